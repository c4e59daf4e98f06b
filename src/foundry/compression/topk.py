"""TOPK: the k largest magnitudes with their indices, exact f32 values.

Layout: ``u32 k``, ``u32 counts[ceil(n / 65536)]`` (kept elements per block of 65536),
``f32 values[k]``, ``u16 low[k]`` (index mod 65536), indices ascending. 6 bytes per kept
element plus 4 per 65536 elements: 66.6x smaller than NONE at 1 %, with exact f32 values
(f16 values would flush small gradients to zero). k = ceil(ratio * n), at least 1. NaN/inf
input is refused (LocalProtocolError): a training bug to stop at the sender.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from foundry.compression.base import Buffer, Codec, CodecParams, F32Array, flat_f32, need
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import Compression

DEFAULT_TOPK_RATIO = 0.01
TOPK_BLOCK = 1 << 16  # TOPK indices are stored as u16 offsets within blocks of this size
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class TopKParams(CodecParams):
    topk_ratio: float = DEFAULT_TOPK_RATIO  # share of the elements kept, in (0, 1]


def topk_k(numel: int, ratio: float) -> int:
    """Elements TOPK keeps: ceil(ratio * numel), at least 1 of a non-empty tensor."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(ratio * numel)))


def topk_size(numel: int, k: int) -> int:
    return 4 + 4 * -(-numel // TOPK_BLOCK) + 6 * k


def topk_compress(values: npt.ArrayLike, k: int) -> tuple[npt.NDArray[np.uint32], F32Array]:
    """sw_topk_compress: indices (ascending) and values of the k largest magnitudes.

    Exactly the k largest |x| are kept; where several elements tie with the k-th largest
    magnitude, the lowest indices win, so the choice is deterministic. O(n): one
    ``np.partition`` (introselect) for the threshold, no sort of the tensor.
    """
    x = flat_f32(values)
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
        idx = np.union1d(above, ties).astype(np.uint32) if ties.size else above.astype(np.uint32)
    return idx, x[idx]


def topk_decompress(indices: npt.ArrayLike, values: npt.ArrayLike, n: int) -> F32Array:
    """sw_topk_decompress: a zero tensor of n elements with ``values`` at ``indices``."""
    idx = np.asarray(indices).reshape(-1)
    vals = flat_f32(values)
    if idx.size != vals.size:
        raise LocalProtocolError(f"{idx.size} indices but {vals.size} values")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise LocalProtocolError(f"an index is outside 0..{n - 1}")
    out = np.zeros(n, dtype=np.float32)
    out[idx] = vals
    return out


class TopKCodec(Codec):
    compression = Compression.TOPK

    Params = TopKParams

    def __init__(self, ratio: float = DEFAULT_TOPK_RATIO) -> None:
        if not 0.0 < ratio <= 1.0:
            raise LocalProtocolError(f"topk_ratio {ratio} is outside (0, 1]")
        self.ratio = ratio

    @classmethod
    def from_params(cls, params: CodecParams) -> TopKCodec:
        assert isinstance(params, TopKParams)
        return cls(params.topk_ratio)

    def encoded_size(self, numel: int) -> int:
        return topk_size(numel, topk_k(numel, self.ratio))

    def encode(self, x: npt.ArrayLike) -> bytearray:
        flat = flat_f32(x)
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
        need(buf, 4, "TOPK tensor header")
        (k,) = _U32.unpack_from(buf, 0)
        if k > numel:
            raise FdtcProtocolError(f"TOPK keeps {k} of a {numel}-element tensor")
        n_blocks = -(-numel // TOPK_BLOCK)
        size = topk_size(numel, k)
        need(buf, size, f"TOPK tensor of {numel} elements keeping {k}")
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
