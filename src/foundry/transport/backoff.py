"""When to dial again after a connection failed: capped exponential backoff with jitter."""

from __future__ import annotations

import random


def backoff_delay(
    attempt: int, *, base_s: float = 0.25, cap_s: float = 10.0, rng: random.Random | None = None
) -> float:
    """Capped exponential backoff with "equal jitter": a delay in [ceiling/2, ceiling].

    Jitter keeps a swarm of workers from reconnecting in lock step after a coordinator restart.
    """
    ceiling = min(cap_s, base_s * (2.0 ** max(attempt, 0)))
    r = rng if rng is not None else random.Random()
    return ceiling * (0.5 + 0.5 * r.random())
