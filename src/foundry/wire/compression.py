"""Gradient codecs for the GRADIENTS data section: NONE, FP16, TOPK, QSGD, plus error feedback.

Python counterparts of the seed's sw_serialize_tensor / sw_deserialize_tensor /
sw_estimate_compressed_size / sw_fp32_to_fp16 / sw_fp16_to_fp32 / sw_topk_compress /
sw_topk_decompress. One ``Codec`` subclass per ``Compression`` wire value, found through
``CODECS`` (checked at import to cover every value). A codec is sans-IO and works on one
flat f32 tensor at a time; ``serialize_tensors`` / ``deserialize_tensors`` do a whole data
section, tensors back to back in WEIGHTS_META order, no padding between them.

Per-tensor layouts (all little-endian; ``docs/protocol.md`` has the tables):

- NONE: ``numel`` f32. 4 bytes per element.
- FP16: ``numel`` IEEE binary16, round to nearest even. Finite values beyond the f16 range
  saturate to +-65504 (a gradient clipped, not turned into an infinity that poisons the
  average); +-inf stay +-inf, NaN stays NaN. 2 bytes per element.
- TOPK: ``u32 k``, ``u32 counts[ceil(n / 65536)]`` (kept elements per block of 65536),
  ``f32 values[k]``, ``u16 low[k]`` (index mod 65536), indices ascending. 6 bytes per kept
  element plus 4 per 65536 elements: 66.6x smaller than NONE at 1 %, with exact f32 values
  (f16 values would flush small gradients to zero). k = ceil(ratio * n), at least 1.
- QSGD (Alistarh et al. 2017): ``u32 bucket``, ``u32 s``, ``f32 norm[ceil(n / bucket)]``,
  then one ``b = 1 + bit_length(s)``-bit code per element, ``level << 1 | sign``, packed
  LSB-first (element i in stream bits [i*b, (i+1)*b)). Decoded value: sign * norm * level/s.

TOPK and QSGD refuse NaN/inf input (LocalProtocolError): a non-finite gradient is a training
bug to stop at the worker, not something to select or quantise. All decoders treat their
input as a peer's bytes: truncated or inconsistent data raises FdtcProtocolError.
"""

from __future__ import annotations

import math
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import Compression

__all__ = [
    "CODECS",
    "Codec",
    "ErrorFeedback",
    "Fp16Codec",
    "NoneCodec",
    "QsgdCodec",
    "TopKCodec",
    "deserialize_tensors",
    "estimate_compressed_size",
    "fp16_to_fp32",
    "fp32_to_fp16",
    "get_codec",
    "serialize_tensors",
    "topk_compress",
    "topk_decompress",
]

F32Array = npt.NDArray[np.float32]
Buffer = bytes | bytearray | memoryview

DEFAULT_TOPK_RATIO = 0.01
DEFAULT_QSGD_LEVELS = 127  # s: 8-bit codes; variance bound 0.03 * ||v||^2 per 512-bucket
DEFAULT_QSGD_BUCKET = 512
MAX_QSGD_LEVELS = 127  # codes are at most 8 bits (7 of level, 1 of sign)
TOPK_BLOCK = 1 << 16  # TOPK indices are stored as u16 offsets within blocks of this size
# Elements per step of the FP16 kernels: the temporaries (4 x 256 KiB) stay in cache, which
# makes the dozen passes of bit arithmetic about as cheap as one pass over memory.
_CHUNK = 1 << 16
_U32 = struct.Struct("<I")
_QSGD_HEAD = struct.Struct("<II")  # bucket, levels


def _flat_f32(x: npt.ArrayLike) -> F32Array:
    """A C-contiguous 1-D float32 view of x (a copy only if x is not already that)."""
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def _need(buf: Buffer, nbytes: int, what: str) -> None:
    if len(buf) < nbytes:
        raise FdtcProtocolError(f"{what} needs {nbytes} bytes, only {len(buf)} left")


