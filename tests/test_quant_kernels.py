"""Weights in their stored GGUF types: the kernels against the gguf package and float64, every
SIMD path against the portable C, the type table.

The C kernels have one definition per type (``csrc/kernels.h``); the SIMD path must equal the
portable C bit for bit, and every result must be independent of how many rows a call holds.
"""

from __future__ import annotations

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from quant_weights import F32, KQUANTS, QUANTIZABLE, random_blocks, stored

from foundry.model.kernels import quant
from foundry.model.kernels.quant import QTensor, QType
from foundry.model.kernels.types import TYPES

INT8_PATH = (QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.Q4_1, QType.Q5_1)  # int8 blocks of 32
Q32 = (QType.Q8_0, QType.Q4_0, QType.Q5_0)  # one exact int32 sum a block


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
SIMD_PATHS = {
    "avx512-vnni+amx": ["avx512-vnni", "avx2+vnni", "avx2"],
    "avx512-vnni": ["avx2+vnni", "avx2"],
    "avx2+vnni": ["avx2"],
}.get(quant.KERNELS, [])

# Shapes of every path's edges: groups of four rows and a remainder; whole chunks of 16 blocks,
# a part chunk and an odd last block (23 and 33 blocks of 32: the 32-blocks' types only).
SHAPES = [(1, 256), (7, 512), (9, 1024)]
ODD_SHAPES = [(5, 736), (6, 1056)]

# Inputs of a block: every part group of 1 to 15 inputs after 0, 1 and 2 whole groups of 16
# (the AVX-512 blocks take a part group from a threshold on, zeros in its other lanes, and
# leave the smaller ones to the small tiles), whole groups of 16 and 32, and a tile of 64 with
# 11 after it.
BLOCK_INPUTS = [16 * whole + part for whole in range(3) for part in range(1, 16)] + [16, 32, 75]


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


@pytest.mark.parametrize(("qtype", "k"), [(t, 768) for t in KQUANTS] + [(t, 736) for t in Q32])
@pytest.mark.parametrize("rows", [5, 16, 17, 33])
def test_prefill_blocks_equal_portable_c_bit_for_bit(qtype: QType, k: int, rows: int) -> None:
    """Blocks of BLOCK_INPUTS inputs by rows of 3 super-blocks (the K-quants) or 23 blocks of 32
    (Q8_0, Q4_0, Q5_0: not a whole number of four): whole groups of 16 inputs and part groups
    of every size after them (AVX-512 VNNI: a part group of KQ_BLOCK_MIN or QB_PART_MIN inputs
    or more with zeros in its other lanes, fewer by the small tiles and the rows), a whole tile
    of 64 inputs and one of 11; 5 rows (the last rows alone), 16 (one AMX tile of rows), 17 and
    33 (tiles of 16 and rows left over)."""
    rng = np.random.default_rng(9)
    w = stored(rng.standard_normal((rows, k), dtype=np.float32), qtype)
    x = rng.standard_normal((75, k), dtype=np.float32)
    assert quant._kernels is not None
    results = []
    try:
        for path in ["best", *SIMD_PATHS, "portable"]:
            quant._kernels.use(path)
            results.append(np.concatenate([quant.linear(x[:n], w) for n in BLOCK_INPUTS]))
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


