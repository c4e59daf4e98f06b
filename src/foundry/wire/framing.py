"""The one frame buffer every wire codec decodes with: a fixed header, then a payload it sizes.

Theory of operation
-------------------
Every link here frames the same way: a header of known size (FDTC 9 bytes, TP control 28, the
TP hello's 8-byte prefix, frontend 13) that names the payload's length. ``FrameDecoder`` owns
the buffering and the error discipline; a codec subclasses it with three hooks:

- ``_header_size()``: how many bytes the next header has (it may change with the state, as
  the TP hello comes before the frames);
- ``_begin(header)``: check the header (magic, type, the length limit, the type's size rule)
  and return the payload's length. It runs the moment the header's last byte arrives, so no
  payload byte of a bad frame is ever kept;
- ``_finish(payload)``: build the event from that payload, or None when the frame is one
  part of a larger event (FDTC's FRAGMENT) that a later frame completes.

``feed`` parses eagerly and queues complete events; ``next_event`` hands them out (``None``:
more bytes are needed). Each payload is received into a buffer of its own, sized once by the
header and written exactly once, so decoding is linear in the input and an event may keep a
view of its payload (tensor data, a LOGITS half) without a copy. ``buffered`` is the partial
frame held, never more than the header plus the limit the codec enforces.

Errors keep stream order: events completed before bad bytes come out first, then
``next_event`` raises the codec's RemoteProtocolError, and keeps raising; ``feed`` raises too.
The decoder is closed for good (after a framing error the frame boundaries are lost).
``feed_eof`` says the peer closed the stream: an error if it stopped in the middle of a frame.

Memory: a payload of ``MAPPED_PAYLOAD`` bytes or more is received into an anonymous memory map
of its own (pages committed only as the peer's bytes fill them, and given back to the system
the moment the buffer is dropped, whatever the allocator's thresholds). A decoder may share a
``ReceiveBudget`` with the other connections of a service: each such buffer takes its size
from it before a byte is kept (the codec's "busy" error when the budget is spent) and gives
it back when the frame is complete or the decoder ``release``s it (its peer went away).
"""

from __future__ import annotations

import copy
import mmap
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

import numpy as np

from foundry.wire.errors import RemoteProtocolError

__all__ = ["MAPPED_PAYLOAD", "NO_PAYLOAD", "FrameDecoder", "ReceiveBudget", "payload_buffer"]

E = TypeVar("E")

# Payloads this large get an uninitialised numpy buffer (pages committed only as the peer's
# bytes fill them, so a header announcing 256 MiB costs no memory until the bytes come);
# smaller ones a bytearray, cheaper to make for the many small frames of a busy link.
_LARGE_PAYLOAD = 64 * 1024
NO_PAYLOAD = memoryview(b"")


# Payloads this large get a memory map of their own, unmapped when dropped (see the module
# docstring): a peer that leaves in the middle of one gives all of it back.
MAPPED_PAYLOAD = 1 << 20


def payload_buffer(length: int) -> memoryview:
    """A writable buffer of ``length`` bytes to receive a payload into (FDTC also joins a
    fragmented message in one)."""
    if length >= MAPPED_PAYLOAD:
        return memoryview(mmap.mmap(-1, length))
    if length >= _LARGE_PAYLOAD:
        return np.empty(length, dtype=np.uint8).data
    return memoryview(bytearray(length))


