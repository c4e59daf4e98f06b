"""The framed-stream driver every link uses: bytes from a socket into a decoder, events out.

The codecs (``foundry.wire``) do all the parsing behind one interface (``feed``,
``next_event``, ``feed_eof``, ``buffered``: ``foundry.wire.framing``); this module only moves
bytes and enforces time, once, for every link:

- ``AsyncStream``, over an asyncio stream pair: the swarm's worker and admin links (through
  ``FdtcStream``), the TP leader's frontend server and the gateway's frontend client;
- ``BlockingStream``, over a blocking socket: the TP control link on both ranks and the
  blocking FDTC admin client of ``foundry up``.

The **frame deadline**: once a frame has begun, the rest of it must arrive within
``frame_deadline_s``, so a slow or malicious sender cannot pin a socket and a buffer forever
(``FrameTimeout``); a message in FRAGMENT frames held half-way is a frame begun too, each
fragment due within the deadline of the one before. Closing a stream releases what its decoder
holds. Between frames a reader may wait without limit, or up to an idle timeout
it names. A send is bounded by the same deadline: a peer that takes no bytes for that long is
cut off, so a reader that stopped reading cannot make us buffer without end.

A peer whose **host vanished** without a FIN or RST (power cut, cable pulled, a NAT that forgot
the flow) answers nothing, and TCP alone notices only after about 15 minutes of
retransmissions. Every asyncio TCP link is therefore watched by the kernel
(``watch_liveness``): keepalive probes on an idle link, and ``TCP_USER_TIMEOUT`` on sent bytes
left unacknowledged, so such a link fails within ``dead_after_s`` (``LINK_DEAD_AFTER_S``).
Whatever the socket's error (a reset, ETIMEDOUT, EHOSTUNREACH once the route is gone), a
failed asyncio link raises a ``ConnectionError``: ``StreamClosed`` for a peer that closed,
``LinkError`` for the rest, so every handler has one thing to catch.

Every asyncio wait is bounded with ``asyncio.timeout``, never ``asyncio.wait_for``: on Python
3.11 ``wait_for`` drops a cancellation that arrives in the same loop iteration as the awaited
result, and a worker whose task is cancelled by SIGTERM would then go on training.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import ssl
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

from foundry.wire.framing import FrameDecoder

__all__ = [
    "JOIN_BELOW",
    "LINK_DEAD_AFTER_S",
    "READ_CHUNK",
    "AsyncStream",
    "BlockingStream",
    "Decoder",
    "FrameTimeout",
    "LinkError",
    "StreamClosed",
    "coalesce",
    "peer_name",
    "watch_liveness",
]

E = TypeVar("E")
E_co = TypeVar("E_co", covariant=True)

# Bytes asked of the socket per read: large enough that a 1 MB weights message is a handful
# of reads, small enough not to over-allocate per connection.
READ_CHUNK = 256 * 1024
# Frame pieces this large (tensor data, a LOGITS half) are written as the views they are, not
# copied into a joined frame first; smaller ones are joined, so a small frame is one write.
JOIN_BELOW = 64 * 1024
# Seconds an asyncio TCP link may go without a sign of its peer's host before it fails
# (``watch_liveness``); a peer that is alive answers the kernel's probes even when idle.
LINK_DEAD_AFTER_S = 30.0
# Unanswered keepalive probes after which the kernel gives an idle link up.
KEEPALIVE_PROBES = 3
# ioctl of the bytes a TCP socket's send queue has not sent yet (Linux's TIOCOUTQ).
_SIOCOUTQ: int | None = 0x5411 if sys.platform.startswith("linux") else None


class Decoder(Protocol[E_co]):
    """What a driver needs of a codec (every ``foundry.wire`` decoder is one)."""

    @property
    def buffered(self) -> int: ...

    def release(self) -> None: ...

    def feed(self, data: bytes | bytearray | memoryview) -> None: ...

    def feed_eof(self) -> None: ...

    def next_event(self) -> E_co | None: ...


class StreamClosed(ConnectionError):
    """The peer closed the connection (cleanly, or half-way through a frame)."""


class FrameTimeout(TimeoutError):
    """A frame begun by the peer was not completed within the frame deadline (or the peer did
    not take a frame of ours within it)."""


class LinkError(ConnectionError):
    """A link failed: the peer closed it (a blocking link), went silent past the deadline,
    or the socket broke (its host unreachable, the kernel's watch timed out). The link is
    unusable afterwards."""


def peer_name(address: object) -> str:
    """``host:port`` of a socket address (a path or ``?`` for anything else)."""
    if isinstance(address, tuple):
        return f"{address[0]}:{address[1]}"
    return str(address or "?")


def coalesce(pieces: Iterable[bytes | memoryview]) -> list[bytes | memoryview]:
    """``pieces`` to write in order: runs of small pieces joined, large ones as given."""
    out: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    for piece in pieces:
        if len(piece) < JOIN_BELOW:
            small.append(piece)
            continue
        if small:
            out.append(small[0] if len(small) == 1 else b"".join(small))
            small = []
        out.append(piece)
    if small:
        out.append(small[0] if len(small) == 1 else b"".join(small))
    return out


def watch_liveness(sock: socket.socket, dead_after_s: float) -> None:
    """Have the kernel fail this TCP link within about ``dead_after_s`` of its peer's host
    going silent: keepalive probes after half of it idle (``KEEPALIVE_PROBES`` of them in the
    other half), and ``TCP_USER_TIMEOUT`` for bytes sent and never acknowledged. A platform
    without these options (not Linux) keeps TCP's defaults."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    idle = max(1, int(dead_after_s / 2))
    interval = max(1, int((dead_after_s - idle) / KEEPALIVE_PROBES))
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(dead_after_s * 1000))


