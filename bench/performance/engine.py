"""Benchmark of the numpy model: training throughput against PyTorch eager, and decode speed.

    OPENBLAS_NUM_THREADS=1 python bench/performance/engine.py [--quick] [--decode-only]
        [--types f16,q8_0,q4_0[,q4_k_m]] [--llama-cpp LLAMA_CPP_BUILD/bin [--llama-bench-args ARGS]]
        [--cores 2] [--split]
    OPENBLAS_NUM_THREADS=1 python bench/performance/engine.py --gguf FILE [--llama-cpp BUILD/bin]
        [--rounds 3] [--prompt 512] [--cores 1]

1. Training: samples/s of one full step (forward, backward, gradient clipping, AdamW) of
   ``foundry.model`` and of a PyTorch eager implementation of the same model (below: SDPA
   attention, a per-expert gather/index_add mixture), same config, same batch, both on one
   thread, measured alternately in the same run. Prints the ratio and PASS when numpy reaches
   at least ``engine_train.TARGET_RATIO`` of torch.
2. Decode: tokens/s of the single-process KV-cache engine on the ``bench`` preset (~1.7 GB of
   float32 weights) stored as f32 and as each of ``--types`` (F16, Q8_0, Q4_0 exported by
   Foundry; with ``--llama-cpp`` the quantized files come from llama.cpp's ``llama-quantize``,
   which also makes ``q4_k_m``), one token of each type after the other, ``--rounds`` times,
   so the ratios to f32 come from the same run. Prints the memory bandwidth each implies (the
   stored bytes one token reads: attention, router, the n_expert_used experts of every layer,
   the output head, one embedding row, and the KV cache), the resident memory of a process
   that loads the file (against the file size), and PASS/FAIL for the targets: f16 >= 1.8x,
   Q8_0 >= 2.5x, Q4_0 >= 3.5x f32. With ``--llama-cpp``, ``llama-bench -t 1`` decodes the same
   files between the rounds (after as many tokens of context as ours); target Q8_0 >= 0.9x.
   ``--split`` also times every matrix product of the engine (``inference.linear`` and
   ``parts.linear``, two clock reads a call) and prints each type's token as its products and
   the engine's own work (attention, norms, router, the expert loop, Python): what a type's
   smaller weights can speed up, and what they cannot.

3. ``--gguf FILE`` (a published file, e.g. Gemma 3 270M Q4_K_M): the engine's prompt of
   ``--prompt`` random tokens as one block (prefill) and 64 tokens decoded after it, against
   ``llama-bench -t 1 -p PROMPT`` and ``-n 64 -d PROMPT`` (64 tokens decoded after as many
   tokens of context as ours, so both pay the same attention) on the same file, rounds
   interleaved, each round printed. Targets (issue 26): decode >= 1.0x llama.cpp, prompt >= 0.5x.
   ``bench/performance/kernels.py --gguf`` times the same file's products alone.
   ``--bench-files q4_k_m,q8_0`` adds the bench preset in those types, ``--llama-3b`` a
   Llama-3.2-3B-shaped file of random weights in Q4_K_M (``random_gguf.py`` beside this
   script: gguf's writer in f16, then ``llama-quantize``), both written into ``--model-dir``.

Both run after ``runtime.retain_freed_memory()`` (as a training process should), which
spares numpy and torch alike the page faults of re-mapping each step's activations;
``--default-malloc`` measures without it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
from engine_decode import LLAMA_BENCH_ARGS, bench_decode, write_models
from engine_train import bench_training
from random_gguf import llama_3b_q4_k_m

from foundry.model.formats.gguf_io import load_gguf_stored
from foundry.model.infer import inference, parts
from foundry.model.infer.inference import Engine
from foundry.model.kernels import quant
from foundry.model.spec.config import preset
from foundry.runtime import retain_freed_memory


class OwnTime:
    """Seconds a decoded token spends outside the C module's calls (the engine's own Python:
    embedding, the calls' arguments, the head's call, the session's bookkeeping) while
    entered: the one-token step and the head's product are timed, the rest is the Python."""

    def __init__(self) -> None:
        self.in_c = 0.0
        self._names = {
            inference: ("step_layers", "step_layer", "step_attn", "step_ffn", "linear"),
            parts: ("linear",),
        }
        self._saved = {
            (module, n): vars(module)[n] for module, names in self._names.items() for n in names
        }

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            self.in_c += time.perf_counter() - t0
            return out

        return timed

    def __enter__(self) -> None:
        for (module, n), fn in self._saved.items():
            vars(module)[n] = self._timed(fn)

    def __exit__(self, *exc: object) -> None:
        for (module, n), fn in self._saved.items():
            vars(module)[n] = fn


