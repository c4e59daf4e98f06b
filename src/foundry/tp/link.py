"""The control link: TP control frames over one blocking TCP socket, with deadlines.

``transport.stream.BlockingStream`` over the sans-IO :class:`~foundry.wire.tp.TpDecoder`: the
driver owns every wait (a peer silent for ``timeout_s`` or a frame not finished within
``frame_deadline_s`` raises :class:`LinkError`; ``recv(idle=...)`` is the one unbounded wait
between frames); this module adds the TP encoding and ``expect``. The socket may be a TLS
socket (``foundry.transport.tls``): the frames above it are the same. :func:`recv_exact`
reads a connection's first bytes exactly, never more, before a link or a gate takes its socket.
"""

from __future__ import annotations

import socket
import time

from foundry.transport.stream import BlockingStream, LinkError
from foundry.wire.tp import TP_MAX_PAYLOAD, Frame, FrameType, TpDecoder, encode_parts

__all__ = ["DEFAULT_FRAME_DEADLINE_S", "ControlLink", "LinkError", "recv_exact"]

# A frame once begun must be complete within this time by default. The largest control frames
# (a LOGITS half of a prefill) are a few MiB: seconds even on a slow network.
DEFAULT_FRAME_DEADLINE_S = 30.0


class ControlLink(BlockingStream[Frame]):
    """One rank's end of the control connection (owns the socket)."""

    decoder: TpDecoder

    def __init__(
        self,
        sock: socket.socket,
        *,
        timeout_s: float,
        expect_hello: bool,
        initial: bytes = b"",
        max_payload: int = TP_MAX_PAYLOAD,
        frame_deadline_s: float = DEFAULT_FRAME_DEADLINE_S,
    ) -> None:
        super().__init__(
            sock,
            TpDecoder(max_payload, expect_hello=expect_hello),
            timeout_s=timeout_s,
            frame_deadline_s=frame_deadline_s,
            name="control link",
            initial=initial,
        )

    def send(self, frame: Frame) -> None:
        self.send_pieces(encode_parts(frame))

    def expect(self, ftype: FrameType, waiting_for: str) -> Frame:
        """The next frame, which must be of type ``ftype`` (LinkError otherwise)."""
        frame = self.recv(waiting_for)
        got = getattr(frame, "TYPE", None)
        if got is not ftype:
            name = got.name if got is not None else "HELLO"
            raise LinkError(
                f"control link to {self.peer}: expected {ftype.name} ({waiting_for}), got {name}; "
                "the ranks are out of step"
            )
        return frame


def recv_exact(
    sock: socket.socket, n: int, deadline: float | None = None, deadline_s: float = 0.0
) -> bytes:
    """``n`` bytes; with ``deadline`` (a time.monotonic(), ``deadline_s`` after the frame's
    first byte) all of them by then (LinkError)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0

    def late() -> LinkError:
        return LinkError(
            f"the peer began a frame and did not finish it within {deadline_s:g} s "
            f"(frame deadline); {got} of {n} more bytes came; closed"
        )

    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise late()
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            if deadline is None:
                raise
            raise late() from None
        if k == 0:
            raise LinkError(f"the peer closed after {got} of the first {n} bytes")
        got += k
    return bytes(buf)
