"""The tensor-parallel protocol (seed: ``ds4_tp.h``, two ranks; N ranks by our extension) as a
sans-IO codec.

Three byte formats live here, none of them touching a socket:

- the **hello** (184 bytes), the first thing each rank sends on the control socket: protocol
  version, role, the execution mode, the engine :class:`Identity` and the shared-memory offer;
  in a world that is not the plain pair (N > 2 ranks, or unequal shares) 40 more bytes, the
  :class:`WorldInfo` (world size, rank, gate port, shares), flagged ``HELLO_WORLD``;
- the **control frames** the leader mirrors to the worker (and the worker's replies): a 28-byte
  header, then a payload laid out per type, numbered exactly as ``ds4_tp_frame_type``; each
  frame's fixed part is a ``Layout`` (``foundry.wire.layout``, the form FDTC and the frontend
  link use too), its variable part (tokens, batch items, a LOGITS half) written next to it;
- the **gate header** (20 bytes) that tags every partial on the data plane, and the layout of
  the shared-memory slab that carries the partials when both ranks share a host.

Theory of operation
-------------------
Each rank sends its hello, then reads the peer's. A :class:`TpDecoder` made with
``expect_hello=True`` accepts exactly one hello as the first record and checks the peer's
version from its first 8 bytes, before trusting any other field; :func:`check_hello` then
compares roles, identities and execution modes and raises with the field name and both values.
After the hello
the control socket carries control frames only. The decoder validates each frame header (magic,
type, flags, length against ``max_payload`` and against the type's legal sizes) as soon as its
28 bytes are in, before waiting for the payload. Short input means "feed me more" (``None``);
bad input raises :class:`TpProtocolError` and leaves the decoder failed for good: the caller
closes the connection and re-handshakes.

Every layout is little-endian and packed (``struct`` formats start with ``<``); every struct's
size is asserted in ``tests/test_tp_wire.py``. ``docs/protocol.md`` (tensor-parallel part)
documents every byte.
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np

from foundry.model.tp_split import (  # the model's sync points, tagged on the data plane
    MAX_SHARE,
    MAX_WORLD,
    Gate,
)
from foundry.wire.errors import IdentityMismatch as IdentityMismatch
from foundry.wire.errors import LocalProtocolError
from foundry.wire.errors import TpProtocolError as TpProtocolError
from foundry.wire.errors import VersionMismatch as VersionMismatch
from foundry.wire.framing import FrameDecoder
from foundry.wire.layout import BOOL, I32, U32, U64, Enum, Layout

if TYPE_CHECKING:
    from typing_extensions import Buffer

# -- constants ---------------------------------------------------------------------------------

Readable = bytes | bytearray | memoryview  # what a payload may be read from

TP_PROTOCOL_VERSION = 2  # 2: the hello ends with the model's architecture (16 bytes)
# On the wire the magics read as ASCII: "DTPH" (hello), "DTP4" (control frame), "DTPS" (slab).
TP_HELLO_MAGIC = int.from_bytes(b"DTPH", "little")
TP_FRAME_MAGIC = int.from_bytes(b"DTP4", "little")
TP_SLAB_MAGIC = int.from_bytes(b"DTPS", "little")

# ds4_tp_identity.gate_slot_mask is DS4_TP_GATE_MASK_WORDS u64 words: one bit per gate slot in
# firing order, 256 slots, enough for 128 layers that each fire ATTN and FFN.
DS4_TP_GATE_MASK_WORDS = 4
# Rows of one verify block (the seed row plus the drafted tokens): DS4_TP_BATCH_MAX_ROWS.
DS4_TP_BATCH_MAX_ROWS = 8
# VERIFY flag bits, as in the seed (DS4_TP_VERIFY_FLAGS is their union).
DS4_TP_VERIFY_HEAD_SPLIT = 1
DS4_TP_VERIFY_DSPARK_TP = 2
DS4_TP_VERIFY_DSPARK_SEED = 4
DS4_TP_VERIFY_FLAGS = DS4_TP_VERIFY_HEAD_SPLIT | DS4_TP_VERIFY_DSPARK_TP | DS4_TP_VERIFY_DSPARK_SEED

# Hello flag bits.
HELLO_SHM_OFFERED = 1
HELLO_WORLD = 2  # the world extension follows the pair's 184 bytes (N ranks, shares)
HELLO_FLAGS = HELLO_SHM_OFFERED | HELLO_WORLD
# The most ranks of a world, and a share's bound (u16): as model.tp_split, which cuts by them.
TP_MAX_WORLD = MAX_WORLD
TP_MAX_SHARE = MAX_SHARE
# Execution mode bits (the hello's u16 at offset 10), the seed's numbers: the flags that
# ds4_tp_agree_execution_mode compares. Both ranks must state the same mode.
DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT = 1  # every routed expert cut by its intermediate size
DS4_TP_MODE_V41_SHARED_OWNER = 2
DS4_TP_MODE_V41_SHARED_BALANCE = 4
DS4_TP_MODE_V41_DSPARK = 8
# The bits this implementation runs; the seed's others are refused on receipt.
EXECUTION_MODE_BITS = DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT
HOST_ID_BYTES = 16
ARCH_BYTES = 16  # the architecture name at the end of the hello, NUL-padded ASCII
ARCH_PATTERN = re.compile(r"[a-z0-9_-]{1,16}")
SHM_NAME_BYTES = 64
# A slab name is a bare file name (it is opened under the shared-memory directory), at most 63
# bytes so that the C char[64] field always ends in a NUL.
SHM_NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,62}")

# Sessions in one EVAL_BATCH / MIXED_BATCH step: far more than a two-rank pair decodes at once,
# and it bounds those frames at 16 KiB of items.
TP_MAX_BATCH_ITEMS = 1024
# Bound on a control payload before the hello, when the model is not known yet: the hello and
# a peer's first frames are small, and a corrupt length field can never make a rank buffer more
# than this. After the hellos each rank's decoder takes max_payload_for(identity, rows).
TP_MAX_PAYLOAD = 16 * 1024 * 1024

_U8, _U16, _U32, _U64 = (1 << 8) - 1, (1 << 16) - 1, (1 << 32) - 1, (1 << 64) - 1
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _check_range(owner: str, name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise LocalProtocolError(
            f"{owner}.{name} must be an integer in [{lo}, {hi}], got {value!r}"
        )


def _check_tokens(owner: str, name: str, tokens: tuple[int, ...]) -> None:
    if tokens and (min(tokens) < _I32_MIN or max(tokens) > _I32_MAX):
        raise LocalProtocolError(f"{owner}.{name} holds a token outside int32")


# -- identity and hello ------------------------------------------------------------------------


class Role(enum.IntEnum):
    LEADER = 0
    WORKER = 1


@dataclass(frozen=True, kw_only=True)
class Identity:
    """``ds4_tp_identity``: what both ranks must agree on before any inference runs.

    The gate schedule (``gate_slot_*``, ``gates_per_token``) is carried as the seed defines it:
    a nonempty mask lists the slots in firing order, otherwise
    ``slot(seq) = start + ((seq - 1) % per_token) * step``, per_token 0 meaning every slot.
    """

    gguf_bytes: int
    model_id: int
    n_layer: int
    n_embd: int
    n_vocab: int
    quant_bits: int
    ctx_size: int
    gate_slot_start: int = 0
    gate_slot_step: int = 1
    gates_per_token: int = 0
    gate_slot_mask: tuple[int, ...] = (0,) * DS4_TP_GATE_MASK_WORDS

    def __post_init__(self) -> None:
        _check_range("Identity", "gguf_bytes", self.gguf_bytes, 0, _U64)
        for f in fields(self)[1:-1]:
            _check_range("Identity", f.name, getattr(self, f.name), 0, _U32)
        if len(self.gate_slot_mask) != DS4_TP_GATE_MASK_WORDS:
            raise LocalProtocolError(
                f"Identity.gate_slot_mask must have {DS4_TP_GATE_MASK_WORDS} words, "
                f"got {len(self.gate_slot_mask)}"
            )
        for word in self.gate_slot_mask:
            _check_range("Identity", "gate_slot_mask", word, 0, _U64)


# magic u32, version u16, hello_size u16: the part of a hello that no version will ever move,
# so a peer of another version is told so instead of being misparsed.
HELLO_PREFIX = struct.Struct("<IHH")
# role u8, flags u8, execution_mode u16
_HELLO_ROLE = struct.Struct("<BBH")
# gguf_bytes u64, model_id .. gates_per_token 9 x u32, gate_slot_mask 4 x u64 (packed: the C
# struct in memory has 4 bytes of padding before the mask, the wire does not).
IDENTITY = struct.Struct(f"<Q9I{DS4_TP_GATE_MASK_WORDS}Q")
HELLO = struct.Struct(
    f"<IHHBBH{IDENTITY.format[1:]}{HOST_ID_BYTES}s{SHM_NAME_BYTES}s{ARCH_BYTES}s"
)
HELLO_SIZE = HELLO.size
# The world extension: world_size u16, rank u16, gate_port u16, reserved u16, shares 16 x u16.
WORLD_EXT = struct.Struct(f"<HHHH{MAX_WORLD}H")
HELLO_WORLD_SIZE = HELLO_SIZE + WORLD_EXT.size


@dataclass(frozen=True, kw_only=True)
class WorldInfo:
    """The hello's world extension (``HELLO_WORLD``): what a world of N ranks agrees on beyond
    the pair. ``rank``: the leader 0; a worker the rank it asks for, 0 for the next free one.
    ``gate_port``: a worker's port for gate connections from higher ranks (N > 2), else 0.
    ``shares``: one per rank, rank 0 first (``tp_split.norm_shares``)."""

    world_size: int
    shares: tuple[int, ...]
    rank: int = 0
    gate_port: int = 0

    def __post_init__(self) -> None:
        _check_range("WorldInfo", "world_size", self.world_size, 2, MAX_WORLD)
        _check_range("WorldInfo", "rank", self.rank, 0, self.world_size - 1)
        _check_range("WorldInfo", "gate_port", self.gate_port, 0, _U16)
        object.__setattr__(self, "shares", tuple(self.shares))
        if len(self.shares) != self.world_size:
            raise LocalProtocolError(
                f"WorldInfo.shares holds {len(self.shares)} shares for a world of "
                f"{self.world_size}"
            )
        for share in self.shares:
            _check_range("WorldInfo", "shares", share, 1, MAX_SHARE)
        if self.world_size == 2 and len(set(self.shares)) == 1:
            raise LocalProtocolError(
                "WorldInfo of the plain pair (2 ranks, equal shares): that pair sends no "
                "world extension"
            )

    def encode(self) -> bytes:
        shares = self.shares + (0,) * (MAX_WORLD - self.world_size)
        return WORLD_EXT.pack(self.world_size, self.rank, self.gate_port, 0, *shares)

    @classmethod
    def decode(cls, buf: Readable, offset: int = 0) -> WorldInfo:
        world, rank, port, reserved, *shares = WORLD_EXT.unpack_from(buf, offset)
        if reserved:
            raise TpProtocolError(f"hello: world extension reserved word is {reserved}, not 0")
        if not 2 <= world <= MAX_WORLD:
            raise TpProtocolError(f"hello: world size {world} outside [2, {MAX_WORLD}]")
        if any(shares[world:]):
            raise TpProtocolError(f"hello: shares beyond the world of {world} are not 0")
        try:
            return cls(world_size=world, rank=rank, gate_port=port, shares=tuple(shares[:world]))
        except LocalProtocolError as exc:
            raise TpProtocolError(f"hello: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class Hello:
    """The first record on the control socket, from each rank.

    ``shm_offered`` says this rank can use a shared-memory slab; the leader also names the slab
    it created (``shm_name``). ``host_id`` identifies the machine (and container): the slab is
    used only when both ranks offered it and their host ids are equal (see
    :func:`negotiate_gate_transport`). ``execution_mode`` holds the ``DS4_TP_MODE_*`` bits of
    how this rank's weights are cut; both ranks must state the same.
    """

    role: Role
    identity: Identity
    host_id: bytes = bytes(HOST_ID_BYTES)
    shm_offered: bool = False
    shm_name: str = ""
    version: int = TP_PROTOCOL_VERSION
    execution_mode: int = 0
    architecture: str = "llama"  # the file's general.architecture
    world: WorldInfo | None = None  # the extension: absent in the plain pair

    @property
    def size(self) -> int:
        return HELLO_SIZE if self.world is None else HELLO_WORLD_SIZE

    def __post_init__(self) -> None:
        _check_range("Hello", "version", self.version, 0, _U16)
        if self.world is not None and not isinstance(self.world, WorldInfo):
            raise LocalProtocolError(f"Hello.world must be a WorldInfo, got {self.world!r}")
        if not ARCH_PATTERN.fullmatch(self.architecture):
            raise LocalProtocolError(
                f"Hello.architecture {self.architecture!r} is not 1-16 characters of "
                "[a-z0-9_-]"
            )
        _check_range("Hello", "execution_mode", self.execution_mode, 0, _U16)
        if self.execution_mode & ~EXECUTION_MODE_BITS:
            raise LocalProtocolError(
                f"Hello.execution_mode {self.execution_mode:#x} has bits this implementation "
                f"does not run (supported: {EXECUTION_MODE_BITS:#x})"
            )
        if not isinstance(self.role, Role):
            raise LocalProtocolError(f"Hello.role must be a Role, got {self.role!r}")
        if len(self.host_id) != HOST_ID_BYTES:
            raise LocalProtocolError(
                f"Hello.host_id must be {HOST_ID_BYTES} bytes, got {len(self.host_id)}"
            )
        if self.shm_name and not self.shm_offered:
            raise LocalProtocolError("Hello.shm_name is set but shm_offered is False")
        if self.shm_name and not SHM_NAME_PATTERN.fullmatch(self.shm_name):
            raise LocalProtocolError(
                f"Hello.shm_name {self.shm_name!r} is not a bare file name of at most 63 "
                "characters from [A-Za-z0-9._-]"
            )


class GateTransport(enum.Enum):
    TCP = "tcp"
    SHM = "shm"


def negotiate_gate_transport(a: Hello, b: Hello) -> GateTransport:
    """The data plane both ranks will use, from the two hellos (in either order).

    Shared memory when both ranks offered it, their host ids are equal (and not all zero, which
    means "unknown") and the leader named a slab; TCP otherwise. Both ranks compute the same
    answer from the same two hellos, so no further message is needed.
    """
    leader = a if a.role is Role.LEADER else b
    same_host = a.host_id == b.host_id and any(a.host_id)
    if a.shm_offered and b.shm_offered and same_host and leader.shm_name:
        return GateTransport.SHM
    return GateTransport.TCP


_IDENTITY_HINTS = {
    "ctx_size": "start both ranks with the same context size",
    "gate_slot_start": "both ranks must load the same GGUF file with the same foundry release",
    "gate_slot_step": "both ranks must load the same GGUF file with the same foundry release",
    "gates_per_token": "both ranks must load the same GGUF file with the same foundry release",
    "gate_slot_mask": "both ranks must load the same GGUF file with the same foundry release",
}
_SAME_GGUF = "both ranks must load the same GGUF file"


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(f"{word:#x}" for word in value) + "]"
    return str(value)


def check_identity(mine: Identity, peer: Identity, *, mine_role: Role = Role.LEADER) -> None:
    """Raise :class:`IdentityMismatch` naming the first differing field and both values."""
    leader, worker = (mine, peer) if mine_role is Role.LEADER else (peer, mine)
    for f in fields(Identity):
        lv, wv = getattr(leader, f.name), getattr(worker, f.name)
        if lv != wv:
            raise IdentityMismatch(
                f"identity mismatch on {f.name}: leader has {_show(lv)}, worker has {_show(wv)}; "
                f"{_IDENTITY_HINTS.get(f.name, _SAME_GGUF)}"
            )


def expert_split_name(execution_mode: int) -> str:
    """The ``--expert-split`` value an execution mode stands for."""
    return "intermediate" if execution_mode & DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT else "experts"


def check_execution_mode(mine: Hello, peer: Hello) -> None:
    """Raise :class:`IdentityMismatch` unless both ranks cut their weights the same way
    (``ds4_tp_agree_execution_mode``), naming the field and both values, leader first."""
    leader, worker = (mine, peer) if mine.role is Role.LEADER else (peer, mine)
    lv, wv = leader.execution_mode, worker.execution_mode
    if (lv ^ wv) & DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT:
        raise IdentityMismatch(
            f"execution mode mismatch on expert_split: leader has {expert_split_name(lv)}, "
            f"worker has {expert_split_name(wv)}; start both ranks with the same --expert-split"
        )
    if lv != wv:
        raise IdentityMismatch(
            f"execution mode mismatch: leader has {lv:#x}, worker has {wv:#x}; run the same "
            "foundry release with the same flags on both ranks"
        )


def _shares_text(world: WorldInfo | None) -> str:
    return "1,1 (the plain pair)" if world is None else ",".join(map(str, world.shares))


class WorldMismatch(IdentityMismatch):
    """The hellos state different worlds. A worker's first hello states none (it learns the
    world from the leader's hello), so this one is expected once: the worker dials again with
    the leader's world."""


