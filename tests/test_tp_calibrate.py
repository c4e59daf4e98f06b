"""Shares by speed (tp.calibrate): the calibration computes the same bits at any thread count
and states a positive speed; the shares chosen follow the speeds (or the stated shares) and
are snapped to the nearest split the model takes (a unit for every rank, column cuts on whole
blocks), with one line saying why."""

from __future__ import annotations

import numpy as np
import pytest

from foundry.model.kernels.quant import set_threads, threads
from foundry.model.shard.shares import check_splittable
from foundry.model.shard.table import ExpertSplit
from foundry.model.spec.config import ModelConfig
from foundry.tp.calibrate import (
    CAL_COLS,
    CAL_ROWS,
    calibration_row,
    choose_shares,
    fill,
    measure_speed,
    misaligned,
    speed_shares,
)

CFG = ModelConfig(n_ctx=256, n_head=4, n_head_kv=4, n_ff=96)  # 4 kv heads
SPLIT = ExpertSplit.INTERMEDIATE


def test_the_calibration_computes_the_same_bits_at_any_thread_count() -> None:
    before = threads()
    try:
        set_threads(1)
        one = calibration_row()
        set_threads(2)
        two = calibration_row()
        speed = measure_speed(budget_s=0.02)
    finally:
        set_threads(before)
    assert one.shape == (1, CAL_ROWS) and np.isfinite(one).all() and np.abs(one).max() > 0
    assert np.array_equal(one, two)
    assert speed.threads == 2 and speed.repeats >= 1 and speed.seconds > 0
    assert speed.speed == round(speed.repeats * CAL_ROWS * CAL_COLS / (speed.seconds * 1e6))


def test_the_log_names_the_kv_heads_as_the_blocks_group_them() -> None:
    """3 query heads of 16 a kv head are 48 attn_output columns, not whole blocks of 32: the
    4 kv heads go out 2 at a time, and the chosen shares' line says so (ranks 2 and 3 none)."""
    cfg = ModelConfig(n_ctx=256, n_embd=192, n_head=12, n_head_kv=4, n_ff=96)
    blocks = {f"blk.{i}.attn_output.weight": 32 for i in range(cfg.n_layer)}
    shares, why = choose_shares(cfg, ExpertSplit.EXPERTS, stated=[1, 1, 1, 1], blocks=blocks)
    assert shares == (1, 1, 1, 1) and "; kv heads 2,2,0,0; vocabulary rows" in why
    _, plain = choose_shares(cfg, ExpertSplit.EXPERTS, stated=[1, 1, 1, 1])  # float32
    assert "; kv heads 1,1,1,1; vocabulary rows" in plain


def test_shares_follow_the_speeds_and_snap_to_a_split_the_model_takes() -> None:
    assert speed_shares([200, 100, 100]) == (2, 1, 1)
    assert speed_shares([100, 300, 100]) == (13, 38, 13)  # 64 x 20%, 60%, 20%
    assert speed_shares([7, 7]) == (1, 1)
    shares, why = choose_shares(CFG, SPLIT, speeds=[100, 300, 100])
    assert shares == (13, 38, 13)
    assert why == (
        "shares 13,38,13 from speeds rank 0 100 (20%), rank 1 300 (60%), rank 2 "
        "100 (20%) multiply-adds/us; kv heads 1,2,1; vocabulary rows 53,154,52"
    )
    # 98% on rank 0 would leave ranks 1 and 2 without a kv head: the nearest that works.
    shares, why = choose_shares(CFG, SPLIT, speeds=[1000, 10, 10])
    assert shares == (2, 1, 1) and check_splittable(CFG, 3, SPLIT, shares) == shares
    assert (
        "(cannot split the model by shares 63,1,1: a rank would hold none of its 4 kv heads;"
        " the nearest shares that work are 2,1,1: snapped to the nearest that works)" in why
    )
    shares, why = choose_shares(CFG, SPLIT, stated=[4, 1, 1])
    assert shares == (2, 1, 1) and why.startswith("shares 2,1,1 from the ranks' --share 4,1,1 (")
    # A file stored in blocks of 32: 3,5 would cut every expert's 128 intermediate columns
    # at 48, inside a block; its 4 blocks handed out each to the rank that would finish it
    # soonest, 1 and 3 (the slower rank's 1/3 against 3/5: 2 and 2 would give 2/3), cut at 32.
    tiny = ModelConfig(n_ctx=256)
    blocks = {f"blk.{i}.ffn_down_exps.weight": 32 for i in range(tiny.n_layer)}
    assert misaligned(tiny, SPLIT, (3, 5), blocks) == ("blk.0.ffn_down_exps.weight", 128, 32)
    assert misaligned(tiny, SPLIT, (1, 3), blocks) is None
    shares, why = choose_shares(tiny, SPLIT, speeds=[3, 5], blocks=blocks)
    assert shares == (1, 3) and misaligned(tiny, SPLIT, shares, blocks) is None
    assert (
        "(shares 3,5 would cut blk.0.ffn_down_exps.weight (128 columns) inside its blocks "
        "of 32: snapped to the nearest that works)"
    ) in why
    assert choose_shares(tiny, SPLIT, speeds=[3, 5])[0] == (3, 5)  # float32: no blocks
    # The bench preset in Q4_K_M's types, one rank of four at a third of the others' speed:
    # 8 blocks of 256 expert rows go 3,2,2,1 (equal shares would give the slow rank 2).
    assert fill(8, [19, 19, 19, 6]) == [3, 2, 2, 1] and fill(4, [1, 1]) == [2, 2]
    with pytest.raises(ValueError, match="speeds must be positive"):
        speed_shares([100, 0])
    with pytest.raises(ValueError, match="not both"):
        choose_shares(CFG, SPLIT, speeds=[1, 1], stated=[1, 1])
