"""Connection limits of the HTTP door, as a uvicorn protocol class.

uvicorn (0.3x-0.5x) bounds the time an idle keep-alive connection is kept, but not the time a
client may take to send a request's headers: a client that opens connections and sends a
header byte now and then (slowloris) keeps each open for good, and the process runs out of
descriptors. ``limited_h11`` makes uvicorn's h11 protocol:

- close a connection whose request headers are not complete within ``header_timeout_s`` of
  its opening, or of the end of the previous response on it (keep-alive);
- answer 503 and close a connection beyond ``max_connections`` open at once (uvicorn's own
  ``limit_concurrency`` counts them too, but only refuses once a request was read).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # uvicorn is imported when a server is made, not with the commands
    from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["DEFAULT_HEADER_TIMEOUT_S", "DEFAULT_MAX_CONNECTIONS", "limited_h11"]

log = logging.getLogger("foundry.gateway")

# Seconds a client has to send a request's headers: a person's client sends them at once; a
# phone on a bad link within a few seconds.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# HTTP connections open at once: streams of every active and waiting generation, with room
# to spare, well under a process's usual 1024-descriptor limit with the gRPC side beside it.
DEFAULT_MAX_CONNECTIONS = 512

_REFUSED_BODY = (
    b'{"error": {"message": "too many connections to this server; retry later", '
    b'"type": "overloaded"}}'
)
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\nretry-after: 1\r\ncontent-length: "
    + str(len(_REFUSED_BODY)).encode()
    + b"\r\n\r\n"
    + _REFUSED_BODY
)


def limited_h11(
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these limits (pass it as ``uvicorn.Config(http=...)``)."""
    if header_timeout_s <= 0 or max_connections < 1:
        raise ValueError(
            f"HTTP limits must be positive, got a header timeout of "
            f"{header_timeout_s} s and {max_connections} connections"
        )
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class LimitedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            if len(self.connections) > max_connections:
                log.warning(
                    "HTTP: refusing a connection from %s: %d open, the limit is %d",
                    self.client,
                    len(self.connections) - 1,
                    max_connections,
                )
                self.transport.write(_REFUSED)
                self.transport.close()
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a request's headers are in
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # the next request on this connection, if any

        def _arm_header_timer(self) -> None:
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.close()

    return LimitedH11Protocol
