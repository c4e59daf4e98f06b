"""Fixing the BLAS thread count of a running process.

A rank's matmuls must use a known number of BLAS threads: the sums BLAS returns depend on how
the work is split among threads (so the pair is bit-identical to a single process only with
the count fixed), and two ranks sharing a machine must not fight over its cores.

OpenBLAS reads ``OPENBLAS_NUM_THREADS`` once, when the library loads, which happens at the
first ``import numpy``; by the time a subcommand runs, numpy is loaded. So this module finds
the OpenBLAS libraries mapped into the process (``/proc/self/maps``) and calls their
``*_set_num_threads`` entry point through ctypes, which is what threadpoolctl does for the same
purpose, without the dependency. The environment variables are set too, for child processes.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

log = logging.getLogger("foundry.tp")

THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Entry points of the OpenBLAS builds numpy ships: the plain library, and scipy-openblas whose
# symbols carry a prefix and, in its 64-bit-integer build, a suffix.
_SETTERS = (
    "openblas_set_num_threads",
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
)
_GETTERS = (
    "openblas_get_num_threads",
    "scipy_openblas_get_num_threads64_",
    "scipy_openblas_get_num_threads",
)


def _openblas_paths() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in lines if "openblas" in line.lower() and "/" in line}
    return sorted(p for p in paths if p.startswith("/"))


def _entry(lib: ctypes.CDLL, names: tuple[str, ...]) -> Any:
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    return None


def limit_blas_threads(n: int) -> int | None:
    """Make every OpenBLAS in this process use ``n`` threads; the count now in force.

    None when no OpenBLAS is loaded (numpy built against another BLAS): the environment
    variables are still set, and a warning says the count could not be checked.
    """
    if n < 1:
        raise ValueError(f"BLAS threads must be >= 1, got {n}")
    for name in THREAD_ENV:
        os.environ[name] = str(n)
    import numpy  # noqa: F401  (loads the BLAS this function adjusts)

    counts = []
    for path in _openblas_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        setter, getter = _entry(lib, _SETTERS), _entry(lib, _GETTERS)
        if setter is None:
            continue
        setter(ctypes.c_int(n))
        if getter is not None:
            getter.restype = ctypes.c_int
            counts.append(int(getter()))
    if not counts:
        log.warning("no OpenBLAS found in this process; BLAS threads not checked (asked for %d)", n)
        return None
    return min(counts)
