"""A step's sampled rows drawn in vocabulary blocks (the tensor-parallel pair's way) give the
tokens ``sample_rows`` gives the whole rows: the same float operations in the same order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry.model.infer.block_draw import (
    BLOCK,
    MAX_TOP_K,
    BlockRows,
    DrawArgs,
    draw_kept,
    inverse_temperature,
)
from foundry.model.infer.sampling import greedy_tops
from foundry.model.kernels import quant
from foundry.wire.tp import TP_MAX_DRAW_TOP_K

pytestmark = pytest.mark.skipif(quant._kernels is None, reason="the draw is the C kernels'")


def whole(row: np.ndarray, temperature: float, top_k: int, u: float) -> int:
    """sample_rows' token for the whole row with uniform ``u``."""
    assert quant._kernels is not None
    out = np.empty(1, np.int64)
    settings_ = np.array([[temperature, 1.0, u, top_k]], np.float64)
    quant._kernels.sample_rows([np.ascontiguousarray(row)], settings_, out)
    return int(out[0])


def in_blocks(
    rows: np.ndarray,
    cut: int,
    temperature: float,
    top_k: int,
    us: list[float],
    *,
    early: bool = False,
) -> list[int]:
    """The exchange of the pair, in this process: the leader holds [0, cut), the worker the
    rest; each step as the ranks run it. ``early``: the worker's pass before the leader's
    mass is known (ROW_MASS), then its finish from that mass; else its whole tail after."""
    lead, work = BlockRows(rows[:, :cut]), BlockRows(rows[:, cut:])
    (lv, lt), (wv, wt) = greedy_tops(rows[:, :cut]), greedy_tops(rows[:, cut:])
    args = []
    for i, u in enumerate(us):
        tops = [v for v, t in ((lv[i], lt[i]), (wv[i], wt[i])) if t >= 0]
        args.append(DrawArgs(True, top_k, max(tops), inverse_temperature(temperature), u=u))
    if early:
        work.worker_pass(args)
    args = lead.leader_pass(args)
    picks = work.worker_finish(args) if early else work.worker_tail(args)
    return lead.finish(args, picks, cut)


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.integers(1, 6),
    extra=st.integers(1, 150),
    rows=st.integers(1, 4),
    temperature=st.sampled_from([1e-3, 0.3, 0.8, 1.0, 2.5]),
    top_k=st.sampled_from([0, 1, 3, 40, 256]),
    seed=st.integers(0, 2**32 - 1),
    masked=st.floats(0.0, 0.9),
    ties=st.booleans(),
)
def test_rows_drawn_in_blocks_equal_the_whole_rows_draw(
    blocks: int,
    extra: int,
    rows: int,
    temperature: float,
    top_k: int,
    seed: int,
    masked: float,
    ties: bool,
) -> None:
    rng = np.random.default_rng(seed)
    cut = blocks * BLOCK
    v = cut + extra
    z = (rng.standard_normal((rows, v)) * rng.choice([0.5, 3.0, 20.0])).astype(np.float32)
    if ties:
        z = np.round(z)  # many equal logits: ties at the top-k cut and in the walk
    z[rng.random((rows, v)) < masked] = -np.inf
    z[:, rng.integers(0, v)] = 5.0  # every row has a finite logit
    us = rng.random(rows).tolist()
    want = [whole(z[i], temperature, top_k, us[i]) for i in range(rows)]
    assert in_blocks(z, cut, temperature, top_k, us) == want
    assert in_blocks(z, cut, temperature, top_k, us, early=True) == want


def test_a_gemma_sized_row_in_two_halves() -> None:
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((3, 262_144)) * 4).astype(np.float32)
    for temperature, top_k in ((0.8, 0), (0.8, 40), (1.5, 1)):
        us = rng.random(3).tolist()
        want = [whole(z[i], temperature, top_k, us[i]) for i in range(3)]
        assert in_blocks(z, 131_072, temperature, top_k, us) == want
        assert in_blocks(z, 131_072, temperature, top_k, us, early=True) == want


