"""The leader's worker port: accept, TLS, the first bytes, the hello, pairing.

Mirrored by the worker's connect (``tp.worker``). The acceptor thread takes connections on
``--listen``; each is brought up on a short-lived handshake thread (at most ``MAX_HANDSHAKES``
at once): the TLS handshake when the leader has a TLS context, then the first four bytes say
what the connection is. ``DTPH`` opens a control connection: the hellos (``tp.handshake``),
the claim (one worker at a time: a second is told BUSY), a pairing token, and the gate
transport (the shared-memory slab, or a second TCP connection that presents the token,
``DTP4``). A formed ``Pair`` is handed to ``on_pair``; ``release`` frees the claim when the
engine ends that pair. The first bytes are read exactly (``recv_exact``), never more: a gate
connection's socket is handed over to the gate exchange with nothing of its stream consumed.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from foundry.obs.metrics import TpMetrics
from foundry.tp.handshake import ACK_ACCEPTED, ACK_BUSY, ACK_SHM_FAILED, exchange_hellos
from foundry.tp.link import ControlLink, LinkError
from foundry.transport import tls as tls_mod
from foundry.transport.gates import (
    GateExchange,
    ShmGateExchange,
    TcpGateExchange,
    local_host_id,
)
from foundry.wire.tp import (
    CommandAck,
    FrameType,
    GateTransport,
    Hello,
    Identity,
    IdentityMismatch,
    Role,
    TpDecoder,
    TpProtocolError,
    VersionMismatch,
    logits_rows,
    negotiate_gate_transport,
)

if TYPE_CHECKING:
    from foundry.tp.options import LeaderOptions

log = logging.getLogger("foundry.tp.leader")

# Connections in the middle of their first bytes / hello at once; more are closed at once.
MAX_HANDSHAKES = 4


class Pair:
    """A formed pair: the control link, the gate exchange, and the watcher's wake-up pipe."""

    def __init__(self, link: ControlLink, gate: GateExchange, transport: GateTransport) -> None:
        self.link = link
        self.gate = gate
        self.transport = transport
        self.lost: str | None = None  # set by the watcher: the worker hung up
        self._wake_r, self._wake_w = os.pipe()
        self.watcher: threading.Thread | None = None

    def watch(self, on_hangup: Callable[[Pair], None]) -> None:
        def run() -> None:
            poller = select.poll()
            poller.register(self.link.sock.fileno(), select.POLLRDHUP | select.POLLHUP)
            poller.register(self._wake_r, select.POLLIN)
            while True:
                for fd, _ in poller.poll():
                    if fd == self._wake_r:
                        return
                    on_hangup(self)
                    return

        self.watcher = threading.Thread(target=run, name="tp-pair-watcher", daemon=True)
        self.watcher.start()

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        if self.watcher is not None and self.watcher is not threading.current_thread():
            self.watcher.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.gate.close()
        self.link.close()


