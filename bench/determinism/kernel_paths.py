"""Every kernel path this CPU has gives the portable C's bits: the products of the kernels'
tests' shapes on each path (AMX, AVX-512 VNNI, AVX2, ...) and thread count, on this machine.

    python bench/determinism/kernel_paths.py [--threads 1,8]

CI's machines lack some of the paths (AMX above all), so the tests there compare only the paths
they have; this runs the same comparison where the others are. For Q8_0, Q5_0 and Q4_0 at
k = 736 (23 blocks of 32) and 640 (Gemma 3's width), Q4_K and Q6_K at 768 (3 super-blocks)
and Q4_K at 1,024; 5, 16, 17, 33 and 100 rows (the last rows alone, one AMX tile of 16 rows,
tiles and rows left over); 1 to 47 and 75 inputs (whole groups of 16 and every part group
after them): each product on every path ``quant.KERNELS`` and the ones below it allow, at each
of ``--threads`` (every product split over the pool), against the portable C at one thread.
Prints the comparisons and those that differ; exit status 1 when one does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "performance"))

import harness
import numpy as np
from kernel_builds import TYPES, weights

from foundry.model.kernels import quant

# Each path and the ones below it (quant._kernels.use accepts each where the CPU has it).
BELOW = {
    "avx512-vnni+amx": ["avx512-vnni+amx", "avx512-vnni", "avx2+vnni", "avx2"],
    "avx512-vnni": ["avx512-vnni", "avx2+vnni", "avx2"],
    "avx2+vnni": ["avx2+vnni", "avx2"],
    "avx2": ["avx2"],
}
SHAPES = [("Q8_0", 736), ("Q5_0", 736), ("Q4_0", 736), ("Q8_0", 640), ("Q5_0", 640)]
SHAPES += [("Q4_K", 768), ("Q6_K", 768), ("Q4_K", 1024)]
INPUTS = [16 * whole + part for whole in range(3) for part in range(1, 16)] + [16, 32, 75]


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,8", help="thread counts (default 1,8)")
    harness.add_json_flag(ap)
    args = ap.parse_args()
    kernels = quant._kernels
    if kernels is None:
        raise SystemExit("the C kernels are not built: python setup.py build_ext --inplace")
    paths = [*BELOW.get(quant.KERNELS, []), "portable"]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"kernels {quant.KERNELS}: paths {', '.join(paths)}; threads {args.threads}")
    differ: list[str] = []
    compared = 0
    try:
        kernels.split_below(0)
        for t, k in SHAPES:
            for rows in (5, 16, 17, 33, 100):
                rng = np.random.default_rng(rows)
                w = weights(t, rows, rng, k)
                x = rng.standard_normal((max(INPUTS), k), dtype=np.float32)
                kernels.use("portable")
                kernels.set_threads(1)
                want = products(kernels, TYPES[t][0], w, rows, k, x)
                for path in paths:
                    kernels.use(path)
                    for n in threads:
                        kernels.set_threads(n)
                        compared += 1
                        if not np.array_equal(products(kernels, TYPES[t][0], w, rows, k, x), want):
                            differ.append(f"{t} {rows}x{k} on {path} at {n} threads")
    finally:
        kernels.use("best")
        kernels.split_below(64 * 1024)
    for d in differ:
        print("DIFFERS:", d)
    print(f"{compared} products of every input count compared, {len(differ)} differ")
    harness.emit(
        "kernel_paths",
        {"kernels": quant.KERNELS, "paths": paths, "compared": compared, "differ": differ},
        passed=not differ,
        path=args.json,
    )
    return 1 if differ else 0


def products(kernels: object, code: int, w: np.ndarray, rows: int, k: int, x: np.ndarray) -> bytes:
    """Every input count's product, their bytes one after the other."""
    out = []
    for n in INPUTS:
        y = np.empty((n, rows), np.float32)
        kernels.matmul(code, w, rows, k, x[:n], n, y)  # type: ignore[attr-defined]
        out.append(y.tobytes())
    return b"".join(out)


if __name__ == "__main__":
    sys.exit(main())
