"""The admin port: the coordinator's end of the admin link (the gateway, ``foundry ctl``).

Each connection is one task (``serve``) that answers requests in order: STATUS_REQ and
SWARM_DETAIL_REQ (``swarm_status``, ``swarm_detail``), EXPORT and CHECKPOINT (``Records``),
START, RESUME, PAUSE and SHUTDOWN (the swarm's state, told to the workers by the downlink; the
end itself is the round loop's ``finish``). A failed coordinator answers every request but a
detail request with its failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from foundry.model.formats.checkpoint import CheckpointError
from foundry.model.formats.gguf_model import GGUFError
from foundry.swarm.core import SwarmCore, SwarmState, clip
from foundry.swarm.downlink import Downlink
from foundry.swarm.records import ExportRefused, Records
from foundry.swarm.round_loop import RoundRunner
from foundry.transport.fdtc_stream import FdtcStream, FrameTimeout, StreamClosed
from foundry.wire import fdtc
from foundry.wire.errors import ProtocolError
from foundry.wire.fdtc import ErrorCode
from foundry.wire.fdtc_lifecycle import Link, Role

log = logging.getLogger("foundry.coordinator")

# How long SHUTDOWN waits for the round under way to end before it stops without it.
SHUTDOWN_WAIT_S = 30.0


class AdminPort:
    def __init__(
        self, core: SwarmCore, downlink: Downlink, records: Records, runner: RoundRunner
    ) -> None:
        self.core = core
        self.downlink = downlink
        self.records = records
        self.runner = runner
        self.streams: set[FdtcStream] = set()  # open admin links

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = FdtcStream(
            reader,
            writer,
            role=Role.COORDINATOR,
            link=Link.ADMIN,
            frame_deadline_s=self.core.opt.frame_deadline_s,
        )
        self.streams.add(stream)
        try:
            while True:
                msg = await stream.recv()
                if isinstance(msg, fdtc.Error):  # the client gives up: nothing to answer
                    log.info(
                        "admin link: %s reports error %d: %s; closed",
                        stream.peer,
                        msg.error_code,
                        msg.message,
                    )
                    return
                await stream.send(*await self._admin_answer(msg))
        except ProtocolError as exc:
            self.core.metrics.protocol_errors.labels(link="admin").inc()
            log.warning("admin link: closing %s: %s", stream.peer, exc)
            await stream.answer(exc)
        except FrameTimeout as exc:
            log.warning("admin link: %s; closed", exc)
        except (StreamClosed, ConnectionError, TimeoutError):
            pass
        finally:
            self.streams.discard(stream)
            await stream.close()

    async def _admin_answer(self, msg: fdtc.Message) -> tuple[fdtc.Message, ...]:
        """The answer to one admin request. A failed coordinator (on its way out) tells the
        failure: in SWARM_DETAIL to a detail request, as an ERROR to any other request, so
        no client reads TRAINING, or takes a checkpoint for written, from it."""
        if isinstance(msg, fdtc.SwarmDetailReq):
            return self.swarm_status(), self.swarm_detail()
        if self.core.failure is not None:
            text = f"the coordinator failed ({self.core.failure}) and is exiting with status 1"
            return (fdtc.Error(int(ErrorCode.INTERNAL), clip(text)),)
        return (await self._on_admin_message(msg),)

    async def _on_admin_message(self, msg: fdtc.Message) -> fdtc.Message:
        """The answer to one admin request (the only messages the admin link's table lets
        through, besides ERROR)."""
        if isinstance(msg, fdtc.StatusReq):
            return self.swarm_status()
        if isinstance(msg, fdtc.Export):
            try:
                path = await self.records.export(
                    Path(msg.path) if msg.path else None, msg.file_type
                )
            except (ExportRefused, GGUFError, OSError, ValueError) as exc:
                log.warning("export refused or failed: %s", exc)
                return self._ack(msg, False, f"export failed: {exc}")
            return self._ack(msg, True, str(path))
        if isinstance(msg, fdtc.Checkpoint):
            try:
                path = await self.records.checkpoint()
            except CheckpointError as exc:
                self.core.metrics.checkpoint_failures.inc()
                log.warning("requested checkpoint failed: %s", exc)
                return self._ack(msg, False, str(exc))
            return self._ack(msg, True, str(path))
        if isinstance(msg, fdtc.Start | fdtc.Resume):
            if self.core.state is SwarmState.DONE:
                return self._ack(msg, False, "training is done; nothing to start")
            self.core.set_state(SwarmState.TRAINING)
            # Workers already told START hear the request itself; the round loop sends START
            # to the others (it holds them back while fewer than --min-workers are there).
            await self.downlink.broadcast(
                fdtc.Resume() if isinstance(msg, fdtc.Resume) else fdtc.Start(),
                only_started=True,
            )
            return self._ack(msg, True, "training")
        if isinstance(msg, fdtc.Pause):
            if self.core.state is SwarmState.DONE:
                return self._ack(msg, False, "training is done; nothing to pause")
            self.core.set_state(SwarmState.PAUSED)
            await self.downlink.broadcast(fdtc.Pause())
            self._release_paused_peers()
            return self._ack(msg, True, "paused after the current round")
        assert isinstance(msg, fdtc.Shutdown), msg
        if self.core.round_task is not None and not self.core.round_task.done():
            # After the round under way: finishing beside the loop could apply a step after
            # the final checkpoint.
            self.core.finish_requested = True
            self.core.wake.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.core.done.wait()), SHUTDOWN_WAIT_S)
        else:
            await self.runner.finish()
        asyncio.get_running_loop().call_later(0.2, self.core.request_stop)
        if not self.core.done.is_set():  # the stop checkpoints whatever step it ends at
            return self._ack(
                msg,
                True,
                f"stopping at step {self.core.step}: the round under way "
                f"did not end within {SHUTDOWN_WAIT_S:.0f} s",
            )
        return self._ack(msg, True, f"shut down at step {self.core.step}")

    def _release_paused_peers(self) -> None:
        """The open round stops expecting seed-only peers that have not reported yet.

        PAUSE tells them to stop training; ours finish the assignment they hold (the round
        closes with their work), but nothing says a seed-only peer will, so the round does not
        wait out its deadline for it. A gradient it still sends for the step is taken.
        """
        rnd = self.core.round
        if rnd is None:
            return
        for worker_id in list(rnd.shares):
            m = self.core.members.get(worker_id)
            if m is not None and not m.extended and rnd.drop(worker_id):
                m.busy = False
        rnd.changed.set()

    def _ack(self, msg: fdtc.Message, ok: bool, text: str) -> fdtc.ControlAck:
        return fdtc.ControlAck(
            acked_type=msg.TYPE, ok=ok, global_step=self.core.step, message=clip(text)
        )

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
            for m in sorted(self.core.members.values(), key=lambda m: m.worker_id)
        )
        return fdtc.SwarmStatus(
            global_step=self.core.step,
            max_steps=self.core.opt.max_steps,
            state=fdtc.SwarmState(int(self.core.reported_state())),
            train_loss=self.core.train_loss,
            val_loss=self.core.val_loss,
            samples_per_sec=self.core.last_rate,
            learning_rate=self.core.trainer.learning_rate(),
            samples_total=self.core.samples_total,
            rows=rows,
        )

    def swarm_detail(self) -> fdtc.SwarmDetail:
        """What SWARM_STATUS does not carry, its rows in the same order."""
        return fdtc.SwarmDetail(
            min_workers=self.core.opt.min_workers,
            seconds_since_step=time.monotonic() - self.core.stepped_at,
            failed=self.core.failure is not None,
            note=clip(
                self.core.failure
                or "; ".join(
                    w for w in (self.records.checkpoint_warning, self.runner.round_warning) if w
                )
            ),
            first_val_loss=self.core.first_val_loss,
            first_val_step=self.core.first_val_step,
            rows=tuple(
                fdtc.SwarmDetailRow(
                    inner_steps=min(m.steps_done, 0xFFFF_FFFF),
                    bytes_up=m.bytes_up,
                    bytes_down=m.bytes_down,
                )
                for m in sorted(self.core.members.values(), key=lambda m: m.worker_id)
            ),
        )
