"""QSGD (Alistarh et al. 2017): per bucket a scale, per element a sign and a level.

Layout: ``u32 bucket``, ``u32 s``, ``f32 scale[ceil(n / bucket)]``, then one
``b = 1 + bit_length(s)``-bit code per element, ``level << 1 | sign``, packed LSB-first
(element i in stream bits [i*b, (i+1)*b)). Decoded value: sign * scale * level/s.

The encoder's scale is the bucket's largest magnitude (QSGD's max-norm form) rather than the
paper's L2 norm: the decoder is the same, the rounding stays unbiased, and the error of each
element is below scale / s instead of ||v|| / s, which makes 4- and 3-bit codes usable
(docs/protocol.md, "QSGD").
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from foundry.compression.base import Buffer, Codec, CodecParams, F32Array, flat_f32, need
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import MAX_QSGD_LEVELS, Compression

DEFAULT_QSGD_LEVELS = 127  # s: 8-bit codes; each element within max|v| / 127 of its value
DEFAULT_QSGD_BUCKET = 512
_QSGD_HEAD = struct.Struct("<II")  # bucket, levels

_qsgd: ModuleType | None
try:  # the C encoder (setup.py builds it where a compiler is found; it writes native floats)
    from foundry.compression import _qsgd  # type: ignore[attr-defined, no-redef]
except ImportError:
    _qsgd = None
if sys.byteorder != "little":
    _qsgd = None
# Which encoder runs: "c" or "numpy" (the same layout and decoder; other random draws).
ENCODER = "numpy" if _qsgd is None else "c"


@dataclass(frozen=True)
class QsgdParams(CodecParams):
    qsgd_levels: int = DEFAULT_QSGD_LEVELS  # s, 1..127
    qsgd_bucket: int = DEFAULT_QSGD_BUCKET  # elements per norm
    seed: int | None = None  # of the stochastic rounding


def _qsgd_bits(levels: int) -> int:
    return 1 + levels.bit_length()


def _qsgd_size(numel: int, bucket: int, levels: int) -> int:
    return _QSGD_HEAD.size + 4 * -(-numel // bucket) + -(-numel * _qsgd_bits(levels) // 8)


def _padded(codes: npt.NDArray[np.uint8], multiple: int) -> npt.NDArray[np.uint8]:
    short = -codes.size % multiple
    return np.concatenate([codes, np.zeros(short, np.uint8)]) if short else codes


def _word_type(bits: int) -> type[np.unsignedinteger[Any]]:
    """The integer that holds 8 codes of ``bits`` bits."""
    return np.uint32 if 8 * bits <= 32 else np.uint64


def _pack_codes(codes: npt.NDArray[np.uint8], bits: int) -> npt.NDArray[np.uint8]:
    """b-bit codes into an LSB-first bit stream of ceil(n*b/8) bytes (b <= 8)."""
    n = codes.size
    if bits == 8:
        return codes
    if 8 % bits == 0:  # whole codes per byte (1, 2, 4 bits): shifts of byte strides
        per = 8 // bits
        padded = _padded(codes, per)
        out = padded[0::per].copy()
        for j in range(1, per):
            out |= padded[j::per] << np.uint8(bits * j)
        return out
    # 8 codes are b bytes: one little-endian word of 8 shifted codes, its low b bytes.
    wt = _word_type(bits)
    padded = _padded(codes, 8)
    word = padded[0::8].astype(wt)
    for j in range(1, 8):
        word |= padded[j::8].astype(wt) << wt(bits * j)
    size = word.dtype.itemsize
    word = word.astype(word.dtype.newbyteorder("<"), copy=False)
    stream = word.view(np.uint8).reshape(-1, size)[:, :bits].reshape(-1)
    return stream[: -(-n * bits // 8)]


def _unpack_codes(stream: npt.NDArray[np.uint8], n: int, bits: int) -> npt.NDArray[np.uint8]:
    if bits == 8:
        return stream[:n]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        nbytes = -(-n // per)
        head = stream[:nbytes]
        out = np.empty(nbytes * per, np.uint8)
        for j in range(per):
            out[j::per] = (head >> np.uint8(bits * j)) & np.uint8(mask)
        return out[:n]
    wt = _word_type(bits)
    size = np.dtype(wt).itemsize
    groups = -(-n // 8)
    g = np.zeros((groups, size), np.uint8)
    flat = np.zeros(groups * bits, np.uint8)
    flat[: stream.size] = stream
    g[:, :bits] = flat.reshape(groups, bits)
    word = g.view(np.dtype(wt).newbyteorder("<")).reshape(groups)
    out = np.empty(groups * 8, np.uint8)
    for j in range(8):
        out[j::8] = (word >> wt(bits * j)) & wt(mask)
    return out[:n]


class QsgdCodec(Codec):
    """QSGD: per bucket of d elements, the scale m = max |v_i| and for each element a sign
    and a level l in 0..s with P(l = floor(r) + 1) = r - floor(r), r = s |v_i| / m. Unbiased:
    E[decode] = v, each element within m / s of v_i, and Var <= d m^2 / (4 s^2) per bucket
    (the L2 norm's bound is min(d / s^2, sqrt(d) / s) ||v||^2, with ||v||^2 up to d m^2).
    """

    compression = Compression.QSGD
    Params = QsgdParams

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
    def from_params(cls, params: CodecParams) -> QsgdCodec:
        assert isinstance(params, QsgdParams)
        return cls(params.qsgd_levels, params.qsgd_bucket, params.seed)

    def random_state(self) -> str:
        return json.dumps(self.rng.bit_generator.state, sort_keys=True)

    def set_random_state(self, state: str) -> None:
        try:
            self.rng.bit_generator.state = json.loads(state)
        except (ValueError, TypeError, KeyError) as exc:
            raise LocalProtocolError(f"not a QSGD generator state: {exc}") from None

    def encoded_size(self, numel: int) -> int:
        return _qsgd_size(numel, self.bucket, self.levels)

    def encode(self, x: npt.ArrayLike) -> bytearray:
        return self.encode_decoded(x, decoded=False)[0]

    def encode_decoded(self, x: npt.ArrayLike, decoded: bool = True) -> tuple[bytearray, F32Array]:
        """The encoding and (``decoded``) what it decodes to, bit for bit as ``decode`` gives
        it; with the C encoder both come from one pass (empty when not asked for)."""
        flat = flat_f32(x)
        if _qsgd is None:
            data = self._encode_numpy(flat)
            return data, (self.decode(data, flat.size)[0] if decoded else np.zeros(0, np.float32))
        n, d = flat.size, self.bucket
        n_buckets = -(-n // d)
        buf = bytearray(self.encoded_size(n))
        _QSGD_HEAD.pack_into(buf, 0, d, self.levels)
        pos = _QSGD_HEAD.size + 4 * n_buckets
        out = np.empty(n if decoded else 0, np.float32)
        try:
            _qsgd.encode(
                np.ascontiguousarray(flat, "<f4").data,
                d,
                self.levels,
                int(self.rng.integers(1 << 63)),
                memoryview(buf)[_QSGD_HEAD.size : pos],
                memoryview(buf)[pos:],
                out.data if decoded else None,
            )
        except ValueError as exc:
            raise LocalProtocolError(str(exc)) from None
        return buf, out

    def _encode_numpy(self, flat: F32Array) -> bytearray:
        n, d, s = flat.size, self.bucket, self.levels
        n_buckets = -(-n // d)
        v = flat
        if n_buckets * d != n:  # zero padding changes no maximum and gets level 0
            v = np.zeros(n_buckets * d, np.float32)
            v[:n] = flat
        r = np.abs(v.reshape(n_buckets, d))
        norms = r.max(axis=1)
        if not bool(np.isfinite(norms).all()):
            raise LocalProtocolError("QSGD input holds NaN or inf")
        # r = s |v_i| / m, as |v_i| times s / m (one pass); s / m overflows f32 for a bucket
        # whose largest magnitude is below about 4e-37: those few divide instead.
        with np.errstate(divide="ignore", over="ignore"):
            scale = np.where(norms > 0, np.float32(s) / norms, np.float32(0))
        tiny = ~np.isfinite(scale)
        scale[tiny] = 0
        r *= scale[:, None]
        if tiny.any():
            r[tiny] = np.abs(v.reshape(n_buckets, d)[tiny]) / norms[tiny, None] * np.float32(s)
        # Stochastic rounding: floor(r + u), u ~ U[0, 1), is floor(r) + 1 with probability
        # r - floor(r). min(., s) guards the largest element, whose r may round to s + eps.
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
        need(buf, _QSGD_HEAD.size, "QSGD tensor header")
        d, s = _QSGD_HEAD.unpack_from(buf, 0)
        if d < 1 or not 1 <= s <= MAX_QSGD_LEVELS:
            raise FdtcProtocolError(f"QSGD bucket {d} / levels {s} out of range")
        bits = _qsgd_bits(s)
        size = _qsgd_size(numel, d, s)
        need(buf, size, f"QSGD tensor of {numel} elements")
        n_buckets = -(-numel // d)
        # A bucket larger than the tensor is one bucket of the tensor: the same values, and
        # no allocation sized by the peer's field (nor a C size that overflows on 32 bits).
        d = min(d, max(numel, 1))
        # A copy: the tensor may start at any byte of its message, and the C decoder reads
        # the scales as floats (an unaligned float load faults on armv7).
        norms = np.frombuffer(buf, "<f4", n_buckets, _QSGD_HEAD.size).copy()
        if n_buckets and not (bool(np.isfinite(norms).all()) and norms.min() >= 0):
            raise FdtcProtocolError("QSGD bucket norms must be finite and non-negative")
        pos = _QSGD_HEAD.size + 4 * n_buckets
        stream = np.frombuffer(buf, np.uint8, size - pos, pos)
        if _qsgd is not None:
            values = np.empty(numel, np.float32)
            try:
                _qsgd.decode(stream.data, d, s, norms.data, values.data)
            except ValueError as exc:
                raise FdtcProtocolError(str(exc)) from None
            return values, size
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
