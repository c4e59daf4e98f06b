"""Q4_K and Q6_K written byte for byte as llama.cpp's reference quantizers write them.

The expected bytes of a fixed input (zero, all-positive and constant rows among random ones)
are the sha256 of what ggml's ``quantize_row_q4_K_ref`` / ``quantize_row_q6_K_ref`` wrote
(``ggml-quants.c`` of llama.cpp as vendored by llama-cpp-python 0.3.36, compiled without
FMA). ``bench/quality/kquants_reference.py`` compares more inputs (random, heavy-tailed, Gemma's own
tensors) with a build of that C file directly.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from foundry.model.formats.gguf_rewrite import replacement_type
from foundry.model.kernels import kquants as K
from foundry.model.kernels.quant import QTensor, QType, quantize

GOLDEN = {
    "q4_K": "82455c0a1af1d249dbd4ed2d1660bdc408f7931243b478f36e926d6e914b486c",
    "q6_K": "38c921d675b8ed5361083a5a7dca4fcfc705eb6903204667d63e573fb63ac79b",
}
WRITERS = {"q4_K": (K.quantize_q4_k, 144, QType.Q4_K), "q6_K": (K.quantize_q6_k, 210, QType.Q6_K)}


def golden_input() -> np.ndarray:
    rng = np.random.default_rng(41)
    g = (rng.standard_normal((8, 512)) * 0.1).astype(np.float32)
    g[0, :256] = 0  # an all-zero block
    g[1, 256:] = np.abs(g[1, 256:])  # no negative value: the min clamps to 0
    g[2, :] = 0.25  # constant: max == min
    return g


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_bytes_equal_llama_cpp_reference(name: str) -> None:
    write, block, _ = WRITERS[name]
    out = write(golden_input())
    assert out.shape == (8, 2 * block)
    assert hashlib.sha256(out.tobytes()).hexdigest() == GOLDEN[name]


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_round_trip_error_is_the_types(name: str) -> None:
    _, _, qtype = WRITERS[name]
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((32, 768)) * 0.05).astype(np.float32)
    back = quantize(w, qtype).dequantize()
    rel = float(np.sqrt(np.mean((back - w) ** 2)) / np.sqrt(np.mean(w**2)))
    # measured: 7.2e-2 for Q4_K, 1.8e-2 for Q6_K (Q8_0: 5.4e-3)
    assert rel < (0.12 if qtype == QType.Q4_K else 0.03), rel
    assert isinstance(quantize(w, qtype), QTensor)


def test_a_merged_k_quant_tensor_keeps_its_type() -> None:
    assert replacement_type(QType.Q4_K, (640, 1024)) == QType.Q4_K
    assert replacement_type(QType.Q6_K, (640, 2048)) == QType.Q6_K
    assert replacement_type(QType.Q5_K, (640, 2048)) == QType.Q8_0  # no Q5_K writer
    assert replacement_type(QType.Q4_K, (64, 96)) == QType.F16  # not whole blocks of 256
