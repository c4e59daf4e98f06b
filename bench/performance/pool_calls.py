"""Builds of the kernels' thread pool against each other: the time of one small product at
thread counts below, at and above the machine's cores.

    python bench/performance/pool_calls.py NAME=PATH.so [NAME=PATH.so ...] [--threads 1,2,4,8]
        [--rows 1024] [--calls 2000] [--rounds 5]

Each ``PATH.so`` is a build of ``foundry.model.kernels._kernels`` (the build of an older commit,
copied aside); all are loaded into this process (each with its own pool) and timed in turn,
round by round, on one Q8_0 product of ``--rows`` x 1,024 weights and one input: a decode
step's product, a few microseconds of work a thread, where a pool call's own cost shows. Every
product is split over the pool (``split_below(0)``). Prints the median microseconds a product
per build and thread count, and each build's ratio to the first (above 1: faster). With more
threads than cores, a pool that waits for every thread at every call waits for the ones the
scheduler has not run yet.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
from kernel_builds import TYPES, K, load, weights


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+", help="NAME=PATH of each build of the kernels")
    ap.add_argument("--threads", default="1,2,4,8", help="thread counts (default 1,2,4,8)")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=2000, help="products a round (default 2000)")
    ap.add_argument("--rounds", type=int, default=5)
    harness.add_json_flag(ap)
    args = ap.parse_args()
    builds = {}
    for spec in args.builds:
        name, _, path = spec.partition("=")
        builds[name] = load(path)
        builds[name].split_below(0)
    code = TYPES["Q8_0"][0]
    rng = np.random.default_rng(0)
    w = weights("Q8_0", args.rows, rng)
    x = rng.standard_normal((1, K), dtype=np.float32)
    counts = [int(t) for t in args.threads.split(",")]
    print(
        f"one Q8_0 product of {args.rows} x {K} weights, one input; median us a product of "
        f"{args.rounds} rounds of {args.calls}; {os.cpu_count()} cores here"
    )
    print(
        " threads"
        + "".join(f" {n:>12s}" for n in builds)
        + "".join(f" {n + '/' + next(iter(builds)):>14s}" for n in list(builds)[1:])
    )
    results: dict[str, object] = {"rows": args.rows, "cores": os.cpu_count()}
    same = True
    for threads in counts:
        times: dict[str, list[float]] = {n: [] for n in builds}
        outs: dict[str, np.ndarray] = {}
        for _ in range(args.rounds):
            for name, kernels in builds.items():
                kernels.set_threads(threads)
                y = np.empty((1, args.rows), np.float32)
                for _ in range(50):  # the workers started and spinning
                    kernels.matmul(code, w, args.rows, K, x, 1, y)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    kernels.matmul(code, w, args.rows, K, x, 1, y)
                times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
                kernels.set_threads(1)  # its workers stopped while the next build runs
                outs[name] = y
        first = next(iter(builds))
        same = same and all(np.array_equal(outs[first], o) for o in outs.values())
        us = {n: harness.median(t) for n, t in times.items()}
        print(
            f" {threads:7d}"
            + "".join(f" {us[n]:12.1f}" for n in builds)
            + "".join(f" {us[first] / us[n]:13.2f}x" for n in list(builds)[1:])
        )
        results[f"threads_{threads}_us"] = us
    print("the same bits from every build" if same else "BUILDS GAVE DIFFERENT BITS")
    harness.emit("pool_calls", results, same, args.json)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
