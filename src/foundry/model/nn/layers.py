"""The model's building blocks: small pure functions, each with its backward.

Every ``*_forward`` returns ``(output, cache)`` and its ``*_backward(d_output, cache)`` returns
the gradients of its inputs and weights, in the order the forward took them. Everything is
float32; shape comments use N rows (tokens), D = n_embd, F = expert intermediate size,
E experts, K = n_expert_used, H query heads, G = H / n_head_kv query heads per kv head,
Dh = head_dim, T query positions, S key positions, V vocabulary.

Semantics follow llama.cpp (docs/decisions.md, D1): RMSNorm multiplies by its weight; rotary
embedding rotates adjacent pairs (x0, x1), (x2, x3), ...; query head h reads kv head h // G;
routing is a softmax over all experts, the top K kept and renormalised to sum to 1; an expert is
down(silu(gate x) * up x).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
ONE = np.float32(1.0)  # a float32 constant keeps float32 arithmetic float32 (and float64 float64)


# --- RMSNorm ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RMSNormCache:
    xhat: F32  # (..., D) x / rms(x)
    rstd: F32  # (..., 1) 1 / rms(x)
    w: F32  # (D,)


def rmsnorm_forward(x: F32, w: F32, eps: float) -> tuple[F32, RMSNormCache]:
    # np.mean's own operations (a sum, then a division by the count) without its Python wrapper
    ms = np.add.reduce(x * x, axis=-1, keepdims=True) / x.shape[-1]  # (..., 1)
    rstd = 1.0 / np.sqrt(ms + eps)  # (..., 1)
    xhat = x * rstd  # (..., D)
    return xhat * w, RMSNormCache(xhat, rstd, w)  # (..., D)


def rmsnorm_backward(dy: F32, cache: RMSNormCache) -> tuple[F32, F32]:
    xhat, rstd, w = cache.xhat, cache.rstd, cache.w
    d = xhat.shape[-1]
    dw = np.sum((dy * xhat).reshape(-1, d), axis=0)  # (D,)
    dxhat = dy * w  # (..., D)
    proj = np.sum(dxhat * xhat, axis=-1, keepdims=True) / d  # (..., 1)
    dx = (dxhat - xhat * proj) * rstd  # (..., D)
    return dx, dw


# --- Rotary position embedding ---------------------------------------------------------------


def rope_tables(n_pos: int, head_dim: int, theta: float) -> tuple[F32, F32]:
    """cos and sin (n_pos, Dh/2): pair i of position p turns by p * theta^(-2i/Dh)."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (Dh/2,)
    angle = np.outer(np.arange(n_pos, dtype=np.float64), inv_freq)  # (n_pos, Dh/2)
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rope_forward(x: F32, cos: F32, sin: F32) -> F32:
    """Rotate adjacent pairs of x (..., T, heads, Dh); cos/sin (T, Dh/2) for x's positions."""
    c = cos[:, None, :]  # (T, 1, Dh/2)
    s = sin[:, None, :]  # (T, 1, Dh/2)
    x0, x1 = x[..., 0::2], x[..., 1::2]  # (..., T, heads, Dh/2) each
    y = np.empty_like(x)  # (..., T, heads, Dh)
    y[..., 0::2] = x0 * c - x1 * s  # (..., T, heads, Dh/2)
    y[..., 1::2] = x0 * s + x1 * c  # (..., T, heads, Dh/2)
    return y


def rope_backward(dy: F32, cos: F32, sin: F32) -> F32:
    """The rotation is orthogonal, so its backward turns the gradient back by -angle."""
    return rope_forward(dy, cos, -sin)


# --- Causal grouped-query attention ----------------------------------------------------------


@dataclass(frozen=True)
class AttentionCache:
    qg: F32  # (B, Hkv, G*T, Dh) queries grouped by the kv head they read
    k: F32  # (B, Hkv, S, Dh)
    v: F32  # (B, Hkv, S, Dh)
    p: F32  # (B, Hkv, G*T, S) attention probabilities
    scale: np.float32


