"""``quant.store_attend``: a layer's cache writes and attention for a batch of sequences in one
C call (``csrc/attention_pool.c``), the bits of the per-sequence ``store_rows`` and
``attend_rows`` it replaced in ``Engine._attention``, at any thread count.

Several sequences at different positions, one row and several rows each, float16 and float32
caches, with and without a sliding window, the V rows as columns of a stacked product (the
engine's ``v_rows, v_col``), at 1, 2 and 3 threads; a call with a bad cache is refused with one
error and writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from foundry.model.kernels import quant

F32 = npt.NDArray[np.float32]
COUNTS = (1, 2, 3)

pytestmark = pytest.mark.skipif(quant.KERNELS == "numpy", reason="needs the C kernels")

Case = tuple[F32, F32, list[npt.NDArray[Any]], list[npt.NDArray[Any]], list[tuple[int, int]]]


@pytest.fixture(autouse=True)
def one_thread_after() -> Iterator[None]:
    yield
    quant.set_threads(1)


def case(
    seed: int, dtype: Any, blocks: list[tuple[int, int]], n_head: int, n_kv: int, dh: int
) -> Case:
    """q (n, n_head, dh), the stacked QKV rows (n, Q + K + V), and each sequence's caches
    (its earlier positions random, the rest zero) for blocks of (pos, rows)."""
    rng = np.random.default_rng(seed)
    n = sum(r for _, r in blocks)
    q = rng.standard_normal((n, n_head, dh)).astype(np.float32)
    qkv = rng.standard_normal((n, (n_head + 2 * n_kv) * dh)).astype(np.float32) * 4
    qkv[0, n_head * dh + 1] = 1 + 2**-11  # a float16 tie: to even (1.0), as numpy rounds
    ks: list[npt.NDArray[Any]] = []
    vs: list[npt.NDArray[Any]] = []
    for pos, rows in blocks:
        for caches in (ks, vs):
            c = np.zeros((pos + rows + 3, n_kv, dh), dtype)
            c[:pos] = rng.standard_normal((pos, n_kv, dh))
            caches.append(c)
    return q, qkv, ks, vs, blocks


def per_sequence(c: Case, window: int) -> tuple[F32, list[npt.NDArray[Any]]]:
    """The engine's loop before store_attend: per sequence store_rows twice, attend_rows."""
    q, qkv, ks, vs, blocks = c
    ks, vs = [k.copy() for k in ks], [v.copy() for v in vs]
    width = ks[0].shape[1] * ks[0].shape[2]
    k_rows = np.ascontiguousarray(qkv[:, q.shape[1] * q.shape[2] :][:, :width])
    out, row = np.empty_like(q), 0
    for k, v, (pos, rows) in zip(ks, vs, blocks, strict=True):
        quant.store_rows(k_rows[row : row + rows], 0, k[pos : pos + rows])
        quant.store_rows(qkv[row : row + rows], q[0].size + width, v[pos : pos + rows])
        quant.attend_rows(q[row : row + rows], k, v, pos, window, out[row : row + rows])
        row += rows
    return out, [*ks, *vs]


def batched(c: Case, window: int) -> tuple[F32, list[npt.NDArray[Any]]]:
    q, qkv, ks, vs, blocks = c
    ks, vs = [k.copy() for k in ks], [v.copy() for v in vs]
    width = ks[0].shape[1] * ks[0].shape[2]
    k_rows = np.ascontiguousarray(qkv[:, q[0].size :][:, :width])
    out = np.full_like(q, np.nan)
    caches = [(k, v, pos, rows) for k, v, (pos, rows) in zip(ks, vs, blocks, strict=True)]
    quant.store_attend(q, k_rows, qkv, q[0].size + width, caches, window, out)
    return out, [*ks, *vs]


BLOCKS = {
    "one row each": [(5, 1), (0, 1), (40, 1), (17, 1)],
    "fewer tasks than threads": [(12, 1), (4, 1)],  # one kv head: its query heads split
    "blocks": [(3, 4), (0, 1), (30, 6), (11, 2)],
    "one sequence": [(9, 5)],
    "one row, one sequence": [(21, 1)],
}


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("blocks", list(BLOCKS))
@pytest.mark.parametrize(("n_head", "n_kv", "dh"), [(8, 2, 64), (4, 4, 32), (6, 1, 20)])
def test_store_attend_has_the_bits_of_the_loop_over_sequences(
    dtype: Any, window: int, blocks: str, n_head: int, n_kv: int, dh: int
) -> None:
    """Each row's output and every cache byte: those of store_rows and attend_rows per
    sequence (whose bits tests/test_threads.py ties to one-row decoding), at every count; a
    head size that is not a multiple of 8 takes the portable loops."""
    c = case(7, dtype, BLOCKS[blocks], n_head, n_kv, dh)
    for n in COUNTS:
        quant.set_threads(n)
        want, want_caches = per_sequence(c, window)
        got, got_caches = batched(c, window)
        assert got.tobytes() == want.tobytes(), n
        assert [g.tobytes() for g in got_caches] == [w.tobytes() for w in want_caches], n
    assert not np.isnan(got).any()
    stored = got_caches[0][BLOCKS[blocks][0][0], 0, 1]
    assert stored == (1.0 if dtype == np.float16 else np.float32(1 + 2**-11))


def test_a_row_moved_by_one_bit_is_seen() -> None:
    """The comparison reads real bits: one query value a bit off moves that row's output."""
    c = case(3, np.float16, BLOCKS["one row each"], 8, 2, 64)
    want, _ = batched(c, 0)
    q = c[0].copy()
    q[2, 5, 3] = np.nextafter(q[2, 5, 3], np.float32(np.inf))
    got, _ = batched((q, *c[1:]), 0)
    assert got[2].tobytes() != want[2].tobytes()
    assert np.delete(got, 2, 0).tobytes() == np.delete(want, 2, 0).tobytes()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("dtype", "float16 or float32"),
        ("mixed", "the same type for every sequence"),
        ("short", "ctx >="),
        ("heads", "ctx >="),
        ("strided", "contiguous"),
        ("rows", "q holds"),
    ],
)
def test_a_bad_cache_is_refused_with_one_error(bad: str, message: str) -> None:
    q, qkv, ks, vs, blocks = case(1, np.float16, BLOCKS["one row each"], 8, 2, 64)
    width = ks[0].shape[1] * ks[0].shape[2]
    k_rows = np.ascontiguousarray(qkv[:, q[0].size :][:, :width])
    caches: list[Any] = [(k, v, p, r) for k, v, (p, r) in zip(ks, vs, blocks, strict=True)]
    k2, v2, pos, rows = caches[2]
    caches[2] = {
        "dtype": (k2.astype(np.float64), v2, pos, rows),
        "mixed": (k2.astype(np.float32), v2.astype(np.float32), pos, rows),
        "short": (k2[: pos + rows - 1], v2, pos, rows),
        "heads": (np.ascontiguousarray(k2[:, :1]), v2, pos, rows),
        "strided": (k2[::2], v2, pos, rows),
        "rows": (k2, v2, pos, rows + 1),
    }[bad]
    before = [k.tobytes() for k in ks]
    with pytest.raises((ValueError, BufferError), match=message):
        quant.store_attend(q, k_rows, qkv, q[0].size + width, caches, 0, np.empty_like(q))
    assert [k.tobytes() for k in ks] == before
