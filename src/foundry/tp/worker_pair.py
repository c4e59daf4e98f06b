"""A worker rank's side of one formed pair (or world): every command the leader mirrors run
through the rank's session table (``lockstep.COMMANDS``) with the reply the table names, the
sync checkpoints met (the leader's verdict in a world of N > 2), the hash checks answered, the
gates and tokens counted. Any failure ends the pair; ``tp.worker.Worker``, built on this,
dials again."""

from __future__ import annotations

import logging
import threading

import numpy as np

from foundry.model.infer.block_draw import BlockRows, DrawArgs
from foundry.model.infer.sampling import greedy_tops
from foundry.model.shard.table import Gate
from foundry.obs.metrics import TpMetrics
from foundry.tp.handshake import ACK_ACCEPTED
from foundry.tp.link import ControlLink, LinkError
from foundry.tp.lockstep import (
    COMMANDS,
    Checkpoint,
    LockstepError,
    RankState,
    Reply,
    TracingExchange,
    failure_kind,
)
from foundry.transport.gates import GateError, GateExchange
from foundry.wire.tp import (
    CommandAck,
    ControlFrame,
    FrameType,
    GateTransport,
    Hash,
    Logits,
    PickRow,
    RowDraw,
    RowMass,
    RowPicks,
    RowTops,
    Stop,
    Sync,
    SyncCheckpoint,
    TpProtocolError,
)

log = logging.getLogger("foundry.tp.worker")

# Failures that end one pair; the worker dials again.
PAIR_FAILURES = (GateError, LinkError, TpProtocolError, LockstepError, OSError)


