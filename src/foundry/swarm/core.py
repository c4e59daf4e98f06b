"""What every part of the coordinator shares: its options, the members, the round, the master
state and the events that pace them (``SwarmCore``), each part in its own module around it
(``swarm.coordinator`` names them)."""

from __future__ import annotations

import asyncio
import enum
import logging
import ssl
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from foundry.compression import largest_message
from foundry.compression.qsgd import DEFAULT_QSGD_LEVELS
from foundry.model.formats.checkpoint_dir import DEFAULT_KEEP_LAST
from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import Corpus
from foundry.model.train.backend import NUMPY, Backend
from foundry.model.train.training import Trainer, TrainSettings
from foundry.obs.metrics import SwarmMetrics
from foundry.obs.timeline import Timeline, now_us
from foundry.swarm import policy, sync
from foundry.transport.fdtc_stream import DEFAULT_FRAME_DEADLINE_S, FdtcStream
from foundry.wire import fdtc
from foundry.wire.fdtc import Compression
from foundry.wire.framing import ReceiveBudget

log = logging.getLogger("foundry.coordinator")

# Our workers heartbeat every 0.5 s; one silent this long is dropped (within 3 s:
# docs/decisions.md, D4).
HEARTBEAT_TIMEOUT_S = 2.5
# The seed fixes no heartbeat interval: a seed-only peer is judged by its own cadence once two
# heartbeats showed it (policy.liveness_timeout), and may stay silent this long before that.
SEED_HEARTBEAT_TIMEOUT_S = 30.0
# Heartbeat intervals remembered per seed-only peer to judge its cadence.
HEARTBEAT_HISTORY = 8
# Open connections per listener by default: a swarm of a few hundred machines on the worker
# link; the gateway's pool (4) and a few `foundry ctl`-like tools on the admin link.
MAX_WORKER_CONNECTIONS = 256
MAX_ADMIN_CONNECTIONS = 16
# The least receive budget of the worker links (SwarmCore.receive_budget), for small models.
RECEIVE_BUDGET_FLOOR = 1 << 30
# Validation loss every this many steps by default (forward passes over at most
# data.VAL_MAX_TOKENS held-out tokens: for the tiny preset about as much as 5 rounds of batch
# 16 x 64).
VALIDATE_EVERY = 25


class SwarmState(enum.IntEnum):
    WAITING = 0
    TRAINING = 1
    PAUSED = 2
    DONE = 3


@dataclass(frozen=True)
class CoordinatorOptions:
    host: str
    port: int
    admin_host: str
    admin_port: int
    checkpoint_dir: Path
    cfg: ModelConfig
    settings: TrainSettings
    compression: Compression = Compression.NONE
    topk_ratio: float = 0.01
    max_steps: int = 1000
    checkpoint_every: int = 50
    keep_checkpoints: int = DEFAULT_KEEP_LAST
    validate_every: int = VALIDATE_EVERY
    min_workers: int = 1
    autostart: bool = True
    quorum: float = policy.DEFAULT_QUORUM
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    seed_heartbeat_timeout_s: float = SEED_HEARTBEAT_TIMEOUT_S
    init_gguf: Path | None = None
    seed: int = 0
    rebalance: bool = True
    export_path: Path | None = None
    # EXPORT writes only inside this folder (None: the folder that holds checkpoint_dir),
    # unless export_anywhere; and never over a file that is not a GGUF.
    export_dir: Path | None = None
    export_anywhere: bool = False
    # Security and limits of both listeners (docs/guide/tls.md, TLS and limits).
    tls: ssl.SSLContext | None = None
    max_connections: int = MAX_WORKER_CONNECTIONS
    admin_max_connections: int = MAX_ADMIN_CONNECTIONS
    frame_deadline_s: float = DEFAULT_FRAME_DEADLINE_S
    # WEIGHTS and UPDATE over this many bytes go to workers as FRAGMENT frames of this size.
    fragment_size: int = fdtc.FRAGMENT_SIZE
    # Local steps (DiLoCo): inner steps per round; 1 is synchronous training.
    sync_every: int = 1
    # Codec of the weight updates sent to workers; None: the same as ``compression``.
    down_compression: Compression | None = None
    outer_lr: float = sync.DEFAULT_OUTER_LR
    outer_momentum: float = sync.DEFAULT_OUTER_MOMENTUM
    digest_every: int = sync.DEFAULT_DIGEST_EVERY
    # With sync_every > 1: steps trained synchronously before local steps begin (a warm start
    # for the outer optimizer, as DiLoCo starts from a trained model).
    sync_warmup: int = 0
    # With sync_every > 1: open each round before the previous one's outer step, so workers
    # train on while it is computed and sent (one outer step of delay).
    overlap: bool = False
    # QSGD's levels s both ways (127: 8-bit codes; 7: 4-bit), told to workers in TRAIN_PLAN.
    qsgd_levels: int = DEFAULT_QSGD_LEVELS
    # QSGD's levels of the UPDATEs when they differ from the uploads' (None: qsgd_levels).
    down_qsgd_levels: int | None = None
    # Where validation computes (``--validate-device``); the optimizer stays in numpy.
    validation_backend: Backend = NUMPY
    # Fine-tuning a published model (``cfg`` a ``tuning.TunedConfig``): the trainable tensors
    # at step 0 (fresh adapters, or the base's own) and the base file, which exports read.
    start_params: dict[str, np.ndarray] | None = None
    base_model: Path | None = None

    def local_at(self, step: int) -> bool:
        """Whether the round that starts at ``step`` runs local steps."""
        return self.sync_every > 1 and step >= self.sync_warmup

    @property
    def downlink(self) -> Compression:
        return self.compression if self.down_compression is None else self.down_compression


