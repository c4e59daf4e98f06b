"""Round policy of the swarm as pure functions of state and time (no sockets, no clocks).

Theory of operation
-------------------
Training is synchronous data parallelism on a parameter server. Step ``s`` trains on the
global samples ``[P, P + G)`` where ``P`` is the data position and ``G`` the global batch:
the same samples whatever the number of workers, so adding or losing a machine changes the
speed of training, not its maths.

At the start of a round the coordinator splits ``G`` among the active workers in proportion
to their measured throughput (samples/s), so a Raspberry Pi and a desktop finish together
(:func:`allocate_samples`). The round closes when every assigned worker reported, or at an
adaptive deadline (:func:`round_deadline`) if the reported samples reach the quorum; below
quorum at the deadline the round is abandoned and re-run on whoever is left
(:func:`round_decision`). Gradients are averaged weighted by the samples each worker actually
processed (:func:`weighted_mean`), which for equal-length sequences is exactly the mean over
the global batch.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

# In a local-step round a worker measured below this share of the mean rate is slow: it
# keeps the equal share of the global batch and adds its samples on top of the fast ones'.
SLOW_SHARE = 0.5
# A measured rate moves this far towards each new measurement: fast enough to follow a
# machine that got busy, slow enough that one noisy round does not swing the split.
RATE_EMA_ALPHA = 0.5
# The deadline waits this many times the slowest expected finish: round times on shared
# machines jitter by tens of percent, a straggler twice as slow as measured is a real stall.
DEADLINE_FACTOR = 2.5
# Never close a round earlier than this after it began (loopback jitter, GC pauses).
DEADLINE_FLOOR_S = 2.0
# Before any worker was measured there is nothing to adapt from: allow a first compile-free
# numpy round on a Raspberry Pi 3.
INITIAL_DEADLINE_S = 120.0
# A seed-only peer is dropped after this many of its own longest recent heartbeat intervals
# of silence: one late heartbeat is jitter, three missed in a row are not.
SEED_CADENCE_FACTOR = 4.0
# A round closes at its deadline only with at least this share of the assigned samples.
DEFAULT_QUORUM = 0.5


def allocate_samples(global_batch: int, rates: Mapping[str, float]) -> dict[str, int]:
    """Split ``global_batch`` samples among workers in proportion to their samples/s.

    Largest-remainder rounding, so the shares sum exactly to ``global_batch``; every worker
    gets at least one sample while there are enough to go round (an idle worker would never be
    measured again). Ties are broken by worker id, so the split is deterministic.
    """
    if global_batch < 0:
        raise ValueError(f"global_batch must be >= 0, got {global_batch}")
    ids = sorted(rates)
    if not ids:
        return {}
    weights = [max(float(rates[i]), 0.0) for i in ids]
    total = sum(weights)
    if total <= 0.0 or not math.isfinite(total):
        weights = [1.0] * len(ids)
        total = float(len(ids))
    floor_each = 1 if global_batch >= len(ids) else 0
    spare = global_batch - floor_each * len(ids)
    exact = [spare * w / total for w in weights]
    shares = [floor_each + math.floor(x) for x in exact]
    left = global_batch - sum(shares)
    by_remainder = sorted(range(len(ids)), key=lambda k: (-(exact[k] - math.floor(exact[k])), k))
    for k in by_remainder[:left]:
        shares[k] += 1
    return dict(zip(ids, shares, strict=True))


def local_batches(
    global_batch: int, rates: Mapping[str, float], tolerance: float = 0.05
) -> dict[str, int]:
    """Samples per inner step of each worker in a local-step round (``--sync-every H``).

    A worker's inner step costs a fixed part (a whole AdamW step over every parameter, the
    per-call and kernel-launch costs) plus a part per sample, and each round a fixed exchange;
    on a GPU the fixed parts are most of it at small batches. An equal split of
    ``global_batch`` shrank a GPU's batch to ``G / 5`` beside four CPU workers, so its rounds
    carried a fifth of its samples for the same fixed costs (0.24 of the summed standalone
    rates on the device). So the workers are split in two:

    - **slow** ones, measured below ``SLOW_SHARE`` of the mean rate, each keep the equal
      share ``G / n`` (the round's time budget then gives them the steps that fit, fewer and
      fuller: ``sync.plan_local_round``, ``sync.fill_local_round``; a few samples a step
      would pay a whole AdamW step each);
    - the others split the whole ``global_batch`` by measured rate, as if the slow ones were
      not there: their rounds are what they would be alone, and the slow workers' samples
      come on top in the same time.

    Before every worker is measured, and between machines within ``tolerance`` of the same
    rate, this is the equal split (summing to ``global_batch``), as it always was.
    """
    equal = allocate_samples(global_batch, dict.fromkeys(rates, 1.0))
    r = [float(rates[w]) for w in rates]
    if not r or min(r) <= 0.0 or max(r) <= (1.0 + tolerance) * min(r):
        return equal
    slow = slow_workers(rates)
    out = allocate_samples(global_batch, {w: float(rates[w]) for w in rates if w not in slow})
    out.update({w: equal[w] for w in slow})
    return out


def slow_workers(rates: Mapping[str, float]) -> frozenset[str]:
    """The workers measured below ``SLOW_SHARE`` of the mean rate (none before every worker
    is measured): in a local-step round they keep the equal share and fill a little less than
    the round's budget (``sync.fill_local_round``)."""
    r = [float(rates[w]) for w in rates]
    if not r or min(r) <= 0.0:
        return frozenset()
    mean = sum(r) / len(r)
    return frozenset(w for w in rates if rates[w] < SLOW_SHARE * mean)


