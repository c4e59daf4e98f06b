"""The tensor-parallel hello (184 bytes), the first thing each rank sends on the control socket:
protocol version, role, the execution mode, the engine :class:`Identity` and the shared-memory
offer, then in a world that is not the plain pair (N > 2 ranks, or unequal shares) 40 bytes
more, the :class:`WorldInfo` (world size, rank, gate port, shares or how they are chosen),
flagged ``HELLO_WORLD``; a worker answering a world whose shares are still to be chosen 8 bytes
more, the :class:`RankWeight` (its ``--share`` and its measured speed), flagged ``HELLO_WEIGHT``;
a worker stating the world 4 bytes more at the end, its compute threads, flagged
``HELLO_THREADS``; its checks (:func:`check_hello`), and the protocol's constants and limits."""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass, fields

from foundry.model.shard.shares import MAX_SHARE, MAX_WORLD
from foundry.wire.errors import (
    IdentityMismatch,
    LocalProtocolError,
    TpProtocolError,
    VersionMismatch,
)

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
HELLO_WEIGHT = 4  # the rank's weight follows the world extension (shares still to be chosen)
HELLO_THREADS = 8  # a worker's compute threads follow the last extension (its STATUS entry)
HELLO_FLAGS = HELLO_SHM_OFFERED | HELLO_WORLD | HELLO_WEIGHT | HELLO_THREADS
# The most ranks of a world, and a share's bound (u16): as model.shard, which cuts by them.
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
    if type(value) is int and lo <= value <= hi:  # the common case (a bool's type is bool)
        return
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
HELLO = struct.Struct(f"<IHHBBH{IDENTITY.format[1:]}{HOST_ID_BYTES}s{SHM_NAME_BYTES}s{ARCH_BYTES}s")
HELLO_SIZE = HELLO.size
# The world extension: world_size u16, rank u16, gate_port u16, shares_from u16, shares 16 x u16.
WORLD_EXT = struct.Struct(f"<HHHH{MAX_WORLD}H")
HELLO_WORLD_SIZE = HELLO_SIZE + WORLD_EXT.size
# The weight extension: share u16, reserved u16, speed u32.
WEIGHT_EXT = struct.Struct("<HHI")
HELLO_WEIGHT_SIZE = HELLO_WORLD_SIZE + WEIGHT_EXT.size
# The threads extension, last: threads u16, reserved u16.
THREADS_EXT = struct.Struct("<HH")


def hello_size(flags: int) -> int:
    """The hello's size its flags call for: the pair's bytes, then each extension flagged, in
    their order (world, weight, threads)."""
    return (
        HELLO_SIZE
        + (WORLD_EXT.size if flags & HELLO_WORLD else 0)
        + (WEIGHT_EXT.size if flags & HELLO_WEIGHT else 0)
        + (THREADS_EXT.size if flags & HELLO_THREADS else 0)
    )


# The extensions that need the world's, in their order after it: flag and name.
_AFTER_WORLD = ((HELLO_WEIGHT, "weight"), (HELLO_THREADS, "threads"))
# Every size a hello may state (checked from its first 8 bytes before the rest is read).
HELLO_SIZES = (
    HELLO_SIZE,
    HELLO_WORLD_SIZE,
    HELLO_WORLD_SIZE + THREADS_EXT.size,
    HELLO_WEIGHT_SIZE,
    HELLO_WEIGHT_SIZE + THREADS_EXT.size,
)


class SharesFrom(enum.IntEnum):
    """The world extension's ``shares_from``: where the world's shares come from. Other than
    ``LIST`` the shares are still to be chosen (all 0 on the wire): the leader chooses them
    once every worker has stated its :class:`RankWeight`."""

    LIST = 0  # the shares field holds them (the leader's --shares, or equal)
    SPEED = 1  # --shares auto: each rank's speed, measured at pairing
    SHARE = 2  # --shares ranks: each rank's own --share


