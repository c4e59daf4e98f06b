"""Benchmark of the numpy model: training throughput against PyTorch eager, and decode speed.

    OPENBLAS_NUM_THREADS=1 python bench/engine.py [--quick]

1. Training: samples/s of one full step (forward, backward, gradient clipping, AdamW) of
   ``foundry.model`` and of a PyTorch eager implementation of the same model (below: SDPA
   attention, a per-expert gather/index_add mixture), same config, same batch, both on one
   thread, measured alternately in the same run. Prints the ratio and PASS when numpy reaches
   at least TARGET_RATIO of torch.
2. Decode: tokens/s of the single-process KV-cache engine on the ``bench`` preset (~1.7 GB of
   float32 weights), and the memory bandwidth that implies: the bytes one token must read
   (attention weights, router, the n_expert_used experts of every layer, output head, and the
   KV cache up to its position) divided by the time per token.

Both run after ``runtime.retain_freed_memory()`` (as a training process should), which
spares numpy and torch alike the page faults of re-mapping each step's activations;
``--default-malloc`` measures without it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from foundry.model import transformer as T
from foundry.model.config import ModelConfig, preset
from foundry.model.inference import Engine
from foundry.model.optim import AdamW, clip_grad_norm
from foundry.runtime import retain_freed_memory

TARGET_RATIO = 0.7
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
    return {name: statistics.median(ts) for name, ts in times.items()}


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
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": keep, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
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
    print(f"training  {cfg.n_params() / 1e6:.2f}M params, batch {batch} x {seq} tokens, "
          f"1 thread, median of {reps}")
    print(f"  numpy  {ours:8.2f} samples/s  ({t['numpy'] * 1e3:7.1f} ms/step)")
    print(f"  torch  {ref:8.2f} samples/s  ({t['torch'] * 1e3:7.1f} ms/step)")
    print(f"  ratio  {ratio:.2f}x of torch eager (target >= {TARGET_RATIO}x): {verdict}")
    return ratio >= TARGET_RATIO


def bytes_per_token(cfg: ModelConfig, pos: int) -> int:
    """Bytes one decode step at position pos reads: the weights it uses and the KV cache."""
    d, kv = cfg.n_embd, cfg.n_embd_kv
    per_layer = (
        2 * d  # norms
        + d * d + 2 * kv * d + d * d  # Q, K, V, output projection
        + cfg.n_expert * d  # router
        + cfg.n_expert_used * 3 * cfg.n_ff * d  # the experts this token is routed to
        + 3 * cfg.n_ff_shared * d  # shared expert
        + 2 * (pos + 1) * kv  # K and V cache up to this position
    )
    return 4 * (cfg.n_layer * per_layer + d + d + cfg.n_vocab * d)  # + embedding row, head


def bench_decode(cfg: ModelConfig, prompt_len: int, n_tokens: int) -> None:
    t0 = time.perf_counter()
    params = T.init_params(cfg, seed=0)
    init_s = time.perf_counter() - t0
    engine = Engine(cfg, params)
    session = engine.new_session()
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, cfg.n_vocab, prompt_len)]
    t0 = time.perf_counter()
    logits = engine.decode(session, prompt)
    prefill_s = time.perf_counter() - t0
    times, read = [], 0
    for _ in range(n_tokens):
        token = int(np.argmax(logits[-1]))
        read += bytes_per_token(cfg, session.pos)
        t0 = time.perf_counter()
        logits = engine.decode(session, [token])
        times.append(time.perf_counter() - t0)
    total = sum(times)
    weights_gb = sum(p.nbytes for p in params.values()) / 1e9
    print(f"decode    {weights_gb:.2f} GB f32 weights (init {init_s:.1f} s), "
          f"{len(engine.parts)} parts, 1 thread")
    print(f"  prefill {prompt_len} tokens: {prompt_len / prefill_s:8.1f} tokens/s")
    print(f"  decode  {n_tokens} tokens:  {n_tokens / total:8.1f} tokens/s "
          f"({total / n_tokens * 1e3:.1f} ms/token, median {statistics.median(times) * 1e3:.1f})")
    print(f"  reads {read / n_tokens / 1e6:.0f} MB/token -> {read / total / 1e9:.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small settings (a few seconds)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave malloc as it is instead of retain_freed_memory()")
    args = ap.parse_args()
    retained = not args.default_malloc and retain_freed_memory()
    print(f"malloc: freed memory {'retained' if retained else 'returned to the OS (default)'} "
          f"(process-wide, applies to numpy and torch alike)")
    if args.quick:
        ok = bench_training(preset("tiny"), batch=4, seq=64, reps=5)
        bench_decode(preset("small"), prompt_len=16, n_tokens=16)
    else:
        ok = bench_training(preset("small"), batch=8, seq=128, reps=15)
        bench_decode(preset("bench"), prompt_len=64, n_tokens=64)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
