"""The TOPK gradient codec: exactly the k largest, ties, its layout and bad peer bytes."""

from __future__ import annotations

import math
import struct

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from foundry.compression import NoneCodec, TopKCodec, topk_compress, topk_decompress
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError

F32 = npt.NDArray[np.float32]


@settings(max_examples=80, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.integers(1, 300),
        elements=st.one_of(st.sampled_from([0.0, 1.0, -1.0, 2.5]), st.floats(-1e6, 1e6, width=32)),
    ),
    st.floats(0.001, 1.0),
)
def test_topk_keeps_exactly_the_k_largest(x: F32, ratio: float) -> None:
    codec = TopKCodec(ratio)
    k = max(1, math.ceil(ratio * x.size))
    idx, vals = topk_compress(x, k)
    assert idx.size == k and np.all(np.diff(idx.astype(np.int64)) > 0)
    np.testing.assert_array_equal(np.sort(np.abs(vals)), np.sort(np.abs(x))[x.size - k :])
    np.testing.assert_array_equal(vals, x[idx])
    out, _ = codec.decode(codec.encode(x), x.size)
    expected = np.zeros_like(x)
    expected[idx] = x[idx]
    np.testing.assert_array_equal(out, expected)


def test_topk_ties_go_to_the_lowest_index() -> None:
    assert topk_compress(np.ones(4, np.float32), 2)[0].tolist() == [0, 1]
    idx, vals = topk_compress(np.array([3, -1, 1, 2, -1], np.float32), 3)
    assert idx.tolist() == [0, 1, 3] and vals.tolist() == [3, -1, 2]
    assert topk_compress(np.zeros(5, np.float32), 2)[0].tolist() == [0, 1]


def test_topk_functions_edges() -> None:
    x = np.array([0.5, -4.0, 2.0], np.float32)
    idx, vals = topk_compress(x, 0)
    assert idx.size == vals.size == 0
    assert topk_compress(x, 3)[0].tolist() == [0, 1, 2]
    np.testing.assert_array_equal(topk_decompress([1, 2], [-4.0, 2.0], 3), [0, -4, 2])
    with pytest.raises(LocalProtocolError):
        topk_compress(x, 4)
    with pytest.raises(LocalProtocolError):
        topk_decompress([3], [1.0], 3)
    with pytest.raises(LocalProtocolError):
        topk_decompress([0, 1], [1.0], 3)
    with pytest.raises(LocalProtocolError, match="NaN or inf"):
        TopKCodec(0.5).encode(np.array([1, np.nan], np.float32))


def test_topk_sends_60x_fewer_bytes_at_one_percent() -> None:
    n = 10_000_000
    assert 60 * TopKCodec(0.01).encoded_size(n) <= NoneCodec().encoded_size(n)
    x = np.random.default_rng(2).standard_normal(1_000_000).astype(np.float32)
    assert 60 * len(TopKCodec(0.01).encode(x)) <= 4 * x.size


def _topk_frame(n: int, k: int, counts: list[int], vals: list[float], low: list[int]) -> bytes:
    return (
        struct.pack("<I", k)
        + struct.pack(f"<{len(counts)}I", *counts)
        + struct.pack(f"<{len(vals)}f", *vals)
        + struct.pack(f"<{len(low)}H", *low)
    )


def test_topk_decode_layout_and_bad_bytes() -> None:
    n = 65536 + 3
    good = _topk_frame(n, 3, [1, 2], [1.0, 2.0, 3.0], [5, 0, 2])
    out, used = TopKCodec().decode(good, n)
    assert used == len(good) == 4 + 8 + 12 + 6
    assert out[5] == 1 and out[65536] == 2 and out[65538] == 3 and np.count_nonzero(out) == 3
    bad = {
        "keeps 9 of": _topk_frame(3, 9, [9], [0.0] * 9, [0] * 9),
        "add up to 2, not k=3": _topk_frame(n, 3, [1, 1], [1.0, 2.0, 3.0], [5, 0, 2]),
        "not strictly ascending": _topk_frame(n, 3, [1, 2], [1.0, 2.0, 3.0], [5, 2, 2]),
        "out of range": _topk_frame(n, 3, [1, 2], [1.0, 2.0, 3.0], [5, 0, 3]),
        "needs 30 bytes": good[:-1],
        "header needs 4": b"\x01",
    }
    for problem, data in bad.items():
        with pytest.raises(FdtcProtocolError, match=problem):
            TopKCodec().decode(data, n if problem != "keeps 9 of" else 3)


def test_topk_decompress_takes_every_index_in_range() -> None:
    np.testing.assert_array_equal(topk_decompress([0, 2], [1.5, -2.0], 3), [1.5, 0, -2.0])
    with pytest.raises(LocalProtocolError, match=r"an index is outside 0\.\.2$"):
        topk_decompress([3], [1.0], 3)
    with pytest.raises(LocalProtocolError, match=r"an index is outside 0\.\.2$"):
        topk_decompress([-1], [1.0], 3)
    assert topk_decompress(np.array([[0]]), [1.0], 2).dtype == np.float32


def test_topk_functions_give_u32_indices_and_f32_values() -> None:
    """Every path of topk_compress (k = 0, k = n, a clean cut, a cut through ties) and
    topk_decompress keep the documented dtypes: what a caller serializes as u32 and f32."""
    x = np.array([3.0, -1.0, 2.0, 2.0, 0.5], np.float32)
    for k, want in ((0, []), (5, [0, 1, 2, 3, 4]), (1, [0]), (2, [0, 2])):
        idx, vals = topk_compress(x, k)
        assert idx.dtype == np.dtype(np.uint32) and vals.dtype == np.dtype(np.float32), k
        assert idx.tolist() == want
        out = topk_decompress(idx, vals, 5)
        assert out.dtype == np.float32
        assert np.array_equal(out[want], x[want]) and np.count_nonzero(out) == len(want)
    with pytest.raises(LocalProtocolError, match=r"^k 6 is outside 0\.\.5$"):
        topk_compress(x, 6)
    with pytest.raises(LocalProtocolError, match=r"^2 indices but 1 values$"):
        topk_decompress([0, 1], [1.0], 5)
    with pytest.raises(LocalProtocolError, match=r"^an index is outside 0\.\.4$"):
        topk_decompress([5], [1.0], 5)
    with pytest.raises(LocalProtocolError, match=r"^TOPK input holds NaN or inf; refusing"):
        topk_compress([1.0, float("inf")], 1)
    with pytest.raises(LocalProtocolError, match=r"^topk_ratio 0\.0 is outside \(0, 1\]$"):
        TopKCodec(0.0)


def test_topk_decode_refuses_two_equal_indices() -> None:
    n = 10
    with pytest.raises(
        FdtcProtocolError, match=r"^TOPK indices are out of range or not strictly ascending$"
    ):
        TopKCodec().decode(_topk_frame(n, 2, [2], [1.0, 2.0], [4, 4]), n)
    out, _ = TopKCodec().decode(_topk_frame(n, 2, [2], [1.0, 2.0], [4, 5]), n)
    assert out[4] == 1.0 and out[5] == 2.0
