"""A worker's gate links to the other workers of a world of N > 2 ranks: after the hellos it
waits for the leader's WORLD frame, dials every worker below its rank, takes the connections of
every one above on its ``--gate-listen`` socket (each presenting the token the WORLD frame gave
the listening rank), under mutual TLS when the world runs TLS, then tells the leader the gates
are up."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time

from foundry.tp.handshake import ACK_ACCEPTED
from foundry.tp.link import ControlLink, LinkError, recv_exact
from foundry.transport.gates import MeshGateExchange
from foundry.transport.tls import PeerContexts, closed_early, refusal_reason, wrap_blocking
from foundry.wire.tp import (
    FRAME_HEADER_SIZE,
    CommandAck,
    TpDecoder,
    TpProtocolError,
    World,
    encode,
)

log = logging.getLogger("foundry.tp.worker")


def connect_mesh(
    link: ControlLink,
    leader_sock: socket.socket,
    listener: socket.socket,
    *,
    rank: int,
    world: int,
    n_embd: int,
    peer_tls: PeerContexts | None,
    handshake_timeout_s: float,
    gate_timeout_s: float,
    stop: threading.Event,
) -> MeshGateExchange:
    """The gates of a world of N > 2 ranks: wait for the WORLD frame, dial every worker
    below this rank, take the connections of every one above (on ``listener``), then tell the
    leader."""
    frame = link.recv("the WORLD frame", idle=lambda: not stop.is_set())
    if not isinstance(frame, World) or len(frame.peers) != world - 1:
        raise LinkError(f"expected the WORLD frame of {world - 1} workers, got {frame}")
    link.deadline = time.monotonic() + 2 * handshake_timeout_s
    me = frame.peers[rank - 1]
    socks: dict[int, socket.socket] = {0: leader_sock}
    try:
        for peer in frame.peers[: rank - 1]:
            host = str(
                ipaddress.IPv6Address(peer.host).ipv4_mapped or ipaddress.IPv6Address(peer.host)
            )
            raw = socket.create_connection((host, peer.gate_port), handshake_timeout_s)
            try:
                s = _gate_tls(peer_tls, raw, dialed=True, timeout_s=handshake_timeout_s)
            except (OSError, TimeoutError) as exc:
                why = (
                    f"the gate link to rank {peer.rank} at {host}:{peer.gate_port} "
                    f"failed in the TLS handshake: {refusal_reason(exc)}"
                )
                log.warning("%s", why)
                raise LinkError(why) from None
            socks[peer.rank] = s
            s.sendall(encode(CommandAck(session_id=rank, seq=peer.token)))
        deadline = time.monotonic() + 2 * handshake_timeout_s
        while len(socks) < world - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(rank + 1, world)) - set(socks))
                raise LinkError(
                    f"ranks {missing} did not connect their gates within "
                    f"{2 * handshake_timeout_s:g} s"
                )
            if stop.is_set():
                raise LinkError("stopping before the world formed")
            listener.settimeout(min(left, 0.25))
            try:
                raw, addr = listener.accept()
            except TimeoutError:
                continue
            try:
                s = _gate_tls(peer_tls, raw, dialed=False, timeout_s=min(left, handshake_timeout_s))
            except (OSError, TimeoutError) as exc:
                if not closed_early(exc):
                    log.warning(
                        "gate link: refused %s:%d in the TLS handshake: %s",
                        addr[0],
                        addr[1],
                        refusal_reason(exc),
                    )
                continue
            try:
                decoder = TpDecoder()
                decoder.feed(recv_exact(s, FRAME_HEADER_SIZE + 4, deadline, left))
                hi = decoder.next_event()
            except (OSError, LinkError, TpProtocolError) as exc:
                log.warning("a gate connection failed its first frame: %s", exc)
                s.close()
                continue
            if (
                not isinstance(hi, CommandAck)
                or hi.seq != me.token
                or not rank < hi.session_id < world
                or hi.session_id in socks
            ):
                log.warning("a gate connection presented no token of this world; closed")
                s.close()
                continue
            socks[hi.session_id] = s
        gate = MeshGateExchange(
            socks, rank=rank, world=world, n_embd=n_embd, timeout_s=gate_timeout_s
        )
        log.info(
            "rank %d of %d: gates to ranks %s up%s",
            rank,
            world,
            ", ".join(map(str, sorted(socks))),
            " (tls)" if peer_tls else "",
        )
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    link.send(CommandAck(status=ACK_ACCEPTED))
    return gate


def _gate_tls(
    peer_tls: PeerContexts | None, sock: socket.socket, *, dialed: bool, timeout_s: float
) -> socket.socket:
    """``sock``, a gate link to another worker, under mutual TLS when the world runs TLS:
    the client side where this worker dialed, the server side where it accepted. Raises
    what ``wrap_blocking`` raises (``sock`` is closed then)."""
    if peer_tls is None:
        return sock
    return wrap_blocking(
        peer_tls.dial if dialed else peer_tls.accept,
        sock,
        server_side=not dialed,
        timeout_s=timeout_s,
    )
