"""The quantization types, one row each, as ggml's ``type_traits``: what every other module
reads of a type (block size, bytes per block, nominal bits, where its f16 scales sit, the
largest magnitude it holds when written).

Block sizes are the ``gguf`` package's (``GGML_QUANT_SIZES``, ggml's own numbers); to and from
float are ``quant.dequantize`` / ``quant.quantize`` and the dot products ``csrc/`` (its
``type_block`` holds the same sizes, checked by ``tests/test_quant_kernels.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

QType = gguf.GGMLQuantizationType

# The largest finite f16: what an F16 value, and a block's f16 scale, can hold.
F16_MAX = 65504.0


@dataclass(frozen=True)
class TypeTraits:
    block_values: int
    """Values per block (1 for F16 and F32)."""
    block_bytes: int
    """Bytes per block."""
    nominal_bits: int
    """The bits a type is named after (Q4_K: 4), what a TP hello's ``quant_bits`` states."""
    scale_offsets: tuple[int, ...]
    """Byte offsets of the f16 fields (scale d, and min m / dmin where the type has one) inside
    one block (ggml-common.h: block_q8_0 {d, qs[32]}, block_q4_K {d, dmin, scales[12],
    qs[128]}, block_q6_K {ql[128], qh[64], scales[16], d}, ...): the only values of a block
    that can be NaN or infinite (``finite``)."""
    storable_max: float | None
    """The largest magnitude a written tensor of the type holds (None: not a type we write):
    the f16 maximum times the largest quant a block's scale multiplies (Q8_0: d = amax / 127;
    Q4_0: d = max / -8, gguf-py's quantizer)."""


def _row(qtype: QType, bits: int, scales: tuple[int, ...], most: float | None) -> TypeTraits:
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    return TypeTraits(int(values), int(size), bits, scales, most)


TYPES: dict[QType, TypeTraits] = {
    QType.F32: _row(QType.F32, 32, (), float(np.finfo(np.float32).max)),
    QType.F16: _row(QType.F16, 16, (), F16_MAX),
    QType.Q8_0: _row(QType.Q8_0, 8, (0,), F16_MAX * 127),
    QType.Q4_0: _row(QType.Q4_0, 4, (0,), F16_MAX * 8),
    QType.Q4_1: _row(QType.Q4_1, 4, (0, 2), None),
    QType.Q5_0: _row(QType.Q5_0, 5, (0,), None),
    QType.Q5_1: _row(QType.Q5_1, 5, (0, 2), None),
    QType.Q4_K: _row(QType.Q4_K, 4, (0, 2), None),
    QType.Q5_K: _row(QType.Q5_K, 5, (0, 2), None),
    QType.Q6_K: _row(QType.Q6_K, 6, (208,), None),
}
"""Every type a model file may hold (F32 tensors stay numpy arrays; the rest are QTensors)."""

SUPPORTED: tuple[QType, ...] = tuple(q for q in TYPES if q != QType.F32)
"""Storage types a QTensor may have."""
