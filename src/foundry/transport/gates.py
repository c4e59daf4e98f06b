"""The tensor-parallel data plane: the ranks swap their partial of one gate and sum them.

Twice per layer (gates ATTN and FFN) each rank holds a partial of shape (rows, n_embd) float32;
``GateExchange.exchange`` sends it to the peers, receives theirs, and returns the sum. In a pair
float addition of the two is commutative bit for bit, so both ranks get bit-identical sums; in
a world of N ranks (:class:`MeshGateExchange`) every rank adds the N partials in rank order,
``((p0 + p1) + p2) + ...``, and gets the same bits. The call is synchronous: the inference
engine's forward pass blocks in it.

Both ranks tag every partial with the same :class:`~foundry.wire.tp.GateHeader` (layer, gate,
seq, rows, n_embd; ``seq`` counts gates from ``first_seq``), so a rank that got out of step is
caught at the first gate where the tags differ, with both tags in the message. A peer that
stalls, dies or closes makes ``exchange`` raise :class:`GateError` within ``timeout_s`` of no
progress; the exchange is then unusable (it has closed its socket or marked the slab closed so
the peer fails fast too), and the services re-handshake.

Three transports:

- :class:`TcpGateExchange`: both ranks write header + partial, then read the peer's, full
  duplex with no per-gate handshake. The socket is non-blocking and one poll loop interleaves
  send and receive, so a multi-MiB prefill partial cannot deadlock when the kernel clamps the
  socket buffers (a blocking "sendall, then recv" on both sides would). No copies: the partial
  is sent from its own buffer, the peer's lands through ``recvmsg_into`` in a reused array.
  Over TLS (``foundry.transport.tls``; an ``ssl.SSLSocket``, which has no scatter/gather
  calls) the same loop uses ``send`` and ``recv_into`` one buffer at a time; the bytes inside
  TLS are the same.
- :class:`MeshGateExchange`: a world of N > 2 ranks, all-to-all: a TCP connection to every
  other rank; per gate the rank writes header + partial to each and reads each one's, one poll
  loop over all of them, then sums in rank order (one hop; docs/protocol.md, N ranks, has the
  choice against a star and a ring). Plain TCP only (no TLS between workers yet).
- :class:`ShmGateExchange`: a slab file in ``/dev/shm`` mapped by both ranks on one host (see
  ``SlabLayout`` for the layout and the seqlock rule). A plain file + ``mmap`` rather than
  ``multiprocessing.shared_memory``: before Python 3.13 the attaching process registers the
  segment with its resource tracker, which then warns about a "leak" and may unlink it under
  the creator; a file has one owner, the creator, who unlinks it.

Which one runs is decided from the two hellos (``foundry.wire.tp.negotiate_gate_transport``): the
leader creates a slab before its hello and names it there; when both ranks offered shared memory
and :func:`local_host_id` matches, the worker attaches to it, otherwise the leader closes it and
both use a TCP connection of their own (not the control socket, whose frames would interleave).
"""

from __future__ import annotations

import abc
import contextlib
import errno
import functools
import hashlib
import mmap
import operator
import os
import platform
import secrets
import select
import socket
import ssl
import struct
import tempfile
import time
import weakref
import zlib
from collections.abc import Callable
from types import TracebackType
from typing import Self

import numpy as np
import numpy.typing as npt

from foundry.model.shard import Gate
from foundry.wire.tp import (
    GATE_HEADER,
    GATE_HEADER_SIZE,
    HOST_ID_BYTES,
    SHM_NAME_PATTERN,
    SLAB_ATTACHED,
    SLAB_CLOSED,
    SLAB_HEADER,
    SLAB_STATE_OFFSET,
    SLOT_CRC_END,
    SLOT_CRC_START,
    GateHeader,
    SlabLayout,
    TpProtocolError,
)

