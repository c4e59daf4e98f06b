"""The products of a step of R sessions, one call at a time: each matrix shape that rank 0 of
the Gemma 3 270M pair holds, multiplied by R inputs, for builds of the kernels against each
other, each build in a process of its own, in turns.

    OPENBLAS_NUM_THREADS=1 python bench/performance/rows_products.py NAME=PATH.so [NAME=PATH.so
        ...] [--paths avx512-vnni+amx,avx512-vnni] [--threads 8] [--rows 16] [--rounds 2]
        [--json PATH]

Each ``PATH.so`` is a build of ``foundry.model.kernels._kernels`` (the build of the commit
before a change, copied aside, against the tree's). A build's pool spins between calls, so two
builds in one process slow each other: every build runs in a child process of its own, one
after the other, ``--rounds`` times. A child times ``matmul`` of random blocks of each type
(kernel_builds.weights) in the shapes of the pair's rank 0 of the Gemma file (the output head's
half, 131,072 x 640 Q8_0; per layer Q, K and V, 512, 256 and 256 x 640; the attention's
output, 640 x 512 Q4_K; gate and up stacked, 2,048 x 640 Q5_0; down, 640 x 1,024 Q4_K and
Q6_K) against ``--rows`` inputs on ``--threads`` threads of kernel path each of ``--paths``:
the median of 300 calls (the head 20). Prints microseconds a call and GMAC/s for every build,
path and shape, each build's speed against the first's in the same round (above 1: faster),
and whether every build gave the same bits (a digest of each product's outputs).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
from kernel_builds import TYPES, load, weights

# (name, type, rows, k): rank 0 of two of the Gemma 3 270M file
SHAPES = [
    ("head", "Q8_0", 131072, 640),
    ("gate_up", "Q5_0", 2048, 640),
    ("q", "Q5_0", 512, 640),
    ("k", "Q5_0", 256, 640),
    ("v", "Q8_0", 256, 640),
    ("attn_output", "Q4_K", 640, 512),
    ("down Q4_K", "Q4_K", 640, 1024),
    ("down Q6_K", "Q6_K", 640, 1024),
]


def child(path: str, paths: list[str], threads: int, rows: int) -> None:
    """One build: {path: {shape: [seconds a call, the outputs' digest]}} as one JSON line."""
    module = load(path)
    module.set_threads(threads)
    out: dict[str, dict[str, list[float | str]]] = {}
    for kernel_path in paths:
        module.use(kernel_path)
        rng = np.random.default_rng(0)
        out[kernel_path] = {}
        for name, t, n_out, k in SHAPES:
            w = weights(t, n_out, rng, k)
            x = rng.standard_normal((rows, k), dtype=np.float32)
            y = np.empty((rows, n_out), np.float32)
            times = []
            for _ in range(20 if name == "head" else 300):
                t0 = time.perf_counter()
                module.matmul(TYPES[t][0], w, n_out, k, x, rows, y)
                times.append(time.perf_counter() - t0)
            digest = hashlib.sha256(y.tobytes()).hexdigest()[:16]
            out[kernel_path][name] = [float(np.median(times)), digest]
    print(json.dumps(out))


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="*", help="NAME=PATH of each build of the kernels")
    ap.add_argument("--paths", default="best", help="kernel paths, comma-separated")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16, help="inputs a product (sessions a step)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    harness.add_json_flag(ap)
    args = ap.parse_args()
    paths = args.paths.split(",")
    if args.child is not None:
        child(args.child, paths, args.threads, args.rows)
        return 0
    if not args.builds:
        ap.error("give at least one NAME=PATH build")
    builds = dict(spec.partition("=")[::2] for spec in args.builds)
    rounds: list[dict[str, dict[str, dict[str, list[Any]]]]] = []
    for r in range(args.rounds):
        got = {}
        for name, path in builds.items():
            cmd = [sys.executable, __file__, "--child", path, "--paths", args.paths]
            cmd += ["--threads", str(args.threads), "--rows", str(args.rows)]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got[name] = json.loads(line.strip().splitlines()[-1])
        rounds.append(got)
        first = next(iter(builds))
        for kernel_path in paths:
            print(f"round {r + 1}, {args.rows} inputs, {args.threads} threads, {kernel_path}:")
            for shape, t, n_out, k in SHAPES:
                macs = args.rows * n_out * k
                cells = []
                for name in builds:
                    s = float(got[name][kernel_path][shape][0])
                    cells.append(f"{name} {s * 1e6:8.1f} us ({macs / s / 1e9:6.1f} GMAC/s)")
                    if name != first:
                        base = float(got[first][kernel_path][shape][0])
                        cells[-1] += f" {harness.ratio(base, s):.2f}x"
                print(f"  {shape:12s} {t} {n_out}x{k}: " + "  ".join(cells))
    same = all(
        got[name][p][shape][1] == got[next(iter(builds))][p][shape][1]
        for got in rounds
        for name in builds
        for p in paths
        for shape, *_ in SHAPES
    )
    print("the same outputs from every build" if same else "builds give different outputs")
    harness.emit(
        "rows_products",
        {"rows": args.rows, "threads": args.threads, "paths": paths, "rounds": rounds},
        passed=same,
        path=args.json,
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
