"""The asyncio FDTC link: ``transport.stream.AsyncStream`` over the FDTC decoder.

The codec (``foundry.wire.fdtc``) does all the parsing and the driver (``transport.stream``)
all the waiting, with the frame deadline: this module only says which codec. ``send`` waits
for the write buffer to drain before it returns, so at most one frame per peer waits in
memory; tensor data is written as the views it came in, never joined into a frame first.
"""

from __future__ import annotations

import asyncio

from foundry.transport.stream import (
    READ_CHUNK,
    AsyncStream,
    FrameTimeout,
    StreamClosed,
    coalesce,
)
from foundry.wire.fdtc import FdtcDecoder, Message, encode_parts

__all__ = ["DEFAULT_FRAME_DEADLINE_S", "FdtcStream", "FrameTimeout", "StreamClosed"]

# A frame once begun must be complete within this time by default: at 1 MB/s (a Pi on a busy
# Wi-Fi) a 64 MB weights message needs about a minute.
DEFAULT_FRAME_DEADLINE_S = 120.0


class FdtcStream(AsyncStream[Message]):
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_payload: int | None = None,
        frame_deadline_s: float = DEFAULT_FRAME_DEADLINE_S,
    ) -> None:
        decoder = FdtcDecoder() if max_payload is None else FdtcDecoder(max_payload)
        super().__init__(reader, writer, decoder, frame_deadline_s=frame_deadline_s)

    @classmethod
    async def connect(
        cls, host: str, port: int, *, ssl: object = None, timeout_s: float = 5.0, **kw: object
    ) -> FdtcStream:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl, limit=READ_CHUNK)
        return cls(reader, writer, **kw)  # type: ignore[arg-type]

    async def send(self, *messages: Message) -> int:
        """Encode and write the messages (all encoded before any is written), then wait until
        the kernel took them (FrameTimeout after ``frame_deadline_s``; the connection is then
        aborted)."""
        pieces = coalesce(part for msg in messages for part in encode_parts(msg))
        return await self.send_pieces(pieces)
