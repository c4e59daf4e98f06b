"""The data plane of a world of N ranks over TCP, plain or TLS (:class:`MeshGateExchange`):
reduce-scatter then allgather, each chunk summed in rank order.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from foundry.transport.gates.base import (
    _F32,
    DEFAULT_GATE_TIMEOUT_S,
    TCP_SPIN_S,
    GateError,
    GateExchange,
    StepGates,
    _describe,
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


def chunk_bounds(n_embd: int, world: int) -> list[tuple[int, int]]:
    """Rank r's columns of a partial, ``[r n_embd // N, (r+1) n_embd // N)``: N contiguous
    chunks that differ by at most one column (empty ones when n_embd < N), the same on every
    rank for every gate."""
    cuts = [r * n_embd // world for r in range(world + 1)]
    return list(itertools.pairwise(cuts))


def _span(views: list[memoryview], start: int, stop: int) -> list[memoryview]:
    """The bytes ``[start, stop)`` of the concatenated ``views``, as buffers for
    sendmsg/recvmsg; empty views left out, so the first buffer is the same for a given
    ``start`` whatever ``stop`` is past the end of the view that ``start`` lies in."""
    out: list[memoryview] = []
    at = 0
    for v in views:
        lo, hi = max(start - at, 0), min(stop - at, len(v))
        if lo < hi:
            out.append(v[lo:hi])
        at += len(v)
    return out


class MeshGateExchange(GateExchange):
    """A world of N ranks over TCP: one connected socket to every other rank (``socks``, by
    rank; plain or TLS, each a :class:`~foundry.transport.gates.channel.GateChannel`), which
    this object then owns.

    The partial's columns are cut into N chunks (:func:`chunk_bounds`); rank r owns chunk r.
    Per gate, on the connection to every peer p, the rank writes header (20 bytes) + chunk p of
    its partial (reduce-scatter), and once every peer's chunk r is in, adds the N pieces of
    chunk r in rank order, ``((p0 + p1) + p2) + ...``, its own in its place, and writes that
    sum after them (allgather); it reads from p header + p's piece of chunk r + p's sum of
    chunk p. Every element is added in the same order as the whole partials would be, so every
    rank holds the same bits as all-to-all would give. Each rank sends 2(N-1)/N partials a gate
    instead of N-1. One non-blocking poll loop over all the sockets moves every byte (so no
    multi-MiB prefill partial can deadlock on clamped socket buffers: every receive is posted
    from the start, and the sums wait only on the pieces, which wait on nothing). Every peer's
    tag must equal its own; no byte moving on any socket for ``timeout_s`` is a stall; EOF or
    an error on any is a GateError naming that rank. Where every socket is plain, that loop
    runs in C (``channel.native``: the same bytes, sums and errors) unless ``native`` is set
    False (the benchmarks compare the two).
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
        self._bounds = chunk_bounds(n_embd, world)
        self._staging: dict[tuple[str, int], np.ndarray] = {}
        self._poller = select.poll()
        fds = [-1 if r == rank else self._channels[r].native_fd for r in range(world)]
        self._fds = None if None in fds else fds
        self.native = self._fds is not None
        # The gates of a C one-token step, the same loop and sums (``_gates.MeshGates``).
        self._step = (
            None
            if self._fds is None or native is None
            else native.MeshGates(
                self._fds,
                rank,
                n_embd,
                [self._tags[p] for p in self._channels],
                timeout_s,
                TCP_SPIN_S,
            )
        )

    def step_gates(self, max_gates: int) -> object | None:
        """The native loop's gates for the C one-token step, where ``native`` is on: the step
        posts each peer's chunk of a partial as soon as its rows are made (the pieces travel
        while the rest of the product is computed), then moves the rest as :meth:`_sum`
        does (the same bytes, sums and checks)."""
        if self._step is None or not self.native:
            return None
        return self._native_step(self._step, max_gates)

    def step_done(self) -> StepGates:
        assert self._step is not None
        return self._native_step_done(self._step.records(), list(self._channels), self._failed)

    def _failed(
        self, code: int, i: int, err: int, got: tuple[int, ...], _: object, tag: bytes
    ) -> GateError:
        """A C step's failed gate (one row), as ``records()`` gives it."""
        return self._native_failure(code, i, err, got, tag, 1)

    def _swap(self, tag: bytes, mine: np.ndarray) -> np.ndarray:
        raise NotImplementedError("a world sums in _sum")

    def _sum(self, tag: bytes, mine: np.ndarray) -> npt.NDArray[np.float32]:
        rows = mine.shape[0]
        out = np.empty((rows, self.n_embd), dtype=_F32)
        if self.native:
            return self._sum_native(tag, mine, out)
        cols = {r: (mine[:, a:b], out[:, a:b]) for r, (a, b) in enumerate(self._bounds)}
        # The bytes move from and to views of ``mine`` and ``out`` where one row makes a chunk
        # contiguous (a decode gate), else through reused buffers, copied in and out here.
        sent = {p: self._land(cols[p][0], "out", p) for p in self._channels}  # my chunk p
        total = self._land(cols[self.rank][1], "total", self.rank)  # my chunk's sum
        pieces = {p: self._buffer("piece", p, *total.shape) for p in self._channels}
        sums = {p: self._land(cols[p][1], "sum", p) for p in self._channels}
        outs, ins = {}, {}
        for p in self._channels:
            if sent[p] is not cols[p][0]:
                np.copyto(sent[p], cols[p][0])
            outs[p] = [memoryview(tag), _bytes(sent[p]), _bytes(total)]
            ins[p] = [memoryview(self._tags[p]), _bytes(pieces[p]), _bytes(sums[p])]

        def reduce() -> None:
            # My chunk summed in rank order, as one process standing for this split adds.
            parts = [cols[r][0] if r == self.rank else pieces[r] for r in range(self.world)]
            np.add(parts[0], parts[1], out=total)
            for q in parts[2:]:
                np.add(total, q, out=total)

        self._move(tag, outs, ins, reduce)
        for r, arr in [(self.rank, total), *sums.items()]:
            if arr is not cols[r][1]:
                cols[r][1][...] = arr
        return out

    def _sum_native(self, tag: bytes, mine: np.ndarray, out: np.ndarray) -> np.ndarray:
        """:meth:`_sum`'s loop in C (``_gates.mesh_sum``), the same bytes, sums and errors."""
        assert native is not None and self._fds is not None
        peers = list(self._channels)  # rank order, as mesh_sum gives its values
        code, i, err, got, _, done = native.mesh_sum(
            self._fds,
            self.rank,
            tag,
            mine,
            mine.shape[0],
            out,
            [self._tags[p] for p in peers],
            self.timeout_s,
            TCP_SPIN_S,
        )
        if code == GATE_OK:
            for p, s in zip(peers, done, strict=True):
                self.peer_wait_s[p] += s
            return out
        raise self._native_failure(code, i, err, got, tag, mine.shape[0])

    def _native_failure(
        self, code: int, i: int, err: int, got: tuple[int, ...], tag: bytes, rows: int
    ) -> GateError:
        """The GateError of a native gate that ended with ``code`` at the other rank of index
        ``i`` (errno ``err``, ``got`` bytes in from each), as the Python loop raises it."""
        peers = list(self._channels)
        a, b = self._bounds[self.rank]
        step1_in = {p: GATE_HEADER_SIZE + 4 * rows * (b - a) for p in peers}
        total_in = {
            p: step1_in[p] + 4 * rows * (self._bounds[p][1] - self._bounds[p][0]) for p in peers
        }
        got_by = dict(zip(peers, got, strict=True))
        if code == GATE_DESYNC:
            return self._desync_from(peers[i], tag, bytes(self._tags[peers[i]]))
        if code in (GATE_CLOSED, GATE_FAILED):
            ch = self._channels[peers[i]]
            exc = (
                ch.closed(tag, got_by[peers[i]], total_in[peers[i]])
                if code == GATE_CLOSED
                else ch.failed(err, tag)
            )
            return self._after_failure(peers[i], exc, tag, got_by, step1_in)
        return self._stalled(tag, got_by, step1_in, total_in)

    def _stalled(
        self, tag: bytes, got: dict[int, int], step1_in: dict[int, int], total_in: dict[int, int]
    ) -> GateError:
        """No byte moved for ``timeout_s``: a rank whose piece is missing holds everyone up;
        else those whose sum is."""
        behind = [r for r in got if got[r] < step1_in[r]]
        behind = behind or [r for r in got if got[r] < total_in[r]]
        return GateError(
            f"peer stalled: no progress for {self.timeout_s:g} s during {_describe(tag)} "
            f"({_waiting_for(behind)})"
        )

    def _after_failure(
        self, r: int, exc: GateError, tag: bytes, got: dict[int, int], step1_in: dict[int, int]
    ) -> GateError:
        """The error to raise when the connection to rank ``r`` failed with ``exc``: a rank
        that gave up on an out-of-step or silent one closes on us, so name the out-of-step one
        if its header is here already, else the silent ones."""
        silent = [q for q in got if q != r and got[q] < step1_in[q]]
        if not silent:
            return exc
        return self._desync_among(tag, silent, got) or GateError(
            f"{exc}; still {_waiting_for(silent)}"
        )

    def _buffer(self, job: str, peer: int, rows: int, width: int) -> np.ndarray:
        """A reused contiguous (rows, width) array for ``job`` with ``peer``."""
        buf = self._staging.get((job, peer))
        if buf is None or buf.size < rows * width:
            buf = self._staging[(job, peer)] = np.empty(rows * width, dtype=_F32)
        return buf[: rows * width].reshape(rows, width)

    def _land(self, view: np.ndarray, job: str, peer: int) -> np.ndarray:
        """``view`` itself where its bytes are contiguous, else a reused buffer of its shape
        for ``job`` with ``peer``."""
        return view if view.flags.c_contiguous else self._buffer(job, peer, *view.shape)

    def _move(
        self,
        tag: bytes,
        outs: dict[int, list[memoryview]],
        ins: dict[int, list[memoryview]],
        between: Callable[[], None],
    ) -> None:
        """Write ``outs[p]`` to and read ``ins[p]`` from every peer p, one poll loop. The first
        two buffers of each are step 1 (header, piece); the rest of the writes wait until every
        peer's step 1 is in and ``between`` has run. ``ins[p][0]`` is ``self._tags[p]``."""
        step1_out = {p: len(v[0]) + len(v[1]) for p, v in outs.items()}
        step1_in = {p: len(v[0]) + len(v[1]) for p, v in ins.items()}
        total_out = {p: sum(map(len, v)) for p, v in outs.items()}
        total_in = {p: sum(map(len, v)) for p, v in ins.items()}
        limit = dict(step1_out)
        sent = dict.fromkeys(self._channels, 0)
        got = dict.fromkeys(self._channels, 0)
        reduced = False
        t0 = time.perf_counter()
        last_progress = time.monotonic()
        while True:
            progress = False
            for r, ch in self._channels.items():
                try:
                    if sent[r] < limit[r]:
                        n = ch.send(_span(outs[r], sent[r], limit[r]), tag)
                        sent[r] += n
                        progress = progress or n > 0
                    if got[r] < total_in[r]:
                        n = ch.recv(_span(ins[r], got[r], total_in[r]), tag, got[r], total_in[r])
                        if got[r] < GATE_HEADER_SIZE <= got[r] + n and self._tags[r] != tag:
                            raise self._desync_from(r, tag, bytes(self._tags[r]))
                        got[r] += n
                        progress = progress or n > 0
                        if got[r] == total_in[r]:
                            self.peer_wait_s[r] += time.perf_counter() - t0
                except GateError as exc:
                    raise self._after_failure(r, exc, tag, got, step1_in) from None
            if not reduced and all(got[r] >= step1_in[r] for r in got):
                between()
                reduced = progress = True
                limit = total_out
            if sent == total_out and got == total_in:
                return
            now = time.monotonic()
            if progress:
                last_progress = now
            elif now - last_progress > TCP_SPIN_S:
                self._wait(last_progress, tag, sent, limit, got, step1_in, total_in)

    def _desync_among(self, tag: bytes, ranks: list[int], got: dict[int, int]) -> GateError | None:
        """The desync of the first of ``ranks`` whose header, read now as far as it has come,
        differs from ``tag``; None when none does (yet)."""
        for q in ranks:
            if got[q] < GATE_HEADER_SIZE:
                with contextlib.suppress(GateError):
                    head = [memoryview(self._tags[q])[got[q] :]]
                    got[q] += self._channels[q].recv(head, tag, got[q], GATE_HEADER_SIZE)
            if got[q] >= GATE_HEADER_SIZE and self._tags[q] != tag:
                return self._desync_from(q, tag, bytes(self._tags[q]))
        return None

    def _desync_from(self, peer: int, tag: bytes, peer_tag: bytes) -> GateError:
        exc = self._desync(tag, peer_tag)
        return GateError(f"rank {peer}: {exc}")

    def _wait(
        self,
        last_progress: float,
        tag: bytes,
        sent: dict[int, int],
        limit: dict[int, int],
        got: dict[int, int],
        step1_in: dict[int, int],
        total_in: dict[int, int],
    ) -> None:
        left = last_progress + self.timeout_s - time.monotonic()
        if left <= 0:
            raise self._stalled(tag, got, step1_in, total_in)
        wants = [(ch, sent[r] < limit[r], got[r] < total_in[r]) for r, ch in self._channels.items()]
        poll_channels(self._poller, wants, left)

    def _release(self) -> None:
        for ch in self._channels.values():
            ch.close()


def _bytes(a: np.ndarray) -> memoryview:
    """The bytes of contiguous ``a`` (an empty chunk, n_embd < N: none; memoryview refuses
    to cast a shape with a zero)."""
    return a.data.cast("B") if a.size else memoryview(b"")


def _waiting_for(ranks: list[int]) -> str:
    return f"waiting for rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