@dataclass
class Member:
    """One registered worker connection."""

    worker_id: str
    stream: FdtcStream
    profile: fdtc.HardwareProfile
    cores: int
    memory_mb: int
    micro_batch: int
    accumulation_steps: int
    extended: bool  # announced itself with DATASET: speaks our extensions
    joined_at: float
    last_seen: float
    rate: float = 0.0  # samples/s, EMA of what the worker measured
    heard_rate: float = 0.0  # the last rate a heartbeat carried (each repeats it until the next)
    # Seconds of a round beyond its compute (EMA): the assignment's wait and transfer, the
    # UPDATE's decoding, the upload; the report's time into the round less samples / rate.
    overhead_s: float = 0.0
    loss: float = float("nan")
    local_step: int = 0
    weights_step: int = -1  # global step of the weights it holds
    busy: bool = False  # has an assignment in the current round
    started: bool = False  # was sent START: it knows training is on
    last_heartbeat: float | None = None
    heartbeat_intervals: deque[float] = field(
        default_factory=lambda: deque(maxlen=HEARTBEAT_HISTORY)
    )
    bytes_up: int = 0  # gradient bytes received from it
    bytes_down: int = 0  # weight and update bytes sent to it
    inner_steps: int = 0  # inner steps assigned to it in local-step rounds
    assigned_steps: int = 1  # training steps of the assignment it holds
    steps_done: int = 0  # training steps of its reports that rounds took (status)
    ack_pending: bool = False  # a HEARTBEAT_ACK is waiting to be sent
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Sends under way: a worker taking our bytes is alive even while its own heartbeats wait
    # unread behind them (its read loop may be the one sending); the frame deadline bounds it.
    sending: int = 0

    @property
    def seed_share(self) -> int:
        """What a seed-only peer trains per round: REGISTER_ACK's batch x accumulation."""
        return self.micro_batch * self.accumulation_steps

    def heard_heartbeat(self, now: float) -> None:
        if self.last_heartbeat is not None:
            self.heartbeat_intervals.append(now - self.last_heartbeat)
        self.last_heartbeat = now


class Round(policy.RoundTracker):
    """The round's rules (``policy.RoundTracker``) and what the service adds: an event set on
    every change, the wall clock of its start for the timeline, and the training steps each
    report carries (counted to its worker when the round's step is applied)."""

    def __init__(
        self, step: int, shares: dict[str, int], *, started: float, deadline: float, quorum: float
    ) -> None:
        super().__init__(step, shares, started=started, deadline=deadline, quorum=quorum)
        self.changed = asyncio.Event()
        self.started_us = now_us()
        self.steps: dict[str, int] = {}

    def wall_us(self, t: float) -> int:
        """The wall-clock microseconds of monotonic time ``t`` (timeline timestamps)."""
        return self.started_us + round((t - self.started) * 1e6)


