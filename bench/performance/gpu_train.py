"""The ``train`` section of ``gpu.py``: samples/s of the worker's compute path
(``TorchBackend.local_steps`` and ``compute_gradients``) against a plain PyTorch training loop of
the same model on the same device, on the GPU or (``--train-device cpu``) on the CPU."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
from gpu_shared import DEVICE, say, timed

from foundry.model.nn import torch_model as TM
from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.text.data import load_corpus
from foundry.model.train.backend import NUMPY
from foundry.model.train.optim import lr_schedule
from foundry.model.train.torch_backend import TorchBackend, adamw
from foundry.runtime import retain_freed_memory

SHAPES = {"small": (64, 256), "bench": (64, 512), "medium": (64, 512)}


def plain_loop(name: str, bf16: bool, compiled: bool, steps: int) -> float:
    """samples/s of a plain loop: everything on the device, nothing leaves it."""
    cfg = preset(name)
    b, t = SHAPES[name]
    corpus = load_corpus(None)
    params = TM.to_device(init_params(cfg, 0), DEVICE[0], requires_grad=True)
    opt = adamw(params, 0.01, torch.device(DEVICE[0]), lr=1e-3)
    loss_fn = torch.compile(TM.loss) if compiled else TM.loss
    batches = [
        tuple(
            torch.from_numpy(a.astype(np.int64)).to(DEVICE[0])
            for a in corpus.sample_batch(i * b, b, t)
        )
        for i in range(4)
    ]
    k = [0]

    def step() -> None:
        tok, tgt = batches[k[0] % len(batches)]
        k[0] += 1
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE[0], dtype=torch.bfloat16, enabled=bf16):
            total, _, _ = loss_fn(params, cfg, tok, tgt, 0.01)
        torch.autograd.backward(total)
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()

    return b / timed(step, 3 if compiled else 2, steps)


def worker_path(
    name: str, bf16: bool, h: int, rounds: int, host_buffers: bool = True
) -> tuple[float, float, dict[str, float]]:
    """samples/s of (a local round of h steps, a --sync-every 1 gradient); the process keeps
    freed memory as a worker's does (``retain_freed_memory``: on a VM whose memory grows as
    it is touched, a fresh 1.7 GB host buffer a round costs its page faults every round)."""
    retain_freed_memory()
    cfg = preset(name)
    b, t = SHAPES[name]
    corpus = load_corpus(None)
    start = init_params(cfg, 0)
    backend: Any = (
        TorchBackend(DEVICE[0], bf16=bf16, host_buffers=host_buffers)
        if DEVICE[0] != "numpy"
        else NUMPY
    )
    inner = backend.make_inner(start, 0.01)
    r = [0]

    def round_() -> None:
        backend.local_steps(
            start,
            inner,
            cfg,
            corpus,
            lr_at=lambda s: lr_schedule(s, 1e-3, 10, 1000),
            grad_clip=1.0,
            global_step=r[0] * h,
            sample_offset=r[0] * h * b,
            samples_per_step=b,
            steps=h,
            micro_batch=b,
            seq_len=t,
            aux_loss_coef=0.01,
        )
        r[0] += 1

    local = h * b / timed(round_, 1, rounds)
    phases = dict(getattr(backend, "last_phases", {}))

    def grad() -> None:
        backend.compute_gradients(
            start, cfg, corpus, r[0] * b, b, seq_len=t, micro_batch=b, aux_loss_coef=0.01
        )
        r[0] += 1

    return local, b / timed(grad, 1, rounds), phases


def section_train_cpu(args: argparse.Namespace) -> None:
    """The CPU worker against a plain PyTorch loop on the CPU, both on --threads threads."""
    from foundry.tp.blas import limit_blas_threads

    torch.set_num_threads(args.threads)
    blas = limit_blas_threads(args.threads)
    say(
        f"## train on the CPU: samples/s, {args.threads} threads (torch "
        f"{torch.get_num_threads()}, BLAS {blas}); worker path (H={args.hs[0]} local round, "
        "and H=1) vs the plain torch loop"
    )
    for name, shape in (s.split("=") for s in args.cpu_shapes.split(",")):
        b, t = (int(v) for v in shape.split("x"))
        SHAPES[name] = (b, t)
        say(f"# {name}: {preset(name).n_params() / 1e6:.1f}M parameters, batch {b}x{t}")
        DEVICE[0] = "cpu"
        eager = plain_loop(name, False, False, args.steps)
        local, grad, _ = worker_path(name, False, args.hs[0], args.rounds, False)
        DEVICE[0] = "numpy"
        np_local, np_grad, _ = worker_path(name, False, args.hs[0], args.rounds, False)
        DEVICE[0] = "cpu"
        say(
            f"{name}: plain torch {eager:8.2f}; worker torch {local:8.2f} ({local / eager:.2f}x "
            f"[{'PASS' if local >= 0.9 * eager else 'FAIL'} >= 0.9], H=1 {grad:8.2f}, "
            f"{grad / eager:.2f}x); worker numpy {np_local:8.2f} ({np_local / eager:.2f}x, "
            f"H=1 {np_grad:8.2f})"
        )


def section_train(args: argparse.Namespace) -> None:
    if args.train_device == "cpu":
        section_train_cpu(args)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    say("## train: samples/s (tokens/s = samples x seq), worker path vs plain torch loop")
    for name in args.presets:
        b, t = SHAPES[name]
        say(f"# {name}: {preset(name).n_params() / 1e6:.1f}M parameters, batch {b}x{t}")
        for kind in args.kinds:
            bf16 = kind == "bf16"
            eager = plain_loop(name, bf16, False, args.steps)
            comp = None
            if not bf16 and not args.no_compile:
                try:
                    comp = plain_loop(name, False, True, args.steps)
                except Exception as exc:  # report and go on
                    say(f"{name} f32: torch.compile failed: {type(exc).__name__}: {exc}"[:300])
            say(
                f"{name} {kind}: plain eager {eager:8.1f}"
                + (f"  plain compiled {comp:8.1f}" if comp else "")
            )
            for h in args.hs:
                for buffers in args.host_buffers:
                    local, grad, ph = worker_path(name, bf16, h, args.rounds, buffers == "on")
                    line = (
                        f"{name} {kind}: worker H={h:<3d} host buffers {buffers:3s} "
                        f"{local:8.1f}  ->  {local / eager:.2f}x eager "
                        f"[{'PASS' if local >= 0.8 * eager else 'FAIL'} >= 0.8]"
                    )
                    if comp:
                        line += (
                            f", {local / comp:.2f}x compiled "
                            f"[{'PASS' if local >= 0.8 * comp else 'FAIL'} >= 0.8]"
                        )
                    say(
                        line + f"   (worker H=1: {grad:8.1f}, {grad / eager:.2f}x eager; "
                        "last round: " + ", ".join(f"{k} {v:.3f} s" for k, v in ph.items()) + ")"
                    )
            torch.cuda.empty_cache()
