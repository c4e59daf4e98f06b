"""What every script of bench/ shares: timing rounds, the median, the ratio against a baseline
measured in the same run, the machine's fingerprint, and one JSON row per run.

A script imports it after putting bench/ on its path (the scripts live one folder down, by
purpose)::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import harness

and, where it keeps its results, takes ``--json PATH`` from :func:`add_json_flag`: the run's
row (:func:`row`) is printed as the last line of its output and, with the flag, also written to
PATH. The row's keys, the same for every script:

- ``bench``: the script's name (``engine``, ``tp``, ...);
- ``schema``: :data:`SCHEMA`, raised when a key changes meaning;
- ``when``: the UTC time the row was made (ISO 8601);
- ``argv``: the script's arguments, so the row says which command printed it;
- ``machine``: :func:`fingerprint`;
- ``results``: the script's own figures (its keys are the script's to document);
- ``pass``: whether the script's checks passed (null where it has none).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = 1
# The cores this process may use when the script started (before any pinning of its own).
USABLE_CORES = (
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
)


def parser(doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """The script's parser: its docstring's first paragraph as the description, and no flag
    taken by a prefix of it (``--step`` is an error, not ``--steps``)."""
    kwargs.setdefault("description", (doc or "").split("\n\n")[0])
    return argparse.ArgumentParser(allow_abbrev=False, **kwargs)


def add_json_flag(ap: argparse.ArgumentParser) -> None:
    """``--json PATH``: also write the run's row (this module's schema) to PATH."""
    ap.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the run's JSON row (bench/harness.py's schema) to PATH",
    )


# ---------------------------------------------------------------------------- timing


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rounds(n: int, fn: Callable[[], object]) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn``, in order."""
    return [timed(fn) for _ in range(n)]


def best_of(n: int, fn: Callable[[], object]) -> float:
    """The fastest of ``n`` calls of ``fn``, in seconds: the figure least disturbed by others
    on the machine, for a kernel measured alone."""
    return min(rounds(n, fn))


def median(values: Iterable[float]) -> float:
    """The median, as a float (the figure of a run of rounds)."""
    return float(statistics.median(list(values)))


def ratio(ours: float, baseline: float) -> float:
    """``ours`` against the baseline measured in the same run (above 1: ours is larger); nan
    for a baseline of 0."""
    return ours / baseline if baseline else float("nan")


def median_ratio(ours: Sequence[float], baseline: Sequence[float]) -> float:
    """The median of the per-round ratios of two interleaved series: a slow moment of the
    machine slows both sides of its round, so this is steadier than the ratio of medians."""
    return median(ratio(a, b) for a, b in zip(ours, baseline, strict=True))


def spread(values: Sequence[float]) -> float:
    """How far the slowest round is above the fastest, as a fraction of the median: the
    noise a difference must exceed to mean something."""
    return (max(values) - min(values)) / median(values) if values else float("nan")


# ---------------------------------------------------------------------------- the machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str:
    try:
        got = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return got.stdout.strip()


def _commit() -> str | None:
    """The checkout's commit, ``+dirty`` when its tracked files differ from it (None outside
    a git checkout, e.g. a copy sent to another machine)."""
    commit = _git("rev-parse", "--short", "HEAD")
    if not commit:
        return None
    return commit + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def fingerprint() -> dict[str, Any]:
    """What a figure depends on besides the code: the CPU, the cores the script could use when
    it started, the BLAS thread setting, the Python and numpy versions, the commit."""
    import numpy as np

    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "host": platform.node(),
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": USABLE_CORES,
        "load_1m": load,
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "commit": _commit(),
    }


# ---------------------------------------------------------------------------- the row


def row(bench: str, results: dict[str, Any], passed: bool | None = None) -> dict[str, Any]:
    """The run's JSON row (the module docstring lists its keys)."""
    return {
        "bench": bench,
        "schema": SCHEMA,
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "machine": fingerprint(),
        "results": results,
        "pass": passed,
    }


def emit(
    bench: str, results: dict[str, Any], passed: bool | None = None, path: Path | None = None
) -> dict[str, Any]:
    """Print the run's row as one JSON line and, given ``path`` (``--json``), write it there."""
    line = json.dumps(row(bench, results, passed), default=str)
    print(line, flush=True)
    if path is not None:
        path.write_text(line + "\n")
    return json.loads(line)  # type: ignore[no-any-return]
