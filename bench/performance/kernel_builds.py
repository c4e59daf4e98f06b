"""Builds of the block kernels against each other in one process: streaming products, and decode.

    python bench/performance/kernel_builds.py NAME=PATH.so [NAME=PATH.so ...] [--rows 600000]
        [--reps 4] [--inputs 1]
        [--core 2] [--types Q8_0,Q4_0,F16] [--huge-pages] [--decode f16,q8_0,q4_0
        [--tokens 48] [--model-dir /tmp]]

Each ``PATH.so`` is a build of ``foundry.model.kernels._kernels`` (e.g. one with
``CFLAGS=-DPREFETCH=0 python setup.py build_ext --inplace --force``, copied aside, or the
build of an older commit). All are loaded into this process and run on the same data,
interleaved, so a busy machine slows them alike:

1. Products: ``--inputs`` float32 input rows (1: decode; 64: a prefill block) times ``--rows``
   x 1,024 weights of each of ``--types`` (random Q8_0, Q4_0, Q4_K and Q6_K blocks with normal
   float16 scales, F16 from a normal sample), best of ``--reps``; by default 653 MB of Q8_0,
   more than a 300 MB L3, so the products stream from DRAM. Prints GB/s of stored weights per
   build and type (GMAC/s with more than one input), each build's speed against the first's,
   whether every build gave the same bits, numpy's float32 product of the same shape (its
   2.4 GB at the default rows) for scale, and the build with the least total time.
   ``--huge-pages`` runs each also from a copy in memory advised MADV_HUGEPAGE (fewer TLB
   misses while streaming, where the kernel's transparent huge pages allow it).
2. With ``--decode``: ms per decoded token of the ``bench`` preset stored as each type (files
   written by ``save_gguf`` into ``--model-dir`` once, reused), one token per build and type
   after the other for ``--tokens`` tokens after a 64-token prompt, with f32 (numpy) between
   them as the baseline; medians, and each type's ratio to f32 as
   ``bench/performance/engine.py`` gives it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import importlib.util
import mmap
import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np

from foundry.model.formats.gguf_io import load_gguf_stored, save_gguf
from foundry.model.infer.inference import Engine
from foundry.model.kernels import quant
from foundry.model.nn import transformer as T
from foundry.model.spec.config import preset

# ggml type code, values and bytes per block
TYPES = {
    "Q8_0": (8, 32, 34),
    "Q4_0": (2, 32, 18),
    "Q4_K": (12, 256, 144),
    "Q6_K": (14, 256, 210),
    "F16": (1, 1, 2),
}
K = 1024


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("foundry.model.kernels._kernels", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights(t: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    if t == "F16":
        return rng.standard_normal((rows, K), dtype=np.float32).astype(np.float16).view(np.uint8)
    _, values, size = TYPES[t]
    blocks = rng.integers(0, 256, (rows, K // values, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)  # normal: no subnormal, no NaN
    if t == "Q6_K":
        blocks[..., 208:210] = scale  # d is the block's last field
    else:
        blocks[..., 0:2] = scale  # d (and Q4_K's dmin after it)
        if t == "Q4_K":
            blocks[..., 2:4] = scale
    return blocks.reshape(rows, -1)


HUGE_PAGE = 2 << 20


def in_huge_pages(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` in anonymous memory advised MADV_HUGEPAGE (transparent huge pages where
    the kernel's setting is ``madvise`` or ``always``), aligned to 2 MiB."""
    buf = mmap.mmap(-1, a.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(buf, np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    out = whole[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def products(
    builds: dict[str, ModuleType],
    types: list[str],
    rows: int,
    reps: int,
    huge_pages: bool,
    inputs: int,
) -> None:
    rng = np.random.default_rng(0)
    w = {t: weights(t, rows, rng) for t in types}
    if huge_pages:
        w |= {f"{t}-huge": in_huge_pages(w[t]) for t in types}
    kinds = list(w)
    x = rng.standard_normal((inputs, K), dtype=np.float32)
    y = np.empty((inputs, rows), np.float32)
    best = {(b, t): float("inf") for b in builds for t in kinds}
    out: dict[tuple[str, str], np.ndarray] = {}
    for _ in range(reps):
        for b, module in builds.items():
            for t in kinds:
                t0 = time.perf_counter()
                module.matmul(TYPES[t.split("-")[0]][0], w[t], rows, K, x, inputs, y)
                best[b, t] = min(best[b, t], time.perf_counter() - t0)
                out[b, t] = y.copy()
    for b in builds:  # a block of inputs in multiply-adds a second, one in weights streamed
        print(
            f"{b}: "
            + ", ".join(
                f"{t} {inputs * rows * K / best[b, t] / 1e9:.2f} GMAC/s"
                if inputs > 1
                else f"{t} {w[t].nbytes / best[b, t] / 1e9:.1f} GB/s"
                for t in kinds
            )
        )
    first = next(iter(builds))
    for b in list(builds)[1:]:  # its speed against the first build's (above 1: faster)
        print(
            f"{b} against {first}: "
            + ", ".join(f"{t} {harness.ratio(best[first, t], best[b, t]):.3f}x" for t in kinds)
        )
    differ = [t for t in kinds if any(not np.array_equal(out[b, t], out[first, t]) for b in builds)]
    print(
        "the same bits from every build"
        if not differ
        else f"builds give different bits for {', '.join(differ)}"
    )
    del w
    f32 = {"f32": rng.standard_normal((rows, K), dtype=np.float32)}
    if huge_pages:
        f32["f32-huge"] = in_huge_pages(f32["f32"])
    for name, a in f32.items():
        base = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            x @ a.T
            base = min(base, time.perf_counter() - t0)
        print(f"{name} numpy: {a.nbytes / base / 1e9:.1f} GB/s")
    print("best", min(builds, key=lambda b: sum(best[b, t] for t in kinds)))


def decode(builds: dict[str, ModuleType], types: list[str], tokens: int, folder: Path) -> None:
    cfg = preset("bench")
    engines = {}
    params = None
    for t in ["f32", *types]:
        path = folder / f"foundry-kernel-builds-bench-{t}.gguf"
        if not path.exists():
            params = params if params is not None else T.init_params(cfg, seed=0)
            save_gguf(path, cfg, params, dtype=t)  # type: ignore[arg-type]
        m = load_gguf_stored(path)
        engines[t] = Engine(m.cfg, m.params)
        del m
    runs = [("", "f32")] + [(b, t) for b in builds for t in types]
    prompt = [int(v) for v in np.random.default_rng(1).integers(3, cfg.n_vocab, 64)]
    sessions, last = {}, {}
    times: dict[tuple[str, str], list[float]] = {r: [] for r in runs}
    for b, t in runs:
        if b:
            quant._kernels = builds[b]
        sessions[b, t] = engines[t].new_session()
        last[b, t] = int(np.argmax(engines[t].decode(sessions[b, t], prompt)[-1]))
    for _ in range(tokens):
        for b, t in runs:
            if b:
                quant._kernels = builds[b]
            t0 = time.perf_counter()
            logits = engines[t].decode(sessions[b, t], [last[b, t]])
            times[b, t].append(time.perf_counter() - t0)
            last[b, t] = int(np.argmax(logits[-1]))
    base = harness.median(times["", "f32"])
    print(f"decode, bench preset, median of {tokens} tokens: f32 {base * 1e3:.2f} ms/token")
    for b, t in runs[1:]:
        ms = harness.median(times[b, t])
        print(f"  {b}: {t:<5} {ms * 1e3:7.2f} ms/token, {harness.ratio(base, ms):.2f}x f32")


def main() -> None:
    ap = harness.parser(__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="NAME=PATH of each build of the kernels")
    ap.add_argument("--rows", type=int, default=600_000)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--types", default="Q8_0,Q4_0,F16", help=f"of {','.join(TYPES)}")
    ap.add_argument("--inputs", type=int, default=1, help="input rows (1: decode)")
    ap.add_argument("--core", type=int, default=None, help="pin to this core")
    ap.add_argument("--decode", default=None, help="also decode these types (f16,q8_0,q4_0)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp"))
    ap.add_argument(
        "--huge-pages",
        action="store_true",
        help="also run each product from a copy of its weights in huge pages",
    )
    args = ap.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    builds = {name: load(path) for name, path in (b.split("=", 1) for b in args.builds)}
    if args.rows > 0:
        products(builds, args.types.split(","), args.rows, args.reps, args.huge_pages, args.inputs)
    if args.decode:
        decode(builds, args.decode.split(","), args.tokens, args.model_dir)


if __name__ == "__main__":
    main()
