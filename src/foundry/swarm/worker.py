"""The worker: registers, pulls weights, computes gradients on its slices, uploads them.

Theory of operation
-------------------
``Worker.run`` keeps one connection to the coordinator alive, reconnecting with capped
exponential backoff whenever it goes away (the coordinator restarting is routine, not fatal).
On each connection: DATASET (our extension: the fingerprint of the local data), REGISTER,
REGISTER_ACK, MODEL_CONFIG, TRAIN_PLAN, WEIGHTS_REQ. The link's ``FdtcConnection`` (role
WORKER) admits only what the coordinator may send in the link's state (a WEIGHTS after its
WEIGHTS_META, an assignment or UPDATE only once weights came); anything else is answered with
its ERROR and the worker reconnects. Then the coordinator drives: WEIGHTS_META + WEIGHTS
replace the local weights, UPDATE adds to them (``worker_core``, over ``swarm.sync``: the worker
then holds bit for bit what the coordinator expects, and says so with WEIGHTS_DIGEST every few
steps). ASSIGN (``--sync-every 1``) starts a gradient over global samples
``[offset, offset + n)``; LOCAL_ASSIGN (above 1) starts inner AdamW steps from the held
weights, after which the pseudo-gradient (held minus trained weights) is the upload. Both
run in a thread (so heartbeats keep flowing) and go out as GRADIENTS through one
``Compressor`` (error feedback for every lossy codec): ``worker_compute``. SHUTDOWN ends the
process with success; a refusal that retrying cannot fix (different data, version, mode) ends
it with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import ssl
import time

from foundry.compression import largest_message
from foundry.hardware import profile_batch_size
from foundry.model.formats.tuning import targets_of, tuned_config
from foundry.model.text.data import Corpus
from foundry.obs.timeline import Timeline
from foundry.swarm.model_config import config_of
from foundry.swarm.worker_compute import Compute
from foundry.swarm.worker_core import Refused, WorkerCore, WorkerOptions
from foundry.transport.backoff import backoff_delay
from foundry.transport.fdtc_stream import FdtcStream, StreamClosed
from foundry.transport.tasks import cancel_and_wait
from foundry.wire import fdtc
from foundry.wire.errors import ProtocolError
from foundry.wire.fdtc import Compression, ErrorCode
from foundry.wire.fdtc_lifecycle import Role

log = logging.getLogger("foundry.worker")

# A link held this long before it broke counts as having worked: the next dial comes soon.
STABLE_LINK_S = 30.0
# Refusals that a retry cannot fix: the operator must change something first.
PERMANENT_REFUSALS = {ErrorCode.DATA_MISMATCH, ErrorCode.VERSION_MISMATCH, ErrorCode.MODEL_MISMATCH}


class Worker(WorkerCore):
    def __init__(
        self, options: WorkerOptions, corpus: Corpus, timeline: Timeline | None = None
    ) -> None:
        super().__init__(options, corpus, timeline)
        self.compute = Compute(self)
        # What the link delivered and the worker has not acted on yet.
        self._meta: fdtc.WeightsMeta | None = None  # announces the WEIGHTS that follows
        self._pending: fdtc.Assign | fdtc.LocalAssign | None = None  # waits for its weights
        self._registered = False  # this link's REGISTER was accepted

    async def run(self) -> int:
        """Serve until SHUTDOWN (0), a permanent refusal or an assignment it cannot train on
        (2), or ``max_attempts`` failures (1)."""
        attempt = 0
        connected_before = False  # the first connection is not a reconnect
        while True:
            try:
                stream = await FdtcStream.connect(
                    self.opt.host,
                    self.opt.port,
                    ssl=self.opt.tls,
                    role=Role.WORKER,
                    dead_after_s=self.opt.link_timeout_s,
                )
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
                delay = backoff_delay(attempt, cap_s=self.opt.backoff_cap_s, rng=self.rng)
                log.info(
                    "coordinator %s:%d unreachable (%s); retrying in %.1fs",
                    self.opt.host,
                    self.opt.port,
                    exc,
                    delay,
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
                await self.compute.stop()
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
                delay = backoff_delay(attempt, cap_s=self.opt.backoff_cap_s, rng=self.rng)
                log.warning(
                    "lost the coordinator: %s; reconnecting in %.1fs (the link held %.1fs)",
                    why,
                    delay,
                    held,
                )
                await asyncio.sleep(delay)
                continue
            # Ended before this worker was accepted: a refusal that will most likely repeat
            # (a certificate the coordinator does not trust, a full swarm), so back off as for
            # an unreachable coordinator, and say why each time.
            attempt += 1
            if self.opt.max_attempts and attempt >= self.opt.max_attempts:
                log.error(
                    "the coordinator %s:%d ended the link before accepting this worker: %s",
                    self.opt.host,
                    self.opt.port,
                    why,
                )
                return 1
            delay = backoff_delay(attempt, cap_s=self.opt.backoff_cap_s, rng=self.rng)
            hint = (
                " (with TLS, the coordinator closes the link of a worker whose certificate "
                "its --tls-ca did not sign; its log says why)"
                if self.opt.tls
                else " (a coordinator started with --tls-cert closes a plaintext worker's link "
                "at once: if it runs TLS, give this worker --tls-cert, --tls-key and "
                "--tls-ca, docs/guide/tls.md)"
            )
            log.warning(
                "the coordinator %s:%d ended the link before accepting this worker: "
                "%s%s; retrying in %.1fs",
                self.opt.host,
                self.opt.port,
                why,
                hint,
                delay,
            )
            await asyncio.sleep(delay)

    async def _session(self, stream: FdtcStream) -> bool:
        hw = self.opt.hardware
        fp = self.corpus.fingerprint
        self.weights_step = -1  # a new link: the coordinator sends full weights first
        self.unmerged = None
        self._meta, self._pending = None, None
        base = self.opt.base
        await stream.send(
            fdtc.Dataset(n_tokens=fp.n_tokens, sha256=bytes.fromhex(fp.sha256)),
            *(
                []
                if base is None
                else [
                    fdtc.BaseModel(
                        file_bytes=base.identity.size,
                        sha256=base.identity.digest,
                        architecture=base.architecture,
                        trainer=int(base.loaded is not None),
                    )
                ]
            ),
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
            self.compute.make_uplink(self.plan)
            log.info(
                "training plan: %s up, %s down, sync every %d",
                self.compression.name.lower(),
                Compression(self.plan.down_compression).name.lower(),
                self.plan.sync_every,
            )
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
            self.opt.fragment_size,
        )

    def _on_base_model(self, msg: fdtc.BaseModel) -> None:
        """The coordinator's BASE_MODEL: what trains on this worker's base (it checked the
        file at REGISTER)."""
        from foundry.model.formats.lora import LoraError, LoraSpec

        base = self.opt.base
        if base is None or base.loaded is None:
            raise fdtc.FdtcProtocolError(
                "BASE_MODEL to a worker without a base model", ErrorCode.MODEL_MISMATCH
            )
        try:
            spec = (
                None
                if not msg.lora_rank
                else LoraSpec(
                    msg.lora_rank, msg.lora_alpha, targets_of(msg.lora_targets), msg.lora_dropout
                )
            )
            cfg = tuned_config(base.cfg, base.identity, spec)
        except (LoraError, ValueError) as exc:
            raise fdtc.FdtcProtocolError(
                f"BASE_MODEL asks for what this base cannot train: {exc}", ErrorCode.MODEL_MISMATCH
            ) from None
        if cfg != self.cfg:
            from foundry.model.train.finetune_backend import FineTuneBackend

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
        if ack.global_step != self.global_step and (
            self.inner is not None or self.uplink is not None
        ):
            # A coordinator restarted from a checkpoint, or one that trained on without us:
            # the inner moments and the upload's residuals were built on other weights.
            log.info(
                "the coordinator is at step %d, this worker was at %d: its inner "
                "optimizer and error-feedback residuals start again from zero",
                ack.global_step,
                self.global_step,
            )
            self.inner = None
            if self.uplink is not None:
                self.uplink.reset()
        self._registered = True
        self.global_step = ack.global_step
        self.compression = Compression(ack.compression)
        self.topk_ratio = ack.topk_ratio
        log.info(
            "registered as %s (shard %d/%d, micro-batch %d) at step %d",
            self.opt.worker_id,
            ack.assigned_shard,
            ack.total_shards,
            ack.batch_size,
            ack.global_step,
        )

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
            self.load_weights(self._meta, msg)
            self._meta = None
        elif isinstance(msg, fdtc.Update):
            await self.apply_update(stream, msg)
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
        if pending is not None and (
            pending.global_step == self.weights_step or self.starts_ahead(pending)
        ):
            self._pending = None
            await self.compute.start(stream, pending)
        return False

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