def contiguous_offsets(start: int, shares: Mapping[str, int]) -> dict[str, int]:
    """Give each worker a contiguous slice of ``[start, start + sum(shares))``, in id order."""
    offsets: dict[str, int] = {}
    pos = start
    for worker_id in sorted(shares):
        offsets[worker_id] = pos
        pos += shares[worker_id]
    return offsets


def update_rate(previous: float | None, measured: float, alpha: float = RATE_EMA_ALPHA) -> float:
    """Exponential moving average of samples/s; the first measurement is taken as is."""
    if not math.isfinite(measured) or measured <= 0.0:
        return previous if previous is not None else 0.0
    if previous is None or previous <= 0.0:
        return measured
    return (1.0 - alpha) * previous + alpha * measured


def round_deadline(
    started_at: float,
    shares: Mapping[str, int],
    rates: Mapping[str, float],
    *,
    overheads: Mapping[str, float] | None = None,
    factor: float = DEADLINE_FACTOR,
    floor_s: float = DEADLINE_FLOOR_S,
    initial_s: float = INITIAL_DEADLINE_S,
) -> float:
    """When the round stops waiting: ``factor`` times the slowest expected finish, its
    compute (``shares`` at ``rates``) plus the time its round took beyond computing
    (``overheads``, measured: the update down, the gradient up), so a round whose transfers
    outlast its compute (a large model on a home LAN) is not closed before they arrive.

    A worker without a measured rate yet makes the deadline the generous ``initial_s``.
    """
    expected = 0.0
    for worker_id, n in shares.items():
        rate = rates.get(worker_id, 0.0)
        if rate <= 0.0:
            return started_at + initial_s
        extra = 0.0 if overheads is None else overheads.get(worker_id, 0.0)
        expected = max(expected, n / rate + extra)
    return started_at + max(floor_s, factor * expected)


class RoundDecision(enum.Enum):
    WAIT = "wait"  # keep collecting gradients
    CLOSE = "close"  # aggregate what arrived and step
    ABANDON = "abandon"  # below quorum at the deadline: re-run the step on who is left


