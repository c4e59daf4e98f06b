"""Weights in their stored GGUF types: the kernels against the gguf package and float64, the
engine on quantized files against the float32 reference, block-aligned tensor-parallel cuts,
and the files ``foundry export --type`` writes.

The C kernels have one definition per type (``csrc/kernels.h``); the SIMD path must equal the
portable C bit for bit, and every result must be independent of how many rows a call holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import pytest

from foundry.model.formats.gguf_io import load_gguf, load_gguf_stored, save_gguf, values_by_type
from foundry.model.formats.gguf_model import storage_type
from foundry.model.infer.inference import Engine
from foundry.model.infer.kv_cache import KVCache
from foundry.model.kernels import quant
from foundry.model.kernels.quant import QTensor, QType
from foundry.model.kernels.types import TYPES
from foundry.model.nn import transformer as T
from foundry.model.nn.layers import attention_forward, rope_tables
from foundry.model.shard.slices import rank_weights
from foundry.model.shard.table import ExpertSplit, SplitError
from foundry.model.spec.config import ModelConfig
from foundry.tp.handshake import identity_for, load_rank

F32 = npt.NDArray[np.float32]
KQUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
QUANTIZABLE = (QType.F16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1)
INT8_PATH = (QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.Q4_1, QType.Q5_1)  # int8 blocks of 32
CFG = ModelConfig(n_ctx=64)


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


def int8_blocks(x: F32, block: int = 32) -> tuple[F32, F32]:
    """x quantized as the kernels do on the int8 path (llama.cpp's x86 build): q (n, blocks,
    block) and the float32 d (n, blocks, 1). Blocks of 32 (Q8_0): q = x * (127 / max|x|) to
    nearest even, d = max|x| / 127. Blocks of 256 (Q8_K): s = -127 / m (m the first value of
    largest magnitude), q = min(127, s * x to nearest even), d = 1 / s."""
    b = x.reshape(x.shape[0], -1, block).astype(np.float32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    if block == 32:
        inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
        return np.rint(b * inv), amax / np.float32(127)
    m = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)
    s = np.divide(np.float32(-127), m, out=np.zeros_like(m), where=m != 0)
    d = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s != 0)
    return np.minimum(np.rint(s * b), 127), d


def int8_inputs(x: F32, block: int = 32) -> npt.NDArray[np.float64]:
    """x as the kernels see it on the int8 path: q * d, where blocks of 32 keep d as float16
    (ggml's Q8_0 and Q8_1) and the K-quants' blocks of 256 as float32 (ggml's Q8_K)."""
    q, d = int8_blocks(x, block)
    if block == 32:
        d = d.astype(np.float16).astype(np.float32)
    return (q * d).reshape(x.shape).astype(np.float64)


def int8_product(x: F32, w: QTensor) -> npt.NDArray[np.float64]:
    """The int8 path's product in float64: int8_inputs against the dequantized weights, and for
    Q4_1 / Q5_1 the blocks' minimums m times ggml's Q8_1 sums s = fp16(d * sum(q)) (float32 d)
    where the dequantized product has m * fp16(d) * sum(q)."""
    want = int8_inputs(x) @ w.dequantize().astype(np.float64).T  # (n, rows)
    if w.qtype in (QType.Q4_1, QType.Q5_1):
        q, d = int8_blocks(x)
        total = q.sum(axis=-1)  # (n, blocks) exact
        s = (total * d[..., 0]).astype(np.float16).astype(np.float64)
        dx = d[..., 0].astype(np.float16).astype(np.float64)
        rows, nb = w.shape[0], w.shape[1] // 32
        m = w.data.reshape(rows, nb, -1)[..., 2:4].copy().view(np.float16)[..., 0]
        want += (s - dx * total) @ m.astype(np.float64).T
    return want


# -- the kernels ------------------------------------------------------------------------------


def test_the_kernels_were_built() -> None:
    """``pip install`` builds them wherever a C compiler is (CI has one); the numpy fallback
    is for machines without, and is tested on its own below."""
    assert quant._kernels is not None, (
        "foundry.model.kernels._kernels did not build; is gcc installed?"
    )
    assert quant.KERNELS != "numpy"


@pytest.mark.parametrize("qtype", QUANTIZABLE + KQUANTS)
def test_dequantize_equals_the_gguf_package(qtype: QType) -> None:
    w = stored(np.random.default_rng(1).standard_normal((8, 512), dtype=np.float32), qtype)
    want = (
        w.data.view(np.float16) if qtype == QType.F16 else gguf.quants.dequantize(w.data, qtype)
    ).astype(np.float32)
    np.testing.assert_array_equal(w.dequantize(), want)
    np.testing.assert_array_equal(w.rows(np.array([5, 0, 5])), want[[5, 0, 5]])


@pytest.mark.parametrize("qtype", QUANTIZABLE + KQUANTS)
@pytest.mark.parametrize("n", [1, 3])
def test_products_against_float64(qtype: QType, n: int) -> None:
    """Against float64 on the dequantized weights (and, on the int8 path, on the int8 inputs
    the kernels multiply): only float32 rounding apart."""
    rng = np.random.default_rng(2)
    w = stored(rng.standard_normal((37, 512), dtype=np.float32), qtype)
    x = rng.standard_normal((n, 512), dtype=np.float32)
    xs = (
        int8_inputs(x)
        if qtype in INT8_PATH
        else int8_inputs(x, 256)
        if qtype in KQUANTS
        else x.astype(np.float64)
    )
    wd = w.dequantize().astype(np.float64)
    want = int8_product(x, w) if qtype in INT8_PATH else xs @ wd.T
    got = quant.linear(x, w)
    bound = 1e-5 * (np.abs(xs) @ np.abs(wd).T)  # relative to the sum of the terms' sizes
    assert got.shape == (n, 37) and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= bound + 1e-30)


# The x86 paths below the best one this CPU has (each is checked against the portable C).
SIMD_PATHS = {"avx512-vnni": ["avx2+vnni", "avx2"], "avx2+vnni": ["avx2"]}.get(quant.KERNELS, [])


# Shapes of every path's edges: groups of four rows and a remainder; whole chunks of 16 blocks,
# a part chunk and an odd last block (23 and 33 blocks of 32: the 32-blocks' types only).
SHAPES = [(1, 256), (7, 512), (9, 1024)]
ODD_SHAPES = [(5, 736), (6, 1056)]


@pytest.mark.parametrize(
    ("qtype", "rows", "k"),
    [(t, r, k) for t in QUANTIZABLE + KQUANTS for r, k in SHAPES]
    + [(t, r, k) for t in QUANTIZABLE for r, k in ODD_SHAPES],
)
def test_simd_paths_equal_portable_c_bit_for_bit(qtype: QType, rows: int, k: int) -> None:
    rng = np.random.default_rng(3)
    w = stored(rng.standard_normal((rows, k), dtype=np.float32), qtype)
    x = rng.standard_normal((9, k), dtype=np.float32)
    assert quant._kernels is not None

    def products() -> np.ndarray:
        """One input (decode: the matrix streamed once), then nine (a block: tiles of rows and
        inputs, Q5_0 unpacked once, the K-quants' inputs four at a time and one)."""
        return np.concatenate([quant.linear(x[:1], w), quant.linear(x, w)])

    results = [products()]
    try:
        for path in [*SIMD_PATHS, "portable"]:
            quant._kernels.use(path)
            results.append(products())
    finally:
        quant._kernels.use("best")
    assert all(np.array_equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("qtype", KQUANTS)
def test_k_quant_prefill_blocks_equal_portable_c_bit_for_bit(qtype: QType) -> None:
    """A block of 75 inputs by 5 rows of 3 super-blocks: a whole tile of 64 inputs and one of
    11 (AVX-512: a tile of four rows and a row alone, by three pairs of inputs and one, and the
    odd input alone), and 5 inputs (fewer than a block unpacks its rows for)."""
    rng = np.random.default_rng(9)
    w = stored(rng.standard_normal((5, 768), dtype=np.float32), qtype)
    x = rng.standard_normal((75, 768), dtype=np.float32)
    assert quant._kernels is not None
    results = []
    try:
        for path in ["best", *SIMD_PATHS, "portable"]:
            quant._kernels.use(path)
            results.append(np.concatenate([quant.linear(x, w), quant.linear(x[:5], w)]))
    finally:
        quant._kernels.use("best")
    assert all(np.array_equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("qtype", INT8_PATH)
def test_inputs_round_half_to_even_on_every_path(qtype: QType) -> None:
    # a block whose largest value is 127 has the scale 1, so its halves are exact ties: llama.cpp's
    # x86 build (round_ps) takes them to even (2.5 -> 2, -0.5 -> 0), where roundf would not
    halves = np.arange(-15.5, 16.0, 1.0, dtype=np.float32)  # 32 values, every one a tie
    x = np.concatenate([[127.0], halves[1:], halves]).astype(np.float32)[None, :]  # (1, 64)
    w = quant.quantize(np.eye(64, dtype=np.float32)[:8] * 0.5 + 0.25, qtype)  # (8, 64)
    assert quant._kernels is not None
    best = quant.linear(x, w)
    try:
        quant._kernels.use("portable")
        portable = quant.linear(x, w)
    finally:
        quant._kernels.use("best")
    assert np.array_equal(best, portable)
    want = int8_product(x, w)  # the int8 inputs rounded to even
    np.testing.assert_allclose(best, want, rtol=1e-6)


@pytest.mark.parametrize("qtype", INT8_PATH)
def test_the_input_scale_of_a_32_block_is_a_float16_on_every_path(qtype: QType) -> None:
    """ggml's Q8_0 / Q8_1 keep a block's scale d = max|x| / 127 as float16: the products use
    it rounded to nearest (ties to even; below 2^-14 float16's subnormals, below 2^-25 zero),
    on every path, while the values are quantized with the float32 d. Blocks of magnitudes from
    1e-9 (d becomes 0) to 300 (Q8_1's float16 block sum d * sum(q) overflows past 65504, as in
    ggml, so no larger)."""
    rng = np.random.default_rng(8)
    scales = np.array([1e-9, 3e-9, 1e-7, 4e-6, 1e-4, 0.01, 0.3, 1.0, 7.0, 300.0], np.float32)
    x = (
        rng.standard_normal((3, len(scales), 32)).astype(np.float32) * scales[None, :, None]
    ).reshape(3, -1)  # (3, 320)
    _, d = int8_blocks(x)
    assert (d.astype(np.float16) != d).any() and (d.astype(np.float16) == 0).any()
    w = quant.quantize(rng.standard_normal((40, x.shape[1]), dtype=np.float32), qtype)
    assert quant._kernels is not None
    results = []
    try:
        for path in ["best", *SIMD_PATHS, "portable"]:
            quant._kernels.use(path)
            results.append(np.concatenate([quant.linear(x[:1], w), quant.linear(x, w)]))
    finally:
        quant._kernels.use("best")
    assert all(np.array_equal(r, results[0]) for r in results[1:])
    want = int8_product(x, w)
    bound = 1e-5 * (np.abs(int8_inputs(x)) @ np.abs(w.dequantize().astype(np.float64)).T)
    assert np.all(np.abs(results[0][1:] - want) <= bound + 1e-30)


@pytest.mark.parametrize("k", [48, 70])
def test_f16_rows_of_any_length(k: int) -> None:
    rng = np.random.default_rng(4)
    w = quant.quantize(rng.standard_normal((6, k), dtype=np.float32), QType.F16)
    x = rng.standard_normal((2, k), dtype=np.float32)
    np.testing.assert_allclose(quant.linear(x, w), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", QUANTIZABLE + KQUANTS)
def test_a_row_does_not_depend_on_its_batch(qtype: QType) -> None:
    """A prefill block (67 rows: a whole tile of 64 inputs and a part one, the K-quants' four
    inputs a time and three) gives each row the bits of that row alone (decode)."""
    rng = np.random.default_rng(5)
    w = stored(rng.standard_normal((16, 256), dtype=np.float32), qtype)
    x = rng.standard_normal((67, 256), dtype=np.float32)
    together = quant.linear(x, w)
    for i in range(67):
        assert np.array_equal(quant.linear(x[i : i + 1], w), together[i : i + 1])


def test_the_kernels_refuse_buffers_that_do_not_fit() -> None:
    assert quant._kernels is not None
    w = quant.quantize(np.ones((4, 64), np.float32), QType.Q8_0)
    y = np.empty((1, 4), np.float32)
    with pytest.raises(ValueError, match="weights hold"):
        quant._kernels.matmul(int(QType.Q8_0), w.data, 5, 64, np.ones((1, 64), np.float32), 1, y)
    with pytest.raises(ValueError, match="x holds"):
        quant._kernels.matmul(int(QType.Q8_0), w.data, 4, 64, np.ones((2, 64), np.float32), 1, y)
    with pytest.raises(ValueError, match="no kernel"):
        quant._kernels.matmul(99, w.data, 4, 64, np.ones((1, 64), np.float32), 1, y)


def test_numpy_fallback_matches_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the extension the products dequantize with the gguf package instead."""
    rng = np.random.default_rng(6)
    w = quant.quantize(rng.standard_normal((8, 128), dtype=np.float32), QType.Q4_0)
    x = rng.standard_normal((2, 128), dtype=np.float32)
    with_kernels = quant.linear(x, w)
    monkeypatch.setattr(quant, "_kernels", None)
    fallback = quant.linear(x, w)
    np.testing.assert_allclose(fallback, x @ w.dequantize().T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(with_kernels, fallback, rtol=0, atol=0.02 * np.abs(fallback).max())


# -- QTensor cuts -----------------------------------------------------------------------------


def test_take_cuts_whole_blocks_only() -> None:
    w = quant.quantize(np.arange(4 * 96, dtype=np.float32).reshape(4, 96), QType.Q8_0)
    part = w.take((slice(1, 3), slice(32, 96)))
    assert part.shape == (2, 64) and part.data.flags.c_contiguous
    np.testing.assert_array_equal(part.dequantize(), w.dequantize()[1:3, 32:96])
    with pytest.raises(quant.QuantError, match=r"columns \[16, 96\) .* blocks of 32"):
        w.take((slice(None), slice(16, 96)))


def test_unsupported_types_are_named() -> None:
    with pytest.raises(quant.QuantError, match="IQ2_XXS is not supported"):
        QTensor(QType.IQ2_XXS, (1, 256), np.zeros((1, 66), np.uint8))


# -- files ------------------------------------------------------------------------------------


def perturbed(cfg: ModelConfig, seed: int = 0) -> dict[str, F32]:
    rng = np.random.default_rng(seed + 100)
    params = T.init_params(cfg, seed=seed)
    for p in params.values():
        p += np.float32(0.1) * rng.standard_normal(p.shape, dtype=np.float32)
    return params


@pytest.mark.parametrize(
    ("dtype", "big", "head"),
    [
        ("f16", QType.F16, QType.F16),
        ("q8_0", QType.Q8_0, QType.Q8_0),
        ("q4_0", QType.Q4_0, QType.Q8_0),
    ],
)
def test_quantized_files_keep_their_type_in_memory(
    tmp_path: Path, dtype: str, big: QType, head: QType
) -> None:
    path = tmp_path / f"m-{dtype}.gguf"
    save_gguf(path, CFG, perturbed(CFG), dtype=dtype)  # type: ignore[arg-type]
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == types["token_embd.weight"] == big
    assert types["output.weight"] == head
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_norm.weight"] == QType.F32
    m = load_gguf_stored(path)
    held = sum(p.nbytes for p in m.params.values())
    data = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert held == data and held > 0.95 * path.stat().st_size - 16384
    w = m.params["blk.1.attn_q.weight"]
    assert isinstance(w, QTensor) and w.qtype == big
    assert isinstance(m.params["blk.1.ffn_norm.weight"], np.ndarray)
    assert identity_for(path, m.cfg, 64).quant_bits == TYPES[big].nominal_bits
    # load_gguf still gives float32 (training, the reference engine), the same values.
    f32 = load_gguf(path).params["blk.1.attn_q.weight"]
    np.testing.assert_array_equal(f32, w.dequantize())


def test_storage_type_falls_back_to_f16_where_rows_are_not_whole_blocks() -> None:
    assert storage_type("q8_0", "blk.0.attn_q.weight", (48, 48)) == QType.F16
    assert storage_type("q4_0", "output.weight", (259, 64)) == QType.Q8_0
    assert storage_type("q4_0", "blk.0.ffn_gate_inp.weight", (4, 64)) == QType.F32


def test_a_file_with_k_quants_loads_as_stored(tmp_path: Path) -> None:
    """The types llama-quantize's Q4_K_M gives rows of 256 (Q4_K, Q5_K, Q6_K) beside Q8_0."""
    cfg = ModelConfig(
        n_ctx=32,
        n_embd=256,
        n_layer=1,
        n_head=4,
        n_head_kv=2,
        n_ff=256,
        n_expert=2,
        n_expert_used=1,
    )
    params: dict[str, quant.Param] = dict(perturbed(cfg))
    kinds = {
        "attn_q": QType.Q4_K,
        "attn_output": QType.Q5_K,
        "ffn_down_exps": QType.Q6_K,
        "attn_v": QType.Q8_0,
    }
    for name, shape in cfg.param_shapes().items():
        kind = next((q for key, q in kinds.items() if f".{key}." in name), None)
        if kind in KQUANTS:
            rows = int(np.prod(shape[:-1]))
            blocks = random_blocks(kind, rows, shape[-1], seed=len(name))
            params[name] = QTensor(kind, shape, blocks.data.reshape(*shape[:-1], -1))
        elif kind is not None:
            params[name] = quant.quantize(params[name], kind)  # type: ignore[arg-type]
    path = tmp_path / "mixed.gguf"
    save_gguf(path, cfg, params)
    assert values_by_type(path)[QType.Q6_K] == 2 * 256 * 256
    stored_model = load_gguf_stored(path)
    reference = Engine(cfg, load_gguf(path).params)
    engine = Engine(cfg, stored_model.params)
    prompt = [5, 17, 200, 33]
    got = engine.decode(engine.new_session(), prompt)
    want = reference.decode(reference.new_session(), prompt)
    # Q8_0 multiplies int8 inputs: about 1% of the largest logit; the K-quants add rounding.
    np.testing.assert_allclose(got, want, rtol=0, atol=0.03 * np.abs(want).max())


# -- the engine on stored weights -------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "atol"), [("f16", 1e-5), ("q8_0", 0.02), ("q4_0", 0.02)])
def test_engine_on_a_quantized_file_tracks_the_f32_reference(
    tmp_path: Path, dtype: str, atol: float
) -> None:
    """The same file through the f32 engine (dequantized at load) and the stored-type engine:
    F16 differs by rounding only; Q8_0 and Q4_0 also by the int8 inputs (which can flip a
    close routing decision: hence the median over positions). Both with a float32 cache (a
    stored file's default is float16): the products are what is compared."""
    path = tmp_path / "m.gguf"
    save_gguf(path, CFG, perturbed(CFG), dtype=dtype)  # type: ignore[arg-type]
    reference = Engine(CFG, load_gguf(path).params)
    engine = Engine(CFG, load_gguf_stored(path).params, kv_cache=KVCache.F32)
    prompt = list(range(10, 40))
    want = reference.decode(reference.new_session(), prompt)
    got = engine.decode(engine.new_session(), prompt)
    relative = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)  # per position
    assert np.median(relative) <= atol, relative
    assert (np.argmax(got, axis=1) == np.argmax(want, axis=1)).mean() >= 0.9


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("mode", list(ExpertSplit))
def test_a_block_gives_the_bits_of_one_row_decoding(
    tmp_path: Path, dtype: str, mode: ExpertSplit
) -> None:
    """Speculative decoding verifies drafts as one block and keeps a token only where the
    block's logits choose it; greedy output is plain decoding's only if every row of a block
    has the bits the one-row pass would give. The int8 inputs make that strict: a float32 part
    (attention, router) off by one bit can round an input value the other way, a jump of
    1/254 of its block's largest value, which later layers carry on."""
    path = tmp_path / "m.gguf"
    save_gguf(path, CFG, perturbed(CFG), dtype=dtype)  # type: ignore[arg-type]
    engine = Engine(CFG, load_gguf_stored(path).params, expert_split=mode)
    prompt, tokens = list(range(10, 30)), [int(t) for t in np.arange(40, 56) * 7 % CFG.n_vocab]
    one = engine.new_session()
    engine.decode(one, prompt)
    rows = np.concatenate([engine.decode(one, [t]) for t in tokens])  # (16, V)
    block = engine.new_session()
    engine.decode(block, prompt)
    blocks = np.concatenate([engine.decode(block, tokens[:5]), engine.decode(block, tokens[5:])])
    np.testing.assert_array_equal(blocks, rows)


def test_a_cut_across_a_block_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """Three heads per rank of 16 values: attn_output's half is 48 columns, not whole blocks
    of 32. The pair refuses the file; one process holds the model in one part instead."""
    cfg = ModelConfig(n_ctx=32, n_embd=96, n_head=6, n_head_kv=2, n_ff=128)
    path = tmp_path / "m.gguf"
    save_gguf(path, cfg, perturbed(cfg), dtype="q8_0")
    params = load_gguf_stored(path).params
    with pytest.raises(SplitError, match=r"blk\.0\.attn_output\.weight \(Q8_0, blocks of 32"):
        rank_weights(cfg, params, 0, 2)
    with pytest.raises(SplitError, match=r"attn_output\.weight \(Q8_0, blocks of 32 values\)"):
        load_rank(path, 1, expert_split=ExpertSplit.EXPERTS)
    assert len(Engine(cfg, params).parts) == 1


def test_intermediate_split_cuts_down_projections_on_blocks(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    save_gguf(path, CFG, perturbed(CFG), dtype="q4_0")
    half = load_rank(path, 1, expert_split=ExpertSplit.INTERMEDIATE)
    down = half.weights.params["blk.0.ffn_down_exps.weight"]
    assert isinstance(down, QTensor) and down.shape == (CFG.n_expert, CFG.n_embd, CFG.n_ff // 2)
    full = load_gguf_stored(path).params["blk.0.ffn_down_exps.weight"]
    assert isinstance(full, QTensor)
    np.testing.assert_array_equal(down.dequantize(), full.dequantize()[..., CFG.n_ff // 2 :])
    assert half.identity.quant_bits == 4


# -- the commands -----------------------------------------------------------------------------


def test_export_type_writes_a_quantized_file_generate_reads(tmp_path: Path) -> None:
    from foundry.model.formats.checkpoint import CheckpointState
    from foundry.model.formats.checkpoint_dir import save_checkpoint
    from foundry.model.train.optim import AdamW

    params = perturbed(CFG)
    ckpt = save_checkpoint(
        tmp_path / "ckpt",
        CheckpointState(
            config=CFG,
            step=3,
            params=params,
            optimizer=AdamW(params).state_dict(),
            data_position=0,
        ),
    )
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    out = tmp_path / "m-q8.gguf"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "export",
            "--checkpoint",
            str(ckpt),
            "--out",
            str(out),
            "--type",
            "q8_0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == 7  # MOSTLY_Q8_0
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "generate",
            "--model",
            str(out),
            "--prompt",
            "The ",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert gen.returncode == 0, gen.stderr
    assert len(gen.stdout) > 1


def test_a_rank_holds_its_stored_weights_once(tmp_path: Path) -> None:
    """The engine's stacked Q/K/V and gate/up buffers replace the loaded tensors in the rank's
    own params (views of the same bytes), so the loaded model is not held a second time."""
    path = tmp_path / "m.gguf"
    save_gguf(path, CFG, perturbed(CFG), dtype="q8_0")
    half = load_rank(path, 0)
    engine = Engine(CFG, half.weights, rank=0, world=2)
    gate = half.weights.params["blk.1.ffn_gate_exps.weight"]
    q = half.weights.params["blk.1.attn_q.weight"]
    assert isinstance(gate, QTensor) and isinstance(q, QTensor)
    assert np.shares_memory(gate.data, engine.fused[0]["blk.1.gate_up"].data)
    assert np.shares_memory(q.data, engine.fused[0]["blk.1.qkv"].data)
    held = {id(b): b.nbytes for b in (_base(p) for p in half.weights.params.values())}
    stored_bytes = sum(p.nbytes for p in half.weights.params.values())
    assert sum(held.values()) == stored_bytes


def _base(p: quant.Param) -> np.ndarray:
    a = p.data if isinstance(p, QTensor) else p
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


@pytest.mark.parametrize(
    ("n_head", "n_kv", "dh", "n_pos"), [(8, 4, 64, 1), (8, 8, 32, 37), (4, 1, 72, 130)]
)
@pytest.mark.parametrize("kernel", [True, False], ids=["c", "numpy"])
def test_attention_of_a_row_against_its_cache_equals_the_layer(
    n_head: int, n_kv: int, dh: int, n_pos: int, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernel:
        monkeypatch.setattr(quant, "_kernels", None)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((n_pos + 9, n_kv, dh), dtype=np.float32)  # a cache longer than used
    v = rng.standard_normal((n_pos + 9, n_kv, dh), dtype=np.float32)
    q = 3 * rng.standard_normal((n_head, dh), dtype=np.float32)  # peaked softmaxes too
    want, _ = attention_forward(q[None, None], k[None, :n_pos], v[None, :n_pos], offset=n_pos - 1)
    got = np.full((n_head, dh), np.nan, np.float32)
    quant.attend(q, k, v, n_pos, got)
    np.testing.assert_allclose(got, want[0, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize(
    ("n_head", "n_kv", "dh", "n_pos"),
    [(4, 1, 256, 515), (2, 1, 256, 2), (9, 3, 32, 38), (5, 1, 24, 7), (7, 7, 8, 1), (6, 2, 40, 19)],
)
def test_attention_on_every_path_is_portable_c_bit_for_bit(
    n_head: int, n_kv: int, dh: int, n_pos: int, half: bool
) -> None:
    """The SIMD attention (heads and positions several at a time) against the portable C:
    head groups of 1 to 4 and more, odd positions, dh not a multiple of 16; a NaN key."""
    kernels = quant._kernels
    assert kernels is not None
    rng = np.random.default_rng(n_pos)
    dtype = np.float16 if half else np.float32
    k = (4 * rng.standard_normal((n_pos, n_kv, dh))).astype(dtype)
    v = rng.standard_normal((n_pos, n_kv, dh)).astype(dtype)
    v[0, 0, :3] = [0.0, -0.0, 65504.0 if half else 1e30]
    q = 2 * rng.standard_normal((n_head, dh), dtype=np.float32)
    for nan in (False, True):
        if nan:
            k[n_pos // 2, 0, 1] = np.nan
        outs = []
        for path in ("best", "portable"):
            kernels.use(path)
            try:
                out = np.empty_like(q)
                quant.attend(q, k, v, n_pos, out)
            finally:
                kernels.use("best")
            outs.append(out)
        assert outs[0].tobytes() == outs[1].tobytes()
        assert np.isnan(outs[0][0, 0]) == nan  # kv head 0's heads, not the others'
        assert np.isnan(outs[0][-1]).any() == (nan and n_kv == 1)


def test_attention_refuses_a_cache_shorter_than_its_positions() -> None:
    assert quant._kernels is not None
    q = np.zeros((8, 64), np.float32)
    cache = np.zeros((4, 4, 64), np.float32)
    with pytest.raises(ValueError, match="5 positions of 4 kv heads"):
        quant.attend(q, cache, cache, 5, q)


# --- the rest of a decode step: the C module against the training layers ---------------------

D_ROWS = [1, 5]  # a decode row, a block


def _on_both_paths(op: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """op's result with the C module and with the numpy fallback; the C module's SIMD and
    portable paths must agree bit for bit."""
    assert quant._kernels is not None
    kernels = quant._kernels
    c = op(*args)
    try:
        kernels.use("portable")
        portable = op(*args)
    finally:
        kernels.use("best")
    for a, b in zip(
        c if isinstance(c, tuple) else (c,),
        portable if isinstance(portable, tuple) else (portable,),
        strict=True,
    ):
        assert np.array_equal(a, b, equal_nan=True)
    quant._kernels = None
    try:
        fallback = op(*args)
    finally:
        quant._kernels = kernels
    return c, fallback


@pytest.mark.parametrize("n", D_ROWS)
def test_rmsnorm_rope_and_swiglu_equal_the_layers(n: int) -> None:
    rng = np.random.default_rng(8)
    x = 3 * rng.standard_normal((n, 1024), dtype=np.float32)
    w = rng.standard_normal(1024, dtype=np.float32)
    got, want = _on_both_paths(quant.rmsnorm, x, w, 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    cos, sin = (a[3 : 3 + n] for a in rope_tables(64, 64, 10000.0))
    qk = rng.standard_normal((n, 6, 64), dtype=np.float32)
    got, want = _on_both_paths(quant.rope, qk, cos, sin)
    assert np.array_equal(got, want)  # the same three roundings per value
    got, want = _on_both_paths(quant.rope, qk, cos, sin, True)  # NEOX: pairs (i, i + 32)
    assert np.array_equal(got, want)
    x0, x1 = qk[..., :32], qk[..., 32:]
    c, s = cos[:, None, :], sin[:, None, :]
    assert np.array_equal(got, np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1))
    gu = 8 * rng.standard_normal((n, 2 * 96), dtype=np.float32)
    # e^-g past float's range both ways, at its ends, and what is not a number
    gu[0, :10] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 88.5, -88.5, -100.0, 100.0, 1e-40]
    with np.errstate(invalid="ignore"):
        got, want = _on_both_paths(quant.swiglu, gu)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # NaN where numpy has NaN


@pytest.mark.parametrize("n", D_ROWS)
def test_geglu_equals_ggml_table_lookup(n: int) -> None:
    rng = np.random.default_rng(11)
    f = 2048
    gu = 4 * rng.standard_normal((n, 2 * f), dtype=np.float32)
    # every float16 value as a gate (the table's every entry), the -10 and 10 ends and past
    # them, halfway cases between float16 neighbours (ties to even) and subnormals
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    every = every[np.isfinite(every)]
    edges = np.array(
        [
            -10.0,
            10.0,
            np.nextafter(-10.0, 0, dtype=np.float32),
            9.999,
            -10.5,
            10.5,
            1e4,
            -1e4,
            1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11,
            2.0**-25,
            -(2.0**-25),
            3 * 2.0**-25,
            0.0,
            -0.0,
        ],
        np.float32,
    )
    gates = np.concatenate([every, edges])
    rows = -(-gates.size // f)
    big = np.ones((rows, 2 * f), np.float32)
    big[:, :f].flat[: gates.size] = gates
    big[:, f:] = rng.standard_normal((rows, f), dtype=np.float32)
    for x in (gu, big):
        got, want = _on_both_paths(quant.geglu, x)
        assert np.array_equal(got, want)  # the fallback is arch.geglu, numpy's float16 rounding
    got = quant.geglu(big)[:, :f].ravel()[: gates.size] / big[:, f:].ravel()[: gates.size]
    np.testing.assert_allclose(got[-15:-13], [0.0, 10.0], rtol=1e-6)  # the ends as ggml's


@pytest.mark.parametrize("n", D_ROWS)
def test_router_grouping_and_combination_equal_the_layers(n: int) -> None:
    rng = np.random.default_rng(9)
    x = rng.standard_normal((n, 256), dtype=np.float32)
    w_router = rng.standard_normal((8, 256), dtype=np.float32)
    w_router[2] = w_router[5] = 0.1 * x[0]  # row 0's best two, tied
    (weights, top), (want_w, want_top) = _on_both_paths(quant.route, x, w_router, 3)
    assert np.array_equal(top, want_top)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5)
    assert list(top[0, :2]) == [2, 5]  # the lower id first, as the stable sort
    for first, n_local in [(0, 8), (2, 4), (6, 2)]:
        (order, bounds), (want_order, want_bounds) = _on_both_paths(
            quant.assign_experts, top, first, n_local
        )
        assert np.array_equal(order, want_order) and np.array_equal(bounds, want_bounds)
        ys = rng.standard_normal((order.size, 256), dtype=np.float32)
        got, want = _on_both_paths(quant.combine_experts, ys, weights, order)
        assert np.array_equal(got, want)  # the slots summed in the same order


def test_each_row_of_the_decode_operations_is_its_own() -> None:
    rng = np.random.default_rng(10)
    x = rng.standard_normal((6, 512), dtype=np.float32)
    w = rng.standard_normal(512, dtype=np.float32)
    w_router = rng.standard_normal((8, 512), dtype=np.float32)
    block = (quant.rmsnorm(x, w, 1e-5), *quant.route(x, w_router, 2))
    for i in range(6):
        alone = (quant.rmsnorm(x[i : i + 1], w, 1e-5), *quant.route(x[i : i + 1], w_router, 2))
        for a, b in zip(alone, block, strict=True):
            assert np.array_equal(a, b[i : i + 1])


def test_the_decode_operations_refuse_buffers_that_do_not_fit() -> None:
    k = quant._kernels
    assert k is not None
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="w holds 128 bytes, expected 256"):
        k.rmsnorm(x, np.zeros(32, np.float32), 2, 64, 1e-5, x)
    with pytest.raises(ValueError, match="at most 256"):
        k.route(
            x,
            np.zeros((300, 64), np.float32),
            2,
            64,
            300,
            2,
            np.zeros(4, np.float32),
            np.zeros(4, np.int64),
        )
    with pytest.raises(ValueError, match="not a distinct assignment"):
        k.combine(x, np.zeros((2, 2), np.float32), np.array([1, 1], np.int64), 2, 2, 64, x)
    with pytest.raises(ValueError, match="not a distinct assignment"):
        k.combine(x, np.zeros((2, 2), np.float32), np.array([0, 4], np.int64), 2, 2, 64, x)
    with pytest.raises(ValueError, match="rows of 3 heads of 63 values"):
        k.rope(x, x, x, 2, 3, 63, 0, x)
    with pytest.raises(ValueError, match="rows of 2 heads of 32 values"):
        k.rope(x, x[0], x[0], 2, 2, 32, 2, x)  # neox is 0 or 1
    table = np.zeros(1 << 16, np.float32)
    with pytest.raises(ValueError, match="table holds 262140 bytes, expected 262144"):
        k.geglu(x, table[1:], 2, 32, x[:, :32].copy())
    with pytest.raises(ValueError, match="out holds 256 bytes, expected 128"):
        k.geglu(x[:, :32].copy(), table, 2, 16, x[:, :32].copy())


@pytest.mark.parametrize("qtype", [t for t in TYPES if t != QType.F32])
def test_the_c_kernels_read_the_type_table_block_sizes(qtype: QType) -> None:
    """csrc's type_block gives each type the table's values and bytes per block: a row of the
    table's size is read, one byte less is refused."""
    kernels = quant._kernels
    assert kernels is not None
    k = TYPES[qtype].block_values * 2
    good = np.zeros((3, quant.row_bytes(qtype, k)), np.uint8)
    out = np.empty((3, k), np.float32)
    kernels.dequantize(int(qtype), good, 3, k, out)
    with pytest.raises(ValueError, match="need"):
        kernels.dequantize(int(qtype), good.reshape(-1)[1:], 3, k, out)
