"""Gradient codecs against their error budgets, their exact sizes and bad peer bytes."""

from __future__ import annotations

import math
import struct

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from foundry.compression import (
    CODECS,
    Codec,
    Compressor,
    ErrorFeedback,
    Fp16Codec,
    NoneCodec,
    QsgdCodec,
    TopKCodec,
    deserialize_tensors,
    estimate_compressed_size,
    fp16_to_fp32,
    fp32_to_fp16,
    get_codec,
    largest_section,
    qsgd,
    serialize_tensors,
    topk_compress,
    topk_decompress,
)
from foundry.model.nn import transformer as T
from foundry.model.spec.config import N_SPECIAL_TOKENS, ModelConfig
from foundry.model.train.optim import AdamW, clip_grad_norm, lr_schedule
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import Compression

F32 = npt.NDArray[np.float32]


def codecs_under_test() -> list[Codec]:
    return [
        NoneCodec(),
        Fp16Codec(),
        *(TopKCodec(r) for r in (0.001, 0.01, 0.3, 1.0)),
        *(QsgdCodec(s, d, seed=1) for s in (1, 3, 7, 15, 127) for d in (1, 7, 512)),
    ]


def test_registry_covers_every_wire_value() -> None:
    assert set(CODECS) == set(Compression)
    assert isinstance(get_codec(Compression.NONE), NoneCodec)
    assert isinstance(get_codec(1), Fp16Codec)
    topk = get_codec(Compression.TOPK, topk_ratio=0.05)
    assert isinstance(topk, TopKCodec) and topk.ratio == 0.05
    qsgd = get_codec(Compression.QSGD, qsgd_levels=15, qsgd_bucket=128, seed=3)
    assert isinstance(qsgd, QsgdCodec) and (qsgd.levels, qsgd.bucket, qsgd.bits) == (15, 128, 5)
    with pytest.raises(LocalProtocolError, match="unknown compression"):
        get_codec(9)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(LocalProtocolError):
            TopKCodec(bad)
    for levels, bucket in ((0, 8), (128, 8), (7, 0)):
        with pytest.raises(LocalProtocolError):
            QsgdCodec(levels, bucket)


# ---------------------------------------------------------------------------- sizes

_SIZES = [0, 1, 2, 7, 8, 9, 511, 512, 513, 65535, 65536, 65537, 131075]


@pytest.mark.parametrize("codec", codecs_under_test(), ids=repr)
def test_estimated_size_is_the_actual_size(codec: Codec) -> None:
    rng = np.random.default_rng(0)
    for n in _SIZES:
        x = rng.standard_normal(n).astype(np.float32)
        data = codec.encode(x)
        assert len(data) == codec.encoded_size(n), n
        # The decoder takes exactly its bytes from a longer buffer.
        out, used = codec.decode(bytes(data) + b"\xff" * 5, n)
        assert used == len(data) and out.shape == (n,) and out.dtype == np.float32


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5000), st.sampled_from(codecs_under_test()))
def test_estimated_size_property(n: int, codec: Codec) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    data = codec.encode(x)
    assert len(data) == codec.encoded_size(n)
    assert codec.decode(data, n)[1] == len(data)


def test_estimate_compressed_size_matches_the_seed_formulae() -> None:
    n = 10_000_000
    assert estimate_compressed_size(n, Compression.NONE) == 4 * n
    assert estimate_compressed_size(n, Compression.FP16) == 2 * n
    # TOPK: u32 k, u32 per 65536-block count, 6 bytes per kept element.
    topk = estimate_compressed_size(n, Compression.TOPK, topk_ratio=0.01)
    assert topk == 4 + 4 * 153 + 6 * 100_000
    # QSGD: 8-byte header, f32 scale per bucket, (1 + bit_length(s)) bits per element.
    assert estimate_compressed_size(100, Compression.QSGD, qsgd_levels=15, qsgd_bucket=64) == (
        8 + 4 * 2 + math.ceil(100 * 5 / 8)
    )


