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
   at least TARGET_RATIO of torch.
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

Both run after ``runtime.retain_freed_memory()`` (as a training process should), which
spares numpy and torch alike the page faults of re-mapping each step's activations;
``--default-malloc`` measures without it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
import torch
import torch.nn.functional as F

from foundry.model.formats.gguf_io import load_gguf_stored, save_gguf
from foundry.model.formats.gguf_model import FILE_DTYPES
from foundry.model.infer import inference, parts
from foundry.model.infer.inference import Engine
from foundry.model.kernels import quant
from foundry.model.nn import transformer as T
from foundry.model.shard.table import SplitKind, rule_for
from foundry.model.spec.config import ModelConfig, preset
from foundry.model.train.optim import AdamW, clip_grad_norm
from foundry.runtime import retain_freed_memory

TARGET_RATIO = 0.7
# The modules whose ``linear`` the engine calls for its products (the parts' dense FFN too).
ENGINE_MODULES = (inference, parts)
# Decode tokens/s of each stored type over f32's, same run (issue 16's targets), and over
# llama.cpp's on the same file.
DECODE_TARGETS = {"f16": 1.8, "q8_0": 2.5, "q4_0": 3.5}
LLAMA_TARGETS = {"q8_0": 0.9, "q4_k_m": 1.0}
AUX_COEF = 0.01
LR = 1e-3


def torch_loss(
    P: dict[str, torch.Tensor], cfg: ModelConfig, tokens: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The model in idiomatic PyTorch eager: cross-entropy + load-balancing loss."""
    b, t = tokens.shape
    n, d, h, hkv, dh = b * t, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    inv = cfg.rope_theta ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:  # adjacent pairs (x0, x1), (x2, x3), ...
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    x = P["token_embd.weight"][tokens].view(n, d)
    aux = torch.zeros(())
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        a = rms(x, P[p + "attn_norm.weight"])
        q = rope((a @ P[p + "attn_q.weight"].T).view(b, t, h, dh)).transpose(1, 2)
        k = rope((a @ P[p + "attn_k.weight"].T).view(b, t, hkv, dh)).transpose(1, 2)
        v = (a @ P[p + "attn_v.weight"].T).view(b, t, hkv, dh).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + o.transpose(1, 2).reshape(n, d) @ P[p + "attn_output.weight"].T
        m = rms(x, P[p + "ffn_norm.weight"])
        probs = (m @ P[p + "ffn_gate_inp.weight"].T).softmax(-1)
        top_w, top = probs.topk(cfg.n_expert_used, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        y = torch.zeros_like(m)
        wg, wu = P[p + "ffn_gate_exps.weight"], P[p + "ffn_up_exps.weight"]
        wd = P[p + "ffn_down_exps.weight"]
        for e in range(cfg.n_expert):
            rows, slot = (top == e).nonzero(as_tuple=True)
            if rows.numel():
                xe = m[rows]
                ye = (F.silu(xe @ wg[e].T) * (xe @ wu[e].T)) @ wd[e].T
                y = y.index_add(0, rows, ye * top_w[rows, slot, None])
        if cfg.n_ff_shared:
            act = F.silu(m @ P[p + "ffn_gate_shexp.weight"].T)
            act = act * (m @ P[p + "ffn_up_shexp.weight"].T)
            y = y + act @ P[p + "ffn_down_shexp.weight"].T
        share = torch.bincount(top.flatten(), minlength=cfg.n_expert).float() / top.numel()
        aux = aux + cfg.n_expert * (share * probs.mean(0)).sum() / cfg.n_layer
        x = x + y
    logits = rms(x, P["output_norm.weight"]) @ P["output.weight"].T
    return F.cross_entropy(logits, targets.reshape(-1)) + AUX_COEF * aux


def time_alternately(steps: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds per call of each step, calls interleaved so machine noise hits both."""
    for step in steps.values():  # warm-up
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: harness.median(ts) for name, ts in times.items()}


def bench_training(cfg: ModelConfig, batch: int, seq: int, reps: int) -> bool:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.n_vocab, (batch, seq))
    targets = rng.integers(0, cfg.n_vocab, (batch, seq))
    params = T.init_params(cfg, seed=0)
    opt = AdamW(params, weight_decay=0.1)

    def numpy_step() -> None:
        _, _, grads = T.loss_and_grads(params, cfg, tokens, targets, aux_loss_coef=AUX_COEF)
        clip_grad_norm(grads, 1.0)
        opt.step(params, grads, lr=LR)

    P = {k: torch.tensor(v, requires_grad=True) for k, v in T.init_params(cfg, seed=0).items()}
    decay = [t for t in P.values() if t.ndim >= 2]
    keep = [t for t in P.values() if t.ndim < 2]
    topt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": keep, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
    )
    ttok, ttgt = torch.tensor(tokens), torch.tensor(targets)

    def torch_step() -> None:
        topt.zero_grad(set_to_none=True)
        torch_loss(P, cfg, ttok, ttgt).backward()
        torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
        topt.step()

    t = time_alternately({"numpy": numpy_step, "torch": torch_step}, reps)
    ours, ref = batch / t["numpy"], batch / t["torch"]
    ratio = ours / ref
    verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
    print(
        f"training  {cfg.n_params() / 1e6:.2f}M params, batch {batch} x {seq} tokens, "
        f"1 thread, median of {reps}"
    )
    print(f"  numpy  {ours:8.2f} samples/s  ({t['numpy'] * 1e3:7.1f} ms/step)")
    print(f"  torch  {ref:8.2f} samples/s  ({t['torch'] * 1e3:7.1f} ms/step)")
    print(f"  ratio  {ratio:.2f}x of torch eager (target >= {TARGET_RATIO}x): {verdict}")
    return ratio >= TARGET_RATIO