def causal_mask(n_group: int, t: int, s: int, offset: int) -> npt.NDArray[np.bool_]:
    """True where query row (g, i) at position offset + i may not read key j (j > offset + i)."""
    qpos = np.tile(np.arange(t) + offset, n_group)  # (G*T,)
    return np.arange(s)[None, :] > qpos[:, None]  # (G*T, S)


def attention_forward(q: F32, k: F32, v: F32, offset: int = 0) -> tuple[F32, AttentionCache]:
    """softmax(q k^T / sqrt(Dh), causal) v with query head h reading kv head h // G.

    q (B, T, H, Dh) at positions offset .. offset+T-1; k, v (B, S, Hkv, Dh) at positions
    0 .. S-1 (training: S = T, offset 0; decoding: S = offset + T against the KV cache).
    Returns (B, T, H, Dh).
    """
    b, t, h, dh = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    scale = np.float32(1.0 / np.sqrt(dh))  # ()
    # qg: (B, Hkv, G*T, Dh), the G query heads reading one kv head stacked along the rows
    qg = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, dh)
    kt = k.transpose(0, 2, 1, 3)  # (B, Hkv, S, Dh)
    vt = v.transpose(0, 2, 1, 3)  # (B, Hkv, S, Dh)
    scores = np.matmul(qg, kt.transpose(0, 1, 3, 2))  # (B, Hkv, G*T, S)
    scores *= scale  # (B, Hkv, G*T, S)
    if s > offset + 1:  # some query row has future keys (never for one token at the end)
        scores[..., causal_mask(g, t, s, offset)] = -np.inf  # future keys get probability 0
    scores -= scores.max(axis=-1, keepdims=True)  # (B, Hkv, G*T, S)
    p = np.exp(scores, out=scores)  # (B, Hkv, G*T, S)
    p /= p.sum(axis=-1, keepdims=True)  # (B, Hkv, G*T, S)
    og = np.matmul(p, vt)  # (B, Hkv, G*T, Dh)
    out = og.reshape(b, hkv, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)  # (B,T,H,Dh)
    return out, AttentionCache(qg, kt, vt, p, scale)


def attention_backward(dout: F32, cache: AttentionCache) -> tuple[F32, F32, F32]:
    """Gradients of q (B, T, H, Dh), k and v (B, S, Hkv, Dh)."""
    qg, kt, vt, p, scale = cache.qg, cache.k, cache.v, cache.p, cache.scale
    b, t, h, dh = dout.shape
    hkv = kt.shape[1]
    g = h // hkv
    dog = dout.reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, dh)
    # dog: (B, Hkv, G*T, Dh), grouped like the queries
    dvt = np.matmul(p.transpose(0, 1, 3, 2), dog)  # (B, Hkv, S, Dh), summed over the group
    dp = np.matmul(dog, vt.transpose(0, 1, 3, 2))  # (B, Hkv, G*T, S)
    dp -= np.sum(dp * p, axis=-1, keepdims=True)  # (B, Hkv, G*T, S)
    ds = dp * p  # (B, Hkv, G*T, S) softmax backward
    ds *= scale  # (B, Hkv, G*T, S)
    dqg = np.matmul(ds, kt)  # (B, Hkv, G*T, Dh)
    dkt = np.matmul(ds.transpose(0, 1, 3, 2), qg)  # (B, Hkv, S, Dh)
    dq = dqg.reshape(b, hkv, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)  # (B,T,H,Dh)
    return dq, dkt.transpose(0, 2, 1, 3), dvt.transpose(0, 2, 1, 3)


# --- SwiGLU feed-forward ---------------------------------------------------------------------


def silu_and_sigmoid(x: F32) -> tuple[F32, F32]:
    """silu(x) = x * sigmoid(x), computed as x / (1 + exp(-x)) like ggml and torch."""
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0: sigmoid is then 0
        sig = ONE / (ONE + np.exp(-x))  # (..., F)
    return x * sig, sig


