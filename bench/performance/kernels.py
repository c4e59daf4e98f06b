"""The block kernels alone: GB/s of weights each type streams through one matrix-vector product,
against numpy's float32 product, one thread, one run.

    OPENBLAS_NUM_THREADS=1 python bench/performance/kernels.py [--mb 256] [--k 1024]
        [--rows R] [--block 64] [--types Q4_K,Q6_K] [--threads 1] [--path best|avx2|portable]
        [--against avx512-vnni]
    OPENBLAS_NUM_THREADS=1 python bench/performance/kernels.py --gguf FILE [--llama-cpp BUILD/bin]
        [--rounds 3] [--prompt 512] [--cores 1]

A (rows, k) weight matrix of about ``--mb`` MB in float32 (a large L3 holds a few hundred MB:
give more to measure streaming from DRAM), stored as each type, multiplied by one float32 row
(decode) and by ``--block`` rows (64: a prefill block; GMAC/s: multiply-adds a second), best of
a few repetitions; ``--rows`` gives the matrix's rows exactly (a model's shape: ``--rows 8192
--k 3072 --block 512`` is Llama 3.2 3B's FFN up against a 512-token prompt), ``--types`` only
those types, ``--threads`` the kernels' threads (numpy's product stays on one), ``--against``
each product also on that path (kernel paths: ``quant._kernels.use``), its time over ours. Also the
engine's overhead: ms per decoded token of the ``small`` preset, whose weights fit in cache, so
what it measures is the Python and numpy work around the products.

``--gguf FILE`` times the products of a published file's own tensors (every 2-d weight of every
layer, and the output head: ``output.weight``, else the tied ``token_embd.weight``), the way a
decoded token and a prompt of ``--prompt`` tokens run them: each tensor against one row, and
each layer tensor against ``--prompt`` rows (the head against one, as llama.cpp computes only
the last row's logits in a prompt). With ``--llama-cpp``, ``llama-bench -t 1 -p PROMPT`` and
``-n 64`` (at depth 0) run on the same file between the rounds, and each round prints the
ratios of llama.cpp's whole token and whole prompt to our products alone (what the engine
around them adds is not in it: an upper bound of the engine's ratio), and each type's GB/s
in the decode products. Targets (issue 26): decode >= 1.0x llama.cpp, prompt >= 0.5x.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf
import harness
import numpy as np
from harness import best_of

from foundry.model.formats.gguf_model import storage_type
from foundry.model.infer.inference import Engine
from foundry.model.kernels import quant
from foundry.model.kernels.quant import QType
from foundry.model.nn import transformer as T
from foundry.model.spec.config import preset

TYPES = (
    QType.F16,
    QType.Q8_0,
    QType.Q4_0,
    QType.Q5_0,
    QType.Q4_1,
    QType.Q5_1,
    QType.Q4_K,
    QType.Q6_K,
)


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


def file_weights(path: Path) -> tuple[list[tuple[str, quant.QTensor]], tuple[str, quant.QTensor]]:
    """The 2-d block weights of every layer of a GGUF file (memory-mapped, as stored) and its
    output head (``output.weight``, else the tied ``token_embd.weight``)."""
    reader = gguf.GGUFReader(path)
    layers, head = [], {}
    for t in reader.tensors:
        qtype = QType(int(t.tensor_type))
        if qtype == QType.F32 or len(t.shape) != 2:
            continue  # norms: not products
        w = quant.from_stored(qtype, t.data)
        assert isinstance(w, quant.QTensor)
        if t.name.startswith("blk."):
            layers.append((t.name, w))
        elif t.name in ("output.weight", "token_embd.weight"):
            head[t.name] = w
    name = "output.weight" if "output.weight" in head else "token_embd.weight"
    return layers, (name, head[name])


def llama_bench_prompt_and_decode(
    llama_cpp: Path,
    path: Path,
    prompt: int,
    cores: str | None,
    depth: int = 0,
    threads: int = 1,
    extra: tuple[str, ...] = (),
) -> tuple[float, float]:
    """llama.cpp's tokens/s of a ``prompt``-token prompt and of 64 tokens decoded after
    ``depth`` tokens of context (``-d``: the attention the decoded tokens pay), on
    ``threads`` threads (``-t``)."""
    pin = ["taskset", "-c", cores] if cores else []
    base = [
        *pin,
        str(llama_cpp / "llama-bench"),
        "-m",
        str(path),
        "-t",
        str(threads),
        "-r",
        "1",
        *extra,
        "-o",
        "json",
    ]
    runs = [["-p", str(prompt), "-n", "0"], ["-p", "0", "-n", "64", "-d", str(depth)]]
    rows = [
        row
        for args in runs
        for row in json.loads(
            subprocess.run([*base, *args], check=True, capture_output=True, text=True).stdout
        )
    ]
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == 64)
    return float(pp), float(tg)


def bench_file(
    path: Path, llama_cpp: Path | None, rounds: int, prompt: int, cores: str | None
) -> bool:
    """Our products of a file's tensors against llama.cpp's whole token and prompt (module
    docstring), ``rounds`` interleaved rounds; True when the medians meet the targets."""
    layers, (head_name, head) = file_weights(path)
    rng = np.random.default_rng(0)
    by_type: dict[str, int] = defaultdict(int)
    for _, w in [*layers, (head_name, head)]:
        by_type[w.qtype.name] += w.nbytes
    print(
        f"{path.name}: {len(layers)} layer tensors and the head ({head_name}, "
        f"{head.qtype.name}); kernels {quant.KERNELS}, 1 thread; bytes per type: "
        + ", ".join(f"{t} {b / 1e6:.1f} MB" for t, b in sorted(by_type.items()))
    )
    inputs = {
        w.shape[1]: rng.standard_normal((prompt, w.shape[1]), dtype=np.float32)
        for _, w in [*layers, (head_name, head)]
    }
    ratios: dict[str, list[float]] = {"decode": [], "prompt": []}
    for r in range(rounds):
        per_type: dict[str, float] = defaultdict(float)
        for _, w in [*layers, (head_name, head)]:  # decode: each tensor once, best of 5
            x = inputs[w.shape[1]][:1]
            per_type[w.qtype.name] += best_of(5, lambda x=x, w=w: quant.linear(x, w))
        decode = sum(per_type.values())
        t0 = time.perf_counter()  # the prompt: every layer tensor against all its rows, once
        for _, w in layers:
            quant.linear(inputs[w.shape[1]], w)
        quant.linear(inputs[head.shape[1]][:1], head)
        prefill = time.perf_counter() - t0
        line = (
            f"  round {r + 1}: products of a token {decode * 1e3:7.2f} ms, of a "
            f"{prompt}-token prompt {prefill:6.2f} s ({prompt / prefill:6.1f} tokens/s); GB/s "
            + ", ".join(f"{t} {by_type[t] / s / 1e9:.1f}" for t, s in sorted(per_type.items()))
        )
        if llama_cpp is not None:
            pp, tg = llama_bench_prompt_and_decode(llama_cpp, path, prompt, cores)
            ratios["decode"].append((1 / tg) / decode)
            ratios["prompt"].append((prompt / pp) / prefill)
            line += (
                f"\n           llama.cpp {tg:6.2f} tokens/s decode ({1e3 / tg:7.2f} ms, "
                f"{sum(by_type.values()) * tg / 1e9:.1f} GB/s of these tensors), {pp:6.1f} "
                f"tokens/s prompt: ratio {ratios['decode'][-1]:.2f}x decode, "
                f"{ratios['prompt'][-1]:.2f}x prompt"
            )
        print(line, flush=True)
    if llama_cpp is None:
        return True
    dec, pre = harness.median(ratios["decode"]), harness.median(ratios["prompt"])
    ok = dec >= 1.0 and pre >= 0.5
    print(
        f"  median over {rounds} rounds, our products against llama.cpp's whole run: decode "
        f"{dec:.2f}x (target >= 1.0x), prompt {pre:.2f}x (target >= 0.5x): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return ok


def main() -> None:
    ap = harness.parser(__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="float32 size of the matrix, MB")
    ap.add_argument("--k", type=int, default=1024, help="row length")
    ap.add_argument("--rows", type=int, default=None, help="rows of the matrix (default: --mb)")
    ap.add_argument("--block", type=int, default=64, help="inputs of the prefill block")
    ap.add_argument("--types", default=None, help="only these types, e.g. Q4_K,Q6_K")
    ap.add_argument("--threads", type=int, default=1, help="the kernels' threads")
    ap.add_argument("--reps", type=int, default=5)
    paths = ["best", "avx512-vnni+amx", "avx512-vnni", "avx2+vnni", "avx2", "portable"]
    ap.add_argument(
        "--path",
        default="best",
        choices=paths,
        help="kernel path: the best this CPU has, AVX-512 VNNI with or without AMX, AVX2 with "
        "or without VNNI, portable C",
    )
    ap.add_argument("--against", default=None, choices=paths, help="also time this path")
    ap.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="time the products of this file's tensors instead (docstring)",
    )
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        default=None,
        help="llama.cpp build folder with llama-bench (with --gguf)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds with --gguf (default 3)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens with --gguf")
    ap.add_argument(
        "--cores", default=None, help="pin this process and llama-bench to these cores (e.g. 1)"
    )
    args = ap.parse_args()
    if args.cores:
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    if args.path != "best" and quant._kernels is not None:
        quant._kernels.use(args.path)
    if args.gguf is not None:
        sys.exit(
            0 if bench_file(args.gguf, args.llama_cpp, args.rounds, args.prompt, args.cores) else 1
        )
    rows = args.rows or args.mb * 1_000_000 // (4 * args.k)
    by_name = {q.name: q for q in QType}
    types = [by_name[t] for t in args.types.split(",")] if args.types else TYPES
    quant.set_threads(args.threads)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, args.k), dtype=np.float32)
    print(
        f"kernels: {quant.KERNELS} (path {args.path}); "
        f"matrix {rows} x {args.k}, {args.threads} thread(s), best of {args.reps}"
    )
    for n in (1, args.block):
        x = rng.standard_normal((n, args.k), dtype=np.float32)
        base = best_of(args.reps, lambda x=x, w=w: x @ w.T)
        print(f"  {n} row(s): f32 numpy {w.nbytes / base / 1e9:6.1f} GB/s ({base * 1e3:.2f} ms)")
        for qtype in types:
            q = stored(w, qtype)
            t = best_of(args.reps, lambda x=x, q=q: quant.linear(x, q))
            against = ""
            if args.against is not None and quant._kernels is not None:
                quant._kernels.use(args.against)
                ta = best_of(args.reps, lambda x=x, q=q: quant.linear(x, q))
                quant._kernels.use(args.path)
                against = f", {ta / t:.2f}x {args.against}'s time ({ta * 1e3:.2f} ms)"
            print(
                f"  {n} row(s): {qtype.name:<5}     {q.nbytes / t / 1e9:6.1f} GB/s "
                f"{rows * args.k * n / t / 1e9:6.1f} GMAC/s ({t * 1e3:.2f} ms, "
                f"{base / t:.2f}x f32's time{against})"
            )
    del w
    cfg = preset("small")
    params = T.init_params(cfg, seed=0)
    for dtype in ("f32", "q8_0"):
        held = {
            n: p
            if storage_type(dtype, n, p.shape) == QType.F32  # type: ignore[arg-type]
            else quant.quantize(p, storage_type(dtype, n, p.shape))  # type: ignore[arg-type]
            for n, p in params.items()
        }
        engine = Engine(cfg, held)
        s = engine.new_session()
        engine.decode(s, list(range(3, 19)))
        t = best_of(50, lambda e=engine, s=s: e.decode(s, [5]))
        print(
            f"engine overhead: small preset ({cfg.n_layer} layers, {len(engine.parts)} parts) "
            f"{dtype}: {t * 1e3:.2f} ms per token"
        )


if __name__ == "__main__":
    main()
