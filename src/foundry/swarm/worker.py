"""The worker: registers, pulls weights, computes gradients on its slices, uploads them.

Theory of operation
-------------------
``Worker.run`` keeps one connection to the coordinator alive, reconnecting with capped
exponential backoff whenever it goes away (the coordinator restarting is routine, not fatal).
On each connection: DATASET (our extension: the fingerprint of the local data), REGISTER,
REGISTER_ACK, MODEL_CONFIG, TRAIN_PLAN, WEIGHTS_REQ. The link's ``FdtcConnection`` (role
WORKER) admits only what the coordinator may send in the link's state (a WEIGHTS after its
WEIGHTS_META, an assignment or UPDATE only once weights came); anything else is answered with
its ERROR and the worker reconnects. Then the coordinator drives:
WEIGHTS_META + WEIGHTS replace the local weights, UPDATE adds to them (``swarm.sync``: the
worker then holds bit for bit what the coordinator expects, and says so with WEIGHTS_DIGEST
every few steps). ASSIGN (``--sync-every 1``) starts a gradient over global samples
``[offset, offset + n)``; LOCAL_ASSIGN (above 1) starts inner AdamW steps from the held
weights, after which the pseudo-gradient (held minus trained weights) is the upload. Both run
in a thread (so heartbeats keep flowing) and go out as GRADIENTS through one ``Compressor``
(error feedback for every lossy codec). SHUTDOWN ends the process with success; a refusal that
retrying cannot fix (different data, version, mode) ends it with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import socket
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from foundry.compression import Compressor, deserialize_tensors, get_codec, largest_message
from foundry.hardware import HardwareInfo, detect_profile, profile_batch_size
from foundry.model.formats.tuning import FileIdentity, targets_of, tuned_config
from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import Corpus, DataError
from foundry.model.train.backend import NUMPY, Backend
from foundry.model.train.training import GradientResult, Params
from foundry.obs.metrics import WorkerMetrics
from foundry.obs.timeline import Timeline, now_us
from foundry.swarm import sync
from foundry.swarm.model_config import config_of
from foundry.transport.backoff import backoff_delay
from foundry.transport.fdtc_stream import FdtcStream, StreamClosed
from foundry.transport.stream import LINK_DEAD_AFTER_S
from foundry.transport.tasks import cancel_and_wait
from foundry.wire import fdtc
from foundry.wire.errors import ProtocolError
from foundry.wire.fdtc import Compression, ErrorCode
from foundry.wire.fdtc_lifecycle import Role

T = TypeVar("T")

log = logging.getLogger("foundry.worker")

HEARTBEAT_INTERVAL_S = 0.5
# A link held this long before it broke counts as having worked: the next dial comes soon.
STABLE_LINK_S = 30.0
# Refusals that a retry cannot fix: the operator must change something first.
PERMANENT_REFUSALS = {ErrorCode.DATA_MISMATCH, ErrorCode.VERSION_MISMATCH, ErrorCode.MODEL_MISMATCH}


class Refused(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerOptions:
    host: str
    port: int
    worker_id: str
    hardware: HardwareInfo
    slowdown: float = 1.0  # >1 makes this worker that many times slower (benchmarks, tests)
    backoff_cap_s: float = 10.0
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    max_attempts: int = 0  # 0 = reconnect forever
    tls: ssl.SSLContext | None = None  # dial the coordinator over TLS (transport.tls)
    # The link fails within this many seconds of the coordinator's host going silent
    # (transport.stream.watch_liveness); the worker then reconnects.
    link_timeout_s: float = LINK_DEAD_AFTER_S
    # Where gradients are computed (``--device``): numpy on this CPU, or PyTorch on a GPU.
    backend: Backend = NUMPY
    # GRADIENTS over this many bytes go up as FRAGMENT frames of this size.
    fragment_size: int = fdtc.FRAGMENT_SIZE
    # Fine-tuning (``--base-model``): this machine's copy of the base file.
    base: BaseFile | None = None


@dataclass(frozen=True)
class BaseFile:
    """A fine-tuning worker's base model: the file's identity and architecture (BASE_MODEL
    states them), its config, and the base loaded for training (a ``finetune.Base``), or None
    where PyTorch is missing (the coordinator then refuses the worker, saying so)."""

    identity: FileIdentity
    architecture: str
    cfg: ModelConfig
    loaded: Any = None


class Worker:
    def __init__(
        self, options: WorkerOptions, corpus: Corpus, timeline: Timeline | None = None
    ) -> None:
        self.opt = options
        self.corpus = corpus
        self.metrics = WorkerMetrics()
        self.metrics.info.labels(
            worker=options.worker_id,
            profile=fdtc.profile_name(options.hardware.profile).lower(),
        ).set(1)
        self.timeline = timeline or Timeline(None, "worker")
        self._idle_since_us: int | None = None  # end of the last send: the "wait" span starts
        self.cfg: ModelConfig | None = None
        self.backend: Backend = options.backend  # a fine-tuning run's, once BASE_MODEL came
        self.aux_loss_coef = 0.0
        self.params: Params | None = None
        self.global_step = 0
        self.compression = Compression.NONE
        self.topk_ratio = 0.01
        self.uplink: Compressor | None = None
        self.plan: fdtc.TrainPlan | None = None
        self.weights_step = -1  # global step of the weights held; -1: none
        # The inner optimizer of local-step rounds (the backend's), kept across them.
        self.inner: Any = None
        # Training and encoding run in this one thread, one job after the other: a cancelled
        # assignment's thread cannot be killed, and two jobs at once would both change the
        # inner moments and the error-feedback residuals. A cancelled local round stops at
        # its next inner step: each job keeps the generation it was started in.
        self._work = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-compute")
        self._generation = 0
        # This worker's last pseudo-gradient (exact) and the step its round started at, until
        # an UPDATE from that step on shows it merged into the held weights. With --overlap the
        # next LOCAL_ASSIGN comes first: it starts from the held weights minus this.
        self.unmerged: tuple[int, Params] | None = None
        self._uplink_key: tuple[Compression, float, int] | None = None
        self.trained_ahead = False  # logged once
        self.inner_steps_done = 0
        self.last_loss = float("nan")
        self.rate = 0.0
        # --slowdown: the fastest seconds per sample seen, per kind of assignment (ASSIGN,
        # LOCAL_ASSIGN), which the emulated slower machine's extra time is made of.
        self._fastest_per_sample: dict[type, float] = {}
        self.samples_done = 0
        self.paused = False
        self.cannot_train: str | None = None  # why an assignment could not be trained on
        self._compute: asyncio.Task[None] | None = None
        # What the link delivered and the worker has not acted on yet.
        self._meta: fdtc.WeightsMeta | None = None  # announces the WEIGHTS that follows
        self._pending: fdtc.Assign | fdtc.LocalAssign | None = None  # waits for its weights
        self._rng = random.Random(hash(options.worker_id))
        self._registered = False  # this link's REGISTER was accepted

    async def run(self) -> int:
        """Serve until SHUTDOWN (0), a permanent refusal or an assignment it cannot train on
        (2), or ``max_attempts`` failures (1)."""
        attempt = 0
        connected_before = False  # the first connection is not a reconnect
        while True:
            try:
                stream = await FdtcStream.connect(self.opt.host, self.opt.port, ssl=self.opt.tls,
                                                  role=Role.WORKER,
                                                  dead_after_s=self.opt.link_timeout_s)
                # The coordinator speaks the extensions too (it must, to send MODEL_CONFIG):
                # messages larger than one frame go as FRAGMENT both ways.
                assert stream.connection is not None
                stream.connection.allow_fragments(fdtc.MAX_MESSAGE, self.opt.fragment_size)
            except (OSError, TimeoutError) as exc:
                attempt += 1
                if self.opt.max_attempts and attempt >= self.opt.max_attempts:
                    log.error(
                        "coordinator %s:%d unreachable: %s", self.opt.host, self.opt.port, exc
                    )
                    return 1
                delay = backoff_delay(attempt, cap_s=self.opt.backoff_cap_s, rng=self._rng)
                log.info(
                    "coordinator %s:%d unreachable (%s); retrying in %.1fs",
                    self.opt.host, self.opt.port, exc, delay,
                )
                await asyncio.sleep(delay)
                continue
            if connected_before:
                self.metrics.reconnects.inc()
            connected_before = True
            connected_at = time.monotonic()
            self._registered = False
            why = ""
            try:
                done = await self._session(stream)
            except Refused as exc:
                log.error("coordinator refused this worker: %s", exc)
                if exc.code in PERMANENT_REFUSALS:
                    return 2
                done, why = False, f"refused: {exc}"
            except (StreamClosed, ConnectionError, TimeoutError) as exc:
                done, why = False, str(exc) or type(exc).__name__
            except ssl.SSLError as exc:
                # TLS 1.3: a coordinator that refuses our certificate says so after the
                # handshake, on the first read.
                done, why = False, f"the coordinator ended TLS: {exc}"
            except ProtocolError as exc:
                await stream.answer(exc)
                done, why = False, f"bad bytes from the coordinator: {exc}"
            finally:
                await self._stop_compute()
                await stream.close()
            if done:
                return 0
            if self.cannot_train is not None:
                return 2
            if self._registered:
                # A link that worked and broke (a coordinator restart is routine): dial again
                # soon, and back off from there if the dials fail. A link that breaks again
                # soon after each registration backs off as a refusal does, so a coordinator
                # that drops this worker at once is not dialled several times a second.
                held = time.monotonic() - connected_at
                attempt = attempt + 1 if held < STABLE_LINK_S else 0
                delay = backoff_delay(attempt, cap_s=self.opt.backoff_cap_s, rng=self._rng)
                log.warning("lost the coordinator: %s; reconnecting in %.1fs (the link held "
                            "%.1fs)", why, delay, held)
                await asyncio.sleep(delay)
                continue
            # Ended before this worker was accepted: a refusal that will most likely repeat
            # (a certificate the coordinator does not trust, a full swarm), so back off as for
            # an unreachable coordinator, and say why each time.
            attempt += 1
            if self.opt.max_attempts and attempt >= self.opt.max_attempts:
                log.error("the coordinator %s:%d ended the link before accepting this worker: "
                          "%s", self.opt.host, self.opt.port, why)
                return 1
            delay = backoff_delay(attempt, cap_s=self.opt.backoff_cap_s, rng=self._rng)
            hint = (" (with TLS, the coordinator closes the link of a worker whose certificate "
                    "its --tls-ca did not sign; its log says why)" if self.opt.tls else
                    " (a coordinator started with --tls-cert closes a plaintext worker's link "
                    "at once: if it runs TLS, give this worker --tls-cert, --tls-key and "
                    "--tls-ca, docs/guide/tls.md)")
            log.warning("the coordinator %s:%d ended the link before accepting this worker: "
                        "%s%s; retrying in %.1fs", self.opt.host, self.opt.port, why, hint, delay)
            await asyncio.sleep(delay)

    async def _stop_compute(self) -> None:
        self._generation += 1  # the job in the thread, if any, stops at its next inner step
        await cancel_and_wait(self._compute)
        self._compute = None

    async def _in_work_thread(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """``fn`` in the worker's compute thread, after any job still running there."""
        return await asyncio.get_running_loop().run_in_executor(
            self._work, lambda: fn(*args, **kwargs))

    async def _session(self, stream: FdtcStream) -> bool:
        hw = self.opt.hardware
        fp = self.corpus.fingerprint
        self.weights_step = -1  # a new link: the coordinator sends full weights first
        self.unmerged = None
        self._meta, self._pending = None, None
        base = self.opt.base
        await stream.send(
            fdtc.Dataset(n_tokens=fp.n_tokens, sha256=bytes.fromhex(fp.sha256)),
            *([] if base is None else [fdtc.BaseModel(
                file_bytes=base.identity.size, sha256=base.identity.digest,
                architecture=base.architecture, trainer=int(base.loaded is not None))]),
            fdtc.Register(
                worker_id=self.opt.worker_id,
                protocol_version=fdtc.PROTOCOL_VERSION,
                profile=hw.profile,
                num_cores=hw.cores,
                memory_mb=hw.memory_mb,
                suggested_batch_size=profile_batch_size(hw.profile),
            ),
        )
        heartbeat: asyncio.Task[None] | None = None
        try:
            # The registration's answers: REGISTER_ACK, MODEL_CONFIG, TRAIN_PLAN. The link's
            # table lets through only what the coordinator may send a registered worker, and
            # until all three are in, the loop waits at most 30 s for each message.
            joined: set[fdtc.MsgType] = set()
            while len(joined) < 3:
                msg = await stream.recv(idle_timeout_s=30.0)
                if isinstance(msg, fdtc.RegisterAck):
                    await self._on_register_ack(stream, msg)
                elif isinstance(msg, fdtc.ModelConfigMsg):
                    self.cfg = config_of(msg)
                    self.aux_loss_coef = msg.aux_loss_coef
                    self._allow_fragments(stream)
                elif isinstance(msg, fdtc.BaseModel):
                    self._on_base_model(msg)
                    self._allow_fragments(stream)
                elif isinstance(msg, fdtc.TrainPlan):
                    self.plan = msg
                else:
                    if await self._on_message(stream, msg):
                        return True
                    continue
                joined.add(msg.TYPE)
            assert self.plan is not None
            self._make_uplink(self.plan)
            log.info("training plan: %s up, %s down, sync every %d",
                     self.compression.name.lower(),
                     Compression(self.plan.down_compression).name.lower(),
                     self.plan.sync_every)
            await stream.send(fdtc.WeightsReq())
            heartbeat = asyncio.ensure_future(self._heartbeats(stream))
            while True:
                if await self._on_message(stream, await stream.recv()):
                    return True
        finally:
            await cancel_and_wait(heartbeat)

    def _allow_fragments(self, stream: FdtcStream) -> None:
        """The coordinator's FRAGMENT frames build no more than this model (or the tensors a
        fine-tuning swarm trains) needs."""
        assert stream.connection is not None and self.cfg is not None
        stream.connection.allow_fragments(
            largest_message(math.prod(s) for s in self.cfg.param_shapes().values()),
            self.opt.fragment_size)

    def _on_base_model(self, msg: fdtc.BaseModel) -> None:
        """The coordinator's BASE_MODEL: what trains on this worker's base (it checked the
        file at REGISTER)."""
        from foundry.model.formats.lora import LoraError, LoraSpec

        base = self.opt.base
        if base is None or base.loaded is None:
            raise fdtc.FdtcProtocolError("BASE_MODEL to a worker without a base model",
                                         ErrorCode.MODEL_MISMATCH)
        try:
            spec = None if not msg.lora_rank else LoraSpec(
                msg.lora_rank, msg.lora_alpha, targets_of(msg.lora_targets), msg.lora_dropout)
            cfg = tuned_config(base.cfg, base.identity, spec)
        except (LoraError, ValueError) as exc:
            raise fdtc.FdtcProtocolError(f"BASE_MODEL asks for what this base cannot train: "
                                         f"{exc}", ErrorCode.MODEL_MISMATCH) from None
        if cfg != self.cfg:
            from foundry.model.train.finetune import FineTuneBackend

            self.backend = FineTuneBackend(base.loaded, spec)
            self.cfg = cfg
            log.info("fine-tuning %s", cfg.describe())

    async def _on_register_ack(self, stream: FdtcStream, ack: fdtc.RegisterAck) -> None:
        if not ack.accepted:
            reason = "no reason given"
            code = int(ErrorCode.REJECTED)
            with contextlib.suppress(Exception):
                err = await stream.recv(idle_timeout_s=2.0)
                if isinstance(err, fdtc.Error):
                    reason, code = err.message, err.error_code
            raise Refused(code, reason)
        if ack.global_step != self.global_step and (self.inner is not None or
                                                    self.uplink is not None):
            # A coordinator restarted from a checkpoint, or one that trained on without us:
            # the inner moments and the upload's residuals were built on other weights.
            log.info("the coordinator is at step %d, this worker was at %d: its inner "
                     "optimizer and error-feedback residuals start again from zero",
                     ack.global_step, self.global_step)
            self.inner = None
            if self.uplink is not None:
                self.uplink.reset()
        self._registered = True
        self.global_step = ack.global_step
        self.compression = Compression(ack.compression)
        self.topk_ratio = ack.topk_ratio
        log.info(
            "registered as %s (shard %d/%d, micro-batch %d) at step %d",
            self.opt.worker_id, ack.assigned_shard, ack.total_shards, ack.batch_size,
            ack.global_step,
        )

    def _make_uplink(self, plan: fdtc.TrainPlan) -> None:
        """The upload's codec as REGISTER_ACK and TRAIN_PLAN set it; a new one (its
        error-feedback residual from zero) only when that changed."""
        key = (self.compression, self.topk_ratio, plan.qsgd_levels)
        if self.uplink is None or key != self._uplink_key:
            params: dict[str, float | int] = {"topk_ratio": self.topk_ratio,
                                              "seed": self._rng.randrange(2**31)}
            if plan.qsgd_levels:
                params["qsgd_levels"] = plan.qsgd_levels
            self.uplink = Compressor(get_codec(self.compression, **params))
            self._uplink_key = key

    async def _heartbeats(self, stream: FdtcStream) -> None:
        while True:
            await stream.send(
                fdtc.Heartbeat(
                    worker_id=self.opt.worker_id,
                    local_step=self.global_step,
                    current_loss=self.last_loss,
                    samples_per_sec=self.rate,
                )
            )
            await asyncio.sleep(self.opt.heartbeat_interval_s)

    async def _on_message(self, stream: FdtcStream, msg: fdtc.Message) -> bool:
        """Act on one message the link's table admitted (``fdtc_lifecycle``: a WEIGHTS always
        follows its WEIGHTS_META, an assignment or UPDATE comes only to a link that got
        weights); True once training is over (SHUTDOWN)."""
        if isinstance(msg, fdtc.WeightsMeta):
            self._meta = msg
        elif isinstance(msg, fdtc.Weights):
            assert self._meta is not None  # the connection checked the order
            self._load_weights(self._meta, msg)
            self._meta = None
        elif isinstance(msg, fdtc.Update):
            await self._apply_update(stream, msg)
        elif isinstance(msg, fdtc.Assign | fdtc.LocalAssign):
            self._pending = msg
        elif isinstance(msg, fdtc.GradientsAck | fdtc.HeartbeatAck):
            self.global_step = max(self.global_step, msg.global_step)
        elif isinstance(msg, fdtc.StatusReq):
            await stream.send(self._status())
        elif isinstance(msg, fdtc.Pause):
            self.paused = True
            log.info("paused by the coordinator")
        elif isinstance(msg, fdtc.Resume | fdtc.Start):
            self.paused = False
        elif isinstance(msg, fdtc.Shutdown):
            log.info("training done at step %d; exiting", self.global_step)
            with contextlib.suppress(ConnectionError, OSError):
                await stream.send(fdtc.Deregister())
            return True
        elif isinstance(msg, fdtc.Error):
            log.warning("coordinator error %d: %s", msg.error_code, msg.message)
        # SYNC and CHECKPOINT are informational for workers: nothing to do locally. A second
        # REGISTER_ACK, MODEL_CONFIG or TRAIN_PLAN on a registered link changes nothing.
        # An assignment for weights not held yet (an UPDATE was refused and full weights are
        # on their way) waits for them.
        pending = self._pending
        if pending is not None and (pending.global_step == self.weights_step
                                    or self._starts_ahead(pending)):
            self._pending = None
            await self._start(stream, pending)
        return False

    def _starts_ahead(self, assign: fdtc.Assign | fdtc.LocalAssign) -> bool:
        """A LOCAL_ASSIGN sent before the UPDATE of the round this worker just trained
        (--overlap): it holds that round's start weights, and its own result is at hand."""
        return (isinstance(assign, fdtc.LocalAssign) and self.unmerged is not None
                and self.unmerged[0] == self.weights_step < assign.global_step)

    def _round_start(self, assign: fdtc.LocalAssign) -> Params:
        """The weights a local-step round starts from: the held ones, or ahead of the UPDATE
        the held ones minus this worker's own last pseudo-gradient (its trained weights)."""
        assert self.params is not None
        if not self._starts_ahead(assign):
            self.unmerged = None  # merged, or its round was abandoned
            return self.params
        assert self.unmerged is not None
        if not self.trained_ahead:
            log.info("step %d starts from this worker's own weights of step %d, ahead of "
                     "that round's UPDATE (--overlap)", assign.global_step, self.unmerged[0])
            self.trained_ahead = True
        pseudo = self.unmerged[1]
        return {k: np.subtract(p, pseudo[k]) for k, p in self.params.items()}

    async def _start(self, stream: FdtcStream, assign: fdtc.Assign | fdtc.LocalAssign) -> None:
        if self._idle_since_us is not None:
            self.timeline.span("wait", self._idle_since_us, step=assign.global_step)
            self._idle_since_us = None
        if self._compute is not None and not self._compute.done():
            await self._stop_compute()
        self._compute = asyncio.ensure_future(self._compute_and_send(stream, assign))

    def _load_weights(self, meta: fdtc.WeightsMeta, weights: fdtc.Weights) -> None:
        assert self.cfg is not None
        shapes = self.cfg.param_shapes()
        names = [t.name for t in meta.tensors]
        got = [tuple(t.shape) for t in meta.tensors]
        if names != list(shapes) or got != [tuple(s) for s in shapes.values()] or any(
            t.dtype is not fdtc.DType.F32 for t in meta.tensors
        ):
            raise Refused(
                int(ErrorCode.MODEL_MISMATCH),
                "WEIGHTS_META names tensors, shapes or types this worker's model does not have",
            )
        # Views of the received payload, not copies (``weights_tensors`` checks its size
        # against WEIGHTS_META): the decoder gave this message a buffer of its own, and an
        # UPDATE makes new arrays rather than writing into these (a big-endian host copies,
        # to swap bytes).
        params: Params = {
            name: t.astype(np.float32, copy=False)
            for name, t in fdtc.weights_tensors(meta, weights).items()
        }
        self.params = params
        self.global_step = meta.global_step
        self.weights_step = meta.global_step
        if self.unmerged is not None and meta.global_step > self.unmerged[0]:
            self.unmerged = None
        self.metrics.weight_bytes.labels(kind="full").inc(len(weights.data))

    async def _apply_update(self, stream: FdtcStream, update: fdtc.Update) -> None:
        """Add an UPDATE to the held weights, as new arrays (a computation in a thread may
        still read the old ones); out of step, ask for full weights instead."""
        self.metrics.weight_bytes.labels(kind="update").inc(len(update.data))
        if self.params is not None:  # its sizes, on receipt, whatever step it is for
            update.check_tensors([t.size for t in self.params.values()])
        if self.params is None or update.base_step != self.weights_step:
            log.info("UPDATE for step %d while holding step %d; asking for full weights",
                     update.base_step, self.weights_step)
            self.weights_step = -1
            await stream.send(fdtc.WeightsReq())
            return
        params = self.params
        names = list(params)
        start_us = now_us()
        tensors = deserialize_tensors(update.data, [params[k].size for k in names],
                                      Compression(update.compression))
        self.params = {k: params[k] + t.reshape(params[k].shape)
                       for k, t in zip(names, tensors, strict=True)}
        self.timeline.span("update", start_us, step=update.global_step, bytes=len(update.data))
        self.weights_step = self.global_step = update.global_step
        if self.unmerged is not None and update.base_step >= self.unmerged[0]:
            self.unmerged = None  # that round is in the weights now
        every = self.plan.digest_every if self.plan is not None else 0
        if sync.digest_due(update.base_step, update.global_step, every):
            digest = await asyncio.to_thread(sync.weights_digest, self.params, names)
            await stream.send(fdtc.WeightsDigest(update.global_step, digest))

    def _local_steps(
        self, start: Params, assign: fdtc.LocalAssign, stop: Callable[[], bool]
    ) -> GradientResult:
        """``inner_steps`` AdamW steps from ``start``; the pseudo-gradient start - end."""
        assert self.cfg is not None and self.plan is not None
        plan = self.plan
        backend = self.backend
        if self.inner is None:
            self.inner = backend.make_inner(start, plan.weight_decay)
        schedule = sync.InnerSchedule(plan.lr, plan.warmup_steps, plan.total_steps,
                                      plan.min_lr_ratio, plan.grad_clip)
        return backend.local_steps(
            start, self.inner, self.cfg, self.corpus, lr_at=schedule.lr_at,
            grad_clip=schedule.grad_clip, global_step=assign.global_step,
            sample_offset=assign.sample_offset, samples_per_step=assign.samples_per_step,
            steps=assign.inner_steps, micro_batch=assign.micro_batch, seq_len=assign.seq_len,
            aux_loss_coef=self.aux_loss_coef, stop=stop,
        )

    async def _compute_and_send(
        self, stream: FdtcStream, assign: fdtc.Assign | fdtc.LocalAssign
    ) -> None:
        if self.params is None or self.cfg is None:
            log.warning("assignment before weights; asking for them")
            await stream.send(fdtc.WeightsReq())
            return
        t0 = time.monotonic()
        start_us = now_us()
        result: GradientResult
        try:
            if isinstance(assign, fdtc.LocalAssign):
                start = self._round_start(assign)
                gen = self._generation
                result = await self._in_work_thread(
                    self._local_steps, start, assign, lambda: self._generation != gen)
                # Before the upload: the next LOCAL_ASSIGN may follow its ack at once.
                self.unmerged = (assign.global_step, result.grads)
                self.inner_steps_done += assign.inner_steps
                self.metrics.inner_steps.inc(assign.inner_steps)
            else:
                result = await self._in_work_thread(
                    self.backend.compute_gradients,
                    self.params,
                    self.cfg,
                    self.corpus,
                    assign.sample_offset,
                    assign.n_samples,
                    seq_len=assign.seq_len,
                    micro_batch=assign.batch_size,
                    aux_loss_coef=self.aux_loss_coef,
                )
        except DataError as exc:
            await self._cannot_train(stream, f"cannot train step {assign.global_step}: {exc}")
            return
        n_samples = result.n_samples
        compute_s = time.monotonic() - t0
        if self.opt.slowdown > 1.0 and n_samples > 0:
            # A machine that many times slower takes (slowdown - 1) x its compute more: of its
            # fastest compute, so that what other processes on this computer take from this
            # one (a benchmark's whole swarm on one machine) is not multiplied along with it.
            kind = type(assign)
            fastest = min(self._fastest_per_sample.get(kind, math.inf), compute_s / n_samples)
            self._fastest_per_sample[kind] = fastest
            extra = fastest * n_samples * (self.opt.slowdown - 1.0)
            await asyncio.sleep(extra)
            compute_s += extra
        self.metrics.phase_duration.labels(phase="compute").observe(compute_s)
        step = assign.global_step
        self.timeline.span("compute", start_us, step=step, samples=n_samples)
        t1 = time.monotonic()
        start_us = now_us()
        data = await self._in_work_thread(self._encode, result.grads)
        if data is None:
            log.warning("step %d: this worker's gradient holds NaN or inf; not sent, and the "
                        "error-feedback residuals start again from zero", step)
            return
        self.metrics.phase_duration.labels(phase="compress").observe(time.monotonic() - t1)
        self.timeline.span("compress", start_us, step=step, bytes=len(data))
        self.last_loss = result.loss
        self.rate = n_samples / compute_s if compute_s > 0 else 0.0
        self.samples_done += n_samples
        self.metrics.samples.inc(n_samples)
        self.metrics.samples_per_second.set(self.rate)
        self.metrics.loss.set(result.loss)
        t2 = time.monotonic()
        start_us = now_us()
        # The heartbeat goes first: it carries this round's loss, which the coordinator
        # records with the gradient that follows.
        await stream.send(
            fdtc.Heartbeat(
                worker_id=self.opt.worker_id,
                local_step=assign.global_step,
                current_loss=self.last_loss,
                samples_per_sec=self.rate,
            ),
            fdtc.Gradients(
                worker_id=self.opt.worker_id,
                local_step=assign.global_step,
                num_tensors=len(result.grads),
                compression=self.compression,
                uncompressed_size=sum(g.size * 4 for g in result.grads.values()),
                data=data,
            ),
        )
        self.metrics.phase_duration.labels(phase="send").observe(time.monotonic() - t2)
        self._idle_since_us = now_us()
        self.timeline.span("send", start_us, self._idle_since_us, step=step, bytes=len(data))
        self.metrics.gradient_bytes.inc(len(data))

    async def _cannot_train(self, stream: FdtcStream, reason: str) -> None:
        """Say so to the coordinator (ERROR, which drops this worker from the round at once)
        and end the session; ``run`` then exits non-zero instead of redialling."""
        self.cannot_train = reason
        log.error("%s", reason)
        message = reason.encode()[: fdtc.MAX_PATH - 1].decode(errors="ignore")
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            await stream.send(fdtc.Error(int(ErrorCode.INTERNAL), message))
        await stream.close()

    def _encode(self, grads: Params) -> bytes | memoryview | None:
        """The upload's data section; None for a NaN/inf gradient through a lossy codec:
        QSGD and TOPK cannot encode it and FP16's residual would carry it into every later
        upload (inf - inf), so the residuals start again and nothing is sent (the coordinator
        drops a non-finite gradient anyway: the round goes on without this share)."""
        assert self.uplink is not None
        if self.uplink.feedback is not None and not sync.all_finite(grads.values()):
            self.uplink.reset()
            return None
        return self.uplink.encode(grads)[0]

    def _status(self) -> fdtc.Status:
        return fdtc.Status(
            worker_id=self.opt.worker_id,
            local_step=self.global_step,
            samples_processed=self.samples_done & 0xFFFFFFFF,
            current_loss=self.last_loss,
            avg_loss=self.last_loss,
            samples_per_sec=self.rate,
            memory_used_mb=_rss_mb(),
            is_training=not self.paused,
        )


def _rss_mb() -> int:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") // (1024 * 1024)
    except (OSError, ValueError, IndexError):
        return 0


def hardware_for(profile_name: str | None) -> HardwareInfo:
    """The detected hardware, or a named profile forced with ``--profile``."""
    detected = detect_profile()
    if profile_name is None:
        return detected
    for p in fdtc.HardwareProfile:
        if profile_name.lower() in (fdtc.profile_name(p).lower(), p.name.lower()):
            return HardwareInfo(
                profile=p, cores=detected.cores, memory_mb=detected.memory_mb,
                description=f"forced profile {fdtc.profile_name(p)}",
            )
    names = ", ".join(p.name.lower() for p in fdtc.HardwareProfile)
    raise ValueError(f"unknown profile {profile_name!r}; choose one of: {names}")

