"""The ranks' shares (one integer weight per rank; a rank's block of n units by largest
remainder) and the limits a model sets on a world's size and shares (``check_splittable``: a
refusal names the nearest world size or shares that work)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from foundry.model.shard.table import ExpertSplit, SplitError
from foundry.model.spec.config import ModelConfig

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


def align_unit(n: int) -> int:
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
        unit = align_unit(cfg.n_ff)
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
