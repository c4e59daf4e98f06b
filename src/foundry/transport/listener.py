"""An asyncio listener of a native link: the connection limit and TLS, before any protocol.

Every accepted connection passes two gates before the link's handler sees a byte:

1. **the connection limit**: with ``max_connections`` open already, the new one is closed at
   once (a flood of connections cannot exhaust file descriptors or memory);
2. **TLS** when the listener has a context: the handshake (with the client certificate check
   of mutual TLS) must complete within ``tls.HANDSHAKE_TIMEOUT_S``. A plaintext peer, a
   missing or foreign certificate, or a stalled handshake ends the connection there.

Each refusal is one warning in the service's log naming the link, the peer and the reason;
the listener keeps serving everyone else. The handshake is run by the handler task
(``StreamWriter.start_tls``) rather than by ``start_server(ssl=...)`` because asyncio reports
a failed server-side handshake nowhere outside its debug mode.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable

from foundry.transport import tls as tls_mod

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Listener:
    """Accepts connections for ``handler`` under a limit and, with ``tls``, TLS."""

    def __init__(
        self,
        link: str,
        handler: Handler,
        *,
        log: logging.Logger,
        max_connections: int,
        limit_flag: str = "--max-connections",
        tls: ssl.SSLContext | None = None,
        handshake_timeout_s: float = tls_mod.HANDSHAKE_TIMEOUT_S,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.link = link
        self.handler = handler
        self.log = log
        self.max_connections = max_connections
        self.limit_flag = limit_flag
        self.tls = tls
        self.handshake_timeout_s = handshake_timeout_s
        self.open_connections = 0
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> asyncio.Server:
        self.server = await asyncio.start_server(self._accept, host, port)
        return self.server

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        if self.tls is not None and isinstance(transport, asyncio.ReadTransport):
            # Before anything can yield to the loop: the peer's first bytes (its ClientHello)
            # must reach TLS, not the plaintext reader.
            transport.pause_reading()
        name = writer.get_extra_info("peername")
        peer = f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name)
        if self.open_connections >= self.max_connections:
            self.log.warning(
                "%s: refused %s: the link has its limit of %d open connections (%s)",
                self.link,
                peer,
                self.max_connections,
                self.limit_flag,
            )
            writer.transport.abort()
            return
        self.open_connections += 1
        try:
            if self.tls is not None and not await self._handshake(writer, peer):
                return
            await self.handler(reader, writer)
        except asyncio.CancelledError:
            # The service is stopping and its loop cancels every connection's task. Ending
            # quietly is the point: Python 3.11's stream callback would log the cancellation
            # of this task as an ERROR with a traceback at every clean stop.
            writer.transport.abort()
        finally:
            self.open_connections -= 1

    async def _handshake(self, writer: asyncio.StreamWriter, peer: str) -> bool:
        assert self.tls is not None
        try:
            # Awaited directly, not through wait_for (a new task would start it one loop turn
            # late); the handshake timeout bounds it.
            await writer.start_tls(self.tls, ssl_handshake_timeout=self.handshake_timeout_s)
        except (OSError, TimeoutError) as exc:
            writer.transport.abort()
            if tls_mod.closed_early(exc):
                self.log.debug("%s: %s closed the connection in the TLS handshake", self.link, peer)
                return False
            self.log.warning(
                "%s: refused %s in the TLS handshake: %s",
                self.link,
                peer,
                tls_mod.refusal_reason(exc),
            )
            return False
        return True
