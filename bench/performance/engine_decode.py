"""Decode in ``engine.py`` (its 2.): the ``bench`` preset written as f32 and each stored type,
one token of each type after the other, the bandwidth and resident memory each implies, and
llama.cpp's ``llama-bench`` on the same files; ``--split`` times the products apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness
import numpy as np

from foundry.model.formats.gguf_io import load_gguf_stored, save_gguf
from foundry.model.formats.gguf_model import FILE_DTYPES
from foundry.model.infer import inference, parts
from foundry.model.infer.inference import Engine
from foundry.model.kernels import quant
from foundry.model.nn import transformer as T
from foundry.model.shard.table import SplitKind, rule_for
from foundry.model.spec.config import ModelConfig, preset
from foundry.runtime import retain_freed_memory

# The modules whose ``linear`` the engine calls for its products (the parts' dense FFN too).
ENGINE_MODULES = (inference, parts)

# Decode tokens/s of each stored type over f32's, same run (issue 16's targets), and over
# llama.cpp's on the same file.
DECODE_TARGETS = {"f16": 1.8, "q8_0": 2.5, "q4_0": 3.5}
LLAMA_TARGETS = {"q8_0": 0.9, "q4_k_m": 1.0}


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


def bench_engine(gguf: Path | None, model_dir: Path) -> tuple[Engine, Path]:
    """An engine on ``gguf``, else on the bench preset as Q8_0 (Foundry's export, written once
    into ``model_dir``), and its file; freed memory kept for the next pass
    (``retain_freed_memory``)."""
    retain_freed_memory()
    path = gguf or write_models(preset("bench"), ["q8_0"], model_dir, None)["q8_0"]
    m = load_gguf_stored(path)
    return Engine(m.cfg, m.params), path