# ---------------------------------------------------------------------------- FP16


def _reference_fp16_bits(x: F32) -> npt.NDArray[np.uint16]:
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.float16).view(np.uint16)  # numpy: IEEE round to nearest even


def test_fp16_is_round_to_nearest_even_bit_for_bit() -> None:
    bits = np.arange(0x7C00, dtype=np.uint16)  # every finite non-negative f16
    finite16 = bits.view(np.float16).astype(np.float32)
    upper = (bits[:-1] + 1).view(np.float16).astype(np.float32)  # the next f16 up
    mids = (finite16[:-1].astype(np.float64) + upper) / 2  # exact ties, representable in f32
    ties = mids.astype(np.float32)
    assert np.array_equal(ties.astype(np.float64), mids)
    rng = np.random.default_rng(0)
    random_bits = (
        rng.integers(0, 2**32, 500_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    )
    x = np.concatenate(
        [
            finite16,
            ties,
            np.nextafter(ties, np.float32(0)),
            np.nextafter(ties, np.float32(1e9)),
            random_bits,
        ]
    )
    x = np.concatenate([x, -x])
    x = x[np.isfinite(x) & (np.abs(x) < 65520)]  # beyond: we saturate, numpy overflows
    np.testing.assert_array_equal(fp32_to_fp16(x), _reference_fp16_bits(x))


def test_fp16_saturates_finite_overflow_and_keeps_inf_and_nan() -> None:
    x = np.array(
        [65504, 65519.996, 65520, 1e6, 3e38, -1e6, np.inf, -np.inf, np.nan, -np.nan],
        np.float32,
    )
    data = Fp16Codec().encode(x)
    out, _ = Fp16Codec().decode(data, x.size)
    np.testing.assert_array_equal(
        out[:8], [65504, 65504, 65504, 65504, 65504, -65504, np.inf, -np.inf]
    )
    assert np.isnan(out[8:]).all()
    bits = fp32_to_fp16(x)
    assert list(bits[5:8]) == [0xFBFF, 0x7C00, 0xFC00]


def test_fp16_error_budget() -> None:
    rng = np.random.default_rng(1)
    # Normal f16 range: relative error at most 2**-11 (half an ulp of an 11-bit significand).
    normal = np.exp2(rng.uniform(-14, 15.99, 200_000)).astype(np.float32)
    normal *= rng.choice(np.array([-1, 1], np.float32), normal.size)
    out, _ = Fp16Codec().decode(Fp16Codec().encode(normal), normal.size)
    rel = np.abs(out.astype(np.float64) - normal) / np.abs(normal)
    assert rel.max() <= 2.0**-11
    # Subnormal range: absolute error at most half the step 2**-24.
    tiny = rng.uniform(-(2.0**-14), 2.0**-14, 100_000).astype(np.float32)
    out, _ = Fp16Codec().decode(Fp16Codec().encode(tiny), tiny.size)
    assert np.abs(out.astype(np.float64) - tiny).max() <= 2.0**-25


def test_fp16_decode_is_exact_for_every_pattern() -> None:
    every = np.arange(65536, dtype=np.uint16)
    ours = fp16_to_fp32(every)
    ref = every.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))  # NaN payloads too


# ---------------------------------------------------------------------------- TOPK


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


# ---------------------------------------------------------------------------- QSGD


@pytest.fixture(params=["c", "numpy"], autouse=False)
def encoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each QSGD test that takes it runs with the C encoder and decoder and with numpy's."""
    if request.param == "numpy":
        monkeypatch.setattr(qsgd, "_qsgd", None)
    return str(request.param)


def test_the_c_qsgd_encoder_is_built() -> None:
    """``pip install`` builds it wherever a C compiler is (CI has one)."""
    assert qsgd.ENCODER == "c"


@pytest.mark.parametrize("levels", [1, 7, 127])
def test_qsgd_encode_decoded_is_what_decode_gives(encoder: str, levels: int) -> None:
    x = (np.random.default_rng(levels).standard_normal(5000) * 4).astype(np.float32)
    codec = QsgdCodec(levels, 512, seed=3)
    data, sent = codec.encode_decoded(x)
    np.testing.assert_array_equal(sent, codec.decode(data, x.size)[0])