class BringUp:
    """The worker port's threads; ``start`` binds, ``accept_loop`` runs on its own thread."""

    def __init__(
        self,
        options: LeaderOptions,
        identity: Identity,
        execution_mode: int,
        metrics: TpMetrics,
        stopping: threading.Event,
        on_pair: Callable[[Pair], None],
        architecture: str = "llama",
    ) -> None:
        self.options = options
        self.identity = identity
        self.execution_mode = execution_mode
        self.architecture = architecture
        self.metrics = metrics
        self._stopping = stopping
        self._on_pair = on_pair
        self.port = 0
        self._listener: socket.socket | None = None
        self._claim_lock = threading.Lock()
        self._claimed = False
        self._gate_waiters: dict[int, queue.Queue[socket.socket]] = {}
        self._handshake_slots = threading.BoundedSemaphore(MAX_HANDSHAKES)

    def start(self) -> None:
        listener = socket.create_server((self.options.host, self.options.port), backlog=16)
        listener.settimeout(0.25)
        self._listener = listener
        self.port = listener.getsockname()[1]

    def release(self) -> None:
        """The pair ended: the next worker may claim the leader."""
        with self._claim_lock:
            self._claimed = False

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()

    def accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stopping.is_set():
                    log.warning("accepting on the worker port failed: %s", exc)
                    time.sleep(0.1)
                continue
            if not self._handshake_slots.acquire(blocking=False):
                log.warning("worker port: refused %s:%d: %d connections are in their "
                            "bring-up already, the limit (a pair needs two)", addr[0], addr[1],
                            MAX_HANDSHAKES)
                sock.close()
                continue
            threading.Thread(target=self._greet, args=(sock, addr), name="tp-handshake",
                             daemon=True).start()

    def _greet(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        o = self.options
        try:
            sock.settimeout(o.handshake_timeout_s)
            if o.tls is not None:
                secured = self._tls_handshake(sock, peer)
                if secured is None:
                    return
                sock = secured
            first = recv_exact(sock, 1)
            frame_deadline = time.monotonic() + o.frame_deadline_s
            head = first + recv_exact(sock, 3, frame_deadline, o.frame_deadline_s)
            if head == b"DTPH":
                self._control_handshake(sock, head)
            elif head == b"DTP4":
                self._gate_connection(sock, head, peer, frame_deadline)
            else:
                log.warning("connection from %s is not a TP worker (first bytes %s); closed",
                            peer, head.hex())
                sock.close()
        except (OSError, LinkError, TpProtocolError) as exc:
            log.warning("bring-up with %s failed: %s", peer, exc)
            self.metrics.failures.labels("handshake").inc()
            sock.close()
        finally:
            self._handshake_slots.release()

    def _tls_handshake(self, sock: socket.socket, peer: str) -> ssl.SSLSocket | None:
        """The TLS handshake of a new connection; None (logged, closed) if it fails."""
        assert self.options.tls is not None
        try:
            return tls_mod.wrap_blocking(self.options.tls, sock, server_side=True,
                                         timeout_s=self.options.handshake_timeout_s)
        except (OSError, TimeoutError) as exc:
            if tls_mod.closed_early(exc):
                log.debug("worker port: %s closed the connection in the TLS handshake", peer)
            else:
                log.warning("worker port: refused %s in the TLS handshake: %s", peer,
                            tls_mod.refusal_reason(exc))
                self.metrics.failures.labels("handshake").inc()
            return None

    def _gate_connection(
        self, sock: socket.socket, head: bytes, peer: str, frame_deadline: float
    ) -> None:
        decoder = TpDecoder()
        decoder.feed(head + recv_exact(sock, 28, frame_deadline, self.options.frame_deadline_s))
        frame = decoder.next_event()
        waiter = self._gate_waiters.get(frame.seq) if isinstance(frame, CommandAck) else None
        if waiter is None:
            log.warning("connection from %s opened a gate link with no pairing token of a "
                        "worker in bring-up; closed", peer)
            sock.close()
            return
        waiter.put(sock)

    def _control_handshake(self, sock: socket.socket, head: bytes) -> None:
        o = self.options
        link = ControlLink(sock, timeout_s=o.handshake_timeout_s, expect_hello=True,
                           initial=head, frame_deadline_s=o.frame_deadline_s)
        link.deadline = time.monotonic() + 2 * o.handshake_timeout_s
        slab: ShmGateExchange | None = None
        if o.shm:
            try:
                slab = ShmGateExchange.create(n_embd=self.identity.n_embd, rank=0,
                                              timeout_s=o.gate_timeout_s)
            except OSError as exc:
                log.warning("no shared-memory slab (%s); gates go over TCP", exc)
        hello = Hello(role=Role.LEADER, identity=self.identity, host_id=local_host_id(),
                      shm_offered=slab is not None, shm_name=slab.name if slab else "",
                      execution_mode=self.execution_mode, architecture=self.architecture)
        gate: GateExchange | None = None
        claimed = formed = False
        token = secrets.randbits(64) or 1
        try:
            try:
                peer = exchange_hellos(link, hello, logits_rows(o.max_sessions))
            except (IdentityMismatch, VersionMismatch) as exc:
                log.error("worker %s refused: %s", link.peer, exc)
                self.metrics.failures.labels("identity").inc()
                return
            transport = negotiate_gate_transport(hello, peer)
            with self._claim_lock:
                claimed = not self._claimed
                self._claimed = True
            if not claimed:
                log.warning("worker %s refused: a worker is already connected", link.peer)
                self.metrics.failures.labels("busy").inc()
                link.send(CommandAck(status=ACK_BUSY))
                return
            waiter: queue.Queue[socket.socket] = queue.Queue()
            self._gate_waiters[token] = waiter
            link.send(CommandAck(status=ACK_ACCEPTED, seq=token))
            if transport is GateTransport.SHM:
                gate, slab = slab, None
            else:
                try:
                    gsock = waiter.get(timeout=o.handshake_timeout_s)
                except queue.Empty:
                    raise LinkError(f"worker {link.peer} opened no gate connection within "
                                    f"{o.handshake_timeout_s:g} s") from None
                gate = TcpGateExchange(gsock, rank=0, n_embd=self.identity.n_embd,
                                       timeout_s=o.gate_timeout_s)
            ack = link.expect(FrameType.COMMAND_ACK, "the worker's data plane")
            assert isinstance(ack, CommandAck)
            if ack.status != ACK_ACCEPTED:
                why = ("it could not map the shared-memory slab and dials again over TCP"
                       if ack.status == ACK_SHM_FAILED else f"status {ack.status}")
                raise LinkError(f"worker {link.peer} could not set up its gates: {why}")
            link.deadline = None
            link.set_timeout(o.control_timeout_s)
            assert gate is not None
            self._on_pair(Pair(link, gate, transport))
            formed = True
        finally:
            left = self._gate_waiters.pop(token, None)
            while left is not None and not left.empty():
                left.get_nowait().close()
            if slab is not None:
                slab.close()
            if not formed:
                if claimed:
                    with self._claim_lock:
                        self._claimed = False
                if gate is not None:
                    gate.close()
                link.close()


def recv_exact(
    sock: socket.socket, n: int, deadline: float | None = None, deadline_s: float = 0.0
) -> bytes:
    """``n`` bytes; with ``deadline`` (a time.monotonic(), ``deadline_s`` after the frame's
    first byte) all of them by then (LinkError)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0

    def late() -> LinkError:
        return LinkError(f"the peer began a frame and did not finish it within {deadline_s:g} s "
                         f"(frame deadline); {got} of {n} more bytes came; closed")

    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise late()
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            if deadline is None:
                raise
            raise late() from None
        if k == 0:
            raise LinkError(f"the peer closed after {got} of the first {n} bytes")
        got += k
    return bytes(buf)