@dataclass(frozen=True)
class SwiGLUCache:
    x: F32  # (N, D)
    g: F32  # (N, F) gate pre-activation
    u: F32  # (N, F) up projection
    a: F32  # (N, F) silu(g) * u
    sig: F32  # (N, F) sigmoid(g)
    w_gate: F32  # (F, D)
    w_up: F32  # (F, D)
    w_down: F32  # (D, F)


def swiglu_forward(x: F32, w_gate: F32, w_up: F32, w_down: F32) -> tuple[F32, SwiGLUCache]:
    """down(silu(gate x) * up x): x (N, D) -> (N, D)."""
    g = x @ w_gate.T  # (N, F)
    u = x @ w_up.T  # (N, F)
    sg, sig = silu_and_sigmoid(g)  # (N, F) each
    a = sg * u  # (N, F)
    y = a @ w_down.T  # (N, D)
    return y, SwiGLUCache(x, g, u, a, sig, w_gate, w_up, w_down)


def swiglu_grads(
    dy: F32, x: F32, g: F32, u: F32, a: F32, sig: F32, w_gate: F32, w_up: F32, w_down: F32
) -> tuple[F32, F32, F32, F32]:
    """(dx, dw_gate, dw_up, dw_down) of one SwiGLU over the rows x (N, D)."""
    dw_down = dy.T @ a  # (D, F)
    da: F32 = dy @ w_down  # (N, F)
    du: F32 = da * g  # (N, F) d/du of silu(g) u = da silu(g)
    du *= sig  # (N, F)
    dsilu: F32 = g * (ONE - sig)  # (N, F) silu'(g) = sig (1 + g (1 - sig))
    dsilu += ONE  # (N, F)
    dsilu *= sig  # (N, F)
    dg: F32 = da * u  # (N, F)
    dg *= dsilu  # (N, F)
    dw_gate = dg.T @ x  # (F, D)
    dw_up = du.T @ x  # (F, D)
    dx = dg @ w_gate  # (N, D)
    dx += du @ w_up  # (N, D)
    return dx, dw_gate, dw_up, dw_down


def swiglu_backward(dy: F32, cache: SwiGLUCache) -> tuple[F32, F32, F32, F32]:
    c = cache
    return swiglu_grads(dy, c.x, c.g, c.u, c.a, c.sig, c.w_gate, c.w_up, c.w_down)


# --- Router: softmax over all experts, top-K, renormalised -----------------------------------


@dataclass(frozen=True)
class RouterCache:
    x: F32  # (N, D)
    probs: F32  # (N, E) softmax over all experts
    top: I64  # (N, K) chosen experts, most probable first
    top_p: F32  # (N, K) their probabilities
    weights: F32  # (N, K) top_p renormalised to sum 1
    w_router: F32  # (E, D)


def softmax(z: F32) -> F32:
    e: F32 = np.exp(z - z.max(axis=-1, keepdims=True))  # (..., C)
    e /= e.sum(axis=-1, keepdims=True)  # (..., C)
    return e


def router_forward(
    x: F32, w_router: F32, k: int, rowwise: bool = False
) -> tuple[F32, I64, RouterCache]:
    """Gating weights (N, K) and expert ids (N, K) of x (N, D).

    Ties go to the lower expert id (a stable sort), so every rank picks the same experts.
    ``rowwise``: each row's logits by a product of its own, so a row's bits do not depend on
    the other rows (BLAS blocks a matrix product by its row count; inference wants a row of a
    block to route as it would alone).
    """
    z = np.matmul(x[:, None, :], w_router.T)[:, 0] if rowwise else x @ w_router.T  # (N, E)
    probs = softmax(z)  # (N, E)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # (N, K)
    top_p = np.take_along_axis(probs, top, axis=-1)  # (N, K)
    weights = top_p / top_p.sum(axis=-1, keepdims=True)  # (N, K)
    return weights, top, RouterCache(x, probs, top, top_p, weights, w_router)