def test_u_at_the_ends_and_a_block_all_masked() -> None:
    rng = np.random.default_rng(3)
    z = rng.standard_normal((3, 4 * BLOCK + 9)).astype(np.float32)
    z[1, 2 * BLOCK :] = -np.inf  # the worker's block holds nothing: the leader's tokens
    z[2, : 2 * BLOCK] = -np.inf  # the leader's holds nothing: its mass 0, u 0 is the worker's
    for u in (0.0, 0.999999999, 0.5):
        for top_k in (0, 2):
            want = [whole(z[i], 0.7, top_k, u) for i in range(3)]
            assert in_blocks(z, 2 * BLOCK, 0.7, top_k, [u, u, u]) == want
            assert in_blocks(z, 2 * BLOCK, 0.7, top_k, [u, u, u], early=True) == want


def test_the_wire_carries_as_many_candidates_as_a_rank_sends() -> None:
    assert MAX_TOP_K == TP_MAX_DRAW_TOP_K


def test_draw_kept_orders_by_probability_then_id() -> None:
    assert draw_kept([(0.25, 9), (0.5, 4), (0.25, 2)], 2, 0.0) == 4
    assert draw_kept([(0.25, 9), (0.5, 4), (0.25, 2)], 2, 0.99) == 2  # 9 is cut (tie: lower id)


def test_without_the_c_kernels_the_parts_are_numpys_and_draw_the_same_tokens_here() -> None:
    """The numpy parts (a build without a C compiler) take the same steps with numpy's exp:
    on these rows, whose targets fall far from any rounding, the same tokens."""
    rng = np.random.default_rng(11)
    z = (rng.standard_normal((6, 5 * BLOCK + 17)) * 2).astype(np.float32)
    z[2, : 3 * BLOCK] = -np.inf
    for top_k in (0, 4):
        us = rng.random(6).tolist()
        with_c = in_blocks(z, 3 * BLOCK, 0.9, top_k, us)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("foundry.model.infer.block_draw._kernels", None)
            with_numpy = in_blocks(z, 3 * BLOCK, 0.9, top_k, us)
            with_numpy_early = in_blocks(z, 3 * BLOCK, 0.9, top_k, us, early=True)
        assert with_numpy == with_numpy_early == with_c


def test_the_leader_refuses_a_pick_that_does_not_answer_its_row() -> None:
    """A worker's ROW_PICKS row must answer the draw it was given: the leader checks it before
    finishing the row (a pick it cannot use would otherwise end the engine thread)."""
    from foundry.tp.commands import _pick_fits
    from foundry.wire.tp import PICK_LEADER_WALK, PICK_NONE, PICK_TOKEN, PICK_TOP_K, PickRow

    drawn, cut, idle = DrawArgs(True, 0, 1.0, 1.0), DrawArgs(True, 2, 1.0, 1.0), DrawArgs(False)
    assert _pick_fits(idle, PickRow(PICK_NONE, 0, 0.0), 100)
    assert not _pick_fits(idle, PickRow(PICK_TOKEN, 3, 0.0), 100)
    assert _pick_fits(drawn, PickRow(PICK_TOKEN, 99, 0.0), 100)
    assert not _pick_fits(drawn, PickRow(PICK_TOKEN, 100, 0.0), 100)  # past its block
    assert not _pick_fits(drawn, PickRow(PICK_NONE, 0, 0.0), 100)
    assert _pick_fits(drawn, PickRow(PICK_LEADER_WALK, 0, 5.0), 100)
    assert not _pick_fits(drawn, PickRow(PICK_TOP_K, 0, 0.0, ((0.5, 1),)), 100)  # uncut row
    assert _pick_fits(cut, PickRow(PICK_TOP_K, 0, 0.0, ((0.5, 1), (0.25, 7))), 100)
    assert not _pick_fits(cut, PickRow(PICK_TOP_K, 0, 0.0, ((0.5, 1),) * 3), 100)  # > top_k
    assert not _pick_fits(cut, PickRow(PICK_TOP_K, 0, 0.0, ((0.5, 100),)), 100)
    assert draw_kept([], 2, 0.5) == -1  # nothing to draw from: the caller's error
