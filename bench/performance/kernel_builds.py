"""Builds of the block kernels against each other in one process: streaming products, and decode.

    python bench/performance/kernel_builds.py NAME=PATH.so [NAME=PATH.so ...] [--rows 600000]
        [--reps 4] [--inputs 1[,4,16]] [--k 1024] [--threads 1] [--path avx2]
        [--core 2] [--types Q8_0,Q4_0,F16] [--huge-pages] [--decode f16,q8_0,q4_0
        [--tokens 48] [--model-dir /tmp]]
    python bench/performance/kernel_builds.py NAME=PATH.so ... --gguf FILE
        --tensors token_embd.weight:131072,blk.0.ffn_gate.weight [--inputs 1,4,16]
    python bench/performance/kernel_builds.py NAME=PATH.so ... --gguf FILE
        --batch 4,8,15 [--steps 8]

Each ``PATH.so`` is a build of ``foundry.model.kernels._kernels`` (e.g. one with
``CFLAGS=-DPREFETCH=0 python setup.py build_ext --inplace --force``, copied aside, or the
build of an older commit). All are loaded into this process and run on the same data,
interleaved, so a busy machine slows them alike:

1. Products: ``--inputs`` float32 input rows (1: decode; 64: a prefill block; a list such as
   ``1,4,16`` runs each in turn) times ``--rows`` x ``--k`` (1,024) weights of each of
   ``--types`` (random Q8_0, Q4_0, Q5_0, Q4_K and Q6_K blocks with normal float16 scales, F16
   from a normal sample), or with ``--gguf`` a file's own ``--tensors`` (``NAME:ROWS`` takes its
   first ROWS rows), best of ``--reps``, on ``--threads`` of each build's pool (default: the
   pool's own count) and its kernel path ``--path`` (default: the best); by default 653 MB of Q8_0,
   more than a 300 MB L3, so the products stream from DRAM. Prints GB/s of stored weights per
   build and type (GMAC/s with more than one input), each build's speed against the first's,
   whether every build gave the same bits, numpy's float32 product of the same shape (its
   2.4 GB at the default rows) for scale, and the build with the least total time.
   ``--huge-pages`` runs each also from a copy in memory advised MADV_HUGEPAGE (fewer TLB
   misses while streaming, where the kernel's transparent huge pages allow it).
2. With ``--prefill``: ms per prompt of ``--prompt`` tokens (512) of the ``bench`` preset
   stored as each type (the files of 3.), each build in turn for ``--rounds`` rounds; medians,
   each build's speed against the first's, and how far its last logits are from the first's.
3. With ``--decode``: ms per decoded token of the ``bench`` preset stored as each type (files
   written by ``save_gguf`` into ``--model-dir`` once, reused), one token per build and type
   after the other for ``--tokens`` tokens after a 64-token prompt, with f32 (numpy) between
   them as the baseline; medians, and each type's ratio to f32 as
   ``bench/performance/engine.py`` gives it.
4. With ``--batch`` and ``--gguf``: ms per decode step of R sessions at once (each R of
   ``--batch``; ``Engine.forward_rows``, one row a session, as a server batches concurrent
   clients) of the file, each build's engine after the other's for ``--steps`` steps after a
   16-token prompt each (the same prompts, greedy tokens); medians, each build's speed against
   the first's, and whether every build chose the same tokens.
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

import gguf
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
    "Q5_0": (6, 32, 22),
    "Q4_K": (12, 256, 144),
    "Q6_K": (14, 256, 210),
    "F16": (1, 1, 2),
}
K = 1024

# A matrix to time: its ggml type code, its rows of stored bytes, its row length.
Matrix = tuple[int, np.ndarray, int]


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("foundry.model.kernels._kernels", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights(t: str, rows: int, rng: np.random.Generator, k: int = K) -> np.ndarray:
    if t == "F16":
        return rng.standard_normal((rows, k), dtype=np.float32).astype(np.float16).view(np.uint8)
    _, values, size = TYPES[t]
    blocks = rng.integers(0, 256, (rows, k // values, size), dtype=np.uint8)
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


def random_matrices(
    types: list[str], rows: int, k: int, huge_pages: bool, rng: np.random.Generator
) -> dict[str, Matrix]:
    w = {t: (TYPES[t][0], weights(t, rows, rng, k), k) for t in types}
    if huge_pages:
        w |= {f"{t}-huge": (c, in_huge_pages(a), kk) for t, (c, a, kk) in w.items()}
    return w


def file_matrices(path: Path, tensors: str) -> dict[str, Matrix]:
    """``NAME[:ROWS]`` of the file's tensors, as stored (the first ROWS rows)."""
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    out: dict[str, Matrix] = {}
    for spec in tensors.split(","):
        name, _, rows = spec.partition(":")
        if name not in by_name:
            raise SystemExit(f"{path}: no tensor {name}")
        t = by_name[name]
        k, n = int(t.shape[0]), int(t.shape[1])
        data = np.ascontiguousarray(np.asarray(t.data).view(np.uint8).reshape(n, -1))
        take = int(rows) if rows else n
        out[f"{name}({t.tensor_type.name} {take}x{k})"] = (int(t.tensor_type), data[:take], k)
    return out


