"""What every section of ``gpu.py`` shares: the lines it says (printed, kept for the verdict,
and written to ``--out`` as they come) and a clock synchronised with the device in use."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

LINES: list[str] = []
OUT: list[Path] = []  # --out, written at every line (a run cut short keeps what it measured)


def say(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)
    for path in OUT:
        with path.open("a") as f:
            f.write(line + "\n")


DEVICE = ["cuda"]  # --train-device


def sync() -> None:
    if DEVICE[0] == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], warm: int, reps: int) -> float:
    """Seconds per call: ``warm`` calls, then the mean of ``reps`` (synchronised)."""
    for _ in range(warm):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps
