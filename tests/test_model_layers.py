"""Every hand-written backward against central finite differences, in float64.

Each layer is checked on a random scalar projection of its output, sum(out * R), so every
output element contributes; then the whole model (cross-entropy + load-balancing loss) is
checked on sampled entries of every parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from foundry.model.nn import layers as L
from foundry.model.nn import transformer as T
from foundry.model.spec.config import ModelConfig

F64 = npt.NDArray[np.float64]
EPS = 1e-6


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def numgrad(f: Callable[[], float], x: F64, max_entries: int = 60, seed: int = 0) -> tuple:
    """Central differences of f w.r.t. (a sample of) the entries of x, perturbed in place."""
    flat = x.reshape(-1)
    picks = np.arange(flat.size)
    if flat.size > max_entries:
        picks = rng(seed).choice(flat.size, max_entries, replace=False)
    out = np.empty(picks.size)
    for i, j in enumerate(picks):
        old = flat[j]
        flat[j] = old + EPS
        up = f()
        flat[j] = old - EPS
        down = f()
        flat[j] = old
        out[i] = (up - down) / (2 * EPS)
    return picks, out


def check(analytic: F64, f: Callable[[], float], x: F64, rtol: float = 1e-6) -> None:
    assert analytic.shape == x.shape
    picks, numeric = numgrad(f, x)
    got = analytic.reshape(-1)[picks]
    scale = max(1.0, float(np.abs(numeric).max()))
    np.testing.assert_allclose(got, numeric, rtol=rtol, atol=1e-8 * scale)


def test_rmsnorm_gradients() -> None:
    r = rng(1)
    x, w, R = r.standard_normal((3, 5, 8)), r.standard_normal(8), r.standard_normal((3, 5, 8))

    def f() -> float:
        return float(np.sum(L.rmsnorm_forward(x, w, 1e-5)[0] * R))

    y, cache = L.rmsnorm_forward(x, w, 1e-5)
    np.testing.assert_allclose(y, x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-5) * w)
    dx, dw = L.rmsnorm_backward(R, cache)
    check(dx, f, x)
    check(dw, f, w)


def test_rope_rotates_adjacent_pairs() -> None:
    cos, sin = L.rope_tables(6, 8, 10000.0)
    x = rng(2).standard_normal((1, 6, 2, 8))
    y = L.rope_forward(x, cos, sin)
    np.testing.assert_array_equal(y[:, 0], x[:, 0])  # position 0 does not turn
    p, i = 3, 2  # pair i = (x[2i], x[2i+1]) turns by p * theta^(-2i/Dh), ggml's normal mode
    angle = p * 10000.0 ** (-2 * i / 8)
    x0, x1 = x[0, p, 1, 2 * i], x[0, p, 1, 2 * i + 1]
    np.testing.assert_allclose(
        y[0, p, 1, 2 * i : 2 * i + 2],
        [x0 * np.cos(angle) - x1 * np.sin(angle), x0 * np.sin(angle) + x1 * np.cos(angle)],
        rtol=1e-6,
    )


def test_rope_gradients() -> None:
    r = rng(3)
    cos, sin = L.rope_tables(5, 6, 500.0)
    x, R = r.standard_normal((2, 5, 3, 6)), r.standard_normal((2, 5, 3, 6))

    def f() -> float:
        return float(np.sum(L.rope_forward(x, cos, sin) * R))

    check(L.rope_backward(R, cos, sin), f, x)


@pytest.mark.parametrize(
    ("t", "s", "h", "hkv"), [(5, 5, 4, 2), (2, 7, 4, 2), (4, 4, 3, 3), (3, 3, 4, 1)]
)
def test_attention_gradients(t: int, s: int, h: int, hkv: int) -> None:
    r = rng(4)
    q = r.standard_normal((2, t, h, 6))
    k, v = r.standard_normal((2, s, hkv, 6)), r.standard_normal((2, s, hkv, 6))
    R = r.standard_normal((2, t, h, 6))
    offset = s - t

    def f() -> float:
        return float(np.sum(L.attention_forward(q, k, v, offset)[0] * R))

    _, cache = L.attention_forward(q, k, v, offset)
    dq, dk, dv = L.attention_backward(R, cache)
    check(dq, f, q)
    check(dk, f, k)
    check(dv, f, v)


def test_attention_matches_naive_causal_gqa() -> None:
    r = rng(5)
    t, h, hkv, dh = 5, 4, 2, 6
    q, k, v = (r.standard_normal((1, t, n, dh)) for n in (h, hkv, hkv))
    out, _ = L.attention_forward(q, k, v)
    for head in range(h):
        kv = head // (h // hkv)
        for i in range(t):
            sc = k[0, : i + 1, kv] @ q[0, i, head] / np.sqrt(dh)
            p = np.exp(sc - sc.max())
            p /= p.sum()
            np.testing.assert_allclose(out[0, i, head], p @ v[0, : i + 1, kv], rtol=1e-5)


def test_swiglu_gradients() -> None:
    r = rng(6)
    x = r.standard_normal((6, 8))
    wg, wu, wd = r.standard_normal((5, 8)), r.standard_normal((5, 8)), r.standard_normal((8, 5))
    R = r.standard_normal((6, 8))

    def f() -> float:
        return float(np.sum(L.swiglu_forward(x, wg, wu, wd)[0] * R))

    _, cache = L.swiglu_forward(x, wg, wu, wd)
    grads = L.swiglu_backward(R, cache)
    for g, x_ in zip(grads, (x, wg, wu, wd), strict=True):
        check(g, f, x_)


def moe_weights(r: np.random.Generator, e: int = 4, d: int = 8, f: int = 5) -> tuple[F64, ...]:
    return (
        r.standard_normal((e, d)),
        r.standard_normal((e, f, d)) * 0.5,
        r.standard_normal((e, f, d)) * 0.5,
        r.standard_normal((e, d, f)) * 0.5,
    )


def test_moe_matches_per_token_reference() -> None:
    r = rng(7)
    x = r.standard_normal((9, 8))
    wr, wg, wu, wd = moe_weights(r)
    y, _ = L.moe_forward(x, wr, wg, wu, wd, 2)
    for n in range(9):
        z = wr @ x[n]
        p = np.exp(z - z.max())
        p /= p.sum()  # softmax over all experts
        top = np.argsort(-p)[:2]
        w = p[top] / p[top].sum()  # renormalised
        ref = sum(
            wi * (wd[e] @ ((wg[e] @ x[n]) / (1 + np.exp(-(wg[e] @ x[n]))) * (wu[e] @ x[n])))
            for wi, e in zip(w, top, strict=True)
        )
        np.testing.assert_allclose(y[n], ref, rtol=1e-10)


def test_experts_split_by_range_sum_to_the_whole() -> None:
    r = rng(8)
    x = r.standard_normal((11, 8))
    wr, wg, wu, wd = moe_weights(r, e=5)
    weights, top, _ = L.router_forward(x, wr, 3)
    whole, _ = L.experts_forward(x, weights, top, wg, wu, wd)
    a, _ = L.experts_forward(x, weights, top, wg[:3], wu[:3], wd[:3], first_expert=0)
    b, _ = L.experts_forward(x, weights, top, wg[3:], wu[3:], wd[3:], first_expert=3)
    np.testing.assert_allclose(a + b, whole, rtol=1e-12)


def test_moe_gradients_including_routing() -> None:
    r = rng(9)
    x = r.standard_normal((10, 8))
    wr, wg, wu, wd = moe_weights(r)
    R = r.standard_normal((10, 8))
    Rp = r.standard_normal((10, 4))  # a direct loss on the router probabilities

    def f() -> float:
        y, c = L.moe_forward(x, wr, wg, wu, wd, 2)
        return float(np.sum(y * R) + np.sum(c.router.probs * Rp))

    _, cache = L.moe_forward(x, wr, wg, wu, wd, 2)
    grads = L.moe_backward(R, cache, dprobs=Rp)
    for g, x_ in zip(grads, (x, wr, wg, wu, wd), strict=True):
        check(g, f, x_)


def test_load_balance_loss() -> None:
    r = rng(10)
    n, e = 12, 4
    uniform = np.full((n, e), 1.0 / e)
    top = np.stack([np.arange(n) % e, (np.arange(n) + 1) % e], axis=1)
    assert L.load_balance_loss(uniform, top)[0] == pytest.approx(1.0)
    probs = r.dirichlet(np.ones(e), size=n)
    _, dprobs = L.load_balance_loss(probs, top)

    def f() -> float:
        return L.load_balance_loss(probs, top)[0]  # top held fixed: f is not differentiable

    check(dprobs, f, probs)


def test_load_balance_loss_per_sequence_is_linear_in_the_batch() -> None:
    r = rng(12)
    t, e = 4, 4
    probs = r.dirichlet(np.ones(e), size=3 * t)  # three sequences of four tokens
    top = np.argsort(-probs, axis=1)[:, :2]
    whole, dprobs = L.load_balance_loss(probs, top, seq_len=t)
    parts = [
        L.load_balance_loss(probs[i * t : (i + 1) * t], top[i * t : (i + 1) * t])[0]
        for i in range(3)
    ]
    assert whole == pytest.approx(np.mean(parts))

    def f() -> float:
        return L.load_balance_loss(probs, top, seq_len=t)[0]

    check(dprobs, f, probs)
    with pytest.raises(ValueError, match="sequences"):
        L.load_balance_loss(probs, top, seq_len=5)


def test_cross_entropy() -> None:
    r = rng(11)
    logits, targets = r.standard_normal((7, 13)) * 3, r.integers(0, 13, 7)
    loss, dlogits = L.cross_entropy(logits.copy(), targets)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert loss == pytest.approx(-logp[np.arange(7), targets].mean(), rel=1e-12)

    def f() -> float:
        return L.cross_entropy(logits.copy(), targets)[0]

    check(dlogits, f, logits)


@pytest.mark.parametrize("n_ff_shared", [0, 6])
def test_whole_model_gradients(n_ff_shared: int) -> None:
    cfg = ModelConfig(
        n_vocab=37,
        n_ctx=16,
        n_embd=16,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        n_ff=8,
        n_expert=4,
        n_expert_used=2,
        n_ff_shared=n_ff_shared,
    )
    r = rng(12)
    params = {
        name: p.astype(np.float64) + 0.3 * r.standard_normal(p.shape)
        for name, p in T.init_params(cfg, seed=0).items()
    }
    tokens, targets = r.integers(0, 37, (2, 7)), r.integers(0, 37, (2, 7))

    def f() -> float:
        return T.loss_and_grads(params, cfg, tokens, targets, aux_loss_coef=0.5)[0]

    loss, stats, grads = T.loss_and_grads(params, cfg, tokens, targets, aux_loss_coef=0.5)
    assert loss == pytest.approx(stats["ce_loss"] + 0.5 * stats["aux_loss"])
    assert list(grads) == list(cfg.param_shapes())
    for name, p in params.items():
        if name == "token_embd.weight":  # only the rows of tokens that occur have a gradient
            used = np.unique(tokens)
            picks = [(int(t), c) for t in used[:4] for c in range(0, 16, 3)]
            for t, c in picks:
                old = p[t, c]
                p[t, c] = old + EPS
                up = f()
                p[t, c] = old - EPS
                down = f()
                p[t, c] = old
                assert grads[name][t, c] == pytest.approx(
                    (up - down) / (2 * EPS), rel=1e-5, abs=1e-9
                )
            unused = np.setdiff1d(np.arange(37), used)
            assert not grads[name][unused].any()
            continue
        analytic = grads[name]
        picks, numeric = numgrad(f, p, max_entries=8, seed=len(name))
        np.testing.assert_allclose(
            analytic.reshape(-1)[picks], numeric, rtol=1e-5, atol=1e-9, err_msg=name
        )
