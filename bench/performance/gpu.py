"""The GPU backend against plain PyTorch and llama.cpp on the same GPU, ratios in one run.

Sections (``--only`` picks some; all run by default, in this order):

``train``  samples/s of the GPU worker's compute path against a plain PyTorch training loop of
           the same model on the same GPU, per preset (``--presets``). The worker path is
           ``TorchBackend.local_steps`` (a ``--sync-every H`` round: the held weights go down
           once, H inner AdamW steps, the pseudo-gradient comes up once as float32) and
           ``compute_gradients`` (``--sync-every 1``: weights down, gradient up, every step).
           The plain loop keeps everything on the device: ``torch_model.loss``, backward,
           clipping and fused AdamW, eager and ``torch.compile``d. f32 (TF32 off, torch's
           default), and bf16 autocast for the worker and the eager loop. Target: worker
           >= 0.8x each plain loop. ``--host-buffers off on`` times the worker path through
           pageable copies and through its page-locked buffers, with each round's phases.
           ``--train-device cpu --threads N``: the same on the CPU, N threads (PyTorch's
           intra-op threads; BLAS's for the numpy worker, timed beside them), batches of
           ``--cpu-shapes``; the CPU worker (``--device auto`` without a GPU: PyTorch) against
           the plain loop, target >= 0.9x.
``decode`` tokens/s of ``TorchEngine`` at batch 1 on the bench preset's GGUF in f32, F16 and
           Q8_0 (dequantized at load to bf16), with CUDA graphs and without (the difference
           is the launch overhead), and a 512-token prefill; against ``llama-bench`` of a CUDA
           build (``--llama-bench PATH``; skipped without) on the same files. Target: decode
           >= 0.5x llama.cpp.
``mixed``  a swarm of one GPU worker and ``--cpu-workers`` numpy workers (real processes on
           loopback, ``--sync-every 8``, DyLU) against the sum of each worker's standalone
           samples/s. Target >= 0.9. ``--mixed-coordinator-args=--overlap`` adds coordinator
           flags, ``--mixed-timelines`` prints each process's phases and the rounds;
           ``--mixed-fast-args "" --mixed-slow-args "--slowdown 20"`` runs the same mix of
           speeds on CPUs alone; ``--mixed-pin`` keeps each process on cores of its own.
``parity`` the CI parity checks on ``--parity-device`` (cuda by default) with TF32 off: the
           torch loss within 1e-5 relative of numpy's at f32 and every gradient within 1e-4
           (of the tensor's largest), with and without a shared expert; the backend's
           ``compute_gradients`` likewise; greedy decoding (f32 weights) gives the numpy
           engine's tokens. ``--only parity --parity-device cpu`` runs without a GPU.

    python bench/performance/gpu.py --llama-bench /path/to/llama-bench --out results.txt
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: live, harness

import numpy as np
import torch
from gpu_mixed import section_mixed
from gpu_shared import LINES, OUT, say, sync, timed
from gpu_train import section_train

from foundry.model.formats.gguf_io import load_gguf_stored, save_gguf
from foundry.model.infer.torch_engine import TorchEngine
from foundry.model.nn import torch_model as TM
from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.text.data import load_corpus
from foundry.model.train.torch_backend import TorchBackend

# --- decode --------------------------------------------------------------------------------


def engine_rates(
    path: Path, graphs: bool, n_decode: int, compiled: bool = False
) -> tuple[float, float]:
    """(decode tokens/s at batch 1, prefill tokens/s of 512 tokens) of TorchEngine."""
    loaded = load_gguf_stored(path)
    engine = TorchEngine(
        loaded.cfg, loaded.params, device="cuda", graphs=graphs, compile_step=compiled
    )
    prompt = list(np.random.default_rng(0).integers(3, 259, 512))

    def prefill() -> None:
        s = engine.new_session()
        engine.decode(s, prompt)

    pre = 512 / timed(prefill, 2, 5)
    s = engine.new_session()
    engine.decode(s, [1])
    for _ in range(8):  # warm-up (and the graph's capture)
        engine.decode(s, [5])
    sync()
    t0 = time.perf_counter()
    for i in range(n_decode):
        engine.decode(s, [3 + i % 200])
    return n_decode / (time.perf_counter() - t0), pre


def llama_rates(binary: str, path: Path) -> tuple[float, float] | None:
    out = subprocess.run(
        [binary, "-m", str(path), "-p", "512", "-n", "128", "-ngl", "99", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if out.returncode != 0:
        say(f"llama-bench failed on {path.name}: {out.stderr[-300:]}")
        return None
    rows = json.loads(out.stdout)
    dec = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    pre = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    return float(dec), float(pre)


def section_decode(args: argparse.Namespace, work: Path) -> None:
    cfg = preset("bench")
    params = init_params(cfg, 0)
    say(
        f"## decode: bench preset ({cfg.n_params() / 1e6:.0f}M), batch 1, tokens/s; "
        "weights dequantized to bf16 at load"
    )
    for dtype in args.dtypes:
        path = work / f"bench-{dtype}.gguf"
        save_gguf(path, cfg, params, dtype=dtype)
        plain, pre = engine_rates(path, True, args.decode_tokens)
        torch.cuda.empty_cache()
        eager, _ = engine_rates(path, False, args.decode_tokens // 2)
        torch.cuda.empty_cache()
        graphed = plain
        line = (
            f"{dtype:5s} ours: decode {plain:7.0f} (graphs) {eager:7.0f} (eager: launch "
            f"overhead {1e3 / eager - 1e3 / plain:.2f} ms of {1e3 / eager:.2f} ms/token)"
        )
        if args.compile_decode:
            try:
                graphed, _ = engine_rates(path, True, args.decode_tokens, compiled=True)
                line += f" {graphed:7.0f} (compiled step + graphs)"
            except Exception as exc:  # report and go on
                line += f" (compiled step failed: {type(exc).__name__}: {exc})"[:200]
            torch.cuda.empty_cache()
        line += f"  prefill-512 {pre:8.0f}"
        ref = llama_rates(args.llama_bench, path) if args.llama_bench else None
        if ref:
            line += (
                f"  | llama.cpp decode {ref[0]:7.0f} prefill {ref[1]:8.0f}  ->  decode "
                f"{graphed / ref[0]:.2f}x [{'PASS' if graphed >= 0.5 * ref[0] else 'FAIL'}"
                f" >= 0.5], prefill {pre / ref[1]:.2f}x"
            )
        say(line)
        path.unlink()


def section_parity(args: argparse.Namespace) -> None:
    from foundry.model.infer.generate import generate_tokens
    from foundry.model.infer.inference import Engine
    from foundry.model.nn.transformer import loss_and_grads
    from foundry.model.spec.config import ModelConfig
    from foundry.model.train.backend import NUMPY

    dev = args.parity_device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    say(
        f"## parity on {dev} (TF32 off): loss <= 1e-5 rel, gradients <= 1e-4 of the largest, "
        "greedy tokens equal"
    )

    def rel_max(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.abs(a - b).max() / np.abs(b).max())

    def check(what: str, ok: bool, detail: str) -> None:
        say(f"{what}: {detail} [{'PASS' if ok else 'FAIL'}]")

    for label, cfg in [
        ("tiny", preset("tiny")),
        ("shared-expert", ModelConfig(n_ff_shared=32, n_expert=4, n_expert_used=2)),
    ]:
        params = {
            k: p if k.endswith("norm.weight") else p * np.float32(20)
            for k, p in init_params(cfg, 1).items()
        }  # sharp routing, clear winners
        rng = np.random.default_rng(7)
        tokens = rng.integers(0, cfg.n_vocab, (3, 24))
        targets = rng.integers(0, cfg.n_vocab, (3, 24))
        loss, _, grads = loss_and_grads(params, cfg, tokens, targets, aux_loss_coef=0.05)
        w = TM.to_device(params, dev, requires_grad=True)
        total, _, _ = TM.loss(
            w, cfg, torch.from_numpy(tokens).to(dev), torch.from_numpy(targets).to(dev), 0.05
        )
        torch.autograd.backward(total)
        lr = abs(float(total.detach().cpu()) - loss) / abs(loss)
        gr = max(
            rel_max(w[k].grad.detach().cpu().numpy(), g)  # type: ignore[union-attr]
            for k, g in grads.items()
        )
        check(f"{label} loss", lr <= 1e-5, f"rel {lr:.2e}")
        check(f"{label} gradients", gr <= 1e-4, f"max rel {gr:.2e}")
        want = list(generate_tokens(Engine(cfg, params), "Hello wor", 40))
        got = list(
            generate_tokens(TorchEngine(cfg, params, device=dev, dtype="f32"), "Hello wor", 40)
        )
        same = sum(a == b for a, b in zip(got, want, strict=False))
        check(
            f"{label} greedy",
            got == want and len(set(want)) > 5,
            f"{same}/{len(want)} tokens equal, {len(set(want))} distinct",
        )
    cfg = preset("tiny")
    params = init_params(cfg, 3)
    corpus = load_corpus(None)
    backend = TorchBackend(dev)
    a = NUMPY.compute_gradients(
        params, cfg, corpus, 5, 6, seq_len=32, micro_batch=2, aux_loss_coef=0.01
    )
    b = backend.compute_gradients(
        params, cfg, corpus, 5, 6, seq_len=32, micro_batch=2, aux_loss_coef=0.01
    )
    lr = abs(b.loss - a.loss) / a.loss
    gr = max(rel_max(b.grads[k], g) for k, g in a.grads.items())
    check(
        "backend compute_gradients",
        lr <= 1e-5 and gr <= 1e-4,
        f"loss rel {lr:.2e}, gradients max rel {gr:.2e}",
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--only", nargs="*", default=["train", "decode", "mixed"])
    ap.add_argument("--presets", nargs="*", default=["small", "bench", "medium"])
    ap.add_argument(
        "--hs",
        type=int,
        nargs="*",
        default=[4, 16],
        help="inner steps of the timed local rounds (--sync-every H)",
    )
    ap.add_argument("--kinds", nargs="*", default=["f32", "bf16"])
    ap.add_argument(
        "--host-buffers",
        nargs="*",
        default=["on"],
        choices=["on", "off"],
        help="the worker path through reused page-locked buffers (on, the "
        "default) or pageable copies (off); both to compare",
    )
    ap.add_argument("--rounds", type=int, default=2, help="timed local rounds")
    ap.add_argument("--steps", type=int, default=6, help="timed steps of the plain loops")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument(
        "--compile-decode",
        action="store_true",
        help="also time the torch.compile'd one-token step in its graph",
    )
    ap.add_argument("--dtypes", nargs="*", default=["f32", "f16", "q8_0"])
    ap.add_argument("--llama-bench", default=None, help="a CUDA build's llama-bench")
    ap.add_argument("--cpu-workers", type=int, default=4)
    ap.add_argument("--mixed-batch", type=int, default=64)
    ap.add_argument("--mixed-warmup", type=int, default=1, help="rounds before measuring")
    ap.add_argument("--mixed-rounds", type=int, default=3, help="measured rounds")
    ap.add_argument("--mixed-sync-every", type=int, default=8)
    ap.add_argument(
        "--mixed-coordinator-args",
        default="",
        help="more coordinator flags for the mixed swarms, e.g. '--overlap'",
    )
    ap.add_argument("--mixed-fast-args", default="--device cuda", help="the fast worker's flags")
    ap.add_argument(
        "--mixed-slow-args",
        default="",
        help="each CPU worker's flags ('--slowdown 20' and a numpy fast worker "
        "reproduce the mix without a GPU)",
    )
    ap.add_argument(
        "--mixed-repeats",
        type=int,
        default=1,
        help="standalone GPU, standalone CPU and the mix, this many times in turn",
    )
    ap.add_argument(
        "--mixed-pin",
        action="store_true",
        help="each process of the mixed swarms on cores of its own (taskset)",
    )
    ap.add_argument(
        "--mixed-timelines", action="store_true", help="print each process's median phase times"
    )
    ap.add_argument("--parity-device", default="cuda", help="parity: cuda or cpu")
    ap.add_argument(
        "--train-device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="train: on the GPU (default) or on the CPU with --threads",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="--train-device cpu: threads of torch and BLAS (default: all)",
    )
    ap.add_argument(
        "--cpu-shapes",
        default="small=16x128,bench=4x128",
        help="--train-device cpu: preset=BATCHxSEQ of each timed preset",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the lines here")
    args = ap.parse_args()
    if args.out:
        OUT.append(args.out)
    cpu_only = (
        (args.only == ["parity"] and args.parity_device == "cpu")
        or (args.only == ["train"] and args.train_device == "cpu")
        or (args.only == ["mixed"] and "cuda" not in args.mixed_fast_args)
    )
    if not cpu_only and not torch.cuda.is_available():
        raise SystemExit("bench/performance/gpu.py needs a CUDA GPU")
    say(
        f"# {torch.cuda.get_device_name() if not cpu_only else 'CPU'}, "
        f"torch {torch.__version__}, {os.cpu_count()} cores"
    )
    with tempfile.TemporaryDirectory(prefix="foundry-gpu-") as tmp:
        work = Path(tmp)
        for name in args.only:
            try:
                {
                    "train": lambda: section_train(args),
                    "decode": lambda: section_decode(args, work),
                    "mixed": lambda: section_mixed(args, work),
                    "parity": lambda: section_parity(args),
                }[name]()
            except Exception as exc:  # a section's failure is a result too
                say(f"{name} failed: {type(exc).__name__}: {exc}"[:500])
    return 0 if not any(re.search(r"\bFAIL\b|failed", x) for x in LINES) else 1


if __name__ == "__main__":
    sys.exit(main())
