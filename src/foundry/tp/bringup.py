"""The leader's worker port: accept, TLS, the first bytes, the hello, pairing.

Mirrored by the worker's connect (``tp.worker``). The acceptor thread takes connections on
``--listen``; each is brought up on a short-lived handshake thread (at most ``MAX_HANDSHAKES``
at once): the TLS handshake when the leader has a TLS context, then the first four bytes say
what the connection is. ``DTPH`` opens a control connection: the hellos (``tp.handshake``),
the claim of a rank (one worker a rank: another asking for a held rank, or when all are held,
is told BUSY), a pairing token, and the gate transport (the shared-memory slab, or a second TCP
connection that presents the token, ``DTP4``). A formed ``Pair`` (the pair, or a world of N
ranks: one control link per worker) is handed to ``on_pair``; ``release`` frees the claims when
the engine ends it. The first bytes are read exactly (``recv_exact``), never more: a gate
connection's socket is handed over to the gate exchange with nothing of its stream consumed.

Shares still to be chosen (``--shares auto`` or ``ranks``): the leader's hello says so; a
worker answering with its weight (speed or ``--share``) is told its rank (:data:`ACK_NOTED`),
closed, and dials again asking for it. With the last weight the leader chooses the shares
(``tp.calibrate.choose_shares``), logs what and why, and states them from then on, for good.

A world of N > 2 ranks: each worker brought up this far waits as a :class:`Member` until every
rank has one; the handshake thread of the last sends each worker the WORLD frame (every
worker's gate port and token), waits for each one's ACK (its gate connections to the other
workers are up) and hands the world to ``on_pair`` with the leader's world gate
(``transport.gates.MeshGateExchange``). A member whose worker hung up while waiting gives its
rank back when another worker asks for it.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import secrets
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from foundry.model.shard.shares import norm_shares
from foundry.model.spec.config import ModelConfig
from foundry.obs.metrics import TpMetrics
from foundry.tp.calibrate import choose_shares, rank_speed
from foundry.tp.handshake import (
    ACK_ACCEPTED,
    ACK_BUSY,
    ACK_NOTED,
    ACK_SHM_FAILED,
    LOAD_TIMEOUT_S,
    exchange_hellos,
    largest_worker_block,
    world_info,
)
from foundry.tp.link import ControlLink, LinkError, recv_exact
from foundry.tp.pair import Member, Pair
from foundry.transport import tls as tls_mod
from foundry.transport.gates import (
    GateExchange,
    MeshGateExchange,
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
    RankWeight,
    Role,
    SharesFrom,
    TpDecoder,
    TpProtocolError,
    VersionMismatch,
    World,
    WorldInfo,
    WorldMismatch,
    WorldPeer,
    logits_rows,
    negotiate_gate_transport,
)

if TYPE_CHECKING:
    from foundry.tp.options import LeaderOptions

log = logging.getLogger("foundry.tp.leader")

# Connections in the middle of their first bytes / hello at once; more are closed at once.
MAX_HANDSHAKES = 4


def _host_bytes(host: str) -> bytes:
    """The 16 bytes of the WORLD frame's host field: IPv6, an IPv4 address mapped."""
    addr = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv4Address):
        addr = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + addr.packed)
    return addr.packed


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
        cfg: ModelConfig | None = None,
        blocks: Mapping[str, int] | None = None,
    ) -> None:
        """``blocks``: each stored tensor's block size (chosen shares cut on whole blocks)."""
        self.options = options
        self.identity = identity
        self.execution_mode = execution_mode
        self.architecture = architecture
        self.metrics = metrics
        self._stopping = stopping
        self._on_pair = on_pair
        self.port = 0
        self.world = options.world_size
        self.cfg = cfg
        self.blocks = dict(blocks or {})
        # The world's shares: equal until chosen when they are still to be (``pending``).
        self.shares = norm_shares(self.world, options.shares)
        self.pending = options.shares_from is not SharesFrom.LIST
        if self.pending and cfg is None:
            raise ValueError("choosing the shares at pairing needs the model's config")
        self._weights: dict[int, RankWeight] = {}  # while pending: each worker's, by rank
        self._choosing = False
        self.choice: str | None = None  # what was chosen and why, once chosen
        # The largest vocabulary block a worker returns (the LOGITS bound); the pair's half
        # when the model is not known here.
        self.vocab_block = None if cfg is None else largest_worker_block(cfg, self.shares)
        self._listener: socket.socket | None = None
        self._claim_lock = threading.Lock()
        self._held: set[int] = set()  # ranks claimed by a worker in bring-up or in the world
        self._members: dict[int, Member] = {}  # N > 2: workers waiting for the others
        self._formed: set[int] = set()  # the ranks of the pair or world being served
        self._gate_waiters: dict[int, queue.Queue[socket.socket]] = {}
        self._handshake_slots = threading.BoundedSemaphore(MAX_HANDSHAKES)

    def start(self) -> None:
        listener = socket.create_server((self.options.host, self.options.port), backlog=16)
        listener.settimeout(0.25)
        self._listener = listener
        self.port = listener.getsockname()[1]

    def release(self) -> None:
        """The pair (or world) ended: its ranks may be claimed again."""
        with self._claim_lock:
            self._held -= self._formed
            self._formed = set()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        with self._claim_lock:
            members, self._members = list(self._members.values()), {}
        for m in members:
            m.close()

    def _claim(self, asked: int) -> int:
        """The rank a worker asking for ``asked`` (0: any) gets, or 0 when it is held (or every
        rank is). A waiting member whose worker hung up gives its rank back first."""
        with self._claim_lock:
            for rank, m in list(self._members.items()):
                if not m.alive():
                    log.warning(
                        "rank %d hung up while waiting for the world; its rank is free", rank
                    )
                    del self._members[rank]
                    self._held.discard(rank)
                    m.close()
            free = [r for r in range(1, self.world) if r not in self._held]
            rank = asked if asked in free else 0 if asked else (free[0] if free else 0)
            if rank:
                self._held.add(rank)
            return rank

    def _unclaim(self, rank: int) -> None:
        with self._claim_lock:
            self._held.discard(rank)

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
                log.warning(
                    "worker port: refused %s:%d: %d connections are in their "
                    "bring-up already, the limit (a pair needs two)",
                    addr[0],
                    addr[1],
                    MAX_HANDSHAKES,
                )
                sock.close()
                continue
            threading.Thread(
                target=self._greet, args=(sock, addr), name="tp-handshake", daemon=True
            ).start()

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
                log.warning(
                    "connection from %s is not a TP worker (first bytes %s); closed",
                    peer,
                    head.hex(),
                )
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
            return tls_mod.wrap_blocking(
                self.options.tls, sock, server_side=True, timeout_s=self.options.handshake_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            if tls_mod.closed_early(exc):
                log.debug("worker port: %s closed the connection in the TLS handshake", peer)
            else:
                log.warning(
                    "worker port: refused %s in the TLS handshake: %s",
                    peer,
                    tls_mod.refusal_reason(exc),
                )
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
            log.warning(
                "connection from %s opened a gate link with no pairing token of a "
                "worker in bring-up; closed",
                peer,
            )
            sock.close()
            return
        waiter.put(sock)

    def _control_handshake(self, sock: socket.socket, head: bytes) -> None:
        o = self.options
        link = ControlLink(
            sock,
            timeout_s=o.handshake_timeout_s,
            expect_hello=True,
            initial=head,
            frame_deadline_s=o.frame_deadline_s,
        )
        link.deadline = time.monotonic() + 2 * o.handshake_timeout_s
        with self._claim_lock:
            world = (
                WorldInfo(world_size=self.world, shares=(), shares_from=self.options.shares_from)
                if self.pending
                else world_info(self.world, self.shares)
            )
        slab: ShmGateExchange | None = None
        if o.shm and self.world == 2:  # the slab is the pair's
            try:
                slab = ShmGateExchange.create(
                    n_embd=self.identity.n_embd, rank=0, timeout_s=o.gate_timeout_s
                )
            except OSError as exc:
                log.warning("no shared-memory slab (%s); gates go over TCP", exc)
        hello = Hello(
            role=Role.LEADER,
            identity=self.identity,
            host_id=local_host_id(),
            shm_offered=slab is not None,
            shm_name=slab.name if slab else "",
            execution_mode=self.execution_mode,
            architecture=self.architecture,
            world=world,
        )
        gate: GateExchange | None = None
        gsock: socket.socket | None = None
        rank = 0
        formed = False
        token = secrets.randbits(64) or 1
        try:
            try:
                peer = exchange_hellos(link, hello, logits_rows(o.max_sessions), self.vocab_block)
            except WorldMismatch as exc:
                log.info(
                    "worker %s learns the world from the hello and dials again (%s)", link.peer, exc
                )
                return
            except (IdentityMismatch, VersionMismatch) as exc:
                log.error("worker %s refused: %s", link.peer, exc)
                self.metrics.failures.labels("identity").inc()
                return
            if world is not None and world.pending:
                self._note(link, peer)
                return
            transport = negotiate_gate_transport(hello, peer)
            asked = peer.world.rank if peer.world is not None else 1
            rank = self._claim(asked)
            if not rank:
                held = f"rank {asked} is held" if asked else f"all {self.world - 1} are held"
                log.warning("worker %s refused: %s", link.peer, held)
                self.metrics.failures.labels("busy").inc()
                link.send(CommandAck(status=ACK_BUSY))
                return
            waiter: queue.Queue[socket.socket] = queue.Queue()
            self._gate_waiters[token] = waiter
            link.send(
                CommandAck(status=ACK_ACCEPTED, seq=token, session_id=0 if world is None else rank)
            )
            # The worker loads its slices now (unless it holds them from before), then opens
            # its gate link.
            wait_s = LOAD_TIMEOUT_S
            link.deadline = time.monotonic() + wait_s + o.handshake_timeout_s
            if transport is GateTransport.SHM:
                gate, slab = slab, None
            else:
                gsock = self._await_gate(link, waiter, wait_s)
                if self.world == 2:
                    gate, gsock = (
                        TcpGateExchange(
                            gsock, rank=0, n_embd=self.identity.n_embd, timeout_s=o.gate_timeout_s
                        ),
                        None,
                    )
            ack = link.expect(FrameType.COMMAND_ACK, "the worker's data plane")
            assert isinstance(ack, CommandAck)
            if ack.status != ACK_ACCEPTED:
                why = (
                    "it could not map the shared-memory slab and dials again over TCP"
                    if ack.status == ACK_SHM_FAILED
                    else f"status {ack.status}"
                )
                raise LinkError(f"worker {link.peer} could not set up its gates: {why}")
            link.deadline = None
            if self.world == 2:
                link.set_timeout(o.control_timeout_s)
                assert gate is not None
                with self._claim_lock:
                    self._formed = {rank}
                self._on_pair(Pair([link], gate, transport, self.shares, (peer.threads or 0,)))
            else:
                assert gsock is not None and peer.world is not None
                member = Member(
                    rank,
                    link,
                    gsock,
                    _host_bytes(link.sock.getpeername()[0]),
                    peer.world.gate_port,
                    peer.threads or 0,
                )
                gsock = None
                self._join(member)
            formed = True
        finally:
            left = self._gate_waiters.pop(token, None)
            while left is not None and not left.empty():
                left.get_nowait().close()
            if slab is not None:
                slab.close()
            if not formed:
                if rank:
                    self._unclaim(rank)
                if gate is not None:
                    gate.close()
                if gsock is not None:
                    gsock.close()
                link.close()

    def _note(self, link: ControlLink, peer: Hello) -> None:
        """While the shares are still to be chosen: keep the worker's weight under a rank (the
        one it asks for, else the first without one), tell it the rank (ACK_NOTED) and let it
        dial again; with the last weight, choose the shares."""
        if peer.weight is None or peer.world is None:
            raise TpProtocolError("the worker's hello states no weight for the shares to be chosen")
        asked = peer.world.rank
        with self._claim_lock:
            free = [r for r in range(1, self.world) if r not in self._weights]
            rank = asked if asked else (free[0] if free else 0)
            fresh = bool(rank) and self._weights.get(rank) != peer.weight
            if rank and self.pending:
                self._weights[rank] = peer.weight
            stated = len(self._weights)
            complete = self.pending and stated == self.world - 1 and not self._choosing
            self._choosing |= complete  # one thread chooses
        if not rank:
            link.send(CommandAck(status=ACK_BUSY))
            return
        link.send(CommandAck(status=ACK_NOTED, session_id=rank))
        if fresh:  # once a weight, not at every dial of a worker waiting for the others
            log.info(
                "worker %s is rank %d: share %s, speed %s (%d of %d workers stated)",
                link.peer,
                rank,
                peer.weight.share or "-",
                peer.weight.speed or "-",
                stated,
                self.world - 1,
            )
        if complete:
            self._choose()

    def _choose(self) -> None:
        """Every worker has stated its weight: choose the shares (measuring this rank's speed
        when they follow the speeds), log what was chosen and why, and state them from now
        on."""
        o = self.options
        assert self.cfg is not None
        with self._claim_lock:
            weights = [self._weights[r] for r in range(1, self.world)]
        if o.shares_from is SharesFrom.SPEED:
            mine = rank_speed(o.speed)
            shares, why = choose_shares(
                self.cfg,
                o.expert_split,
                blocks=self.blocks,
                speeds=[mine, *(max(1, w.speed) for w in weights)],
            )
        else:
            shares, why = choose_shares(
                self.cfg,
                o.expert_split,
                blocks=self.blocks,
                stated=[o.share or 1, *(w.share or 1 for w in weights)],
            )
        with self._claim_lock:
            self.shares = shares
            self.vocab_block = largest_worker_block(self.cfg, shares)
            self.choice = why
            self.pending = False
        log.info("the world of %d ranks: %s", self.world, why)

    @staticmethod
    def _await_gate(
        link: ControlLink, waiter: queue.Queue[socket.socket], wait_s: float
    ) -> socket.socket:
        """The worker's gate connection, once it has loaded its slices: up to ``wait_s``, but
        a worker that hangs up meanwhile (its load failed) is given up at once."""
        deadline = time.monotonic() + wait_s
        poller = select.poll()
        poller.register(link.sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        while True:
            try:
                return waiter.get(timeout=min(0.25, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                pass
            if poller.poll(0):
                raise LinkError(
                    f"worker {link.peer} hung up before opening its gate connection (see its log)"
                )
            if time.monotonic() >= deadline:
                raise LinkError(f"worker {link.peer} opened no gate connection within {wait_s:g} s")

    def _join(self, member: Member) -> None:
        """A world's worker is up to its gate link: wait for the others, or, the last one,
        form the world."""
        with self._claim_lock:
            self._members[member.rank] = member
            if len(self._members) < self.world - 1:
                log.info(
                    "rank %d of %d is in (%d of %d workers)",
                    member.rank,
                    self.world,
                    len(self._members),
                    self.world - 1,
                )
                return
            members, self._members = [self._members[r] for r in sorted(self._members)], {}
        self._form_world(members)

    def _form_world(self, members: list[Member]) -> None:
        """Send every worker the WORLD table, wait for each one's gate connections to the
        others, and hand the world on; any failure closes every member (they dial again)."""
        o = self.options
        peers = tuple(WorldPeer(m.rank, m.gate_port, m.host, secrets.randbits(64)) for m in members)
        gate: MeshGateExchange | None = None
        try:
            frame = World(peers=peers)
            for m in members:
                m.link.deadline = time.monotonic() + 2 * o.handshake_timeout_s
                m.link.send(frame)
            for m in members:
                ack = m.link.expect(FrameType.COMMAND_ACK, "the worker's gates to the others")
                assert isinstance(ack, CommandAck)
                if ack.status != ACK_ACCEPTED:
                    raise LinkError(
                        f"rank {m.rank} could not connect its gates to the other "
                        f"workers (status {ack.status})"
                    )
            gate = MeshGateExchange(
                {m.rank: m.gate_sock for m in members},
                rank=0,
                world=self.world,
                n_embd=self.identity.n_embd,
                timeout_s=o.gate_timeout_s,
            )
            for m in members:
                m.link.deadline = None
                m.link.set_timeout(o.control_timeout_s)
            with self._claim_lock:
                self._formed = {m.rank for m in members}
            self._on_pair(
                Pair(
                    [m.link for m in members],
                    gate,
                    GateTransport.TCP,
                    self.shares,
                    [m.threads for m in members],
                )
            )
        except (OSError, LinkError, TpProtocolError) as exc:
            log.warning(
                "forming the world of %d ranks failed: %s; every worker dials again",
                self.world,
                exc,
            )
            self.metrics.failures.labels("handshake").inc()
            if gate is not None:
                gate.close()
            for m in members:
                m.close()
            with self._claim_lock:
                self._held.difference_update(m.rank for m in members)
