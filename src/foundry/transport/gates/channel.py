"""One connected gate socket, plain TCP or TLS, as the TCP exchanges' poll loops drive it
(:class:`GateChannel`, :func:`poll_channels`): the pair's :class:`TcpGateExchange` has one, a
world's :class:`MeshGateExchange` one per other rank.

On plain sockets the exchanges hand the whole gate to ``native`` (``_gates.c``: the same bytes
and checks, the loop in C with the GIL released) where that module was built; over TLS, or
without it, the loops here and in ``tcp`` and ``mesh`` move them.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import ssl
from collections.abc import Sequence
from types import ModuleType

from foundry.transport.gates.base import TLS_SEND_CHUNK, GateError, _describe

native: ModuleType | None
try:
    from foundry.transport.gates import _gates as native  # type: ignore[attr-defined, no-redef]
except ImportError:  # built without a C compiler (setup.py): the Python loops
    native = None

# What a native move ended with (``_gates.c``).
GATE_OK, GATE_CLOSED, GATE_FAILED, GATE_DESYNC, GATE_STALLED = range(5)


class GateChannel:
    """A connected stream socket, which this object then owns, made non-blocking (and
    TCP_NODELAY where it applies: a gate is one small write, Nagle would hold it back waiting
    for an ACK).

    ``send`` and ``recv`` move what they can now and return the byte count, 0 when the socket
    would block; a closed or failed connection is a GateError naming ``peer`` ("peer", "rank
    2") and the gate. A plain socket moves header and partial in one scatter/gather call; an
    ``ssl.SSLSocket`` has no such calls, so over TLS they go one buffer at a time (sends at
    most ``TLS_SEND_CHUNK``, so that a retry after "would block" offers the same bytes). The
    bytes inside TLS are the same.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._tls = sock if isinstance(sock, ssl.SSLSocket) else None
        self._tls_wants_write = False  # TLS must write (a handshake message) before it reads

    def send(self, views: list[memoryview], tag: bytes) -> int:
        try:
            if self._tls is None:
                return self.sock.sendmsg(views)
            return self._tls.send(views[0][:TLS_SEND_CHUNK])
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return 0
        except OSError as exc:
            raise self._failed(exc, tag) from None

    def recv(self, views: list[memoryview], tag: bytes, got: int, total: int) -> int:
        """Into ``views``; ``got`` of ``total`` bytes of this gate are in (for the message)."""
        try:
            if self._tls is None:
                n = self.sock.recvmsg_into(views)[0]
            else:
                n = self._tls.recv_into(views[0])
                self._tls_wants_write = False
        except (BlockingIOError, ssl.SSLWantReadError):
            return 0
        except ssl.SSLWantWriteError:
            self._tls_wants_write = True
            return 0
        except OSError as exc:
            raise self._failed(exc, tag) from None
        if n == 0:
            raise self.closed(tag, got, total)
        return n

    @property
    def native_fd(self) -> int | None:
        """The descriptor ``native`` drives: a plain socket's where the module was built, else
        None (the Python loops)."""
        return self.sock.fileno() if self._tls is None and native is not None else None

    def closed(self, tag: bytes, got: int, total: int) -> GateError:
        """The peer closed the connection after ``got`` of the gate's ``total`` bytes in."""
        return GateError(
            f"{self.peer} closed the gate connection during {_describe(tag)} "
            f"(received {got} of {total} bytes)"
        )

    def failed(self, code: int, tag: bytes) -> GateError:
        """The socket failed with errno ``code`` (a native move's)."""
        return self._failed(OSError(code, os.strerror(code)), tag)

    def buffered(self) -> bool:
        """Decrypted bytes wait inside TLS, not on the socket, where poll() cannot see them."""
        return self._tls is not None and self._tls.pending() > 0

    def events(self, sending: bool, receiving: bool) -> int:
        """What to poll for while this gate still sends and/or receives on it."""
        out = sending or (receiving and self._tls_wants_write)
        return (select.POLLOUT if out else 0) | (select.POLLIN if receiving else 0)

    def close(self) -> None:
        self.sock.close()

    def _failed(self, exc: OSError, tag: bytes) -> GateError:
        if isinstance(exc, ssl.SSLError):  # its errno is OpenSSL's, not the kernel's
            why = f"TLS {exc.reason or type(exc).__name__}: {exc}"
        else:
            why = f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}"
        return GateError(f"gate connection to {self.peer} failed during {_describe(tag)}: {why}")


def poll_channels(
    poller: select.poll, wants: Sequence[tuple[GateChannel, bool, bool]], left_s: float
) -> None:
    """Sleep until one of ``wants`` (channel, still sending, still receiving) can move, or
    ``left_s`` pass; at once when TLS already holds bytes for a channel that receives."""
    if any(receiving and ch.buffered() for ch, _, receiving in wants):
        return
    registered = []
    try:
        for ch, sending, receiving in wants:
            events = ch.events(sending, receiving)
            if events:
                poller.register(ch.sock, events)
                registered.append(ch.sock)
        poller.poll(max(1, int(left_s * 1000) + 1))
    finally:
        for sock in registered:
            poller.unregister(sock)