def _late(peer: str, deadline_s: float) -> str:
    return f"{peer} began a frame and did not finish it within {deadline_s:g} s (frame deadline)"


class AsyncStream(Generic[E]):
    """One asyncio connection: ``recv`` the next event, ``send_pieces`` of frames, ``close``."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        decoder: Decoder[E],
        *,
        frame_deadline_s: float,
        read_chunk: int = READ_CHUNK,
        dead_after_s: float = LINK_DEAD_AFTER_S,
    ) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            watch_liveness(sock, dead_after_s)
        self.reader = reader
        self.writer = writer
        self.decoder = decoder
        self.frame_deadline_s = frame_deadline_s
        self.read_chunk = read_chunk
        self.peer = peer_name(writer.get_extra_info("peername"))
        self.bytes_in = 0
        self.bytes_out = 0
        # time.monotonic() of the last bytes received: a peer in the middle of a large frame
        # (a gradient on a slow link) is alive although no whole message arrived for a while.
        self.last_rx = time.monotonic()

    async def recv(self, idle_timeout_s: float | None = None) -> E:
        """The next whole event. Raises StreamClosed, FrameTimeout, TimeoutError (idle past
        ``idle_timeout_s``), or the codec's protocol error for bad bytes."""
        loop = asyncio.get_running_loop()
        frame_started: float | None = None
        held_then = 0
        while True:
            event = self.decoder.next_event()
            if event is not None:
                return event
            # A message in fragments (FDTC) held: its next fragment is due as a frame begun.
            held = getattr(self.decoder, "reassembling", 0)
            partial = self.decoder.buffered > 0 or held > 0
            timeout = idle_timeout_s
            if not partial:
                frame_started = None  # between frames
            else:
                if frame_started is None or held != held_then:  # each frame its own deadline
                    frame_started, held_then = loop.time(), held
                timeout = self.frame_deadline_s - (loop.time() - frame_started)
                if timeout <= 0:
                    raise FrameTimeout(_late(self.peer, self.frame_deadline_s))
            try:
                async with asyncio.timeout(timeout):
                    with self._link_errors():
                        data = await self.reader.read(self.read_chunk)
            except TimeoutError:
                if partial:
                    raise FrameTimeout(_late(self.peer, self.frame_deadline_s)) from None
                raise
            if not data:
                if partial:
                    raise StreamClosed(f"{self.peer} closed the connection in mid-frame")
                raise StreamClosed(f"{self.peer} closed the connection")
            self.bytes_in += len(data)
            self.last_rx = time.monotonic()
            self.decoder.feed(data)

    def write_pieces(self, pieces: Iterable[bytes | memoryview]) -> int:
        """Queue pieces for writing without waiting (a write that must happen even while the
        caller is being cancelled); ``drain`` bounds the wait for them."""
        if self.writer.is_closing():
            raise StreamClosed(f"the connection to {self.peer} is closed")
        n = 0
        try:
            for piece in pieces:
                self.writer.write(piece)
                n += len(piece)
        except AttributeError:
            # asyncio's transport, closed under the write by the peer's reset, reports the
            # send's error through a loop it no longer has (CPython 3.12).
            raise StreamClosed(f"the connection to {self.peer} was reset") from None
        self.bytes_out += n
        return n

    async def send_pieces(self, pieces: Sequence[bytes | memoryview]) -> int:
        """Write the pieces, then wait until the kernel took them (FrameTimeout after
        ``frame_deadline_s``; the connection is then aborted)."""
        n = self.write_pieces(pieces)
        await self.drain(n)
        return n

    def unsent(self) -> int:
        """Bytes written but not yet on the wire: what asyncio still holds, plus (on Linux)
        what the kernel's send queue has not sent (``SIOCOUTQ``)."""
        n = self.writer.transport.get_write_buffer_size()
        sock = self.writer.get_extra_info("socket")
        if sock is not None and _SIOCOUTQ is not None:
            with contextlib.suppress(OSError, ValueError):
                n += struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0" * 4))[0]
        return n

    async def drain(self, n: int = 0) -> None:
        """Wait until the kernel took what was written. FrameTimeout (the connection is then
        aborted) once the peer took none of it for ``frame_deadline_s``: a large message on a
        slow link may take longer in all, as long as its bytes keep moving."""
        loop = asyncio.get_running_loop()
        left, since = self.unsent(), loop.time()
        poll = min(1.0, self.frame_deadline_s / 4)
        while True:
            try:
                async with asyncio.timeout(poll):
                    with self._link_errors():
                        await self.writer.drain()
                return
            except TimeoutError:
                unsent, now = self.unsent(), loop.time()
                if unsent < left:
                    left, since = unsent, now
                elif now - since >= self.frame_deadline_s:
                    # Part of a frame may be on the wire: the connection cannot be used any more.
                    self.writer.transport.abort()
                    raise FrameTimeout(
                        f"{self.peer} did not take a frame's bytes for "
                        f"{self.frame_deadline_s:g} s ({unsent} of {n} bytes unsent; it reads "
                        "too slowly or not at all)"
                    ) from None

    @contextlib.contextmanager
    def _link_errors(self) -> Iterator[None]:
        """Around one wait on the socket, inside its ``asyncio.timeout`` (whose own expiry
        never passes through here): an error of the socket that is not already a
        ConnectionError (the kernel's ETIMEDOUT, EHOSTUNREACH) as LinkError; TLS's errors as
        they are."""
        try:
            yield
        except (ConnectionError, ssl.SSLError):
            raise
        except OSError as exc:
            raise LinkError(f"the link to {self.peer} failed: {exc}") from None

    async def close(self) -> None:
        self.decoder.release()  # a partial frame's memory goes back now, not when collected
        if self.writer.is_closing():
            return
        self.writer.close()
        # Not CancelledError: a stop that arrives while closing must reach the caller.
        with contextlib.suppress(ConnectionError, OSError, TimeoutError):
            async with asyncio.timeout(1.0):
                await self.writer.wait_closed()