# A peer that moves no byte for this long is taken as stalled or dead. A decode gate takes tens
# of microseconds and a prefill gate milliseconds, so one second never fires on a healthy pair.
DEFAULT_GATE_TIMEOUT_S = 1.0
# Shared-memory waits spin for this long before sleeping: a nap is pure added latency (a 20 us
# sleep lasts 70 or more, the timer slack), and a decode gate's peer is usually within a
# millisecond (the two ranks' halves of a layer differ by that much at most). While spinning
# the rank lets go of the GIL every SHM_YIELD_POLLS polls, so that its process's other threads
# (the leader's frontend and control link) are not held up.
SHM_SPIN_S = 2e-3
SHM_YIELD_POLLS = 32
# Then sleep, doubling from the first to the last value. The peer computes on another core, so
# a nap is pure added latency per gate: 1 ms naps made the slab slower than TCP inside the
# pair (bench/performance/tp.py); 100 us keeps a stalled peer cheap and a live one prompt.
SHM_SLEEP_FIRST_S = 20e-6
SHM_SLEEP_MAX_S = 100e-6

# TCP waits retry the socket for this long before sleeping in poll(): the peer's partial of a
# decode gate is usually tens of microseconds away, and a core that goes idle (a halted vCPU
# in a VM especially) takes about as long again to wake up.
TCP_SPIN_S = 50e-6
# Over TLS, bytes handed to one send: a multiple of the 16 KiB TLS record, and a retry after
# "would block" must offer the same bytes again, so the slice must not depend on anything else.
TLS_SEND_CHUNK = 256 * 1024
# Machines whose stores become visible to other cores in program order (total store order):
# there a slot's seq_end can never be seen before its data, and the checksum is not needed.
TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})

_F32 = np.dtype("<f4")
_U32 = struct.Struct("<I")
_SLOT_TAG = struct.Struct(f"<Q{GATE_HEADER_SIZE}s")  # pub, gate header: what the crc starts on


class GateError(ConnectionError):
    """A gate exchange failed: the peer stalled, died, closed, or is out of step.

    The exchange object is unusable afterwards; the services re-handshake and re-sync.
    """


