"""The Mixture-of-Experts transformer for training: init, forward, hand-written backward, loss.

Parameters are a flat dict ``name -> float32 array`` in ``ModelConfig.param_shapes()`` order
(llama.cpp's GGUF names); gradients come back as a dict with the same names, order, shapes
and dtype, which is what the FDTC wire carries. Shapes: B sequences of T tokens, N = B*T rows,
D = n_embd, V = n_vocab, H heads of Dh = head_dim, Hkv kv heads.

    x = token_embd[tokens]
    per block:  x += attn_output(attention(rope(q), rope(k), v))   of rmsnorm(x) * attn_norm
                x += moe(rmsnorm(x) * ffn_norm) [+ shared expert]
    logits = output(rmsnorm(x) * output_norm)

The loss is the mean cross-entropy plus ``aux_loss_coef`` times the load-balancing loss
(``layers.load_balance_loss``) averaged over the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from foundry.model.nn import layers as L
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]
Params = dict[str, F32]

INIT_STD = 0.02  # every weight matrix: N(0, 0.02^2), as GPT-2 and nanoGPT
# Projections that write into the residual stream are scaled down by 1/sqrt(2 * n_layer), so
# the residual's variance does not grow with depth (GPT-2).
RESIDUAL_PROJECTIONS = ("attn_output.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")


def init_params(cfg: ModelConfig, seed: int = 0) -> Params:
    """Scaled normal init, norms = 1, in param_shapes() order; float32 drawn directly."""
    rng = np.random.default_rng(seed)
    residual_std = INIT_STD / np.sqrt(2.0 * cfg.n_layer)
    params: Params = {}
    for name, shape in cfg.param_shapes().items():
        if name.endswith("norm.weight"):
            params[name] = np.ones(shape, np.float32)
            continue
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= np.float32(residual_std if name.endswith(RESIDUAL_PROJECTIONS) else INIT_STD)
        params[name] = w
    return params


@dataclass(frozen=True)
class LayerCache:
    attn_norm: L.RMSNormCache
    h: F32  # (N, D) normed input of attention
    attn: L.AttentionCache
    o: F32  # (N, D) attention output before the output projection
    ffn_norm: L.RMSNormCache
    moe: L.MoECache
    shared: L.SwiGLUCache | None


@dataclass(frozen=True)
class ForwardCache:
    tokens: npt.NDArray[np.int64]  # (B, T)
    cos: F32  # (T, Dh/2)
    sin: F32  # (T, Dh/2)
    layers: list[LayerCache]
    out_norm: L.RMSNormCache
    hf: F32  # (N, D) final normed hidden state


def _check_tokens(cfg: ModelConfig, tokens: npt.NDArray[np.integer]) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (batch, seq), got shape {tokens.shape}")
    if tokens.shape[1] > cfg.n_ctx:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds n_ctx {cfg.n_ctx}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.n_vocab):
        raise ValueError(f"token ids must lie in [0, {cfg.n_vocab})")


def forward(
    params: Params, cfg: ModelConfig, tokens: npt.NDArray[np.integer]
) -> tuple[F32, ForwardCache]:
    """Logits (B, T, V) of every position of tokens (B, T), and the cache for backward."""
    _check_tokens(cfg, tokens)
    tok = tokens.astype(np.int64)
    b, t = tok.shape
    n, d, h, hkv, dh = b * t, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    cos, sin = L.rope_tables(t, dh, cfg.rope_theta)  # (T, Dh/2) each
    x = params["token_embd.weight"][tok.ravel()]  # (N, D)
    caches: list[LayerCache] = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        hn, c_an = L.rmsnorm_forward(x, params[p + "attn_norm.weight"], cfg.norm_eps)  # (N, D)
        q = (hn @ params[p + "attn_q.weight"].T).reshape(b, t, h, dh)  # (B, T, H, Dh)
        k = (hn @ params[p + "attn_k.weight"].T).reshape(b, t, hkv, dh)  # (B, T, Hkv, Dh)
        v = (hn @ params[p + "attn_v.weight"].T).reshape(b, t, hkv, dh)  # (B, T, Hkv, Dh)
        q = L.rope_forward(q, cos, sin)  # (B, T, H, Dh)
        k = L.rope_forward(k, cos, sin)  # (B, T, Hkv, Dh)
        o, c_at = L.attention_forward(q, k, v)  # (B, T, H, Dh)
        o = o.reshape(n, d)  # (N, D)
        x = x + o @ params[p + "attn_output.weight"].T  # (N, D)
        h2, c_fn = L.rmsnorm_forward(x, params[p + "ffn_norm.weight"], cfg.norm_eps)  # (N, D)
        y, c_moe = L.moe_forward(
            h2,
            params[p + "ffn_gate_inp.weight"],
            params[p + "ffn_gate_exps.weight"],
            params[p + "ffn_up_exps.weight"],
            params[p + "ffn_down_exps.weight"],
            cfg.n_expert_used,
        )  # (N, D)
        c_sh = None
        if cfg.n_ff_shared:
            ys, c_sh = L.swiglu_forward(
                h2,
                params[p + "ffn_gate_shexp.weight"],
                params[p + "ffn_up_shexp.weight"],
                params[p + "ffn_down_shexp.weight"],
            )  # (N, D)
            y += ys  # (N, D)
        x = x + y  # (N, D)
        caches.append(LayerCache(c_an, hn, c_at, o, c_fn, c_moe, c_sh))
    hf, c_on = L.rmsnorm_forward(x, params["output_norm.weight"], cfg.norm_eps)  # (N, D)
    logits = hf @ params["output.weight"].T  # (N, V)
    return logits.reshape(b, t, -1), ForwardCache(tok, cos, sin, caches, c_on, hf)


def backward(
    params: Params,
    cfg: ModelConfig,
    dlogits: F32,
    cache: ForwardCache,
    router_dprobs: list[F32] | None = None,
) -> Params:
    """Gradients of every parameter (param_shapes() order, float32) from dlogits (B, T, V).

    ``router_dprobs[i]`` (N, E), if given, is a gradient on layer i's router probabilities
    (the load-balancing loss's).
    """
    b, t = cache.tokens.shape
    n, d, h, hkv, dh = b * t, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    g: Params = {}
    dl = dlogits.reshape(n, -1)  # (N, V)
    g["output.weight"] = dl.T @ cache.hf  # (V, D)
    dx, g["output_norm.weight"] = L.rmsnorm_backward(
        dl @ params["output.weight"], cache.out_norm
    )  # (N, D)
    for i in reversed(range(cfg.n_layer)):
        p = f"blk.{i}."
        c = cache.layers[i]
        dprobs = None if router_dprobs is None else router_dprobs[i]
        dh2, g[p + "ffn_gate_inp.weight"], dwg, dwu, dwd = L.moe_backward(dx, c.moe, dprobs)
        # dh2 (N, D); dwg, dwu (E, F, D); dwd (E, D, F)
        g[p + "ffn_gate_exps.weight"], g[p + "ffn_up_exps.weight"] = dwg, dwu
        g[p + "ffn_down_exps.weight"] = dwd
        if c.shared is not None:
            dhs, dsg, dsu, dsd = L.swiglu_backward(dx, c.shared)  # dhs (N, D)
            dh2 += dhs  # (N, D)
            g[p + "ffn_gate_shexp.weight"], g[p + "ffn_up_shexp.weight"] = dsg, dsu
            g[p + "ffn_down_shexp.weight"] = dsd
        dxn, g[p + "ffn_norm.weight"] = L.rmsnorm_backward(dh2, c.ffn_norm)  # (N, D)
        dx = dx + dxn  # (N, D)
        g[p + "attn_output.weight"] = dx.T @ c.o  # (D, D)
        do = (dx @ params[p + "attn_output.weight"]).reshape(b, t, h, dh)  # (B, T, H, Dh)
        dq, dk, dv = L.attention_backward(do, c.attn)  # (B, T, H|Hkv|Hkv, Dh)
        dq = L.rope_backward(dq, cache.cos, cache.sin).reshape(n, d)  # (N, D)
        dk = L.rope_backward(dk, cache.cos, cache.sin).reshape(n, hkv * dh)  # (N, Dkv)
        dv = dv.reshape(n, hkv * dh)  # (N, Dkv)
        g[p + "attn_q.weight"] = dq.T @ c.h  # (D, D)
        g[p + "attn_k.weight"] = dk.T @ c.h  # (Dkv, D)
        g[p + "attn_v.weight"] = dv.T @ c.h  # (Dkv, D)
        dhn = dq @ params[p + "attn_q.weight"]  # (N, D)
        dhn += dk @ params[p + "attn_k.weight"]  # (N, D)
        dhn += dv @ params[p + "attn_v.weight"]  # (N, D)
        dxn, g[p + "attn_norm.weight"] = L.rmsnorm_backward(dhn, c.attn_norm)  # (N, D)
        dx = dx + dxn  # (N, D)
    demb = np.zeros_like(params["token_embd.weight"])  # (V, D)
    np.add.at(demb, cache.tokens.ravel(), dx)
    g["token_embd.weight"] = demb
    return {name: g[name] for name in cfg.param_shapes()}


def loss_and_grads(
    params: Params,
    cfg: ModelConfig,
    tokens: npt.NDArray[np.integer],
    targets: npt.NDArray[np.integer],
    aux_loss_coef: float = 0.01,
) -> tuple[float, dict[str, float], Params]:
    """Loss = mean cross-entropy + aux_loss_coef * mean over layers of the balancing loss.

    The balancing loss is taken per sequence and averaged, so the whole loss is a mean over
    sequences and splitting a batch among workers leaves the mean gradient unchanged.

    Returns (loss, stats, grads); stats holds "loss", "ce_loss" and "aux_loss" (the balancing
    loss before its coefficient).
    """
    if targets.shape != tokens.shape:
        raise ValueError(f"targets {targets.shape} and tokens {tokens.shape} differ in shape")
    if targets.size and (targets.min() < 0 or targets.max() >= cfg.n_vocab):
        raise ValueError(f"target ids must lie in [0, {cfg.n_vocab})")
    logits, cache = forward(params, cfg, tokens)  # (B, T, V)
    b, t, v = logits.shape
    ce, dlogits = L.cross_entropy(logits.reshape(b * t, v), targets.astype(np.int64).ravel())
    aux = 0.0
    dprobs: list[F32] = []
    for c in cache.layers:
        aux_l, dp = L.load_balance_loss(c.moe.router.probs, c.moe.router.top, t)  # dp (N, E)
        aux += aux_l / cfg.n_layer
        dp *= np.float32(aux_loss_coef / cfg.n_layer)
        dprobs.append(dp)
    grads = backward(params, cfg, dlogits, cache, dprobs)
    loss = ce + aux_loss_coef * aux
    return loss, {"loss": loss, "ce_loss": ce, "aux_loss": aux}, grads
