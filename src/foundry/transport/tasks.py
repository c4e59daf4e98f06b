"""Task hygiene for the asyncio services."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel ``task`` and wait for it to end, swallowing its cancellation and its errors
    but never our own: if the caller is being cancelled (SIGTERM on a worker that is closing a
    connection), that cancellation still propagates, so a stop request is never lost."""
    if task is None or task.done():
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:  # the task's own failure is logged where it happened
        return