def weight_bytes_per_token(engine: Engine) -> int:
    """Weight bytes one decode step reads in the stored types: every tensor once, the routed
    experts' n_expert_used / n_expert share, one row of the embedding."""
    cfg, total = engine.cfg, 0
    for j, part in enumerate(engine.parts):
        for name, p in part.params.items():
            if j and rule_for(name, engine.expert_split).kind is SplitKind.REPLICATED:
                continue  # held once, read once
            share = 1.0
            if name.endswith("_exps.weight"):
                share = cfg.n_expert_used / cfg.n_expert
            elif name == "token_embd.weight":
                share = 1 / cfg.n_vocab
            total += int(p.nbytes * share)
    return total


def kv_bytes(cfg: ModelConfig, pos: int) -> int:
    return 4 * cfg.n_layer * 2 * (pos + 1) * cfg.n_embd_kv  # K and V up to this position


def write_models(
    cfg: ModelConfig, types: list[str], folder: Path, llama_cpp: Path | None
) -> dict[str, Path]:
    """The f32 model (seeded init, written once) and each other type: exported by Foundry
    (``save_gguf``), or by ``llama-quantize`` from llama.cpp's build folder when given (f16 is
    always ours; ``q4_k_m`` needs llama.cpp)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {t: folder / f"foundry-bench-{cfg.n_embd}-{t}.gguf" for t in ["f32", *types]}
    params = None
    for t, path in paths.items():
        if path.exists():
            continue
        t0 = time.perf_counter()
        if t == "f32" or (t in FILE_DTYPES and (llama_cpp is None or t == "f16")):
            params = params if params is not None else T.init_params(cfg, seed=0)
            save_gguf(path, cfg, params, dtype=t)  # type: ignore[arg-type]
            how = "save_gguf"
        elif llama_cpp is not None:
            subprocess.run(
                [
                    str(llama_cpp / "llama-quantize"),
                    str(paths["f32"]),
                    str(path),
                    t.upper(),
                    str(os.cpu_count() or 1),
                ],
                check=True,
                capture_output=True,
            )
            how = "llama-quantize"
        else:
            raise SystemExit(f"--types {t} needs --llama-cpp (Foundry does not write {t})")
        print(f"  wrote {path.name} with {how} in {time.perf_counter() - t0:.1f} s")
    return paths


def rss_of(path: Path | None) -> tuple[float, float]:
    """Resident and peak memory (GB) of a fresh process that loads ``path`` for the engine and
    decodes one token (None: the imports alone), from /proc/self/status."""
    code = (
        "import sys; from foundry.model.formats.gguf_io import load_gguf_stored;"
        "from foundry.model.infer.inference import Engine; p = sys.argv[1]\n"
        "if p:\n m = load_gguf_stored(p); e = Engine(m.cfg, m.params); del m\n"
        " e.decode(e.new_session(), [1])\n"
        "f = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(int(f['VmRSS'].split()[0]), int(f['VmHWM'].split()[0]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path or "")], check=True, capture_output=True, text=True
    ).stdout.split()
    return int(out[0]) * 1024 / 1e9, int(out[1]) * 1024 / 1e9


LLAMA_BENCH_ARGS: list[str] = []  # --llama-bench-args


def llama_bench(llama_cpp: Path, path: Path, depth: int, n: int) -> float:
    """llama.cpp's decode tokens/s on one thread (``llama-bench -t 1``), after ``depth`` tokens
    of context where this build supports ``-d``."""
    exe = str(llama_cpp / "llama-bench")
    help_text = subprocess.run([exe, "--help"], capture_output=True, text=True).stdout
    depth_args = ["-d", str(depth)] if "--n-depth" in help_text else []
    out = subprocess.run(
        [
            exe,
            "-m",
            str(path),
            "-t",
            "1",
            "-p",
            "0",
            "-n",
            str(n),
            "-r",
            "1",
            *depth_args,
            *LLAMA_BENCH_ARGS,
            "-o",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(json.loads(out.stdout)[0]["avg_ts"])


def judge(ratio: float, target: float | None) -> tuple[bool, str]:
    """(passed, the words to print) of a ratio against its target, if it has one."""
    if target is None:
        return True, ""
    passed = ratio >= target
    return passed, f"target >= {target}x {'PASS' if passed else 'FAIL'}"


class ProductClock:
    """Seconds spent in the engine's matrix products while it is entered (``--split``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._linear = quant.linear  # what the engine calls for every product

    def _timed(self, x: np.ndarray, w: quant.Param) -> np.ndarray:
        t0 = time.perf_counter()
        y = self._linear(x, w)
        self.seconds += time.perf_counter() - t0
        return y

    def __enter__(self) -> None:
        for module in ENGINE_MODULES:
            vars(module)["linear"] = self._timed  # the engine's module-level name

    def __exit__(self, *exc: object) -> None:
        for module in ENGINE_MODULES:
            vars(module)["linear"] = self._linear