def _qsgd_exact_variance(v: F32, s: int, d: int) -> tuple[npt.NDArray[np.float64], float]:
    """Per-element variance of one QSGD decoding (scale m = the bucket's largest magnitude),
    and the bound d m^2 / (4 s^2) summed over buckets."""
    var = np.zeros(v.size)
    bound = 0.0
    for b in range(0, v.size, d):
        vb = v[b : b + d].astype(np.float64)
        m = float(np.abs(vb).max())
        if m == 0:
            continue
        r = s * np.abs(vb) / m
        p = r - np.floor(r)
        var[b : b + d] = (m / s) ** 2 * p * (1 - p)
        bound += vb.size * m**2 / (4 * s**2)
    return var, bound


@pytest.mark.parametrize(("levels", "bucket"), [(1, 64), (4, 64), (15, 50), (127, 64)])
def test_qsgd_is_unbiased_with_bounded_variance(encoder: str, levels: int, bucket: int) -> None:
    """N = 3000 independent decodings of a fixed vector of n = 200 elements (buckets of
    ``bucket``, the last one partial) at s = ``levels``:

    - every decoded value is sign(v_i) * m * l / s with an integer l in 0..s, m the bucket's
      largest magnitude, and each is within m / s of v_i;
    - the empirical mean of each element is within 5 standard errors (sqrt(Var_i / N), Var_i
      from the exact two-point distribution) of v_i: unbiased;
    - Var_i summed over a bucket is at most d m^2 / (4 s^2), below the L2 form's
      min(d / s^2, sqrt(d) / s) ||v||^2 (Alistarh et al., Lemma 3.1) for these vectors, and
      the empirical total squared error is within 10 % of that variance.
    """
    n_samples, n = 3000, 200
    rng = np.random.default_rng(7)
    v = (rng.standard_normal(n) * rng.uniform(0.1, 3, n)).astype(np.float32)
    codec = QsgdCodec(levels, bucket, seed=11)
    decoded = np.stack([codec.decode(codec.encode(v), n)[0] for _ in range(n_samples)])
    # Levels: integers in 0..s of the bucket's unit m/s, with v's sign.
    l2_bound = 0.0
    for b in range(0, n, bucket):
        vb = v[b : b + bucket].astype(np.float64)
        unit = np.abs(vb).max() / levels
        lv = decoded[:, b : b + bucket] / unit
        assert np.allclose(lv, np.round(lv), atol=1e-4)
        assert np.abs(lv).max() <= levels + 1e-4
        assert np.all(decoded[:, b : b + bucket] * v[b : b + bucket] >= 0)
        assert np.all(np.abs(decoded[:, b : b + bucket] - vb) <= unit * (1 + 1e-5))
        norm = float(np.linalg.norm(vb))
        l2_bound += min(vb.size / levels**2, math.sqrt(vb.size) / levels) * norm**2
    var, bound = _qsgd_exact_variance(v, levels, bucket)
    assert var.sum() <= bound <= l2_bound
    stderr = np.sqrt(var / n_samples)
    bias = np.abs(decoded.mean(axis=0, dtype=np.float64) - v)
    assert np.all(bias <= 5 * stderr + 1e-6 * np.abs(v).max())
    empirical = ((decoded - v) ** 2).sum(axis=1).mean()
    assert abs(empirical - var.sum()) <= 0.1 * var.sum()


