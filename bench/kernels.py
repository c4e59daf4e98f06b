"""The block kernels alone: GB/s of weights each type streams through one matrix-vector product,
against numpy's float32 product, one thread, one run.

    OPENBLAS_NUM_THREADS=1 python bench/kernels.py [--mb 256] [--k 1024] [--path best|avx2|portable]

A (rows, k) weight matrix of about ``--mb`` MB in float32 (a large L3 holds a few hundred MB:
give more to measure streaming from DRAM), stored as each type, multiplied by one float32 row
(decode) and by 8 rows (a prefill block), best of a few repetitions. Also the engine's
overhead: ms per decoded token of the ``small`` preset, whose weights fit in cache, so what it
measures is the Python and numpy work around the products.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import argparse

import numpy as np
from codec import best_of

from foundry.model import quant
from foundry.model import transformer as T
from foundry.model.config import preset
from foundry.model.gguf_io import storage_type
from foundry.model.inference import Engine
from foundry.model.quant import QType

TYPES = (QType.F16, QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.Q4_K, QType.Q6_K)


def stored(w: np.ndarray, qtype: QType) -> quant.QTensor:
    if qtype in (QType.Q4_K, QType.Q6_K):  # the gguf package writes no K-quants: random blocks
        values, size = quant.gguf.GGML_QUANT_SIZES[qtype]
        rows, k = w.shape
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, (rows, k // values, size), np.uint8)
        # normal float16 scales (random bytes would hold subnormals and NaNs, which real files
        # do not, and which cost the float unit a slow path)
        scale = (rng.random((rows, k // values)) * 1e-3 + 1e-4).astype(np.float16)
        scale_bytes = scale.view(np.uint8).reshape(rows, k // values, 2)
        if qtype == QType.Q6_K:
            data[..., 208:210] = scale_bytes  # d is the block's last field
        else:
            data[..., 0:2] = data[..., 2:4] = scale_bytes  # d, dmin
        return quant.QTensor(qtype, w.shape, data.reshape(rows, -1))
    return quant.quantize(w, qtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="float32 size of the matrix, MB")
    ap.add_argument("--k", type=int, default=1024, help="row length")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--path", default="best", choices=["best", "avx2", "portable"],
                    help="kernel path: the best this CPU has, AVX2 without VNNI, portable C")
    args = ap.parse_args()
    if args.path != "best" and quant._kernels is not None:
        quant._kernels.use(args.path)
    rows = args.mb * 1_000_000 // (4 * args.k)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, args.k), dtype=np.float32)
    print(f"kernels: {quant.KERNELS} (path {args.path}); "
          f"matrix {rows} x {args.k}, 1 thread, best of {args.reps}")
    for n in (1, 8):
        x = rng.standard_normal((n, args.k), dtype=np.float32)
        base = best_of(args.reps, lambda x=x, w=w: x @ w.T)
        print(f"  {n} row(s): f32 numpy {w.nbytes / base / 1e9:6.1f} GB/s ({base * 1e3:.2f} ms)")
        for qtype in TYPES:
            q = stored(w, qtype)
            t = best_of(args.reps, lambda x=x, q=q: quant.linear(x, q))
            print(f"  {n} row(s): {qtype.name:<5}     {q.nbytes / t / 1e9:6.1f} GB/s "
                  f"({t * 1e3:.2f} ms, {base / t:.2f}x f32's time)")
    del w
    cfg = preset("small")
    params = T.init_params(cfg, seed=0)
    for dtype in ("f32", "q8_0"):
        held = {n: p if storage_type(dtype, n, p.shape) == QType.F32  # type: ignore[arg-type]
                else quant.quantize(p, storage_type(dtype, n, p.shape))  # type: ignore[arg-type]
                for n, p in params.items()}
        engine = Engine(cfg, held)
        s = engine.new_session()
        engine.decode(s, list(range(3, 19)))
        t = best_of(50, lambda e=engine, s=s: e.decode(s, [5]))
        print(f"engine overhead: small preset ({cfg.n_layer} layers, {len(engine.parts)} parts) "
              f"{dtype}: {t * 1e3:.2f} ms per token")


if __name__ == "__main__":
    main()
