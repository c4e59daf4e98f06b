"""Tensor-parallel slicing as data: which part of each parameter rank r of w holds
(docs/decisions.md, D3).

Every parameter name matches one rule of ``SPLIT_TABLE``: a split kind (which axis is cut)
and the unit it counts (query heads, kv heads, experts, shared-expert intermediate rows,
vocabulary rows). Rank r owns the r-th contiguous block of units.

Shares. The ranks of a world of N need not hold equal blocks: each has a *share*, a positive
integer weight (``--shares 2,1,1``: rank 0 holds about half of every unit, ranks 1 and 2 a
quarter each), so a slow machine holds the smaller slice instead of gating everyone. Rank r's
block of n units is its quota ``n * share_r / sum(shares)``, rounded by largest remainder (whole
quotas first, then one more unit to the ranks with the largest fractions, the earlier rank
first on a tie: :func:`share_range`). Equal shares give the plain blocks, the first ``n %
world`` ranks taking one more unit (rank 0 of 2 gets the first ceil(V/2) rows of the output
head): the pair of two equal ranks is cut exactly as before shares existed. Shares are
reduced by their greatest common divisor, so ``2,2`` is ``1,1``.

The limits (:func:`check_splittable`): every rank must hold at least one unit of what it
computes (a kv head, or a query head when the model has a single kv head; a block of
the dense FFN; an expert, or a row of every expert's intermediate dimension; a row of the
shared expert; a vocabulary row), and column cuts of stored blocks fall on whole blocks
(:func:`shard_part`). A world size or shares the model cannot take raise :class:`SplitError`,
one line naming the unit and the nearest world size or shares that work.

The routed experts are cut one of two ways, the :class:`ExpertSplit` (the execution mode both ranks
of a pair must agree on): ``EXPERTS``, the first design (docs/decisions.md, D3), gives each rank a
contiguous block of whole experts; ``INTERMEDIATE`` gives each rank every expert but only its block
of each expert's intermediate dimension (gate/up rows along n_ff, down columns along n_ff). The mode
selects the rules of the three expert tensors (:data:`SPLIT_TABLES`); every other rule is shared.

What each rank computes with its slice, per layer:

- ATTN gate: the output projection of its heads' attention (its columns of ``attn_output``
  times its heads' outputs, from its rows of Q/K/V): an (n_rows, n_embd) partial.
- FFN gate: the outputs of its routed experts plus its slice of the shared expert's
  intermediate rows: an (n_rows, n_embd) partial. The router is replicated, so every rank
  computes the same full routing. With ``EXPERTS`` a rank skips the assignments to experts it
  does not hold (when both of a token's experts sit on one rank, the other idles at the gate);
  with ``INTERMEDIATE`` it evaluates every assignment on its half of the expert:
  ``w * down[:, half] @ (silu(gate[half] x) * up[half] x)``. SwiGLU is elementwise over the
  intermediate dimension, so the two halves' sum is the whole expert, and both ranks do the
  same work for every token.
- The partials of all ranks are summed and added to the residual stream on every rank.
- The output head gives each rank its vocabulary block of the logits; the blocks, joined in
  rank order, are the full logits.

Embeddings and norms are replicated. Query head h reads kv head h // (n_head / n_head_kv), so a
rank owning a contiguous block of whole kv heads owns exactly the query heads reading them
(:func:`attention_split`: uneven blocks for an odd count of kv heads; K and V replicated, query
heads split, when there are fewer kv heads than ranks). A dense FFN is cut by its intermediate
rows (gate/up rows, down columns), on block boundaries (:func:`aligned_range`). A tied output
head (no ``output.weight``) is the replicated ``token_embd``, each rank reading its vocabulary
block of rows.

Weights kept in their stored type (``quant.QTensor``) are cut the same way, along whole blocks:
a cut of the last axis (the COLUMN and EXPERT_COLUMN kinds, where the rank reads part of each
row) must fall on a block boundary of the tensor's type, else :class:`SplitError` names the
tensor and its block size. Cuts of the other axes take whole rows and never split a block.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum

import numpy as np
import numpy.typing as npt

from foundry.model.kernels.quant import Param, QTensor
from foundry.model.spec.arch import QKNorm, spec
from foundry.model.spec.config import ConfigError, ModelConfig

F32 = npt.NDArray[np.float32]


class Gate(IntEnum):
    """The two sync points of a layer, where the ranks' partials are summed
    (DS4_TP_GATE_ATTN / _FFN); the TP gate header carries the value."""

    ATTN = 0
    FFN = 1


class SplitKind(Enum):
    REPLICATED = "replicated"  # every rank holds the whole tensor
    ROW = "row"  # axis 0 of an (out, in) matrix: the rank computes part of the outputs
    COLUMN = "column"  # axis 1: the rank reads part of the inputs, outputs are partial sums
    EXPERT = "expert"  # axis 0 of a merged (E, ., .) expert tensor
    EXPERT_ROW = "expert_row"  # axis 1 of (E, F, D) gate/up: part of every expert's outputs
    EXPERT_COLUMN = "expert_column"  # axis 2 of (E, D, F) down: partial sums of every expert
    VOCAB = "vocab"  # rows of the output head: the rank computes a block of the logits


class ExpertSplit(Enum):
    """How the routed experts are cut: the execution mode both ranks must agree on."""

    EXPERTS = "experts"  # contiguous blocks of whole experts (docs/decisions.md, D3)
    INTERMEDIATE = "intermediate"  # every expert, a block of its intermediate dimension


class Unit(Enum):
    """What a split counts; each unit spans ``unit_size`` elements of the cut axis."""

    HEAD = "head"  # a query head: head_dim columns of attn_output (the heads it attends for)
    KV_HEAD = "kv_head"  # a kv head: head_dim rows of V (the heads it caches)
    Q_ROWS = "q_rows"  # a query head's head_dim rows of Q (all of them under whole-vector
    # QK-norm, which needs the whole Q; else the rank's heads)
    K_ROWS = "k_rows"  # a kv head's head_dim rows of K (likewise)
    FF = "ff"  # one intermediate row of a dense FFN
    EXPERT = "expert"
    EXPERT_FF = "expert_ff"  # one intermediate row of every routed expert
    SHARED_FF = "shared_ff"  # one intermediate row of the shared expert
    VOCAB = "vocab"  # one token's row of the output head


AXIS = {
    SplitKind.ROW: 0,
    SplitKind.COLUMN: 1,
    SplitKind.EXPERT: 0,
    SplitKind.EXPERT_ROW: 1,
    SplitKind.EXPERT_COLUMN: 2,
    SplitKind.VOCAB: 0,
}


@dataclass(frozen=True)
class SplitRule:
    pattern: str  # fnmatch pattern over parameter names
    kind: SplitKind
    unit: Unit | None  # None for REPLICATED


SPLIT_TABLE: tuple[SplitRule, ...] = (
    SplitRule("token_embd.weight", SplitKind.REPLICATED, None),
    SplitRule("rope_freqs.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.attn_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.attn_q.weight", SplitKind.ROW, Unit.Q_ROWS),
    SplitRule("blk.*.attn_k.weight", SplitKind.ROW, Unit.K_ROWS),
    SplitRule("blk.*.attn_v.weight", SplitKind.ROW, Unit.KV_HEAD),
    SplitRule("blk.*.attn_q.bias", SplitKind.ROW, Unit.Q_ROWS),
    SplitRule("blk.*.attn_k.bias", SplitKind.ROW, Unit.K_ROWS),
    SplitRule("blk.*.attn_v.bias", SplitKind.ROW, Unit.KV_HEAD),
    SplitRule("blk.*.attn_q_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.attn_k_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.attn_output.weight", SplitKind.COLUMN, Unit.HEAD),
    SplitRule("blk.*.post_attention_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.ffn_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.ffn_gate.weight", SplitKind.ROW, Unit.FF),
    SplitRule("blk.*.ffn_up.weight", SplitKind.ROW, Unit.FF),
    SplitRule("blk.*.ffn_down.weight", SplitKind.COLUMN, Unit.FF),
    SplitRule("blk.*.post_ffw_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.ffn_gate_inp.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.ffn_gate_exps.weight", SplitKind.EXPERT, Unit.EXPERT),
    SplitRule("blk.*.ffn_up_exps.weight", SplitKind.EXPERT, Unit.EXPERT),
    SplitRule("blk.*.ffn_down_exps.weight", SplitKind.EXPERT, Unit.EXPERT),
    SplitRule("blk.*.ffn_gate_shexp.weight", SplitKind.ROW, Unit.SHARED_FF),
    SplitRule("blk.*.ffn_up_shexp.weight", SplitKind.ROW, Unit.SHARED_FF),
    SplitRule("blk.*.ffn_down_shexp.weight", SplitKind.COLUMN, Unit.SHARED_FF),
    SplitRule("output_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("output.weight", SplitKind.VOCAB, Unit.VOCAB),
)
"""The default table (``ExpertSplit.EXPERTS``)."""

# The rules of the expert tensors in each mode; SPLIT_TABLES puts them in SPLIT_TABLE's place.
EXPERT_RULES: dict[ExpertSplit, tuple[SplitRule, ...]] = {
    ExpertSplit.EXPERTS: tuple(r for r in SPLIT_TABLE if r.kind is SplitKind.EXPERT),
    ExpertSplit.INTERMEDIATE: (
        SplitRule("blk.*.ffn_gate_exps.weight", SplitKind.EXPERT_ROW, Unit.EXPERT_FF),
        SplitRule("blk.*.ffn_up_exps.weight", SplitKind.EXPERT_ROW, Unit.EXPERT_FF),
        SplitRule("blk.*.ffn_down_exps.weight", SplitKind.EXPERT_COLUMN, Unit.EXPERT_FF),
    ),
}


def _with_expert_rules(rules: tuple[SplitRule, ...]) -> tuple[SplitRule, ...]:
    by_pattern = {r.pattern: r for r in rules}
    table = tuple(by_pattern.get(r.pattern, r) for r in SPLIT_TABLE)
    assert set(by_pattern) <= {r.pattern for r in SPLIT_TABLE}
    return table


SPLIT_TABLES: dict[ExpertSplit, tuple[SplitRule, ...]] = {
    mode: _with_expert_rules(rules) for mode, rules in EXPERT_RULES.items()
}
assert SPLIT_TABLES[ExpertSplit.EXPERTS] == SPLIT_TABLE


class SplitError(ConfigError):
    """A model that cannot be cut for the requested world size (names the field and value)."""


def rule_for(name: str, expert_split: ExpertSplit = ExpertSplit.EXPERTS) -> SplitRule:
    for rule in SPLIT_TABLES[expert_split]:
        if fnmatch.fnmatchcase(name, rule.pattern):
            return rule
    raise KeyError(f"no tensor-parallel split rule for parameter {name!r}")


Shares = tuple[int, ...]
"""One positive integer weight per rank, rank 0 first (:func:`norm_shares`)."""

# The most ranks one world holds: the hello's extension carries a share for each (wire.tp).
MAX_WORLD = 16
# A share is a u16 on the wire.
MAX_SHARE = 0xFFFF


def norm_shares(world: int, shares: Sequence[int] | None = None) -> Shares:
    """``shares`` for ``world`` ranks (None: equal), checked and reduced by their gcd."""
    if world < 1:
        raise SplitError(f"world size must be >= 1, got {world}")
    if world > MAX_WORLD:
        raise SplitError(f"world size {world} exceeds the limit of {MAX_WORLD} ranks")
    if shares is None:
        return (1,) * world
    out = tuple(shares)
    if len(out) != world:
        raise SplitError(
            f"{len(out)} shares given for a world of {world} ranks; give one per rank, rank 0 first"
        )
    if any(isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= MAX_SHARE for s in out):
        raise SplitError(
            f"shares must be integers in [1, {MAX_SHARE}], got {','.join(map(str, out))}"
        )
    g = math.gcd(*out)
    return tuple(s // g for s in out)


def share_blocks(n: int, shares: Sequence[int]) -> list[int]:
    """How many of n units each rank holds: its quota ``n * s / sum`` by largest remainder
    (whole quotas, then one more unit to the largest fractions, the earlier rank on a tie)."""
    total = sum(shares)
    sizes = [n * s // total for s in shares]
    order = sorted(range(len(shares)), key=lambda r: (-(n * shares[r] % total), r))
    for r in order[: n - sum(sizes)]:
        sizes[r] += 1
    return sizes


def share_range(n: int, rank: int, shares: Sequence[int]) -> tuple[int, int]:
    """Rank's contiguous block [start, stop) of n units under ``shares`` (see the module
    docstring); equal shares give :func:`block_range`."""
    sizes = share_blocks(n, shares)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def block_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's contiguous block [start, stop) of n units; the first n % world ranks get one more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _align_unit(n: int) -> int:
    """The largest block (256, 32, else 1) that divides n: a dense FFN is cut in these."""
    return next(u for u in (256, 32, 1) if n % u == 0)


def _counted_units(
    cfg: ModelConfig, expert_split: ExpertSplit, world: int
) -> list[tuple[str, int]]:
    """(what, how many) of every unit each rank of ``world`` must hold at least one of."""
    units: list[tuple[str, int]] = []
    if cfg.n_head_kv == 1 < world:  # the one kv head replicated, the query heads split
        units.append(("query heads", cfg.n_head))
    else:
        units.append(("kv heads", cfg.n_head_kv))
    if cfg.n_expert == 0:
        unit = _align_unit(cfg.n_ff)
        units.append((f"dense FFN blocks of {unit} rows", cfg.n_ff // unit))
    elif expert_split is ExpertSplit.EXPERTS:
        units.append(("experts", cfg.n_expert))
    else:
        units.append(("expert intermediate rows", cfg.n_ff))
    if cfg.n_ff_shared:
        units.append(("shared-expert rows", cfg.n_ff_shared))
    units.append(("vocabulary rows", cfg.n_vocab))
    return units


def _short(cfg: ModelConfig, expert_split: ExpertSplit, shares: Shares) -> tuple[str, int] | None:
    """The first unit some rank would hold none of: (what, how many), or None."""
    for what, n in _counted_units(cfg, expert_split, len(shares)):
        if min(share_blocks(n, shares)) < 1:
            return what, n
    return None


def nearest_shares(cfg: ModelConfig, expert_split: ExpertSplit, shares: Sequence[int]) -> Shares:
    """Shares close to ``shares`` that the model can take (``shares`` themselves when it can):
    each short unit handed out as one to every rank and the rest by the wanted shares, that
    allocation the new shares."""
    norm = norm_shares(len(shares), shares)
    for _ in range(8):
        short = _short(cfg, expert_split, norm)
        if short is None:
            return norm
        n = short[1]
        rest = share_blocks(n - len(norm), norm)
        norm = norm_shares(len(norm), [1 + r for r in rest])
    return norm


def check_splittable(
    cfg: ModelConfig,
    world: int,
    expert_split: ExpertSplit = ExpertSplit.EXPERTS,
    shares: Sequence[int] | None = None,
) -> Shares:
    """The normalized shares (:func:`norm_shares`) if the model can be cut for them; else
    :class:`SplitError`, one line naming the unit and the nearest world size or shares that
    work."""
    norm = norm_shares(world, shares)
    equal = len(set(norm)) == 1
    if expert_split is ExpertSplit.INTERMEDIATE and cfg.n_expert and cfg.n_ff % world and equal:
        raise SplitError(
            f"cannot split the experts' intermediate dimension over {world} ranks: "
            f"n_ff={cfg.n_ff} is not divisible by {world} (each rank must hold an equal block "
            f"of every expert); use --expert-split experts or a model whose n_ff is a multiple "
            f"of {world}"
        )
    short = _short(cfg, expert_split, norm)
    if short is None:
        return norm
    what, n = short
    if n < world:
        fits = [w for w in range(world - 1, 0, -1) if _short(cfg, expert_split, (1,) * w) is None]
        nearest = f"the nearest world size that works is {fits[0]}" if fits else "none works"
        raise SplitError(
            f"cannot split the model over {world} ranks: it has {n} {what} and "
            f"every rank needs at least one; {nearest}"
        )
    near = nearest_shares(cfg, expert_split, norm)
    raise SplitError(
        f"cannot split the model by shares {','.join(map(str, norm))}: a rank would hold none "
        f"of its {n} {what}; the nearest shares that work are {','.join(map(str, near))}"
    )


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


def aligned_range(
    n: int, rank: int, world: int, shares: Sequence[int] | None = None
) -> tuple[int, int]:
    """``share_range`` of n rows counted in the largest block (256, 32, else 1) that divides n,
    so a column cut of a stored matrix falls on its blocks (a dense FFN's down projection)."""
    unit = _align_unit(n)
    start, stop = share_range(n // unit, rank, norm_shares(world, shares))
    return start * unit, stop * unit


def attention_split(
    cfg: ModelConfig, rank: int, world: int, shares: Sequence[int] | None = None
) -> dict[str, tuple[int, int]]:
    """Which heads rank ``rank`` of ``world`` attends for, caches, and computes Q/K rows of.

    - KV groups split: when there are at least ``world`` kv heads, the rank owns a contiguous
      block of kv heads (uneven when the count is odd or the shares are: 3 over 2 gives 2 and
      1) with the query heads that read them.
    - A single kv head and several ranks: K and V are replicated (each rank computes and
      caches the kv head), the query heads are split. (More kv heads than one but fewer than
      the ranks: refused by :func:`check_splittable`.)
    - Whole-vector QK-norm (olmoe) needs all of Q and K before the norm: their rows are
      replicated, each rank then keeps its heads' part of the normed vectors.
    """
    group = cfg.n_head // cfg.n_head_kv
    norm = norm_shares(world, shares)
    if cfg.n_head_kv >= world:
        kv = share_range(cfg.n_head_kv, rank, norm)
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


def rank_layout(
    cfg: ModelConfig,
    rank: int,
    world: int,
    expert_split: ExpertSplit = ExpertSplit.EXPERTS,
    shares: Sequence[int] | None = None,
) -> RankLayout:
    """Rank's blocks of every unit in a world of ``world`` ranks holding ``shares`` (None:
    equal); SplitError when the model cannot be cut so (:func:`check_splittable`)."""
    norm = check_splittable(cfg, world, expert_split, shares)
    if not 0 <= rank < world:
        raise SplitError(f"rank must lie in [0, {world}), got {rank}")
    by_ff = expert_split is ExpertSplit.INTERMEDIATE
    dense = cfg.n_expert == 0

    def cut(n: int) -> tuple[int, int]:
        return share_range(n, rank, norm)

    return RankLayout(
        rank=rank,
        world=world,
        shares=norm,
        **attention_split(cfg, rank, world, norm),
        ff=aligned_range(cfg.n_ff, rank, world, norm) if dense else (0, 0),
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
) -> dict[str, tuple[int, ...]]:
    """Shapes of rank's parameters, in param_shapes() order (to load only a rank's part)."""
    return layout_shapes(cfg, rank_layout(cfg, rank, world, expert_split, shares))


def off_blocks(name: str, shape: tuple[int, ...], block: int, layout: RankLayout) -> range | None:
    """The layout's columns of a tensor stored in blocks of ``block`` values when they do not
    start and end on a block boundary (None when they do)."""
    cols = range(*shard_slice(name, len(shape), layout)[-1].indices(shape[-1]))
    return cols if cols.start % block or cols.stop % block else None


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
) -> dict[str, Param]:
    """Rank's part of every parameter (:func:`shard_part`)."""
    return layout_params(cfg, params, rank_layout(cfg, rank, world, expert_split, shares))


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
) -> RankWeights:
    """Cut the full ``params`` for rank ``rank`` of ``world`` ranks holding ``shares``."""
    layout = rank_layout(cfg, rank, world, expert_split, shares)
    return RankWeights(cfg, layout, layout_params(cfg, params, layout))
