"""What every gate transport shares: the waits' constants, :class:`GateError`, the host id, the
:class:`GateExchange` base class (tags, desync check, lifecycle) and the buffer helpers.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import hashlib
import operator
import os
import platform
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from foundry.model.shard.table import Gate
from foundry.wire.tp import (
    GATE_HEADER,
    GATE_HEADER_SIZE,
    HOST_ID_BYTES,
    GateHeader,
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


@dataclasses.dataclass(frozen=True)
class StepGates:
    """The gates a C one-token step ran (:meth:`GateExchange.step_done`): each gate's seconds
    in order (ATTN, FFN, ATTN, ...), the last gate's total (None if no gate completed) and the
    failure that ended the step, if one did."""

    seconds: tuple[float, ...]
    last: npt.NDArray[np.float32] | None
    error: GateError | None


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
        self._step_seq = first_seq  # the seq a C step's gates started at (_native_step)
        self._failure: str | None = None
        self._closed = False

    def exchange(self, layer: int, gate: int, partial: np.ndarray) -> npt.NDArray[np.float32]:
        """``partial`` (rows, n_embd) or (n_embd,) float32 plus the peer's; same shape back.

        ``gate`` is a :class:`~foundry.model.shard.table.Gate` or any int enum with its values.
        """
        if partial.dtype != _F32 or partial.ndim not in (1, 2) or partial.shape[-1] != self.n_embd:
            raise ValueError(
                f"a gate partial is float32 of shape (rows, {self.n_embd}) or ({self.n_embd},), "
                f"got {partial.dtype} {partial.shape}"
            )
        self._check_usable()
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

    def step_gates(self, max_gates: int) -> object | None:
        """A capsule with which the C one-token step (``step_layers``) runs the gates of a step
        itself, up to ``max_gates`` of them timed, or None where they need Python (this
        transport). After the step, :meth:`step_done`."""
        return None

    def step_done(self) -> StepGates:
        """What the step's gates since :meth:`step_gates` did, ``seq`` and the waits advanced
        by them; a failed gate's GateError in ``error`` (the exchange is then unusable, as
        after a failed :meth:`exchange`)."""
        raise NotImplementedError("no gates run in C on this transport")

    def _native_step(self, gates: Any, max_gates: int, *more: int) -> object:
        """The capsule of ``gates`` (a ``_gates`` type: MeshGates, SlabGates) for a step's
        gates from this exchange's next seq on; ``more``: its ``start``'s further values."""
        self._check_usable()
        self._step_seq = self.seq
        capsule: object = gates.start(self.seq, max_gates, *more)
        return capsule

    def _native_step_done(
        self,
        records: tuple[Any, ...],
        peers: Sequence[int],
        failed: Callable[..., GateError],
    ) -> StepGates:
        """:meth:`step_done` from a ``_gates`` type's ``records()``: ``seq`` and the waits of
        ``peers`` (the other ranks, in its order) advanced; a failure becomes ``failed(*it)``,
        after which the exchange is unusable."""
        seq, seconds, waits, failure, last = records
        self.gates_done += seq - self._step_seq
        self.seq = seq
        for p, s in zip(peers, waits, strict=True):
            self.peer_wait_s[p] += s
        error = None
        if failure is not None:
            error = failed(*failure)
            self._failure = str(error)
            self._release()
        total = None if last is None else np.frombuffer(last, dtype=_F32).reshape(1, -1)
        return StepGates(seconds, total, error)

    def _check_usable(self) -> None:
        if self._closed:
            raise GateError("gate exchange is closed")
        if self._failure is not None:
            raise GateError(f"gate exchange failed earlier ({self._failure}); re-handshake")

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


def _tail(views: tuple[memoryview, memoryview], offset: int) -> list[memoryview]:
    """The bytes of ``views`` (header, data) from ``offset`` on, as buffers for sendmsg/recvmsg."""
    head = len(views[0])
    if offset < head:
        return [views[0][offset:], views[1]]
    return [views[1][offset - head :]]


def _describe(tag: bytes) -> str:
    return GateHeader.decode(tag).describe()
