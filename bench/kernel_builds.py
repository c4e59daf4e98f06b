"""Builds of the block kernels against each other, streaming weights from memory, one process.

    python bench/kernel_builds.py NAME=PATH.so [NAME=PATH.so ...] [--rows 600000] [--reps 4]
        [--core 2]

Each ``PATH.so`` is a build of ``foundry.model._kernels`` (e.g. one with
``CFLAGS=-DPREFETCH=0 python setup.py build_ext --inplace --force``, copied aside). All are
loaded into this process and multiply the same weights, one float32 input row, interleaved, best
of ``--reps``: Q8_0 and Q4_0 matrices of ``--rows`` x 1,024 random blocks (with a normal float16
scale), by default 653 MB and 346 MB, more than a 300 MB L3, so the products stream from DRAM.
Prints GB/s of stored weights per build and type, and the build with the least total time.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from types import ModuleType

import numpy as np

TYPES = {"Q8_0": (8, 34), "Q4_0": (2, 18)}  # ggml type code, bytes per block of 32
K = 1024


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("foundry.model._kernels", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="NAME=PATH of each build of the kernels")
    ap.add_argument("--rows", type=int, default=600_000)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--core", type=int, default=None, help="pin to this core")
    args = ap.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    builds = {name: load(path) for name, path in (b.split("=", 1) for b in args.builds)}
    rng = np.random.default_rng(0)
    weights = {}
    for t, (_, size) in TYPES.items():
        blocks = rng.integers(0, 256, (args.rows, K // 32, size), dtype=np.uint8)
        blocks[..., 0:2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)  # the scale
        weights[t] = blocks.reshape(args.rows, -1)
    x = rng.standard_normal((1, K), dtype=np.float32)
    y = np.empty((1, args.rows), np.float32)
    best = {(b, t): float("inf") for b in builds for t in TYPES}
    for _ in range(args.reps):
        for b, module in builds.items():
            for t, (code, _) in TYPES.items():
                t0 = time.perf_counter()
                module.matmul(code, weights[t], args.rows, K, x, 1, y)
                best[b, t] = min(best[b, t], time.perf_counter() - t0)
    for b in builds:
        print(f"{b}: " + ", ".join(f"{t} {weights[t].nbytes / best[b, t] / 1e9:.1f} GB/s"
                                   for t in TYPES))
    print("best", min(builds, key=lambda b: sum(best[b, t] for t in TYPES)))


if __name__ == "__main__":
    main()
