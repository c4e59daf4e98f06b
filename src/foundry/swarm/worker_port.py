"""The worker port: the coordinator's end of the worker link.

Each connection is one task (``serve``) that reads messages through the link's
``FdtcConnection`` (which admits only what the worker link's table allows: a message out of
order is answered with the connection's ERROR and the link closed): DATASET (optional) and
REGISTER first, then heartbeats, weight requests, gradients, digests and status. Gradients go
into the open round. The reaper drops workers that fell silent; a dropped worker is removed from
the round it was in, so nothing waits on the dead. Bad input from one peer closes that peer only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import numpy as np
import numpy.typing as npt

from foundry.compression import deserialize_tensors
from foundry.compression.qsgd import DEFAULT_QSGD_LEVELS
from foundry.hardware import profile_accumulation_steps, profile_batch_size
from foundry.model.formats.tuning import TunedConfig, targets_mask
from foundry.obs.timeline import now_us
from foundry.runtime import give_back_freed_memory
from foundry.swarm import policy, sync
from foundry.swarm.core import Member, SwarmCore, clip
from foundry.swarm.downlink import Downlink
from foundry.swarm.model_config import model_config_msg
from foundry.transport.fdtc_stream import FdtcStream, FrameTimeout, StreamClosed
from foundry.wire import fdtc
from foundry.wire.errors import ProtocolError
from foundry.wire.fdtc import Compression, ErrorCode
from foundry.wire.fdtc_lifecycle import Link, Role

log = logging.getLogger("foundry.coordinator")

# How often the reaper looks for silent workers.
REAPER_INTERVAL_S = 0.25
# A connection must say who it is (REGISTER or DATASET) within this time.
REGISTER_TIMEOUT_S = 10.0


class WorkerPort:
    def __init__(self, core: SwarmCore, downlink: Downlink) -> None:
        self.core = core
        self.downlink = downlink

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = FdtcStream(
            reader,
            writer,
            role=Role.COORDINATOR,
            link=Link.WORKER,
            frame_deadline_s=self.core.opt.frame_deadline_s,
            budget=self.core.receive_budget,
        )
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
            self.core.metrics.protocol_errors.labels(link="worker").inc()
            log.warning("worker link: closing %s: %s", stream.peer, exc)
            await stream.answer(exc)
        except FrameTimeout as exc:
            log.warning("worker link: %s; closed", exc)
        except (StreamClosed, ConnectionError, TimeoutError) as exc:
            if member is not None:
                log.info("worker %s disconnected: %s", member.worker_id, exc)
        finally:
            if member is not None and self.core.members.get(member.worker_id) is member:
                self.drop(member, "disconnected")
            await stream.close()

    async def _handshake(self, stream: FdtcStream) -> Member | None:
        """DATASET (optional) then REGISTER, in the order the connection enforces; answer
        REGISTER_ACK, and extensions if spoken."""
        extended = False
        msg: fdtc.Register | None = None
        base: fdtc.BaseModel | None = None
        while msg is None:
            event = await stream.recv(idle_timeout_s=REGISTER_TIMEOUT_S)
            if isinstance(event, fdtc.Register):
                msg = event
            elif isinstance(event, fdtc.BaseModel):
                base = event
            elif isinstance(event, fdtc.Dataset):
                extended = True
                # A peer of ours: messages larger than one frame go as FRAGMENT both ways.
                assert stream.connection is not None
                stream.connection.allow_fragments(
                    self.core.message_limit, self.core.opt.fragment_size
                )
                mine = self.core.corpus.fingerprint
                if (event.n_tokens, event.sha256.hex()) != (mine.n_tokens, mine.sha256):
                    reason = (
                        f"worker data ({event.n_tokens} tokens, sha256 "
                        f"{event.sha256.hex()[:12]}) differs from the swarm's ({mine.n_tokens} "
                        f"tokens, sha256 {mine.sha256[:12]}); start the worker with the "
                        "coordinator's --data"
                    )
                    cfg = self.core.opt.cfg
                    if isinstance(cfg, TunedConfig):  # its tokens are the base's
                        reason += (
                            f" (this swarm fine-tunes a {cfg.architecture} base: start "
                            "the worker with --base-model and its copy of that file)"
                        )
                    await self._refuse(stream, ErrorCode.DATA_MISMATCH, reason)
                    return None
            else:  # ERROR or DEREGISTER: the peer leaves before it joined
                log.info(
                    "%s left before registering (%s)", stream.peer, fdtc.msg_type_name(event.TYPE)
                )
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
        tuned = self.core.opt.cfg if isinstance(self.core.opt.cfg, TunedConfig) else None
        why = base_model_refusal(tuned, base)
        if why is not None:
            await self._refuse(stream, ErrorCode.MODEL_MISMATCH, why)
            return None
        if not extended and self.core.opt.sync_every > 1:
            reason = (
                f"this swarm trains with local steps (--sync-every {self.core.opt.sync_every}), "
                "which the seed protocol cannot carry (LOCAL_ASSIGN, UPDATE); join a "
                "coordinator run with --sync-every 1, or use a worker that speaks the "
                "extensions (docs/protocol.md)"
            )
            await self._refuse(stream, ErrorCode.REJECTED, reason)
            return None
        weight_bytes = 4 * sum(self.core.numels)
        if not extended and weight_bytes > fdtc.MAX_PAYLOAD:
            reason = (
                f"this swarm's model has {weight_bytes / 2**20:.0f} MiB of float32 weights, "
                f"more than one seed frame carries ({fdtc.MAX_PAYLOAD // 2**20} MiB); use a "
                "worker that speaks the extensions, which sends it in FRAGMENT frames "
                "(docs/protocol.md)"
            )
            await self._refuse(stream, ErrorCode.REJECTED, reason)
            return None
        old = self.core.members.get(msg.worker_id)
        if old is not None:
            log.info("worker %s reconnected; closing its old connection", msg.worker_id)
            self.drop(old, "replaced")
            await old.stream.close()
        profile = msg.profile
        micro = max(1, msg.suggested_batch_size or profile_batch_size(profile))
        now = time.monotonic()
        member = Member(
            worker_id=msg.worker_id,
            stream=stream,
            profile=profile,
            cores=msg.num_cores,
            memory_mb=msg.memory_mb,
            micro_batch=micro,
            accumulation_steps=profile_accumulation_steps(profile),
            extended=extended,
            joined_at=now,
            last_seen=now,
        )
        self.core.members[member.worker_id] = member
        shard, total = self._shard_of(member.worker_id)
        ack = fdtc.RegisterAck(
            accepted=True,
            assigned_shard=shard,
            total_shards=total,
            batch_size=member.micro_batch,
            accumulation_steps=member.accumulation_steps,
            compression=self.core.opt.compression,
            topk_ratio=self.core.opt.topk_ratio,
            global_step=self.core.step,
        )
        msgs: list[fdtc.Message] = [ack]
        if extended:
            msgs.append(
                base_model_msg(tuned)
                if tuned is not None
                else model_config_msg(self.core.opt.cfg, self.core.opt.settings.aux_loss_coef)
            )
            msgs.append(self._train_plan())
        await stream.send(*msgs)
        log.info(
            "worker %s registered from %s (%s, %d cores, %d MB, micro-batch %d)%s",
            member.worker_id,
            stream.peer,
            fdtc.profile_name(profile),
            member.cores,
            member.memory_mb,
            member.micro_batch,
            "" if extended else " [seed protocol only]",
        )
        self.core.update_member_gauges()
        self.core.wake.set()
        return member

    def _train_plan(self) -> fdtc.TrainPlan:
        s = self.core.opt.settings
        return fdtc.TrainPlan(
            sync_every=self.core.opt.sync_every,
            digest_every=self.core.opt.digest_every,
            down_compression=self.core.opt.downlink,
            lr=s.lr,
            warmup_steps=s.warmup_steps,
            total_steps=s.total_steps,
            min_lr_ratio=s.min_lr_ratio,
            weight_decay=s.weight_decay,
            grad_clip=s.grad_clip,
            flags=fdtc.train_plan_flags(  # the default levels travel as 0
                overlap=self.core.opt.overlap,
                qsgd_levels=0
                if self.core.opt.qsgd_levels == DEFAULT_QSGD_LEVELS
                else self.core.opt.qsgd_levels,
            ),
        )

    async def _refuse(self, stream: FdtcStream, code: ErrorCode, reason: str) -> None:
        log.warning("refusing %s: %s", stream.peer, reason)
        refuse = fdtc.RegisterAck(
            accepted=False,
            assigned_shard=0,
            total_shards=0,
            batch_size=0,
            accumulation_steps=0,
            compression=self.core.opt.compression,
            topk_ratio=0.0,
            global_step=self.core.step,
        )
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            await stream.send(refuse, fdtc.Error(int(code), clip(reason)))

    def _shard_of(self, worker_id: str) -> tuple[int, int]:
        ids = sorted(self.core.members)
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
                self.core.metrics.worker_samples_per_second.labels(worker=m.worker_id).set(m.rate)
            if not m.ack_pending:
                # Sent from a task of its own: behind a large send (full weights on a slow
                # link) this loop must keep reading, or the worker looks silent.
                m.ack_pending = True
                self.core.spawn(self._heartbeat_ack(m), "heartbeat ack")
        elif isinstance(msg, fdtc.WeightsReq):
            if not self.core.applied.is_set():
                # The weights are changing: ours get them with their next assignment, a
                # seed-only peer (which has none) as soon as the step is applied.
                m.weights_step = -1
                if not m.extended:
                    self.downlink.weights_wanted.add(m.worker_id)
            else:
                await self.downlink.send_weights(m)
        elif isinstance(msg, fdtc.Gradients):
            await self._on_gradients(m, msg)
        elif isinstance(msg, fdtc.WeightsDigest):
            self.downlink.check_digest(m, msg)
        elif isinstance(msg, fdtc.Status):
            m.local_step = msg.local_step
            if np.isfinite(msg.current_loss):
                m.loss = msg.current_loss
        elif isinstance(msg, fdtc.Deregister):
            log.info("worker %s left (DEREGISTER)", m.worker_id)
            self.drop(m, "deregistered")
            return False
        elif isinstance(msg, fdtc.Error):
            # A worker that cannot train says so and leaves: no round waits on it.
            log.warning("worker %s reports error %d: %s", m.worker_id, msg.error_code, msg.message)
            if msg.error_code == ErrorCode.INTERNAL:
                self.drop(m, "error")
                return False
        # Nothing else passes the worker link's table (``fdtc_lifecycle``).
        return True

    async def _heartbeat_ack(self, m: Member) -> None:
        try:
            await self.downlink.send_to(m, fdtc.HeartbeatAck(self.core.step))
        except (ConnectionError, OSError, RuntimeError, TimeoutError):
            pass  # the link is going away; its reader sees that
        finally:
            m.ack_pending = False

    async def _on_gradients(self, m: Member, msg: fdtc.Gradients) -> None:
        comp_label = Compression(msg.compression).name.lower()
        self.core.metrics.gradient_bytes.labels(direction="received", compression=comp_label).inc(
            len(msg.data)
        )
        m.bytes_up += len(msg.data)
        self.core.round_bytes[0] += len(msg.data)
        rnd = self.core.round
        # An extended worker only reports what it was assigned.
        fresh = rnd is not None and rnd.accepts(
            m.worker_id, msg.local_step, assigned_only=m.extended
        )
        msg.check_tensors(self.core.numels)
        if not fresh or rnd is None:
            log.info(
                "stale gradient from %s for step %d (now at %d); dropped",
                m.worker_id,
                msg.local_step,
                self.core.step,
            )
            await self.downlink.send_to(m, fdtc.GradientsAck(self.core.step, accepted=False))
            return
        try:
            # In a thread: the loop goes on feeding the other workers' sockets meanwhile.
            start_us = now_us()
            tensors, finite = await asyncio.to_thread(self._decode_gradients, msg)
            self.core.timeline.span(
                "decode", start_us, step=msg.local_step, worker=m.worker_id, bytes=len(msg.data)
            )
        except (ValueError, ProtocolError) as exc:
            raise fdtc.FdtcProtocolError(f"undecodable gradient data: {exc}") from exc
        if not finite:
            log.warning("gradient from %s holds NaN/inf; dropped", m.worker_id)
            await self.downlink.send_to(m, fdtc.GradientsAck(self.core.step, accepted=False))
            return
        if self.core.round is not rnd or not rnd.accepts(
            m.worker_id, msg.local_step, assigned_only=m.extended
        ):
            log.info(
                "gradient from %s for step %d came as its round ended; dropped",
                m.worker_id,
                msg.local_step,
            )
            await self.downlink.send_to(m, fdtc.GradientsAck(self.core.step, accepted=False))
            return
        now = time.monotonic()
        rnd.report(
            m.worker_id,
            msg.local_step,
            tensors,
            samples=m.seed_share,
            loss=m.loss,
            now=now,
            assigned_only=m.extended,
        )
        rnd.steps[m.worker_id] = m.assigned_steps if m.extended else 1
        if m.extended and m.heard_rate > 0:
            # This round's heartbeat came just before: its rate is this compute's.
            compute = rnd.reported[m.worker_id] / m.heard_rate
            m.overhead_s = policy.update_rate(
                m.overhead_s or None, max(1e-6, now - rnd.started - compute)
            )
        if not m.extended:
            # Its throughput as the round sees it (weights pull included), for the deadline.
            elapsed = now - rnd.started
            if elapsed > 0:
                m.rate = policy.update_rate(m.rate or None, rnd.reported[m.worker_id] / elapsed)
        m.busy = False
        rnd.changed.set()
        await self.downlink.send_to(m, fdtc.GradientsAck(rnd.step, accepted=True))

    def _decode_gradients(self, msg: fdtc.Gradients) -> tuple[list[npt.NDArray[np.float32]], bool]:
        tensors = deserialize_tensors(msg.data, self.core.numels, Compression(msg.compression))
        return tensors, sync.all_finite(tensors)

    def drop(self, m: Member, reason: str) -> None:
        """``reason``: one of ``SWARM_DROP_REASONS`` (a metric label: no spaces)."""
        if self.core.members.get(m.worker_id) is not m:
            return
        del self.core.members[m.worker_id]
        self.core.metrics.workers_dropped.labels(reason=reason).inc()
        with contextlib.suppress(KeyError):
            self.core.metrics.worker_samples_per_second.remove(m.worker_id)
        if self.core.round is not None and self.core.round.drop(m.worker_id):
            self.core.round.changed.set()
        if reason not in ("deregistered", "replaced"):
            log.warning("dropped worker %s (%s)", m.worker_id, reason.replace("_", " "))
            # What it made this process buffer (frames, fragments, its gradients) is freed
            # now; the coordinator keeps freed memory for its steps (runtime), so trim it.
            give_back_freed_memory()
        self.core.update_member_gauges()

    async def reaper(self) -> None:
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            now = time.monotonic()
            for m in list(self.core.members.values()):
                timeout = policy.liveness_timeout(
                    extended=m.extended,
                    heartbeat_intervals=m.heartbeat_intervals,
                    fast_s=self.core.opt.heartbeat_timeout_s,
                    seed_default_s=self.core.opt.seed_heartbeat_timeout_s,
                )
                # Bytes of a frame still arriving count as life: on a slow link a worker's
                # heartbeat waits behind its own gradient.
                last = max(m.last_seen, m.stream.last_rx)
                if not m.sending and policy.is_dead(now, last, timeout):
                    self.drop(m, "heartbeat_timeout")
                    await m.stream.close()

    # ------------------------------------------------------------------ rounds


def base_model_msg(cfg: TunedConfig) -> fdtc.BaseModel:
    """The coordinator's BASE_MODEL: its base file and what trains."""
    return fdtc.BaseModel(
        file_bytes=cfg.base_bytes,
        sha256=bytes.fromhex(cfg.base_sha256),
        architecture=cfg.architecture,
        trainer=1,
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        lora_targets=targets_mask(cfg.lora_targets),
    )


