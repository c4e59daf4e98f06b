"""The QSGD gradient codec (C and numpy encoders): unbiased with bounded variance, packed codes,
its layout, limits and bad peer bytes.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import numpy.typing as npt
import pytest

from foundry.compression import QsgdCodec, qsgd
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError

F32 = npt.NDArray[np.float32]


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


def test_qsgd_rounds_each_element_independently(encoder: str) -> None:
    """Every element at r = 0.5 (s = 1, half the bucket maximum) rounds up with probability
    1/2 on its own draw: about half of 2000 go up, not all or none."""
    x = np.full(2001, 0.5, np.float32)
    x[0] = 1.0
    out, _ = QsgdCodec(1, 4096, seed=5).decode(QsgdCodec(1, 4096, seed=5).encode(x), 2001)
    ups = int(np.count_nonzero(out[1:]))
    assert 800 < ups < 1200, ups


def test_qsgd_level_one_above_s_is_refused(encoder: str) -> None:
    """s = 6 takes 4-bit codes, whose levels reach 7 = s + 1: level 7 is refused."""
    with pytest.raises(FdtcProtocolError, match="level above s=6"):
        QsgdCodec().decode(_qsgd_frame(4, 6, [1.0], bytes([0x0E, 0x00])), 3)
    with pytest.raises(FdtcProtocolError, match=r"^QSGD bucket norms must be finite"):
        QsgdCodec().decode(_qsgd_frame(4, 6, [-1.0], bytes(2)), 3)