class WorkerPair:
    """The pair's commands on a worker rank (the dial loop and the slices: ``Worker``)."""

    # Set by Worker.__init__ (``_state`` again whenever other slices are loaded).
    metrics: TpMetrics
    _state: RankState | None
    _kept: dict[str, int]
    _stop: threading.Event
    pairs_formed: int

    @property
    def state(self) -> RankState:
        """The session table over this rank's engine (once its slices are loaded)."""
        assert self._state is not None, "no slices loaded yet"
        return self._state

    def _serve(self, link: ControlLink, gate: GateExchange, transport: GateTransport) -> bool:
        """Run commands until the pair ends; True when the leader sent STOP."""
        log.info("paired with the leader at %s: gates over %s", link.peer, transport.value)
        self.pairs_formed += 1
        self.state.reset()
        self.state.exchange = TracingExchange(gate, self._on_gate)
        self.metrics.worker_connected.set(1)
        sent, received = 0, 0
        try:
            while True:
                frame = link.recv("the next command", idle=lambda: not self._stop.is_set())
                if isinstance(frame, Stop):
                    log.info("the leader stopped the pair")
                    return True
                self._apply(link, frame)
                self._export(link, sent, received)
                sent, received = link.bytes_sent, link.bytes_received
        except PAIR_FAILURES as exc:
            if not self._stop.is_set():
                kind = failure_kind(exc)
                self.metrics.failures.labels(kind).inc()
                log.warning("pair with the leader lost (%s): %s; dialing again", kind, exc)
            return False
        finally:
            self.metrics.worker_connected.set(0)
            self.metrics.active_sessions.set(0)
            self.state.reset()
            self.state.exchange = None
            gate.close()
            link.close()

    def _apply(self, link: ControlLink, frame: object) -> None:
        """Run one command (``lockstep.COMMANDS``) and send the reply the table names."""
        st = self.state
        if isinstance(frame, Hash):
            self._hash_check(link, frame)
            return
        command = COMMANDS.get(getattr(frame, "TYPE", None))  # type: ignore[arg-type]
        if command is None:
            name = getattr(getattr(frame, "TYPE", None), "name", type(frame).__name__)
            raise LinkError(f"the leader sent {name}, which is not a command; out of step")
        assert isinstance(frame, ControlFrame)
        checkpoint = self._checkpoint(link, frame) if isinstance(frame, Sync) else None
        status = ACK_ACCEPTED
        try:
            rows = command.run(st, frame, checkpoint)
        except MemoryError:
            if command.reply is not Reply.COMMAND_ACK:
                raise
            log.error("no memory for %s", frame)
            rows, status = None, 1
        if command.reply is Reply.COMMAND_ACK:
            link.send(CommandAck(session_id=frame.session_id, status=status))
        elif command.reply is Reply.LOGITS and rows is not None and frame.row_tops:
            values, tokens = greedy_tops(rows)  # this rank's block of each row, greedily
            link.send(
                RowTops(
                    values=tuple(values),
                    tokens=tuple(tokens),
                    session_id=frame.session_id,
                    seq=st.step,
                )
            )
            if frame.row_draws:
                self._draw(link, rows, frame.row_mass)
        elif command.reply is Reply.LOGITS and rows is not None:
            link.send(Logits.from_array(rows, session_id=frame.session_id, seq=st.step))
        self.metrics.active_sessions.set(len(st.sessions))

    def _draw(self, link: ControlLink, rows: np.ndarray, row_mass: bool) -> None:
        """A ROW_DRAWS command's sampled rows: the leader's ROW_DRAW in, this block's part of
        each row's draw (block_draw) out as ROW_PICKS. With ``row_mass`` this block's pass
        runs on the ROW_DRAW (acc and nonzero 0) while the leader runs its own, and the draw
        finishes on the leader's ROW_MASS."""
        draw = link.expect(FrameType.ROW_DRAW, "the leader's row draws")
        assert isinstance(draw, RowDraw)
        self._check_step("ROW_DRAW", draw.seq, len(draw.rows), rows.shape[0])
        args = [
            DrawArgs(bool(r.mode), r.top_k, r.top, r.inv, r.acc, r.u, r.nonzero) for r in draw.rows
        ]
        block = BlockRows(rows)
        if row_mass:
            if any(r.acc or r.nonzero for r in draw.rows):
                raise LockstepError(
                    "a ROW_DRAW sent with ROW_MASS carries a row's acc or nonzero; they come "
                    "in ROW_MASS"
                )
            block.worker_pass(args)
            mass = link.expect(FrameType.ROW_MASS, "the leader's row masses")
            assert isinstance(mass, RowMass)
            self._check_step("ROW_MASS", mass.seq, len(mass.rows), rows.shape[0])
            args = [
                DrawArgs(True, a.top_k, a.top, a.inv, m.acc, a.u, m.nonzero) if a.draw else a
                for a, m in zip(args, mass.rows, strict=True)
            ]
            picks = block.worker_finish(args)
        else:
            picks = block.worker_tail(args)
        link.send(
            RowPicks(
                rows=tuple(PickRow(p.kind, p.index, p.target, p.candidates) for p in picks),
                seq=self.state.step,
            )
        )

    def _check_step(self, what: str, seq: int, count: int, rows: int) -> None:
        if seq != self.state.step or count != rows:
            raise LockstepError(
                f"{what} of step {seq} for {count} rows; this rank is at step "
                f"{self.state.step} with {rows} rows"
            )

    def _checkpoint(self, link: ControlLink, sync: Sync) -> Checkpoint:
        def meet(current: int, total: int) -> int | None:
            theirs = link.expect(FrameType.SYNC_CHECKPOINT, "the leader's sync checkpoint")
            assert isinstance(theirs, SyncCheckpoint)
            if (theirs.session_id, theirs.current, theirs.total) != (
                sync.session_id,
                current,
                total,
            ):
                raise LockstepError(
                    f"sync checkpoint of session {theirs.session_id} at {theirs.current}/"
                    f"{theirs.total}; this rank is at {current}/{total} of session "
                    f"{sync.session_id}"
                )
            mine = self._stop.is_set()
            link.send(
                SyncCheckpoint(
                    session_id=sync.session_id,
                    point=theirs.point,
                    current=current,
                    total=total,
                    requested=mine,
                )
            )
            stop = theirs.requested or mine
            if self.state.engine.world > 2:  # every rank goes by the leader's verdict
                verdict = link.expect(FrameType.SYNC_CHECKPOINT, "the leader's verdict")
                assert isinstance(verdict, SyncCheckpoint)
                if verdict.point != theirs.point or (mine and not verdict.requested):
                    raise LockstepError(
                        f"the leader's verdict at {verdict.current}/"
                        f"{verdict.total} disagrees with its checkpoint"
                    )
                stop = verdict.requested
            if stop:
                log.info(
                    "sync of session %d cancelled at %d of %d", sync.session_id, current, total
                )
                return None
            return theirs.point

        return meet

    def _hash_check(self, link: ControlLink, theirs: Hash) -> None:
        value = self.state.state_hash()
        link.send(Hash(seq=self.state.step, value=value))
        if (theirs.seq, theirs.value) == (self.state.step, value):
            self.metrics.hash_checks.labels("match").inc()
            return
        self.metrics.hash_checks.labels("mismatch").inc()
        log.error(
            "lockstep hash mismatch: leader step %d hash %#018x, worker step %d hash %#018x",
            theirs.seq,
            theirs.value,
            self.state.step,
            value,
        )

    def _on_gate(self, gate: Gate, seconds: float, nbytes: int) -> None:
        self.metrics.record_gate(seconds, nbytes)

    def _export(self, link: ControlLink, sent: int, received: int) -> None:
        m = self.metrics
        m.control_bytes.labels("sent").inc(link.bytes_sent - sent)
        m.control_bytes.labels("received").inc(link.bytes_received - received)
        for phase, n in self.state.kept.items():
            if n > self._kept[phase]:
                m.tokens.labels(phase).inc(n - self._kept[phase])
        self._kept = dict(self.state.kept)