def local_host_id() -> bytes:
    """16 bytes that are equal for two processes exactly when they can share a slab file.

    A hash of the kernel boot id, the host name and the identity of the shared-memory
    directory, so two containers on one kernel with separate ``/dev/shm`` differ. All zero
    (meaning "unknown", never matched) when the boot id cannot be read.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(_shm_dir())
    except OSError:
        return bytes(HOST_ID_BYTES)
    key = f"{boot}\0{socket.gethostname()}\0{st.st_dev}\0{st.st_ino}"
    return hashlib.sha256(key.encode()).digest()[:HOST_ID_BYTES]


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _needs_checksum() -> bool:
    return platform.machine().lower() not in TSO_MACHINES


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class GateExchange(abc.ABC):
    """Swap one gate's partial with the peer and return the sum; see the module docstring.

    ``rank`` is 0 (leader) .. ``world`` - 1 (a pair: 0 or 1); ``first_seq`` numbers the first
    gate and every rank must pass the same value. Use as a context manager or call
    :meth:`close`.
    """

    def __init__(
        self,
        *,
        rank: int,
        n_embd: int,
        timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
        first_seq: int = 1,
        world: int = 2,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank must lie in [0, {world}), got {rank}")
        if n_embd <= 0:
            raise ValueError(f"n_embd must be positive, got {n_embd}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.rank = rank
        self.world = world
        self.n_embd = n_embd
        self.timeout_s = timeout_s
        self.seq = first_seq  # the seq of the next gate
        # Per rank: seconds from the start of each gate until that rank's partial was in,
        # summed over ``gates_done`` gates (``STATUS``'s gate wait: the rank that gates
        # everyone has the largest).
        self.peer_wait_s = [0.0] * world
        self.gates_done = 0
        self._failure: str | None = None
        self._closed = False

    def exchange(self, layer: int, gate: int, partial: np.ndarray) -> npt.NDArray[np.float32]:
        """``partial`` (rows, n_embd) or (n_embd,) float32 plus the peer's; same shape back.

        ``gate`` is a :class:`~foundry.model.shard.Gate` or any int enum with its values.
        """
        if partial.dtype != _F32 or partial.ndim not in (1, 2) or partial.shape[-1] != self.n_embd:
            raise ValueError(
                f"a gate partial is float32 of shape (rows, {self.n_embd}) or ({self.n_embd},), "
                f"got {partial.dtype} {partial.shape}"
            )
        if self._closed:
            raise GateError("gate exchange is closed")
        if self._failure is not None:
            raise GateError(f"gate exchange failed earlier ({self._failure}); re-handshake")
        mine = np.ascontiguousarray(partial).reshape(-1, self.n_embd)
        try:
            tag = GATE_HEADER.pack(
                operator.index(layer), Gate(gate), 0, self.seq, mine.shape[0], self.n_embd
            )
        except struct.error as exc:
            raise ValueError(f"gate tag out of range (layer {layer}, seq {self.seq})") from exc
        try:
            total = self._sum(tag, mine)
        except GateError as exc:
            self._failure = str(exc)
            self._release()
            raise
        self.seq += 1
        self.gates_done += 1
        return total.reshape(partial.shape)

    def _sum(self, tag: bytes, mine: np.ndarray) -> npt.NDArray[np.float32]:
        """The sum over the ranks of this gate: in a pair ``mine + peer``."""
        t0 = time.perf_counter()
        peer = self._swap(tag, mine)
        self.peer_wait_s[1 - self.rank] += time.perf_counter() - t0
        total: npt.NDArray[np.float32] = mine + peer
        return total

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @abc.abstractmethod
    def _swap(self, tag: bytes, mine: np.ndarray) -> np.ndarray:
        """Send ``tag`` + ``mine``, return the peer's partial (same shape) after checking that
        its tag equals ``tag``; raise GateError on any failure."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Free the transport (idempotent); the peer's next exchange then fails fast."""

    def _desync(self, tag: bytes, peer_tag: bytes) -> GateError:
        mine = GateHeader.decode(tag).describe()
        try:
            theirs = GateHeader.decode(peer_tag).describe()
        except TpProtocolError as exc:
            theirs = f"garbage ({exc})"
        return GateError(
            f"gate desync: expected {mine}, peer sent {theirs}; the ranks are out of step"
        )


