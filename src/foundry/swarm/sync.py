"""What the coordinator and the workers hold in common, and how it moves: pure, no sockets.

Theory of operation
-------------------
Every worker holds the same weights, the **shadow**: the coordinator keeps an exact copy of it
(``Shadow``). After the coordinator changes its own weights (the **master**: AdamW on the
averaged gradient when ``--sync-every 1``, the outer Nesterov step on the averaged
pseudo-gradient above 1), it sends every worker one UPDATE, ``encode(master - shadow)`` with
the downlink codec, and adds what the worker will decode to its copy of the shadow. Both sides
run the same f32 additions on the same decoded bytes, so they end bit for bit equal on every
IEEE-754 machine, x86 or ARM. Whatever a lossy codec dropped stays in ``master - shadow`` and
goes out with the next update: error feedback held by the coordinator, so it always knows
which bytes every worker holds. Full weights go out only to a worker that joins (or missed an
update) and to one whose digest (``weights_digest``, every K steps) differs from the shadow's.

With ``--sync-every H > 1`` a round is a time budget (DyLU): the fastest worker runs ``H``
inner steps, each other one the steps its measured rate allows in the same time, at least one
(``plan_local_round``); contributions are weighted by samples. The outer optimizer is
Nesterov momentum on the averaged pseudo-gradient (``OuterNesterov``; DiLoCo's lr 0.7,
momentum 0.9).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from foundry.compression import Codec
from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import Corpus
from foundry.model.train.backend import NUMPY
from foundry.model.train.optim import AdamW, lr_schedule
from foundry.model.train.training import GradientResult, Params

F32 = npt.NDArray[np.float32]

# DiLoCo's outer optimizer (arXiv 2311.08105, section 3): Nesterov, lr 0.7, momentum 0.9.
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
# A worker reports the digest of its weights every this many steps: BLAKE2b of 13.7 MB (the
# small preset) costs about 20 ms, well under 1% of ten rounds.
DEFAULT_DIGEST_EVERY = 10


def weights_digest(params: Mapping[str, F32], order: Sequence[str]) -> bytes:
    """BLAKE2b-256 of every tensor's little-endian f32 bytes, in ``order``."""
    h = hashlib.blake2b(digest_size=32)
    for name in order:
        h.update(np.ascontiguousarray(params[name], dtype="<f4").data)
    return h.digest()


def add_update(params: Mapping[str, F32], names: Sequence[str], tensors: Sequence[F32]) -> None:
    """``params[name] += tensor`` for each, in place: what a worker does with an UPDATE."""
    for name, t in zip(names, tensors, strict=True):
        p = params[name]
        p += t.reshape(p.shape)


class Shadow:
    """The coordinator's exact copy of what every worker holds, and the UPDATE that moves it."""

    def __init__(self, params: Mapping[str, F32]) -> None:
        self.names = list(params)
        self.params: dict[str, F32] = {k: np.array(v, dtype=np.float32) for k, v in params.items()}

    def update(self, master: Mapping[str, F32], codec: Codec) -> bytes | memoryview:
        """The data section of an UPDATE taking workers towards ``master``; applied here too."""
        deltas = [
            np.subtract(master[k], self.params[k], dtype=np.float32).reshape(-1) for k in self.names
        ]
        if not codec.lossy:  # NONE decodes to exactly these values
            add_update(self.params, self.names, deltas)
            return codec.encode_section(deltas)
        parts = [codec.encode_decoded(d) for d in deltas]
        add_update(self.params, self.names, [sent for _, sent in parts])
        return b"".join(data for data, _ in parts)

    def digest(self) -> bytes:
        return weights_digest(self.params, self.names)

    def residual_norm(self, master: Mapping[str, F32]) -> float:
        """||master - shadow||: what the workers still lack (0 with a lossless downlink)."""
        return math.sqrt(
            sum(
                float(np.sum((master[k] - self.params[k]) ** 2, dtype=np.float64))
                for k in self.names
            )
        )