def products(builds: dict[str, ModuleType], w: dict[str, Matrix], reps: int, inputs: int) -> None:
    rng = np.random.default_rng(0)
    kinds = list(w)
    x = {t: rng.standard_normal((inputs, w[t][2]), dtype=np.float32) for t in kinds}
    best = {(b, t): float("inf") for b in builds for t in kinds}
    out: dict[tuple[str, str], np.ndarray] = {}
    for _ in range(reps):
        for b, module in builds.items():
            for t in kinds:
                code, a, k = w[t]
                y = np.empty((inputs, a.shape[0]), np.float32)
                t0 = time.perf_counter()
                module.matmul(code, a, a.shape[0], k, x[t], inputs, y)
                best[b, t] = min(best[b, t], time.perf_counter() - t0)
                out[b, t] = y
    print(f"{inputs} input{'s' if inputs > 1 else ''}:")
    for b in builds:  # a block of inputs in multiply-adds a second, one in weights streamed
        print(
            f"{b}: "
            + ", ".join(
                f"{t} {inputs * w[t][1].shape[0] * w[t][2] / best[b, t] / 1e9:.2f} GMAC/s"
                if inputs > 1
                else f"{t} {w[t][1].nbytes / best[b, t] / 1e9:.1f} GB/s "
                f"({w[t][1].shape[0] * w[t][2] / best[b, t] / 1e9:.2f} GMAC/s)"
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
    print("best", min(builds, key=lambda b: sum(best[b, t] for t in kinds)))


def f32_product(rows: int, reps: int, huge_pages: bool, inputs: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((inputs, K), dtype=np.float32)
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


def bench_engines(types: list[str], folder: Path) -> dict[str, Engine]:
    """The ``bench`` preset stored as each type (files written once into ``folder``)."""
    cfg = preset("bench")
    engines = {}
    params = None
    for t in types:
        path = folder / f"foundry-kernel-builds-bench-{t}.gguf"
        if not path.exists():
            params = params if params is not None else T.init_params(cfg, seed=0)
            save_gguf(path, cfg, params, dtype=t)  # type: ignore[arg-type]
        m = load_gguf_stored(path)
        engines[t] = Engine(m.cfg, m.params)
        del m
    return engines


def prefill(
    builds: dict[str, ModuleType], types: list[str], tokens: int, rounds: int, folder: Path
) -> None:
    """A prompt of ``tokens`` tokens of the bench preset as each type, each build after the
    other, ``rounds`` times; medians, each build's speed against the first's, and how far its
    last row's logits are from the first's."""
    engines = {}
    for b, module in builds.items():  # each build's own engines: a step plan is its module's
        quant._kernels = module
        engines[b] = bench_engines(types, folder)
    prompt = [int(v) for v in np.random.default_rng(2).integers(3, preset("bench").n_vocab, tokens)]
    times: dict[tuple[str, str], list[float]] = {(b, t): [] for b in builds for t in types}
    last: dict[tuple[str, str], np.ndarray] = {}
    for _ in range(rounds):
        for b in builds:
            quant._kernels = builds[b]
            for t in types:
                session = engines[b][t].new_session()
                t0 = time.perf_counter()
                last[b, t] = engines[b][t].decode(session, prompt)[-1].copy()
                times[b, t].append(time.perf_counter() - t0)
    first = next(iter(builds))
    print(f"prefill, bench preset, {tokens} tokens, median of {rounds} rounds:")
    for b in builds:
        for t in types:
            ms = harness.median(times[b, t])
            print(
                f"  {b}: {t:<5} {ms * 1e3:8.1f} ms, {tokens / ms:7.1f} tokens/s, "
                f"{harness.ratio(harness.median(times[first, t]), ms):.3f}x {first}, last "
                f"row's logits at most {np.abs(last[b, t] - last[first, t]).max():.2e} from its"
            )


def decode(builds: dict[str, ModuleType], types: list[str], tokens: int, folder: Path) -> None:
    cfg = preset("bench")
    engines = bench_engines(["f32", *types], folder)
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


def batch(builds: dict[str, ModuleType], path: Path, sizes: list[int], steps: int) -> None:
    engines = {}
    for b, module in builds.items():  # each build's own engine: a step plan is its module's
        quant._kernels = module
        m = load_gguf_stored(path)
        engines[b] = Engine(m.cfg, m.params, ctx_size=16 + steps + 1)
        del m
    first = next(iter(builds))
    vocab = engines[first].cfg.n_vocab
    rng = np.random.default_rng(3)
    print(f"decode steps of R sessions, {path.name}, median of {steps} steps:")
    for r in sizes:
        prompts = [[int(t) for t in rng.integers(3, vocab, 16)] for _ in range(r)]
        sessions, tokens = {}, {}
        times: dict[str, list[float]] = {b: [] for b in builds}
        for b in builds:
            quant._kernels = builds[b]
            sessions[b] = [engines[b].new_session() for _ in range(r)]
            logits = engines[b].forward_rows(
                list(zip(sessions[b], prompts, strict=True)), last_only=True
            )
            tokens[b] = [int(t) for t in np.argmax(logits, axis=1)]
        same = True
        for _ in range(steps):
            for b in builds:
                quant._kernels = builds[b]
                t0 = time.perf_counter()
                logits = engines[b].forward_rows(
                    [(s, [t]) for s, t in zip(sessions[b], tokens[b], strict=True)]
                )
                times[b].append(time.perf_counter() - t0)
                tokens[b] = [int(t) for t in np.argmax(logits, axis=1)]
            same = same and all(tokens[b] == tokens[first] for b in builds)
        for b in builds:
            ms = harness.median(times[b])
            print(
                f"  R {r:2d}: {b}: {ms * 1e3:8.2f} ms a step, {r / ms:7.1f} tokens/s, "
                f"{harness.ratio(harness.median(times[first]), ms):.3f}x {first}"
            )
        print(f"  R {r:2d}: {'the same' if same else 'DIFFERENT'} tokens from every build")


def main() -> None:
    ap = harness.parser(__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="NAME=PATH of each build of the kernels")
    ap.add_argument("--rows", type=int, default=600_000)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--types", default="Q8_0,Q4_0,F16", help=f"of {','.join(TYPES)}")
    ap.add_argument("--inputs", default="1", help="input rows (1: decode), or a list: 1,4,16")
    ap.add_argument("--k", type=int, default=K, help="row length of the random matrices")
    ap.add_argument("--threads", type=int, default=None, help="each build's pool threads")
    ap.add_argument("--path", default=None, help="each build's kernel path (quant._kernels.use)")
    ap.add_argument("--gguf", type=Path, default=None, help="time this file's --tensors")
    ap.add_argument("--tensors", default="", help="NAME[:ROWS],... of the --gguf file")
    ap.add_argument("--core", type=int, default=None, help="pin to this core")
    ap.add_argument("--decode", default=None, help="also decode these types (f16,q8_0,q4_0)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prefill", default=None, help="also a prompt of these types (q8_0,q4_0)")
    ap.add_argument("--prompt", type=int, default=512, help="tokens of the --prefill prompt")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the --prefill prompt")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--batch", default=None, help="decode steps of R sessions of --gguf: 4,8,15")
    ap.add_argument("--steps", type=int, default=8, help="steps of each --batch size")
    ap.add_argument(
        "--huge-pages",
        action="store_true",
        help="also run each product from a copy of its weights in huge pages",
    )
    args = ap.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    builds = {name: load(path) for name, path in (b.split("=", 1) for b in args.builds)}
    for module in builds.values():
        if args.threads is not None:
            module.set_threads(args.threads)
        if args.path is not None:
            module.use(args.path)
    inputs = [int(n) for n in args.inputs.split(",")]
    if args.gguf is not None:
        w = file_matrices(args.gguf, args.tensors) if args.tensors else {}
    elif args.rows > 0:
        w = random_matrices(
            args.types.split(","), args.rows, args.k, args.huge_pages, np.random.default_rng(0)
        )
    else:
        w = {}
    for n in inputs if w else []:
        products(builds, w, args.reps, n)
    if args.gguf is None and args.rows > 0:
        f32_product(args.rows, args.reps, args.huge_pages, inputs[0])
    if args.decode:
        decode(builds, args.decode.split(","), args.tokens, args.model_dir)
    if args.prefill:
        prefill(builds, args.prefill.split(","), args.prompt, args.rounds, args.model_dir)
    if args.batch:
        if args.gguf is None:
            raise SystemExit("--batch needs --gguf")
        batch(builds, args.gguf, [int(r) for r in args.batch.split(",")], args.steps)


if __name__ == "__main__":
    main()
