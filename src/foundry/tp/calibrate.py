"""Shares by speed: a rank's speed from a short calibration, and the world's shares chosen from
every rank's speed (``--shares auto``) or from every rank's own ``--share`` (``--shares
ranks``), snapped to the nearest split the model can take (docs/tp.md, "Shares by speed").

The calibration is one fixed product through the engine's own kernels at the process's thread
count (``quant.threads``): a Q4_K matrix of :data:`CAL_ROWS` x :data:`CAL_COLS` (about 38 MB,
more than the last-level cache of most machines, so it is bound by memory bandwidth as a decode
step is) times one row, its blocks filled from a fixed seed. It runs once to warm up, then
again until :data:`CAL_BUDGET_S` has passed; the speed is the multiply-adds of the products run
divided by their time, in multiply-adds per microsecond (the hello's ``RankWeight.speed``).
What it computes is the same bits every time and at any thread count (:func:`calibration_row`);
only the time differs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from foundry.model.kernels.quant import QTensor, QType, linear, row_bytes
from foundry.model.kernels.quant import threads as kernel_threads
from foundry.model.shard.shares import (
    Shares,
    check_splittable,
    nearest_shares,
    norm_shares,
    share_blocks,
)
from foundry.model.shard.slices import attention_split, kv_group_of, misaligned
from foundry.model.shard.table import ExpertSplit, SplitError
from foundry.model.spec.config import ModelConfig

log = logging.getLogger("foundry.tp.calibrate")

CAL_ROWS = 16384
CAL_COLS = 4096
# Time spent on the repeats after the warm-up product (the whole calibration stays under a few
# hundred ms on any machine that can decode this model at all).
CAL_BUDGET_S = 0.15
CAL_MAX_REPEATS = 200
# Shares chosen from speeds are integers summing to about this before the gcd reduces them:
# finer than any unit the model is cut in but the vocabulary rows, coarse enough to read.
SPEED_RESOLUTION = 64
SEED = 46


@dataclass(frozen=True)
class Speed:
    """A calibration's result: multiply-adds per microsecond, measured at ``threads``."""

    speed: int
    threads: int
    seconds: float
    repeats: int


def _matrix() -> QTensor:
    """The calibration's matrix: seeded bytes as Q4_K blocks whose scales (d, dmin) are fixed
    finite values, so every product is finite and the same bits."""
    rng = np.random.default_rng(SEED)
    width = row_bytes(QType.Q4_K, CAL_COLS)
    data = rng.integers(0, 256, size=(CAL_ROWS, width), dtype=np.uint8)
    blocks = data.reshape(CAL_ROWS, -1, 144)  # a Q4_K block: d, dmin (f16), 12 scales, 128 qs
    blocks[:, :, 0:4] = np.array([1 / 1024, 1 / 2048], np.float16).view(np.uint8)
    return QTensor(QType.Q4_K, (CAL_ROWS, CAL_COLS), data)


def _row() -> np.ndarray:
    return np.random.default_rng(SEED + 1).standard_normal((1, CAL_COLS)).astype(np.float32)


def calibration_row() -> np.ndarray:
    """The calibration product's result (1, CAL_ROWS): what :func:`measure_speed` computes."""
    return linear(_row(), _matrix())


def measure_speed(budget_s: float = CAL_BUDGET_S) -> Speed:
    """This process's speed at its kernel thread count (see the module docstring)."""
    w, x = _matrix(), _row()
    linear(x, w)  # warm-up: the pages, the caches, the thread pool
    repeats, start = 0, time.perf_counter()
    while True:
        linear(x, w)
        repeats += 1
        seconds = time.perf_counter() - start
        if seconds >= budget_s or repeats >= CAL_MAX_REPEATS:
            break
    speed = max(1, min(0xFFFFFFFF, round(repeats * CAL_ROWS * CAL_COLS / (seconds * 1e6))))
    return Speed(speed, kernel_threads(), seconds, repeats)


def rank_speed(stated: int | None) -> int:
    """This rank's speed for ``--shares auto``: ``--speed`` when given, else measured now
    (logged with its thread count)."""
    if stated is not None:
        return stated
    measured = measure_speed()
    log.info(
        "this rank's speed: %d multiply-adds/us at %d threads (%d products in %.0f ms)",
        measured.speed,
        measured.threads,
        measured.repeats,
        1e3 * measured.seconds,
    )
    return measured.speed