def check_world(mine: Hello, peer: Hello) -> None:
    """Raise :class:`WorldMismatch` unless both hellos state the same world: both the plain
    pair, or the same world size and shares (every rank's slice), leader first."""
    leader, worker = (mine, peer) if mine.role is Role.LEADER else (peer, mine)
    lw, ww = leader.world, worker.world
    lsize, wsize = (2 if w is None else w.world_size for w in (lw, ww))
    if lsize != wsize:
        raise WorldMismatch(
            f"world mismatch on world_size: leader has {lsize}, worker has {wsize}; the "
            "worker dials again with the leader's world"
        )
    if _shares_text(lw) != _shares_text(ww):
        raise WorldMismatch(
            f"world mismatch on shares: leader has {_shares_text(lw)}, worker has "
            f"{_shares_text(ww)}; the worker dials again with the leader's world"
        )
    if lw is not None and lw.rank != 0:
        raise IdentityMismatch(f"world mismatch on rank: the leader states rank {lw.rank}, not 0")


def check_hello(mine: Hello, peer: Hello) -> None:
    """Everything both ranks must agree on before any inference: version, roles, identity,
    execution mode."""
    if mine.version != peer.version:
        raise VersionMismatch(_version_message(mine.version, peer.version))
    if mine.role is peer.role:
        other = Role.WORKER if mine.role is Role.LEADER else Role.LEADER
        raise IdentityMismatch(
            f"role mismatch: both ranks say they are the {mine.role.name.lower()}; "
            f"start exactly one rank as the {other.name.lower()}"
        )
    check_identity(mine.identity, peer.identity, mine_role=mine.role)
    check_world(mine, peer)
    if mine.architecture != peer.architecture:
        raise IdentityMismatch(
            f"architecture mismatch: this rank runs {mine.architecture!r}, the peer "
            f"{peer.architecture!r}; load the same model file on both ranks"
        )
    check_execution_mode(mine, peer)


