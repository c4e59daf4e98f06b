"""Admission of generations: at most ``max_active`` run on the pair, ``max_waiting`` more wait,
let in round-robin by client (:class:`FairQueue`); past that :class:`QueueFull` at once.

Pure asyncio, no I/O: the OpenAI HTTP routes (``gateway.openai.routes``) admit every
generation through it and answer ``QueueFull`` with a 429.
"""

from __future__ import annotations

import asyncio
import collections


class QueueFull(Exception):
    pass


class FairQueue:
    """At most ``max_active`` holders at a time; up to ``max_waiting`` more wait, and are let
    in round-robin by key (the client's address): each key's waiters in arrival order, the
    keys taking turns. Past ``max_waiting``, :meth:`acquire` raises QueueFull at once."""

    def __init__(self, max_active: int, max_waiting: int) -> None:
        if max_active < 1 or max_waiting < 0:
            raise ValueError(
                f"max_active must be >= 1 and max_waiting >= 0, got {max_active} and {max_waiting}"
            )
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.active = 0
        self.waiting = 0
        self._queues: collections.OrderedDict[str, collections.deque[asyncio.Future[None]]] = (
            collections.OrderedDict()
        )

    async def acquire(self, key: str) -> None:
        if self.active < self.max_active and not self.waiting:
            self.active += 1
            return
        if self.waiting >= self.max_waiting:
            raise QueueFull(
                f"{self.active} requests run and {self.waiting} wait, the most this gateway queues"
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, collections.deque()).append(fut)
        self.waiting += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # let in just as it was cancelled
                self.release()
            else:
                self._forget(key, fut)
            raise

    def release(self) -> None:
        self.active -= 1
        while self.active < self.max_active and self._queues:
            key, queue = next(iter(self._queues.items()))
            fut = queue.popleft()
            self.waiting -= 1
            if queue:
                self._queues.move_to_end(key)  # the next key's turn
            else:
                del self._queues[key]
            if fut.done():  # cancelled, its waiter not yet woken to leave: skip it
                continue
            self.active += 1
            fut.set_result(None)

    def _forget(self, key: str, fut: asyncio.Future[None]) -> None:
        queue = self._queues.get(key)
        if queue is not None and fut in queue:
            queue.remove(fut)
            self.waiting -= 1
            if not queue:
                del self._queues[key]