class Codec(ABC):
    """One wire compression: ``encode`` a flat f32 tensor, ``decode`` it back.

    ``encoded_size(numel)`` is exact: it equals ``len(encode(x))`` for every x of that size,
    so a sender can size buffers and the receiver's estimate never lies.
    """

    compression: ClassVar[Compression]
    lossy: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.compression in CODECS:
            raise RuntimeError(f"two codecs for {cls.compression.name}")
        CODECS[cls.compression] = cls

    @classmethod
    def from_params(
        cls, *, topk_ratio: float, qsgd_levels: int, qsgd_bucket: int, seed: int | None
    ) -> Self:
        """Build from ``get_codec``'s keyword set; each codec takes what it uses."""
        return cls()

    @abstractmethod
    def encoded_size(self, numel: int) -> int: ...

    @abstractmethod
    def encode(self, x: npt.ArrayLike) -> bytes | bytearray:
        """x flattened (C order) to f32, encoded."""

    @abstractmethod
    def decode(self, buf: Buffer, numel: int) -> tuple[F32Array, int]:
        """The f32 tensor at the start of ``buf`` and the bytes it took. ``buf`` may hold
        more (the rest of a data section). The array may be a read-only view of ``buf``."""

    def encode_section(self, arrays: Iterable[npt.ArrayLike]) -> bytes | memoryview:
        """A data section: each array encoded, back to back."""
        return b"".join(self.encode(a) for a in arrays)


CODECS: dict[Compression, type[Codec]] = {}


# ---------------------------------------------------------------------------- NONE


class NoneCodec(Codec):
    compression = Compression.NONE
    lossy = False

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: npt.ArrayLike) -> bytes:
        return _flat_f32(x).astype("<f4", copy=False).tobytes()

    def decode(self, buf: Buffer, numel: int) -> tuple[F32Array, int]:
        _need(buf, 4 * numel, f"NONE tensor of {numel} elements")
        return np.frombuffer(buf, dtype="<f4", count=numel), 4 * numel

    def encode_section(self, arrays: Iterable[npt.ArrayLike]) -> memoryview:
        # The values back to back: one copy into the section, no bytes object per tensor.
        flat = [_flat_f32(a) for a in arrays]
        section = np.concatenate(flat) if flat else np.empty(0, np.float32)
        return section.astype("<f4", copy=False).data.cast("B")


# ---------------------------------------------------------------------------- FP16
#
# numpy's own float16 cast is a scalar software loop (2.5 ns/element, 10x slower on inputs
# that become f16 subnormals, which small gradients do). These kernels do the same IEEE
# round-to-nearest-even in a dozen vectorised integer passes over cache-sized chunks.

_F16_MIN_NORMAL_BITS = 0x3880_0000  # f32 bits of 2**-14, the smallest normal f16
_F16_OVERFLOW_BITS = 0x477F_F000  # f32 bits of 65520: from here RNE would give inf
_F32_INF_BITS = 0x7F80_0000
_HALF = np.float32(0.5)
_HALF_BITS = 0x3F00_0000
# Normal path: add the exponent rebias (127 - 15) << 23 (as a wrapping u32) and the
# round-half-up bias 0xFFF; the lowest kept mantissa bit is added separately to get ties to
# even; >> 13 drops the 13 extra mantissa bits.
_REBIAS_AND_ROUND = np.uint32((-(112 << 23) + 0xFFF) & 0xFFFF_FFFF)


