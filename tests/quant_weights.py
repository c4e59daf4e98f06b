"""The stored GGUF types under test, and weights in them, for the quantized-kernel tests."""

from __future__ import annotations

import gguf
import numpy as np
import numpy.typing as npt

from foundry.model.kernels import quant
from foundry.model.kernels.quant import QTensor, QType
from foundry.model.nn import transformer as T
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]
KQUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
QUANTIZABLE = (QType.F16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1)


def random_blocks(qtype: QType, rows: int, k: int, seed: int = 0) -> QTensor:
    """Random K-quant super-blocks with small finite scales (the gguf package cannot quantize
    K-quants): whatever they dequantize to is the tensor's value."""
    rng = np.random.default_rng(seed)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, k // values, size), dtype=np.uint8)
    scale = (rng.random((rows, k // values)) * 1e-3 + 1e-4).astype(np.float16)
    scale_bytes = scale.view(np.uint8).reshape(rows, k // values, 2)
    if qtype == QType.Q6_K:
        data[..., 208:210] = scale_bytes  # d is the block's last field
    else:
        data[..., 0:2] = scale_bytes  # d, then dmin
        data[..., 2:4] = scale_bytes
    return QTensor(qtype, (rows, k), data.reshape(rows, -1))


def stored(a: F32, qtype: QType) -> QTensor:
    return random_blocks(qtype, *a.shape) if qtype in KQUANTS else quant.quantize(a, qtype)


def perturbed(cfg: ModelConfig, seed: int = 0) -> dict[str, F32]:
    rng = np.random.default_rng(seed + 100)
    params = T.init_params(cfg, seed=seed)
    for p in params.values():
        p += np.float32(0.1) * rng.standard_normal(p.shape, dtype=np.float32)
    return params
