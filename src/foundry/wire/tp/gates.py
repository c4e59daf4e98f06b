"""The tensor-parallel data plane's bytes: the gate header (20 bytes) that tags every partial,
and the layout of the shared-memory slab that carries the partials when both ranks share a
host."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from foundry.model.shard.table import Gate  # the model's sync points, tagged on the data plane
from foundry.wire.errors import LocalProtocolError, TpProtocolError
from foundry.wire.tp.hello import (
    _U16,
    _U32,
    _U64,
    DS4_TP_BATCH_MAX_ROWS,
    TP_PROTOCOL_VERSION,
    TP_SLAB_MAGIC,
    _check_range,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer


# -- the data plane ----------------------------------------------------------------------------


# layer u16, gate u8, flags u8, seq u64, rows u32, n_embd u32; the payload that follows is
# rows * n_embd float32 (little-endian), row-major.
GATE_HEADER = struct.Struct("<HBBQII")
GATE_HEADER_SIZE = GATE_HEADER.size


@dataclass(frozen=True)
class GateHeader:
    """The tag of one partial on the data plane; both ranks send the same tag for one gate."""

    layer: int
    gate: Gate
    seq: int
    rows: int
    n_embd: int

    def __post_init__(self) -> None:
        _check_range("GateHeader", "layer", self.layer, 0, _U16)
        if not isinstance(self.gate, Gate):
            raise LocalProtocolError(f"GateHeader.gate must be a Gate, got {self.gate!r}")
        _check_range("GateHeader", "seq", self.seq, 0, _U64)
        _check_range("GateHeader", "rows", self.rows, 0, _U32)
        _check_range("GateHeader", "n_embd", self.n_embd, 0, _U32)

    @property
    def payload_bytes(self) -> int:
        return 4 * self.rows * self.n_embd

    def encode(self) -> bytes:
        return GATE_HEADER.pack(self.layer, self.gate, 0, self.seq, self.rows, self.n_embd)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> GateHeader:
        layer, gate, flags, seq, rows, n_embd = GATE_HEADER.unpack_from(data)
        if gate not in (Gate.ATTN, Gate.FFN) or flags:
            raise TpProtocolError(
                f"bad gate header: gate {gate} (0 ATTN, 1 FFN), flags {flags:#x} (must be 0)"
            )
        return cls(layer, Gate(gate), seq, rows, n_embd)

    def describe(self) -> str:
        return (
            f"layer {self.layer} gate {self.gate.name} seq {self.seq} ({self.rows} x {self.n_embd})"
        )


# Shared-memory slab. Header: magic u32, version u16, flags u16, n_embd u32, slot_rows u32,
# slot_stride u64, total bytes u64, state u32 per rank (0 absent, 1 attached, 2 closed), padded
# to 64 bytes. Then four slots: rank 0 parity 0, rank 0 parity 1, rank 1 parity 0, rank 1 parity 1.
SLAB_HEADER = struct.Struct("<IHHIIQQII24x")
SLAB_STATE_OFFSET = 32  # the two u32 state words
SLAB_ABSENT, SLAB_ATTACHED, SLAB_CLOSED = 0, 1, 2
# Slab flag: writers fill each slot's crc32 and readers check it (needed where stores may become
# visible out of order, see transport/gates.py).
SLAB_FLAG_CHECKSUM = 1
# Slot header: seq_begin u64, pub u64, gate header (20), crc32 u32, padded to 64 bytes. The
# data follows at +64; seq_end u64 sits in the 64 bytes after the data area.
SLOT_HEADER = struct.Struct(f"<QQ{GATE_HEADER_SIZE}sI24x")
SLOT_CRC_START = 8  # the checksum covers pub, the gate header, then the data
SLOT_CRC_END = 8 + 8 + GATE_HEADER_SIZE
SLAB_ALIGN = 64
# One slab round moves at most this many bytes per rank: large enough that a prefill partial is
# a few rounds, small enough that the slab of a big model stays a few MiB.
SLAB_ROUND_BYTES = 1024 * 1024


def _align(n: int) -> int:
    return -(-n // SLAB_ALIGN) * SLAB_ALIGN


@dataclass(frozen=True)
class SlabLayout:
    """Offsets of the shared-memory slab for a model of width ``n_embd`` (see the docs).

    Each rank owns two slots and publishes round ``pub`` in slot ``pub % 2``: a rank can only
    reach round ``pub + 2`` after reading the peer's ``pub + 1``, which the peer publishes after
    it has finished reading our ``pub``, so a slot is never rewritten while being read.
    """

    n_embd: int

    def __post_init__(self) -> None:
        _check_range("SlabLayout", "n_embd", self.n_embd, 1, _U32)

    @property
    def slot_rows(self) -> int:
        return max(DS4_TP_BATCH_MAX_ROWS, SLAB_ROUND_BYTES // (4 * self.n_embd))

    @property
    def data_capacity(self) -> int:
        return _align(4 * self.slot_rows * self.n_embd)

    @property
    def slot_stride(self) -> int:
        return SLOT_HEADER.size + self.data_capacity + SLAB_ALIGN

    @property
    def total_bytes(self) -> int:
        return SLAB_HEADER.size + 4 * self.slot_stride

    def slot_offset(self, rank: int, parity: int) -> int:
        return SLAB_HEADER.size + (2 * rank + parity) * self.slot_stride

    def data_offset(self, rank: int, parity: int) -> int:
        return self.slot_offset(rank, parity) + SLOT_HEADER.size

    def seq_end_offset(self, rank: int, parity: int) -> int:
        return self.data_offset(rank, parity) + self.data_capacity

    def header_bytes(self, *, checksum: bool) -> bytes:
        flags = SLAB_FLAG_CHECKSUM if checksum else 0
        return SLAB_HEADER.pack(
            TP_SLAB_MAGIC, TP_PROTOCOL_VERSION, flags, self.n_embd, self.slot_rows,
            self.slot_stride, self.total_bytes, SLAB_ABSENT, SLAB_ABSENT,
        )  # fmt: skip

    def check_header(self, data: Buffer) -> bool:
        """Raise :class:`TpProtocolError` unless ``data`` starts with this layout's header;
        return whether the slab's rounds carry checksums."""
        got = SLAB_HEADER.unpack_from(data)
        want = SLAB_HEADER.unpack(self.header_bytes(checksum=bool(got[2] & SLAB_FLAG_CHECKSUM)))
        names = ("magic", "version", "flags", "n_embd", "slot_rows", "slot_stride", "bytes")
        for name, g, w in zip(names, got[:7], want[:7], strict=True):
            if g != w:
                raise TpProtocolError(
                    f"shared-memory slab {name} is {g}, expected {w}: the slab was made by "
                    "another foundry release or for another model"
                )
        return bool(got[2] & SLAB_FLAG_CHECKSUM)


def slab_bytes(n_embd: int) -> int:
    """Size of the shared-memory slab for a model of width ``n_embd``."""
    return SlabLayout(n_embd).total_bytes
