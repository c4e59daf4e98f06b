"""The control link: TP control frames over one blocking TCP socket, with deadlines.

A thin driver around the sans-IO :class:`~foundry.wire.tp.TpDecoder`: ``send`` encodes and
writes a frame, ``recv`` reads until the decoder yields one. Every wait is bounded: a peer that
moves no byte for ``timeout_s`` raises :class:`LinkError`, so a stalled or dead rank never
hangs the other, and a frame once begun must be complete within ``frame_deadline_s``, so a
peer dripping a byte now and then cannot hold the other rank either. ``recv(idle=...)`` is the
one unbounded wait between frames (a worker waiting for the next command); it wakes every
``timeout_s`` to ask ``idle`` whether to keep waiting. The socket may be a TLS socket
(``foundry.transport.tls``): the frames above it are the same.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from foundry.wire.tp import TP_MAX_PAYLOAD, Frame, FrameType, TpDecoder, encode

READ_CHUNK = 256 * 1024
# A frame once begun must be complete within this time by default. The largest control frames
# (a LOGITS half of a prefill) are a few MiB: seconds even on a slow network.
DEFAULT_FRAME_DEADLINE_S = 30.0


class LinkError(ConnectionError):
    """The control link failed: the peer closed it, went silent past the deadline, or the
    socket broke. The link is unusable afterwards."""


class ControlLink:
    """One rank's end of the control connection (owns the socket)."""

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
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if frame_deadline_s <= 0:
            raise ValueError(f"frame_deadline_s must be positive, got {frame_deadline_s}")
        self.sock = sock
        self.timeout_s = timeout_s
        self.frame_deadline_s = frame_deadline_s
        self._sock_timeout = timeout_s
        self.decoder = TpDecoder(max_payload, expect_hello=expect_hello)
        if initial:
            self.decoder.feed(initial)
        self.bytes_sent = 0
        self.bytes_received = len(initial)
        # An absolute time.monotonic() by which every recv must be done (None: no limit), so
        # a peer dripping bytes cannot hold a bring-up open.
        self.deadline: float | None = None
        sock.settimeout(timeout_s)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Commands are small writes that the peer waits for; never hold them back.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            name = sock.getpeername()
        except OSError:
            name = None
        self.peer = f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name or "?")

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._settimeout(timeout_s)

    def _settimeout(self, timeout_s: float) -> None:
        # Only on a change: each call is a system call, and recv runs per command.
        if timeout_s != self._sock_timeout:
            self.sock.settimeout(timeout_s)
            self._sock_timeout = timeout_s

    def send(self, frame: Frame) -> None:
        data = encode(frame)
        self._settimeout(self.timeout_s)
        try:
            self.sock.sendall(data)
        except TimeoutError:
            raise LinkError(
                f"control link to {self.peer}: the peer took no bytes for {self.timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise LinkError(f"control link to {self.peer} failed: {exc}") from None
        self.bytes_sent += len(data)

    def recv(self, waiting_for: str = "a frame", idle: Callable[[], bool] | None = None) -> Frame:
        """The next frame. Without ``idle``, LinkError after ``timeout_s`` of silence; with it,
        silence is fine as long as ``idle()`` returns True (False: LinkError, "stopped")."""
        begun: float | None = None  # when the frame now arriving began
        while True:
            frame = self.decoder.next_event()
            if frame is not None:
                return frame
            timeout = self.timeout_s
            now = time.monotonic()
            if self.decoder.buffered:
                begun = now if begun is None else begun
                left = begun + self.frame_deadline_s - now
                if left <= 0:
                    raise self._frame_late(waiting_for)
                timeout = min(timeout, left)
            if self.deadline is not None:
                left = self.deadline - now
                if left <= 0:
                    raise LinkError(f"control link to {self.peer}: {waiting_for} did not arrive "
                                    "in time")
                timeout = min(timeout, left)
            self._settimeout(timeout)
            try:
                data = self.sock.recv(READ_CHUNK)
            except TimeoutError:
                if begun is not None and time.monotonic() - begun >= self.frame_deadline_s:
                    raise self._frame_late(waiting_for) from None
                if idle is not None and idle():
                    continue
                if idle is not None:
                    raise LinkError("stopped while waiting for the peer") from None
                raise LinkError(
                    f"control link to {self.peer}: no bytes for {self.timeout_s:g} s while "
                    f"waiting for {waiting_for}; the peer stalled"
                ) from None
            except OSError as exc:
                raise LinkError(f"control link to {self.peer} failed: {exc}") from None
            if not data:
                self.decoder.feed_eof()
                raise LinkError(
                    f"the peer at {self.peer} closed the control connection "
                    f"(while waiting for {waiting_for})"
                )
            self.bytes_received += len(data)
            self.decoder.feed(data)

    def _frame_late(self, waiting_for: str) -> LinkError:
        return LinkError(
            f"control link to {self.peer}: the peer began a frame and did not finish it within "
            f"{self.frame_deadline_s:g} s (frame deadline); closed while waiting for "
            f"{waiting_for}"
        )

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

    def close(self) -> None:
        self.sock.close()
