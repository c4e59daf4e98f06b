"""Training in ``engine.py`` (its 1.): samples/s of one full step of ``foundry.model`` against
a PyTorch eager implementation of the same model, same config and batch, one thread each,
measured alternately in the same run."""

from __future__ import annotations

import time
from collections.abc import Callable

import harness
import numpy as np
import torch
import torch.nn.functional as F

from foundry.model.nn import transformer as T
from foundry.model.spec.config import ModelConfig
from foundry.model.train.optim import AdamW, clip_grad_norm

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