def print_profile(threads: int, tokens: int, in_c: float, profiled: dict[str, list[int]]) -> None:
    """Where a decoded token's time went at ``threads`` (``--profile``): the C step's phases
    (csrc/kernels.h, PROF_*) in microseconds a token, and pool calls a token."""
    us = {k: ns / tokens / 1e3 for k, (ns, _) in profiled.items()}
    calls = {k: c / tokens for k, (_, c) in profiled.items()}
    phases = us["qkv"] + us["attention"] + us["out"] + us["ffn"]
    print(
        f"  {threads:>2} threads, a token: {in_c / tokens * 1e6:.0f} us in C; the layers "
        f"{us['layer']:.0f} us = Q/K/V {us['qkv']:.0f} + attention {us['attention']:.0f} + "
        f"output {us['out']:.0f} + FFN {us['ffn']:.0f} + norms and sums "
        f"{us['layer'] - phases:.0f}; pool calls {calls['pool']:.1f} taking "
        f"{us['pool']:.0f} us, of which the join waits {us['join']:.0f}; products "
        f"run alone {calls['alone']:.1f} taking {us['alone']:.0f} us",
        flush=True,
    )


def bench_file(
    path: Path,
    llama_cpp: Path | None,
    rounds: int,
    prompt_len: int,
    cores: str | None,
    threads: list[int],
    profile: bool = False,
) -> bool:
    """A file in the engine: a prompt as one block and 64 decoded tokens at each thread count,
    against llama-bench on the same file with as many threads (module docstring, 3.)."""
    from kernels import llama_bench_prompt_and_decode  # bench/performance/kernels.py

    try:
        m = load_gguf_stored(path)
    except ValueError as exc:  # an architecture the engine does not read (yet)
        print(f"{path.name}: the engine cannot load it: {exc}")
        return False
    engine = Engine(m.cfg, m.params)
    del m
    n_gen = 64
    print(
        f"{path.name} in the engine: kernels {quant.KERNELS}; a {prompt_len}-token prompt as "
        f"one block, then {n_gen} tokens; threads {', '.join(map(str, threads))}; one "
        f"client",
        flush=True,
    )
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, engine.cfg.n_vocab, prompt_len)]
    engine.decode(engine.new_session(prompt_len + 1), prompt[:32])  # weights paged in
    ok = True
    rows = []
    for n in threads:
        quant.set_threads(n)
        ratios: dict[str, list[float]] = {"decode": [], "prompt": []}
        ours: dict[str, list[float]] = {"decode": [], "prompt": []}
        theirs: dict[str, list[float]] = {"decode": [], "prompt": []}
        own = OwnTime()
        profiled: dict[str, list[int]] = {}
        for r in range(rounds):
            s = engine.new_session(prompt_len + n_gen + 1)
            t0 = time.perf_counter()
            last = int(np.argmax(engine.decode(s, prompt, last_only=True)[-1]))  # as llama.cpp
            pre = prompt_len / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            quant.profile(profile)
            with own:
                for _ in range(n_gen):
                    last = int(np.argmax(engine.decode(s, [last])[-1]))
            counted = quant.profile(False)
            for k, (ns, calls) in counted.items():
                acc = profiled.setdefault(k, [0, 0])
                acc[0] += ns
                acc[1] += calls
            dec = n_gen / (time.perf_counter() - t0)
            ours["prompt"].append(pre)
            ours["decode"].append(dec)
            line = (
                f"  {n:>2} threads, round {r + 1}: Foundry prompt {pre:8.1f} tokens/s, "
                f"decode {dec:7.2f}"
            )
            if llama_cpp is not None:
                pp, tg = llama_bench_prompt_and_decode(
                    llama_cpp,
                    path,
                    prompt_len,
                    cores,
                    depth=prompt_len,
                    threads=n,
                    extra=tuple(LLAMA_BENCH_ARGS),
                )
                theirs["prompt"].append(pp)
                theirs["decode"].append(tg)
                ratios["prompt"].append(pre / pp)
                ratios["decode"].append(dec / tg)
                line += (
                    f"; llama.cpp prompt {pp:8.1f}, decode {tg:7.2f}: {pre / pp:.2f}x "
                    f"prompt, {dec / tg:.2f}x decode"
                )
            print(line, flush=True)
        if profile:
            print_profile(n, rounds * n_gen, own.in_c, profiled)
        token_s = rounds * n_gen / sum(n_gen / d for d in ours["decode"])
        python_us = (rounds * n_gen / token_s - own.in_c) / (rounds * n_gen) * 1e6
        rows.append((n, ours, theirs, ratios, python_us))
    print(
        f"  {'threads':>7} {'prompt':>9} {'llama.cpp':>9} {'ratio':>6}   {'decode':>8} "
        f"{'llama.cpp':>9} {'ratio':>6}   {'outside C/token':>15}"
    )
    for n, ours, theirs, ratios, python_us in rows:
        med = {k: harness.median(v) for k, v in ours.items()}
        line = f"  {n:>7} {med['prompt']:>9.1f} "
        if llama_cpp is not None:
            dec_r, pre_r = harness.median(ratios["decode"]), harness.median(ratios["prompt"])
            passed = dec_r >= 1.0 and pre_r >= 0.7
            ok = ok and passed
            line += (
                f"{harness.median(theirs['prompt']):>9.1f} {pre_r:>5.2f}x   "
                f"{med['decode']:>8.2f} {harness.median(theirs['decode']):>9.2f} "
                f"{dec_r:>5.2f}x   {python_us:>9.0f} us   "
                f"{'PASS' if passed else 'FAIL'} (decode >= 1.0x, prompt >= 0.7x)"
            )
        else:
            line += (
                f"{'':>9} {'':>6}   {med['decode']:>8.2f} {'':>9} {'':>6}   {python_us:>9.0f} us"
            )
        print(line, flush=True)
    quant.set_threads(1)
    return ok


