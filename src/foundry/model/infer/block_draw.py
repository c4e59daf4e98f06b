"""A step's sampled rows drawn where they lie: each rank of a tensor-parallel pair holds a block
of the vocabulary of every row, and the draw of ``sample_rows`` is split between the ranks so
that no block's logits cross the link (``sample.c``, "A row in blocks", defines each part).

The exchange, for the pair (the leader holds the first block, the worker the second, which
starts on a multiple of :data:`BLOCK`):

1. each rank reduces its block of every row to its largest logit (``sampling.greedy_tops``);
   the leader takes the row's top and its error, if any, from both;
2. the leader's :meth:`BlockRows.leader_pass`: its block's probabilities with that top, their
   count above 0, and its mass (its block masses added in order); what the worker needs of it
   goes in a :class:`DrawArgs` each row (``ROW_DRAW`` on the wire);
3. the worker's :meth:`BlockRows.worker_tail`: the same for its block, continuing the leader's
   mass, then the draw: a :class:`Pick` each row (``ROW_PICKS``): its token, or where the
   leader finds it (its own blocks' walk to a target, its last nonzero token), or for a row cut
   to ``top_k``, the worker's best candidates. With the leader's mass sent apart (``ROW_MASS``:
   the leader sends the row's top first, its mass after its pass) the worker runs its pass
   (:meth:`BlockRows.worker_pass`) while the leader runs its own, and
   :meth:`BlockRows.worker_finish` continues from the leader's mass when it comes: the same
   additions in the same order, so the same picks, with the two passes at once instead of one
   after the other;
4. the leader's :meth:`BlockRows.finish`: each row's token, exactly ``sample_rows``'s on the
   whole row (the same float operations in the same order).

Rows drawn this way have ``top_p`` 1 (the nucleus sums its buckets across the whole row in id
order, which no block holds) and ``top_k`` at most :data:`MAX_TOP_K`. Without the C kernels the
parts are numpy's (``exp`` in other roundings, as ``sampling``'s numpy draw).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from foundry.model.kernels.quant import _kernels

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

BLOCK = 64  # sample.c's block of the row's mass: every rank's block starts on a multiple
MAX_TOP_K = 256  # the most candidates a rank sends for a row cut to top_k

# sample.c's modes and kinds (kernels.h).
PART_SKIP, PART_PASS, PART_TAIL, PART_WALK, PART_LAST, PART_TOP_K = -1, 0, 1, 2, 3, 4
PART_FINISH = 5
KIND_NONE, KIND_TOKEN, KIND_LEADER_WALK, KIND_LEADER_LAST, KIND_TOP_K = 0, 1, 2, 3, 4
_NO_MEMORY = -3
_ARGS, _OUTS = 8, 7  # PART_ARGS, PART_OUTS
_FLT_MAX = float(np.finfo(np.float32).max)


def inverse_temperature(temperature: float) -> float:
    """1 / temperature rounded to float32, at most its largest value (``sample.c`` 2.)."""
    inv = 1.0 / temperature
    return float(np.float32(inv)) if inv < _FLT_MAX else _FLT_MAX


@dataclass(frozen=True)
class DrawArgs:
    """What the worker needs of the leader to draw one row (``ROW_DRAW``'s row)."""

    draw: bool  # False: the row is not drawn here (greedy, or it failed)
    top_k: int = 0
    top: float = 0.0  # the row's largest logit
    inv: float = 0.0  # inverse_temperature
    acc: float = 0.0  # the leader's mass: its block masses added in order
    u: float = 0.0  # the row's uniform
    nonzero: int = 0  # the leader's tokens of probability above 0


@dataclass(frozen=True)
class Pick:
    """The worker's answer for one row (``ROW_PICKS``'s row): its ``kind`` (KIND_*), a token
    index in its block (KIND_TOKEN), the target the leader walks to (KIND_LEADER_WALK), or
    its best candidates, (probability, index in its block), best first (KIND_TOP_K)."""

    kind: int
    index: int = 0
    target: float = 0.0
    candidates: tuple[tuple[float, int], ...] = ()


class BlockRows:
    """One rank's block of a step's rows, kept from one part of the draw to the next: the
    block's logits (R, V), its probabilities and block masses once a pass ran."""

    def __init__(self, z: npt.NDArray[np.floating], k: int = MAX_TOP_K) -> None:
        self.z = np.ascontiguousarray(z, dtype=np.float32)  # (R, V)
        rows, v = self.z.shape
        self.e: F32 = np.empty((rows, v), np.float32)
        self.bsum: F64 = np.empty((rows, (v + BLOCK - 1) // BLOCK), np.float64)
        self.out: F64 = np.zeros((rows, _OUTS), np.float64)
        self.cand_e: F32 = np.empty((rows, k), np.float32)
        self.cand_id: I64 = np.empty((rows, k), np.int64)
        self.k = k

    def _run(self, args: F64) -> None:
        if _kernels is not None:
            _kernels.sample_parts(
                self.z, self.e, self.bsum, args, self.out, self.cand_e, self.cand_id
            )
        else:
            _parts_numpy(self, args)
        if (self.out[:, 3] == _NO_MEMORY).any():
            raise MemoryError("no memory for a row's top-k candidates while sampling")

    def leader_pass(self, rows: Sequence[DrawArgs]) -> list[DrawArgs]:
        """The leader's part 2: ``rows`` with its mass and nonzero count filled in."""
        args = np.zeros((len(rows), _ARGS), np.float64)
        for i, r in enumerate(rows):
            args[i, :4] = (PART_PASS if r.draw else PART_SKIP), r.top, r.inv, 0.0
        self._run(args)
        return [
            DrawArgs(True, r.top_k, r.top, r.inv, float(o[2]), r.u, int(o[0])) if r.draw else r
            for r, o in zip(rows, self.out, strict=True)
        ]

    def worker_tail(self, rows: Sequence[DrawArgs]) -> list[Pick]:
        """The worker's part 3: each row's pick from its block."""
        return self._worker_picks(rows, PART_TAIL)

    def worker_pass(self, rows: Sequence[DrawArgs]) -> None:
        """Part 3's pass alone, before the leader's mass is known (``acc`` and ``nonzero`` of
        ``rows`` are not read): this block's probabilities with each drawn row's top."""
        args = np.zeros((len(rows), _ARGS), np.float64)
        for i, r in enumerate(rows):
            args[i, :3] = (PART_PASS if r.draw else PART_SKIP), r.top, r.inv
        self._run(args)

    def worker_finish(self, rows: Sequence[DrawArgs]) -> list[Pick]:
        """Part 3 after :meth:`worker_pass` of the same rows (their top and inv), with the
        leader's mass and count now in ``rows``: the picks ``worker_tail`` gives."""
        return self._worker_picks(rows, PART_FINISH)

    def _worker_picks(self, rows: Sequence[DrawArgs], mode: int) -> list[Pick]:
        args = np.zeros((len(rows), _ARGS), np.float64)
        for i, r in enumerate(rows):
            if r.draw:
                args[i] = (mode, r.top, r.inv, r.acc, r.u, 0.0, r.top_k, r.nonzero)
            else:
                args[i, 0] = PART_SKIP
        self._run(args)
        picks = []
        for i, o in enumerate(self.out):
            kind, n = int(o[3]), int(o[6])
            cands = tuple(
                zip(self.cand_e[i, :n].tolist(), self.cand_id[i, :n].tolist(), strict=True)
            )
            picks.append(Pick(kind, int(o[4]) if kind == KIND_TOKEN else 0, float(o[5]), cands))
        return picks

    def finish(self, rows: Sequence[DrawArgs], picks: Sequence[Pick], offset: int) -> list[int]:
        """The leader's part 4: each drawn row's token (-1 for a row not drawn, or one whose
        pick gave no token), ``offset`` the worker's block's first token id."""
        args = np.zeros((len(rows), _ARGS), np.float64)
        for i, (r, p) in enumerate(zip(rows, picks, strict=True)):
            mode = {KIND_LEADER_WALK: PART_WALK, KIND_LEADER_LAST: PART_LAST}.get(p.kind)
            if r.draw and p.kind == KIND_TOP_K:
                mode = PART_TOP_K
            args[i, 0] = PART_SKIP if mode is None else mode
            args[i, 5], args[i, 6], args[i, 7] = p.target, r.top_k, r.nonzero
        self._run(args)
        tokens = []
        for i, (r, p) in enumerate(zip(rows, picks, strict=True)):
            if not r.draw:
                tokens.append(-1)
            elif p.kind == KIND_TOKEN:
                tokens.append(offset + p.index)
            elif p.kind in (KIND_LEADER_WALK, KIND_LEADER_LAST):
                tokens.append(int(self.out[i, 4]))
            else:
                n = int(self.out[i, 6])
                mine = zip(self.cand_e[i, :n].tolist(), self.cand_id[i, :n].tolist(), strict=True)
                theirs = ((e, offset + j) for e, j in p.candidates)
                tokens.append(draw_kept([*mine, *theirs], r.top_k, r.u))
        return tokens


def draw_kept(candidates: Sequence[tuple[float, int]], k: int, u: float) -> int:
    """``sample.c``'s draw over the row's ``k`` best of ``candidates`` (probability, token):
    ordered by probability, ties by the lower id; the first whose running mass exceeds
    u x their mass (float64, in that order)."""
    kept = sorted(candidates, key=lambda c: (-c[0], c[1]))[:k]
    if not kept:
        return -1  # no candidate: not a row cut to top_k (the caller's error)
    total = 0.0
    for e, _ in kept:
        total = total + e
    target = u * total
    cum = 0.0
    for e, token in kept:
        cum = cum + e
        if cum > target:
            return token
    return kept[-1][1]


def _parts_numpy(rows: BlockRows, args: F64) -> None:
    """``sample_parts`` in numpy (no C kernels): the same steps, ``exp`` in numpy's roundings."""
    v = rows.z.shape[1]
    for i, a in enumerate(args):
        mode, o = int(a[0]), rows.out[i]
        o[3], o[6] = KIND_NONE, 0
        e, bsum = rows.e[i], rows.bsum[i]
        if mode in (PART_PASS, PART_TAIL, PART_FINISH):
            if mode != PART_FINISH:
                with np.errstate(under="ignore", over="ignore"):
                    e[:] = np.exp((rows.z[i] - np.float32(a[1])) * np.float32(a[2]))
                pad = np.zeros(len(bsum) * BLOCK, np.float64)
                pad[:v] = e
                bsum[:] = pad.reshape(-1, BLOCK // 8, 8).sum(axis=1).sum(axis=1)
                o[0], o[1] = np.count_nonzero(e > 0), _last_nonzero(e, 0, v)
            nonzero, last = int(o[0]), int(o[1])
            mass = float(np.cumsum(np.r_[a[3], bsum])[-1])
            o[2] = mass
            if mode == PART_PASS:
                continue
            if a[6] and a[6] < nonzero + a[7]:
                _top_k(rows, i, int(a[6]), nonzero)
                continue
            target = a[4] * mass
            o[5] = target
            if a[3] > target:
                o[3] = KIND_LEADER_WALK
                continue
            t = _walk(e, bsum, a[3], target)
            o[3] = KIND_TOKEN if t >= 0 or last >= 0 else KIND_LEADER_LAST
            o[4] = t if t >= 0 else last
        elif mode == PART_WALK:
            t = _walk(e, bsum, 0.0, a[5])
            o[3], o[4] = KIND_TOKEN, t if t >= 0 else _last_nonzero(e, 0, v)
        elif mode == PART_LAST:
            o[3], o[4] = KIND_TOKEN, _last_nonzero(e, 0, v)
        elif mode == PART_TOP_K:
            _top_k(rows, i, int(a[6]), int(a[7]))


def _last_nonzero(e: F32, lo: int, hi: int) -> int:
    nz = np.flatnonzero(e[lo:hi] > 0)
    return lo + int(nz[-1]) if nz.size else -1


def _walk(e: F32, bsum: F64, acc: float, target: float) -> int:
    after = np.cumsum(np.r_[acc, bsum])[1:]  # the running mass after each block, in order
    crossed = np.flatnonzero(after > target)
    for b in crossed[:1].tolist():
        lo, hi = b * BLOCK, min((b + 1) * BLOCK, e.size)
        before = acc if b == 0 else float(after[b - 1])
        inside = np.flatnonzero(np.cumsum(np.r_[before, e[lo:hi].astype(np.float64)])[1:] > target)
        return lo + int(inside[0]) if inside.size else _last_nonzero(e, lo, hi)
    return -1


def _top_k(rows: BlockRows, i: int, k: int, nonzero: int) -> None:
    e = rows.e[i]
    m = min(k, nonzero)
    order = np.lexsort((np.arange(e.size), -e))[:m]  # probability descending, ids ascending
    rows.cand_e[i, :m], rows.cand_id[i, :m] = e[order], order
    rows.out[i, 3], rows.out[i, 6] = KIND_TOP_K, m