@dataclass(frozen=True, kw_only=True)
class WorldInfo:
    """The hello's world extension (``HELLO_WORLD``): what a world of N ranks agrees on beyond
    the pair. ``rank``: the leader 0; a worker the rank it asks for, 0 for the next free one.
    ``gate_port``: a worker's port for gate connections from higher ranks (N > 2), else 0.
    ``shares``: one per rank, rank 0 first (``model.shard.shares.norm_shares``); empty while
    ``shares_from`` says they are still to be chosen."""

    world_size: int
    shares: tuple[int, ...]
    rank: int = 0
    gate_port: int = 0
    shares_from: SharesFrom = SharesFrom.LIST

    @property
    def pending(self) -> bool:
        """The shares are still to be chosen from every rank's weight."""
        return self.shares_from is not SharesFrom.LIST

    def __post_init__(self) -> None:
        _check_range("WorldInfo", "world_size", self.world_size, 2, MAX_WORLD)
        _check_range("WorldInfo", "rank", self.rank, 0, self.world_size - 1)
        _check_range("WorldInfo", "gate_port", self.gate_port, 0, _U16)
        if not isinstance(self.shares_from, SharesFrom):
            raise LocalProtocolError(
                f"WorldInfo.shares_from must be a SharesFrom, got {self.shares_from!r}"
            )
        object.__setattr__(self, "shares", tuple(self.shares))
        if self.pending:
            if self.shares:
                raise LocalProtocolError(
                    "WorldInfo.shares must be empty while they are still "
                    f"to be chosen (shares_from {self.shares_from.name})"
                )
            return
        if len(self.shares) != self.world_size:
            raise LocalProtocolError(
                f"WorldInfo.shares holds {len(self.shares)} shares for a world of {self.world_size}"
            )
        for share in self.shares:
            _check_range("WorldInfo", "shares", share, 1, MAX_SHARE)
        if self.world_size == 2 and len(set(self.shares)) == 1:
            raise LocalProtocolError(
                "WorldInfo of the plain pair (2 ranks, equal shares): that pair sends no "
                "world extension"
            )

    def encode(self) -> bytes:
        shares = self.shares + (0,) * (MAX_WORLD - len(self.shares))
        return WORLD_EXT.pack(self.world_size, self.rank, self.gate_port, self.shares_from, *shares)

    @classmethod
    def decode(cls, buf: Readable, offset: int = 0) -> WorldInfo:
        world, rank, port, shares_from, *shares = WORLD_EXT.unpack_from(buf, offset)
        if shares_from not in SharesFrom.__members__.values():
            raise TpProtocolError(
                f"hello: world extension shares_from is {shares_from}, not "
                "0 (the list), 1 (speed) or 2 (each rank's share)"
            )
        if not 2 <= world <= MAX_WORLD:
            raise TpProtocolError(f"hello: world size {world} outside [2, {MAX_WORLD}]")
        kept = 0 if shares_from else world
        if any(shares[kept:]):
            raise TpProtocolError(
                f"hello: shares beyond the world of {world} are not 0"
                if kept
                else "hello: shares to be chosen are not all 0"
            )
        try:
            return cls(
                world_size=world,
                rank=rank,
                gate_port=port,
                shares=tuple(shares[:kept]),
                shares_from=SharesFrom(shares_from),
            )
        except LocalProtocolError as exc:
            raise TpProtocolError(f"hello: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class RankWeight:
    """The hello's weight extension (``HELLO_WEIGHT``, after the world extension): what a
    worker states when the leader's world has its shares still to be chosen. ``share``: its
    ``--share`` (0: none given); ``speed``: its calibration's rate in multiply-adds per
    microsecond (``tp.calibrate``; 0: not measured)."""

    share: int = 0
    speed: int = 0

    def __post_init__(self) -> None:
        _check_range("RankWeight", "share", self.share, 0, MAX_SHARE)
        _check_range("RankWeight", "speed", self.speed, 0, _U32)

    def encode(self) -> bytes:
        return WEIGHT_EXT.pack(self.share, 0, self.speed)

    @classmethod
    def decode(cls, buf: Readable, offset: int = 0) -> RankWeight:
        share, reserved, speed = WEIGHT_EXT.unpack_from(buf, offset)
        if reserved:
            raise TpProtocolError(f"hello: weight extension reserved word is {reserved}, not 0")
        return cls(share=share, speed=speed)


@dataclass(frozen=True, kw_only=True)
class Hello:
    """The first record on the control socket, from each rank.

    ``shm_offered`` says this rank can use a shared-memory slab; the leader also names the slab
    it created (``shm_name``). ``host_id`` identifies the machine (and container): the slab is
    used only when both ranks offered it and their host ids are equal (see
    :func:`negotiate_gate_transport`). ``execution_mode`` holds the ``DS4_TP_MODE_*`` bits of
    how this rank's weights are cut; both ranks must state the same. ``threads``: the threads
    a worker computes on, stated in every hello that carries the world (the leader's STATUS
    lists it); the leader's hello states none, its own being local to it.
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
    weight: RankWeight | None = None  # after the world: shares still to be chosen
    threads: int | None = None  # last, with the world: a worker's compute threads (0: unknown)

    @property
    def flags(self) -> int:
        """The flags byte: the shared-memory offer and the extensions present."""
        return (
            (HELLO_SHM_OFFERED if self.shm_offered else 0)
            | (HELLO_WORLD if self.world is not None else 0)
            | (HELLO_WEIGHT if self.weight is not None else 0)
            | (HELLO_THREADS if self.threads is not None else 0)
        )

    @property
    def size(self) -> int:
        return hello_size(self.flags)

    def __post_init__(self) -> None:
        _check_range("Hello", "version", self.version, 0, _U16)
        if self.world is not None and not isinstance(self.world, WorldInfo):
            raise LocalProtocolError(f"Hello.world must be a WorldInfo, got {self.world!r}")
        if self.weight is not None and not isinstance(self.weight, RankWeight):
            raise LocalProtocolError(f"Hello.weight must be a RankWeight, got {self.weight!r}")
        if self.weight is not None and (self.world is None or not self.world.pending):
            raise LocalProtocolError(
                "Hello.weight goes only with a world whose shares are still to be chosen"
            )
        if self.threads is not None:
            if self.world is None:
                raise LocalProtocolError(
                    "Hello.threads goes only with the world extension (the plain pair's hello "
                    "has none)"
                )
            _check_range("Hello", "threads", self.threads, 0, _U16)
        if not ARCH_PATTERN.fullmatch(self.architecture):
            raise LocalProtocolError(
                f"Hello.architecture {self.architecture!r} is not 1-16 characters of [a-z0-9_-]"
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


class WorldMismatch(IdentityMismatch):
    """The hellos state different worlds. A worker's first hello states none (it learns the
    world from the leader's hello), so this one is expected once: the worker dials again with
    the leader's world."""


def _shares_text(world: WorldInfo | None) -> str:
    if world is None:
        return "1,1 (the plain pair)"
    if world.pending:
        return {SharesFrom.SPEED: "auto", SharesFrom.SHARE: "ranks"}[world.shares_from]
    return ",".join(map(str, world.shares))


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
    base = HELLO.pack(
        TP_HELLO_MAGIC, h.version, h.size, h.role, h.flags, h.execution_mode,
        i.gguf_bytes, i.model_id, i.n_layer, i.n_embd, i.n_vocab, i.quant_bits, i.ctx_size,
        i.gate_slot_start, i.gate_slot_step, i.gates_per_token, *i.gate_slot_mask,
        h.host_id, h.shm_name.encode(), h.architecture.encode(),
    )  # fmt: skip
    if h.world is None:
        return base
    weight = b"" if h.weight is None else h.weight.encode()
    threads = b"" if h.threads is None else THREADS_EXT.pack(h.threads, 0)
    return base + h.world.encode() + weight + threads


def _decode_hello(buf: Readable, offset: int) -> Hello:
    v = HELLO.unpack_from(buf, offset)
    version, size, role, flags, mode = v[1], v[2], v[3], v[4], v[5]
    if role not in (Role.LEADER, Role.WORKER):
        raise TpProtocolError(f"hello: unknown role {role} (0 leader, 1 worker)")
    if flags & ~HELLO_FLAGS:
        raise TpProtocolError(f"hello: unknown flags {flags:#x}")
    for flag, name in _AFTER_WORLD:
        if flags & flag and not flags & HELLO_WORLD:
            raise TpProtocolError(f"hello: the {name} flag is set without the world flag")
    want = hello_size(flags)
    if size != want:
        said = ", ".join(
            f"the {name} flag {'set' if flags & flag else 'clear'}" for flag, name in _AFTER_WORLD
        )
        raise TpProtocolError(
            f"hello: the world flag is {'set' if flags & HELLO_WORLD else 'clear'}, {said}, so "
            f"the hello is {want} bytes, but it says {size} ({HELLO_SIZE} plain, "
            f"{HELLO_WORLD_SIZE} with the world extension, {WEIGHT_EXT.size} more with the "
            f"weight, {THREADS_EXT.size} more with the threads)"
        )
    world = WorldInfo.decode(buf, offset + HELLO_SIZE) if flags & HELLO_WORLD else None
    weight = RankWeight.decode(buf, offset + HELLO_WORLD_SIZE) if flags & HELLO_WEIGHT else None
    threads: int | None = None
    if flags & HELLO_THREADS:
        threads, reserved = THREADS_EXT.unpack_from(buf, offset + size - THREADS_EXT.size)
        if reserved:
            raise TpProtocolError(f"hello: threads extension reserved word is {reserved}, not 0")
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
            weight=weight,
            threads=threads,
        )
    except LocalProtocolError as exc:
        raise TpProtocolError(f"hello: {exc}") from None
