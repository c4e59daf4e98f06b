"""Rank r's slice of every parameter: its unit blocks (``RankLayout``, ``rank_layout``), the
slice of each tensor (float32 views, or stored blocks cut along whole blocks) and its shapes, and
the cut weights a rank holds (``RankWeights``, ``rank_weights``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from foundry.model.kernels.quant import Param, QTensor
from foundry.model.shard.shares import (
    Shares,
    align_unit,
    check_splittable,
    norm_shares,
    share_range,
)
from foundry.model.shard.table import AXIS, ExpertSplit, SplitError, SplitKind, Unit, rule_for
from foundry.model.spec.arch import QKNorm, spec
from foundry.model.spec.config import ModelConfig


@dataclass(frozen=True)
class RankLayout:
    """The unit blocks [start, stop) that rank ``rank`` of ``world`` owns.

    ``experts`` and ``expert_ff`` follow the expert split: ``EXPERTS`` gives a block of experts
    and the whole intermediate dimension, ``INTERMEDIATE`` every expert and a block of it.
    """

    rank: int
    world: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    experts: tuple[int, int]
    shared_ff: tuple[int, int]
    vocab: tuple[int, int]
    head_dim: int
    expert_ff: tuple[int, int]
    expert_split: ExpertSplit
    shares: Shares = ()  # the world's shares (norm_shares); () is read as equal
    q_rows: tuple[int, int] = (0, 0)  # heads whose Q rows the rank computes
    k_rows: tuple[int, int] = (0, 0)  # kv heads whose K rows the rank computes
    ff: tuple[int, int] = (0, 0)  # dense FFN intermediate rows

    def units(self, unit: Unit) -> tuple[int, int]:
        return {
            Unit.HEAD: self.heads,
            Unit.KV_HEAD: self.kv_heads,
            Unit.Q_ROWS: self.q_rows,
            Unit.K_ROWS: self.k_rows,
            Unit.FF: self.ff,
            Unit.EXPERT: self.experts,
            Unit.EXPERT_FF: self.expert_ff,
            Unit.SHARED_FF: self.shared_ff,
            Unit.VOCAB: self.vocab,
        }[unit]

    def elements(self, unit: Unit) -> tuple[int, int]:
        """The block as indices along the cut axis."""
        start, stop = self.units(unit)
        size = self.head_dim if unit in _HEAD_UNITS else 1
        return start * size, stop * size


_HEAD_UNITS = (Unit.HEAD, Unit.KV_HEAD, Unit.Q_ROWS, Unit.K_ROWS)


def attention_split(
    cfg: ModelConfig,
    rank: int,
    world: int,
    shares: Sequence[int] | None = None,
    kv_group: int = 1,
) -> dict[str, tuple[int, int]]:
    """Which heads rank ``rank`` of ``world`` attends for, caches, and computes Q/K rows of.

    - KV groups split: when there are at least ``world`` kv heads, the rank owns a contiguous
      block of kv heads (uneven when the count is odd or the shares are: 3 over 2 gives 2 and
      1) with the query heads that read them. ``kv_group`` > 1 (:func:`kv_group_for`: the
      file's blocks would cut attn_output inside a block) hands the kv heads out in groups of
      that many, so a rank may hold none: its attention partial is zero, its FFN rows and
      vocabulary rows those of its share as ever. (Giving it more of those instead would not
      help: the gates end every attention and every FFN, so the ranks with heads set the
      attention's time, the ranks with the most FFN rows the FFN's.)
    - A single kv head and several ranks: K and V are replicated (each rank computes and
      caches the kv head), the query heads are split. (More kv heads than one but fewer than
      the ranks: refused by :func:`check_splittable`.)
    - Whole-vector QK-norm (olmoe) needs all of Q and K before the norm: their rows are
      replicated, each rank then keeps its heads' part of the normed vectors.
    """
    group = cfg.n_head // cfg.n_head_kv
    norm = norm_shares(world, shares)
    if cfg.n_head_kv >= world:
        units = share_range(cfg.n_head_kv // kv_group, rank, norm)
        kv = (units[0] * kv_group, units[1] * kv_group)
        heads = (kv[0] * group, kv[1] * group)
    else:
        kv = (0, cfg.n_head_kv)
        heads = share_range(cfg.n_head, rank, norm)
    full = spec(cfg).qk_norm is QKNorm.FULL
    return {
        "heads": heads,
        "kv_heads": kv,
        "q_rows": (0, cfg.n_head) if full else heads,
        "k_rows": (0, cfg.n_head_kv) if full else kv,
    }


def stored_blocks(params: Mapping[str, Param]) -> dict[str, int]:
    """The block size of every parameter kept in blocks of more than one value: what
    ``gguf_io.block_sizes`` reads from a file's header, from the loaded tensors instead."""
    return {n: p.block for n, p in params.items() if isinstance(p, QTensor) and p.block > 1}


def _kv_cols(cfg: ModelConfig) -> int:
    """attn_output columns of one kv head: its query heads' values."""
    return cfg.n_head // cfg.n_head_kv * cfg.head_dim


def _attn_block(blocks: Mapping[str, int]) -> int:
    """attn_output's block size in a file stored in ``blocks`` (1: float)."""
    return max((b for n, b in blocks.items() if n.endswith("attn_output.weight")), default=1)


def kv_group_for(cfg: ModelConfig, shares: Sequence[int], attn_block: int) -> int:
    """How many kv heads one unit of the attention cut holds for a file that stores
    attn_output in blocks of ``attn_block`` values: 1 where every rank's block of whole kv
    heads starts and ends on a block of its columns; else the fewest kv heads whose columns
    fill whole blocks (a Llama-3.2-3B in Q4_K: 3 query heads of 128 a kv head, 384 columns,
    so 2 kv heads a unit and 4 units, over 8 ranks: ranks 4-7 hold no heads), 1 where none
    does (the cut is then refused by :func:`check_cuts`)."""
    world, n_kv = len(shares), cfg.n_head_kv
    if attn_block <= 1 or n_kv == 1 or n_kv < world:
        return 1
    cols = _kv_cols(cfg)
    if all(share_range(n_kv, r, shares)[0] * cols % attn_block == 0 for r in range(1, world)):
        return 1
    return next((g for g in range(2, n_kv + 1) if n_kv % g == 0 and g * cols % attn_block == 0), 1)


def kv_group_of(cfg: ModelConfig, shares: Sequence[int], blocks: Mapping[str, int]) -> int:
    """:func:`kv_group_for` of a file whose tensors are stored in ``blocks`` (name: values a
    block; a float tensor absent or 1)."""
    return kv_group_for(cfg, shares, _attn_block(blocks))


def heads_note(cfg: ModelConfig, shares: Sequence[int], blocks: Mapping[str, int]) -> str:
    """'' where a world holding ``shares`` cuts the kv heads of a file stored in ``blocks`` one
    at a time; else, in words for the log, the groups the blocks ask for and the ranks they
    leave without heads (:func:`kv_group_of`)."""
    world, norm = len(shares), norm_shares(len(shares), shares)
    group = kv_group_of(cfg, norm, blocks)
    if group == 1:
        return ""
    heads = [attention_split(cfg, r, world, norm, group)["heads"] for r in range(world)]
    none = [str(r) for r, (a, b) in enumerate(heads) if a == b]
    held = (
        "every rank holds some"
        if not none
        else f"rank {none[0]} holds no heads"
        if len(none) == 1
        else f"ranks {','.join(none)} hold no heads"
    )
    return (
        f"kv heads {group} at a time (a kv head's {_kv_cols(cfg)} columns of attn_output would "
        f"cut its blocks of {_attn_block(blocks)}); {held}"
    )


def rank_layout(
    cfg: ModelConfig,
    rank: int,
    world: int,
    expert_split: ExpertSplit = ExpertSplit.EXPERTS,
    shares: Sequence[int] | None = None,
    kv_group: int = 1,
) -> RankLayout:
    """Rank's blocks of every unit in a world of ``world`` ranks holding ``shares`` (None:
    equal), its kv heads in groups of ``kv_group`` (:func:`kv_group_for`); SplitError when the
    model cannot be cut so (:func:`check_splittable`)."""
    norm = check_splittable(cfg, world, expert_split, shares)
    if not 0 <= rank < world:
        raise SplitError(f"rank must lie in [0, {world}), got {rank}")
    by_ff = expert_split is ExpertSplit.INTERMEDIATE
    dense = cfg.n_expert == 0

    def cut(n: int) -> tuple[int, int]:
        return share_range(n, rank, norm)

    ff = (0, 0)
    if dense:  # in the largest block (256, 32, else 1) dividing n_ff: whole stored blocks
        unit = align_unit(cfg.n_ff)
        start, stop = share_range(cfg.n_ff // unit, rank, norm)
        ff = (start * unit, stop * unit)
    return RankLayout(
        rank=rank,
        world=world,
        shares=norm,
        **attention_split(cfg, rank, world, norm, kv_group),
        ff=ff,
        experts=(0, cfg.n_expert) if by_ff else cut(cfg.n_expert),
        shared_ff=cut(cfg.n_ff_shared),
        vocab=cut(cfg.n_vocab),
        head_dim=cfg.head_dim,
        expert_ff=(0, 0) if dense else cut(cfg.n_ff) if by_ff else (0, cfg.n_ff),
        expert_split=expert_split,
    )


def shard_slice(name: str, ndim: int, layout: RankLayout) -> tuple[slice, ...]:
    """The index of rank's part of parameter ``name`` (of ``ndim`` axes), by the rules of the
    layout's expert split."""
    rule = rule_for(name, layout.expert_split)
    index = [slice(None)] * ndim
    if rule.kind is not SplitKind.REPLICATED:
        assert rule.unit is not None
        start, stop = layout.elements(rule.unit)
        index[AXIS[rule.kind]] = slice(start, stop)
    return tuple(index)


def _cuts(
    layout: RankLayout, cfg: ModelConfig
) -> Iterator[tuple[str, tuple[int, ...], tuple[slice, ...]]]:
    """Every parameter of ``cfg`` in param_shapes() order, its full shape and the layout's
    index into it: the one loop over a rank's cuts."""
    for name, shape in cfg.param_shapes().items():
        yield name, shape, shard_slice(name, len(shape), layout)


def layout_shapes(cfg: ModelConfig, layout: RankLayout) -> dict[str, tuple[int, ...]]:
    """Shapes of the layout's parameters, in param_shapes() order."""
    return {
        name: tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
        for name, shape, index in _cuts(layout, cfg)
    }


def shard_shapes(
    cfg: ModelConfig,
    rank: int,
    world: int,
    expert_split: ExpertSplit = ExpertSplit.EXPERTS,
    shares: Sequence[int] | None = None,
    kv_group: int = 1,
) -> dict[str, tuple[int, ...]]:
    """Shapes of rank's parameters, in param_shapes() order (to load only a rank's part)."""
    return layout_shapes(cfg, rank_layout(cfg, rank, world, expert_split, shares, kv_group))


def off_blocks(name: str, shape: tuple[int, ...], block: int, layout: RankLayout) -> range | None:
    """The layout's columns of a tensor stored in blocks of ``block`` values when they do not
    start and end on a block boundary (None when they do)."""
    cols = range(*shard_slice(name, len(shape), layout)[-1].indices(shape[-1]))
    return cols if cols.start % block or cols.stop % block else None


def misaligned(
    cfg: ModelConfig, split: ExpertSplit, shares: Shares, blocks: Mapping[str, int]
) -> tuple[str, int, int] | None:
    """The first stored tensor (``blocks``: its name and block size) that some rank's column
    cut under ``shares`` would split inside a block: (name, columns, block), or None."""
    shapes = cfg.param_shapes()
    group = kv_group_of(cfg, shares, blocks)
    for rank in range(len(shares)):
        layout = rank_layout(cfg, rank, len(shares), split, shares, group)
        for name, block in blocks.items():
            if name in shapes and off_blocks(name, shapes[name], block, layout) is not None:
                return name, shapes[name][-1], block
    return None


def check_cuts(
    cfg: ModelConfig, split: ExpertSplit, shares: Shares, blocks: Mapping[str, int]
) -> None:
    """SplitError, in one line, when some rank's column cut under ``shares`` falls inside a
    block of a tensor the file stores in blocks (``blocks``), naming the tensor, the other
    expert split when that one fits, and the nearest world size of equal shares that works."""
    bad = misaligned(cfg, split, shares, blocks)
    if bad is None:
        return
    name, cols, block = bad
    world = len(shares)
    other = ExpertSplit.EXPERTS if split is ExpertSplit.INTERMEDIATE else ExpertSplit.INTERMEDIATE
    sizes = [w for w in range(world - 1, 1, -1) if _fits(cfg, split, (1,) * w, blocks)]
    if cfg.n_expert and _fits(cfg, other, shares, blocks):
        hint = f"--expert-split {other.value} fits, or "
    elif sizes:
        hint = f"the nearest world size that works is {sizes[0]}, or "
    else:
        hint = ""
    raise SplitError(
        f"cannot split {name} ({cols} columns, stored in blocks of {block}) over {world} ranks "
        f"with shares {','.join(map(str, shares))}: a rank's columns would start or end inside "
        f"a block; {hint}use a file of another quantization type, or f16/f32"
    )


def _fits(cfg: ModelConfig, split: ExpertSplit, shares: Shares, blocks: Mapping[str, int]) -> bool:
    try:
        check_splittable(cfg, len(shares), split, shares)
    except SplitError:
        return False
    return misaligned(cfg, split, shares, blocks) is None


def pick_expert_split(
    cfg: ModelConfig, shares: Shares, blocks: Mapping[str, int]
) -> tuple[ExpertSplit, str]:
    """``--expert-split auto``: ``INTERMEDIATE`` (every token costs every rank the same work)
    where the model takes it under ``shares`` with every column cut on whole blocks of the
    file (``blocks``), else ``EXPERTS``; and why, in words for the log ('' for a model without
    routed experts, which either split cuts alike). Where whole experts do not fit either, their
    load names what does not (kv heads, experts, a block no split moves)."""
    if cfg.n_expert == 0:
        return ExpertSplit.INTERMEDIATE, ""
    try:
        check_splittable(cfg, len(shares), ExpertSplit.INTERMEDIATE, shares)
    except SplitError as exc:
        why = str(exc).split(";")[0]  # the reason, without the advice
    else:
        bad = misaligned(cfg, ExpertSplit.INTERMEDIATE, shares, blocks)
        if bad is None:
            return ExpertSplit.INTERMEDIATE, "each rank holds a block of every expert"
        name, cols, block = bad
        why = f"intermediate would cut {name} ({cols} columns) inside its blocks of {block}"
    # Whole experts; where they do not fit either, their load names what no split changes.
    return ExpertSplit.EXPERTS, why


def shard_part(name: str, value: Param, layout: RankLayout) -> Param:
    """The layout's part of one parameter, C-contiguous: a view where the cut allows it (rows,
    experts, replicated), a copy for column cuts and for the intermediate cuts of the experts
    (a block of every expert is not one contiguous block). float32 stays float32; stored blocks
    stay blocks, cut only on block boundaries (SplitError otherwise)."""
    index = shard_slice(name, len(value.shape), layout)
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value[index], dtype=np.float32)
    cols = off_blocks(name, tuple(value.shape), value.block, layout)
    if cols is not None:
        raise SplitError(
            f"cannot split {name} ({value.qtype.name}, blocks of {value.block} values) for rank "
            f"{layout.rank} of {layout.world}: its columns [{cols.start}, {cols.stop}) of "
            f"{value.shape[-1]} do not start and end on a block boundary; use a model file whose "
            f"split falls on whole blocks (another quantization type, or f16/f32)"
        )
    return value.take(index)


def layout_params(
    cfg: ModelConfig, params: Mapping[str, Param], layout: RankLayout
) -> dict[str, Param]:
    """The layout's part of every parameter (:func:`shard_part`)."""
    out: dict[str, Param] = {}
    for name, shape, _ in _cuts(layout, cfg):
        value = params[name]
        if tuple(value.shape) != shape:
            raise ValueError(f"parameter {name} has shape {value.shape}, expected {shape}")
        out[name] = shard_part(name, value, layout)
    return out


def shard_params(
    cfg: ModelConfig,
    params: Mapping[str, Param],
    rank: int,
    world: int,
    expert_split: ExpertSplit = ExpertSplit.EXPERTS,
    shares: Sequence[int] | None = None,
    kv_group: int = 1,
) -> dict[str, Param]:
    """Rank's part of every parameter (:func:`shard_part`)."""
    layout = rank_layout(cfg, rank, world, expert_split, shares, kv_group)
    return layout_params(cfg, params, layout)


@dataclass(frozen=True)
class RankWeights:
    """The parameters one rank holds (world 1: everything), with the blocks they cover."""

    cfg: ModelConfig
    layout: RankLayout
    params: dict[str, Param]  # float32, or QTensor blocks in the file's type

    def __post_init__(self) -> None:
        for name, shape in layout_shapes(self.cfg, self.layout).items():
            value = self.params.get(name)
            if value is None:
                raise ValueError(f"rank {self.rank} of {self.world} lacks parameter {name}")
            stored = isinstance(value, QTensor) or value.dtype == np.float32
            if tuple(value.shape) != shape or not stored:
                kind = value.qtype.name if isinstance(value, QTensor) else value.dtype
                raise ValueError(
                    f"rank {self.rank} of {self.world}: {name} is {kind}{value.shape}, "
                    f"expected float32 or stored blocks of shape {shape}"
                )

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def expert_split(self) -> ExpertSplit:
        return self.layout.expert_split

    @property
    def shares(self) -> Shares:
        return self.layout.shares or norm_shares(self.layout.world)


def rank_weights(
    cfg: ModelConfig,
    params: Mapping[str, Param],
    rank: int,
    world: int,
    expert_split: ExpertSplit = ExpertSplit.EXPERTS,
    shares: Sequence[int] | None = None,
    kv_group: int = 1,
) -> RankWeights:
    """Cut the full ``params`` for rank ``rank`` of ``world`` ranks holding ``shares``, kv
    heads in groups of ``kv_group`` (:func:`kv_group_of`)."""
    layout = rank_layout(cfg, rank, world, expert_split, shares, kv_group)
    return RankWeights(cfg, layout, layout_params(cfg, params, layout))