def bench_decode(
    cfg: ModelConfig,
    types: list[str],
    prompt_len: int,
    n_tokens: int,
    folder: Path,
    llama_cpp: Path | None,
    rounds: int,
    split: bool = False,
) -> bool:
    """Decode tokens/s of each stored type against f32 in the same run (tokens interleaved
    across the types, ``rounds`` times), with llama.cpp on the same files when given."""
    print(f"decode    {cfg.n_params() / 1e6:.0f}M params, kernels: {quant.KERNELS}, 1 thread")
    paths = write_models(cfg, types, folder, llama_cpp)
    engines = {}
    for t, path in paths.items():
        m = load_gguf_stored(path)
        engines[t] = Engine(m.cfg, m.params)
        del m
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, cfg.n_vocab, prompt_len)]
    times: dict[str, list[float]] = {t: [] for t in engines}
    ours: dict[str, list[float]] = {t: [] for t in engines}
    theirs: dict[str, list[float]] = {t: [] for t in engines if t != "f32" or llama_cpp}
    read = {t: weight_bytes_per_token(e) for t, e in engines.items()}
    clocks = {t: ProductClock() for t in engines}
    for _ in range(rounds):
        sessions = {t: e.new_session() for t, e in engines.items()}
        last = {
            t: int(np.argmax(e.decode(sessions[t], prompt, last_only=True)[-1]))
            for t, e in engines.items()
        }
        round_times: dict[str, list[float]] = {t: [] for t in engines}
        for _ in range(n_tokens):
            for t, e in engines.items():
                t0 = time.perf_counter()
                if split:
                    with clocks[t]:
                        logits = e.decode(sessions[t], [last[t]])
                else:
                    logits = e.decode(sessions[t], [last[t]])
                round_times[t].append(time.perf_counter() - t0)
                last[t] = int(np.argmax(logits[-1]))
        for t in engines:
            times[t] += round_times[t]
            ours[t].append(n_tokens / sum(round_times[t]))
        if llama_cpp is not None:
            for t in theirs:
                theirs[t].append(llama_bench(llama_cpp, paths[t], prompt_len, n_tokens))
    base = harness.median(ours["f32"])
    ok = True
    kv = kv_bytes(cfg, prompt_len + n_tokens // 2)
    print(
        f"  {'type':<8}{'file GB':>8}{'RSS GB':>8}{'tokens/s':>10}{'ms/token':>10}"
        f"{'x f32':>7}{'MB/token':>10}{'GB/s':>7}   target"
    )
    for t in engines:
        rate = harness.median(ours[t])
        ratio = rate / base
        rss, peak = rss_of(paths[t])
        mb = (read[t] + kv) / 1e6
        passed, verdict = judge(ratio, DECODE_TARGETS.get(t))
        ok = ok and passed
        print(
            f"  {t:<8}{paths[t].stat().st_size / 1e9:>8.3f}{rss:>8.3f}{rate:>10.2f}"
            f"{1e3 / rate:>10.2f}{ratio:>6.2f}x{mb:>10.0f}{mb * rate / 1e3:>7.1f}   {verdict}"
        )
        print(
            f"  {'':<8}(peak RSS {peak:.3f} GB; median step "
            f"{harness.median(times[t]) * 1e3:.2f} ms; per round: "
            + ", ".join(f"{r:.2f}" for r in ours[t])
            + ")"
        )
    if split:
        print("  a token as products and the engine's own work (means over every token):")
        for t in engines:
            total, products = sum(times[t]) / len(times[t]), clocks[t].seconds / len(times[t])
            own = total - products
            print(
                f"  {t:<8} {total * 1e3:7.2f} ms = products {products * 1e3:6.2f} "
                f"({read[t] / products / 1e9:.1f} GB/s) + own work {own * 1e3:.2f}"
            )
    base_rss, _ = rss_of(None)
    print(f"  RSS of a process that only imports the engine: {base_rss:.3f} GB")
    if llama_cpp is not None:
        print("  against llama.cpp (llama-bench -t 1 on the same file, rounds interleaved):")
        for t, rates in theirs.items():
            ratio = harness.median_ratio(ours[t], rates)
            passed, verdict = judge(ratio, LLAMA_TARGETS.get(t))
            ok = ok and passed
            print(
                f"  {t:<8} llama.cpp {harness.median(rates):8.2f} tokens/s, Foundry "
                f"{harness.median(ours[t]):8.2f}: {ratio:.2f}x  {verdict} (per round: "
                + ", ".join(f"{a / b:.2f}x" for a, b in zip(ours[t], rates, strict=True))
                + ")"
            )
    return ok


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
