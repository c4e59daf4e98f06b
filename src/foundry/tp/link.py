"""The control link: TP control frames over one blocking TCP socket, with deadlines.

``transport.stream.BlockingStream`` over the sans-IO :class:`~foundry.wire.tp.TpDecoder`: the
driver owns every wait (a peer silent for ``timeout_s`` or a frame not finished within
``frame_deadline_s`` raises :class:`LinkError`; ``recv(idle=...)`` is the one unbounded wait
between frames); this module adds the TP encoding and ``expect``. The socket may be a TLS
socket (``foundry.transport.tls``): the frames above it are the same.
"""

from __future__ import annotations

import socket

from foundry.transport.stream import BlockingStream, LinkError
from foundry.wire.tp import TP_MAX_PAYLOAD, Frame, FrameType, TpDecoder, encode_parts

__all__ = ["DEFAULT_FRAME_DEADLINE_S", "ControlLink", "LinkError"]

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
            sock, TpDecoder(max_payload, expect_hello=expect_hello), timeout_s=timeout_s,
            frame_deadline_s=frame_deadline_s, name="control link", initial=initial,
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