def fp32_to_fp16(
    src: npt.ArrayLike, out: npt.NDArray[np.uint16] | None = None
) -> npt.NDArray[np.uint16]:
    """sw_fp32_to_fp16: IEEE binary16 bits of each f32, round to nearest even, finite
    overflow saturated to +-65504 (0x7BFF), +-inf kept, NaN -> quiet NaN (0x7E00, sign kept).
    """
    x = _flat_f32(src)
    n = x.size
    if out is None:
        out = np.empty(n, dtype="<u2")
    u = x.view(np.uint32)
    c = min(_CHUNK, max(n, 1))
    f, t, s = (np.empty(c, np.uint32) for _ in range(3))
    small = np.empty(c, np.int32)
    # inf/NaN bit patterns go through the float add below before being replaced; a
    # signalling NaN there would only raise a spurious "invalid" flag.
    with np.errstate(invalid="ignore"):
        for i in range(0, n, c):
            ui = u[i : i + c]
            k = ui.size
            fk, tk, sk, mk = f[:k], t[:k], s[:k], small[:k]
            np.bitwise_and(ui, 0x7FFF_FFFF, out=fk)  # |x| bits
            # Normal f16 results: RNE on the 13 dropped mantissa bits, then rebias.
            np.right_shift(fk, 13, out=tk)
            np.bitwise_and(tk, 1, out=tk)
            np.add(tk, fk, out=tk)
            np.add(tk, _REBIAS_AND_ROUND, out=tk)
            np.right_shift(tk, 13, out=tk)
            # Subnormal (and zero) results: in |x| + 0.5 the float unit rounds |x| to a
            # multiple of 2**-24 (the f16 subnormal step) in one correctly rounded add.
            np.add(fk.view(np.float32), _HALF, out=sk.view(np.float32))
            np.subtract(sk, _HALF_BITS, out=sk)
            # Pick the subnormal result where |x| < 2**-14 with a branch-free blend,
            # t ^= (t ^ s) & mask: a masked copy mispredicts on mixed gradient data.
            np.subtract(fk.view(np.int32), _F16_MIN_NORMAL_BITS, out=mk)
            np.right_shift(mk, 31, out=mk)  # arithmetic: -1 (all ones) where smaller
            np.bitwise_xor(sk, tk, out=sk)
            np.bitwise_and(sk, mk.view(np.uint32), out=sk)
            np.bitwise_xor(tk, sk, out=tk)
            if fk.max() >= _F16_OVERFLOW_BITS:  # rare: saturate, keep inf, quiet NaN
                big = np.flatnonzero(fk >= _F16_OVERFLOW_BITS)
                fb = fk[big]
                tk[big] = np.where(
                    fb > _F32_INF_BITS, 0x7E00, np.where(fb == _F32_INF_BITS, 0x7C00, 0x7BFF)
                )
            np.right_shift(ui, 16, out=sk)
            np.bitwise_and(sk, 0x8000, out=sk)  # the sign, moved to bit 15
            np.bitwise_or(tk, sk, out=out[i : i + k], casting="unsafe")
    return out


def fp16_to_fp32(src: npt.ArrayLike, out: F32Array | None = None) -> F32Array:
    """sw_fp16_to_fp32: f32 values of IEEE binary16 bit patterns (exact; NaN payload kept)."""
    h = np.ascontiguousarray(src, dtype=np.uint16).reshape(-1).view(np.int16)
    n = h.size
    if out is None:
        out = np.empty(n, dtype=np.float32)
    w = out.view(np.int32)
    scale = np.float32(2.0**112)
    for i in range(0, n, _CHUNK):
        wk = w[i : i + _CHUNK]
        wk[...] = h[i : i + _CHUNK]  # sign-extends: bits 31..15 = the sign
        # Shift exponent+mantissa into f32 position and clear the three stray sign copies
        # (bits 28..30). The result is the f16 value scaled by 2**-112, exactly, for normals
        # and subnormals alike; the multiply puts the exponent right.
        np.left_shift(wk, 13, out=wk)
        np.bitwise_and(wk, np.int32(-0x7000_0001), out=wk)  # 0x8FFFFFFF
        fk = out[i : i + _CHUNK]
        np.multiply(fk, scale, out=fk)
        if fk.max() >= 65536.0 or fk.min() <= -65536.0:  # f16 inf/NaN landed at 2**16..2**17
            bad = np.flatnonzero(np.abs(fk) >= 65536.0)
            hb = h[i + bad].astype(np.int32) & 0xFFFF
            wk[bad] = ((hb & 0x8000) << 16) | _F32_INF_BITS | ((hb & 0x3FF) << 13)
    return out