def round_decision(
    *,
    now: float,
    deadline: float,
    assigned: Mapping[str, int],
    reported: Mapping[str, int],
    quorum: float = DEFAULT_QUORUM,
) -> RoundDecision:
    """Close when everyone assigned reported; at the deadline close with quorum, else abandon.

    ``assigned`` holds the workers still alive (a dropped worker is removed by the caller), so
    a round never waits on the dead; ``reported`` maps each reporter to its sample count.
    """
    pending = [w for w in assigned if w not in reported]
    if not pending and reported:
        return RoundDecision.CLOSE
    if now < deadline:
        return RoundDecision.WAIT
    total_assigned = sum(assigned.values()) + sum(
        n for w, n in reported.items() if w not in assigned
    )
    got = sum(reported.values())
    if got > 0 and got >= quorum * total_assigned:
        return RoundDecision.CLOSE
    return RoundDecision.ABANDON


def weighted_mean(
    grads: Sequence[tuple[int, Sequence[npt.NDArray[np.float32]]]],
) -> list[npt.NDArray[np.float32]]:
    """Average per-worker mean gradients weighted by the samples each one processed.

    ``grads`` is ``[(n_samples, [tensor, ...]), ...]``, tensors in the canonical order.
    The result is accumulated in a fixed order (as given), so it is reproducible.
    """
    if not grads:
        raise ValueError("no gradients to average")
    total = sum(n for n, _ in grads)
    if total <= 0:
        raise ValueError("gradients cover no samples")
    out: list[npt.NDArray[np.float32]] | None = None
    for n, tensors in grads:
        out = _add_weighted(out, n / total, tensors)
    assert out is not None
    return out


def _add_weighted(
    acc: list[npt.NDArray[np.float32]] | None,
    weight: float,
    tensors: Sequence[npt.NDArray[np.float32]],
) -> list[npt.NDArray[np.float32]]:
    """``acc + weight * tensors`` in place (the first term when ``acc`` is None)."""
    w = np.float32(weight)
    if acc is None:
        return [w * t for t in tensors]
    if len(tensors) != len(acc):
        raise ValueError(f"expected {len(acc)} tensors, got {len(tensors)}")
    for a, t in zip(acc, tensors, strict=True):
        a += w * t
    return acc


class GradientSum:
    """The weighted mean of one round's gradients, summed while the round is still open.

    ``mean()`` equals ``weighted_mean`` of the reported parts in worker-id order, bit for bit;
    summing each part as it arrives leaves only the last one to the round's critical path.
    A part is summed once every planned worker before it (in id order) reported, so the order
    never depends on arrival. Planned parts are weighted by ``n / planned total``; a round that
    closes with other samples (a worker left, or one that was not planned reported) is summed
    again from its parts at ``mean()``.
    """

    def __init__(self, shares: Mapping[str, int]) -> None:
        self._shares = dict(shares)
        self._order = sorted(shares)
        self._total = sum(shares.values())
        self._parts: dict[str, tuple[int, Sequence[npt.NDArray[np.float32]]]] = {}
        self._summed = 0  # _order[:_summed] are in _sum
        self._sum: list[npt.NDArray[np.float32]] | None = None

    def add(self, worker_id: str, n: int, tensors: Sequence[npt.NDArray[np.float32]]) -> None:
        if worker_id in self._parts:
            raise ValueError(f"{worker_id} reported twice")
        self._parts[worker_id] = (n, tensors)
        while self._summed < len(self._order) and self._order[self._summed] in self._parts:
            n_k, tensors_k = self._parts[self._order[self._summed]]
            if n_k != self._shares[self._order[self._summed]]:
                break  # not the planned share: the weights are wrong, mean() sums again
            self._sum = _add_weighted(self._sum, n_k / self._total, tensors_k)
            self._summed += 1

    def mean(self) -> list[npt.NDArray[np.float32]]:
        if self._summed == len(self._order) == len(self._parts) and self._sum is not None:
            return self._sum
        return weighted_mean([self._parts[w] for w in sorted(self._parts)])


def is_dead(now: float, last_seen: float, timeout_s: float) -> bool:
    """A worker silent for longer than ``timeout_s`` (no heartbeat, no message) is dropped."""
    return now - last_seen > timeout_s