def router_backward(
    dweights: F32, cache: RouterCache, dprobs: F32 | None = None
) -> tuple[F32, F32]:
    """(dx, dw_router) from d(weights) (N, K) plus an optional direct d(probs) (N, E).

    ``dprobs`` carries the load-balancing loss, which reads the router probabilities.
    """
    w, top_p = cache.weights, cache.top_p
    z = top_p.sum(axis=-1, keepdims=True)  # (N, 1)
    dtop_p = (dweights - np.sum(dweights * w, axis=-1, keepdims=True)) / z  # (N, K)
    dp = np.zeros_like(cache.probs) if dprobs is None else dprobs.copy()  # (N, E)
    rows = np.arange(dp.shape[0])[:, None]  # (N, 1)
    dp[rows, cache.top] += dtop_p  # a row's top ids are distinct: no index repeats
    p = cache.probs
    dlogits = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))  # (N, E) softmax backward
    dx = dlogits @ cache.w_router  # (N, D)
    dw_router = dlogits.T @ cache.x  # (E, D)
    return dx, dw_router


# --- Routed experts: gather the rows of each expert, one matmul per expert -------------------


@dataclass(frozen=True)
class ExpertsCache:
    x: F32  # (N, D)
    weights: F32  # (N, K)
    order: I64  # (M,) flat assignment index n*K + j of each local assignment, grouped by expert
    bounds: I64  # (E_local + 1,) assignments of local expert e are order[bounds[e]:bounds[e+1]]
    xs: F32  # (M, D) the rows, gathered in that order
    g: F32  # (M, F)
    u: F32  # (M, F)
    a: F32  # (M, F)
    sig: F32  # (M, F)
    ys: F32  # (M, D) unweighted expert outputs
    w_gate: F32  # (E_local, F, D)
    w_up: F32  # (E_local, F, D)
    w_down: F32  # (E_local, D, F)


def expert_assignments(top: I64, first_expert: int, n_local: int) -> tuple[I64, I64]:
    """The assignments (flat index n*K + j) to experts first_expert .. + n_local - 1, grouped
    by expert: ``order`` (M,), and ``bounds`` (n_local + 1,) so that local expert e has
    ``order[bounds[e]:bounds[e + 1]]``."""
    local = top.ravel() - first_expert  # (N*K,) local expert id of each assignment
    mine = np.flatnonzero((local >= 0) & (local < n_local))  # (M,)
    order = mine[np.argsort(local[mine], kind="stable")]  # (M,) grouped by expert
    counts = np.bincount(local[order], minlength=n_local)  # (E_local,)
    bounds = np.concatenate(([0], np.cumsum(counts)))  # (E_local + 1,)
    return order, bounds


def combine_expert_outputs(ys: F32, weights: F32, order: I64) -> F32:
    """sum_j weights[n, j] * (output of assignment n*K + j), slots summed in top-K order:
    ys (M, D) unweighted outputs of the assignments ``order`` -> (N, D)."""
    n, k = weights.shape
    slots = np.zeros((n * k, ys.shape[1]), ys.dtype)  # (N*K, D)
    slots[order] = ys * weights.ravel()[order][:, None]  # (M, D) weighted, into their slots
    slots3 = slots.reshape(n, k, -1)  # (N, K, D)
    y = slots3[:, 0].copy()  # (N, D)
    for j in range(1, k):
        y += slots3[:, j]  # (N, D)
    return y