def test_qsgd_special_inputs(encoder: str) -> None:
    codec = QsgdCodec(7, 4, seed=0)
    zeros, _ = codec.decode(codec.encode(np.zeros(10, np.float32)), 10)
    np.testing.assert_array_equal(zeros, 0)
    one_hot = np.array([0, 0, -3, 0], np.float32)  # a single element is its bucket's scale
    np.testing.assert_array_equal(codec.decode(codec.encode(one_hot), 4)[0], one_hot)
    for bad in (np.nan, np.inf):
        with pytest.raises(LocalProtocolError, match="NaN or inf"):
            codec.encode(np.array([1, bad], np.float32))
    # Neither huge nor subnormal magnitudes overflow the scale: each decodes within m / s.
    for m in (3e38, 1e-40):
        x = np.array([m, -m / 2, m / 3, 0], np.float32)
        out = codec.decode(codec.encode(x), 4)[0].astype(np.float64)
        assert np.all(np.isfinite(out))
        assert np.all(np.abs(out - x) <= float(np.float32(m)) / 7 * (1 + 1e-5))
    a, b = QsgdCodec(seed=5), QsgdCodec(seed=5)
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert a.encode(x) == b.encode(x)  # seeded: reproducible


def _qsgd_frame(bucket: int, levels: int, norms: list[float], stream: bytes) -> bytes:
    return struct.pack("<II", bucket, levels) + struct.pack(f"<{len(norms)}f", *norms) + stream


