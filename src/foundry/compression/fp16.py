"""FP16: ``numel`` IEEE binary16, round to nearest even, 2 bytes per element.

Finite values beyond the f16 range saturate to +-65504 (a gradient clipped, not turned into an
infinity that poisons the average); +-inf stay +-inf, NaN stays NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from foundry.compression.base import Buffer, Codec, CodecParams, F32Array, flat_f32, need
from foundry.wire.fdtc import Compression

# Elements per step of the FP16 kernels: the temporaries (4 x 256 KiB) stay in cache, which
# makes the dozen passes of bit arithmetic about as cheap as one pass over memory.
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Fp16Params(CodecParams):
    """FP16 has no parameters."""


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
    x = flat_f32(src)
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
    Params = Fp16Params

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: npt.ArrayLike) -> bytearray:
        flat = flat_f32(x)
        buf = bytearray(2 * flat.size)
        fp32_to_fp16(flat, out=np.frombuffer(buf, dtype="<u2"))
        return buf

    def decode(self, buf: Buffer, numel: int) -> tuple[F32Array, int]:
        need(buf, 2 * numel, f"FP16 tensor of {numel} elements")
        return fp16_to_fp32(np.frombuffer(buf, dtype="<u2", count=numel)), 2 * numel
