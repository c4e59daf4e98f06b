"""The full-duplex TCP data plane of a pair, plain or over TLS (:class:`TcpGateExchange`)."""

from __future__ import annotations

import select
import socket
import time

import numpy as np

from foundry.transport.gates.base import (
    _F32,
    DEFAULT_GATE_TIMEOUT_S,
    TCP_SPIN_S,
    GateError,
    GateExchange,
    StepGates,
    _describe,
    _tail,
)
from foundry.transport.gates.channel import (
    GATE_CLOSED,
    GATE_DESYNC,
    GATE_FAILED,
    GATE_OK,
    GateChannel,
    native,
    poll_channels,
)
from foundry.wire.tp import (
    GATE_HEADER_SIZE,
)


class TcpGateExchange(GateExchange):
    """The full-duplex TCP data plane over a connected socket, which this object then owns.

    Per gate, header (20 bytes) + partial go out while the peer's come in, one poll loop
    driving both directions. Works over any connected stream socket, a TLS socket included
    (:class:`~foundry.transport.gates.channel.GateChannel`); on a plain one the loop runs in C
    (``channel.native``) unless ``native`` is set False (the benchmarks compare the two), and
    the C one-token step runs its gates itself (:meth:`step_gates`).
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        rank: int,
        n_embd: int,
        timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
        first_seq: int = 1,
    ) -> None:
        super().__init__(rank=rank, n_embd=n_embd, timeout_s=timeout_s, first_seq=first_seq)
        self._channel = GateChannel(sock, "peer")
        self._poller = select.poll()
        self._tag_in = bytearray(GATE_HEADER_SIZE)
        self._peer = np.empty(0, dtype=_F32)  # grows to the largest gate seen, then reused
        self.native = self._channel.native_fd is not None
        fd = self._channel.native_fd
        # The gates of a C one-token step: the same bytes and sum (``_gates.MeshGates``, whole).
        self._step = (
            None
            if fd is None or native is None
            else native.MeshGates(
                [-1 if r == rank else fd for r in (0, 1)],
                rank,
                n_embd,
                [self._tag_in],
                timeout_s,
                TCP_SPIN_S,
                whole=True,
            )
        )

    def step_gates(self, max_gates: int) -> object | None:
        """The native loop's gates for the C one-token step, where ``native`` is on: each
        gate's bytes, sum and checks as :meth:`_swap_native`'s, without Python between."""
        if self._step is None or not self.native:
            return None
        return self._native_step(self._step, max_gates)

    def step_done(self) -> StepGates:
        assert self._step is not None
        return self._native_step_done(self._step.records(), [1 - self.rank], self._failed)

    def _failed(
        self, code: int, _: int, err: int, got: tuple[int], sent: tuple[int], tag: bytes
    ) -> GateError:
        """A C step's failed gate (one row), as ``records()`` gives it."""
        return self._native_error(
            code, err, got[0], sent[0], tag, GATE_HEADER_SIZE + 4 * self.n_embd
        )

    def _swap(self, tag: bytes, mine: np.ndarray) -> np.ndarray:
        rows = mine.shape[0]
        if self._peer.size < mine.size:
            self._peer = np.empty(mine.size, dtype=_F32)
        peer = self._peer[: mine.size].reshape(rows, self.n_embd)
        if self.native:
            return self._swap_native(tag, mine, peer)
        out = (memoryview(tag), mine.data.cast("B"))
        into = (memoryview(self._tag_in), peer.data.cast("B"))
        total = GATE_HEADER_SIZE + mine.nbytes
        ch = self._channel
        sent = got = 0
        last_progress = time.monotonic()
        while sent < total or got < total:
            progress = False
            if sent < total:
                n = ch.send(_tail(out, sent), tag)
                sent += n
                progress = n > 0
            if got < total:
                n = ch.recv(_tail(into, got), tag, got, total)
                if got < GATE_HEADER_SIZE <= got + n and self._tag_in != tag:
                    raise self._desync(tag, bytes(self._tag_in))
                got += n
                progress = progress or n > 0
            now = time.monotonic()
            if progress:
                last_progress = now
            elif now - last_progress > TCP_SPIN_S and (sent < total or got < total):
                left = last_progress + self.timeout_s - now
                if left <= 0:
                    raise GateError(
                        f"peer stalled: no progress for {self.timeout_s:g} s during "
                        f"{_describe(tag)} ({_counts(sent, got, total)})"
                    )
                poll_channels(self._poller, [(ch, sent < total, got < total)], left)
        return peer

    def _swap_native(self, tag: bytes, mine: np.ndarray, peer: np.ndarray) -> np.ndarray:
        """The loop above in C (``_gates.swap``), the same bytes and errors."""
        assert native is not None and self._channel.native_fd is not None
        code, _, err, (got,), (sent,), _ = native.swap(
            self._channel.native_fd, tag, mine, self._tag_in, peer, self.timeout_s, TCP_SPIN_S
        )
        if code == GATE_OK:
            return peer
        raise self._native_error(code, err, got, sent, tag, GATE_HEADER_SIZE + mine.nbytes)

    def _native_error(
        self, code: int, err: int, got: int, sent: int, tag: bytes, total: int
    ) -> GateError:
        """The GateError of a native gate that ended with ``code`` (not GATE_OK), as the
        Python loop raises it; ``total`` bytes each way."""
        if code == GATE_DESYNC:
            return self._desync(tag, bytes(self._tag_in))
        if code == GATE_CLOSED:
            return self._channel.closed(tag, got, total)
        if code == GATE_FAILED:
            return self._channel.failed(err, tag)
        return GateError(
            f"peer stalled: no progress for {self.timeout_s:g} s during {_describe(tag)} "
            f"({_counts(sent, got, total)})"
        )

    def _release(self) -> None:
        self._channel.close()


def _counts(sent: int, got: int, total: int) -> str:
    return f"sent {sent} of {total} bytes, received {got} of {total}"
