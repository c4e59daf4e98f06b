"""Weights that are numbers: NaN and infinity found when a model is loaded, overflow when it
is written.

A loaded weight is checked once, over what the file stores, without expanding it:

- F32: the tensor's minimum and maximum (NaN propagates through both, an infinity is one of
  them), two passes of numpy's vectorised reductions and no copy;
- F16: the exponent bits of every value (all ones: infinity or NaN);
- block types: only the f16 scales of each block can be non-finite (the quants are small
  integers), so only their exponent bits are read (``scale_offsets`` of
  ``types.TYPES``, from ggml's block structs in ``ggml-common.h``).

The cost on the ``bench`` preset is measured by ``bench/performance/finite_check.py``
(docs/guide/recovering.md, "Faults and bad input").

Writing checks the other way: a value whose magnitude the target type cannot hold would become
an infinity (F16 holds up to 65,504; a Q8_0 block's scale is its largest magnitude / 127, in
f16), so the writer refuses the tensor, naming it and its largest magnitude.
"""

from __future__ import annotations

import math

import numpy as np

from foundry.model.kernels import quant
from foundry.model.kernels.types import TYPES, QType

# An f16 whose bits without the sign are at least this has an all-ones exponent: inf or NaN.
_F16_NONFINITE = 0x7C00
_F16_ABS = np.uint16(0x7FFF)
# Values per reduction: the scratch (and a chunk read twice) stays in the cache, the loop
# runs a few hundred times for the largest tensor, and a bad tensor stops the scan early.
_CHUNK = 1 << 18


def _f16_bits_nonfinite(bits: np.ndarray) -> bool:
    """Whether any of these f16 bit patterns (a 1-d uint16 view, maybe strided) is an
    infinity or a NaN."""
    scratch = np.empty(min(_CHUNK, bits.size), dtype=np.uint16)
    for i in range(0, bits.size, _CHUNK):
        part = bits[i : i + _CHUNK]
        out = scratch[: part.size]
        np.bitwise_and(part, _F16_ABS, out=out)
        if int(out.max()) >= _F16_NONFINITE:
            return True
    return False


def _f32_nonfinite(values: np.ndarray) -> bool:
    flat = values.reshape(-1)
    for i in range(0, flat.size, _CHUNK):
        part = flat[i : i + _CHUNK]
        if not (np.isfinite(part.min()) and np.isfinite(part.max())):
            return True
    return False


def nonfinite(p: quant.Param) -> str | None:
    """What is not finite in a stored weight ("NaN or inf among its values", "... in a block
    scale"), or None when every value it stands for is finite."""
    if isinstance(p, np.ndarray):
        return "NaN or infinity among its values" if _f32_nonfinite(p) else None
    data = np.ascontiguousarray(p.data).reshape(-1)
    if p.qtype == QType.F16:
        if _f16_bits_nonfinite(data.view("<u2")):
            return "NaN or infinity among its F16 values"
        return None
    block_bytes = TYPES[p.qtype].block_bytes
    n_blocks = data.size // block_bytes
    if n_blocks == 0:  # no values (a rank's slice of none: a rank without heads)
        return None
    for offset in TYPES[p.qtype].scale_offsets:
        # The f16 field at ``offset`` of every block, read in place (a strided view).
        bits = np.ndarray(
            (n_blocks,), dtype="<u2", buffer=data, offset=offset, strides=(block_bytes,)
        )
        if _f16_bits_nonfinite(bits):
            return f"NaN or infinity in a {p.qtype.name} block scale"
    return None


def largest_magnitude(a: np.ndarray) -> float:
    """max |a| (NaN when a holds one), without a temporary of a's size."""
    if a.size == 0:
        return 0.0
    hi, lo = float(a.max()), float(a.min())
    if math.isnan(hi) or math.isnan(lo):
        return math.nan
    return max(abs(hi), abs(lo))


def overflow(a: np.ndarray, qtype: QType) -> str | None:
    """Why ``a`` cannot be written as ``qtype`` (a value not finite, or too large for it), or
    None when it can."""
    big = largest_magnitude(a)
    if not np.isfinite(big):
        return "it holds NaN or infinity"
    limit = TYPES[qtype].storable_max if qtype in TYPES else None
    if limit is not None and big > limit:
        return (
            f"its largest magnitude {big:.6g} overflows {qtype.name} (at most {limit:.6g}); "
            "export as f32, or train with a smaller learning rate"
        )
    return None