@pytest.mark.parametrize("levels", [1, 3, 7, 15, 31, 63, 127])
def test_qsgd_codes_are_packed_lsb_first_at_every_width(encoder: str, levels: int) -> None:
    """The bit stream at every code width (2..8 bits) against the layout written out bit by
    bit: element i occupies stream bits [i b, (i + 1) b), bit 0 the LSB of byte 0; odd
    lengths, a zero-padded last byte."""
    bits = 1 + levels.bit_length()
    rng = np.random.default_rng(levels)
    for n in (1, 7, 8, 9, 63, 1000):
        v = (rng.standard_normal(n) * 3).astype(np.float32)
        data = bytes(QsgdCodec(levels, 512, seed=1).encode(v))
        stream = data[8 + 4 * -(-n // 512) :]
        assert len(stream) == -(-n * bits // 8)
        as_bits = [(stream[k // 8] >> (k % 8)) & 1 for k in range(8 * len(stream))]
        codes = [sum(as_bits[i * bits + j] << j for j in range(bits)) for i in range(n)]
        assert not any(as_bits[n * bits :])  # the padding
        decoded, _ = QsgdCodec().decode(data, n)
        scale = np.repeat([np.abs(v[b : b + 512]).max() for b in range(0, n, 512)], 512)[:n]
        want = [(-1.0 if c & 1 else 1.0) * (c >> 1) for c in codes]
        np.testing.assert_allclose(decoded, np.array(want) * scale / levels, rtol=1e-6)


def test_qsgd_decode_layout_and_bad_bytes(encoder: str) -> None:
    # s = 5 -> 4-bit codes (level << 1 | sign), element i in bits [4i, 4i + 4): LSB first.
    # Codes: +5 (0xA), -1 (0x3), 0 (0x0) -> bytes 0x3A, 0x00.
    good = _qsgd_frame(4, 5, [10.0], bytes([0x3A, 0x00]))
    out, used = QsgdCodec().decode(good, 3)
    assert used == len(good) == 8 + 4 + 2
    np.testing.assert_allclose(out, [10.0, -2.0, 0.0])
    bad = {
        "bucket 0": _qsgd_frame(0, 5, [], b""),
        "levels 128": _qsgd_frame(4, 128, [1.0], bytes(3)),
        "finite and non-negative": _qsgd_frame(4, 5, [-1.0], bytes(2)),
        "level above s=5": _qsgd_frame(4, 5, [1.0], bytes([0x0C, 0x00])),  # level 6
        "needs 14 bytes": good[:-1],
        "header needs 8": b"\x01\x02",
    }
    for problem, data in bad.items():
        with pytest.raises(FdtcProtocolError, match=problem):
            QsgdCodec().decode(data, 3)
    nan_norm = _qsgd_frame(4, 5, [float("nan")], bytes(2))
    with pytest.raises(FdtcProtocolError, match="finite"):
        QsgdCodec().decode(nan_norm, 3)


# ---------------------------------------------------------------------------- sections


@pytest.mark.parametrize("compression", list(Compression))
def test_serialize_deserialize_a_data_section(compression: Compression) -> None:
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (70000,), (1,), (0,))]
    numels = [a.size for a in arrays]
    data = serialize_tensors(arrays, compression, topk_ratio=1.0, seed=0)
    assert len(data) == sum(
        estimate_compressed_size(n, compression, topk_ratio=1.0) for n in numels
    )
    out = deserialize_tensors(data, numels, compression)
    assert [o.size for o in out] == numels
    if compression in (Compression.NONE, Compression.TOPK):  # TOPK at ratio 1 keeps all
        for a, o in zip(arrays, out, strict=True):
            np.testing.assert_array_equal(o, a.reshape(-1))
    with pytest.raises(FdtcProtocolError, match="1 bytes left over"):
        deserialize_tensors(bytes(data) + b"\0", numels, compression)
    with pytest.raises(FdtcProtocolError, match="tensor 1 of 4"):
        deserialize_tensors(data[: len(data) // 2], numels, compression)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 100), st.sampled_from(list(Compression)))
def test_decoders_on_any_bytes_give_a_tensor_or_a_clean_error(
    data: bytes, numel: int, compression: Compression
) -> None:
    try:
        out, used = get_codec(compression).decode(data, numel)
    except FdtcProtocolError:
        return
    assert out.shape == (numel,) and used <= len(data)


# ---------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize(
    "codec",
    [NoneCodec(), Fp16Codec(), TopKCodec(0.05), QsgdCodec(3, 16, seed=2)],
    ids=repr,
)
def test_error_feedback_loses_nothing(codec: Codec) -> None:
    """sum over steps of what was sent (decoded) + the residual == sum of the gradients."""
    rng = np.random.default_rng(4)
    shapes = {"blk.0.attn_q.weight": (16, 16), "output_norm.weight": (40,)}
    feedback = ErrorFeedback(codec)
    inputs = {k: np.zeros(s, np.float64).reshape(-1) for k, s in shapes.items()}
    sent = {k: np.zeros(s, np.float64).reshape(-1) for k, s in shapes.items()}
    for _ in range(12):
        for name, shape in shapes.items():
            g = rng.standard_normal(shape).astype(np.float32)
            data = feedback.compress(name, g)
            inputs[name] += g.reshape(-1)
            sent[name] += codec.decode(data, g.size)[0]
    for name in shapes:
        residual = feedback.residual(name)
        assert residual is not None
        np.testing.assert_allclose(sent[name] + residual, inputs[name], rtol=0, atol=1e-4)
        if not codec.lossy:
            assert not residual.any()
    with pytest.raises(LocalProtocolError, match="call reset"):
        feedback.compress("output_norm.weight", np.zeros(41, np.float32))
    feedback.reset("output_norm.weight")
    assert feedback.residual("output_norm.weight") is None
    feedback.compress("output_norm.weight", np.zeros(41, np.float32))
    feedback.reset()
    assert feedback.residual("blk.0.attn_q.weight") is None


def test_qsgd_decodes_a_huge_bucket_field_without_a_huge_allocation(encoder: str) -> None:
    """The bucket size comes from the peer: a tensor of 4 values that claims buckets of
    2^32 - 1 decodes as the one bucket it is (not a 16 GiB buffer), to the same values as
    the honest field, also when the tensor starts at an odd byte of its message."""
    codec = qsgd.QsgdCodec(levels=7, bucket=4, seed=1)
    x = np.array([0.5, -1.0, 0.25, 2.0], np.float32)
    honest = bytes(codec.encode(x))
    want, used = codec.decode(honest, 4)
    huge = struct.pack("<II", 0xFFFF_FFFF, 7) + honest[8:]
    got, used_huge = codec.decode(huge, 4)
    assert used_huge == used and got.tobytes() == want.tobytes()
    odd = memoryview(b"\x00" + huge)[1:]  # unaligned scales
    got_odd, _ = codec.decode(odd, 4)
    assert got_odd.tobytes() == want.tobytes()


@pytest.mark.parametrize(
    "codec",
    [NoneCodec(), Fp16Codec(), TopKCodec(0.05), QsgdCodec(3, 16, seed=2)],
    ids=repr,
)
def test_compressor_sends_what_it_says_and_loses_nothing(codec: Codec) -> None:
    """The sender's wrapper (the worker's upload, the coordinator's UPDATE): over several
    calls, what the receiver decodes from each section plus the residual kept for the next call
    equals the sum of the inputs, tensor by tensor; the section is the codec's own encoding."""
    rng = np.random.default_rng(5)
    shapes = {"blk.0.attn_q.weight": (16, 16), "output_norm.weight": (40,)}
    compressor = Compressor(codec)
    assert (compressor.feedback is not None) == codec.lossy
    inputs = {k: np.zeros(math.prod(s), np.float64) for k, s in shapes.items()}
    received = {k: np.zeros(math.prod(s), np.float64) for k, s in shapes.items()}
    for _ in range(10):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        section, sent = compressor.encode(grads)
        assert len(section) == sum(codec.encoded_size(g.size) for g in grads.values())
        decoded = deserialize_tensors(section, [g.size for g in grads.values()], codec.compression)
        for (name, g), got in zip(grads.items(), decoded, strict=True):
            np.testing.assert_array_equal(sent[name], got)  # the sender's view is exact
            inputs[name] += g.reshape(-1)
            received[name] += got
    for name in shapes:
        if codec.lossy:
            assert compressor.feedback is not None
            residual = compressor.feedback.residual(name)
            assert residual is not None and np.abs(residual).max() > 0
        else:
            residual = np.zeros(1, np.float32)
        np.testing.assert_allclose(received[name] + residual, inputs[name], rtol=0, atol=1e-4)
    compressor.reset()
    if compressor.feedback is not None:
        assert compressor.feedback.residual("output_norm.weight") is None


def test_topk_learns_better_with_error_feedback_than_without() -> None:
    """The same AdamW run on a periodic corpus, its gradients through TOPK at 0.5%: once
    through the sender's Compressor (error feedback), once through the bare codec (what was
    dropped is lost). Feedback on ends about 0.25 nats lower (1.45 against 1.70 over the last
    ten steps, three data seeds); with feedback off, or broken, the two runs are alike."""
    cfg = ModelConfig(
        n_ctx=64, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_expert=4, n_expert_used=2
    )
    text = b"the quick brown fox jumps over the lazy dog; " * 40
    corpus = np.frombuffer(text, np.uint8).astype(np.int64) + N_SPECIAL_TOKENS
    steps, seq, batch = 60, 32, 8

    def final_loss(feedback: bool) -> float:
        codec = TopKCodec(0.005)
        compressor = Compressor(codec)
        params = T.init_params(cfg, seed=0)
        opt = AdamW(params, weight_decay=0.01)
        rng = np.random.default_rng(0)
        losses = []
        for step in range(steps):
            starts = rng.integers(0, corpus.size - seq - 1, batch)
            window = np.stack([corpus[s : s + seq + 1] for s in starts])
            _, stats, grads = T.loss_and_grads(params, cfg, window[:, :-1], window[:, 1:])
            if feedback:
                sent = compressor.encode(grads)[1]
            else:
                sent = {k: codec.encode_decoded(g)[1] for k, g in grads.items()}
            update = {k: np.array(v).reshape(grads[k].shape) for k, v in sent.items()}
            clip_grad_norm(update, 1.0)
            opt.step(params, update, lr=lr_schedule(step, 1e-2, 10, steps))
            losses.append(stats["ce_loss"])
        assert losses[0] > 5.0
        return float(np.mean(losses[-10:]))

    on, off = final_loss(True), final_loss(False)
    assert on < 2.0, f"TOPK with feedback stalled at {on:.3f}"
    assert on <= off - 0.1, f"feedback on {on:.3f} is not clearly below feedback off {off:.3f}"


@pytest.mark.parametrize("sign", [0x0000, 0x8000])
def test_fp16_specials_of_one_sign_decode_exactly(sign: int) -> None:
    """Infinity and NaN patterns of one sign only, alone in their chunk (the decoder fixes them
    up per chunk), and every pattern of that sign."""
    for patterns in (
        [sign | 0x7C00],
        [sign | 0x7E00],
        [sign | 0x7BFF, sign | 0x7C01],
        list(range(sign, sign + 0x8000)),
    ):
        h = np.array(patterns, np.uint16)
        want = h.view(np.float16).astype(np.float32)
        np.testing.assert_array_equal(fp16_to_fp32(h).view(np.uint32), want.view(np.uint32))
        assert fp16_to_fp32(h).dtype == np.float32


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


def test_short_tensors_name_their_codec_and_size() -> None:
    cases = {
        "^TOPK tensor header needs 4 bytes": (TopKCodec(), b"", 3),
        "^TOPK tensor of 3 elements keeping 1 needs": (TopKCodec(), b"\x01\x00\x00\x00", 3),
        "^QSGD tensor header needs 8 bytes": (QsgdCodec(), b"", 3),
        "^QSGD tensor of 3 elements needs": (QsgdCodec(), struct.pack("<II", 4, 5), 3),
        "^FP16 tensor of 3 elements needs 6 bytes": (Fp16Codec(), b"", 3),
        "^NONE tensor of 3 elements needs 12 bytes": (NoneCodec(), b"", 3),
    }
    for problem, (codec, data, n) in cases.items():
        with pytest.raises(FdtcProtocolError, match=problem):
            codec.decode(data, n)


def test_qsgd_parameter_limits_and_seed() -> None:
    """Bucket 1 and 2**32 - 1 are accepted, 0 and 2**32 refused; levels 1..127. The seed of
    QsgdParams makes the stochastic rounding repeatable."""
    for bucket in (1, 0xFFFF_FFFF):
        assert QsgdCodec(7, bucket).bucket == bucket
    for bucket in (0, 1 << 32):
        with pytest.raises(LocalProtocolError, match=f"^qsgd_bucket {bucket} must be a positive"):
            QsgdCodec(7, bucket)
    with pytest.raises(LocalProtocolError, match=r"^qsgd_levels 128 is outside 1\.\.127"):
        QsgdCodec(128)
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    params = qsgd.QsgdParams(qsgd_levels=3, qsgd_bucket=64, seed=11)
    first = QsgdCodec.from_params(params).encode(x)
    assert QsgdCodec.from_params(params).encode(x) == first == QsgdCodec(3, 64, 11).encode(x)


@pytest.mark.parametrize("decoded", [False, True])
def test_qsgd_encode_decoded_returns_the_decoding_only_when_asked(
    encoder: str, decoded: bool
) -> None:
    x = np.random.default_rng(4).standard_normal(100).astype(np.float32)
    data, out = QsgdCodec(7, 32, seed=2).encode_decoded(x, decoded=decoded)
    assert data == QsgdCodec(7, 32, seed=2).encode(x)
    if decoded:
        assert np.array_equal(out, QsgdCodec().decode(data, 100)[0])
    else:
        assert out.dtype == np.float32 and out.size == 0


def test_fp16_edges_bit_for_bit() -> None:
    """65520 (the first value RNE would round to inf) saturates even when it is the chunk's
    largest; a saturated element does not touch its neighbours; NaN is exactly the quiet
    0x7E00 with its sign; a signalling NaN raises no floating-point flag; the output is u16."""
    x = np.array([65520.0, 1.0, -0.0], np.float32)
    bits = fp32_to_fp16(x)
    assert bits.dtype == np.dtype(np.uint16)
    assert bits.tolist() == [0x7BFF, 0x3C00, 0x8000]
    assert fp32_to_fp16(np.array([np.nan, -np.nan], np.float32)).tolist() == [0x7E00, 0xFE00]
    snan = np.array([0x7F80_0001], np.uint32).view(np.float32)
    with np.errstate(all="raise"):
        assert fp32_to_fp16(snan).tolist() == [0x7E00]


@pytest.mark.parametrize("inf", [0x7C00, 0xFC00])
def test_fp16_an_infinity_alone_at_the_chunk_edge_decodes(inf: int) -> None:
    """An f16 infinity alone among finite values: its scaled value is exactly +-2**16."""
    out = fp16_to_fp32(np.array([0x3C00, inf, 0x7BFF, 0xFBFF], np.uint16))
    assert out.tolist() == [
        1.0,
        math.copysign(math.inf, 1 if inf == 0x7C00 else -1),
        65504.0,
        -65504.0,
    ]


def test_fp16_to_fp32_takes_any_integer_array_like() -> None:
    """Bit patterns as Python ints or a 2-D array are read as u16, one value each."""
    assert fp16_to_fp32([0x3C00, 0xC000]).tolist() == [1.0, -2.0]
    assert fp16_to_fp32(np.array([[0x3C00], [0xC000]], np.uint16)).tolist() == [1.0, -2.0]


def test_none_codec_empty_section() -> None:
    assert bytes(NoneCodec().encode_section([])) == b""
    assert bytes(NoneCodec().encode_section([[1.0], []])) == struct.pack("<f", 1.0)


def test_qsgd_rounds_each_element_independently(encoder: str) -> None:
    """Every element at r = 0.5 (s = 1, half the bucket maximum) rounds up with probability
    1/2 on its own draw: about half of 2000 go up, not all or none."""
    x = np.full(2001, 0.5, np.float32)
    x[0] = 1.0
    out, _ = QsgdCodec(1, 4096, seed=5).decode(QsgdCodec(1, 4096, seed=5).encode(x), 2001)
    ups = int(np.count_nonzero(out[1:]))
    assert 800 < ups < 1200, ups


def test_error_feedback_reset_of_an_unknown_name() -> None:
    fb = ErrorFeedback(TopKCodec(0.5))
    fb.reset("never-sent")
    fb.reset()


def test_qsgd_level_one_above_s_is_refused(encoder: str) -> None:
    """s = 6 takes 4-bit codes, whose levels reach 7 = s + 1: level 7 is refused."""
    with pytest.raises(FdtcProtocolError, match="level above s=6"):
        QsgdCodec().decode(_qsgd_frame(4, 6, [1.0], bytes([0x0E, 0x00])), 3)
    with pytest.raises(FdtcProtocolError, match=r"^QSGD bucket norms must be finite"):
        QsgdCodec().decode(_qsgd_frame(4, 6, [-1.0], bytes(2)), 3)


def test_codecs_take_python_floats_as_f32() -> None:
    _, vals = topk_compress([3.0, 1.0, -2.0], 2)
    assert vals.dtype == np.dtype(np.float32) and vals.tolist() == [3.0, -2.0]


@pytest.mark.parametrize("numels", [[1], [7, 3], [1000, 1, 65537], [70000]])
def test_no_codec_writes_more_than_the_largest_section_bound(numels: list[int]) -> None:
    """The coordinator sizes its links' largest message by ``largest_section``: every codec at
    its largest parameters (top-k keeping all, QSGD with one norm an element) stays under it."""
    rng = np.random.default_rng(len(numels))
    arrays = [rng.standard_normal(n).astype(np.float32) for n in numels]
    widest = [
        get_codec(Compression.NONE),
        get_codec(Compression.FP16),
        get_codec(Compression.TOPK, topk_ratio=1.0),
        get_codec(Compression.QSGD, qsgd_levels=127, qsgd_bucket=1),
    ]
    sizes = [len(codec.encode_section(arrays)) for codec in widest]
    assert max(sizes) <= largest_section(numels)
    assert sizes[2] == sum(
        get_codec(Compression.TOPK, topk_ratio=1.0).encoded_size(n) for n in numels
    )
