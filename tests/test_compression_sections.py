"""Gradient codecs as a whole: the registry covers every wire value, sizes are exact and
estimated exactly, data sections round-trip, any bytes decode to a tensor or a clean error.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry.compression import (
    CODECS,
    Codec,
    Fp16Codec,
    NoneCodec,
    QsgdCodec,
    TopKCodec,
    deserialize_tensors,
    estimate_compressed_size,
    get_codec,
    largest_section,
    serialize_tensors,
    topk_compress,
)
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import Compression


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


def test_none_codec_empty_section() -> None:
    assert bytes(NoneCodec().encode_section([])) == b""
    assert bytes(NoneCodec().encode_section([[1.0], []])) == struct.pack("<f", 1.0)


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