def _version_message(mine: int, peer: int) -> str:
    return (
        f"TP protocol version mismatch: this rank speaks version {mine}, the peer speaks "
        f"version {peer}; run the same foundry release on both ranks"
    )


def _encode_hello(h: Hello) -> bytes:
    i = h.identity
    flags = (HELLO_SHM_OFFERED if h.shm_offered else 0) | (HELLO_WORLD if h.world else 0)
    base = HELLO.pack(
        TP_HELLO_MAGIC, h.version, h.size, h.role, flags, h.execution_mode,
        i.gguf_bytes, i.model_id, i.n_layer, i.n_embd, i.n_vocab, i.quant_bits, i.ctx_size,
        i.gate_slot_start, i.gate_slot_step, i.gates_per_token, *i.gate_slot_mask,
        h.host_id, h.shm_name.encode(), h.architecture.encode(),
    )  # fmt: skip
    return base if h.world is None else base + h.world.encode()


def _decode_hello(buf: Readable, offset: int) -> Hello:
    v = HELLO.unpack_from(buf, offset)
    version, size, role, flags, mode = v[1], v[2], v[3], v[4], v[5]
    if role not in (Role.LEADER, Role.WORKER):
        raise TpProtocolError(f"hello: unknown role {role} (0 leader, 1 worker)")
    if flags & ~HELLO_FLAGS:
        raise TpProtocolError(f"hello: unknown flags {flags:#x}")
    if bool(flags & HELLO_WORLD) != (size == HELLO_WORLD_SIZE):
        raise TpProtocolError(
            f"hello: the world flag is {'set' if flags & HELLO_WORLD else 'clear'} but the hello "
            f"is {size} bytes ({HELLO_WORLD_SIZE} with the world extension, {HELLO_SIZE} without)"
        )
    world = WorldInfo.decode(buf, offset + HELLO_SIZE) if flags & HELLO_WORLD else None
    if mode & ~EXECUTION_MODE_BITS:
        raise TpProtocolError(
            f"hello: execution mode {mode:#x} has bits this implementation does not run "
            f"(supported: {EXECUTION_MODE_BITS:#x}: {DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT} = "
            "experts cut by their intermediate size)"
        )
    raw_arch = v[-1].rstrip(b"\0")
    v = v[:-1]
    raw_name = v[-1].rstrip(b"\0")
    try:
        name = raw_name.decode()
    except UnicodeDecodeError:
        raise TpProtocolError(f"hello: shm name {raw_name!r} is not UTF-8") from None
    try:
        identity = Identity(
            gguf_bytes=v[6], model_id=v[7], n_layer=v[8], n_embd=v[9], n_vocab=v[10],
            quant_bits=v[11], ctx_size=v[12], gate_slot_start=v[13], gate_slot_step=v[14],
            gates_per_token=v[15], gate_slot_mask=tuple(v[16:-2]),
        )  # fmt: skip
        return Hello(
            role=Role(role),
            identity=identity,
            host_id=v[-2],
            shm_offered=bool(flags & HELLO_SHM_OFFERED),
            shm_name=name,
            version=version,
            execution_mode=mode,
            architecture=raw_arch.decode("ascii", errors="replace"),
            world=world,
        )
    except LocalProtocolError as exc:
        raise TpProtocolError(f"hello: {exc}") from None


