"""The full-duplex TCP data plane of a pair, plain or over TLS (:class:`TcpGateExchange`).
"""

from __future__ import annotations

import errno
import select
import socket
import ssl
import time
from collections.abc import Callable

import numpy as np

from foundry.transport.gates.base import (
    _F32,
    DEFAULT_GATE_TIMEOUT_S,
    TCP_SPIN_S,
    TLS_SEND_CHUNK,
    GateError,
    GateExchange,
    _describe,
    _tail,
)
from foundry.wire.tp import (
    GATE_HEADER_SIZE,
)


class TcpGateExchange(GateExchange):
    """The full-duplex TCP data plane over a connected socket, which this object then owns.

    Per gate, header (20 bytes) + partial go out while the peer's come in, one poll loop
    driving both directions. Works over any connected stream socket (TCP_NODELAY is set where
    it applies), a TLS socket included.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        rank: int,
        n_embd: int,
        timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
        first_seq: int = 1,
    ) -> None:
        super().__init__(rank=rank, n_embd=n_embd, timeout_s=timeout_s, first_seq=first_seq)
        self._sock = sock
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # A gate is one small write; Nagle would hold it back waiting for an ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._poller = select.poll()
        self._tls = sock if isinstance(sock, ssl.SSLSocket) else None
        self._tls_wants_write = False  # TLS must write (a handshake message) before it reads
        self._tag_in = bytearray(GATE_HEADER_SIZE)
        self._peer = np.empty(0, dtype=_F32)  # grows to the largest gate seen, then reused

    def _swap(self, tag: bytes, mine: np.ndarray) -> np.ndarray:
        rows = mine.shape[0]
        if self._peer.size < mine.size:
            self._peer = np.empty(mine.size, dtype=_F32)
        peer = self._peer[: mine.size].reshape(rows, self.n_embd)
        out = (memoryview(tag), mine.data.cast("B"))
        into = (memoryview(self._tag_in), peer.data.cast("B"))
        total = GATE_HEADER_SIZE + mine.nbytes
        sent = got = 0
        last_progress = time.monotonic()
        while sent < total or got < total:
            progress = False
            if sent < total:
                n = self._io(self._send, _tail(out, sent), tag, sent, got, total)
                sent += n
                progress = n > 0
            if got < total:
                n = self._io(self._recv, _tail(into, got), tag, sent, got, total)
                if got < GATE_HEADER_SIZE <= got + n and self._tag_in != tag:
                    raise self._desync(tag, bytes(self._tag_in))
                got += n
                progress = progress or n > 0
            now = time.monotonic()
            if progress:
                last_progress = now
            elif now - last_progress > TCP_SPIN_S and (sent < total or got < total):
                self._wait(last_progress, tag, sent, got, total)
        return peer

    def _send(self, views: list[memoryview]) -> int:
        if self._tls is None:
            return self._sock.sendmsg(views)
        try:
            return self._tls.send(views[0][:TLS_SEND_CHUNK])
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            raise BlockingIOError from None

    def _recv(self, views: list[memoryview]) -> int:
        if self._tls is None:
            n = self._sock.recvmsg_into(views)[0]
        else:
            try:
                n = self._tls.recv_into(views[0])
            except ssl.SSLWantReadError:
                raise BlockingIOError from None
            except ssl.SSLWantWriteError:
                self._tls_wants_write = True
                raise BlockingIOError from None
            self._tls_wants_write = False
        if n == 0:
            raise EOFError
        return n

    def _io(
        self,
        op: Callable[[list[memoryview]], int],
        views: list[memoryview],
        tag: bytes,
        sent: int,
        got: int,
        total: int,
    ) -> int:
        try:
            return op(views)
        except BlockingIOError:
            return 0
        except EOFError:
            raise GateError(
                f"peer closed the gate connection during {_describe(tag)} "
                f"(received {got} of {total} bytes)"
            ) from None
        except OSError as exc:
            raise GateError(
                f"gate connection failed during {_describe(tag)}: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}"
            ) from None

    def _wait(self, last_progress: float, tag: bytes, sent: int, got: int, total: int) -> None:
        left = last_progress + self.timeout_s - time.monotonic()
        if left <= 0:
            raise GateError(
                f"peer stalled: no progress for {self.timeout_s:g} s during {_describe(tag)} "
                f"(sent {sent} of {total} bytes, received {got} of {total})"
            )
        if self._tls is not None and self._tls.pending():
            return  # decrypted bytes wait inside TLS, not on the socket: read them first
        out = sent < total or self._tls_wants_write
        events = (select.POLLOUT if out else 0) | (select.POLLIN if got < total else 0)
        self._poller.register(self._sock, events)
        try:
            self._poller.poll(max(1, int(left * 1000) + 1))
        finally:
            self._poller.unregister(self._sock)

    def _release(self) -> None:
        self._sock.close()
