"""The round loop: one task that runs the rounds, one after another, under the round policy of
each step (``swarm.rounds``: synchronous or local steps).

It waits until training is on and enough workers are registered, plans the round, brings each
worker up to date and sends its assignment (``Downlink.send_staggered``), waits until the round
closes (``policy.round_decision``: all reported, or the deadline with quorum) or is abandoned,
then applies the optimizer step and moves the shadow (``Downlink.after_step``), tells the
workers (SYNC), and validates and checkpoints when due (``Records``). With ``--overlap`` the
next local-step round opens before this one's outer step. At the end (the last step, or
SHUTDOWN) it validates and checkpoints the last step, sends every worker the final UPDATE and
SHUTDOWN.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time

import numpy as np

from foundry.model.formats.tuning import TunedConfig
from foundry.model.train.training import Params
from foundry.obs.timeline import now_us
from foundry.swarm import policy
from foundry.swarm.core import Member, Round, SwarmCore, SwarmState
from foundry.swarm.downlink import Downlink
from foundry.swarm.records import Records
from foundry.swarm.rounds import LocalRounds, RoundPolicy, SyncRounds
from foundry.wire import fdtc

log = logging.getLogger("foundry.coordinator")

# Rounds abandoned in a row before status carries a note that training is stuck.
ROUNDS_BEFORE_STALL_NOTE = 2
# Shares are balanced so that reports arrive together: a round still waiting this many times the
# median report time is waiting on stragglers, and the log names them ...
LATE_FACTOR = 1.5
# ... once it has waited at least this long after the first report (less is scheduling jitter).
# That line is INFO: on a busy machine a wait of tens of milliseconds is ordinary ...
LATE_MIN_WAIT_S = 0.05
# ... and the round is told again at WARNING once it has waited this long after the first report.
LATE_WARNING_S = 1.0


class RoundRunner:
    def __init__(self, core: SwarmCore, downlink: Downlink, records: Records) -> None:
        self.core = core
        self.downlink = downlink
        self.records = records
        self.sync = SyncRounds(core)
        self.local = LocalRounds(core)
        self._ahead: Round | None = None  # the next round, opened before this one's step
        self._told_missing = 0
        self._abandoned_in_a_row = 0
        self.round_warning = ""  # rounds that keep being abandoned, while they are (status)

    def policy_at(self, step: int) -> RoundPolicy:
        """The policy of the round that starts at ``step``."""
        return self.local if self.core.opt.local_at(step) else self.sync

    def step_of(self, rnd: Round) -> int:
        """The step a round completes, the number its log lines carry: the same as the loss
        line it ends with (``step N: loss``), so "step N abandoned" is the round that was to
        make step N (``rnd.step`` is the step it starts from)."""
        local = self.core.opt.local_at(rnd.step)
        return rnd.step + (self.local.advance(rnd.step) if local else 1)

    def active_for_round(self) -> list[Member]:
        """Workers a round can expect a gradient from: ours, and seed-only peers sent START."""
        return [m for m in self.core.members.values() if m.extended or m.started]

    async def run(self) -> None:
        while not self.core.stopping.is_set():
            if self.core.state is not SwarmState.DONE and (
                self.core.finish_requested
                or (
                    self.core.state is SwarmState.TRAINING
                    and self.core.step >= self.core.opt.max_steps
                )
            ):
                await self.finish()
                continue
            if self.core.training_on():
                if (
                    isinstance(self.core.opt.cfg, TunedConfig)
                    and self.core.step == 0
                    and self.records.validation_step < 0
                ):
                    await self.records.validate()  # the base's held-out loss: the "before"
                await self.downlink.announce_start()
                if self.active_for_round():
                    await self.run_round()
                    continue
            # Nothing to do (paused, too few workers, or nobody who could report): no round
            # is opened until that changes, so no round waits on nobody.
            missing = self.core.missing_workers() if self.core.state is SwarmState.TRAINING else 0
            if missing and missing != self._told_missing:
                log.info(
                    "waiting for %d more worker(s): %d registered, --min-workers %d",
                    missing,
                    len(self.core.members),
                    self.core.opt.min_workers,
                )
            self._told_missing = missing
            self.core.wake.clear()
            await self.core.wake.wait()

    async def run_round(self) -> None:
        # With --overlap the round may already be open: its assignments went out before the
        # previous round's optimizer step (``_close_round``).
        rnd = self._ahead or await self.open_round(self.core.step, self.core.trainer.position)
        self._ahead = None
        decision = await self._await_decision(rnd)
        self._end_round(rnd, decision)
        if decision is policy.RoundDecision.CLOSE:
            await self._close_round(rnd)

    async def open_round(self, step: int, position: int) -> Round:
        """Plan the round that starts at ``step`` on samples from ``position``, make it the
        current round and send its assignments, each after what brings its worker up to
        ``core.step``. Opened ahead (``--overlap``), ``step`` is past ``core.step``: a worker
        that holds ``core.step`` gets only its assignment and starts from its own trained
        weights; the previous round's UPDATE follows once it is made."""
        c = self.core
        members = self.active_for_round()
        c.round_bytes = [0, 0]
        rounds = self.policy_at(step)
        plan = rounds.plan([m for m in members if m.extended], step)
        shares = plan.shares
        offsets = policy.contiguous_offsets(position, shares)
        # A seed-only peer trains its own shard at the size its REGISTER_ACK gave it; the round
        # expects that gradient too (on top of the global batch, weighted by its samples).
        expected = dict(shares)
        expected.update({m.worker_id: m.seed_share for m in members if not m.extended})
        now = time.monotonic()
        rnd = Round(
            step,
            expected,
            started=now,
            quorum=c.opt.quorum,
            deadline=policy.round_deadline(
                now,
                expected,
                {m.worker_id: m.rate for m in members},
                overheads={m.worker_id: m.overhead_s for m in members},
            ),
        )
        c.round = rnd
        ids = sorted(shares)
        sends: list[tuple[Member, fdtc.Assign | fdtc.LocalAssign]] = []
        for m in members:
            if not m.extended:
                m.busy = True
                continue
            if m.worker_id not in shares:
                continue
            m.busy = True
            sends.append((m, rounds.assignment(m, step, offsets[m.worker_id], plan, ids)))
        # The longest expected compute first (unmeasured ones before all): the sends go out
        # one at a time, and the round ends with its last report.
        sends.sort(
            key=lambda s: -(shares[s[0].worker_id] / s[0].rate) if s[0].rate > 0 else -math.inf
        )
        c.update_member_gauges()
        start_us = now_us()
        for res in await self.downlink.send_staggered(sends):
            if isinstance(res, BaseException):
                log.info("could not send an assignment: %s", res)
        c.timeline.span("assign", start_us, step=step, workers=len(sends))
        return rnd

    async def _await_decision(self, rnd: Round) -> policy.RoundDecision:
        """Wait until the round closes or is abandoned (reports, deaths, its deadline)."""
        told = logging.NOTSET  # the level the wait was last logged at
        while True:
            decision = rnd.decide(time.monotonic())
            paused = self.core.state is SwarmState.PAUSED
            if decision is policy.RoundDecision.ABANDON and rnd.deserted():
                # Every worker of the round left (or, seed-only, was paused) before reporting:
                # nothing more can arrive for it, and workers that joined since wait idle until
                # the next round; it runs again now rather than at the deadline.
                log.info(
                    "step %d: %s before reporting; it runs again%s",
                    self.step_of(rnd),
                    "paused" if paused else "every assigned worker left",
                    " after RESUME" if paused else "",
                )
            if decision is not policy.RoundDecision.WAIT or self.core.stopping.is_set():
                break
            wake = rnd.deadline
            stages = late_stages(rnd.started, list(rnd.report_at.values()))
            due = [level for level, at in stages if time.monotonic() >= at]
            if due and max(due) > told:
                told = max(due)
                self._warn_late(rnd, told)
            wake = min([wake, *(at for level, at in stages if level > told)])
            rnd.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rnd.changed.wait(), max(0.0, wake - time.monotonic()))
        return decision

    def _end_round(self, rnd: Round, decision: policy.RoundDecision) -> None:
        self.core.round = None
        if rnd.first_report_at is not None:
            self.core.timeline.span(
                "wait",
                rnd.wall_us(rnd.first_report_at),
                step=rnd.step,
                last=max(rnd.report_at, key=rnd.report_at.__getitem__),
                missing=rnd.missing(),
            )
        for m in self.core.members.values():
            m.busy = False
        late = rnd.missing()
        if decision is policy.RoundDecision.CLOSE:
            if late:
                log.warning(
                    "step %d closed at its deadline without %s",
                    self.step_of(rnd),
                    ", ".join(late),
                )
            self.core.metrics.rounds.labels(outcome="closed").inc()
        elif self.core.stopping.is_set():
            log.info("step %d left open: the coordinator is stopping", self.step_of(rnd))
        else:
            self.core.metrics.rounds.labels(outcome="abandoned").inc()
            if rnd.shares or rnd.reported:
                log.warning(
                    "step %d abandoned: %d of %d samples reported by the deadline; re-running",
                    self.step_of(rnd),
                    sum(rnd.reported.values()),
                    sum(rnd.shares.values()),
                )
                self._abandoned_in_a_row += 1
                if self._abandoned_in_a_row >= ROUNDS_BEFORE_STALL_NOTE:
                    # Status says so: TRAINING with no progress is not the whole truth.
                    self.round_warning = (
                        f"step {self.step_of(rnd)} abandoned {self._abandoned_in_a_row} times in "
                        "a row "
                        f"(last: {sum(rnd.reported.values())} of {sum(rnd.shares.values())} "
                        f"samples reported by the deadline; see the coordinator's log)"
                    )
        if decision is policy.RoundDecision.CLOSE:
            self._abandoned_in_a_row = 0
            self.round_warning = ""
        self.core.timeline.span(
            "round",
            rnd.started_us,
            step=rnd.step,
            outcome=decision.name.lower(),
            workers=len(rnd.reported),
        )

    def _warn_late(self, rnd: Round, level: int) -> None:
        assert rnd.first_report_at is not None
        median = statistics.median(t - rnd.started for t in rnd.report_at.values())
        log.log(
            level,
            "step %d is waiting for %s: %.2fs after the first report; the median report "
            "came %.2fs into the round",
            self.step_of(rnd),
            ", ".join(rnd.missing()),
            time.monotonic() - rnd.first_report_at,
            median,
        )

    def _overlaps(self, rnd: Round) -> bool:
        """Whether the round after ``rnd`` opens before ``rnd``'s optimizer step (--overlap)."""
        nxt = rnd.step + self.local.advance(rnd.step)
        o = self.core.opt
        return (
            o.overlap
            and o.local_at(rnd.step)
            and o.local_at(nxt)
            and nxt < o.max_steps
            and self.core.training_on()
            and not self.core.stopping.is_set()
            and not self.core.finish_requested
        )

    async def _close_round(self, rnd: Round) -> None:
        t0 = time.monotonic()
        round_bytes = list(self.core.round_bytes)
        if rnd.first_report_at is not None:
            self.core.metrics.straggler_wait.observe(t0 - rnd.first_report_at)
        if self._overlaps(rnd):
            # The next round's assignments go out now: each worker trains on from its own
            # weights while this round's mean, outer step and UPDATE are computed and sent.
            self._ahead = await self.open_round(
                rnd.step + self.local.advance(rnd.step),
                self.core.trainer.position + sum(rnd.planned.values()),
            )
        mean = rnd.gradients.mean()
        grads: Params = {
            name: t.reshape(shape) for (name, shape), t in zip(self.core.shapes, mean, strict=True)
        }
        n_samples = sum(rnd.reported.values())
        losses = [(rnd.reported[w], loss) for w, loss in rnd.losses.items() if np.isfinite(loss)]
        lr = self.core.trainer.learning_rate()
        before = self.core.step
        # The reports go into a step now (an abandoned round's never do). Counted before the
        # optimizer thread moves the global step, in this turn of the loop: status shows a
        # worker's steps at most this round ahead of the global step while it is applied,
        # never behind it (counted after, a status read during the apply saw them behind).
        for worker_id, steps in rnd.steps.items():
            if worker_id in rnd.reported and (member := self.core.members.get(worker_id)):
                member.steps_done += steps
        self.core.applied.clear()
        try:
            await asyncio.to_thread(self._apply, grads, rnd)
        finally:
            self.core.applied.set()
        await self.downlink.answer_weights_wanted()
        if self._ahead is not None:
            # This round's UPDATE to every worker of the round already running.
            ahead = [m for m in self.core.members.values() if m.worker_id in self._ahead.planned]
            results = await asyncio.gather(
                *(self.downlink.bring_up_to_date(m) for m in ahead), return_exceptions=True
            )
            for res in results:
                if isinstance(res, BaseException):
                    log.info("could not send an update: %s", res)
        self.core.samples_total += n_samples
        if losses:
            self.core.train_loss = sum(n * loss for n, loss in losses) / sum(n for n, _ in losses)
            self.core.metrics.train_loss.set(self.core.train_loss)
        elapsed = time.monotonic() - rnd.started
        self.core.last_rate = n_samples / elapsed if elapsed > 0 else 0.0
        self.core.metrics.samples.inc(n_samples)
        self.core.metrics.global_step.set(self.core.step)
        self.core.stepped_at = time.monotonic()
        self.core.metrics.learning_rate.set(lr)
        self.core.metrics.apply_duration.observe(time.monotonic() - t0)
        self.core.metrics.round_duration.observe(time.monotonic() - rnd.started)
        self.core.timeline.span("apply", rnd.wall_us(t0), step=rnd.step, samples=n_samples)
        # SYNC: the step advanced. A seed-only peer pulls the new weights (WEIGHTS_REQ) before
        # its next gradient; ours get theirs with their next ASSIGN.
        await self.downlink.broadcast(fdtc.Sync())
        log.info(
            "step %d: loss %.4f, %d samples from %d workers in %.2fs (%.1f samples/s)",
            self.core.step,
            self.core.train_loss,
            n_samples,
            len(rnd.reported),
            elapsed,
            self.core.last_rate,
        )
        self.core.metrics.step_bytes.labels(direction="up").set(round_bytes[0])
        self.core.metrics.step_bytes.labels(direction="down").set(round_bytes[1])
        v, c = self.core.opt.validate_every, self.core.opt.checkpoint_every
        if self.core.step // v > before // v or self.core.step >= self.core.opt.max_steps:
            await self.records.validate()
        if self.core.step // c > before // c or self.records.checkpoint_failed:
            await self.records.checkpoint_or_warn()

    def _apply(self, grads: Params, rnd: Round) -> None:
        """The optimizer step on the master (AdamW on the mean gradient, or the outer Nesterov
        step on the mean pseudo-gradient), then the UPDATE that moves the shadow after it."""
        base = self.core.step
        start_us = now_us()
        self.policy_at(base).apply(grads, rnd)
        encode_us = now_us()
        self.core.timeline.span("optimizer", start_us, encode_us, step=rnd.step)
        self.downlink.after_step(base)
        self.core.timeline.span("encode", encode_us, step=rnd.step)

    async def finish(self) -> None:
        """The end of training, from the round loop only (so no step is applied meanwhile):
        validate and checkpoint the last step, DONE, every worker's final UPDATE, SHUTDOWN."""
        if self.core.state is SwarmState.DONE:
            log.info(
                "training done at step %d (resumed at its last checkpoint); nothing left to train",
                self.core.step,
            )
            self.core.done.set()
            return
        if self.records.validation_step != self.core.step:
            await self.records.validate()
        await self.records.validated()
        if self.core.checkpoint_step != self.core.step:
            await self.records.checkpoint_or_warn()
        self.core.set_state(SwarmState.DONE)
        log.info("training done at step %d; telling the workers", self.core.step)
        # The last step's UPDATE first, so every worker ends holding the final weights.
        for m in list(self.core.members.values()):
            if m.extended and m.weights_step >= 0:
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    await self.downlink.bring_up_to_date(m)
        await self.downlink.broadcast(fdtc.Shutdown())
        self.core.done.set()


def late_after(started: float, report_times: list[float]) -> float | None:
    """When a round that started at ``started`` is waiting on stragglers; None before a report.

    ``LATE_FACTOR`` times the median report time so far, and no sooner than ``LATE_MIN_WAIT_S``
    after the first report.
    """
    if not report_times:
        return None
    median = statistics.median(t - started for t in report_times)
    return max(started + LATE_FACTOR * median, min(report_times) + LATE_MIN_WAIT_S)


def late_stages(started: float, report_times: list[float]) -> list[tuple[int, float]]:
    """(log level, when) at which a waiting round names its stragglers: INFO at ``late_after``,
    WARNING once it has waited ``LATE_WARNING_S`` after the first report; none before a report."""
    late_at = late_after(started, report_times)
    if late_at is None:
        return []
    return [
        (logging.INFO, late_at),
        (logging.WARNING, max(late_at, min(report_times) + LATE_WARNING_S)),
    ]