def main() -> None:
    ap = harness.parser(__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small settings (a few seconds)")
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave malloc as it is instead of retain_freed_memory()",
    )
    ap.add_argument("--decode-only", action="store_true", help="skip the training benchmark")
    ap.add_argument(
        "--types",
        default="f16,q8_0,q4_0",
        help="stored types to decode against f32 (q4_k_m needs --llama-cpp)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds per type (default 3)")
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=Path("/tmp"),
        help="where the model files are written once and reused (default /tmp)",
    )
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        default=None,
        help="llama.cpp build folder with llama-quantize and llama-bench: quantize "
        "with llama-quantize and measure llama.cpp on the same files",
    )
    ap.add_argument(
        "--llama-bench-args",
        default="",
        help="more arguments for llama-bench, e.g. '--repack 0' (a VM whose CPU "
        "flags promise more than it runs: llama.cpp's repacked kernels died "
        "there with SIGILL)",
    )
    ap.add_argument("--cores", default=None, help="pin to these cores (e.g. 2)")
    ap.add_argument(
        "--split",
        action="store_true",
        help="also time the products apart from the engine's own work",
    )
    ap.add_argument(
        "--gguf",
        type=Path,
        action="append",
        default=[],
        help="a file (published, or any GGUF the engine reads): its prompt and "
        "decode against llama.cpp (3.); repeat for several",
    )
    ap.add_argument(
        "--bench-files",
        default=None,
        metavar="TYPES",
        help="with --gguf's measurement: also the bench preset written as these "
        "types (e.g. q4_k_m,q8_0; q4_k_m needs --llama-cpp) into --model-dir",
    )
    ap.add_argument(
        "--threads",
        default="1",
        metavar="N,N,...",
        help="thread counts of the --gguf measurement, each against llama-bench -t N (default 1)",
    )
    ap.add_argument(
        "--llama-3b",
        action="store_true",
        help="with --gguf's measurement: also a Llama-3.2-3B-shaped file of random "
        "weights in Q4_K_M (gguf's writer, then llama-quantize; needs --llama-cpp), "
        "written into --model-dir once (about 2 GB)",
    )
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens with --gguf")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="with --gguf: where a decoded token's time goes in the C step at each "
        "thread count (its phases, pool calls and their joins; two clock reads a "
        "phase, so decode is timed slightly slower)",
    )
    args = ap.parse_args()
    LLAMA_BENCH_ARGS.extend(args.llama_bench_args.split())
    retained = not args.default_malloc and retain_freed_memory()
    print(
        f"malloc: freed memory {'retained' if retained else 'returned to the OS (default)'} "
        f"(process-wide, applies to numpy and torch alike)"
    )
    if args.cores:
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    files = list(args.gguf)
    if args.bench_files:
        types = args.bench_files.split(",")
        written = write_models(preset("bench"), types, args.model_dir, args.llama_cpp)
        files += [written[t] for t in types]
    if args.llama_3b:
        if args.llama_cpp is None:
            raise SystemExit("--llama-3b needs --llama-cpp (llama-quantize writes the Q4_K_M file)")
        files.append(llama_3b_q4_k_m(args.model_dir, args.llama_cpp))
    if files:
        threads = [int(n) for n in args.threads.split(",")]
        results = [
            bench_file(
                f, args.llama_cpp, args.rounds, args.prompt, args.cores, threads, args.profile
            )
            for f in files
        ]
        raise SystemExit(0 if all(results) else 1)
    ok = True
    if not args.decode_only:
        ok = (
            bench_training(preset("tiny"), batch=4, seq=64, reps=5)
            if args.quick
            else bench_training(preset("small"), batch=8, seq=128, reps=15)
        )
    cfg, prompt, n = (preset("small"), 16, 16) if args.quick else (preset("bench"), 64, 64)
    ok = (
        bench_decode(
            cfg,
            args.types.split(","),
            prompt,
            n,
            args.model_dir,
            args.llama_cpp,
            args.rounds,
            args.split,
        )
        and ok
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
