"""The asyncio FDTC link: ``transport.stream.AsyncStream`` over an ``FdtcConnection``.

The connection (``foundry.wire.fdtc_connection``) does all the parsing and owns the link's
lifecycle (which message may pass when); the driver (``transport.stream``) does all the
waiting, with the frame deadline. The bytes read go straight into the connection, whose
decoder is the link's one frame buffer. Built with a ``role`` (the services), every message
received has passed the role's table and every message sent is checked against it; without
one (tests that speak raw frames) the stream decodes and encodes without a lifecycle.

``send`` waits for the write buffer to drain before it returns, so at most one frame per peer
waits in memory; tensor data is written as the views it came in, never joined into a frame
first. A send on a link that is over (closed, or its peer broke the protocol: only the ERROR
that answers it may still go) raises StreamClosed, a ConnectionError, like a send on a closed
socket; a send that the link's state does not allow is our bug (LocalProtocolError).
"""

from __future__ import annotations

import asyncio
import contextlib

from foundry.transport.stream import (
    LINK_DEAD_AFTER_S,
    READ_CHUNK,
    AsyncStream,
    FrameTimeout,
    StreamClosed,
    coalesce,
)
from foundry.wire.errors import FdtcProtocolError, ProtocolError
from foundry.wire.fdtc import (
    MAX_PATH,
    MAX_PAYLOAD,
    Error,
    ErrorCode,
    FdtcDecoder,
    Message,
    MsgType,
    encode_parts,
)
from foundry.wire.fdtc_connection import ConnectionClosed, FdtcConnection
from foundry.wire.fdtc_lifecycle import Link, LinkState, Role
from foundry.wire.framing import ReceiveBudget

__all__ = ["DEFAULT_FRAME_DEADLINE_S", "FdtcStream", "FrameTimeout", "StreamClosed"]

# A frame once begun must be complete within this time by default: at 1 MB/s (a Pi on a busy
# Wi-Fi) a 64 MB weights message needs about a minute.
DEFAULT_FRAME_DEADLINE_S = 120.0


class FdtcStream(AsyncStream[Message | ConnectionClosed]):
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        role: Role | None = None,
        link: Link | None = None,
        max_payload: int = MAX_PAYLOAD,
        frame_deadline_s: float = DEFAULT_FRAME_DEADLINE_S,
        dead_after_s: float = LINK_DEAD_AFTER_S,
        budget: ReceiveBudget | None = None,
    ) -> None:
        self.connection = (
            None
            if role is None
            else FdtcConnection(role, link=link, max_payload=max_payload, budget=budget)
        )
        decoder = (
            FdtcDecoder(max_payload, budget=budget) if self.connection is None else self.connection
        )
        super().__init__(
            reader, writer, decoder, frame_deadline_s=frame_deadline_s, dead_after_s=dead_after_s
        )

    @classmethod
    async def connect(
        cls, host: str, port: int, *, ssl: object = None, timeout_s: float = 5.0, **kw: object
    ) -> FdtcStream:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl, limit=READ_CHUNK)
        return cls(reader, writer, **kw)  # type: ignore[arg-type]

    async def recv(self, idle_timeout_s: float | None = None) -> Message:
        """The next message (see ``AsyncStream.recv``); on a stream with a role, one the
        link's state allows, or the connection's FdtcProtocolError."""
        event = await super().recv(idle_timeout_s)
        if isinstance(event, ConnectionClosed):  # the driver sees the end of stream first
            raise StreamClosed(f"{self.peer} closed the connection")
        return event

    def may_send(self, msg_type: MsgType) -> bool:
        """Whether a message of ``msg_type`` may go on this link now."""
        conn = self.connection
        return not self.writer.is_closing() and (conn is None or conn.may_send(msg_type))

    async def send(self, *messages: Message) -> int:
        """Encode and write the messages (all encoded, and checked against the lifecycle,
        before any is written), then wait until the kernel took them (FrameTimeout after
        ``frame_deadline_s``; the connection is then aborted)."""
        conn = self.connection
        if conn is None:
            pieces = [part for msg in messages for part in encode_parts(msg)]
        else:
            answer = (
                conn.their_error is not None
                and conn.state is not LinkState.CLOSED
                and all(m.TYPE is MsgType.ERROR for m in messages)
            )
            if conn.over and not answer:
                raise StreamClosed(
                    f"the link to {self.peer} is over: {conn.their_error or 'closed'}"
                )
            pieces = conn.send(*messages)
        return await self.send_pieces(coalesce(pieces))

    async def answer(self, exc: ProtocolError, timeout_s: float = 1.0) -> None:
        """Best effort, before closing: the ERROR that answers ``exc``, with the code the
        connection or the codec gave it (NOT_REGISTERED or UNEXPECTED for a message out of
        order, MODEL_MISMATCH for sizes that do not fit), BAD_FRAME for anything else."""
        code = exc.error_code if isinstance(exc, FdtcProtocolError) else ErrorCode.BAD_FRAME
        text = str(exc).encode("utf-8")[: MAX_PATH - 1].decode("utf-8", errors="ignore")
        with contextlib.suppress(
            ConnectionError, OSError, RuntimeError, TimeoutError, ProtocolError
        ):
            async with asyncio.timeout(timeout_s):
                await self.send(Error(int(code), text))

    async def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
        await super().close()