class TcpGateExchange(GateExchange):
    """The full-duplex TCP data plane over a connected socket, which this object then owns.

    Per gate, header (20 bytes) + partial go out while the peer's come in, one poll loop
    driving both directions. Works over any connected stream socket (TCP_NODELAY is set where
    it applies), a TLS socket included.
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
        self._sock = sock
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # A gate is one small write; Nagle would hold it back waiting for an ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._poller = select.poll()
        self._tls = sock if isinstance(sock, ssl.SSLSocket) else None
        self._tls_wants_write = False  # TLS must write (a handshake message) before it reads
        self._tag_in = bytearray(GATE_HEADER_SIZE)
        self._peer = np.empty(0, dtype=_F32)  # grows to the largest gate seen, then reused

    def _swap(self, tag: bytes, mine: np.ndarray) -> np.ndarray:
        rows = mine.shape[0]
        if self._peer.size < mine.size:
            self._peer = np.empty(mine.size, dtype=_F32)
        peer = self._peer[: mine.size].reshape(rows, self.n_embd)
        out = (memoryview(tag), mine.data.cast("B"))
        into = (memoryview(self._tag_in), peer.data.cast("B"))
        total = GATE_HEADER_SIZE + mine.nbytes
        sent = got = 0
        last_progress = time.monotonic()
        while sent < total or got < total:
            progress = False
            if sent < total:
                n = self._io(self._send, _tail(out, sent), tag, sent, got, total)
                sent += n
                progress = n > 0
            if got < total:
                n = self._io(self._recv, _tail(into, got), tag, sent, got, total)
                if got < GATE_HEADER_SIZE <= got + n and self._tag_in != tag:
                    raise self._desync(tag, bytes(self._tag_in))
                got += n
                progress = progress or n > 0
            now = time.monotonic()
            if progress:
                last_progress = now
            elif now - last_progress > TCP_SPIN_S and (sent < total or got < total):
                self._wait(last_progress, tag, sent, got, total)
        return peer

    def _send(self, views: list[memoryview]) -> int:
        if self._tls is None:
            return self._sock.sendmsg(views)
        try:
            return self._tls.send(views[0][:TLS_SEND_CHUNK])
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            raise BlockingIOError from None

    def _recv(self, views: list[memoryview]) -> int:
        if self._tls is None:
            n = self._sock.recvmsg_into(views)[0]
        else:
            try:
                n = self._tls.recv_into(views[0])
            except ssl.SSLWantReadError:
                raise BlockingIOError from None
            except ssl.SSLWantWriteError:
                self._tls_wants_write = True
                raise BlockingIOError from None
            self._tls_wants_write = False
        if n == 0:
            raise EOFError
        return n

    def _io(
        self,
        op: Callable[[list[memoryview]], int],
        views: list[memoryview],
        tag: bytes,
        sent: int,
        got: int,
        total: int,
    ) -> int:
        try:
            return op(views)
        except BlockingIOError:
            return 0
        except EOFError:
            raise GateError(
                f"peer closed the gate connection during {_describe(tag)} "
                f"(received {got} of {total} bytes)"
            ) from None
        except OSError as exc:
            raise GateError(
                f"gate connection failed during {_describe(tag)}: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}"
            ) from None

    def _wait(self, last_progress: float, tag: bytes, sent: int, got: int, total: int) -> None:
        left = last_progress + self.timeout_s - time.monotonic()
        if left <= 0:
            raise GateError(
                f"peer stalled: no progress for {self.timeout_s:g} s during {_describe(tag)} "
                f"(sent {sent} of {total} bytes, received {got} of {total})"
            )
        if self._tls is not None and self._tls.pending():
            return  # decrypted bytes wait inside TLS, not on the socket: read them first
        out = sent < total or self._tls_wants_write
        events = (select.POLLOUT if out else 0) | (select.POLLIN if got < total else 0)
        self._poller.register(self._sock, events)
        try:
            self._poller.poll(max(1, int(left * 1000) + 1))
        finally:
            self._poller.unregister(self._sock)

    def _release(self) -> None:
        self._sock.close()


class MeshGateExchange(GateExchange):
    """All-to-all for a world of N ranks over plain TCP: one connected socket to every other
    rank (``socks``, by rank), which this object then owns.

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
        super().__init__(rank=rank, n_embd=n_embd, timeout_s=timeout_s, first_seq=first_seq,
                         world=world)
        if set(socks) != set(range(world)) - {rank}:
            raise ValueError(f"rank {rank} of {world} needs a socket to every other rank, got "
                             f"ranks {sorted(socks)}")
        self._socks = dict(sorted(socks.items()))
        for sock in self._socks.values():
            if isinstance(sock, ssl.SSLSocket):
                raise ValueError("the all-to-all gates run over plain TCP only")
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._tags = {r: bytearray(GATE_HEADER_SIZE) for r in self._socks}
        self._bufs = {r: np.empty(0, dtype=_F32) for r in self._socks}
        self._poller = select.poll()

    def _swap(self, tag: bytes, mine: np.ndarray) -> np.ndarray:
        raise NotImplementedError("a world sums in _sum")

    def _sum(self, tag: bytes, mine: np.ndarray) -> npt.NDArray[np.float32]:
        rows = mine.shape[0]
        peers: dict[int, np.ndarray] = {}
        for r in self._socks:
            if self._bufs[r].size < mine.size:
                self._bufs[r] = np.empty(mine.size, dtype=_F32)
            peers[r] = self._bufs[r][: mine.size].reshape(rows, self.n_embd)
        out = (memoryview(tag), mine.data.cast("B"))
        total = GATE_HEADER_SIZE + mine.nbytes
        sent = dict.fromkeys(self._socks, 0)
        got = dict.fromkeys(self._socks, 0)
        t0 = time.perf_counter()
        last_progress = time.monotonic()
        while True:
            progress = False
            for r, sock in self._socks.items():
                if sent[r] < total:
                    n = self._io(r, sock.sendmsg, _tail(out, sent[r]), tag)
                    sent[r] += n
                    progress = progress or n > 0
                if got[r] < total:
                    into = (memoryview(self._tags[r]), peers[r].data.cast("B"))
                    n = self._io(r, functools.partial(_recv_some, sock), _tail(into, got[r]), tag)
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

    def _io(self, peer: int, op: Callable[[list[memoryview]], int], views: list[memoryview],
            tag: bytes) -> int:
        try:
            return op(views)
        except BlockingIOError:
            return 0
        except EOFError:
            raise GateError(f"rank {peer} closed the gate connection during "
                            f"{_describe(tag)}") from None
        except OSError as exc:
            raise GateError(
                f"gate connection to rank {peer} failed during {_describe(tag)}: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}"
            ) from None

    def _desync_from(self, peer: int, tag: bytes, peer_tag: bytes) -> GateError:
        exc = self._desync(tag, peer_tag)
        return GateError(f"rank {peer}: {exc}")

    def _wait(self, last_progress: float, tag: bytes, sent: dict[int, int],
              got: dict[int, int], total: int) -> None:
        left = last_progress + self.timeout_s - time.monotonic()
        if left <= 0:
            behind = [r for r in self._socks if got[r] < total]
            raise GateError(
                f"peer stalled: no progress for {self.timeout_s:g} s during {_describe(tag)} "
                f"(waiting for rank{'s' if len(behind) > 1 else ''} "
                f"{', '.join(map(str, behind))})"
            )
        registered = []
        for r, sock in self._socks.items():
            events = (select.POLLOUT if sent[r] < total else 0) | (
                select.POLLIN if got[r] < total else 0)
            if events:
                self._poller.register(sock, events)
                registered.append(sock)
        try:
            self._poller.poll(max(1, int(left * 1000) + 1))
        finally:
            for sock in registered:
                self._poller.unregister(sock)

    def _release(self) -> None:
        for sock in self._socks.values():
            sock.close()