# -- control frames ----------------------------------------------------------------------------


class FrameType(enum.IntEnum):
    """``ds4_tp_frame_type``, the same numbers (DS4_TP_FRAME_ERROR = -1 is a C return code,
    never a wire value). Types in :data:`UNSUPPORTED_FRAME_TYPES` are reserved: receiving one is
    a protocol error."""

    SYNC = 1
    EVAL = 2
    REWIND = 3
    INVALIDATE = 4
    STOP = 5
    HASH = 6
    RDMA_INFO = 7
    SYNC_ACK = 8
    RDMA_READY = 9
    LOGITS = 10
    VERIFY = 11
    VERIFY_COMMIT = 12
    SESSION_CREATE = 13
    SESSION_DESTROY = 14
    EVAL_BATCH = 15
    MIXED_BATCH = 16
    COMMAND_ACK = 17
    SYNC_MULTIMODAL = 18
    RDMA_WARM = 19
    RDMA_POSTED = 20
    GLM_MTP = 21
    SYNC_CHECKPOINT = 22
    DSPARK_DRAFT = 23
    SPEC_RESTORE = 24
    WORLD = 32  # Foundry's extension: the table of a world's workers (N > 2)


_NO_RDMA = "RDMA bring-up; this implementation has no RDMA (the slab is negotiated in the hello)"
UNSUPPORTED_FRAME_TYPES: dict[FrameType, str] = {
    FrameType.RDMA_INFO: _NO_RDMA,
    FrameType.SYNC_ACK: "a seed acknowledgement this implementation replaces by COMMAND_ACK",
    FrameType.RDMA_READY: _NO_RDMA,
    FrameType.SYNC_MULTIMODAL: "multimodal prefill; the model has no vision input",
    FrameType.RDMA_WARM: _NO_RDMA,
    FrameType.RDMA_POSTED: _NO_RDMA,
    FrameType.GLM_MTP: "GLM multi-token prediction; not part of this model",
    FrameType.DSPARK_DRAFT: "the DSpark drafter; not part of this model",
    FrameType.SPEC_RESTORE: "state-only restore; rollback goes through VERIFY_COMMIT",
}