class Fp16Codec(Codec):
    compression = Compression.FP16

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: npt.ArrayLike) -> bytearray:
        flat = _flat_f32(x)
        buf = bytearray(2 * flat.size)
        fp32_to_fp16(flat, out=np.frombuffer(buf, dtype="<u2"))
        return buf

    def decode(self, buf: Buffer, numel: int) -> tuple[F32Array, int]:
        _need(buf, 2 * numel, f"FP16 tensor of {numel} elements")
        return fp16_to_fp32(np.frombuffer(buf, dtype="<u2", count=numel)), 2 * numel


# ---------------------------------------------------------------------------- TOPK


def topk_k(numel: int, ratio: float) -> int:
    """Elements TOPK keeps: ceil(ratio * numel), at least 1 of a non-empty tensor."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(ratio * numel)))


def topk_size(numel: int, k: int) -> int:
    return 4 + 4 * -(-numel // TOPK_BLOCK) + 6 * k


def topk_compress(
    values: npt.ArrayLike, k: int
) -> tuple[npt.NDArray[np.uint32], F32Array]:
    """sw_topk_compress: indices (ascending) and values of the k largest magnitudes.

    Exactly the k largest |x| are kept; where several elements tie with the k-th largest
    magnitude, the lowest indices win, so the choice is deterministic. O(n): one
    ``np.partition`` (introselect) for the threshold, no sort of the tensor.
    """
    x = _flat_f32(values)
    n = x.size
    if not 0 <= k <= n:
        raise LocalProtocolError(f"k {k} is outside 0..{n}")
    if k == 0:
        return np.empty(0, np.uint32), np.empty(0, np.float32)
    mag = np.abs(x)
    if not math.isfinite(float(mag.max())):  # max propagates NaN
        raise LocalProtocolError("TOPK input holds NaN or inf; refusing to compress it")
    if k == n:
        idx = np.arange(n, dtype=np.uint32)
    else:
        kth = np.partition(mag, n - k)[n - k]  # the k-th largest magnitude
        above = np.flatnonzero(mag > kth)
        ties = np.flatnonzero(mag == kth)[: k - above.size]
        idx = np.union1d(above, ties).astype(np.uint32) if ties.size else above.astype(
            np.uint32
        )
    return idx, x[idx]


def topk_decompress(
    indices: npt.ArrayLike, values: npt.ArrayLike, n: int
) -> F32Array:
    """sw_topk_decompress: a zero tensor of n elements with ``values`` at ``indices``."""
    idx = np.asarray(indices).reshape(-1)
    vals = _flat_f32(values)
    if idx.size != vals.size:
        raise LocalProtocolError(f"{idx.size} indices but {vals.size} values")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise LocalProtocolError(f"an index is outside 0..{n - 1}")
    out = np.zeros(n, dtype=np.float32)
    out[idx] = vals
    return out


class TopKCodec(Codec):
    compression = Compression.TOPK

    def __init__(self, ratio: float = DEFAULT_TOPK_RATIO) -> None:
        if not 0.0 < ratio <= 1.0:
            raise LocalProtocolError(f"topk_ratio {ratio} is outside (0, 1]")
        self.ratio = ratio

    @classmethod
    def from_params(
        cls, *, topk_ratio: float, qsgd_levels: int, qsgd_bucket: int, seed: int | None
    ) -> Self:
        return cls(topk_ratio)

    def encoded_size(self, numel: int) -> int:
        return topk_size(numel, topk_k(numel, self.ratio))

    def encode(self, x: npt.ArrayLike) -> bytearray:
        flat = _flat_f32(x)
        n = flat.size
        k = topk_k(n, self.ratio)
        idx, vals = topk_compress(flat, k)
        n_blocks = -(-n // TOPK_BLOCK)
        buf = bytearray(topk_size(n, k))
        _U32.pack_into(buf, 0, k)
        counts = np.bincount(idx >> 16, minlength=n_blocks)
        np.frombuffer(buf, "<u4", n_blocks, 4)[:] = counts
        pos = 4 + 4 * n_blocks
        np.frombuffer(buf, "<f4", k, pos)[:] = vals
        np.frombuffer(buf, "<u2", k, pos + 4 * k)[:] = idx & 0xFFFF
        return buf

    def decode(self, buf: Buffer, numel: int) -> tuple[F32Array, int]:
        _need(buf, 4, "TOPK tensor header")
        (k,) = _U32.unpack_from(buf, 0)
        if k > numel:
            raise FdtcProtocolError(f"TOPK keeps {k} of a {numel}-element tensor")
        n_blocks = -(-numel // TOPK_BLOCK)
        size = topk_size(numel, k)
        _need(buf, size, f"TOPK tensor of {numel} elements keeping {k}")
        counts = np.frombuffer(buf, "<u4", n_blocks, 4)
        pos = 4 + 4 * n_blocks
        vals = np.frombuffer(buf, "<f4", k, pos)
        low = np.frombuffer(buf, "<u2", k, pos + 4 * k)
        if int(counts.sum(dtype=np.int64)) != k:
            raise FdtcProtocolError(f"TOPK block counts add up to {counts.sum()}, not k={k}")
        blocks = np.repeat(np.arange(n_blocks, dtype=np.int64), counts)
        idx = blocks * TOPK_BLOCK + low
        if k and (idx[-1] >= numel or (k > 1 and not bool(np.all(np.diff(idx) > 0)))):
            raise FdtcProtocolError("TOPK indices are out of range or not strictly ascending")
        out = np.zeros(numel, dtype=np.float32)
        out[idx] = vals
        return out, size


# ---------------------------------------------------------------------------- QSGD


def _qsgd_bits(levels: int) -> int:
    return 1 + levels.bit_length()


def _qsgd_size(numel: int, bucket: int, levels: int) -> int:
    return _QSGD_HEAD.size + 4 * -(-numel // bucket) + -(-numel * _qsgd_bits(levels) // 8)


def _pack_codes(codes: npt.NDArray[np.uint8], bits: int) -> npt.NDArray[np.uint8]:
    """b-bit codes into an LSB-first bit stream of ceil(n*b/8) bytes (b <= 8)."""
    n = codes.size
    if bits == 8:
        return codes
    groups = -(-n // 8)  # 8 codes = b bytes exactly
    padded = np.zeros(groups * 8, np.uint8)
    padded[:n] = codes
    g = padded.reshape(groups, 8).astype("<u8")
    word = g[:, 0].copy()
    for j in range(1, 8):
        word |= g[:, j] << np.uint64(bits * j)
    stream = word.view(np.uint8).reshape(groups, 8)[:, :bits].reshape(-1)
    return stream[: -(-n * bits // 8)]


def _unpack_codes(stream: npt.NDArray[np.uint8], n: int, bits: int) -> npt.NDArray[np.uint8]:
    if bits == 8:
        return stream[:n]
    groups = -(-n // 8)
    g = np.zeros((groups, 8), np.uint8)
    flat = np.zeros(groups * bits, np.uint8)
    flat[: stream.size] = stream
    g[:, :bits] = flat.reshape(groups, bits)
    word = g.view("<u8").reshape(groups)
    mask = np.uint64((1 << bits) - 1)
    codes = np.empty((groups, 8), np.uint8)
    for j in range(8):
        codes[:, j] = (word >> np.uint64(bits * j)) & mask
    return codes.reshape(-1)[:n]


class QsgdCodec(Codec):
    """QSGD: per bucket of d elements, the L2 norm and for each element a sign and a level
    l in 0..s with P(l = floor(r) + 1) = r - floor(r), r = s |v_i| / ||v||. Unbiased:
    E[decode] = v, and Var <= min(d / s^2, sqrt(d) / s) ||v||^2 per bucket.
    """

    compression = Compression.QSGD

    def __init__(
        self,
        levels: int = DEFAULT_QSGD_LEVELS,
        bucket: int = DEFAULT_QSGD_BUCKET,
        seed: int | None = None,
    ) -> None:
        if not 1 <= levels <= MAX_QSGD_LEVELS:
            raise LocalProtocolError(f"qsgd_levels {levels} is outside 1..{MAX_QSGD_LEVELS}")
        if not 1 <= bucket <= 0xFFFF_FFFF:
            raise LocalProtocolError(f"qsgd_bucket {bucket} must be a positive u32")
        self.levels = levels
        self.bucket = bucket
        self.bits = _qsgd_bits(levels)
        self.rng = np.random.default_rng(seed)

    @classmethod
    def from_params(
        cls, *, topk_ratio: float, qsgd_levels: int, qsgd_bucket: int, seed: int | None
    ) -> Self:
        return cls(qsgd_levels, qsgd_bucket, seed)

    def encoded_size(self, numel: int) -> int:
        return _qsgd_size(numel, self.bucket, self.levels)

    def encode(self, x: npt.ArrayLike) -> bytearray:
        flat = _flat_f32(x)
        n, d, s = flat.size, self.bucket, self.levels
        n_buckets = -(-n // d)
        v = flat
        if n_buckets * d != n:  # zero padding adds nothing to a norm and gets level 0
            v = np.zeros(n_buckets * d, np.float32)
            v[:n] = flat
        v2 = v.reshape(n_buckets, d)
        norms = np.sqrt(np.einsum("ij,ij->i", v2, v2)).astype(np.float32)
        if not bool(np.isfinite(norms).all()):
            raise LocalProtocolError(
                "QSGD input holds NaN, inf or values whose square overflows f32"
            )
        with np.errstate(divide="ignore"):
            scale = np.where(norms > 0, np.float32(s) / norms, np.float32(0)).astype(np.float32)
        r = np.abs(v2)
        r *= scale[:, None]
        # Stochastic rounding: floor(r + u), u ~ U[0, 1), is floor(r) + 1 with probability
        # r - floor(r). min(., s) guards the one element of a bucket that can round to s + eps.
        r += self.rng.random(r.shape, dtype=np.float32)
        np.floor(r, out=r)
        np.minimum(r, np.float32(s), out=r)
        codes = r.reshape(-1)[:n].astype(np.uint8)
        codes <<= 1
        codes |= np.signbit(flat)
        buf = bytearray(self.encoded_size(n))
        _QSGD_HEAD.pack_into(buf, 0, d, s)
        np.frombuffer(buf, "<f4", n_buckets, _QSGD_HEAD.size)[:] = norms
        stream = _pack_codes(codes, self.bits)
        pos = _QSGD_HEAD.size + 4 * n_buckets
        np.frombuffer(buf, np.uint8, stream.size, pos)[:] = stream
        return buf

    def decode(self, buf: Buffer, numel: int) -> tuple[F32Array, int]:
        _need(buf, _QSGD_HEAD.size, "QSGD tensor header")
        d, s = _QSGD_HEAD.unpack_from(buf, 0)
        if d < 1 or not 1 <= s <= MAX_QSGD_LEVELS:
            raise FdtcProtocolError(f"QSGD bucket {d} / levels {s} out of range")
        bits = _qsgd_bits(s)
        size = _qsgd_size(numel, d, s)
        _need(buf, size, f"QSGD tensor of {numel} elements")
        n_buckets = -(-numel // d)
        norms = np.frombuffer(buf, "<f4", n_buckets, _QSGD_HEAD.size)
        if n_buckets and not (bool(np.isfinite(norms).all()) and norms.min() >= 0):
            raise FdtcProtocolError("QSGD bucket norms must be finite and non-negative")
        pos = _QSGD_HEAD.size + 4 * n_buckets
        stream = np.frombuffer(buf, np.uint8, size - pos, pos)
        codes = _unpack_codes(stream, numel, bits)
        levels = codes >> 1
        if (1 << (bits - 1)) - 1 > s and numel and int(levels.max()) > s:
            raise FdtcProtocolError(f"QSGD level above s={s}")
        # Signed level in int8 (|level| <= 127) by two's complement: (l ^ m) + sign with
        # m = -sign (0 or 0xFF). Integer passes; a masked float negate is 10x slower.
        sign = codes & 1
        levels ^= 0 - sign
        levels += sign
        out = np.zeros(n_buckets * d, np.float32)
        out[:numel] = levels.view(np.int8)
        out.reshape(n_buckets, d)[...] *= (norms / np.float32(s))[:, None]
        return out[:numel], size


# ---------------------------------------------------------------------------- registry


def _check_registry() -> None:
    missing = sorted(c.name for c in Compression if c not in CODECS)
    if missing:
        raise RuntimeError(f"no codec for compression {', '.join(missing)}")


_check_registry()


def get_codec(
    compression: Compression | int,
    *,
    topk_ratio: float = DEFAULT_TOPK_RATIO,
    qsgd_levels: int = DEFAULT_QSGD_LEVELS,
    qsgd_bucket: int = DEFAULT_QSGD_BUCKET,
    seed: int | None = None,
) -> Codec:
    """The codec for a wire compression value, with its parameters (others are ignored)."""
    try:
        cls = CODECS[Compression(compression)]
    except ValueError:
        raise LocalProtocolError(f"unknown compression {compression!r}") from None
    return cls.from_params(
        topk_ratio=topk_ratio, qsgd_levels=qsgd_levels, qsgd_bucket=qsgd_bucket, seed=seed
    )


def estimate_compressed_size(numel: int, compression: Compression | int, **params: Any) -> int:
    """sw_estimate_compressed_size, exact: bytes ``numel`` elements take on the wire."""
    return get_codec(compression, **params).encoded_size(numel)


def serialize_tensors(
    arrays: Iterable[npt.ArrayLike], compression: Compression | int, **params: Any
) -> bytes | memoryview:
    """sw_serialize_tensor for each tensor, back to back: a GRADIENTS data section."""
    return get_codec(compression, **params).encode_section(arrays)


def deserialize_tensors(
    buf: Buffer, numels: Sequence[int], compression: Compression | int
) -> list[F32Array]:
    """sw_deserialize_tensor for each tensor of a data section; every byte must be used."""
    codec = get_codec(compression)  # the layouts carry their own parameters
    view = memoryview(buf).cast("B")
    out: list[F32Array] = []
    pos = 0
    for i, numel in enumerate(numels):
        try:
            array, used = codec.decode(view[pos:], numel)
        except FdtcProtocolError as exc:
            raise FdtcProtocolError(f"tensor {i} of {len(numels)}: {exc}") from None
        out.append(array)
        pos += used
    if pos != len(view):
        raise FdtcProtocolError(
            f"{len(view) - pos} bytes left over after {len(numels)} tensors"
        )
    return out


# ---------------------------------------------------------------------------- error feedback


class ErrorFeedback:
    """Error feedback (residual memory) around any codec: what compression dropped from a
    tensor is added to that tensor's next gradient, so nothing is lost for good.

    Invariant: sum of decoded transmissions + current residual == sum of inputs.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residual: dict[str, F32Array] = {}

    def compress(self, name: str, grad: npt.ArrayLike) -> bytes | bytearray:
        x = _flat_f32(grad)
        residual = self._residual.get(name)
        if residual is not None:
            if residual.size != x.size:
                raise LocalProtocolError(
                    f"{name}: gradient has {x.size} elements, its residual {residual.size}; "
                    "call reset() when the model changes"
                )
            x = x + residual
        data = self.codec.encode(x)
        sent, _ = self.codec.decode(data, x.size)
        self._residual[name] = x - sent
        return data

    def residual(self, name: str) -> F32Array | None:
        return self._residual.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget one tensor's residual, or all of them."""
        if name is None:
            self._residual.clear()
        else:
            self._residual.pop(name, None)