def speed_shares(speeds: Sequence[int]) -> Shares:
    """Shares in proportion to ``speeds`` (rank 0 first) at :data:`SPEED_RESOLUTION`, each at
    least 1, reduced by their gcd; the model may not take them (``shard.shares.nearest_shares``)."""
    if not speeds or any(s < 1 for s in speeds):
        raise ValueError(f"speeds must be positive, got {list(speeds)}")
    total = sum(speeds)
    return norm_shares(len(speeds), [max(1, round(SPEED_RESOLUTION * s / total)) for s in speeds])


def fill(n: int, weights: Sequence[int]) -> list[int]:
    """``n`` >= len(weights) whole units handed out one at a time, each to the rank that would
    finish its units soonest at its weight (the least ``(units + 1) / weight``, the earlier
    rank on a tie), every rank one first: the allocation whose slowest rank is fastest."""
    sizes = [1] * len(weights)
    for _ in range(n - len(weights)):
        r = min(range(len(weights)), key=lambda r: ((sizes[r] + 1) / weights[r], r))
        sizes[r] += 1
    return sizes


def snap(cfg: ModelConfig, split: ExpertSplit, wanted: Shares, blocks: Mapping[str, int]) -> Shares:
    """The nearest shares to ``wanted`` the model takes: every rank at least one of each unit
    (``shard.shares.nearest_shares``) and every column cut of a stored tensor on its blocks (such a
    tensor's blocks handed out by the wanted shares, :func:`fill`, that allocation the new
    shares); equal shares when that does not settle (the leader holds those: they work)."""
    shares = nearest_shares(cfg, split, wanted)
    for _ in range(8):
        bad = misaligned(cfg, split, shares, blocks)
        if bad is None:
            return shares
        n = bad[1] // bad[2]
        if n < len(shares):
            break
        shares = nearest_shares(cfg, split, norm_shares(len(shares), fill(n, wanted)))
    return norm_shares(len(wanted))


def choose_shares(
    cfg: ModelConfig,
    split: ExpertSplit,
    *,
    speeds: Sequence[int] | None = None,
    stated: Sequence[int] | None = None,
    blocks: Mapping[str, int] | None = None,
) -> tuple[Shares, str]:
    """The world's shares from every rank's speed or every rank's stated share (rank 0 first),
    snapped to the nearest the model takes (:func:`snap`; ``blocks``: the block size of each
    tensor stored in blocks), and one line saying what was chosen and why (the leader logs
    it)."""
    if (speeds is None) == (stated is None):
        raise ValueError("choose shares from speeds or from stated shares, not both")
    if speeds is not None:
        wanted = speed_shares(speeds)
        total = sum(speeds)
        basis = (
            "speeds "
            + ", ".join(f"rank {r} {s} ({100 * s / total:.0f}%)" for r, s in enumerate(speeds))
            + " multiply-adds/us"
        )
    else:
        assert stated is not None
        wanted = norm_shares(len(stated), stated)
        basis = "the ranks' --share " + ",".join(map(str, stated))
    blocks = blocks or {}
    shares = snap(cfg, split, wanted, blocks)
    if shares != wanted:
        try:
            check_splittable(cfg, len(wanted), split, wanted)
            name, cols, block = misaligned(cfg, split, wanted, blocks) or ("", 0, 0)
            why = (
                f"shares {','.join(map(str, wanted))} would cut {name} ({cols} columns) "
                f"inside its blocks of {block}"
            )
        except SplitError as exc:
            why = str(exc)
        basis += f" ({why}: snapped to the nearest that works)"
    kv = None
    if cfg.n_head_kv >= len(shares):  # kv heads cut, in groups where the blocks ask for them
        group = kv_group_of(cfg, shares, blocks)
        cuts = (attention_split(cfg, r, len(shares), shares, group) for r in range(len(shares)))
        kv = [b - a for a, b in (c["kv_heads"] for c in cuts)]
    held = ("" if kv is None else f"; kv heads {','.join(map(str, kv))}") + (
        f"; vocabulary rows {','.join(map(str, share_blocks(cfg.n_vocab, shares)))}"
    )
    return shares, f"shares {','.join(map(str, shares))} from {basis}{held}"
