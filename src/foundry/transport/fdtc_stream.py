"""The asyncio driver of the FDTC codec: bytes from a stream in, messages out, and back.

The codec (``foundry.wire.fdtc``) does all the parsing; this module only moves bytes and
enforces time: once a frame has begun, the rest of it must arrive within ``frame_deadline_s``
(a slow sender cannot pin a socket and a buffer forever), and an idle peer may be given up on
with ``idle_timeout_s``. The same deadline bounds a send: a peer that does not take a frame's
bytes within it is cut off, so a reader that stopped reading cannot make us buffer without
end (``send`` waits for the write buffer to drain before it returns, so at most one frame per
peer waits in memory).

Every wait is bounded with ``asyncio.timeout``, never ``asyncio.wait_for``: on Python 3.11
``wait_for`` drops a cancellation that arrives in the same loop iteration as the awaited
result, and a worker whose task is cancelled by SIGTERM would then go on training.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from foundry.wire.fdtc import FdtcDecoder, Message, encode_parts

log = logging.getLogger(__name__)

# Bytes asked of the socket per read: large enough that a 1 MB weights message is a handful
# of reads, small enough not to over-allocate per connection.
READ_CHUNK = 256 * 1024
# A frame once begun must be complete within this time by default: at 1 MB/s (a Pi on a busy
# Wi-Fi) a 64 MB weights message needs about a minute.
DEFAULT_FRAME_DEADLINE_S = 120.0
# Frame pieces this large (tensor data) are written as the views they are, not copied into a
# joined frame first; smaller ones are joined, so a small message is one write, one segment.
JOIN_BELOW = 64 * 1024


class StreamClosed(ConnectionError):
    """The peer closed the connection (cleanly, or half-way through a frame)."""


class FrameTimeout(TimeoutError):
    """A frame begun by the peer was not completed within the frame deadline."""


class FdtcStream:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_payload: int | None = None,
        frame_deadline_s: float = DEFAULT_FRAME_DEADLINE_S,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FdtcDecoder() if max_payload is None else FdtcDecoder(max_payload)
        self.frame_deadline_s = frame_deadline_s
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.bytes_in = 0
        self.bytes_out = 0

    @classmethod
    async def connect(
        cls, host: str, port: int, *, ssl: object = None, timeout_s: float = 5.0, **kw: object
    ) -> FdtcStream:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl, limit=READ_CHUNK)
        return cls(reader, writer, **kw)  # type: ignore[arg-type]

    async def recv(self, idle_timeout_s: float | None = None) -> Message:
        """The next whole message. Raises StreamClosed, FrameTimeout, TimeoutError (idle), or
        the codec's protocol error for bad bytes."""
        loop = asyncio.get_running_loop()
        frame_started: float | None = None
        while True:
            msg = self.decoder.next_event()
            if msg is not None:
                return msg
            partial = self.decoder.buffered > 0
            if partial and frame_started is None:
                frame_started = loop.time()
            if partial:
                assert frame_started is not None
                timeout: float | None = self.frame_deadline_s - (loop.time() - frame_started)
                if timeout is not None and timeout <= 0:
                    raise FrameTimeout(
                        f"{self.peer} began a frame and did not finish it within "
                        f"{self.frame_deadline_s:g} s (frame deadline)"
                    )
            else:
                timeout = idle_timeout_s
            try:
                async with asyncio.timeout(timeout):
                    data = await self.reader.read(READ_CHUNK)
            except TimeoutError:
                if partial:
                    raise FrameTimeout(
                        f"{self.peer} began a frame and did not finish it within "
                        f"{self.frame_deadline_s:g} s (frame deadline)"
                    ) from None
                raise
            if not data:
                if partial:
                    raise StreamClosed(f"{self.peer} closed the connection in mid-frame")
                raise StreamClosed(f"{self.peer} closed the connection")
            self.bytes_in += len(data)
            self.decoder.feed(data)

    async def send(self, *messages: Message) -> int:
        """Encode and write the messages, then wait until the kernel took them (FrameTimeout
        after ``frame_deadline_s``; the connection is then aborted)."""
        pieces = list(_pieces(messages))  # all encoded before any is written
        for piece in pieces:
            self.writer.write(piece)
        n = sum(len(piece) for piece in pieces)
        self.bytes_out += n
        try:
            async with asyncio.timeout(self.frame_deadline_s):
                await self.writer.drain()
        except TimeoutError:
            # Part of a frame may be on the wire: the connection cannot be used any more.
            self.writer.transport.abort()
            raise FrameTimeout(
                f"{self.peer} did not take a frame of {n} bytes within "
                f"{self.frame_deadline_s:g} s (it reads too slowly or not at all)"
            ) from None
        return n

    async def close(self) -> None:
        if self.writer.is_closing():
            return
        self.writer.close()
        # Not CancelledError: a stop that arrives while closing must reach the caller.
        with contextlib.suppress(ConnectionError, OSError, TimeoutError):
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)


def _pieces(messages: tuple[Message, ...]) -> Iterator[bytes | memoryview]:
    """The frames of ``messages`` as pieces to write in order: runs of small pieces joined,
    large ones (tensor data) as given, uncopied."""
    small: list[bytes | memoryview] = []
    for msg in messages:
        for part in encode_parts(msg):
            if len(part) < JOIN_BELOW:
                small.append(part)
                continue
            if small:
                yield b"".join(small)
                small = []
            yield part
    if small:
        yield b"".join(small)
