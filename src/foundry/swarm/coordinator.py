"""The coordinator: parameter server of the swarm.

It owns the weights, the optimizer state, membership, rounds and checkpoints, and listens on
two FDTC ports: workers on ``listen``, the gateway (or ``foundry ctl``) on ``admin_listen``.
This module wires its jobs together, each in its own module around the shared state
(``swarm.core.SwarmCore``): the worker port (``swarm.worker_port``), the admin port
(``swarm.admin_port``), the round loop (``swarm.round_loop``) with its two round policies
(``swarm.rounds``: synchronous and local steps), the downlink (``swarm.downlink``: the shadow,
UPDATEs, digests, staggered assignments, broadcasts) and the records (``swarm.records``:
resume, checkpoints, validation, export).

Theory of operation
-------------------
Each worker connection is one asyncio task that reads messages (through the link's
``FdtcConnection``, which admits only what the worker link's table allows: a message out of
order is answered with the connection's ERROR and the link closed) and updates the shared state;
a single round task runs the rounds (``RoundRunner.run``): it waits until training is on and
enough workers are registered, splits the global batch among them by measured throughput
(``policy.allocate_samples``), brings each one's weights up to date (one UPDATE, or full
weights to a worker that lacks the last step's: ``swarm.sync``), sends its ASSIGN, then waits
until the round closes (``policy.round_decision``): all reported, or the deadline with quorum.
Gradients are summed, weighted by samples, as they arrive (``policy.GradientSum``); at the
close the coordinator applies AdamW to their mean, moves its copy of the workers' weights (the
shadow) by the compressed update, and moves on.

With ``--sync-every H > 1`` (local steps) a round is H inner steps of the fastest worker:
each worker gets an equal share of the global batch per inner step and the inner steps its
measured speed allows in that time (``sync.plan_local_round``), sent as LOCAL_ASSIGN; the
reports are pseudo-gradients, averaged weighted by samples, to which the coordinator applies
the outer Nesterov step (``sync.OuterNesterov``); the global step advances by H. Workers that
speak only the seed protocol are refused in this mode (it has no message for local steps).

A dropped worker (EOF, missed heartbeats, bad bytes) is removed from the round it was in, so
nothing waits on the dead. Bad input from one peer closes that peer only.

Every control message of the seed reaches every worker, seed-only peers included: START once
training is on and the worker holds weights, SYNC after each step, CHECKPOINT after each
checkpoint, PAUSE / RESUME from the admin link, SHUTDOWN at the end. A seed-only peer that was
sent START is expected in each round with the samples its REGISTER_ACK gave it, and is judged
live against its own heartbeat cadence (``policy.liveness_timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from foundry.model.text.data import Corpus
from foundry.obs.timeline import Timeline
from foundry.swarm import sync
from foundry.swarm.admin_port import SHUTDOWN_WAIT_S, AdminPort
from foundry.swarm.core import (
    HEARTBEAT_TIMEOUT_S,
    MAX_ADMIN_CONNECTIONS,
    MAX_WORKER_CONNECTIONS,
    SEED_HEARTBEAT_TIMEOUT_S,
    VALIDATE_EVERY,
    CoordinatorOptions,
    Member,
    Round,
    SwarmCore,
    SwarmState,
    clip,
)
from foundry.swarm.downlink import Downlink
from foundry.swarm.records import ExportRefused, Records, load_or_init
from foundry.swarm.round_loop import (
    LATE_FACTOR,
    LATE_MIN_WAIT_S,
    ROUNDS_BEFORE_STALL_NOTE,
    RoundRunner,
    late_after,
)
from foundry.swarm.worker_port import REGISTER_TIMEOUT_S, WorkerPort
from foundry.transport.listener import Listener
from foundry.transport.tasks import cancel_and_wait
from foundry.wire import fdtc

__all__ = [
    "HEARTBEAT_TIMEOUT_S",
    "LATE_FACTOR",
    "LATE_MIN_WAIT_S",
    "MAX_ADMIN_CONNECTIONS",
    "MAX_WORKER_CONNECTIONS",
    "REGISTER_TIMEOUT_S",
    "ROUNDS_BEFORE_STALL_NOTE",
    "SEED_HEARTBEAT_TIMEOUT_S",
    "SHUTDOWN_WAIT_S",
    "VALIDATE_EVERY",
    "Coordinator",
    "CoordinatorOptions",
    "ExportRefused",
    "Member",
    "Round",
    "SwarmState",
    "clip",
    "late_after",
]

log = logging.getLogger("foundry.coordinator")

# On a stop, the step being applied is given this long to finish before the final checkpoint.
STOP_ROUND_S = 30.0
# After an internal failure the open admin links answer with it this long before the process
# exits: `foundry up`, the gateway and `foundry ctl watch` learn why, not only that it went.
# Longer than one whole round of the gateway's health probes (a probe of up to 1 s, then 1 s
# asleep: gateway.health), so the gateway always asks at least once while it is told.
FAILED_LINGER_S = 3.0


class Coordinator(SwarmCore):
    def __init__(
        self, options: CoordinatorOptions, corpus: Corpus, timeline: Timeline | None = None
    ) -> None:
        start = load_or_init(options)
        outer = sync.OuterNesterov(start.trainer.params, options.outer_lr, options.outer_momentum)
        if "outer_m" in start.tensors:
            outer.load(start.tensors["outer_m"])
        super().__init__(options, corpus, timeline, start.trainer, outer, start.outer_steps)
        # The master's copy of what every worker holds.
        self.downlink = Downlink(self, start.tensors.get("shadow", start.trainer.params))
        self.downlink.resume_random_state(start.downlink_rng)
        self.records = Records(self, self.downlink)
        self.runner = RoundRunner(self, self.downlink, self.records)
        self.workers = WorkerPort(self, self.downlink)
        self.admin = AdminPort(self, self.downlink, self.records, self.runner)
        self._servers: list[asyncio.base_events.Server] = []
        self.bound_port = 0
        self.bound_admin_port = 0

    # ------------------------------------------------------------------ serving

    async def start(self) -> None:
        """Bind both listeners; ``bound_port`` / ``bound_admin_port`` give the real ports."""
        o = self.opt
        workers = Listener(
            "worker link", self.workers.serve, log=log, tls=o.tls, max_connections=o.max_connections
        )
        admin = Listener(
            "admin link",
            self.admin.serve,
            log=log,
            tls=o.tls,
            max_connections=o.admin_max_connections,
            limit_flag="--admin-max-connections",
        )
        worker_srv = await workers.start(o.host, o.port)
        admin_srv = await admin.start(o.admin_host, o.admin_port)
        self._servers = [worker_srv, admin_srv]
        self.bound_port = worker_srv.sockets[0].getsockname()[1]
        self.bound_admin_port = admin_srv.sockets[0].getsockname()[1]
        self.metrics.global_step.set(self.step)
        if self.step >= self.opt.max_steps:
            self.state = SwarmState.DONE
        elif self.opt.autostart:
            self.state = SwarmState.TRAINING
        self.round_task = self.spawn(self.runner.run(), "round loop")
        self.spawn(self.workers.reaper(), "reaper")

    async def wait_stopped(self) -> None:
        await self.stopping.wait()

    async def close(self) -> None:
        """Stop serving; first let the round loop finish the step it is applying (the open
        round is given up), then write a checkpoint of the last completed step if none is on
        disk: a stop (SIGTERM, SIGINT, SHUTDOWN) never loses a step."""
        for srv in self._servers:
            srv.close()
        if self.failure is not None and self.admin.streams:
            await asyncio.sleep(FAILED_LINGER_S)  # they answer every request with the failure
        if self.round_task is not None and self.failure is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self.round_task), STOP_ROUND_S)
            if self.checkpoint_step != self.step:
                log.info("stopping at step %d: writing a final checkpoint", self.step)
                await self.records.checkpoint_or_warn()
        for m in list(self.members.values()):
            await m.stream.close()
        for admin in list(self.admin.streams):
            await admin.close()
        for task in list(self.tasks):
            await cancel_and_wait(task)
        for srv in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 2.0)

    # ------------------------------------------------------------------ the parts, from outside

    @property
    def _applied(self) -> asyncio.Event:
        return self.applied

    @property
    def shadow(self) -> sync.Shadow:
        """What every worker holds (the downlink's)."""
        return self.downlink.shadow

    async def _answer_weights_wanted(self) -> None:
        await self.downlink.answer_weights_wanted()

    async def checkpoint(self) -> Path:
        return await self.records.checkpoint()

    def export_target(self, path: Path | None) -> Path:
        return self.records.export_target(path)

    async def export(self, path: Path | None) -> Path:
        return await self.records.export(path)

    def swarm_status(self) -> fdtc.SwarmStatus:
        return self.admin.swarm_status()

    def swarm_detail(self) -> fdtc.SwarmDetail:
        return self.admin.swarm_detail()