def experts_forward(
    x: F32,
    weights: F32,
    top: I64,
    w_gate: F32,
    w_up: F32,
    w_down: F32,
    first_expert: int = 0,
) -> tuple[F32, ExpertsCache]:
    """sum_j weights[n, j] * expert_{top[n, j]}(x[n]) over the experts held here.

    The weights hold experts first_expert .. first_expert + E_local - 1; assignments to any
    other expert contribute zero (a tensor-parallel rank evaluates only its own experts).
    The weights may also be a block of every expert's intermediate dimension (gate/up rows,
    down columns; first_expert 0): SwiGLU is elementwise over F, so the result is that block's
    share of the output, and the shares of all blocks sum to the whole.
    x (N, D), weights/top (N, K) -> (N, D), slots summed in top-K order.
    """
    k = top.shape[1]
    n_local = w_gate.shape[0]
    order, bounds = expert_assignments(top, first_expert, n_local)  # (M,), (E_local + 1,)
    xs = x[order // k]  # (M, D)
    m, f = order.shape[0], w_gate.shape[1]
    g = np.empty((m, f), x.dtype)  # (M, F)
    u = np.empty((m, f), x.dtype)  # (M, F)
    for e in range(n_local):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            np.matmul(xs[lo:hi], w_gate[e].T, out=g[lo:hi])  # (M_e, F)
            np.matmul(xs[lo:hi], w_up[e].T, out=u[lo:hi])  # (M_e, F)
    sg, sig = silu_and_sigmoid(g)  # (M, F)
    a = sg * u  # (M, F)
    ys = np.empty_like(xs)  # (M, D)
    for e in range(n_local):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            np.matmul(a[lo:hi], w_down[e].T, out=ys[lo:hi])  # (M_e, D)
    y = combine_expert_outputs(ys, weights, order)  # (N, D)
    cache = ExpertsCache(x, weights, order, bounds, xs, g, u, a, sig, ys, w_gate, w_up, w_down)
    return y, cache


def experts_backward(dy: F32, cache: ExpertsCache) -> tuple[F32, F32, F32, F32, F32]:
    """(dx, dweights, dw_gate, dw_up, dw_down) of experts_forward."""
    c = cache
    n, k = c.weights.shape
    d = c.x.shape[1]
    dys = dy[c.order // k]  # (M, D) the output gradient of each assignment's token
    dweights = np.zeros(n * k, dy.dtype)  # (N*K,)
    dweights[c.order] = np.einsum("md,md->m", dys, c.ys)  # (M,) <dy, unweighted output>
    dys *= c.weights.ravel()[c.order][:, None]  # (M, D) gradient of each unweighted output
    dw_gate, dw_up, dw_down = (
        np.zeros_like(c.w_gate),
        np.zeros_like(c.w_up),
        np.zeros_like(c.w_down),
    )
    dxs = np.empty_like(c.xs)  # (M, D)
    for e in range(c.w_gate.shape[0]):
        lo, hi = c.bounds[e], c.bounds[e + 1]
        if lo < hi:
            dxs[lo:hi], dw_gate[e], dw_up[e], dw_down[e] = swiglu_grads(
                dys[lo:hi],
                c.xs[lo:hi],
                c.g[lo:hi],
                c.u[lo:hi],
                c.a[lo:hi],
                c.sig[lo:hi],
                c.w_gate[e],
                c.w_up[e],
                c.w_down[e],
            )
    slots = np.zeros((n * k, d), dy.dtype)  # (N*K, D) back in (token, slot) order
    slots[c.order] = dxs  # (M, D)
    slots3 = slots.reshape(n, k, d)  # (N, K, D)
    dx = slots3[:, 0].copy()  # (N, D)
    for j in range(1, k):
        dx += slots3[:, j]  # (N, D)
    return dx, dweights.reshape(n, k), dw_gate, dw_up, dw_down


# --- Mixture of experts: router + routed experts ---------------------------------------------


@dataclass(frozen=True)
class MoECache:
    router: RouterCache
    experts: ExpertsCache


def moe_forward(
    x: F32, w_router: F32, w_gate: F32, w_up: F32, w_down: F32, k: int
) -> tuple[F32, MoECache]:
    """Route each row of x (N, D) to its top-K experts and mix their outputs: (N, D)."""
    weights, top, rc = router_forward(x, w_router, k)  # (N, K) each
    y, ec = experts_forward(x, weights, top, w_gate, w_up, w_down)  # (N, D)
    return y, MoECache(rc, ec)


def moe_backward(
    dy: F32, cache: MoECache, dprobs: F32 | None = None
) -> tuple[F32, F32, F32, F32, F32]:
    """(dx, dw_router, dw_gate, dw_up, dw_down); dprobs (N, E) adds a loss on the probs."""
    dx, dweights, dw_gate, dw_up, dw_down = experts_backward(dy, cache.experts)
    dx_r, dw_router = router_backward(dweights, cache.router, dprobs)
    dx += dx_r  # (N, D)
    return dx, dw_router, dw_gate, dw_up, dw_down


def load_balance_loss(probs: F32, top: I64, seq_len: int | None = None) -> tuple[float, F32]:
    """Switch/Mixtral auxiliary loss E * sum_e f_e P_e and its gradient d/dprobs (N, E).

    f_e is the share of the top-K assignments that went to expert e (not differentiable),
    P_e the mean router probability of e; the gradient flows through P only. A uniform router
    scores 1. With ``seq_len`` the rows are sequences of that length: the loss is computed per
    sequence and averaged, which makes it linear in the batch, so a batch split among
    data-parallel workers gives the same gradient as the whole batch.
    """
    n, e = probs.shape
    t = n if seq_len is None else seq_len
    if t <= 0 or n % t:
        raise ValueError(f"{n} rows do not split into sequences of {t}")
    g, k = n // t, top.shape[1]
    group = np.repeat(np.arange(g), t * k)  # (N*K,) sequence of each assignment
    counts = np.bincount(group * e + top.ravel(), minlength=g * e)  # (G*E,)
    f = counts.reshape(g, e).astype(probs.dtype) / np.float32(t * k)  # (G, E)
    p_mean = probs.reshape(g, t, e).mean(axis=1)  # (G, E)
    loss = float(e * np.mean(np.sum(f * p_mean, axis=1)))
    dprobs = np.repeat(f * np.float32(e / (t * g)), t, axis=0)  # (N, E)
    return loss, dprobs


# --- Cross-entropy ---------------------------------------------------------------------------


def cross_entropy(logits: F32, targets: I64) -> tuple[float, F32]:
    """Mean negative log-likelihood of targets (N,) under logits (N, V), and d/dlogits (N, V)."""
    n = logits.shape[0]
    rows = np.arange(n)  # (N,)
    z = logits - logits.max(axis=-1, keepdims=True)  # (N, V)
    e = np.exp(z)  # (N, V)
    total = e.sum(axis=-1, keepdims=True)  # (N, 1)
    nll = np.log(total[:, 0]) - z[rows, targets]  # (N,)
    loss = float(np.mean(nll, dtype=np.float64))
    dlogits = e  # (N, V) becomes (softmax - onehot) / N
    dlogits /= total  # (N, V) softmax
    dlogits[rows, targets] -= 1.0  # (N, V)
    dlogits /= np.float32(n)  # (N, V)
    return loss, dlogits


_GELU: F32 | None = None


def gelu_table() -> F32:
    """ggml_table_gelu_f16 as float32: gelu_tanh of every float16 value (by its bits), rounded
    to float16; built once."""
    global _GELU
    if _GELU is None:
        x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            inner = (
                np.float32(0.7978845608028654)
                * x
                * (np.float32(1.0) + np.float32(0.044715) * x * x)
            )
            y = np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))
        _GELU = np.nan_to_num(y.astype(np.float16).astype(np.float32), nan=0.0)
    return _GELU


def geglu(gu: F32) -> F32:
    """gelu(g) * u of each row [g | u] of gu (N, 2F), as ggml's geglu on float32: GELU looked
    up at the float16 nearest g (0 below -10, g above 10). The numpy reference of
    ``kernels.quant.geglu``."""
    f = gu.shape[1] // 2
    g, u = gu[:, :f], gu[:, f:]
    looked = gelu_table()[g.astype(np.float16).view(np.uint16)]
    act = np.where(g <= -10.0, np.float32(0.0), np.where(g >= 10.0, g, looked))
    return np.ascontiguousarray(act * u, dtype=np.float32)
