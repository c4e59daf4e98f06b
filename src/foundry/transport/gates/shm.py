"""The shared-memory data plane of a pair on one host: a slab file both ranks map
(:class:`ShmGateExchange`; ``SlabLayout`` has the layout and the seqlock rule).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import struct
import time
import weakref
import zlib

import numpy as np

from foundry.transport.gates.base import (
    _F32,
    _SLOT_TAG,
    _U32,
    DEFAULT_GATE_TIMEOUT_S,
    SHM_SLEEP_FIRST_S,
    SHM_SLEEP_MAX_S,
    SHM_SPIN_S,
    SHM_YIELD_POLLS,
    GateError,
    GateExchange,
    StepGates,
    _describe,
    _needs_checksum,
    _shm_dir,
    _unlink_quietly,
)
from foundry.transport.gates.channel import GATE_CLOSED, GATE_DESYNC, GATE_STALLED, native
from foundry.wire.tp import (
    SHM_NAME_PATTERN,
    SLAB_ATTACHED,
    SLAB_CLOSED,
    SLAB_HEADER,
    SLAB_STATE_OFFSET,
    SLOT_CRC_END,
    SLOT_CRC_START,
    SLOT_HEADER,
    SlabLayout,
    TpProtocolError,
)


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

    On a slab without checksums the C one-token step runs its gates itself
    (:meth:`step_gates`: the same rounds in C, with C11 barriers, ``_gates.SlabGates``).
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
        layout = self._layout
        self._step = (
            None
            if checksum or native is None
            else native.SlabGates(
                mm,
                rank,
                n_embd,
                tuple(layout.slot_offset(r, p) for r in (0, 1) for p in (0, 1)),
                SLOT_CRC_START,
                SLOT_HEADER.size,
                layout.seq_end_offset(0, 0) - layout.slot_offset(0, 0),
                SLAB_STATE_OFFSET,
                timeout_s,
                SHM_SPIN_S,
                SHM_SLEEP_FIRST_S,
                SHM_SLEEP_MAX_S,
            )
        )

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

    def step_gates(self, max_gates: int) -> object | None:
        """The rounds of a C one-token step's gates in C, on a slab without checksums: the
        same slots, bytes, sums and checks as :meth:`_swap`'s, one round a gate."""
        self._check_usable()  # a failed or closed slab says so, though it dropped its SlabGates
        if self._step is None:
            return None
        return self._native_step(self._step, max_gates, self._pub)

    def step_done(self) -> StepGates:
        assert self._step is not None
        done = self._native_step_done(self._step.records(), [1 - self.rank], self._failed)
        rounds = self.seq - self._step_seq  # one a gate
        self._pub += rounds
        if rounds and self._unlink is not None and self._unlink.alive:
            self._unlink()  # the peer has attached, as after _swap's first round
        return done

    def _failed(self, code: int, peer_tag: bytes, tag: bytes) -> GateError:
        """A failed gate's error: a C step's, as ``records()`` gives it, or :meth:`_collect`'s
        (``peer_tag`` read only for GATE_DESYNC)."""
        if code == GATE_DESYNC:
            return self._desync(tag, peer_tag)
        if code == GATE_CLOSED:
            return GateError(f"peer closed the shared-memory slab during {_describe(tag)}")
        return GateError(
            f"peer stalled: no partial for {_describe(tag)} within {self.timeout_s:g} s "
            "on the shared-memory slab"
        )

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
                raise self._failed(GATE_CLOSED, b"", tag)
            polls += 1
            if polls % SHM_YIELD_POLLS:
                continue
            waited = time.monotonic() - start
            if waited < SHM_SPIN_S:
                os.sched_yield()
                continue
            if waited > self.timeout_s:
                raise self._failed(GATE_STALLED, b"", tag)
            time.sleep(sleep)
            sleep = min(2 * sleep, SHM_SLEEP_MAX_S)

    def _release(self) -> None:
        if self._views is None:
            return
        self._views.state[self.rank] = SLAB_CLOSED
        self._views = None
        self._step = None  # its hold on the map (a step's capsule may keep it a while longer)
        # The map closes once no numpy view of it is left. One may still live in the traceback
        # of the error being raised; the map is then unmapped when that error is dropped.
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._unlink is not None:
            self._unlink()