class SwarmCore:
    """The coordinator's shared state. The parts (worker port, admin port, downlink, rounds,
    records) each hold this object and change it only on the asyncio loop."""

    def __init__(
        self,
        options: CoordinatorOptions,
        corpus: Corpus,
        timeline: Timeline | None,
        trainer: Trainer,
        outer: sync.OuterNesterov,
        outer_steps: int,
    ) -> None:
        self.opt = options
        self.corpus = corpus
        self.metrics = SwarmMetrics()
        self.timeline = timeline or Timeline(None, "coordinator")
        self.members: dict[str, Member] = {}
        self.state = SwarmState.WAITING
        self.round: Round | None = None
        self.trainer = trainer
        # The outer optimizer of local-step rounds (sync.OuterNesterov) and its steps so far.
        self.outer = outer
        self.outer_steps = outer_steps
        self.train_loss = float("nan")
        self.val_loss = float("nan")
        # The first held-out loss this process measured and its step (fine-tuning: the base's).
        self.first_val_loss = float("nan")
        self.first_val_step = 0
        self.samples_total = 0
        self.last_rate = 0.0
        self.wake = asyncio.Event()
        self.stopping = asyncio.Event()
        # Clear while the round's optimizer step runs in a thread: what copies the master
        # state (checkpoints, exports, validation) waits for it, so no copy is torn.
        self.applied = asyncio.Event()
        self.applied.set()
        # SHUTDOWN from the admin link: the round loop finishes after the round under way.
        self.finish_requested = False
        self.done = asyncio.Event()
        self.round_task: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.failure: str | None = None  # why an internal task ended the process
        self.shapes = list(options.cfg.param_shapes().items())
        self.numels = [int(np.prod(s)) for _, s in self.shapes]
        # The largest message a worker link carries either way (WEIGHTS, or GRADIENTS and
        # UPDATE in any codec) for this model: what a peer's FRAGMENT frames may build, so a
        # peer cannot make the coordinator hold more than the model's largest message.
        self.message_limit = largest_message(self.numels)
        # What all worker links together may hold of frames and messages being received
        # (framing.ReceiveBudget): four of the largest messages, and at least 1 GiB.
        self.receive_budget = ReceiveBudget(max(RECEIVE_BUDGET_FLOOR, 4 * self.message_limit))
        self.round_bytes = [0, 0]  # up, down during the current round
        self.stepped_at = time.monotonic()  # when the global step last advanced (status)
        self.checkpoint_step = trainer.step  # a resumed run already has this one on disk

    @property
    def step(self) -> int:
        return self.trainer.step

    def set_state(self, state: SwarmState) -> None:
        if state != self.state:
            log.info("swarm %s -> %s at step %d", self.state.name, state.name, self.step)
        self.state = state
        self.wake.set()

    def update_member_gauges(self) -> None:
        counts = {"training": 0, "idle": 0}
        for m in self.members.values():
            counts["training" if m.busy else "idle"] += 1
        for k, v in counts.items():
            self.metrics.workers.labels(state=k).set(v)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        # No half-alive service: a task that cannot go on ends the process (non-zero, one
        # line), so a supervisor restarts it from the last checkpoint.
        log.debug("internal task failed", exc_info=exc)
        self.failure = f"{task.get_name()} failed: {type(exc).__name__}: {exc}"
        log.error("%s; stopping", self.failure)
        self.request_stop()

    def request_stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        if self.round is not None:
            self.round.changed.set()

    def training_on(self) -> bool:
        """Rounds run: training is on, enough workers are there, steps are left."""
        return (
            self.state is SwarmState.TRAINING
            and len(self.members) >= self.opt.min_workers
            and self.step < self.opt.max_steps
        )

    def reported_state(self) -> SwarmState:
        """The state as status tells it: TRAINING only while rounds can run; with fewer than
        --min-workers registered it is WAITING (``missing_workers`` says how many)."""
        if self.state is SwarmState.TRAINING and self.missing_workers() > 0:
            return SwarmState.WAITING
        return self.state

    def missing_workers(self) -> int:
        return max(0, self.opt.min_workers - len(self.members))


def clip(text: str, limit: int = fdtc.MAX_PATH - 1) -> str:
    """``text`` cut to fit a NUL-terminated char[256] field without splitting a character."""
    return text.encode("utf-8")[:limit].decode("utf-8", errors="ignore")