def _recv_some(sock: socket.socket, views: list[memoryview]) -> int:
    n = sock.recvmsg_into(views)[0]
    if n == 0:
        raise EOFError
    return n


def _tail(views: tuple[memoryview, memoryview], offset: int) -> list[memoryview]:
    """The bytes of ``views`` (header, data) from ``offset`` on, as buffers for sendmsg/recvmsg."""
    head = len(views[0])
    if offset < head:
        return [views[0][offset:], views[1]]
    return [views[1][offset - head :]]


def _describe(tag: bytes) -> str:
    return GateHeader.decode(tag).describe()


class _Slot:
    """Numpy views of one slot of the mapped slab."""

    def __init__(self, raw: np.ndarray, layout: SlabLayout, rank: int, parity: int) -> None:
        self.base = layout.slot_offset(rank, parity)
        end = layout.seq_end_offset(rank, parity)
        data = layout.data_offset(rank, parity)
        self.seq_begin = raw[self.base : self.base + 8].view("<u8")
        self.seq_end = raw[end : end + 8].view("<u8")
        self.data = raw[data : data + layout.data_capacity].view(_F32)


class _SlabViews:
    """Every numpy view of the map, held in one place so that dropping it frees the map."""

    def __init__(self, mm: mmap.mmap, layout: SlabLayout) -> None:
        raw = np.frombuffer(mm, dtype=np.uint8)
        self.state = raw[SLAB_STATE_OFFSET : SLAB_STATE_OFFSET + 8].view("<u4")
        self.slots = [[_Slot(raw, layout, r, p) for p in (0, 1)] for r in (0, 1)]


