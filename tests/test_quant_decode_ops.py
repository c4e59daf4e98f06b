"""A decode step's C operations on stored weights: attention against its cache, RMSNorm, RoPE,
SwiGLU, GeGLU and the router against the training layers, every path against the portable C.

The C kernels have one definition per type (``csrc/kernels.h``); the SIMD path must equal the
portable C bit for bit, and every result must be independent of how many rows a call holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from foundry.model.kernels import quant
from foundry.model.nn.layers import attention_forward, rope_tables


@pytest.mark.parametrize(
    ("n_head", "n_kv", "dh", "n_pos"), [(8, 4, 64, 1), (8, 8, 32, 37), (4, 1, 72, 130)]
)
@pytest.mark.parametrize("kernel", [True, False], ids=["c", "numpy"])
def test_attention_of_a_row_against_its_cache_equals_the_layer(
    n_head: int, n_kv: int, dh: int, n_pos: int, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernel:
        monkeypatch.setattr(quant, "_kernels", None)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((n_pos + 9, n_kv, dh), dtype=np.float32)  # a cache longer than used
    v = rng.standard_normal((n_pos + 9, n_kv, dh), dtype=np.float32)
    q = 3 * rng.standard_normal((n_head, dh), dtype=np.float32)  # peaked softmaxes too
    want, _ = attention_forward(q[None, None], k[None, :n_pos], v[None, :n_pos], offset=n_pos - 1)
    got = np.full((n_head, dh), np.nan, np.float32)
    quant.attend(q, k, v, n_pos, got)
    np.testing.assert_allclose(got, want[0, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize(
    ("n_head", "n_kv", "dh", "n_pos"),
    [(4, 1, 256, 515), (2, 1, 256, 2), (9, 3, 32, 38), (5, 1, 24, 7), (7, 7, 8, 1), (6, 2, 40, 19)],
)
def test_attention_on_every_path_is_portable_c_bit_for_bit(
    n_head: int, n_kv: int, dh: int, n_pos: int, half: bool
) -> None:
    """The SIMD attention (heads and positions several at a time) against the portable C:
    head groups of 1 to 4 and more, odd positions, dh not a multiple of 16; a NaN key."""
    kernels = quant._kernels
    assert kernels is not None
    rng = np.random.default_rng(n_pos)
    dtype = np.float16 if half else np.float32
    k = (4 * rng.standard_normal((n_pos, n_kv, dh))).astype(dtype)
    v = rng.standard_normal((n_pos, n_kv, dh)).astype(dtype)
    v[0, 0, :3] = [0.0, -0.0, 65504.0 if half else 1e30]
    q = 2 * rng.standard_normal((n_head, dh), dtype=np.float32)
    for nan in (False, True):
        if nan:
            k[n_pos // 2, 0, 1] = np.nan
        outs = []
        for path in ("best", "portable"):
            kernels.use(path)
            try:
                out = np.empty_like(q)
                quant.attend(q, k, v, n_pos, out)
            finally:
                kernels.use("best")
            outs.append(out)
        assert outs[0].tobytes() == outs[1].tobytes()
        assert np.isnan(outs[0][0, 0]) == nan  # kv head 0's heads, not the others'
        assert np.isnan(outs[0][-1]).any() == (nan and n_kv == 1)


def test_attention_refuses_a_cache_shorter_than_its_positions() -> None:
    assert quant._kernels is not None
    q = np.zeros((8, 64), np.float32)
    cache = np.zeros((4, 4, 64), np.float32)
    with pytest.raises(ValueError, match="5 positions of 4 kv heads"):
        quant.attend(q, cache, cache, 5, q)


D_ROWS = [1, 5]  # a decode row, a block


def _on_both_paths(op: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """op's result with the C module and with the numpy fallback; the C module's SIMD and
    portable paths must agree bit for bit."""
    assert quant._kernels is not None
    kernels = quant._kernels
    c = op(*args)
    try:
        kernels.use("portable")
        portable = op(*args)
    finally:
        kernels.use("best")
    for a, b in zip(
        c if isinstance(c, tuple) else (c,),
        portable if isinstance(portable, tuple) else (portable,),
        strict=True,
    ):
        assert np.array_equal(a, b, equal_nan=True)
    quant._kernels = None
    try:
        fallback = op(*args)
    finally:
        quant._kernels = kernels
    return c, fallback


@pytest.mark.parametrize("n", D_ROWS)
def test_rmsnorm_rope_and_swiglu_equal_the_layers(n: int) -> None:
    rng = np.random.default_rng(8)
    x = 3 * rng.standard_normal((n, 1024), dtype=np.float32)
    w = rng.standard_normal(1024, dtype=np.float32)
    got, want = _on_both_paths(quant.rmsnorm, x, w, 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    cos, sin = (a[3 : 3 + n] for a in rope_tables(64, 64, 10000.0))
    qk = rng.standard_normal((n, 6, 64), dtype=np.float32)
    got, want = _on_both_paths(quant.rope, qk, cos, sin)
    assert np.array_equal(got, want)  # the same three roundings per value
    got, want = _on_both_paths(quant.rope, qk, cos, sin, True)  # NEOX: pairs (i, i + 32)
    assert np.array_equal(got, want)
    x0, x1 = qk[..., :32], qk[..., 32:]
    c, s = cos[:, None, :], sin[:, None, :]
    assert np.array_equal(got, np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1))
    gu = 8 * rng.standard_normal((n, 2 * 96), dtype=np.float32)
    # e^-g past float's range both ways, at its ends, and what is not a number
    gu[0, :10] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 88.5, -88.5, -100.0, 100.0, 1e-40]
    with np.errstate(invalid="ignore"):
        got, want = _on_both_paths(quant.swiglu, gu)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # NaN where numpy has NaN


@pytest.mark.parametrize("n", D_ROWS)
def test_geglu_equals_ggml_table_lookup(n: int) -> None:
    rng = np.random.default_rng(11)
    f = 2048
    gu = 4 * rng.standard_normal((n, 2 * f), dtype=np.float32)
    # every float16 value as a gate (the table's every entry), the -10 and 10 ends and past
    # them, halfway cases between float16 neighbours (ties to even) and subnormals
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    every = every[np.isfinite(every)]
    edges = np.array(
        [
            -10.0,
            10.0,
            np.nextafter(-10.0, 0, dtype=np.float32),
            9.999,
            -10.5,
            10.5,
            1e4,
            -1e4,
            1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11,
            2.0**-25,
            -(2.0**-25),
            3 * 2.0**-25,
            0.0,
            -0.0,
        ],
        np.float32,
    )
    gates = np.concatenate([every, edges])
    rows = -(-gates.size // f)
    big = np.ones((rows, 2 * f), np.float32)
    big[:, :f].flat[: gates.size] = gates
    big[:, f:] = rng.standard_normal((rows, f), dtype=np.float32)
    for x in (gu, big):
        got, want = _on_both_paths(quant.geglu, x)
        assert np.array_equal(got, want)  # the fallback is arch.geglu, numpy's float16 rounding
    got = quant.geglu(big)[:, :f].ravel()[: gates.size] / big[:, f:].ravel()[: gates.size]
    np.testing.assert_allclose(got[-15:-13], [0.0, 10.0], rtol=1e-6)  # the ends as ggml's


@pytest.mark.parametrize("n", D_ROWS)
def test_router_grouping_and_combination_equal_the_layers(n: int) -> None:
    rng = np.random.default_rng(9)
    x = rng.standard_normal((n, 256), dtype=np.float32)
    w_router = rng.standard_normal((8, 256), dtype=np.float32)
    w_router[2] = w_router[5] = 0.1 * x[0]  # row 0's best two, tied
    (weights, top), (want_w, want_top) = _on_both_paths(quant.route, x, w_router, 3)
    assert np.array_equal(top, want_top)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5)
    assert list(top[0, :2]) == [2, 5]  # the lower id first, as the stable sort
    for first, n_local in [(0, 8), (2, 4), (6, 2)]:
        (order, bounds), (want_order, want_bounds) = _on_both_paths(
            quant.assign_experts, top, first, n_local
        )
        assert np.array_equal(order, want_order) and np.array_equal(bounds, want_bounds)
        ys = rng.standard_normal((order.size, 256), dtype=np.float32)
        got, want = _on_both_paths(quant.combine_experts, ys, weights, order)
        assert np.array_equal(got, want)  # the slots summed in the same order


def test_each_row_of_the_decode_operations_is_its_own() -> None:
    rng = np.random.default_rng(10)
    x = rng.standard_normal((6, 512), dtype=np.float32)
    w = rng.standard_normal(512, dtype=np.float32)
    w_router = rng.standard_normal((8, 512), dtype=np.float32)
    block = (quant.rmsnorm(x, w, 1e-5), *quant.route(x, w_router, 2))
    for i in range(6):
        alone = (quant.rmsnorm(x[i : i + 1], w, 1e-5), *quant.route(x[i : i + 1], w_router, 2))
        for a, b in zip(alone, block, strict=True):
            assert np.array_equal(a, b[i : i + 1])


def test_the_decode_operations_refuse_buffers_that_do_not_fit() -> None:
    k = quant._kernels
    assert k is not None
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="w holds 128 bytes, expected 256"):
        k.rmsnorm(x, np.zeros(32, np.float32), 2, 64, 1e-5, x)
    with pytest.raises(ValueError, match="at most 256"):
        k.route(
            x,
            np.zeros((300, 64), np.float32),
            2,
            64,
            300,
            2,
            np.zeros(4, np.float32),
            np.zeros(4, np.int64),
        )
    with pytest.raises(ValueError, match="not a distinct assignment"):
        k.combine(x, np.zeros((2, 2), np.float32), np.array([1, 1], np.int64), 2, 2, 64, x)
    with pytest.raises(ValueError, match="not a distinct assignment"):
        k.combine(x, np.zeros((2, 2), np.float32), np.array([0, 4], np.int64), 2, 2, 64, x)
    with pytest.raises(ValueError, match="rows of 3 heads of 63 values"):
        k.rope(x, x, x, 2, 3, 63, 0, x)
    with pytest.raises(ValueError, match="rows of 2 heads of 32 values"):
        k.rope(x, x[0], x[0], 2, 2, 32, 2, x)  # neox is 0 or 1
    table = np.zeros(1 << 16, np.float32)
    with pytest.raises(ValueError, match="table holds 262140 bytes, expected 262144"):
        k.geglu(x, table[1:], 2, 32, x[:, :32].copy())
    with pytest.raises(ValueError, match="out holds 256 bytes, expected 128"):
        k.geglu(x[:, :32].copy(), table, 2, 16, x[:, :32].copy())
