"""The FP16 gradient codec: round to nearest even bit for bit, saturation, infinities and NaNs,
its error budget.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest

from foundry.compression import Fp16Codec, fp16_to_fp32, fp32_to_fp16

F32 = npt.NDArray[np.float32]


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