class OuterNesterov:
    """Nesterov momentum on the pseudo-gradient (PyTorch's SGD(nesterov=True) form).

    ``m = mu m + g``; ``params -= lr (g + mu m)``. ``g`` is the averaged pseudo-gradient
    (start weights minus the workers' weights), so lr 1 with mu 0 is plain averaging.
    """

    def __init__(
        self,
        params: Mapping[str, F32],
        lr: float = DEFAULT_OUTER_LR,
        momentum: float = DEFAULT_OUTER_MOMENTUM,
    ) -> None:
        if lr <= 0 or not 0.0 <= momentum < 1.0:
            raise ValueError(f"need outer lr > 0 and momentum in [0, 1), got {lr}, {momentum}")
        self.lr = lr
        self.momentum = momentum
        self.m: dict[str, F32] = {k: np.zeros_like(v, dtype=np.float32) for k, v in params.items()}

    def step(self, params: Mapping[str, F32], pseudo_grads: Mapping[str, F32]) -> None:
        mu, lr = np.float32(self.momentum), np.float32(self.lr)
        for name, p in params.items():
            g = pseudo_grads[name].reshape(p.shape)
            m = self.m[name]
            m *= mu
            m += g
            p -= lr * (g + mu * m)

    def load(self, m: Mapping[str, F32]) -> None:
        if m.keys() != self.m.keys():
            raise KeyError("outer momentum holds other parameters than the model")
        self.m = {k: np.array(v, dtype=np.float32).reshape(self.m[k].shape) for k, v in m.items()}


@dataclass(frozen=True)
class InnerSchedule:
    """What inner steps need of the plan: the learning-rate schedule and clipping."""

    lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    grad_clip: float

    def lr_at(self, step: int) -> float:
        return lr_schedule(step, self.lr, self.warmup_steps, self.total_steps, self.min_lr_ratio)


def all_finite(tensors: Iterable[F32]) -> bool:
    """Whether no value of the tensors is NaN or inf: one float64 sum per tensor (NaN and inf
    carry through a sum, and float32 values cannot overflow one), no mask allocated."""
    return all(math.isfinite(float(np.sum(t, dtype=np.float64))) for t in tensors)


def local_steps(
    start: Params,
    inner: AdamW,
    cfg: ModelConfig,
    corpus: Corpus,
    schedule: InnerSchedule,
    *,
    global_step: int,
    sample_offset: int,
    samples_per_step: int,
    steps: int,
    micro_batch: int,
    seq_len: int,
    aux_loss_coef: float,
    stop: Callable[[], bool] | None = None,
) -> GradientResult:
    """``steps`` inner AdamW steps from ``start`` (left unchanged) on consecutive global
    samples, on the numpy engine (``backend.NumpyBackend.local_steps``; a worker calls its own
    backend's): the pseudo-gradient ``start - end``, weighted as ``steps * samples_per_step``.
    """
    return NUMPY.local_steps(
        start,
        inner,
        cfg,
        corpus,
        lr_at=schedule.lr_at,
        grad_clip=schedule.grad_clip,
        global_step=global_step,
        sample_offset=sample_offset,
        samples_per_step=samples_per_step,
        steps=steps,
        micro_batch=micro_batch,
        seq_len=seq_len,
        aux_loss_coef=aux_loss_coef,
        stop=stop,
    )


# A worker whose steps fill the round's budget to within this share keeps its batch.
FILL_TOLERANCE = 0.05
# A slow worker's steps fill this share of the budget: its rate jitters and leaves out the
# fixed cost of each step, and where it overruns the fastest worker waits, while a short
# fill costs only a few of its own samples.
SLOW_FILL = 0.85