class VerifyCommitMode(enum.IntEnum):
    """``ds4_tp_verify_commit_mode``."""

    ROLLBACK_REPLAY = 0
    COMMIT_FULL = 1
    COMMIT_PREFIX = 2


# magic u32, type u8, flags u8, reserved u16, session_id u64, seq u64, length u32
FRAME_HEADER = struct.Struct("<IBBHQQI")
FRAME_HEADER_SIZE = FRAME_HEADER.size
# ds4_tp_batch_item: session_id u64, token i32, reserved u32
BATCH_ITEM = struct.Struct("<QiI")
_U32S = struct.Struct("<I")
_U32X2 = struct.Struct("<II")


def _pack_tokens(tokens: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def _unpack_tokens(buf: Readable, offset: int, count: int) -> tuple[int, ...]:
    return struct.unpack_from(f"<{count}i", buf, offset)


class _Layout(Layout):
    error = TpProtocolError


@dataclass(frozen=True, kw_only=True)
class _Frame:
    """Fields every control frame carries in its header, and its payload's fixed part.

    ``session_id`` names the inference session a command applies to (0 where none does);
    ``seq`` is the leader's command sequence number, echoed where the seed has one (EVAL, HASH).
    ``LAYOUT`` declares the payload's fixed part (``foundry.wire.layout``, the FDTC codec's
    form): its fields are validated when the frame is built, packed, and unpacked. A frame
    with a variable part after it (tokens, items, a LOGITS half) adds ``_tail`` and
    ``_parse_tail``. Payload sizes: every legal payload length is
    ``PAYLOAD_BASE + k * PAYLOAD_UNIT``, the base being the fixed part's size unless a frame
    says otherwise (counts that are no field of its own).
    """

    TYPE: ClassVar[FrameType]
    LAYOUT: ClassVar[_Layout] = _Layout()
    PAYLOAD_BASE: ClassVar[int] = 0
    PAYLOAD_UNIT: ClassVar[int] = 0

    session_id: int = 0
    seq: int = 0

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "PAYLOAD_BASE" not in cls.__dict__:
            cls.PAYLOAD_BASE = cls.LAYOUT.size

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_range(owner, "session_id", self.session_id, 0, _U64)
        _check_range(owner, "seq", self.seq, 0, _U64)
        self.LAYOUT.normalise(self)

    def _tail(self) -> bytes:
        return b""

    def _payload_parts(self) -> tuple[bytes | memoryview, ...]:
        return (self.LAYOUT.pack_obj(self) + self._tail(),)

    @classmethod
    def _parse_tail(cls, buf: Readable, offset: int, length: int) -> dict[str, Any]:
        """The fields of the variable part, ``length`` bytes from ``offset``."""
        return {}

    @classmethod
    def _parse(cls, buf: Readable, offset: int, length: int, **header: int) -> Self:
        size = cls.LAYOUT.size
        fixed = cls.LAYOUT.unpack(memoryview(buf), offset)
        return cls(**fixed, **cls._parse_tail(buf, offset + size, length - size), **header)


@dataclass(frozen=True, kw_only=True)
class Sync(_Frame):
    """Prefill: bring the session's context to exactly ``tokens`` (int32 array)."""

    TYPE = FrameType.SYNC
    PAYLOAD_UNIT = 4
    tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "tokens", tuple(self.tokens))
        _check_tokens("Sync", "tokens", self.tokens)

    def _tail(self) -> bytes:
        return _pack_tokens(self.tokens)

    @classmethod
    def _parse_tail(cls, buf: Readable, offset: int, length: int) -> dict[str, Any]:
        return {"tokens": _unpack_tokens(buf, offset, length // 4)}


@dataclass(frozen=True, kw_only=True)
class Eval(_Frame):
    """Decode one token (the header's ``seq`` numbers the step)."""

    TYPE = FrameType.EVAL
    LAYOUT = _Layout(("token", I32))
    token: int


@dataclass(frozen=True, kw_only=True)
class Rewind(_Frame):
    """Truncate the session's context to ``pos`` tokens."""

    TYPE = FrameType.REWIND
    LAYOUT = _Layout(("pos", I32))
    pos: int


@dataclass(frozen=True, kw_only=True)
class Invalidate(_Frame):
    """Drop the session's cached context (the next SYNC starts from scratch)."""

    TYPE = FrameType.INVALIDATE


@dataclass(frozen=True, kw_only=True)
class Stop(_Frame):
    """The leader is shutting the pair down; the worker leaves its loop."""

    TYPE = FrameType.STOP


@dataclass(frozen=True, kw_only=True)
class Hash(_Frame):
    """Debug lockstep check: a rank's hidden-state hash for step ``seq``."""

    TYPE = FrameType.HASH
    LAYOUT = _Layout(("value", U64))
    value: int


@dataclass(frozen=True, kw_only=True)
class Logits(_Frame):
    """The worker's half of the vocabulary logits: count u32, then count float32.

    ``values`` holds the raw little-endian float32 bytes, as a read-only view where it can:
    of the sender's array (``from_array``: send the frame before that array changes) or of
    the received payload's own buffer. :meth:`array` views them as numpy. No step of the way
    from the worker's rows to the leader's array copies them: they are written from the
    array and read into the buffer they are parsed from.
    """

    TYPE = FrameType.LOGITS
    PAYLOAD_BASE = 4
    PAYLOAD_UNIT = 4
    values: bytes | memoryview = b""

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.values) % 4:
            raise LocalProtocolError(
                f"Logits.values must be whole float32s, got {len(self.values)} bytes"
            )

    @classmethod
    def from_array(cls, half: np.ndarray, *, session_id: int = 0, seq: int = 0) -> Logits:
        view = np.ascontiguousarray(half, dtype="<f4").data.cast("B").toreadonly()
        return cls(values=view, session_id=session_id, seq=seq)

    def array(self) -> np.ndarray:
        return np.frombuffer(self.values, dtype="<f4")

    def _payload_parts(self) -> tuple[bytes | memoryview, ...]:
        return _U32S.pack(len(self.values) // 4), self.values

    @classmethod
    def _parse(cls, buf: Readable, offset: int, length: int, **header: int) -> Self:
        # count u32 then the floats: the view of the payload is the frame's, no tail copied
        (count,) = _U32S.unpack_from(buf, offset)
        if 4 + 4 * count != length:
            raise TpProtocolError(
                f"LOGITS says {count} floats but its payload is {length} bytes "
                f"(expected {4 + 4 * count})"
            )
        return cls(values=memoryview(buf)[offset + 4 : offset + length], **header)


@dataclass(frozen=True, kw_only=True)
class Verify(_Frame):
    """Speculative decoding: verify the block ``drafts`` (1..8 rows) with ``flags``."""

    TYPE = FrameType.VERIFY
    LAYOUT = _Layout(("flags", U32))
    PAYLOAD_UNIT = 4
    drafts: tuple[int, ...] = ()
    flags: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "drafts", tuple(self.drafts))
        if not 1 <= len(self.drafts) <= DS4_TP_BATCH_MAX_ROWS:
            raise LocalProtocolError(
                f"Verify.drafts must hold 1..{DS4_TP_BATCH_MAX_ROWS} rows, got {len(self.drafts)}"
            )
        _check_tokens("Verify", "drafts", self.drafts)
        if self.flags & ~DS4_TP_VERIFY_FLAGS:
            raise LocalProtocolError(
                f"Verify.flags has unknown bits {self.flags & ~DS4_TP_VERIFY_FLAGS:#x}"
            )

    def _tail(self) -> bytes:
        return _pack_tokens(self.drafts)

    @classmethod
    def _parse_tail(cls, buf: Readable, offset: int, length: int) -> dict[str, Any]:
        return {"drafts": _unpack_tokens(buf, offset, length // 4)}


@dataclass(frozen=True, kw_only=True)
class VerifyCommit(_Frame):
    """How the verified block ends: full commit, prefix commit, or rollback then replay."""

    TYPE = FrameType.VERIFY_COMMIT
    LAYOUT = _Layout(("mode", Enum("i", VerifyCommitMode)), ("token_count", I32))
    mode: VerifyCommitMode
    token_count: int


@dataclass(frozen=True, kw_only=True)
class SessionCreate(_Frame):
    """Open session ``session_id`` with a context of ``ctx_size`` tokens."""

    TYPE = FrameType.SESSION_CREATE
    LAYOUT = _Layout(("ctx_size", U32))
    ctx_size: int


@dataclass(frozen=True, kw_only=True)
class SessionDestroy(_Frame):
    """Close session ``session_id`` and free its KV cache."""

    TYPE = FrameType.SESSION_DESTROY


@dataclass(frozen=True)
class BatchItem:
    """``ds4_tp_batch_item`` without its reserved word (always 0 on the wire)."""

    session_id: int
    token: int

    def __post_init__(self) -> None:
        _check_range("BatchItem", "session_id", self.session_id, 0, _U64)
        _check_range("BatchItem", "token", self.token, _I32_MIN, _I32_MAX)


def _check_items(owner: str, items: tuple[BatchItem, ...]) -> None:
    if len(items) > TP_MAX_BATCH_ITEMS:
        raise LocalProtocolError(f"{owner}.items holds {len(items)} > {TP_MAX_BATCH_ITEMS} items")
    for item in items:
        if not isinstance(item, BatchItem):
            raise LocalProtocolError(f"{owner}.items must hold BatchItem, got {item!r}")


def _pack_items(items: tuple[BatchItem, ...]) -> bytes:
    return b"".join(BATCH_ITEM.pack(it.session_id, it.token, 0) for it in items)


def _unpack_items(buf: Readable, offset: int, count: int) -> tuple[BatchItem, ...]:
    items = []
    for sid, token, reserved in BATCH_ITEM.iter_unpack(buf[offset : offset + 16 * count]):
        if reserved:
            raise TpProtocolError(f"batch item for session {sid}: nonzero reserved word")
        items.append(BatchItem(sid, token))
    return tuple(items)


@dataclass(frozen=True, kw_only=True)
class EvalBatch(_Frame):
    """One decode step for several sessions: one token each (``ds4_tp_batch_item`` array)."""

    TYPE = FrameType.EVAL_BATCH
    PAYLOAD_UNIT = BATCH_ITEM.size
    items: tuple[BatchItem, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "items", tuple(self.items))
        _check_items("EvalBatch", self.items)

    def _tail(self) -> bytes:
        return _pack_items(self.items)

    @classmethod
    def _parse_tail(cls, buf: Readable, offset: int, length: int) -> dict[str, Any]:
        return {"items": _unpack_items(buf, offset, length // BATCH_ITEM.size)}


@dataclass(frozen=True, kw_only=True)
class MixedBatch(_Frame):
    """A prefill of ``prompt`` for session ``session_id`` fused with one decode step for
    ``items``. Payload: prompt_count u32, item_count u32, the prompt (int32), the items."""

    TYPE = FrameType.MIXED_BATCH
    PAYLOAD_BASE = 8
    PAYLOAD_UNIT = 4
    prompt: tuple[int, ...] = ()
    items: tuple[BatchItem, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "prompt", tuple(self.prompt))
        object.__setattr__(self, "items", tuple(self.items))
        _check_tokens("MixedBatch", "prompt", self.prompt)
        _check_items("MixedBatch", self.items)

    def _tail(self) -> bytes:
        counts = _U32X2.pack(len(self.prompt), len(self.items))
        return counts + _pack_tokens(self.prompt) + _pack_items(self.items)

    @classmethod
    def _parse(cls, buf: Readable, offset: int, length: int, **header: int) -> Self:
        # The counts come first and are no fields of the frame: no fixed part to declare.
        n_prompt, n_items = _U32X2.unpack_from(buf, offset)
        if 8 + 4 * n_prompt + BATCH_ITEM.size * n_items != length:
            raise TpProtocolError(
                f"MIXED_BATCH says {n_prompt} prompt tokens and {n_items} items, which is "
                f"{8 + 4 * n_prompt + BATCH_ITEM.size * n_items} bytes, but its payload is "
                f"{length} bytes"
            )
        prompt = _unpack_tokens(buf, offset + 8, n_prompt)
        items = _unpack_items(buf, offset + 8 + 4 * n_prompt, n_items)
        return cls(prompt=prompt, items=items, **header)


@dataclass(frozen=True, kw_only=True)
class CommandAck(_Frame):
    """The worker's answer to a mirrored command: ``status`` 0 ok, nonzero failed."""

    TYPE = FrameType.COMMAND_ACK
    LAYOUT = _Layout(("status", I32))
    status: int = 0


@dataclass(frozen=True, kw_only=True)
class SyncCheckpoint(_Frame):
    """Agreed cancellation at a prefill boundary: each rank says whether it wants to stop;
    the prefill is cancelled when either does."""

    TYPE = FrameType.SYNC_CHECKPOINT
    LAYOUT = _Layout(("point", U32), ("current", I32), ("total", I32), ("requested", BOOL))
    point: int
    current: int
    total: int
    requested: bool = False

    @classmethod
    def _parse(cls, buf: Readable, offset: int, length: int, **header: int) -> Self:
        requested = memoryview(buf)[offset + cls.LAYOUT.size - 1]
        if requested > 1:
            raise TpProtocolError(f"SYNC_CHECKPOINT: requested must be 0 or 1, got {requested}")
        return super()._parse(buf, offset, length, **header)


# WORLD entry: rank u16, gate_port u16, host 16 bytes (IPv6; IPv4 mapped), token u64.
WORLD_ENTRY = struct.Struct("<HH16sQ")


@dataclass(frozen=True)
class WorldPeer:
    """One worker of a world, as the WORLD frame lists it: where its gate port is and the
    token that port takes for this world."""

    rank: int
    gate_port: int
    host: bytes  # 16 bytes, IPv6 (``ipaddress.IPv6Address(...).packed``; IPv4 mapped)
    token: int

    def __post_init__(self) -> None:
        _check_range("WorldPeer", "rank", self.rank, 1, MAX_WORLD - 1)
        _check_range("WorldPeer", "gate_port", self.gate_port, 1, _U16)
        _check_range("WorldPeer", "token", self.token, 0, _U64)
        if not isinstance(self.host, bytes) or len(self.host) != 16:
            raise LocalProtocolError(f"WorldPeer.host must be 16 bytes, got {self.host!r}")


@dataclass(frozen=True, kw_only=True)
class World(_Frame):
    """The leader's table of every worker of a world of N > 2 ranks, rank order (1 .. N-1):
    each worker dials the lower ranks' gate ports with it (docs/protocol.md, N ranks)."""

    TYPE = FrameType.WORLD
    PAYLOAD_UNIT = WORLD_ENTRY.size
    peers: tuple[WorldPeer, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "peers", tuple(self.peers))
        ranks = [p.rank for p in self.peers if isinstance(p, WorldPeer)]
        if len(ranks) != len(self.peers) or ranks != list(range(1, len(ranks) + 1)) or not (
            2 <= len(ranks) < MAX_WORLD
        ):
            raise LocalProtocolError(
                f"World.peers must list ranks 1 .. N-1 in order, 3 <= N <= {MAX_WORLD}; got "
                f"ranks {ranks}"
            )

    def _tail(self) -> bytes:
        return b"".join(WORLD_ENTRY.pack(p.rank, p.gate_port, p.host, p.token)
                        for p in self.peers)

    @classmethod
    def _parse_tail(cls, buf: Readable, offset: int, length: int) -> dict[str, Any]:
        data = memoryview(buf)[offset : offset + length]
        return {"peers": tuple(WorldPeer(*e) for e in WORLD_ENTRY.iter_unpack(data))}


ControlFrame = (
    Sync | Eval | Rewind | Invalidate | Stop | Hash | Logits | Verify | VerifyCommit
    | SessionCreate | SessionDestroy | EvalBatch | MixedBatch | CommandAck | SyncCheckpoint
    | World
)  # fmt: skip
Frame = Hello | ControlFrame

FRAME_CLASSES: dict[FrameType, type[_Frame]] = {
    cls.TYPE: cls
    for cls in (
        Sync, Eval, Rewind, Invalidate, Stop, Hash, Logits, Verify, VerifyCommit,
        SessionCreate, SessionDestroy, EvalBatch, MixedBatch, CommandAck, SyncCheckpoint,
        World,
    )
}  # fmt: skip
# Every seed frame type is either implemented or explicitly reserved, never both.
assert set(FRAME_CLASSES).isdisjoint(UNSUPPORTED_FRAME_TYPES)
assert set(FRAME_CLASSES) | set(UNSUPPORTED_FRAME_TYPES) == set(FrameType)


def encode_parts(frame: Frame) -> list[bytes | memoryview]:
    """The pieces of a hello or a control frame, to write in order (a LOGITS half as the view
    it is, uncopied)."""
    if isinstance(frame, Hello):
        return [_encode_hello(frame)]
    parts = frame._payload_parts()
    length = sum(len(p) for p in parts)
    header = FRAME_HEADER.pack(
        TP_FRAME_MAGIC, frame.TYPE, 0, 0, frame.session_id, frame.seq, length
    )
    return [header, *parts]


def encode(frame: Frame) -> bytes:
    """The bytes of a hello or a control frame."""
    return b"".join(encode_parts(frame))


def logits_rows(max_sessions: int) -> int:
    """The most logits rows one command returns on a pair that runs ``max_sessions`` sessions
    at once: a VERIFY block (``DS4_TP_BATCH_MAX_ROWS``), or one row per session of an
    EVAL_BATCH or MIXED_BATCH (the prefill's last row and one for every other session)."""
    if not 1 <= max_sessions <= TP_MAX_BATCH_ITEMS:
        raise LocalProtocolError(
            f"max_sessions must be in [1, {TP_MAX_BATCH_ITEMS}], got {max_sessions}"
        )
    return max(DS4_TP_BATCH_MAX_ROWS, max_sessions)


def max_payload_for(identity: Identity, max_rows: int, vocab_block: int | None = None) -> int:
    """The largest legal control payload for this model on a pair whose commands return at
    most ``max_rows`` logits rows (``logits_rows``): the bound a rank's decoder uses, the
    larger of these frames (docs/protocol.md, Limits, gives the same formula).
    ``vocab_block``: the largest vocabulary block a worker returns (default the larger half,
    the pair's; a world of N ranks or unequal shares passes its own)."""
    if max_rows < 1:
        raise LocalProtocolError(f"max_rows must be >= 1, got {max_rows}")
    block = (identity.n_vocab + 1) // 2 if vocab_block is None else vocab_block
    return max(
        4 * identity.ctx_size,  # SYNC of a full context
        4 + 4 * max_rows * block,  # LOGITS: rows of the larger half (of the largest block)
        WORLD_ENTRY.size * (MAX_WORLD - 1),  # WORLD
        8 + 4 * identity.ctx_size + BATCH_ITEM.size * TP_MAX_BATCH_ITEMS,  # MIXED_BATCH
        4 + 4 * DS4_TP_BATCH_MAX_ROWS,  # VERIFY
        SyncCheckpoint.LAYOUT.size,
    )


class TpDecoder(FrameDecoder[Frame]):
    """Incremental decoder (``foundry.wire.framing``): ``feed`` bytes as they arrive, take the
    hello (when ``expect_hello``) and then control frames with ``next_event``.

    The hello's 8-byte prefix is checked before the rest of it is kept, a control frame's
    28-byte header before its payload. After a :class:`TpProtocolError` the decoder is failed
    for good.
    """

    def __init__(self, max_payload: int = TP_MAX_PAYLOAD, *, expect_hello: bool = False) -> None:
        if max_payload < 0:
            raise ValueError(f"max_payload must be >= 0, got {max_payload}")
        super().__init__()
        self.max_payload = max_payload
        self._hello_next = expect_hello
        self._hello_prefix = b""
        # (type, session_id, seq) of a header already validated, awaiting its payload.
        self._header: tuple[FrameType, int, int] = (FrameType.STOP, 0, 0)

    def _header_size(self) -> int:
        return HELLO_PREFIX.size if self._hello_next else FRAME_HEADER_SIZE

    def _begin(self, header: bytes) -> int:
        if self._hello_next:
            size = self._check_hello_prefix(header)
            self._hello_prefix = header
            return size - HELLO_PREFIX.size
        ftype, session_id, seq, length = self._parse_header(header)
        self._header = (ftype, session_id, seq)
        return length

    def _finish(self, payload: memoryview) -> Frame:
        if self._hello_next:
            hello = _decode_hello(self._hello_prefix + bytes(payload), 0)
            self._hello_next = False
            return hello
        ftype, session_id, seq = self._header
        try:
            return FRAME_CLASSES[ftype]._parse(  # type: ignore[return-value]
                payload, 0, len(payload), session_id=session_id, seq=seq
            )
        except LocalProtocolError as exc:
            raise TpProtocolError(f"{ftype.name}: {exc}") from None

    def _eof_error(self, message: str) -> TpProtocolError:
        return TpProtocolError(message)

    @staticmethod
    def _check_hello_prefix(prefix: bytes) -> int:
        magic, version, size = HELLO_PREFIX.unpack(prefix)
        if magic == TP_FRAME_MAGIC:
            raise TpProtocolError("expected the peer's hello first, got a control frame")
        if magic != TP_HELLO_MAGIC:
            raise TpProtocolError(
                f"bad hello magic {magic:#010x} (expected {TP_HELLO_MAGIC:#010x}, 'DTPH'): "
                "the peer does not speak the TP protocol"
            )
        if version != TP_PROTOCOL_VERSION:
            raise VersionMismatch(_version_message(TP_PROTOCOL_VERSION, version))
        if size not in (HELLO_SIZE, HELLO_WORLD_SIZE):
            raise TpProtocolError(f"hello of version {version} must be {HELLO_SIZE} bytes "
                                  f"({HELLO_WORLD_SIZE} with the world extension), the peer "
                                  f"says {size}")
        return int(size)

    def _parse_header(self, header: bytes) -> tuple[FrameType, int, int, int]:
        magic, code, flags, reserved, session_id, seq, length = FRAME_HEADER.unpack(header)
        if magic == TP_HELLO_MAGIC:
            raise TpProtocolError("unexpected hello after the handshake")
        if magic != TP_FRAME_MAGIC:
            raise TpProtocolError(
                f"bad frame magic {magic:#010x} (expected {TP_FRAME_MAGIC:#010x}, 'DTP4'): "
                "the stream is out of step or the peer does not speak the TP protocol"
            )
        if code not in FrameType.__members__.values():
            raise TpProtocolError(f"unknown frame type {code}")
        ftype = FrameType(code)
        if ftype in UNSUPPORTED_FRAME_TYPES:
            raise TpProtocolError(
                f"frame type {ftype.name} ({code}) is not supported: "
                f"{UNSUPPORTED_FRAME_TYPES[ftype]}"
            )
        if flags or reserved:
            raise TpProtocolError(
                f"{ftype.name}: header flags {flags:#x} / reserved {reserved} must be 0 "
                f"in protocol version {TP_PROTOCOL_VERSION}"
            )
        if length > self.max_payload:
            raise TpProtocolError(
                f"{ftype.name} payload of {length} bytes exceeds the limit of "
                f"{self.max_payload} bytes"
            )
        cls = FRAME_CLASSES[ftype]
        base, unit = cls.PAYLOAD_BASE, cls.PAYLOAD_UNIT
        legal = length >= base and (length - base) % unit == 0 if unit else length == base
        if not legal:
            rule = f"{base} + a multiple of {unit}" if unit else f"exactly {base}"
            raise TpProtocolError(f"{ftype.name} payload must be {rule} bytes, got {length}")
        return ftype, session_id, seq, length


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
            f"layer {self.layer} gate {self.gate.name} seq {self.seq} "
            f"({self.rows} x {self.n_embd})"
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

