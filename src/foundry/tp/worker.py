"""The worker rank (rank 1): dial the leader, agree, then run every command it mirrors.

One thread does everything: numpy and the gate exchange block it, and there is nothing else to
do while they do. The loop:

1. dial the leader with capped exponential backoff (``transport.backoff``);
2. bring the pair up (``foundry.tp.handshake``): the same identity or version mismatch met
   :data:`MISMATCH_REPEATS` dials in a row ends the process with :data:`EXIT_MISMATCH`
   (dialing again with the same files cannot help); a mismatch met once (one garbage hello,
   a stray process on the port), a busy leader, a refused or broken connection mean "dial
   again";
3. receive commands and run each through :class:`~foundry.tp.lockstep.RankState`, shipping the
   vocabulary half of the logits back after every command that produced some;
4. on any failure (gate, control link, bad bytes, a command that does not fit the session
   table) close both links, forget every session and go back to 1: the leader re-creates the
   sessions it still has. STOP from the leader ends the process with :data:`EXIT_STOPPED`.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from foundry.model.engines import make_engine
from foundry.model.tp_split import ExpertSplit, Gate
from foundry.obs.metrics import TpMetrics
from foundry.tp.handshake import (
    ACK_ACCEPTED,
    ACK_BUSY,
    ACK_SHM_FAILED,
    DEFAULT_EXPERT_SPLIT,
    RankModel,
    exchange_hellos,
    load_rank,
)
from foundry.tp.link import DEFAULT_FRAME_DEADLINE_S, ControlLink, LinkError
from foundry.tp.lockstep import (
    COMMANDS,
    Checkpoint,
    LockstepError,
    RankState,
    Reply,
    TracingExchange,
    failure_kind,
)
from foundry.transport.backoff import backoff_delay
from foundry.transport.gates import (
    DEFAULT_GATE_TIMEOUT_S,
    GateError,
    GateExchange,
    ShmGateExchange,
    TcpGateExchange,
    local_host_id,
)
from foundry.transport.tls import wrap_blocking
from foundry.wire.tp import (
    CommandAck,
    ControlFrame,
    FrameType,
    GateTransport,
    Hash,
    Hello,
    IdentityMismatch,
    Logits,
    Role,
    Stop,
    Sync,
    SyncCheckpoint,
    TpProtocolError,
    VersionMismatch,
    encode,
    negotiate_gate_transport,
)

log = logging.getLogger("foundry.tp.worker")

EXIT_STOPPED = 0
EXIT_MISMATCH = 2  # the pair can never form with these files: fix the command line
BACKOFF_BASE_S = 0.05
# The same mismatch, dials in a row, before the worker gives up: a real leader with another
# model answers the same every time; one garbage hello does not end the worker.
MISMATCH_REPEATS = 3
# Failures that end one pair; the worker dials again.
PAIR_FAILURES = (GateError, LinkError, TpProtocolError, LockstepError, OSError)


@dataclass(frozen=True)
class WorkerOptions:
    model: Path
    leader_host: str = "127.0.0.1"
    leader_port: int = 7090
    ctx_size: int | None = None
    shm: bool = True  # offer the shared-memory data plane (used when on the leader's host)
    gate_timeout_s: float = DEFAULT_GATE_TIMEOUT_S
    control_timeout_s: float = 1.0
    handshake_timeout_s: float = 5.0
    retry_max_s: float = 2.0
    expert_split: ExpertSplit = DEFAULT_EXPERT_SPLIT  # must equal the leader's (the hello checks)
    device: str = "cpu"  # --device: numpy here, or PyTorch on a GPU (model.engines)
    lora: Path | None = None  # a LoRA adapter merged at load (both ranks load the same)
    tls: ssl.SSLContext | None = None  # dial the leader over TLS (control and gate connections)
    frame_deadline_s: float = DEFAULT_FRAME_DEADLINE_S


class _Busy(Exception):
    """The leader has a worker already."""


class Worker:
    def __init__(
        self,
        options: WorkerOptions,
        model: RankModel | None = None,
        metrics: TpMetrics | None = None,
    ) -> None:
        self.options = options
        self.model = model or load_rank(options.model, 1, options.ctx_size, options.expert_split,
                                             options.lora)
        self.identity = self.model.identity
        self.metrics = metrics or TpMetrics(rank=1)
        engine = make_engine(self.model.cfg, self.model.weights, rank=1, world=2,
                             ctx_size=self.identity.ctx_size, device=options.device)
        self.state = RankState(engine, self.identity.ctx_size)
        self._offer_shm = options.shm
        self._stop = threading.Event()
        self._kept = dict(self.state.kept)
        self.pairs_formed = 0

    def request_stop(self) -> None:
        """Leave at the next command boundary (or sync checkpoint, where it asks to cancel)."""
        self._stop.set()

    # -- the dial loop -------------------------------------------------------------------

    def run(self) -> int:
        """Serve until STOP or request_stop (EXIT_STOPPED), or a mismatch (EXIT_MISMATCH)."""
        o = self.options
        attempt = 0
        mismatches: list[str] = []  # the same mismatch, dials in a row
        while not self._stop.is_set():
            try:
                link, gate, transport = self._connect()
            except (IdentityMismatch, VersionMismatch) as exc:
                self.metrics.failures.labels("identity").inc()
                mismatches = [*mismatches, str(exc)] if str(exc) in mismatches else [str(exc)]
                if len(mismatches) >= MISMATCH_REPEATS:
                    log.error("the leader at %s:%d refused this worker: %s", o.leader_host,
                              o.leader_port, exc)
                    return EXIT_MISMATCH
                log.error("the peer at %s:%d does not match this worker: %s; dialing again "
                          "(giving up after %d such answers in a row)", o.leader_host,
                          o.leader_port, exc, MISMATCH_REPEATS)
            except _Busy:
                log.warning("the leader at %s:%d already has a worker; dialing again",
                            o.leader_host, o.leader_port)
                self.metrics.failures.labels("busy").inc()
                mismatches = []
            except PAIR_FAILURES as exc:
                mismatches = []
                # A leader that is not up yet is normal at start: say so quietly, then now
                # and then (the delay is capped at retry_max_s, so the log stays readable).
                level = logging.INFO if attempt < 3 else logging.WARNING
                if attempt < 3 or attempt % 30 == 0:
                    log.log(level, "cannot reach the leader at %s:%d (%s); dialing again",
                            o.leader_host, o.leader_port, exc)
            else:
                attempt = 0
                mismatches = []
                if self._serve(link, gate, transport):
                    return EXIT_STOPPED
                continue
            delay = backoff_delay(attempt, base_s=BACKOFF_BASE_S, cap_s=o.retry_max_s)
            attempt += 1
            self._stop.wait(delay)
        return EXIT_STOPPED

    def _connect(self) -> tuple[ControlLink, GateExchange, GateTransport]:
        o = self.options
        sock = self._dial()
        link = ControlLink(sock, timeout_s=o.handshake_timeout_s, expect_hello=True,
                           frame_deadline_s=o.frame_deadline_s)
        link.deadline = time.monotonic() + 2 * o.handshake_timeout_s
        gate: GateExchange | None = None
        try:
            hello = Hello(role=Role.WORKER, identity=self.identity, host_id=local_host_id(),
                          shm_offered=self._offer_shm, execution_mode=self.model.execution_mode,
                          architecture=self.model.architecture)
            peer = exchange_hellos(link, hello)
            transport = negotiate_gate_transport(hello, peer)
            ack = link.expect(FrameType.COMMAND_ACK, "the leader's answer to the hello")
            assert isinstance(ack, CommandAck)
            if ack.status == ACK_BUSY:
                raise _Busy
            if ack.status != ACK_ACCEPTED:
                raise LinkError(f"the leader answered the hello with status {ack.status}")
            if transport is GateTransport.SHM:
                try:
                    gate = ShmGateExchange.attach(
                        peer.shm_name, n_embd=self.identity.n_embd, rank=1,
                        timeout_s=o.gate_timeout_s,
                    )
                except GateError:
                    link.send(CommandAck(status=ACK_SHM_FAILED))
                    self._offer_shm = False
                    raise
            else:
                gsock = self._dial()
                try:
                    gsock.sendall(encode(CommandAck(status=ACK_ACCEPTED, seq=ack.seq)))
                except OSError:
                    gsock.close()
                    raise
                gate = TcpGateExchange(gsock, rank=1, n_embd=self.identity.n_embd,
                                       timeout_s=o.gate_timeout_s)
            link.send(CommandAck(status=ACK_ACCEPTED))
            link.deadline = None
            link.set_timeout(o.control_timeout_s)
        except BaseException:
            if gate is not None:
                gate.close()
            link.close()
            raise
        return link, gate, transport

    def _dial(self) -> socket.socket:
        """A connection to the leader's port, TLS done when configured."""
        o = self.options
        sock = socket.create_connection((o.leader_host, o.leader_port), o.handshake_timeout_s)
        if o.tls is None:
            return sock
        return wrap_blocking(o.tls, sock, server_side=False, server_hostname=o.leader_host,
                             timeout_s=o.handshake_timeout_s)

    # -- one pair ------------------------------------------------------------------------

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
        elif command.reply is Reply.LOGITS and rows is not None:
            link.send(Logits.from_array(rows, session_id=frame.session_id, seq=st.step))
        self.metrics.active_sessions.set(len(st.sessions))

    def _checkpoint(self, link: ControlLink, sync: Sync) -> Checkpoint:
        def meet(current: int, total: int) -> int | None:
            theirs = link.expect(FrameType.SYNC_CHECKPOINT, "the leader's sync checkpoint")
            assert isinstance(theirs, SyncCheckpoint)
            if (theirs.session_id, theirs.current, theirs.total) != (sync.session_id, current,
                                                                    total):
                raise LockstepError(
                    f"sync checkpoint of session {theirs.session_id} at {theirs.current}/"
                    f"{theirs.total}; this rank is at {current}/{total} of session "
                    f"{sync.session_id}"
                )
            mine = self._stop.is_set()
            link.send(SyncCheckpoint(session_id=sync.session_id, point=theirs.point,
                                     current=current, total=total, requested=mine))
            if theirs.requested or mine:
                log.info("sync of session %d cancelled at %d of %d", sync.session_id, current,
                         total)
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
        log.error("lockstep hash mismatch: leader step %d hash %#018x, worker step %d hash %#018x",
                  theirs.seq, theirs.value, self.state.step, value)

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