def base_model_refusal(tuned: TunedConfig | None, offered: fdtc.BaseModel | None) -> str | None:
    """Why a registering worker cannot join, as far as the base model goes (None: it can):
    the swarm fine-tunes ``tuned`` (None: trains from scratch), the worker ``offered`` a base
    in BASE_MODEL (None: it sent none)."""
    if tuned is None:
        if offered is None:
            return None
        return (
            f"this swarm trains Foundry's own model from scratch; the worker offers the "
            f"base model {offered.architecture} ({offered.sha256.hex()[:12]}): start it "
            "without --base-model"
        )
    if offered is None:
        return (
            f"this swarm fine-tunes a {tuned.architecture} base ({tuned.base_bytes:,} "
            f"bytes, sha256 {tuned.base_sha256[:12]}); start the worker with "
            "--base-model and its copy of that file"
        )
    if (offered.file_bytes, offered.sha256.hex()) != (tuned.base_bytes, tuned.base_sha256):
        return (
            f"the worker's base model ({offered.architecture}, {offered.file_bytes:,} "
            f"bytes, sha256 {offered.sha256.hex()[:12]}) differs from the swarm's "
            f"({tuned.architecture}, {tuned.base_bytes:,} bytes, sha256 "
            f"{tuned.base_sha256[:12]}); give it a copy of the coordinator's --base-model"
        )
    if not offered.trainer:
        return (
            f"the worker cannot train {tuned.architecture}: PyTorch is not installed there "
            "(the numpy engine's backward covers Foundry's own model only); "
            "pip install 'foundry[gpu]' on it"
        )
    return None
