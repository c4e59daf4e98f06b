"""One FDTC connection, sans-IO (h11-style): the decoder and the lifecycle table behind one object.

::

    conn = FdtcConnection(Role.WORKER)
    sock.sendall(b"".join(conn.send(Dataset(...), Register(...))))
    conn.receive_data(sock.recv(65536))      # b"" when the peer closed
    while (event := conn.next_event()) is not None:
        ...                                  # a Message, or ConnectionClosed (the last event)

``send`` checks each message against the role's table (``foundry.wire.fdtc_lifecycle``),
moves the state, and returns the frame pieces to write in order (tensor data as the views it
came in, uncopied). ``next_event`` hands out each decoded message only after the table admitted
it and moved the state; ``None`` means more bytes are needed. Which message may come when is
therefore the connection's business: a service dispatches on the event's type and never
re-checks the order.

Errors (``foundry.wire.errors``):

- the peer's bad bytes, or a message its state does not allow, raise FdtcProtocolError from
  ``next_event`` (every call from then on), with the ERROR code to answer with. Receiving is
  over; the only thing left to send is that ERROR, then ``close()``;
- a message we may not send here raises LocalProtocolError from ``send``, and the
  connection is closed: our side is out of step with the protocol.

End of stream: ``receive_data(b"")``. Messages before it still come out; then
``ConnectionClosed``, once and on every later call. End of stream in mid-frame is the peer's
error.

The connection is also a decoder in the framing interface (``feed``, ``feed_eof``,
``next_event``, ``buffered``: ``foundry.wire.framing``), so the stream driver
(``foundry.transport.stream``) reads into it as into any codec: one buffer per link, the
connection's. ``may_send`` says whether a message may go now (a broadcast skips a link that
may not take it), ``over`` whether the link is finished for anything but the last ERROR.

Messages larger than one frame (FRAGMENT, ours): ``allow_fragments(max_message,
fragment_size)``, by both sides of a worker link whose peers speak the extensions, makes
``send`` cut a WEIGHTS, GRADIENTS or UPDATE payload over ``fragment_size`` bytes into FRAGMENT
frames, and lets the decoder reassemble the peer's, up to ``max_message`` bytes. A first
fragment is admitted only if the link's table takes its message at that point of the stream
(the coordinator: GRADIENTS once it sent WEIGHTS), so no unregistered peer makes us hold more
than one frame; the whole message then passes the lifecycle like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import (
    FRAGMENT_SIZE,
    MAX_PAYLOAD,
    ErrorCode,
    FdtcDecoder,
    Message,
    MsgType,
    encode_parts,
)
from foundry.wire.fdtc_lifecycle import Lifecycle, Link, LinkState, Role
from foundry.wire.framing import ReceiveBudget

__all__ = ["ConnectionClosed", "FdtcConnection"]


@dataclass(frozen=True)
class ConnectionClosed:
    """The peer ended the stream between two frames."""


class FdtcConnection:
    def __init__(
        self,
        role: Role,
        *,
        link: Link | None = None,
        max_payload: int = MAX_PAYLOAD,
        budget: ReceiveBudget | None = None,
    ) -> None:
        self.role = role
        self._decoder = FdtcDecoder(max_payload, budget=budget)
        self._decoder.admit = self._admit
        self._lifecycle = Lifecycle(role, link=link)
        self._fragment_size: int | None = None  # None: one frame per message (the seed's)
        self._eof = False
        self._error: FdtcProtocolError | None = None  # the peer broke the protocol

    def allow_fragments(self, max_message: int, fragment_size: int = FRAGMENT_SIZE) -> None:
        """Both peers speak the extensions: messages up to ``max_message`` bytes, larger ones
        than ``fragment_size`` sent as FRAGMENT frames (see the module docstring)."""
        self._decoder.max_message = max_message
        self._fragment_size = fragment_size

    def _admit(self, msg_type: MsgType, length: int, fragmented: bool) -> None:
        """A large buffer is about to be made (a frame's header of 1 MiB or more, or a first
        fragment arrived): only for a message this link's state takes at that point of the
        stream (the messages decoded before it counted in), so that no peer makes this side
        hold a large buffer before it may send one (before REGISTER, say)."""
        before = [event.TYPE for event in self._decoder.queued()]
        if not self._lifecycle.may_receive_after(before, msg_type):
            state = self._lifecycle.state
            what = "a fragmented" if fragmented else "a"
            raise FdtcProtocolError(
                f"{what} {msg_type.name} is not allowed on a {state.value} link (refused at "
                f"its header: {length} bytes)",
                ErrorCode.NOT_REGISTERED if state is LinkState.CONNECTED else ErrorCode.UNEXPECTED,
            )

    @property
    def state(self) -> LinkState:
        return self._lifecycle.state

    @property
    def buffered(self) -> int:
        """Bytes of a frame begun and not yet complete (for a driver's frame deadline)."""
        return self._decoder.buffered

    @property
    def reassembling(self) -> int:
        """Bytes held of a fragmented message not complete yet (its next fragment is due
        within the frame deadline too)."""
        return self._decoder.reassembling

    def release(self) -> None:
        """The connection ended: drop what the decoder holds and give its memory back."""
        self._decoder.release()

    @property
    def their_error(self) -> FdtcProtocolError | None:
        return self._error

    @property
    def over(self) -> bool:
        """True once the link is closed or the peer broke the protocol: nothing but that
        ERROR goes out any more."""
        return self._error is not None or self._lifecycle.state is LinkState.CLOSED

    def may_send(self, msg: Message | MsgType) -> bool:
        """Whether ``send`` would take ``msg`` now."""
        return not self.over and self._lifecycle.may_send(msg)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from the peer; ``b""`` when it closed the stream."""
        if self._eof:
            raise LocalProtocolError("receive_data after the end of the stream")
        if not data:
            self._eof = True
            return
        if self._error is None:
            self._decoder.feed(data)  # a framing error is kept there and raised in order

    feed = receive_data

    def feed_eof(self) -> None:
        """The framing interface's name for ``receive_data(b"")``."""
        self.receive_data(b"")

    def next_event(self) -> Message | ConnectionClosed | None:
        if self._error is not None:
            raise FdtcProtocolError(str(self._error), self._error.error_code)
        try:
            msg = self._decoder.next_event()
            if msg is not None:
                self._lifecycle.receive(msg)
                return msg
            if self._eof and self._decoder.buffered:
                raise FdtcProtocolError(
                    f"the peer closed the connection in mid-frame "
                    f"({self._decoder.buffered} bytes of a frame received)"
                )
            if self._eof and (begun := self._decoder.unfinished()) is not None:
                raise FdtcProtocolError(f"the peer closed the connection in the middle of {begun}")
        except FdtcProtocolError as exc:
            self._error = exc
            raise
        if self._eof:
            self._lifecycle.close()
            return ConnectionClosed()
        return None

    def send(self, *messages: Message) -> list[bytes | memoryview]:
        """The frame pieces of ``messages``, to write in order."""
        pieces: list[bytes | memoryview] = []
        for msg in messages:
            if self._error is not None and msg.TYPE is not MsgType.ERROR:
                raise LocalProtocolError(
                    f"cannot send {msg.TYPE.name}: the peer broke the protocol "
                    f"({self._error}); send ERROR and close"
                )
            try:
                parts = encode_parts(
                    msg, fragment_size=self._fragment_size, max_message=self._decoder.max_message
                )
                self._lifecycle.send(msg)
            except LocalProtocolError:
                self._lifecycle.close()
                raise
            pieces += parts
        return pieces

    def close(self) -> None:
        self._lifecycle.close()
