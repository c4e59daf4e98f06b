"""The all-to-all data plane of a world of N ranks over TCP, plain or TLS
(:class:`MeshGateExchange`).
"""

from __future__ import annotations

import select
import socket
import time

import numpy as np
import numpy.typing as npt

from foundry.transport.gates.base import (
    _F32,
    DEFAULT_GATE_TIMEOUT_S,
    TCP_SPIN_S,
    GateError,
    GateExchange,
    _describe,
    _tail,
)
from foundry.transport.gates.channel import GateChannel, poll_channels
from foundry.wire.tp import (
    GATE_HEADER_SIZE,
)


class MeshGateExchange(GateExchange):
    """All-to-all for a world of N ranks over TCP: one connected socket to every other rank
    (``socks``, by rank; plain or TLS, each a
    :class:`~foundry.transport.gates.channel.GateChannel`), which this object then owns.

    Per gate the rank writes header (20 bytes) + partial to every peer while reading every
    peer's, one non-blocking poll loop over all the sockets (so no multi-MiB prefill partial
    can deadlock on clamped socket buffers), and returns the N partials added in rank order,
    its own in its place. Every peer's tag must equal its own; no byte moving on any socket
    for ``timeout_s`` is a stall; EOF or an error on any is a GateError naming that rank.
    """

    def __init__(
        self,
        socks: dict[int, socket.socket],
        *,
        rank: int,
        world: int,
        n_embd: int,
        timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
        first_seq: int = 1,
    ) -> None:
        super().__init__(
            rank=rank, n_embd=n_embd, timeout_s=timeout_s, first_seq=first_seq, world=world
        )
        if set(socks) != set(range(world)) - {rank}:
            raise ValueError(
                f"rank {rank} of {world} needs a socket to every other rank, got "
                f"ranks {sorted(socks)}"
            )
        self._channels = {r: GateChannel(s, f"rank {r}") for r, s in sorted(socks.items())}
        self._tags = {r: bytearray(GATE_HEADER_SIZE) for r in self._channels}
        self._bufs = {r: np.empty(0, dtype=_F32) for r in self._channels}
        self._poller = select.poll()

    def _swap(self, tag: bytes, mine: np.ndarray) -> np.ndarray:
        raise NotImplementedError("a world sums in _sum")

    def _sum(self, tag: bytes, mine: np.ndarray) -> npt.NDArray[np.float32]:
        rows = mine.shape[0]
        peers: dict[int, np.ndarray] = {}
        for r in self._channels:
            if self._bufs[r].size < mine.size:
                self._bufs[r] = np.empty(mine.size, dtype=_F32)
            peers[r] = self._bufs[r][: mine.size].reshape(rows, self.n_embd)
        out = (memoryview(tag), mine.data.cast("B"))
        total = GATE_HEADER_SIZE + mine.nbytes
        sent = dict.fromkeys(self._channels, 0)
        got = dict.fromkeys(self._channels, 0)
        t0 = time.perf_counter()
        last_progress = time.monotonic()
        while True:
            progress = False
            for r, ch in self._channels.items():
                if sent[r] < total:
                    n = ch.send(_tail(out, sent[r]), tag)
                    sent[r] += n
                    progress = progress or n > 0
                if got[r] < total:
                    into = (memoryview(self._tags[r]), peers[r].data.cast("B"))
                    n = ch.recv(_tail(into, got[r]), tag, got[r], total)
                    if got[r] < GATE_HEADER_SIZE <= got[r] + n and self._tags[r] != tag:
                        raise self._desync_from(r, tag, bytes(self._tags[r]))
                    got[r] += n
                    progress = progress or n > 0
                    if got[r] == total:
                        self.peer_wait_s[r] += time.perf_counter() - t0
            if all(v == total for v in sent.values()) and all(v == total for v in got.values()):
                break
            now = time.monotonic()
            if progress:
                last_progress = now
            elif now - last_progress > TCP_SPIN_S:
                self._wait(last_progress, tag, sent, got, total)
        # The sum in rank order, as one process standing for this split adds its parts.
        parts = [mine if r == self.rank else peers[r] for r in range(self.world)]
        acc: npt.NDArray[np.float32] = parts[0] + parts[1]
        for p in parts[2:]:
            np.add(acc, p, out=acc)
        return acc

    def _desync_from(self, peer: int, tag: bytes, peer_tag: bytes) -> GateError:
        exc = self._desync(tag, peer_tag)
        return GateError(f"rank {peer}: {exc}")

    def _wait(
        self,
        last_progress: float,
        tag: bytes,
        sent: dict[int, int],
        got: dict[int, int],
        total: int,
    ) -> None:
        left = last_progress + self.timeout_s - time.monotonic()
        if left <= 0:
            behind = [r for r in self._channels if got[r] < total]
            raise GateError(
                f"peer stalled: no progress for {self.timeout_s:g} s during {_describe(tag)} "
                f"(waiting for rank{'s' if len(behind) > 1 else ''} "
                f"{', '.join(map(str, behind))})"
            )
        wants = [(ch, sent[r] < total, got[r] < total) for r, ch in self._channels.items()]
        poll_channels(self._poller, wants, left)

    def _release(self) -> None:
        for ch in self._channels.values():
            ch.close()