class ShmGateExchange(GateExchange):
    """The shared-memory data plane: both ranks map one slab file (see ``SlabLayout``).

    Make it with :meth:`create` on the rank that offers the slab (the leader) and
    :meth:`attach` on the other. Each round, a rank writes its partial into its own slot with
    the seqlock rule (``seq_begin``; pub, tag and data; crc32; then ``seq_end``, each a
    separate store in that order) and polls the peer's slot until ``seq_end`` shows the round.
    It then copies the tag and data out and accepts them only if ``seq_begin == seq_end ==
    pub`` still holds (and, on a checksummed slab, the crc32 over pub, tag and data matches),
    retrying otherwise; partials larger than a slot go in several rounds.

    Memory ordering: Python offers no barriers, and each store above is a separate C call, so
    the compiler cannot reorder them, but the CPU may. x86 is TSO: stores become visible in
    program order and loads are not reordered with each other, so once the reader sees
    ``seq_end`` the data before it is visible too. arm64 is weakly ordered (stores may become
    visible out of order, loads may be satisfied out of order) and armv7 may tear 8-byte
    stores, so off x86 the creator marks the slab checksummed: a reader that saw ``seq_end``
    early reads a stale or partial slot whose crc32 cannot match (the crc covers ``pub``, so
    even a complete stale round fails) and retries until the stores have landed. On x86 the
    crc is skipped: it would cost 4 us per 16 KiB on each side of every gate.
    """

    def __init__(
        self,
        path: str,
        mm: mmap.mmap,
        *,
        rank: int,
        n_embd: int,
        timeout_s: float,
        first_seq: int,
        owner: bool,
        checksum: bool,
    ) -> None:
        super().__init__(rank=rank, n_embd=n_embd, timeout_s=timeout_s, first_seq=first_seq)
        self.path = path
        self._mm = mm
        # The creator unlinks the file: at the first completed gate, on close, or at the latest
        # when this object is collected or the interpreter exits.
        self._unlink = weakref.finalize(self, _unlink_quietly, path) if owner else None
        self.checksum = checksum
        self._layout = SlabLayout(n_embd)
        self._pub = 1  # the next round; both ranks count rounds the same way
        self._views: _SlabViews | None = _SlabViews(mm, self._layout)
        self._views.state[rank] = SLAB_ATTACHED
        self._scratch = np.empty(0, dtype=_F32)

    @property
    def name(self) -> str:
        """The slab's file name, as offered in the hello."""
        return os.path.basename(self.path)

    @classmethod
    def create(
        cls,
        *,
        n_embd: int,
        rank: int = 0,
        timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
        first_seq: int = 1,
        checksum: bool | None = None,
    ) -> ShmGateExchange:
        """Create a fresh slab file (mode 0600) in ``/dev/shm`` and map it.

        ``checksum`` defaults to what this machine needs (off on x86 only).
        """
        if checksum is None:
            checksum = _needs_checksum()
        layout = SlabLayout(n_embd)
        path = os.path.join(_shm_dir(), f"foundry-tp-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, layout.total_bytes)
            mm = mmap.mmap(fd, layout.total_bytes)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mm[: SLAB_HEADER.size] = layout.header_bytes(checksum=checksum)
        return cls(
            path, mm, rank=rank, n_embd=n_embd, timeout_s=timeout_s, first_seq=first_seq,
            owner=True, checksum=checksum,
        )  # fmt: skip

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        n_embd: int,
        rank: int = 1,
        timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
        first_seq: int = 1,
    ) -> ShmGateExchange:
        """Map the slab the peer created and named in its hello; GateError if unusable."""
        if not SHM_NAME_PATTERN.fullmatch(name):
            raise ValueError(f"slab name {name!r} is not a bare file name")
        layout = SlabLayout(n_embd)
        path = os.path.join(_shm_dir(), name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise GateError(f"cannot open the peer's slab {path}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size != layout.total_bytes:
                raise GateError(
                    f"slab {path} is {size} bytes, expected {layout.total_bytes} for n_embd "
                    f"{n_embd}: the ranks disagree on the model"
                )
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            checksum = layout.check_header(mm)
            if _needs_checksum() and not checksum:
                raise GateError(
                    f"slab {path} has no checksums but this machine ({platform.machine()}) "
                    "is not TSO; the ranks must run on the same architecture"
                )
            if int(struct.unpack_from("<I", mm, SLAB_STATE_OFFSET + 4 * rank)[0]):
                raise GateError(f"slab {path} already has a rank {rank}")
        except (TpProtocolError, GateError) as exc:
            mm.close()
            raise GateError(str(exc)) from None
        return cls(
            path, mm, rank=rank, n_embd=n_embd, timeout_s=timeout_s, first_seq=first_seq,
            owner=False, checksum=checksum,
        )  # fmt: skip

    def _swap(self, tag: bytes, mine: np.ndarray) -> np.ndarray:
        rows = mine.shape[0]
        slot_rows = self._layout.slot_rows
        if self._scratch.size < mine.size:
            self._scratch = np.empty(mine.size, dtype=_F32)
        peer = self._scratch[: mine.size].reshape(rows, self.n_embd)
        for r0 in range(0, max(rows, 1), slot_rows):
            r1 = min(rows, r0 + slot_rows)
            self._publish(tag, mine[r0:r1])
            self._collect(tag, peer[r0:r1])
            self._pub += 1
        if self._unlink is not None and self._unlink.alive:
            # The peer has attached (it published a round): nothing else will open the file,
            # so unlink it now and a crash of either rank leaves nothing behind in /dev/shm.
            self._unlink()
        return peer

    def _publish(self, tag: bytes, chunk: np.ndarray) -> None:
        assert self._views is not None
        pub = self._pub
        slot = self._views.slots[self.rank][pub % 2]
        slot.seq_begin[0] = pub
        stamp = _SLOT_TAG.pack(pub, tag)
        self._mm[slot.base + SLOT_CRC_START : slot.base + SLOT_CRC_END] = stamp
        flat = chunk.reshape(-1)
        slot.data[: flat.size] = flat
        if self.checksum:
            crc = zlib.crc32(flat.data, zlib.crc32(stamp))
            _U32.pack_into(self._mm, slot.base + SLOT_CRC_END, crc)
        slot.seq_end[0] = pub

    def _collect(self, tag: bytes, dest: np.ndarray) -> None:
        assert self._views is not None
        pub, peer = self._pub, 1 - self.rank
        slot, state = self._views.slots[peer][pub % 2], self._views.state
        flat = dest.reshape(-1)
        expected = _SLOT_TAG.pack(pub, tag)
        start = time.monotonic()
        polls = 0
        sleep = SHM_SLEEP_FIRST_S
        while True:
            if slot.seq_end[0] == pub:
                stamp = self._mm[slot.base + SLOT_CRC_START : slot.base + SLOT_CRC_END]
                (crc,) = _U32.unpack_from(self._mm, slot.base + SLOT_CRC_END)
                flat[:] = slot.data[: flat.size]
                if (
                    slot.seq_begin[0] == pub
                    and slot.seq_end[0] == pub
                    and (not self.checksum or zlib.crc32(flat.data, zlib.crc32(stamp)) == crc)
                ):
                    if stamp != expected:
                        raise self._desync(tag, stamp[8:])
                    return
            if state[peer] == SLAB_CLOSED:
                raise GateError(f"peer closed the shared-memory slab during {_describe(tag)}")
            polls += 1
            if polls % SHM_YIELD_POLLS:
                continue
            waited = time.monotonic() - start
            if waited < SHM_SPIN_S:
                os.sched_yield()
                continue
            if waited > self.timeout_s:
                raise GateError(
                    f"peer stalled: no partial for {_describe(tag)} within {self.timeout_s:g} s "
                    "on the shared-memory slab"
                )
            time.sleep(sleep)
            sleep = min(2 * sleep, SHM_SLEEP_MAX_S)

    def _release(self) -> None:
        if self._views is None:
            return
        self._views.state[self.rank] = SLAB_CLOSED
        self._views = None
        # The map closes once no numpy view of it is left. One may still live in the traceback
        # of the error being raised; the map is then unmapped when that error is dropped.
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._unlink is not None:
            self._unlink()