def plan_local_round(
    batch: Mapping[str, int],
    rates: Mapping[str, float],
    sync_every: int,
    slow: Collection[str] = (),
) -> dict[str, int]:
    """Inner steps per worker for one round: a time budget, not a step count (DyLU).

    ``batch`` is each worker's samples per inner step, ``rates`` its measured samples/s (0:
    not measured yet). The budget is what the fastest worker needs for ``sync_every`` steps;
    each worker gets the steps that fit in it at its own rate, at least 1 and at most
    ``sync_every``: to the nearest, or for the ``slow`` workers (``policy.slow_workers``)
    rounded down, so that ``fill_local_round`` makes their steps fuller rather than cut
    them. Before every worker is measured, all run ``sync_every``.
    """
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    budget = _round_budget(batch, rates, sync_every)
    if budget is None:
        return dict.fromkeys(batch, sync_every)
    return {
        w: max(
            1,
            min(
                sync_every, math.floor(budget / (batch[w] / rates[w]) + (0.0 if w in slow else 0.5))
            ),
        )
        for w in batch
    }


def _round_budget(
    batch: Mapping[str, int],
    rates: Mapping[str, float],
    sync_every: int,
) -> float | None:
    """Seconds of a local round: ``sync_every`` steps of the fastest worker; None when the
    round is H steps of each worker's batch (not every worker measured, or equal machines)."""
    step_s = [batch[w] / rates[w] for w in batch if rates.get(w, 0.0) > 0 and batch[w] > 0]
    if not batch or len(step_s) < len(batch) or equal_machines(rates, batch):
        return None
    return sync_every * min(step_s)


def equal_machines(rates: Mapping[str, float], among: Mapping[str, int]) -> bool:
    """Whether the workers of ``among`` run within ``FILL_TOLERANCE`` of the same rate: then
    they all run H steps of their batch (batches that differ by the global batch's remainder
    are not a difference of speed, and measured rates jitter)."""
    r = [rates.get(w, 0.0) for w in among]
    return bool(r) and min(r) > 0 and max(r) <= (1 + FILL_TOLERANCE) * min(r)


def fill_local_round(
    batch: Mapping[str, int],
    rates: Mapping[str, float],
    steps: Mapping[str, int],
    sync_every: int,
    slow: Collection[str] = (),
    overheads: Mapping[str, float] | None = None,
) -> dict[str, int]:
    """Samples per inner step that make each worker's ``steps`` fill the round's budget.

    Whole steps leave a worker short of the budget or over it (3 steps where 2.67 fit: 12 %
    over, and the fastest waits for it): each worker's samples per step are set so that its
    steps take the budget at its rate, within half and twice ``batch``. The fastest keeps its
    own; so does everyone before every worker is measured, and a worker already within
    ``FILL_TOLERANCE`` of the budget (measured rates jitter by a few percent: equal machines
    keep equal batches). The ``slow`` workers fill ``SLOW_FILL`` of the budget, and one that
    has a single step goes below half its batch if that is what fits (a CPU worker beside a
    GPU: one step of its equal share takes longer than the GPU's whole round). Where
    ``overheads`` gives each worker's measured seconds of a round beyond its compute, a slow
    worker's budget is also short by what its overhead exceeds the fastest worker's (its
    UPDATE's decoding and its upload on a CPU, its later place in the round's sends).
    """
    budget = _round_budget(batch, rates, sync_every)
    if budget is None:
        return dict(batch)
    over = overheads or {}
    fastest = min(batch, key=lambda w: (batch[w] / rates[w], w))
    out = {}
    for w, b in batch.items():
        if w in slow:
            extra = max(0.0, over.get(w, 0.0) - over.get(fastest, 0.0))
            fit = max(0.0, SLOW_FILL * budget - extra) * rates[w] / steps[w]
            least = 1 if steps[w] == 1 else -(-b // 2)
            out[w] = min(2 * b, max(least, math.floor(fit)))
            continue
        fit = budget * rates[w] / steps[w]
        out[w] = (
            b if abs(fit - b) <= FILL_TOLERANCE * b else min(2 * b, max(-(-b // 2), round(fit)))
        )
    return out


def digest_due(base_step: int, global_step: int, every: int) -> bool:
    """Whether the UPDATE from ``base_step`` to ``global_step`` is followed by a weights
    digest: it crosses a multiple of ``every`` (0: never). Rounds of H steps after a warm-up
    need not land on one (warm-up 5, H 4: steps 9, 13, 17, ...)."""
    return every > 0 and global_step // every > base_step // every
