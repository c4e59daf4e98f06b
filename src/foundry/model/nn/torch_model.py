"""The Mixture-of-Experts transformer in PyTorch: transformer.py and layers.py, side by side.

The same parameter table (``ModelConfig.param_shapes()``: llama.cpp's GGUF names, numpy-style
(out, in) matrices, merged experts (E, F, D) and (E, D, F)), the same semantics, the same loss;
autograd stands in for the hand-written backward. Parameters are a flat dict
``name -> torch.Tensor``, as transformer.py's are of numpy arrays, so GPU and CPU workers train
one model and ``to_numpy`` hands a gradient to the FDTC wire as it is. Shapes: B sequences of T
tokens, N = B*T rows, D = n_embd, V = n_vocab, H heads of Dh = head_dim, Hkv kv heads,
E experts, K = n_expert_used, F = n_ff, M = N*K assignments.

    x = token_embd[tokens]
    per block:  x += attn_output(attention(rope(q), rope(k), v))   of rmsnorm(x) * attn_norm
                x += moe(rmsnorm(x) * ffn_norm) [+ shared expert]
    logits = output(rmsnorm(x) * output_norm)

Attention is ``scaled_dot_product_attention`` (fused on CUDA; query head h reads kv head
h // G through its grouped-query mode). The routed experts are grouped, not looped: the M
assignments are sorted by expert, scattered into one (E, C, D) block padded to the busiest
expert's count C, and each of gate, up and down is one batched product over the E experts
(``torch.bmm``); the outputs are gathered back and summed into their tokens with
``index_add_``. Under ``torch.autocast`` (bf16) the products run in bf16 and the router's
softmax and the loss in float32, as autocast's op lists say.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from foundry.model.nn import layers as L
from foundry.model.spec.config import ModelConfig

Tensors = dict[str, torch.Tensor]


def to_device(
    params: Mapping[str, npt.NDArray[np.float32]],
    device: torch.device | str,
    *,
    requires_grad: bool = False,
) -> Tensors:
    """The numpy parameters as float32 tensors on ``device`` (copies), in the same order."""
    out: Tensors = {}
    for name, p in params.items():
        out[name] = host_tensor(p).to(device, copy=True).requires_grad_(requires_grad)
    return out


def host_tensor(a: npt.NDArray[np.float32]) -> torch.Tensor:
    """A float32 array as a CPU tensor sharing its memory, read-only arrays too (a received
    payload's views): the caller copies before anything writes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def to_numpy(tensors: Mapping[str, torch.Tensor]) -> dict[str, npt.NDArray[np.float32]]:
    """Tensors as float32 numpy arrays on the host, in the same order (one copy each)."""
    return {name: t.detach().to("cpu", torch.float32).numpy() for name, t in tensors.items()}


def rope_tables(
    n_pos: int, cfg: ModelConfig, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (n_pos, Dh/2), computed in float64 as layers.rope_tables does."""
    cos, sin = L.rope_tables(n_pos, cfg.head_dim, cfg.rope_theta)
    return torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * w over the last axis, in float32 whatever x's type."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w  # (..., D)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x (..., T, heads, Dh); cos/sin (T, Dh/2)."""
    c = cos[:, None, :]  # (T, 1, Dh/2)
    s = sin[:, None, :]  # (T, 1, Dh/2)
    x0, x1 = x[..., 0::2], x[..., 1::2]  # (..., T, heads, Dh/2) each
    y0 = x0 * c - x1 * s  # (..., T, heads, Dh/2)
    y1 = x0 * s + x1 * c  # (..., T, heads, Dh/2)
    return torch.stack((y0, y1), dim=-1).flatten(-2)  # (..., T, heads, Dh) pairs interleaved


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention: q (B, T, H, Dh), k, v (B, T, Hkv, Dh) -> (B, T, H, Dh)."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),  # (B, heads, T, Dh)
        is_causal=True,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # (B, H, T, Dh)
    return o.transpose(1, 2)  # (B, T, H, Dh)


def router(
    x: torch.Tensor, w_router: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights (N, K), top (N, K), probs (N, E)): softmax over all experts in float32, the
    top K kept and renormalised to sum 1."""
    probs = torch.softmax((x @ w_router.T).float(), dim=-1)  # (N, E)
    top_p, top = torch.topk(probs, k, dim=-1)  # (N, K) each, most probable first
    return top_p / top_p.sum(-1, keepdim=True), top, probs


def experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    top: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """sum_j weights[n, j] * expert_{top[n, j]}(x[n]) with one batched product per matrix.

    x (N, D), weights/top (N, K), w_gate/w_up (E, F, D), w_down (E, D, F) -> (N, D).
    """
    n, k = top.shape
    e = w_gate.shape[0]
    flat = top.reshape(-1)  # (M,) expert of each assignment n*K + j
    order = torch.argsort(flat, stable=True)  # (M,) assignments grouped by expert
    expert = flat[order]  # (M,)
    counts = torch.bincount(flat, minlength=e)  # (E,)
    starts = torch.cumsum(counts, 0) - counts  # (E,)
    slot = torch.arange(order.numel(), device=x.device) - starts[expert]  # (M,) row in its block
    cap = int(counts.max())  # the busiest expert's assignments (one host sync per layer)
    token = order // k  # (M,)
    blocks = x.new_zeros(e, cap, x.shape[1])  # (E, C, D)
    blocks[expert, slot] = x[token].to(blocks.dtype)  # (M, D) scattered, zeros pad the rest
    g = torch.bmm(blocks, w_gate.transpose(1, 2))  # (E, C, F)
    u = torch.bmm(blocks, w_up.transpose(1, 2))  # (E, C, F)
    a = F.silu(g) * u  # (E, C, F)
    yb = torch.bmm(a, w_down.transpose(1, 2))  # (E, C, D)
    ys = yb[expert, slot].float()  # (M, D) unweighted outputs of the assignments
    ys = ys * weights.reshape(-1)[order][:, None]  # (M, D) weighted
    return torch.zeros(n, x.shape[1], device=x.device, dtype=ys.dtype).index_add_(0, token, ys)


def swiglu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """down(silu(gate x) * up x): x (N, D) -> (N, D)."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def load_balance_loss(
    probs: torch.Tensor, top: torch.Tensor, n_expert: int, seq_len: int
) -> torch.Tensor:
    """layers.load_balance_loss per sequence, averaged: E * sum_e f_e P_e, f without grad."""
    n, k = top.shape
    g = n // seq_len
    onehot = torch.zeros(n, n_expert, device=probs.device, dtype=probs.dtype)
    onehot.scatter_add_(1, top, torch.ones_like(top, dtype=probs.dtype))  # (N, E) counts
    f = onehot.reshape(g, seq_len, n_expert).sum(1) / (seq_len * k)  # (G, E)
    p_mean = probs.reshape(g, seq_len, n_expert).mean(1)  # (G, E)
    return n_expert * (f * p_mean).sum(1).mean()


def forward(
    params: Mapping[str, torch.Tensor], cfg: ModelConfig, tokens: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Logits (B, T, V) of tokens (B, T), and each layer's router (probs (N, E), top (N, K))."""
    b, t = tokens.shape
    n, d, h, hkv, dh = b * t, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    cos, sin = rope_tables(t, cfg, tokens.device)  # (T, Dh/2) each
    x = params["token_embd.weight"][tokens.reshape(-1)]  # (N, D)
    routers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        hn = rmsnorm(x, params[p + "attn_norm.weight"], cfg.norm_eps)  # (N, D)
        q = (hn @ params[p + "attn_q.weight"].T).reshape(b, t, h, dh)  # (B, T, H, Dh)
        k = (hn @ params[p + "attn_k.weight"].T).reshape(b, t, hkv, dh)  # (B, T, Hkv, Dh)
        v = (hn @ params[p + "attn_v.weight"].T).reshape(b, t, hkv, dh)  # (B, T, Hkv, Dh)
        o = attention(rope(q, cos, sin), rope(k, cos, sin), v).reshape(n, d)  # (N, D)
        x = x + o @ params[p + "attn_output.weight"].T  # (N, D)
        h2 = rmsnorm(x, params[p + "ffn_norm.weight"], cfg.norm_eps)  # (N, D)
        weights, top, probs = router(h2, params[p + "ffn_gate_inp.weight"], cfg.n_expert_used)
        y = experts(
            h2,
            weights,
            top,
            params[p + "ffn_gate_exps.weight"],
            params[p + "ffn_up_exps.weight"],
            params[p + "ffn_down_exps.weight"],
        )
        if cfg.n_ff_shared:
            y = y + swiglu(
                h2,
                params[p + "ffn_gate_shexp.weight"],
                params[p + "ffn_up_shexp.weight"],
                params[p + "ffn_down_shexp.weight"],
            )  # (N, D)
        x = x + y  # (N, D)
        routers.append((probs, top))
    hf = rmsnorm(x, params["output_norm.weight"], cfg.norm_eps)  # (N, D)
    logits = hf @ params["output.weight"].T  # (N, V)
    return logits.reshape(b, t, -1), routers


def loss(
    params: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    aux_loss_coef: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, ce, aux) as transformer.loss_and_grads defines them: mean cross-entropy plus
    aux_loss_coef times the per-sequence balancing loss averaged over the layers."""
    logits, routers = forward(params, cfg, tokens)  # (B, T, V)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    t = tokens.shape[1]
    aux = torch.stack([load_balance_loss(pr, top, cfg.n_expert, t) for pr, top in routers])
    aux = aux.mean()
    return ce + aux_loss_coef * aux, ce, aux