def kquant_ints(w: QTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K or Q6_K tensor's integers: values (rows, super-blocks, 256) as the products take
    them (Q4_K 0..15, Q6_K q - 32), each value's sub-block scale, the chunks' minimums (rows,
    super-blocks, 8; Q6_K zeros), and d, dmin as float32 (rows, super-blocks)."""
    rows, nsb = w.shape[0], w.shape[1] // 256
    blk = w.data.reshape(rows, nsb, -1).astype(np.int64)
    f16 = w.data.reshape(rows, nsb, -1)
    if w.qtype == QType.Q6_K:
        ql, qh = blk[..., :128], blk[..., 128:192]
        sc = f16[..., 192:208].view(np.int8).astype(np.int64)
        q = np.zeros((rows, nsb, 256), dtype=np.int64)
        for c in range(8):
            n, cc = c // 4, c % 4
            low = ql[..., 64 * n + (32 if cc & 1 else 0) :][..., :32]
            low = low & 15 if cc < 2 else low >> 4
            q[..., 32 * c : 32 * c + 32] = (
                low | ((qh[..., 32 * n : 32 * n + 32] >> 2 * cc) & 3) << 4
            ) - 32
        d = f16[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
        return q, np.repeat(sc, 16, axis=-1), np.zeros((rows, nsb, 8), np.int64), d, d * 0
    s = blk[..., 4:16]
    scale = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4], -1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], -1)
    qs = blk[..., 16:144].reshape(rows, nsb, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, nsb, 256)
    dd = f16[..., 0:4].copy().view(np.float16).astype(np.float32)
    return q, np.repeat(scale, 32, axis=-1), mins, dd[..., 0], dd[..., 1]


def k_definition(x: F32, w: QTensor) -> tuple[F32, int]:
    """The K-quant product as kernels.h defines it, in numpy float32 scalars: per super-block
    the exact int32 L (and M), then acc + (d * dx) * float(L), acc_min + (dmin * dx) * float(M);
    acc - acc_min. Also the largest |L| seen."""
    q, sc, mins, d, dmin = kquant_ints(w)
    xq, xd = int8_blocks(x, 256)  # (n, nsb, 256), (n, nsb, 1)
    xi = xq.astype(np.int64)
    s32 = xi.reshape(x.shape[0], -1, 8, 32).sum(-1)  # (n, nsb, 8)
    L = np.einsum("rbv,tbv->trb", q * sc, xi)  # (n, rows, nsb), exact
    M = np.einsum("rbc,tbc->trb", mins, s32)
    assert np.abs(L).max() < 2**31
    out = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for t in range(x.shape[0]):
        for r in range(w.shape[0]):
            acc, acc_min = np.float32(0), np.float32(0)
            for b in range(q.shape[1]):
                dx = xd[t, b, 0]
                acc = acc + (d[r, b] * dx) * np.float32(L[t, r, b])
                acc_min = acc_min + (dmin[r, b] * dx) * np.float32(M[t, r, b])
            out[t, r] = acc - acc_min
    return out, int(np.abs(L).max())


def large_sums(qtype: QType, rows: int, k: int) -> QTensor:
    """Super-blocks whose values and scales sit near their largest, so that against inputs of
    one sign a super-block's exact L is above 2^24 (float32 rounds it)."""
    rng = np.random.default_rng(11)
    w = stored(np.zeros((rows, k), dtype=np.float32), qtype)
    blk = w.data.reshape(rows, k // 256, -1)
    if qtype == QType.Q6_K:
        blk[..., :192] = rng.integers(0xEE, 0x100, blk[..., :192].shape)  # q 62, 63 (less 32)
        blk[..., 192:208] = rng.integers(100, 128, blk[..., 192:208].shape)  # int8 scales
    else:
        blk[..., 4:16] = rng.integers(0xF0, 0x100, blk[..., 4:16].shape)  # scales, mins 48..63
        blk[..., 16:] = rng.integers(0xDD, 0x100, blk[..., 16:].shape)  # values 13..15
    return w


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K])
def test_k_quant_products_equal_the_definition_where_l_rounds(qtype: QType) -> None:
    """Rows of exact super-block sums above 2^24 (Q4_K about 2^24.3, Q6_K 2^25.9), whose
    conversion to float32 rounds: every path, decode and blocks of 16, 17, 33 and 75 inputs
    (whole and part groups of 16, a tile of 64 and the rest) by 17 rows (an AMX tile of 16 and
    one left over), equals the definition in numpy bit for bit, and so each other."""
    rng = np.random.default_rng(12)
    w = large_sums(qtype, 17, 768)
    x = (0.9 + 0.1 * rng.random((75, 768))).astype(np.float32)
    want, largest = k_definition(x, w)
    assert largest > 2**24
    assert quant._kernels is not None
    try:
        for path in ["best", *SIMD_PATHS, "portable"]:
            quant._kernels.use(path)
            for n in (1, 16, 17, 33, 75):
                np.testing.assert_array_equal(quant.linear(x[:n], w), want[:n], err_msg=path)
    finally:
        quant._kernels.use("best")


def q32_ints(w: QTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0, Q4_0 or Q5_0 tensor's integers as the products take them (rows, blocks, 32):
    Q8_0 its int8, Q4_0 the nibble - 8, Q5_0 the five bits - 16; and d as float32."""
    rows, nb = w.shape[0], w.shape[1] // 32
    blk = w.data.reshape(rows, nb, -1)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if w.qtype == QType.Q8_0:
        return blk[..., 2:34].view(np.int8).astype(np.int64), d
    if w.qtype == QType.Q4_0:
        qs = blk[..., 2:18].astype(np.int64)
        return np.concatenate([qs & 15, qs >> 4], -1) - 8, d
    qh = blk[..., 2:6].copy().view(np.uint32).astype(np.int64)  # (rows, nb, 1): bit v, value v
    qs = blk[..., 6:22].astype(np.int64)
    return (np.concatenate([qs & 15, qs >> 4], -1) | ((qh >> np.arange(32)) & 1) << 4) - 16, d


def q32_definition(x: F32, w: QTensor) -> F32:
    """The Q8_0, Q4_0, Q5_0 product as kernels.h defines it, in numpy float32: per block the
    exact sum S_b of the int8 products, then acc = acc + (d_w * d_x) * float(S_b), block after
    block."""
    q, dw = q32_ints(w)
    xq, xd = int8_blocks(x)
    dx = xd[..., 0].astype(np.float16).astype(np.float32)  # ggml's Q8_0 keeps it as float16
    S = np.einsum("rbv,tbv->trb", q, xq.astype(np.int64))  # (n, rows, blocks), exact
    assert np.abs(S).max() < 2**24  # float(S) exact
    out = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for b in range(q.shape[1]):  # every (input, row) at once, block by block
        out = out + (dw[None, :, b] * dx[:, b, None]) * S[:, :, b].astype(np.float32)
    return out


@pytest.mark.parametrize("qtype", Q32)
@pytest.mark.parametrize(("rows", "k"), [(17, 736), (33, 1024)])
def test_32_block_products_equal_the_definition(qtype: QType, rows: int, k: int) -> None:
    """Random blocks (every stored value, Q8_0's -128 too) by rows of 23 and 32 blocks (17 and 33
    rows: an AMX tile of 16 rows and rows left over): every path, decode and blocks of
    BLOCK_INPUTS inputs (part groups of every size after 0, 1 and 2 whole groups), equals the
    definition in numpy bit for bit (and so each other)."""
    rng = np.random.default_rng(13)
    w = random_blocks(qtype, rows, k, seed=14)
    x = rng.standard_normal((75, k), dtype=np.float32)
    want = q32_definition(x, w)
    assert quant._kernels is not None
    try:
        for path in ["best", *SIMD_PATHS, "portable"]:
            quant._kernels.use(path)
            for n in (1, *BLOCK_INPUTS):
                np.testing.assert_array_equal(
                    quant.linear(x[:n], w), want[:n], err_msg=f"{path}, {n} inputs"
                )
    finally:
        quant._kernels.use("best")
