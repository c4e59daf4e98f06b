"""The arithmetic of an engine's parts (``inference.Engine``): the weights cut into the parts
one engine holds (``cut_parts``), a part's rows of a tied head (``row_block``), a dense FFN on
a part's slice (``glu``, ``swiglu_ffn``), a block's routed experts (``experts_swiglu``), and
the parts' partials added in rank order as the ranks' exchange adds them (``sum_partials``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from foundry.model.kernels.quant import (
    Param,
    QTensor,
    add,
    geglu,
    linear,
    linear_groups,
    swiglu,
)
from foundry.model.shard.shares import Shares, check_splittable
from foundry.model.shard.slices import RankWeights, kv_group_of, rank_weights, stored_blocks
from foundry.model.shard.table import ExpertSplit, SplitError
from foundry.model.spec.arch import Act
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]


def row_block(w: Param, block: tuple[int, int]) -> Param:
    """Rows [start, stop) of a 2-d tensor, a view (a tied head's vocabulary block)."""
    if isinstance(w, np.ndarray):
        return w[block[0] : block[1]]
    return QTensor(w.qtype, (block[1] - block[0], w.shape[1]), w.data[block[0] : block[1]])


def glu(x: F32, gate_up: Param | None, w_gate: Param, w_up: Param, w_down: Param, act: Act) -> F32:
    """A dense FFN: down(act(gate x) * up x), SwiGLU or GeGLU."""
    if act is Act.SILU:
        return swiglu_ffn(x, gate_up, w_gate, w_up, w_down)
    gu = (
        linear(x, gate_up)
        if gate_up is not None
        else np.concatenate([linear(x, w_gate), linear(x, w_up)], axis=1)
    )  # (N, 2F)
    return linear(geglu(gu), w_down)  # (N, D)


def swiglu_ffn(x: F32, gate_up: Param | None, w_gate: Param, w_up: Param, w_down: Param) -> F32:
    """down(silu(gate x) * up x) for x (N, D), on float32 or stored weights: one product for
    gate and up where ``step_plan.fuse`` stacked them (``gate_up``), else one each."""
    gu = (
        linear(x, gate_up)
        if gate_up is not None
        else np.concatenate([linear(x, w_gate), linear(x, w_up)], axis=1)
    )  # (N, 2F)
    return linear(swiglu(gu), w_down)  # (N, D)


def experts_swiglu(
    xs: F32,
    groups: list[tuple[int, int, int]],
    gate_up: list[Param] | None,
    gate: list[Param],
    up: list[Param],
    down: list[Param],
    out: F32,
) -> F32:
    """``swiglu_ffn`` of each routed expert e on its rows lo .. hi - 1 of xs (M, D), for each
    (lo, hi, e) of ``groups``, into those rows of out (M, D): every expert's products in the
    same pool calls (``linear_groups``) and SiLU x up over all rows at once, each row the bits
    of its expert's ``swiglu_ffn``."""
    if gate_up is not None:
        n_gu = gate_up[groups[0][2]].shape[0]
        gu = linear_groups(xs, [(lo, hi, gate_up[e]) for lo, hi, e in groups], _rows(xs, n_gu))
    else:
        n_ff = gate[groups[0][2]].shape[0]
        gu = np.concatenate(
            [
                linear_groups(xs, [(lo, hi, m[e]) for lo, hi, e in groups], _rows(xs, n_ff))
                for m in (gate, up)
            ],
            axis=1,
        )  # (M, 2F)
    return linear_groups(swiglu(gu), [(lo, hi, down[e]) for lo, hi, e in groups], out)


def _rows(x: F32, width: int) -> F32:
    return np.empty((x.shape[0], width), np.float32)


def cut_parts(
    cfg: ModelConfig,
    weights: Mapping[str, Param],
    rank: int,
    world: int,
    mode: ExpertSplit,
    shares: Shares,
) -> tuple[RankWeights, ...]:
    """The parts an engine holds: rank's own, or for one process every part of the world it
    stands for (one part with everything when the model cannot be cut so: a shape
    check_splittable refuses, or stored blocks the cut would split)."""
    blocks = stored_blocks(weights)
    if world == 1:
        n = len(shares)
        try:
            norm = check_splittable(cfg, n, mode, shares)
            group = kv_group_of(cfg, norm, blocks)
            return tuple(rank_weights(cfg, weights, r, n, mode, norm, group) for r in range(n))
        except SplitError:
            pass
        return (rank_weights(cfg, weights, rank, world, mode),)
    norm = check_splittable(cfg, world, mode, shares)
    group = kv_group_of(cfg, norm, blocks)
    return (rank_weights(cfg, weights, rank, world, mode, norm, group),)


def sum_partials(partials: list[F32]) -> F32:
    """Partials added in rank order, as the ranks' exchange adds them (a new array where there
    are several)."""
    if len(partials) == 1:
        return partials[0]
    total = add(partials[0], partials[1])
    for p in partials[2:]:
        add(total, p, total)
    return total