class BlockingStream(Generic[E]):
    """One blocking socket with deadlines (owns the socket).

    Every wait is bounded: a peer that moves no byte for ``timeout_s`` raises LinkError, so a
    stalled or dead peer never hangs us, and a frame once begun must be complete within
    ``frame_deadline_s``. ``recv(idle=...)`` is the one unbounded wait between frames; it wakes
    every ``timeout_s`` to ask ``idle`` whether to keep waiting. ``deadline`` (an absolute
    ``time.monotonic()``, None for none) bounds every ``recv`` as a whole, so a peer dripping
    bytes cannot hold a bring-up open. The socket may be a TLS socket.
    """

    def __init__(
        self,
        sock: socket.socket,
        decoder: Decoder[E],
        *,
        timeout_s: float,
        frame_deadline_s: float,
        name: str,
        initial: bytes = b"",
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if frame_deadline_s <= 0:
            raise ValueError(f"frame_deadline_s must be positive, got {frame_deadline_s}")
        self.sock = sock
        self.decoder = decoder
        self.name = name
        self.timeout_s = timeout_s
        self.frame_deadline_s = frame_deadline_s
        self.deadline: float | None = None
        self.bytes_sent = 0
        self.bytes_received = len(initial)
        if initial:
            decoder.feed(initial)
        self._sock_timeout = timeout_s
        sock.settimeout(timeout_s)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Requests are small writes that the peer waits for; never hold them back.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            address: object = sock.getpeername()
        except OSError:
            address = None
        self.peer = peer_name(address)

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._settimeout(timeout_s)

    def _settimeout(self, timeout_s: float) -> None:
        # Only on a change: each call is a system call, and recv runs per frame.
        if timeout_s != self._sock_timeout:
            self.sock.settimeout(timeout_s)
            self._sock_timeout = timeout_s

    def send_pieces(self, pieces: Sequence[bytes | memoryview]) -> int:
        """Write the pieces in order (large ones as the views they are, uncopied)."""
        self._settimeout(self.timeout_s)
        n = sum(len(p) for p in pieces)
        try:
            for piece in coalesce(pieces):
                self.sock.sendall(piece)
        except TimeoutError:
            raise LinkError(
                f"{self.name} to {self.peer}: the peer took no bytes for {self.timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise LinkError(f"{self.name} to {self.peer} failed: {exc}") from None
        self.bytes_sent += n
        return n

    def recv(self, waiting_for: str = "a frame", idle: Callable[[], bool] | None = None) -> E:
        """The next event. Without ``idle``, LinkError after ``timeout_s`` of silence; with it,
        silence is fine as long as ``idle()`` returns True (False: LinkError, "stopped")."""
        begun: float | None = None  # when the frame now arriving began
        while True:
            event = self.decoder.next_event()
            if event is not None:
                return event
            timeout = self.timeout_s
            now = time.monotonic()
            if not self.decoder.buffered:
                begun = None  # between frames
            else:
                begun = now if begun is None else begun
                left = begun + self.frame_deadline_s - now
                if left <= 0:
                    raise self._frame_late(waiting_for)
                timeout = min(timeout, left)
            if self.deadline is not None:
                left = self.deadline - now
                if left <= 0:
                    raise LinkError(
                        f"{self.name} to {self.peer}: {waiting_for} did not arrive in time"
                    )
                timeout = min(timeout, left)
            self._settimeout(timeout)
            try:
                got = self._recv_into_payload()
                if got:
                    continue
                data = self.sock.recv(READ_CHUNK) if got is None else b""
            except TimeoutError:
                if begun is not None and time.monotonic() - begun >= self.frame_deadline_s:
                    raise self._frame_late(waiting_for) from None
                if idle is not None and idle():
                    continue
                if idle is not None:
                    raise LinkError("stopped while waiting for the peer") from None
                raise LinkError(
                    f"{self.name} to {self.peer}: no bytes for {self.timeout_s:g} s while "
                    f"waiting for {waiting_for}; the peer stalled"
                ) from None
            except OSError as exc:
                raise LinkError(f"{self.name} to {self.peer} failed: {exc}") from None
            if not data:
                self.decoder.feed_eof()
                raise LinkError(
                    f"the peer at {self.peer} closed the {self.name} "
                    f"(while waiting for {waiting_for})"
                )
            self.bytes_received += len(data)
            self.decoder.feed(data)

    def _recv_into_payload(self) -> int | None:
        """The next bytes of a large payload received straight into its buffer (the bytes
        received, 0 when the peer closed): a LOGITS block or a tensor is written once, where
        it stays, not read in chunks and copied. None when no such payload is arriving."""
        decoder = self.decoder
        if not isinstance(decoder, FrameDecoder):
            return None
        room = decoder.room()
        if room is None or len(room) < READ_CHUNK:
            return None
        n = self.sock.recv_into(room)
        if n:
            self.bytes_received += n
            decoder.filled(n)
        return n

    def _frame_late(self, waiting_for: str) -> LinkError:
        return LinkError(
            f"{self.name} to {self.peer}: the peer began a frame and did not finish it within "
            f"{self.frame_deadline_s:g} s (frame deadline); closed while waiting for "
            f"{waiting_for}"
        )

    def close(self) -> None:
        self.decoder.release()
        self.sock.close()
