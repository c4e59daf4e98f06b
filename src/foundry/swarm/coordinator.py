"""The coordinator: parameter server of the swarm.

It owns the weights, the optimizer state, membership, rounds and checkpoints, and listens on
two FDTC ports: workers on ``listen``, the gateway (or ``foundry ctl``) on ``admin_listen``.

Theory of operation
-------------------
Each worker connection is one asyncio task that reads messages (through the link's
``FdtcConnection``, which admits only what the worker link's table allows: a message out of
order is answered with the connection's ERROR and the link closed) and updates the shared state;
a single round task runs the rounds (``_round_loop``): it waits until training is on and
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
import enum
import logging
import ssl
import statistics
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from foundry.compression import Codec, deserialize_tensors, get_codec
from foundry.compression.qsgd import DEFAULT_QSGD_LEVELS
from foundry.model.checkpoint import (
    DEFAULT_KEEP_LAST,
    CheckpointError,
    CheckpointState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from foundry.model.config import ModelConfig
from foundry.model.data import Corpus, compressor_bits_per_byte
from foundry.model.gguf_io import GGUF_MAGIC_BYTES, GGUFError, load_gguf, save_gguf
from foundry.model.training import (
    Params,
    Trainer,
    TrainSettings,
    against_compressors,
    bits_per_byte,
    evaluate_loss,
)
from foundry.model.transformer import init_params
from foundry.obs.metrics import SwarmMetrics
from foundry.obs.timeline import Timeline, now_us
from foundry.swarm import policy, sync
from foundry.swarm.model_config import model_config_msg
from foundry.transport.fdtc_stream import (
    DEFAULT_FRAME_DEADLINE_S,
    FdtcStream,
    FrameTimeout,
    StreamClosed,
)
from foundry.transport.listener import Listener
from foundry.transport.tasks import cancel_and_wait
from foundry.wire import fdtc
from foundry.wire.errors import ProtocolError
from foundry.wire.fdtc import Compression, ErrorCode
from foundry.wire.fdtc_lifecycle import Link, Role

log = logging.getLogger("foundry.coordinator")

# Rounds abandoned in a row before status carries a note that training is stuck.
ROUNDS_BEFORE_STALL_NOTE = 2

# Our workers heartbeat every 0.5 s; one silent this long is dropped (DESIGN: within 3 s).
HEARTBEAT_TIMEOUT_S = 2.5
# The seed fixes no heartbeat interval: a seed-only peer is judged by its own cadence once two
# heartbeats showed it (policy.liveness_timeout), and may stay silent this long before that.
SEED_HEARTBEAT_TIMEOUT_S = 30.0
# Heartbeat intervals remembered per seed-only peer to judge its cadence.
HEARTBEAT_HISTORY = 8
# How often the reaper looks for silent workers.
REAPER_INTERVAL_S = 0.25
# A connection must say who it is (REGISTER or DATASET) within this time.
REGISTER_TIMEOUT_S = 10.0
# Open connections per listener by default: a swarm of a few hundred machines on the worker
# link; the gateway's pool (4) and a few `foundry ctl`-like tools on the admin link.
MAX_WORKER_CONNECTIONS = 256
MAX_ADMIN_CONNECTIONS = 16
# On a stop, the step being applied is given this long to finish before the final checkpoint.
STOP_ROUND_S = 30.0
# How long SHUTDOWN waits for the round under way to end before it stops without it.
SHUTDOWN_WAIT_S = 30.0
# After an internal failure the open admin links answer with it this long before the process
# exits: `foundry up`, the gateway and `foundry ctl watch` learn why, not only that it went.
FAILED_LINGER_S = 1.5
# Validation loss every this many steps by default (forward passes over at most
# data.VAL_MAX_TOKENS held-out tokens: for the tiny preset about as much as 5 rounds of batch
# 16 x 64).
VALIDATE_EVERY = 25
# Shares are balanced so that reports arrive together: a round still waiting this many times the
# median report time is waiting on stragglers, and the log names them ...
LATE_FACTOR = 1.5
# ... once it has waited at least this long after the first report (less is scheduling jitter).
LATE_MIN_WAIT_S = 0.05
# Assignments go out one worker at a time (``_send_staggered``): the next begins once fewer
# than STAGGER_BELOW bytes of the last are unsent, or after its bytes' time at the best rate
# the port has shown x STAGGER_SLACK (at least STAGGER_MIN_S; STAGGER_UNMEASURED_S before any
# rate is known). Sends above STAGGER_MEASURE_ABOVE bytes measure that rate, which decays by
# STAGGER_DECAY a send.
STAGGER_BELOW = 64 * 1024
STAGGER_SLACK = 1.5
STAGGER_MIN_S = 0.002
STAGGER_UNMEASURED_S = 0.25
STAGGER_POLL_S = 0.001
STAGGER_MEASURE_ABOVE = 256 * 1024
STAGGER_DECAY = 0.9


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
    # Security and limits of both listeners (docs/operations.md, "TLS" and "Limits").
    tls: ssl.SSLContext | None = None
    max_connections: int = MAX_WORKER_CONNECTIONS
    admin_max_connections: int = MAX_ADMIN_CONNECTIONS
    frame_deadline_s: float = DEFAULT_FRAME_DEADLINE_S
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

    def __init__(self, step: int, shares: dict[str, int], *, started: float, deadline: float,
                 quorum: float) -> None:
        super().__init__(step, shares, started=started, deadline=deadline, quorum=quorum)
        self.changed = asyncio.Event()
        self.started_us = now_us()
        self.steps: dict[str, int] = {}

    def wall_us(self, t: float) -> int:
        """The wall-clock microseconds of monotonic time ``t`` (timeline timestamps)."""
        return self.started_us + round((t - self.started) * 1e6)


class Coordinator:
    def __init__(
        self, options: CoordinatorOptions, corpus: Corpus, timeline: Timeline | None = None
    ) -> None:
        self.opt = options
        self.corpus = corpus
        self.metrics = SwarmMetrics()
        self.timeline = timeline or Timeline(None, "coordinator")
        self.members: dict[str, Member] = {}
        self.state = SwarmState.WAITING
        self.round: Round | None = None
        self.train_loss = float("nan")
        self.val_loss = float("nan")
        self.samples_total = 0
        self.last_rate = 0.0
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._admin_streams: set[FdtcStream] = set()
        self._round_task: asyncio.Task[None] | None = None
        self.failure: str | None = None  # why an internal task ended the process
        self.trainer = self._initial_trainer()
        self._shapes = list(self.opt.cfg.param_shapes().items())
        self._numels = [int(np.prod(s)) for _, s in self._shapes]
        self._weights_cache: tuple[int, fdtc.WeightsMeta, fdtc.Weights] | None = None
        self.bound_port = 0
        self.bound_admin_port = 0
        self._validation_step = -1  # the step of the last validation begun
        self._validation: asyncio.Task[None] | None = None  # the one under way
        self._checkpoint_failed = False
        self._checkpoint_warning = ""  # why checkpoints fail, while they do (status)
        self._abandoned_in_a_row = 0
        self._round_warning = ""  # rounds that keep being abandoned, while they are (status)
        self._stepped_at = time.monotonic()  # when the global step last advanced (status)
        self._told_missing = 0
        self._yardstick: dict[str, float] | None = None  # compressors on the held-out bytes
        self._checkpoint_step = self.step  # a resumed run already has this one on disk
        down_levels = (options.qsgd_levels if options.down_qsgd_levels is None
                       else options.down_qsgd_levels)
        self._down_codec: Codec = get_codec(options.downlink, topk_ratio=options.topk_ratio,
                                            qsgd_levels=down_levels, seed=options.seed)
        self._update: fdtc.Update | None = None  # the last step's UPDATE, for every worker
        self._digests: dict[int, bytes] = {}  # step -> digest of the shadow, recent ones
        self._round_bytes = [0, 0]  # up, down during the current round
        self._port_rate = 0.0  # bytes/s: the best a staggered send has shown lately

    # ------------------------------------------------------------------ state

    def _initial_trainer(self) -> Trainer:
        """The master weights and their optimizers, and the shadow of the workers' weights."""
        trainer = self._load_or_init()
        self.outer = sync.OuterNesterov(trainer.params, self.opt.outer_lr, self.opt.outer_momentum)
        self.shadow = sync.Shadow(self._resumed.get("shadow", trainer.params))
        if "outer_m" in self._resumed:
            self.outer.load(self._resumed["outer_m"])
        self.outer_steps = self._resumed_outer_steps
        # Clear while the round's optimizer step runs in a thread: what copies the master
        # state (checkpoints, exports, validation) waits for it, so no copy is torn.
        self._applied = asyncio.Event()
        self._applied.set()
        self._weights_wanted: set[str] = set()  # seed-only peers asking during a step
        # SHUTDOWN from the admin link: the round loop finishes after the round under way.
        self._finish_requested = False
        self._done = asyncio.Event()
        self._ahead: Round | None = None  # the next round, opened before this one's step
        return trainer

    def _load_or_init(self) -> Trainer:
        self._resumed: dict[str, dict[str, np.ndarray]] = {}
        self._resumed_outer_steps = 0
        ckpt = latest_checkpoint(self.opt.checkpoint_dir)
        if ckpt is not None:
            state = load_checkpoint(ckpt)
            if state.config != self.opt.cfg:
                raise SystemExit(
                    f"checkpoint {ckpt} holds a different model ({state.config}) than "
                    f"--preset asks for ({self.opt.cfg}); use another --checkpoint-dir"
                )
            mode = int(state.extra.get("sync_every", 1))
            if mode != self.opt.sync_every:
                raise SystemExit(
                    f"checkpoint {ckpt} was written with --sync-every {mode}, not "
                    f"{self.opt.sync_every}; resume with --sync-every {mode} or use another "
                    "--checkpoint-dir"
                )
            trainer = Trainer(self.opt.cfg, self.opt.settings, state.params)
            trainer.optimizer.load_state_dict(state.optimizer)
            trainer.step = state.step
            trainer.position = state.data_position
            self._resumed = state.tensors
            self._resumed_outer_steps = int(state.extra.get("outer_steps", 0))
            log.info("resumed from %s at step %d", ckpt, trainer.step)
            return trainer
        if self.opt.init_gguf is not None:
            loaded = load_gguf(self.opt.init_gguf)
            if loaded.cfg != self.opt.cfg:
                raise SystemExit(
                    f"{self.opt.init_gguf} holds {loaded.cfg}, not the --preset model "
                    f"{self.opt.cfg}; pass the matching --preset"
                )
            log.info("initialised weights from %s", self.opt.init_gguf)
            return Trainer(self.opt.cfg, self.opt.settings, loaded.params)
        return Trainer(self.opt.cfg, self.opt.settings, init_params(self.opt.cfg, self.opt.seed))

    @property
    def step(self) -> int:
        return self.trainer.step

    def _set_state(self, state: SwarmState) -> None:
        if state != self.state:
            log.info("swarm %s -> %s at step %d", self.state.name, state.name, self.step)
        self.state = state
        self._wake.set()

    def _update_member_gauges(self) -> None:
        counts = {"training": 0, "idle": 0}
        for m in self.members.values():
            counts["training" if m.busy else "idle"] += 1
        for k, v in counts.items():
            self.metrics.workers.labels(state=k).set(v)

    # ------------------------------------------------------------------ serving

    async def start(self) -> None:
        """Bind both listeners; ``bound_port`` / ``bound_admin_port`` give the real ports."""
        o = self.opt
        workers = Listener("worker link", self._serve_worker, log=log, tls=o.tls,
                           max_connections=o.max_connections)
        admin = Listener("admin link", self._serve_admin, log=log, tls=o.tls,
                         max_connections=o.admin_max_connections,
                         limit_flag="--admin-max-connections")
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
        self._round_task = self._spawn(self._round_loop(), "round loop")
        self._spawn(self._reaper(), "reaper")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        # No half-alive service: a task that cannot go on ends the process (non-zero, one
        # line), so a supervisor restarts it from the last checkpoint.
        log.debug("internal task failed", exc_info=exc)
        self.failure = f"{task.get_name()} failed: {type(exc).__name__}: {exc}"
        log.error("%s; stopping", self.failure)
        self.request_stop()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    def request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self.round is not None:
            self.round.changed.set()

    async def close(self) -> None:
        """Stop serving; first let the round loop finish the step it is applying (the open
        round is given up), then write a checkpoint of the last completed step if none is on
        disk: a stop (SIGTERM, SIGINT, SHUTDOWN) never loses a step."""
        for srv in self._servers:
            srv.close()
        if self.failure is not None and self._admin_streams:
            await asyncio.sleep(FAILED_LINGER_S)  # they answer every request with the failure
        if self._round_task is not None and self.failure is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._round_task), STOP_ROUND_S)
            if self._checkpoint_step != self.step:
                log.info("stopping at step %d: writing a final checkpoint", self.step)
                await self._checkpoint_or_warn()
        for m in list(self.members.values()):
            await m.stream.close()
        for admin in list(self._admin_streams):
            await admin.close()
        for task in list(self._tasks):
            await cancel_and_wait(task)
        for srv in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 2.0)

    # ------------------------------------------------------------------ worker link

    async def _serve_worker(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        stream = FdtcStream(reader, writer, role=Role.COORDINATOR, link=Link.WORKER,
                            frame_deadline_s=self.opt.frame_deadline_s)
        member: Member | None = None
        try:
            member = await self._handshake(stream)
            if member is None:
                return
            while True:
                msg = await stream.recv()
                member.last_seen = time.monotonic()
                if not await self._on_worker_message(member, msg):
                    return
        except ProtocolError as exc:
            self.metrics.protocol_errors.labels(link="worker").inc()
            log.warning("worker link: closing %s: %s", stream.peer, exc)
            await stream.answer(exc)
        except FrameTimeout as exc:
            log.warning("worker link: %s; closed", exc)
        except (StreamClosed, ConnectionError, TimeoutError) as exc:
            if member is not None:
                log.info("worker %s disconnected: %s", member.worker_id, exc)
        finally:
            if member is not None and self.members.get(member.worker_id) is member:
                self._drop(member, "disconnected")
            await stream.close()

    async def _handshake(self, stream: FdtcStream) -> Member | None:
        """DATASET (optional) then REGISTER, in the order the connection enforces; answer
        REGISTER_ACK, and extensions if spoken."""
        extended = False
        msg: fdtc.Register | None = None
        while msg is None:
            event = await stream.recv(idle_timeout_s=REGISTER_TIMEOUT_S)
            if isinstance(event, fdtc.Register):
                msg = event
            elif isinstance(event, fdtc.Dataset):
                extended = True
                mine = self.corpus.fingerprint
                if (event.n_tokens, event.sha256.hex()) != (mine.n_tokens, mine.sha256):
                    reason = (
                        f"worker data ({event.n_tokens} tokens, sha256 "
                        f"{event.sha256.hex()[:12]}) differs from the swarm's ({mine.n_tokens} "
                        f"tokens, sha256 {mine.sha256[:12]}); start the worker with the "
                        "coordinator's --data"
                    )
                    await self._refuse(stream, ErrorCode.DATA_MISMATCH, reason)
                    return None
            else:  # ERROR or DEREGISTER: the peer leaves before it joined
                log.info("%s left before registering (%s)", stream.peer,
                         fdtc.msg_type_name(event.TYPE))
                return None
        if msg.protocol_version != fdtc.PROTOCOL_VERSION:
            reason = (
                f"protocol version {msg.protocol_version} is not supported; this coordinator "
                f"speaks version {fdtc.PROTOCOL_VERSION}: upgrade the worker"
            )
            await self._refuse(stream, ErrorCode.VERSION_MISMATCH, reason)
            return None
        if not msg.worker_id:
            await self._refuse(stream, ErrorCode.REJECTED, "empty worker_id")
            return None
        if not extended and self.opt.sync_every > 1:
            reason = (
                f"this swarm trains with local steps (--sync-every {self.opt.sync_every}), "
                "which the seed protocol cannot carry (LOCAL_ASSIGN, UPDATE); join a "
                "coordinator run with --sync-every 1, or use a worker that speaks the "
                "extensions (docs/protocol.md)"
            )
            await self._refuse(stream, ErrorCode.REJECTED, reason)
            return None
        old = self.members.get(msg.worker_id)
        if old is not None:
            log.info("worker %s reconnected; closing its old connection", msg.worker_id)
            self._drop(old, "replaced")
            await old.stream.close()
        profile = msg.profile
        micro = max(1, msg.suggested_batch_size or fdtc.profile_batch_size(profile))
        now = time.monotonic()
        member = Member(
            worker_id=msg.worker_id,
            stream=stream,
            profile=profile,
            cores=msg.num_cores,
            memory_mb=msg.memory_mb,
            micro_batch=micro,
            accumulation_steps=fdtc.profile_accumulation_steps(profile),
            extended=extended,
            joined_at=now,
            last_seen=now,
        )
        self.members[member.worker_id] = member
        shard, total = self._shard_of(member.worker_id)
        ack = fdtc.RegisterAck(
            accepted=True,
            assigned_shard=shard,
            total_shards=total,
            batch_size=member.micro_batch,
            accumulation_steps=member.accumulation_steps,
            compression=self.opt.compression,
            topk_ratio=self.opt.topk_ratio,
            global_step=self.step,
        )
        msgs: list[fdtc.Message] = [ack]
        if extended:
            msgs.append(
                model_config_msg(self.opt.cfg, self.opt.settings.aux_loss_coef)
            )
            msgs.append(self._train_plan())
        await stream.send(*msgs)
        log.info(
            "worker %s registered from %s (%s, %d cores, %d MB, micro-batch %d)%s",
            member.worker_id, stream.peer, fdtc.profile_name(profile), member.cores,
            member.memory_mb, member.micro_batch, "" if extended else " [seed protocol only]",
        )
        self._update_member_gauges()
        self._wake.set()
        return member

    def _train_plan(self) -> fdtc.TrainPlan:
        s = self.opt.settings
        return fdtc.TrainPlan(
            sync_every=self.opt.sync_every, digest_every=self.opt.digest_every,
            down_compression=self.opt.downlink, lr=s.lr, warmup_steps=s.warmup_steps,
            total_steps=s.total_steps, min_lr_ratio=s.min_lr_ratio,
            weight_decay=s.weight_decay, grad_clip=s.grad_clip,
            flags=fdtc.train_plan_flags(  # the default levels travel as 0
                overlap=self.opt.overlap,
                qsgd_levels=0 if self.opt.qsgd_levels == DEFAULT_QSGD_LEVELS
                else self.opt.qsgd_levels,
            ),
        )

    async def _refuse(self, stream: FdtcStream, code: ErrorCode, reason: str) -> None:
        log.warning("refusing %s: %s", stream.peer, reason)
        refuse = fdtc.RegisterAck(
            accepted=False, assigned_shard=0, total_shards=0, batch_size=0,
            accumulation_steps=0, compression=self.opt.compression, topk_ratio=0.0,
            global_step=self.step,
        )
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            await stream.send(refuse, fdtc.Error(int(code), clip(reason)))

    def _shard_of(self, worker_id: str) -> tuple[int, int]:
        ids = sorted(self.members)
        return ids.index(worker_id), len(ids)

    async def _on_worker_message(self, m: Member, msg: fdtc.Message) -> bool:
        """Handle one message the link's state allows; False closes the connection."""
        if isinstance(msg, fdtc.Heartbeat):
            m.heard_heartbeat(m.last_seen)
            m.local_step = msg.local_step
            if np.isfinite(msg.current_loss):
                m.loss = msg.current_loss
            if msg.samples_per_sec > 0 and msg.samples_per_sec != m.heard_rate:
                # A new measurement (heartbeats repeat the last one every 0.5 s: averaging
                # the repeats would leave only the last round in the average).
                m.heard_rate = msg.samples_per_sec
                m.rate = policy.update_rate(m.rate or None, msg.samples_per_sec)
                self.metrics.worker_samples_per_second.labels(worker=m.worker_id).set(m.rate)
            if not m.ack_pending:
                # Sent from a task of its own: behind a large send (full weights on a slow
                # link) this loop must keep reading, or the worker looks silent.
                m.ack_pending = True
                self._spawn(self._heartbeat_ack(m), "heartbeat ack")
        elif isinstance(msg, fdtc.WeightsReq):
            if not self._applied.is_set():
                # The weights are changing: ours get them with their next assignment, a
                # seed-only peer (which has none) as soon as the step is applied.
                m.weights_step = -1
                if not m.extended:
                    self._weights_wanted.add(m.worker_id)
            else:
                await self._send_weights(m)
        elif isinstance(msg, fdtc.Gradients):
            await self._on_gradients(m, msg)
        elif isinstance(msg, fdtc.WeightsDigest):
            expected = self._digests.get(msg.global_step)
            if expected is not None and expected != msg.digest:
                self.metrics.digest_mismatches.inc()
                log.warning(
                    "worker %s holds other weights than expected at step %d; it gets full "
                    "weights with its next assignment", m.worker_id, msg.global_step,
                )
                m.weights_step = -1
        elif isinstance(msg, fdtc.Status):
            m.local_step = msg.local_step
            if np.isfinite(msg.current_loss):
                m.loss = msg.current_loss
        elif isinstance(msg, fdtc.Deregister):
            log.info("worker %s left (DEREGISTER)", m.worker_id)
            self._drop(m, "deregistered")
            return False
        elif isinstance(msg, fdtc.Error):
            # A worker that cannot train says so and leaves: no round waits on it.
            log.warning("worker %s reports error %d: %s", m.worker_id, msg.error_code, msg.message)
            if msg.error_code == ErrorCode.INTERNAL:
                self._drop(m, "error")
                return False
        # Nothing else passes the worker link's table (``fdtc_lifecycle``).
        return True

    async def _heartbeat_ack(self, m: Member) -> None:
        try:
            await self._send_to(m, fdtc.HeartbeatAck(self.step))
        except (ConnectionError, OSError, RuntimeError, TimeoutError):
            pass  # the link is going away; its reader sees that
        finally:
            m.ack_pending = False

    async def _send_to(self, m: Member, *msgs: fdtc.Message) -> None:
        m.sending += 1
        try:
            async with m.send_lock:
                await m.stream.send(*msgs)
        finally:
            m.sending -= 1

    def _weights_messages(self) -> tuple[fdtc.WeightsMeta, fdtc.Weights]:
        if self._weights_cache is None or self._weights_cache[0] != self.step:
            metas = tuple(
                fdtc.TensorMeta(name=name, shape=tuple(shape), dtype=fdtc.DType.F32)
                for name, shape in self._shapes
            )
            meta = fdtc.WeightsMeta(
                global_step=self.step,
                learning_rate=self.trainer.learning_rate(),
                tensors=metas,
            )
            # One copy of every tensor into the payload, which each worker's send then writes
            # as it is (a view: no per-tensor bytes, no joined frame).
            # The shadow, not the master: every worker holds the same bytes, whichever way
            # they reached it (docs/architecture.md, "The downlink").
            flat = np.concatenate([self.shadow.params[name].ravel() for name, _ in self._shapes])
            weights = fdtc.Weights(flat.astype("<f4", copy=False).data)
            self._weights_cache = (self.step, meta, weights)
        return self._weights_cache[1], self._weights_cache[2]

    async def _send_weights(self, m: Member) -> None:
        if not m.stream.may_send(fdtc.MsgType.WEIGHTS_META):
            return  # told SHUTDOWN already: training is over for it
        meta, weights = self._weights_messages()
        await self._send_to(m, meta, weights)
        m.weights_step = meta.global_step
        self._count_down(m, len(weights.data))
        self.metrics.weight_bytes.labels(direction="sent").inc(len(weights.data))
        # A worker holding weights learns at once where training stands (the seed's order:
        # WEIGHTS_META + WEIGHTS, then START), so a peer that waits for START never waits on
        # a swarm that is already training.
        if self.state is SwarmState.DONE:
            await self._send_to(m, fdtc.Shutdown())
        elif self._training_on() and not m.started:
            m.started = True
            await self._send_to(m, fdtc.Start())
            self._wake.set()

    def _training_on(self) -> bool:
        """Rounds run: training is on, enough workers are there, steps are left."""
        return (
            self.state is SwarmState.TRAINING
            and len(self.members) >= self.opt.min_workers
            and self.step < self.opt.max_steps
        )

    async def _announce_start(self) -> None:
        """START to every worker that holds weights and was not told yet."""
        for m in list(self.members.values()):
            if m.weights_step >= 0 and not m.started:
                m.started = True
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    await self._send_to(m, fdtc.Start())

    def _count_down(self, m: Member, n: int) -> None:
        m.bytes_down += n
        self._round_bytes[1] += n

    async def _bring_up_to_date(self, m: Member) -> None:
        """The last UPDATE to a worker that holds the step before; full weights otherwise."""
        if m.weights_step == self.step:
            return
        update = self._update
        if m.extended and update is not None and m.weights_step == update.base_step \
                and update.global_step == self.step:
            await self._send_to(m, update)
            m.weights_step = update.global_step
            self._count_down(m, len(update.data))
            self.metrics.update_bytes.labels(
                compression=Compression(update.compression).name.lower()
            ).inc(len(update.data))
        else:
            await self._send_weights(m)

    async def _on_gradients(self, m: Member, msg: fdtc.Gradients) -> None:
        comp_label = Compression(msg.compression).name.lower()
        self.metrics.gradient_bytes.labels(direction="received", compression=comp_label).inc(
            len(msg.data)
        )
        m.bytes_up += len(msg.data)
        self._round_bytes[0] += len(msg.data)
        rnd = self.round
        # An extended worker only reports what it was assigned.
        fresh = rnd is not None and rnd.accepts(m.worker_id, msg.local_step,
                                                assigned_only=m.extended)
        msg.check_tensors(self._numels)
        if not fresh or rnd is None:
            log.info(
                "stale gradient from %s for step %d (now at %d); dropped",
                m.worker_id, msg.local_step, self.step,
            )
            await self._send_to(m, fdtc.GradientsAck(self.step, accepted=False))
            return
        try:
            # In a thread: the loop goes on feeding the other workers' sockets meanwhile.
            tensors, finite = await asyncio.to_thread(self._decode_gradients, msg)
        except (ValueError, ProtocolError) as exc:
            raise fdtc.FdtcProtocolError(f"undecodable gradient data: {exc}") from exc
        if not finite:
            log.warning("gradient from %s holds NaN/inf; dropped", m.worker_id)
            await self._send_to(m, fdtc.GradientsAck(self.step, accepted=False))
            return
        if self.round is not rnd or not rnd.accepts(m.worker_id, msg.local_step,
                                                    assigned_only=m.extended):
            log.info("gradient from %s for step %d came as its round ended; dropped",
                     m.worker_id, msg.local_step)
            await self._send_to(m, fdtc.GradientsAck(self.step, accepted=False))
            return
        now = time.monotonic()
        rnd.report(m.worker_id, msg.local_step, tensors, samples=m.seed_share, loss=m.loss,
                   now=now, assigned_only=m.extended)
        rnd.steps[m.worker_id] = m.assigned_steps if m.extended else 1
        if not m.extended:
            # Its throughput as the round sees it (weights pull included), for the deadline.
            elapsed = now - rnd.started
            if elapsed > 0:
                m.rate = policy.update_rate(m.rate or None, rnd.reported[m.worker_id] / elapsed)
        m.busy = False
        rnd.changed.set()
        await self._send_to(m, fdtc.GradientsAck(rnd.step, accepted=True))

    def _decode_gradients(self, msg: fdtc.Gradients) -> tuple[list[npt.NDArray[np.float32]], bool]:
        tensors = deserialize_tensors(msg.data, self._numels, Compression(msg.compression))
        return tensors, sync.all_finite(tensors)

    def _drop(self, m: Member, reason: str) -> None:
        """``reason``: one of ``SWARM_DROP_REASONS`` (a metric label: no spaces)."""
        if self.members.get(m.worker_id) is not m:
            return
        del self.members[m.worker_id]
        self.metrics.workers_dropped.labels(reason=reason).inc()
        with contextlib.suppress(KeyError):
            self.metrics.worker_samples_per_second.remove(m.worker_id)
        if self.round is not None and self.round.drop(m.worker_id):
            self.round.changed.set()
        if reason not in ("deregistered", "replaced"):
            log.warning("dropped worker %s (%s)", m.worker_id, reason.replace("_", " "))
        self._update_member_gauges()

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            now = time.monotonic()
            for m in list(self.members.values()):
                timeout = policy.liveness_timeout(
                    extended=m.extended,
                    heartbeat_intervals=m.heartbeat_intervals,
                    fast_s=self.opt.heartbeat_timeout_s,
                    seed_default_s=self.opt.seed_heartbeat_timeout_s,
                )
                # Bytes of a frame still arriving count as life: on a slow link a worker's
                # heartbeat waits behind its own gradient.
                last = max(m.last_seen, m.stream.last_rx)
                if not m.sending and policy.is_dead(now, last, timeout):
                    self._drop(m, "heartbeat_timeout")
                    await m.stream.close()

    # ------------------------------------------------------------------ rounds

    def _active_for_round(self) -> list[Member]:
        """Workers a round can expect a gradient from: ours, and seed-only peers sent START."""
        return [m for m in self.members.values() if m.extended or m.started]

    async def _round_loop(self) -> None:
        while not self._stopping.is_set():
            if self.state is not SwarmState.DONE and (
                self._finish_requested
                or (self.state is SwarmState.TRAINING and self.step >= self.opt.max_steps)
            ):
                await self._finish()
                continue
            if self._training_on():
                await self._announce_start()
                if self._active_for_round():
                    await self._run_round()
                    continue
            # Nothing to do (paused, too few workers, or nobody who could report): no round
            # is opened until that changes, so no round waits on nobody.
            missing = self.missing_workers() if self.state is SwarmState.TRAINING else 0
            if missing and missing != self._told_missing:
                log.info("waiting for %d more worker(s): %d registered, --min-workers %d",
                         missing, len(self.members), self.opt.min_workers)
            self._told_missing = missing
            self._wake.clear()
            await self._wake.wait()

    def _advance(self, step: int) -> int:
        """Global steps a local-step round that starts at ``step`` advances: ``min(H, left)``."""
        return min(self.opt.sync_every, self.opt.max_steps - step)

    def _local_plan(
        self, members: list[Member], step: int
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Samples per inner step and inner steps of each worker, for a local-step round that
        starts at ``step`` (the global step advances by ``_advance(step)``)."""
        ids = {m.worker_id: 1.0 for m in members}
        per_step = policy.allocate_samples(self.opt.settings.global_batch, ids)
        per_step = {w: n for w, n in per_step.items() if n > 0}
        h = self._advance(step)
        rates = {m.worker_id: (m.rate if self.opt.rebalance else 1.0) for m in members}
        steps = sync.plan_local_round(per_step, rates, h)
        return sync.fill_local_round(per_step, rates, steps, h), steps

    async def _run_round(self) -> None:
        # With --overlap the round may already be open: its assignments went out before the
        # previous round's optimizer step (``_close_round``).
        rnd = self._ahead or await self._open_round(self.step, self.trainer.position)
        self._ahead = None
        decision = await self._await_decision(rnd)
        self._end_round(rnd, decision)
        if decision is policy.RoundDecision.CLOSE:
            await self._close_round(rnd)

    async def _open_round(self, step: int, position: int) -> Round:
        """Plan the round that starts at ``step`` on samples from ``position``, make it the
        current round and send its assignments, each after what brings its worker up to
        ``self.step``. Opened ahead (``--overlap``), ``step`` is past ``self.step``: a worker
        that holds ``self.step`` gets only its assignment and starts from its own trained
        weights; the previous round's UPDATE follows once it is made."""
        members = self._active_for_round()
        ours = [m for m in members if m.extended]
        self._round_bytes = [0, 0]
        local = self.opt.local_at(step)
        per_step: dict[str, int] = {}
        steps: dict[str, int] = {}
        if local:
            per_step, steps = self._local_plan(ours, step)
            shares = {w: per_step[w] * steps[w] for w in per_step}
        else:
            rates = {m.worker_id: (m.rate if self.opt.rebalance else 1.0) for m in ours}
            if self.opt.rebalance and any(r <= 0 for r in rates.values()):
                # Unmeasured workers: start from the profile's batch size as a relative speed.
                rates = {m.worker_id: float(m.rate or m.micro_batch) for m in ours}
            shares = policy.allocate_samples(self.opt.settings.global_batch, rates)
            shares = {w: n for w, n in shares.items() if n > 0}
        offsets = policy.contiguous_offsets(position, shares)
        # A seed-only peer trains its own shard at the size its REGISTER_ACK gave it; the round
        # expects that gradient too (on top of the global batch, weighted by its samples).
        expected = dict(shares)
        expected.update({m.worker_id: m.seed_share for m in members if not m.extended})
        now = time.monotonic()
        rnd = Round(
            step, expected, started=now, quorum=self.opt.quorum,
            deadline=policy.round_deadline(
                now, expected, {m.worker_id: m.rate for m in members}
            ),
        )
        self.round = rnd
        ids = sorted(shares)
        sends = []
        for m in members:
            if not m.extended:
                m.busy = True
                continue
            if m.worker_id not in shares:
                continue
            m.busy = True
            assign: fdtc.Assign | fdtc.LocalAssign
            if local:
                assign = fdtc.LocalAssign(
                    global_step=step,
                    sample_offset=offsets[m.worker_id],
                    samples_per_step=per_step[m.worker_id],
                    inner_steps=steps[m.worker_id],
                    micro_batch=m.micro_batch,
                    seq_len=self.opt.settings.seq_len,
                )
                m.inner_steps += steps[m.worker_id]
                self.metrics.inner_steps.observe(steps[m.worker_id])
            else:
                assign = fdtc.Assign(
                    global_step=step,
                    sample_offset=offsets[m.worker_id],
                    n_samples=shares[m.worker_id],
                    batch_size=m.micro_batch,
                    accumulation_steps=-(-shares[m.worker_id] // m.micro_batch),
                    assigned_shard=ids.index(m.worker_id),
                    total_shards=len(ids),
                    seq_len=self.opt.settings.seq_len,
                )
            sends.append((m, assign))
        self._update_member_gauges()
        start_us = now_us()
        for res in await self._send_staggered(sends):
            if isinstance(res, BaseException):
                log.info("could not send an assignment: %s", res)
        self.timeline.span("assign", start_us, step=step, workers=len(sends))
        return rnd

    async def _send_staggered(
        self, sends: list[tuple[Member, fdtc.Assign | fdtc.LocalAssign]]
    ) -> list[BaseException | None]:
        """The round's assignments, each after what brings its worker up to date, one worker
        at a time: the next begins once the last one's bytes are on the wire, or after as long
        as they take at the best rate this port has shown (x ``STAGGER_SLACK``), whichever is
        first; a worker behind a slower link goes on receiving beside the next. Sent all at
        once, the UPDATEs share the port and every worker starts computing when the last byte
        is out, then all uploads arrive at once; one at a time, the first starts after 1/N of
        that and the uploads come in spread out while the rest go down (the port is full
        duplex). docs/architecture.md, "Synchronous training at LAN scale"."""
        tasks: list[asyncio.Task[None]] = []
        try:
            for m, assign in sends:
                before = m.stream.bytes_out
                tasks.append(asyncio.ensure_future(self._assign(m, assign)))
                await self._until_sent(m, tasks[-1], before)
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for pending in tasks:
                pending.cancel()
            raise
        return [r if isinstance(r, BaseException) else None for r in results]

    async def _until_sent(self, m: Member, task: asyncio.Task[None], before: int) -> None:
        t0 = time.monotonic()
        while True:
            sent = m.stream.bytes_out - before
            if task.done() and (task.cancelled() or task.exception() is not None
                                or m.stream.writer.is_closing()):
                return
            if task.done() and m.stream.unsent() <= STAGGER_BELOW:
                elapsed = time.monotonic() - t0
                if sent >= STAGGER_MEASURE_ABOVE and elapsed > 0:
                    self._port_rate = max(sent / elapsed, STAGGER_DECAY * self._port_rate)
                return
            # Until a send has shown the port's rate, a fixed allowance (which a send that
            # completes within it then measures).
            budget = (sent / self._port_rate * STAGGER_SLACK if self._port_rate
                      else STAGGER_UNMEASURED_S)
            if time.monotonic() - t0 >= max(STAGGER_MIN_S, budget):
                return
            await asyncio.sleep(STAGGER_POLL_S)

    async def _await_decision(self, rnd: Round) -> policy.RoundDecision:
        """Wait until the round closes or is abandoned (reports, deaths, its deadline)."""
        warned = False
        while True:
            decision = rnd.decide(time.monotonic())
            if decision is policy.RoundDecision.ABANDON and rnd.deserted():
                # Every worker of the round left (or, seed-only, was paused) before reporting:
                # nothing more can arrive for it, and workers that joined since wait idle until
                # the next round; it runs again now rather than at the deadline.
                log.info(
                    "step %d: %s before reporting; it runs again%s", rnd.step,
                    "paused" if self.state is SwarmState.PAUSED else "every assigned worker left",
                    " after RESUME" if self.state is SwarmState.PAUSED else "",
                )
            if decision is not policy.RoundDecision.WAIT or self._stopping.is_set():
                break
            wake = rnd.deadline
            late_at = late_after(rnd.started, list(rnd.report_at.values()))
            if late_at is not None and not warned:
                if time.monotonic() >= late_at:
                    self._warn_late(rnd)
                    warned = True
                else:
                    wake = min(wake, late_at)
            rnd.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rnd.changed.wait(), max(0.0, wake - time.monotonic()))
        return decision

    def _end_round(self, rnd: Round, decision: policy.RoundDecision) -> None:
        self.round = None
        if rnd.first_report_at is not None:
            self.timeline.span(
                "wait", rnd.wall_us(rnd.first_report_at), step=rnd.step,
                last=max(rnd.report_at, key=rnd.report_at.__getitem__),
                missing=rnd.missing(),
            )
        for m in self.members.values():
            m.busy = False
        late = rnd.missing()
        if decision is policy.RoundDecision.CLOSE:
            if late:
                log.warning(
                    "step %d closed at its deadline without %s", rnd.step, ", ".join(late)
                )
            self.metrics.rounds.labels(outcome="closed").inc()
        elif self._stopping.is_set():
            log.info("step %d left open: the coordinator is stopping", rnd.step)
        else:
            self.metrics.rounds.labels(outcome="abandoned").inc()
            if rnd.shares or rnd.reported:
                log.warning(
                    "step %d abandoned: %d of %d samples reported by the deadline; re-running",
                    rnd.step, sum(rnd.reported.values()), sum(rnd.shares.values()),
                )
                self._abandoned_in_a_row += 1
                if self._abandoned_in_a_row >= ROUNDS_BEFORE_STALL_NOTE:
                    # Status says so: TRAINING with no progress is not the whole truth.
                    self._round_warning = (
                        f"step {rnd.step} abandoned {self._abandoned_in_a_row} times in a row "
                        f"(last: {sum(rnd.reported.values())} of {sum(rnd.shares.values())} "
                        f"samples reported by the deadline; see the coordinator's log)"
                    )
        if decision is policy.RoundDecision.CLOSE:
            self._abandoned_in_a_row = 0
            self._round_warning = ""
        self.timeline.span(
            "round", rnd.started_us, step=rnd.step, outcome=decision.name.lower(),
            workers=len(rnd.reported),
        )

    def _warn_late(self, rnd: Round) -> None:
        assert rnd.first_report_at is not None
        median = statistics.median(t - rnd.started for t in rnd.report_at.values())
        log.warning(
            "step %d is waiting for %s: %.2fs after the first report; the median report "
            "came %.2fs into the round",
            rnd.step, ", ".join(rnd.missing()),
            time.monotonic() - rnd.first_report_at, median,
        )

    async def _assign(self, m: Member, assign: fdtc.Assign | fdtc.LocalAssign) -> None:
        m.assigned_steps = assign.inner_steps if isinstance(assign, fdtc.LocalAssign) else 1
        await self._bring_up_to_date(m)
        await self._send_to(m, assign)

    def _overlaps(self, rnd: Round) -> bool:
        """Whether the round after ``rnd`` opens before ``rnd``'s optimizer step (--overlap)."""
        nxt = rnd.step + self._advance(rnd.step)
        return (self.opt.overlap and self.opt.local_at(rnd.step) and self.opt.local_at(nxt)
                and nxt < self.opt.max_steps and self._training_on()
                and not self._stopping.is_set() and not self._finish_requested)

    async def _close_round(self, rnd: Round) -> None:
        t0 = time.monotonic()
        round_bytes = list(self._round_bytes)
        if rnd.first_report_at is not None:
            self.metrics.straggler_wait.observe(t0 - rnd.first_report_at)
        if self._overlaps(rnd):
            # The next round's assignments go out now: each worker trains on from its own
            # weights while this round's mean, outer step and UPDATE are computed and sent.
            self._ahead = await self._open_round(
                rnd.step + self._advance(rnd.step),
                self.trainer.position + sum(rnd.planned.values()),
            )
        mean = rnd.gradients.mean()
        grads: Params = {name: t.reshape(shape) for (name, shape), t in zip(
            self._shapes, mean, strict=True
        )}
        n_samples = sum(rnd.reported.values())
        losses = [(rnd.reported[w], loss) for w, loss in rnd.losses.items() if np.isfinite(loss)]
        lr = self.trainer.learning_rate()
        before = self.step
        # The reports go into a step now (an abandoned round's never do). Counted before the
        # optimizer thread moves the global step, in this turn of the loop: status shows a
        # worker's steps at most this round ahead of the global step while it is applied,
        # never behind it (counted after, a status read during the apply saw them behind).
        for worker_id, steps in rnd.steps.items():
            if worker_id in rnd.reported and (member := self.members.get(worker_id)):
                member.steps_done += steps
        self._applied.clear()
        try:
            await asyncio.to_thread(self._apply, grads, rnd)
        finally:
            self._applied.set()
        await self._answer_weights_wanted()
        if self._ahead is not None:
            # This round's UPDATE to every worker of the round already running.
            ahead = [m for m in self.members.values() if m.worker_id in self._ahead.planned]
            results = await asyncio.gather(*(self._bring_up_to_date(m) for m in ahead),
                                           return_exceptions=True)
            for res in results:
                if isinstance(res, BaseException):
                    log.info("could not send an update: %s", res)
        self.samples_total += n_samples
        if losses:
            self.train_loss = sum(n * loss for n, loss in losses) / sum(n for n, _ in losses)
            self.metrics.train_loss.set(self.train_loss)
        elapsed = time.monotonic() - rnd.started
        self.last_rate = n_samples / elapsed if elapsed > 0 else 0.0
        self.metrics.samples.inc(n_samples)
        self.metrics.global_step.set(self.step)
        self._stepped_at = time.monotonic()
        self.metrics.learning_rate.set(lr)
        self.metrics.apply_duration.observe(time.monotonic() - t0)
        self.metrics.round_duration.observe(time.monotonic() - rnd.started)
        self.timeline.span("apply", rnd.wall_us(t0), step=rnd.step, samples=n_samples)
        # SYNC: the step advanced. A seed-only peer pulls the new weights (WEIGHTS_REQ) before
        # its next gradient; ours get theirs with their next ASSIGN.
        await self._broadcast(fdtc.Sync())
        log.info(
            "step %d: loss %.4f, %d samples from %d workers in %.2fs (%.1f samples/s)",
            self.step, self.train_loss, n_samples, len(rnd.reported), elapsed, self.last_rate,
        )
        self.metrics.step_bytes.labels(direction="up").set(round_bytes[0])
        self.metrics.step_bytes.labels(direction="down").set(round_bytes[1])
        v, c = self.opt.validate_every, self.opt.checkpoint_every
        if self.step // v > before // v or self.step >= self.opt.max_steps:
            await self._validate()
        if self.step // c > before // c or self._checkpoint_failed:
            await self._checkpoint_or_warn()

    async def _answer_weights_wanted(self) -> None:
        """The weights for the seed-only peers that asked while the step was applied."""
        wanted, self._weights_wanted = sorted(self._weights_wanted), set()
        for worker_id in wanted:
            if (peer := self.members.get(worker_id)) is not None:
                try:
                    await self._send_weights(peer)
                except (ConnectionError, OSError, RuntimeError) as exc:
                    log.info("could not send weights to %s: %s", worker_id, exc)

    def _apply(self, grads: Params, rnd: Round) -> None:
        """The optimizer step on the master (AdamW on the mean gradient, or the outer Nesterov
        step on the mean pseudo-gradient), then the UPDATE that moves the shadow after it."""
        base = self.step
        if self.opt.local_at(base):
            self.outer.step(self.trainer.params, grads)
            self.outer_steps += 1
            self.metrics.outer_step.set(self.outer_steps)
            self.trainer.step += min(self.opt.sync_every, self.opt.max_steps - base)  # as planned
            self.trainer.position += sum(rnd.planned.values())
        else:
            self.trainer.apply(grads)
        data = self.shadow.update(self.trainer.params, self._down_codec)
        self._update = fdtc.Update(
            global_step=self.step, base_step=base, compression=self.opt.downlink,
            num_tensors=len(self._shapes), uncompressed_size=4 * sum(self._numels), data=data,
        )
        if sync.digest_due(base, self.step, self.opt.digest_every):
            self._digests[self.step] = self.shadow.digest()
            for old in [s for s in self._digests if s < self.step - 4 * self.opt.digest_every]:
                del self._digests[old]

    async def _validate(self) -> None:
        """Validate the weights of this step in the background: rounds go on while it runs
        (on the whole held-out split it takes as long as several steps). One at a time: a
        validation due while the last still runs waits for it, so none is skipped and their
        log lines come in step order."""
        await self._validated()
        await self._applied.wait()
        params = {k: v.copy() for k, v in self.trainer.params.items()}
        self._validation_step = self.step
        self._validation = self._spawn(self._run_validation(self.step, params), "validation")

    async def _validated(self) -> None:
        """Until the validation under way (if any) is done."""
        task = self._validation
        if task is not None:
            await asyncio.shield(task)
            if self._validation is task:  # another waiter may have started the next one
                self._validation = None

    async def _run_validation(self, step: int, params: Params) -> None:
        seq_len = self.opt.settings.seq_len
        loss = await asyncio.to_thread(evaluate_loss, params, self.opt.cfg, self.corpus, seq_len)
        if self._yardstick is None:
            self._yardstick = await asyncio.to_thread(
                compressor_bits_per_byte, self.corpus.held_out_bytes(seq_len)
            )
        self.val_loss = loss
        self.metrics.validation_loss.set(loss)
        log.info("step %d: validation loss %.4f, %s", step, loss,
                 against_compressors(bits_per_byte(loss), self._yardstick))

    async def _checkpoint_or_warn(self) -> None:
        """A periodic checkpoint that fails (full or read-only disk) does not stop training:
        it is told, counted, and tried again after every following step until one succeeds;
        the previous checkpoints stay intact."""
        try:
            await self.checkpoint()
        except CheckpointError as exc:
            self.metrics.checkpoint_failures.inc()
            if not self._checkpoint_failed:
                self._checkpoint_warning = f"checkpoints failing since step {self.step}: {exc}"
            self._checkpoint_failed = True
            log.warning("step %d: %s; training goes on, retrying after the next step",
                        self.step, exc)
        else:
            self._checkpoint_failed = False
            self._checkpoint_warning = ""

    async def checkpoint(self) -> Path:
        t0 = time.monotonic()
        start_us = now_us()
        await self._applied.wait()  # then copied with no await between: one step's state
        opt_state = self.trainer.optimizer.state_dict()
        state = CheckpointState(
            config=self.opt.cfg,
            step=self.step,
            params={k: v.copy() for k, v in self.trainer.params.items()},
            # Copies too: the next step changes the moments while the file is written.
            optimizer={"step": opt_state["step"],
                       "m": {k: v.copy() for k, v in opt_state["m"].items()},
                       "v": {k: v.copy() for k, v in opt_state["v"].items()}},
            data_position=self.trainer.position,
            extra={"compression": Compression(self.opt.compression).name.lower(),
                   "down_compression": Compression(self.opt.downlink).name.lower(),
                   "sync_every": self.opt.sync_every, "outer_steps": self.outer_steps},
            tensors={
                "shadow": {k: v.copy() for k, v in self.shadow.params.items()},
                **({"outer_m": {k: v.copy() for k, v in self.outer.m.items()}}
                   if self.opt.sync_every > 1 else {}),
            },
        )
        path = await asyncio.to_thread(save_checkpoint, self.opt.checkpoint_dir, state,
                                       self.opt.keep_checkpoints)
        self.metrics.checkpoints.inc()
        self._checkpoint_step = state.step
        self.metrics.checkpoint_duration.observe(time.monotonic() - t0)
        self.timeline.span("checkpoint", start_us, step=state.step)
        log.info("checkpoint %s written at step %d", path, self.step)
        await self._broadcast(fdtc.Checkpoint())
        return path

    async def _finish(self) -> None:
        """The end of training, from the round loop only (so no step is applied meanwhile):
        validate and checkpoint the last step, DONE, every worker's final UPDATE, SHUTDOWN."""
        if self.state is SwarmState.DONE:
            self._done.set()
            return
        if self._validation_step != self.step:
            await self._validate()
        await self._validated()
        if self._checkpoint_step != self.step:
            await self._checkpoint_or_warn()
        self._set_state(SwarmState.DONE)
        log.info("training done at step %d; telling the workers", self.step)
        # The last step's UPDATE first, so every worker ends holding the final weights.
        for m in list(self.members.values()):
            if m.extended and m.weights_step >= 0:
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    await self._bring_up_to_date(m)
        await self._broadcast(fdtc.Shutdown())
        self._done.set()

    def export_target(self, path: Path | None) -> Path:
        """Where EXPORT may write, or ExportRefused saying why not and what to do."""
        target = path or self.opt.export_path or (self.opt.checkpoint_dir / "model.gguf")
        allowed = (self.opt.export_dir or self.opt.checkpoint_dir.parent).resolve()
        resolved = target.resolve()
        if not self.opt.export_anywhere and not resolved.is_relative_to(allowed):
            raise ExportRefused(
                f"{target} is outside the export dir {allowed}; export there, or start the "
                "coordinator with --export-dir DIR or --export-anywhere"
            )
        if resolved.is_dir():
            raise ExportRefused(f"{target} is a folder; name a file in it (model.gguf)")
        if resolved.exists():
            with resolved.open("rb") as f:
                head = f.read(len(GGUF_MAGIC_BYTES))
            if head != GGUF_MAGIC_BYTES:
                raise ExportRefused(
                    f"{target} exists and is not a GGUF file; not overwriting it (remove it "
                    "or choose another --path)"
                )
        if not resolved.parent.is_dir():
            raise ExportRefused(f"folder {target.parent} does not exist; create it first")
        return target

    async def export(self, path: Path | None) -> Path:
        target = self.export_target(path)
        await self._applied.wait()
        step, params = self.step, {k: v.copy() for k, v in self.trainer.params.items()}
        await asyncio.to_thread(save_gguf, target, self.opt.cfg, params)
        log.info("exported step %d to %s", step, target)
        return target

    # ------------------------------------------------------------------ admin link

    async def _serve_admin(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        stream = FdtcStream(reader, writer, role=Role.COORDINATOR, link=Link.ADMIN,
                            frame_deadline_s=self.opt.frame_deadline_s)
        self._admin_streams.add(stream)
        try:
            while True:
                msg = await stream.recv()
                if isinstance(msg, fdtc.Error):  # the client gives up: nothing to answer
                    log.info("admin link: %s reports error %d: %s; closed", stream.peer,
                             msg.error_code, msg.message)
                    return
                await stream.send(*await self._admin_answer(msg))
        except ProtocolError as exc:
            self.metrics.protocol_errors.labels(link="admin").inc()
            log.warning("admin link: closing %s: %s", stream.peer, exc)
            await stream.answer(exc)
        except FrameTimeout as exc:
            log.warning("admin link: %s; closed", exc)
        except (StreamClosed, ConnectionError, TimeoutError):
            pass
        finally:
            self._admin_streams.discard(stream)
            await stream.close()

    async def _admin_answer(self, msg: fdtc.Message) -> tuple[fdtc.Message, ...]:
        """The answer to one admin request. A failed coordinator (on its way out) tells the
        failure: in SWARM_DETAIL to a detail request, as an ERROR to any other request, so
        no client reads TRAINING, or takes a checkpoint for written, from it."""
        if isinstance(msg, fdtc.SwarmDetailReq):
            return self.swarm_status(), self.swarm_detail()
        if self.failure is not None:
            text = f"the coordinator failed ({self.failure}) and is exiting with status 1"
            return (fdtc.Error(int(ErrorCode.INTERNAL), clip(text)),)
        return (await self._on_admin_message(msg),)

    async def _on_admin_message(self, msg: fdtc.Message) -> fdtc.Message:
        """The answer to one admin request (the only messages the admin link's table lets
        through, besides ERROR)."""
        if isinstance(msg, fdtc.StatusReq):
            return self.swarm_status()
        if isinstance(msg, fdtc.Export):
            try:
                path = await self.export(Path(msg.path) if msg.path else None)
            except (ExportRefused, GGUFError, OSError) as exc:
                log.warning("export refused or failed: %s", exc)
                return self._ack(msg, False, f"export failed: {exc}")
            return self._ack(msg, True, str(path))
        if isinstance(msg, fdtc.Checkpoint):
            try:
                path = await self.checkpoint()
            except CheckpointError as exc:
                self.metrics.checkpoint_failures.inc()
                log.warning("requested checkpoint failed: %s", exc)
                return self._ack(msg, False, str(exc))
            return self._ack(msg, True, str(path))
        if isinstance(msg, fdtc.Start | fdtc.Resume):
            if self.state is SwarmState.DONE:
                return self._ack(msg, False, "training is done; nothing to start")
            self._set_state(SwarmState.TRAINING)
            # Workers already told START hear the request itself; the round loop sends START
            # to the others (it holds them back while fewer than --min-workers are there).
            await self._broadcast(
                fdtc.Resume() if isinstance(msg, fdtc.Resume) else fdtc.Start(),
                only_started=True,
            )
            return self._ack(msg, True, "training")
        if isinstance(msg, fdtc.Pause):
            if self.state is SwarmState.DONE:
                return self._ack(msg, False, "training is done; nothing to pause")
            self._set_state(SwarmState.PAUSED)
            await self._broadcast(fdtc.Pause())
            self._release_paused_peers()
            return self._ack(msg, True, "paused after the current round")
        assert isinstance(msg, fdtc.Shutdown), msg
        if self._round_task is not None and not self._round_task.done():
            # After the round under way: finishing beside the loop could apply a step after
            # the final checkpoint.
            self._finish_requested = True
            self._wake.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._done.wait()), SHUTDOWN_WAIT_S)
        else:
            await self._finish()
        asyncio.get_running_loop().call_later(0.2, self.request_stop)
        if not self._done.is_set():  # the stop checkpoints whatever step it ends at
            return self._ack(msg, True, f"stopping at step {self.step}: the round under way "
                                        f"did not end within {SHUTDOWN_WAIT_S:.0f} s")
        return self._ack(msg, True, f"shut down at step {self.step}")

    def _release_paused_peers(self) -> None:
        """The open round stops expecting seed-only peers that have not reported yet.

        PAUSE tells them to stop training; ours finish the assignment they hold (the round
        closes with their work), but nothing says a seed-only peer will, so the round does not
        wait out its deadline for it. A gradient it still sends for the step is taken.
        """
        rnd = self.round
        if rnd is None:
            return
        for worker_id in list(rnd.shares):
            m = self.members.get(worker_id)
            if m is not None and not m.extended and rnd.drop(worker_id):
                m.busy = False
        rnd.changed.set()

    def _ack(self, msg: fdtc.Message, ok: bool, text: str) -> fdtc.ControlAck:
        return fdtc.ControlAck(
            acked_type=msg.TYPE, ok=ok, global_step=self.step, message=clip(text)
        )

    async def _broadcast(self, msg: fdtc.Message, *, only_started: bool = False) -> None:
        """``msg`` to every registered worker, seed-only peers included, whose link takes it
        now (after SHUTDOWN only the end of a round may still go)."""
        for m in list(self.members.values()):
            if (only_started and not m.started) or not m.stream.may_send(msg.TYPE):
                continue
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                await self._send_to(m, msg)

    def reported_state(self) -> SwarmState:
        """The state as status tells it: TRAINING only while rounds can run; with fewer than
        --min-workers registered it is WAITING (``missing_workers`` says how many)."""
        if self.state is SwarmState.TRAINING and self.missing_workers() > 0:
            return SwarmState.WAITING
        return self.state

    def missing_workers(self) -> int:
        return max(0, self.opt.min_workers - len(self.members))

    def swarm_status(self) -> fdtc.SwarmStatus:
        now = time.monotonic()
        rows = tuple(
            fdtc.SwarmStatusRow(
                worker_id=m.worker_id,
                profile=m.profile,
                state=fdtc.WorkerState.TRAINING if m.busy else fdtc.WorkerState.IDLE,
                batch_size=m.micro_batch,
                accumulation_steps=m.accumulation_steps,
                samples_per_sec=m.rate,
                loss=m.loss,
                local_step=m.local_step,
                seconds_since_heartbeat=now - m.last_seen,
            )
            for m in sorted(self.members.values(), key=lambda m: m.worker_id)
        )
        return fdtc.SwarmStatus(
            global_step=self.step,
            max_steps=self.opt.max_steps,
            state=fdtc.SwarmState(int(self.reported_state())),
            train_loss=self.train_loss,
            val_loss=self.val_loss,
            samples_per_sec=self.last_rate,
            learning_rate=self.trainer.learning_rate(),
            samples_total=self.samples_total,
            rows=rows,
        )

    def swarm_detail(self) -> fdtc.SwarmDetail:
        """What SWARM_STATUS does not carry, its rows in the same order."""
        return fdtc.SwarmDetail(
            min_workers=self.opt.min_workers,
            seconds_since_step=time.monotonic() - self._stepped_at,
            failed=self.failure is not None,
            note=clip(self.failure or "; ".join(
                w for w in (self._checkpoint_warning, self._round_warning) if w)),
            rows=tuple(
                fdtc.SwarmDetailRow(
                    inner_steps=min(m.steps_done, 0xFFFF_FFFF), bytes_up=m.bytes_up,
                    bytes_down=m.bytes_down,
                )
                for m in sorted(self.members.values(), key=lambda m: m.worker_id)
            ),
        )


class ExportRefused(Exception):
    """An EXPORT path the coordinator will not write; the message says what to do."""


def late_after(started: float, report_times: list[float]) -> float | None:
    """When a round that started at ``started`` is waiting on stragglers; None before a report.

    ``LATE_FACTOR`` times the median report time so far, and no sooner than ``LATE_MIN_WAIT_S``
    after the first report.
    """
    if not report_times:
        return None
    median = statistics.median(t - started for t in report_times)
    return max(started + LATE_FACTOR * median, min(report_times) + LATE_MIN_WAIT_S)


def clip(text: str, limit: int = fdtc.MAX_PATH - 1) -> str:
    """``text`` cut to fit a NUL-terminated char[256] field without splitting a character."""
    return text.encode("utf-8")[:limit].decode("utf-8", errors="ignore")