class ReceiveBudget:
    """Bytes that the decoders sharing it may hold at once in buffers of ``MAPPED_PAYLOAD``
    bytes or more (frames being received, messages being reassembled): a service's bound on
    what its peers can make it buffer, across all their connections."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"a receive budget must be >= 0 bytes, got {limit}")
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        """Reserve ``n`` bytes; False (and nothing reserved) when they are not left."""
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class FrameDecoder(ABC, Generic[E]):
    """Bytes in (``feed``), events out (``next_event``); see the module docstring."""

    def __init__(self, budget: ReceiveBudget | None = None) -> None:
        self.budget = budget
        self._taken = 0  # bytes of the budget held for the frame's payload buffer
        self._head = bytearray()
        self._in_payload = False
        self._length = 0
        self._payload = NO_PAYLOAD  # the frame's payload buffer, its first _filled bytes in
        self._filled = 0
        self._ready: deque[E] = deque()
        self._error: RemoteProtocolError | None = None
        self._reported = False  # next_event raised _error once already

    # -- the codec's hooks

    @abstractmethod
    def _header_size(self) -> int: ...

    @abstractmethod
    def _begin(self, header: bytes) -> int:
        """Check a whole header; the payload length it announces."""

    @abstractmethod
    def _finish(self, payload: memoryview) -> E | None:
        """The event of the frame whose header ``_begin`` just accepted (None: no event
        yet)."""

    # -- the interface every decoder shares

    @property
    def buffered(self) -> int:
        """Bytes of a frame begun and not yet complete, header included (0 between frames)."""
        if not self._in_payload:
            return len(self._head)
        return len(self._head) + self._filled

    def queued(self) -> tuple[E, ...]:
        """The events complete and not yet handed out, in stream order."""
        return tuple(self._ready)

    @property
    def closed(self) -> bool:
        """True after bad input: nothing more will be decoded."""
        return self._error is not None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise self._again()
        view = memoryview(data).cast("B")
        pos, end = 0, len(view)
        try:
            while pos < end:
                if not self._in_payload:
                    take = min(self._header_size() - len(self._head), end - pos)
                    self._head += view[pos : pos + take]
                    pos += take
                    if len(self._head) == self._header_size():
                        self._length = self._begin(bytes(self._head))
                        self._taken = self.reserve(self._length, "a frame")
                        self._in_payload = True
                        self._payload, self._filled = payload_buffer(self._length), 0
                else:
                    take = min(self._length - self._filled, end - pos)
                    self._payload[self._filled : self._filled + take] = view[pos : pos + take]
                    self._filled += take
                    pos += take
                if self._in_payload and self._filled == self._length:
                    self._complete()
        except RemoteProtocolError as exc:
            self._error = exc
            self.release()

    def room(self) -> memoryview | None:
        """The part of the payload now arriving that is not filled yet, for a reader to
        receive straight into (then ``filled``): a large payload is written once, where it
        stays, instead of in chunks copied from the reader's buffers. None between payloads
        or after bad input."""
        if self._error is not None or not self._in_payload:
            return None
        return self._payload[self._filled : self._length]

    def filled(self, n: int) -> None:
        """``n`` bytes were received into ``room()``."""
        if not self._in_payload or not 0 <= n <= self._length - self._filled:
            raise ValueError(f"filled({n}): the payload has {self._length - self._filled} left")
        self._filled += n
        if self._filled == self._length:
            try:
                self._complete()
            except RemoteProtocolError as exc:
                self._error = exc
                self.release()

    def _complete(self) -> None:
        payload = self._payload.toreadonly()
        self._head, self._in_payload = bytearray(), False
        self._payload, self._filled = NO_PAYLOAD, 0
        self.unreserve(self._taken)
        self._taken = 0
        if (event := self._finish(payload)) is not None:
            self._ready.append(event)

    def reserve(self, n: int, what: str) -> int:
        """Take ``n`` bytes of the budget for a buffer about to be made (0 when the buffer
        is small or there is no budget); the codec's busy error when they are not left."""
        if self.budget is None or n < MAPPED_PAYLOAD:
            return 0
        if not self.budget.take(n):
            raise self._busy_error(
                f"{what} of {n} bytes does not fit: {self.budget.held} of the "
                f"{self.budget.limit} bytes this side receives into at once are in use by "
                "other peers; try again later"
            )
        return n

    def unreserve(self, n: int) -> None:
        if n and self.budget is not None:
            self.budget.give(n)

    def release(self) -> None:
        """Drop the partial frame held and give its memory back: for a connection that ended
        (its peer went away, or broke the protocol)."""
        self._head, self._in_payload = bytearray(), False
        self._payload, self._filled = NO_PAYLOAD, 0
        self.unreserve(self._taken)
        self._taken = 0

    def feed_eof(self) -> None:
        """The peer closed the stream; an error if it did so in the middle of a frame."""
        if self._error is not None:
            raise self._again()
        if (begun := self.unfinished()) is not None:
            self._error = self._eof_error(f"connection closed in the middle of {begun}")
            self._reported = True
            raise self._error

    def unfinished(self) -> str | None:
        """What was begun and not finished (a frame), None between events."""
        if self.buffered:
            return f"a frame ({self.buffered} bytes of it received)"
        return None

    def next_event(self) -> E | None:
        """The next complete event, None if more bytes are needed; raises the codec's
        protocol error (every time) once the events before bad input are consumed."""
        if self._ready:
            return self._ready.popleft()
        if self._error is not None:
            if self._reported:
                raise self._again()
            self._reported = True
            raise self._error
        return None

    def events(self) -> Iterator[E]:
        """Every complete event buffered now."""
        while (event := self.next_event()) is not None:
            yield event

    @abstractmethod
    def _eof_error(self, message: str) -> RemoteProtocolError:
        """The codec's protocol error for ``message``."""

    def _busy_error(self, message: str) -> RemoteProtocolError:
        """The codec's error for a buffer the budget cannot hold."""
        return self._eof_error(message)

    def _again(self) -> RemoteProtocolError:
        """The first error again, said to be old news (same type, same error code)."""
        assert self._error is not None
        again = copy.copy(self._error)
        again.args = (f"decoder already failed and is closed: {self._error}",)
        return again
