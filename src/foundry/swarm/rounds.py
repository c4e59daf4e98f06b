"""The two round policies behind one interface (``RoundPolicy``): how a round's samples are
shared among the workers, what each one is assigned, and the optimizer step on the master when
the round closes.

- ``SyncRounds`` (``--sync-every 1``, and the ``--sync-warmup`` steps): the global batch split
  by measured throughput (``policy.allocate_samples``), ASSIGN, AdamW on the mean gradient; the
  global step advances by one.
- ``LocalRounds`` (``--sync-every H > 1``): H inner steps of the fastest worker, each worker an
  equal share of the global batch per inner step and the inner steps its speed allows in that
  time (``sync.plan_local_round``), LOCAL_ASSIGN, the outer Nesterov step on the mean
  pseudo-gradient (``sync.OuterNesterov``); the global step advances by ``min(H, left)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from foundry.model.train.training import Params
from foundry.swarm import policy, sync
from foundry.swarm.core import Member, Round, SwarmCore
from foundry.wire import fdtc


@dataclass(frozen=True)
class RoundPlan:
    """Samples of each worker of ours in the round; with local steps also the samples per
    inner step and the inner steps of each."""

    shares: dict[str, int]
    per_step: dict[str, int] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)


class RoundPolicy(Protocol):
    def plan(self, members: list[Member], step: int) -> RoundPlan:
        """The shares of the round that starts at ``step`` among ``members`` (ours only)."""
        ...

    def assignment(
        self, m: Member, step: int, offset: int, plan: RoundPlan, ids: list[str]
    ) -> fdtc.Assign | fdtc.LocalAssign:
        """What ``m`` is sent: its share of ``plan`` from sample ``offset``; ``ids``: the
        workers of the round, sorted (shards)."""
        ...

    def apply(self, grads: Params, rnd: Round) -> None:
        """The optimizer step on the master for the closed round ``rnd`` (in a thread)."""
        ...


class SyncRounds:
    def __init__(self, core: SwarmCore) -> None:
        self.core = core

    def plan(self, members: list[Member], step: int) -> RoundPlan:
        opt = self.core.opt
        rates = {m.worker_id: (m.rate if opt.rebalance else 1.0) for m in members}
        if opt.rebalance and any(r <= 0 for r in rates.values()):
            # Unmeasured workers: start from the profile's batch size as a relative speed.
            rates = {m.worker_id: float(m.rate or m.micro_batch) for m in members}
        shares = policy.allocate_samples(opt.settings.global_batch, rates)
        return RoundPlan({w: n for w, n in shares.items() if n > 0})

    def assignment(
        self, m: Member, step: int, offset: int, plan: RoundPlan, ids: list[str]
    ) -> fdtc.Assign:
        share = plan.shares[m.worker_id]
        return fdtc.Assign(
            global_step=step,
            sample_offset=offset,
            n_samples=share,
            batch_size=m.micro_batch,
            accumulation_steps=-(-share // m.micro_batch),
            assigned_shard=ids.index(m.worker_id),
            total_shards=len(ids),
            seq_len=self.core.opt.settings.seq_len,
        )

    def apply(self, grads: Params, rnd: Round) -> None:
        self.core.trainer.apply(grads)


class LocalRounds:
    def __init__(self, core: SwarmCore) -> None:
        self.core = core

    def advance(self, step: int) -> int:
        """Global steps a local-step round that starts at ``step`` advances: ``min(H, left)``."""
        return min(self.core.opt.sync_every, self.core.opt.max_steps - step)

    def plan(self, members: list[Member], step: int) -> RoundPlan:
        """Samples per inner step and inner steps of each worker, for a local-step round that
        starts at ``step`` (the global step advances by ``advance(step)``)."""
        opt = self.core.opt
        h = self.advance(step)
        rates = {m.worker_id: (m.rate if opt.rebalance else 1.0) for m in members}
        per_step = policy.local_batches(opt.settings.global_batch, rates)
        per_step = {w: n for w, n in per_step.items() if n > 0}
        slow = policy.slow_workers(rates)
        steps = sync.plan_local_round(per_step, rates, h, slow)
        overheads = {m.worker_id: m.overhead_s for m in members}
        per_step = sync.fill_local_round(per_step, rates, steps, h, slow, overheads)
        return RoundPlan({w: per_step[w] * steps[w] for w in per_step}, per_step, steps)

    def assignment(
        self, m: Member, step: int, offset: int, plan: RoundPlan, ids: list[str]
    ) -> fdtc.LocalAssign:
        steps = plan.steps[m.worker_id]
        m.inner_steps += steps
        self.core.metrics.inner_steps.observe(steps)
        return fdtc.LocalAssign(
            global_step=step,
            sample_offset=offset,
            samples_per_step=plan.per_step[m.worker_id],
            inner_steps=steps,
            micro_batch=m.micro_batch,
            seq_len=self.core.opt.settings.seq_len,
        )

    def apply(self, grads: Params, rnd: Round) -> None:
        c = self.core
        base = c.step
        c.outer.step(c.trainer.params, grads)
        c.outer_steps += 1
        c.metrics.outer_step.set(c.outer_steps)
        c.trainer.step += self.advance(base)  # as planned
        c.trainer.position += sum(rnd.planned.values())