def liveness_timeout(
    *,
    extended: bool,
    heartbeat_intervals: Sequence[float],
    fast_s: float,
    seed_default_s: float,
    cadence_factor: float = SEED_CADENCE_FACTOR,
) -> float:
    """How long a worker may stay silent before it is dropped.

    Our workers heartbeat every 0.5 s, so they get the fast timeout ``fast_s``. The seed
    header fixes no heartbeat interval, so a seed-only peer is judged against its own cadence:
    ``cadence_factor`` times the longest of its recent intervals (never below ``fast_s``), and
    ``seed_default_s`` until two heartbeats have shown what that cadence is.
    """
    if extended:
        return fast_s
    if not heartbeat_intervals:
        return seed_default_s
    return max(fast_s, cadence_factor * max(heartbeat_intervals))


class Report(enum.Enum):
    ACCEPTED = "accepted"  # counted in the round
    STALE = "stale"  # another step, a second report, or work the worker was not given


class RoundTracker:
    """The rules of one round as a pure object: who owes what, what arrived, whether it closes.

    It reads no clock and touches no socket: every call that depends on time takes ``now``.
    ``shares`` maps each worker expected to report to its samples; ``drop`` removes one that
    left before reporting, so the round never waits on the dead. A report of the round's step
    from a worker not in ``shares`` is taken only when ``assigned_only`` is False (a seed-only
    peer trains whatever shard it likes), counted for the ``samples`` it brings.
    """

    def __init__(
        self,
        step: int,
        shares: Mapping[str, int],
        *,
        started: float,
        deadline: float,
        quorum: float = DEFAULT_QUORUM,
    ) -> None:
        self.step = step
        self.shares = dict(shares)  # still expected: not dropped
        self.planned = dict(shares)  # as the round began
        self.started = started
        self.deadline = deadline
        self.quorum = quorum
        self.reported: dict[str, int] = {}  # worker -> samples counted
        self.losses: dict[str, float] = {}
        self.report_at: dict[str, float] = {}
        self.gradients = GradientSum(self.shares)

    @property
    def first_report_at(self) -> float | None:
        return min(self.report_at.values()) if self.report_at else None

    def accepts(self, worker_id: str, step: int, *, assigned_only: bool = True) -> bool:
        """Whether a report would count (checked before decoding its payload)."""
        if step != self.step or worker_id in self.reported:
            return False
        return not (assigned_only and worker_id not in self.shares)

    def report(
        self,
        worker_id: str,
        step: int,
        tensors: Sequence[npt.NDArray[np.float32]],
        *,
        samples: int,
        loss: float,
        now: float,
        assigned_only: bool = True,
    ) -> Report:
        if not self.accepts(worker_id, step, assigned_only=assigned_only):
            return Report.STALE
        n = self.shares.get(worker_id, samples)
        self.reported[worker_id] = n
        self.losses[worker_id] = loss
        self.gradients.add(worker_id, n, tensors)
        self.report_at[worker_id] = now
        return Report.ACCEPTED

    def drop(self, worker_id: str) -> bool:
        """Stop expecting a worker that has not reported; True if it was expected."""
        if worker_id in self.shares and worker_id not in self.reported:
            del self.shares[worker_id]
            return True
        return False

    def missing(self) -> list[str]:
        return sorted(w for w in self.shares if w not in self.reported)

    def deserted(self) -> bool:
        """Everyone the round began with left before reporting: nothing more can arrive."""
        return bool(self.planned) and not self.shares and not self.reported

    def decide(self, now: float) -> RoundDecision:
        """``round_decision`` on what arrived; a deserted round is abandoned at once rather
        than at its deadline (up to INITIAL_DEADLINE_S for workers never measured)."""
        decision = round_decision(
            now=now,
            deadline=self.deadline,
            assigned=self.shares,
            reported=self.reported,
            quorum=self.quorum,
        )
        if decision is RoundDecision.WAIT and self.deserted():
            return RoundDecision.ABANDON
        return decision
