"""The tensor-parallel control frames the leader mirrors to the worker (and the worker's
replies): a 28-byte header, then a payload laid out per type, numbered exactly as
``ds4_tp_frame_type``; each frame's fixed part is a ``Layout``, its variable part (tokens,
batch items, a LOGITS half) written next to it."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import operator
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np

from foundry.wire.errors import LocalProtocolError, TpProtocolError
from foundry.wire.layout import BOOL, I32, U32, U64, Enum, Layout
from foundry.wire.tp.hello import (
    _I32_MAX,
    _I32_MIN,
    _U16,
    _U32,
    _U64,
    DS4_TP_BATCH_MAX_ROWS,
    DS4_TP_VERIFY_FLAGS,
    TP_MAX_BATCH_ITEMS,
    TP_MAX_WORLD,
    Hello,
    Readable,
    _check_range,
    _check_tokens,
)

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
    ROW_TOPS = 33  # Foundry's extension: each row's best token of a worker's block (greedy)
    ROW_DRAW = 34  # Foundry's extension: what the workers need to draw the step's sampled rows
    ROW_PICKS = 35  # Foundry's extension: a worker's part of each drawn row
    ROW_MASS = 36  # Foundry's extension: the leader's mass of each drawn row, after ROW_DRAW
    MIXED_PREFILLS = 37  # Foundry's extension: MIXED_BATCH with a chunk of several prompts


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
# The header's flags (Foundry's extension; the seed's are 0). ROW_TOPS on a command whose reply
# is logits rows: every row is drawn greedily and nothing else reads it, so each worker sends
# its rows' best tokens (ROW_TOPS) instead of its block of the logits (LOGITS).
FRAME_FLAG_ROW_TOPS = 0x01
# ROW_DRAWS, only with ROW_TOPS: after its ROW_TOPS the worker waits for the leader's ROW_DRAW
# and answers ROW_PICKS, the exchange that draws the step's sampled rows without shipping the
# logits (the header's flags are then 0x03).
FRAME_FLAG_ROW_DRAWS = 0x02
# ROW_MASS, only with ROW_DRAWS: the leader sends ROW_DRAW as soon as it knows each row's top,
# with acc and nonzero 0, and their values in ROW_MASS after its own pass, so that the worker
# runs its pass meanwhile (the header's flags are then 0x07).
FRAME_FLAG_ROW_MASS = 0x04
# The flags, as the frames' fields name them, in order: each needs the one before it.
ROW_FLAGS = (
    ("row_tops", FRAME_FLAG_ROW_TOPS),
    ("row_draws", FRAME_FLAG_ROW_DRAWS),
    ("row_mass", FRAME_FLAG_ROW_MASS),
)
# ROW_TOPS row: value f32 (the block's largest logit), token i32 (the global id of its first
# occurrence; -1 a NaN or +inf in the block, -2 every logit of the block -inf)
ROW_TOP = struct.Struct("<fi")
ROW_TOP_BROKEN = -1
ROW_TOP_ALL_MASKED = -2
# The largest top_k a row drawn by ROW_DRAW / ROW_PICKS may have: a worker sends at most this
# many candidates of a row cut to top_k (8 bytes each); the leader ships logits for larger ones.
TP_MAX_DRAW_TOP_K = 256
# ROW_DRAW row: mode u32, top_k u32, top f32, inv f32, acc f64, u f64, nonzero u32, reserved u32
DRAW_ROW = struct.Struct("<IIffddII")
# ROW_MASS row: acc f64 (the leader's mass), nonzero u32 (its tokens above 0), reserved u32
MASS_ROW = struct.Struct("<dII")
# ROW_PICKS row: kind i32, index i32, target f64, n u32 (candidates that follow), reserved u32
PICK_ROW = struct.Struct("<iidII")
# ROW_PICKS candidate, after every row: e f32, index i32 (in the worker's vocabulary block)
PICK_CANDIDATE = struct.Struct("<fi")
# ROW_PICKS kinds: where the row's token is.
PICK_NONE = 0  # a row of mode 0: no draw
PICK_TOKEN = 1  # the worker's token: ``index`` in its vocabulary block
PICK_LEADER_WALK = 2  # in the leader's blocks: the leader walks them to ``target``
PICK_LEADER_LAST = 3  # rounding left the walk short, none here nonzero: the leader's last token
PICK_TOP_K = 4  # the row is cut to top_k: the worker's most probable candidates follow
_PICK_NAMES = ("PICK_NONE", "PICK_TOKEN", "PICK_LEADER_WALK", "PICK_LEADER_LAST", "PICK_TOP_K")
FRAME_HEADER_SIZE = FRAME_HEADER.size
# ds4_tp_batch_item: session_id u64, token i32, reserved u32
BATCH_ITEM = struct.Struct("<QiI")
# MIXED_PREFILLS prefill: session_id u64, token_count u32 (its tokens follow every prefill's
# head, in order), reserved u32
PREFILL_HEAD = struct.Struct("<QII")
_U32S = struct.Struct("<I")
_U32X2 = struct.Struct("<II")
_F32 = struct.Struct("<f")


def _real(owner: str, name: str, value: object) -> float:
    if type(value) is float:  # the common case, without the ABC's check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise LocalProtocolError(f"{owner}.{name} must be a real number, got {value!r}")
    return float(value)


def _f32(owner: str, name: str, value: object) -> float:
    """``value`` rounded to float32, as the wire carries it."""
    real = _real(owner, name, value)
    try:
        return float(_F32.unpack(_F32.pack(real))[0])
    except OverflowError:
        raise LocalProtocolError(f"{owner}.{name} {real!r} does not fit a float32") from None


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
    ``seq`` is the leader's command sequence number, echoed where the seed has one (EVAL, HASH);
    ``row_tops`` asks the workers for ROW_TOPS instead of LOGITS, ``row_draws`` (only with
    ``row_tops``) then for the ROW_DRAW / ROW_PICKS exchange, ``row_mass`` (only with
    ``row_draws``) for ROW_MASS between them (the header's flags).
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
    ROWS_REPLY: ClassVar[bool] = False  # a command the worker answers with logits rows

    session_id: int = 0
    seq: int = 0
    row_tops: bool = False  # the header's FRAME_FLAG_ROW_TOPS (only where ROWS_REPLY)
    row_draws: bool = False  # the header's FRAME_FLAG_ROW_DRAWS (only with row_tops)
    row_mass: bool = False  # the header's FRAME_FLAG_ROW_MASS (only with row_draws)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "PAYLOAD_BASE" not in cls.__dict__:
            cls.PAYLOAD_BASE = cls.LAYOUT.size

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_range(owner, "session_id", self.session_id, 0, _U64)
        _check_range(owner, "seq", self.seq, 0, _U64)
        for name, flag in ROW_FLAGS:
            if getattr(self, name) and not self.ROWS_REPLY:
                raise LocalProtocolError(
                    f"{owner}: {name} (header flag {flag:#x}) is only for a command answered "
                    "with logits rows"
                )
        for (name, flag), (needed, needed_flag) in zip(ROW_FLAGS[1:], ROW_FLAGS, strict=False):
            if getattr(self, name) and not getattr(self, needed):
                raise LocalProtocolError(
                    f"{owner}: {name} (header flag {flag:#x}) needs {needed} "
                    f"(header flag {needed_flag:#x})"
                )
        self.LAYOUT.normalise(self)

    @property
    def header_flags(self) -> int:
        """The header's flags byte: ``FRAME_FLAG_ROW_TOPS``, ``FRAME_FLAG_ROW_DRAWS`` and
        ``FRAME_FLAG_ROW_MASS``."""
        return sum(flag for name, flag in ROW_FLAGS if getattr(self, name))

    def _tail(self) -> bytes:
        return b""

    def _payload_parts(self) -> tuple[bytes | memoryview, ...]:
        return (self.LAYOUT.pack_obj(self) + self._tail(),)

    @classmethod
    def _parse_tail(cls, buf: Readable, offset: int, length: int) -> dict[str, Any]:
        """The fields of the variable part, ``length`` bytes from ``offset``."""
        return {}

    @classmethod
    def _parse(cls, buf: Readable, offset: int, length: int, **header: Any) -> Self:
        size = cls.LAYOUT.size
        fixed = cls.LAYOUT.unpack(memoryview(buf), offset)
        return cls(**fixed, **cls._parse_tail(buf, offset + size, length - size), **header)


@dataclass(frozen=True, kw_only=True)
class Sync(_Frame):
    """Prefill: bring the session's context to exactly ``tokens`` (int32 array)."""

    TYPE = FrameType.SYNC
    ROWS_REPLY = True
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
    ROWS_REPLY = True
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
    def _parse(cls, buf: Readable, offset: int, length: int, **header: Any) -> Self:
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
    ROWS_REPLY = True
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
    ROWS_REPLY = True
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
    ROWS_REPLY = True
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
    def _parse(cls, buf: Readable, offset: int, length: int, **header: Any) -> Self:
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


@dataclass(frozen=True)
class Prefill:
    """One prompt's chunk of a MIXED_PREFILLS: evaluated for session ``session_id``, appended
    to what it holds."""

    session_id: int
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_range("Prefill", "session_id", self.session_id, 0, _U64)
        object.__setattr__(self, "tokens", tuple(self.tokens))
        if not self.tokens:
            raise LocalProtocolError(f"Prefill of session {self.session_id} has no tokens")
        _check_tokens("Prefill", "tokens", self.tokens)


@dataclass(frozen=True, kw_only=True)
class MixedPrefills(_Frame):
    """MIXED_BATCH with several prompts: a chunk of each of ``prefills`` (distinct sessions)
    fused with one decode step for ``items``; the header's session_id is 0. Rows: each
    prefill's last, in order, then one for each item. Payload: prefill_count u32, item_count
    u32, the prefills' heads (``PREFILL_HEAD``), their tokens (int32) in order, the items."""

    TYPE = FrameType.MIXED_PREFILLS
    ROWS_REPLY = True
    PAYLOAD_BASE = 8
    PAYLOAD_UNIT = 4
    prefills: tuple[Prefill, ...] = ()
    items: tuple[BatchItem, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "prefills", tuple(self.prefills))
        object.__setattr__(self, "items", tuple(self.items))
        if not self.prefills:
            raise LocalProtocolError("MixedPrefills has no prefill")
        for prefill in self.prefills:
            if not isinstance(prefill, Prefill):
                raise LocalProtocolError(
                    f"MixedPrefills.prefills must hold Prefill, got {prefill!r}"
                )
        _check_items("MixedPrefills", self.items)
        if len(self.prefills) + len(self.items) > TP_MAX_BATCH_ITEMS:
            raise LocalProtocolError(
                f"MixedPrefills holds {len(self.prefills)} prefills and {len(self.items)} items, "
                f"more than {TP_MAX_BATCH_ITEMS} sessions"
            )

    def _tail(self) -> bytes:
        heads = (PREFILL_HEAD.pack(p.session_id, len(p.tokens), 0) for p in self.prefills)
        tokens = (_pack_tokens(p.tokens) for p in self.prefills)
        return (
            _U32X2.pack(len(self.prefills), len(self.items))
            + b"".join(heads)
            + b"".join(tokens)
            + _pack_items(self.items)
        )

    @classmethod
    def _parse(cls, buf: Readable, offset: int, length: int, **header: Any) -> Self:
        n_prefills, n_items = _U32X2.unpack_from(buf, offset)
        fixed = 8 + PREFILL_HEAD.size * n_prefills
        if fixed + BATCH_ITEM.size * n_items > length:
            raise TpProtocolError(
                f"MIXED_PREFILLS says {n_prefills} prefills and {n_items} items, which is at "
                f"least {fixed + BATCH_ITEM.size * n_items} bytes, but its payload is {length} "
                "bytes"
            )
        heads = list(PREFILL_HEAD.iter_unpack(memoryview(buf)[offset + 8 : offset + fixed]))
        for sid, _, reserved in heads:
            if reserved:
                raise TpProtocolError(
                    f"MIXED_PREFILLS prefill of session {sid}: nonzero reserved word"
                )
        n_tokens = sum(count for _, count, _ in heads)
        if fixed + 4 * n_tokens + BATCH_ITEM.size * n_items != length:
            raise TpProtocolError(
                f"MIXED_PREFILLS says {n_prefills} prefills of {n_tokens} tokens and {n_items} "
                f"items, which is {fixed + 4 * n_tokens + BATCH_ITEM.size * n_items} bytes, but "
                f"its payload is {length} bytes"
            )
        prefills, at = [], offset + fixed
        for sid, count, _ in heads:
            prefills.append(Prefill(sid, _unpack_tokens(buf, at, count)))
            at += 4 * count
        items = _unpack_items(buf, at, n_items)
        return cls(prefills=tuple(prefills), items=items, **header)


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
    def _parse(cls, buf: Readable, offset: int, length: int, **header: Any) -> Self:
        requested = memoryview(buf)[offset + cls.LAYOUT.size - 1]
        if requested > 1:
            raise TpProtocolError(f"SYNC_CHECKPOINT: requested must be 0 or 1, got {requested}")
        return super()._parse(buf, offset, length, **header)


@dataclass(frozen=True, kw_only=True)
class RowTops(_Frame):
    """A worker's answer to a command sent with ``row_tops``: for each row, in order, the
    largest logit of its vocabulary block and the global id of its first occurrence, or
    ``ROW_TOP_BROKEN`` / ``ROW_TOP_ALL_MASKED`` (value 0) where the block cannot give one. The
    leader takes the first of the blocks' best in rank order: the greedy token of the whole
    row. Payload: count u32, then count x (value f32, token i32)."""

    TYPE = FrameType.ROW_TOPS
    PAYLOAD_BASE = 4
    PAYLOAD_UNIT = ROW_TOP.size
    values: tuple[float, ...] = ()
    tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        object.__setattr__(self, "tokens", tuple(self.tokens))
        if len(self.values) != len(self.tokens):
            raise LocalProtocolError(
                f"RowTops has {len(self.values)} values and {len(self.tokens)} tokens"
            )
        for token in self.tokens:
            _check_range("RowTops", "tokens", token, ROW_TOP_ALL_MASKED, _I32_MAX)

    def _tail(self) -> bytes:
        rows = zip(self.values, self.tokens, strict=True)
        return _U32S.pack(len(self.tokens)) + b"".join(ROW_TOP.pack(v, t) for v, t in rows)

    @classmethod
    def _parse(cls, buf: Readable, offset: int, length: int, **header: Any) -> Self:
        (count,) = _U32S.unpack_from(buf, offset)
        if 4 + ROW_TOP.size * count != length:
            raise TpProtocolError(
                f"ROW_TOPS says {count} rows but its payload is {length} bytes "
                f"(expected {4 + ROW_TOP.size * count})"
            )
        data = memoryview(buf)[offset + 4 : offset + length]
        rows = list(ROW_TOP.iter_unpack(data))
        return cls(values=tuple(v for v, _ in rows), tokens=tuple(t for _, t in rows), **header)


@dataclass(frozen=True)
class DrawRow:
    """One row of a ROW_DRAW, in the order the rows of the step come. ``mode`` 0: no draw for
    this row (the other fields may be 0); 1: draw it. ``top_k`` the row's cut (0 keeps every
    token; at most ``TP_MAX_DRAW_TOP_K``); ``top`` the row's largest logit over every block;
    ``inv`` 1/temperature rounded to float32 (> 0); ``acc`` the leader's mass, its blocks'
    masses added in order; ``u`` the row's uniform, in [0, 1); ``nonzero`` how many of the
    leader's tokens have probability > 0. ``top`` and ``inv`` are kept rounded to float32, as
    the wire carries them."""

    mode: int
    top_k: int
    top: float
    inv: float
    acc: float
    u: float
    nonzero: int

    def __post_init__(self) -> None:
        _check_range("DrawRow", "mode", self.mode, 0, 1)
        _check_range("DrawRow", "top_k", self.top_k, 0, TP_MAX_DRAW_TOP_K)
        _check_range("DrawRow", "nonzero", self.nonzero, 0, _U32)
        top = _f32("DrawRow", "top", self.top)
        inv = _f32("DrawRow", "inv", self.inv)
        acc = _real("DrawRow", "acc", self.acc)
        u = _real("DrawRow", "u", self.u)
        if not 0.0 <= u < 1.0:
            raise LocalProtocolError(f"DrawRow.u must be in [0, 1), got {u!r}")
        if not (math.isfinite(acc) and acc >= 0.0):
            raise LocalProtocolError(f"DrawRow.acc must be finite and >= 0, got {acc!r}")
        if self.mode == 1 and not (math.isfinite(inv) and inv > 0.0):
            raise LocalProtocolError(
                f"DrawRow.inv must be finite and > 0 on a drawn row (mode 1), got {inv!r}"
            )
        if self.mode == 1 and not math.isfinite(top):
            raise LocalProtocolError(
                f"DrawRow.top must be finite on a drawn row (mode 1), got {top!r}"
            )
        for name, value in (("top", top), ("inv", inv), ("acc", acc), ("u", u)):
            object.__setattr__(self, name, value)


@dataclass(frozen=True, kw_only=True)
class _Rows(_Frame):
    """A frame of ``rows``, each a fixed struct ``ROW`` ending in a reserved u32 (0), built
    from and read into ``ROW_TYPE`` (its fields, in the struct's order). Payload: count u32,
    then count x ``ROW.size`` bytes."""

    ROW: ClassVar[struct.Struct]
    ROW_TYPE: ClassVar[type]
    _FIELDS: ClassVar[operator.attrgetter[tuple[Any, ...]]]  # the row's fields, in order
    rows: tuple[Any, ...] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.PAYLOAD_BASE, cls.PAYLOAD_UNIT = 4, cls.ROW.size
        cls._FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(cls.ROW_TYPE)))

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "rows", tuple(self.rows))
        owner, kind = type(self).__name__, self.ROW_TYPE.__name__
        for row in self.rows:
            if not isinstance(row, self.ROW_TYPE):
                raise LocalProtocolError(f"{owner}.rows must hold {kind}, got {row!r}")

    def _tail(self) -> bytes:
        rows = (self.ROW.pack(*self._FIELDS(r), 0) for r in self.rows)
        return _U32S.pack(len(self.rows)) + b"".join(rows)

    @classmethod
    def _parse(cls, buf: Readable, offset: int, length: int, **header: Any) -> Self:
        (count,) = _U32S.unpack_from(buf, offset)
        name = cls.TYPE.name
        if 4 + cls.ROW.size * count != length:
            raise TpProtocolError(
                f"{name} says {count} rows but its payload is {length} bytes "
                f"(expected {4 + cls.ROW.size * count})"
            )
        rows = []
        data = memoryview(buf)[offset + 4 : offset + length]
        for i, (*fields, reserved) in enumerate(cls.ROW.iter_unpack(data)):
            if reserved:
                raise TpProtocolError(f"{name} row {i}: nonzero reserved word")
            rows.append(cls.ROW_TYPE(*fields))
        return cls(rows=tuple(rows), **header)


@dataclass(frozen=True, kw_only=True)
class RowDraw(_Rows):
    """The leader's ROW_DRAW, after the workers' ROW_TOPS of a command sent with ``row_draws``
    (seq the step): one :class:`DrawRow` for each row of the step, in order; each worker
    answers with ROW_PICKS. Payload: count u32, then count x 40-byte rows (``DRAW_ROW``)."""

    TYPE = FrameType.ROW_DRAW
    ROW = DRAW_ROW
    ROW_TYPE = DrawRow
    rows: tuple[DrawRow, ...] = ()


@dataclass(frozen=True)
class PickRow:
    """A worker's answer for one row of a ROW_DRAW: ``kind`` says where the row's token is
    (``PICK_NONE`` .. ``PICK_TOP_K``). ``PICK_TOKEN``: the worker's, ``index`` in its
    vocabulary block; ``PICK_LEADER_WALK``: in the leader's blocks, reached by walking them to
    ``target``; ``PICK_LEADER_LAST``: the leader's last nonzero token; ``PICK_TOP_K``: the row
    is cut to top_k and ``candidates`` are the worker's most probable, (e, index in its block)
    each, e kept rounded to float32. Only a ``PICK_TOP_K`` row has candidates, at most
    ``TP_MAX_DRAW_TOP_K``."""

    kind: int
    index: int
    target: float
    candidates: tuple[tuple[float, int], ...] = ()

    def __post_init__(self) -> None:
        _check_range("PickRow", "kind", self.kind, PICK_NONE, PICK_TOP_K)
        _check_range(
            "PickRow", "index", self.index, 0 if self.kind == PICK_TOKEN else _I32_MIN, _I32_MAX
        )
        target = _real("PickRow", "target", self.target)
        if not math.isfinite(target):
            raise LocalProtocolError(f"PickRow.target must be finite, got {target!r}")
        object.__setattr__(self, "target", target)
        candidates = tuple(self.candidates)
        if candidates and self.kind != PICK_TOP_K:
            raise LocalProtocolError(
                f"PickRow of kind {self.kind} ({_PICK_NAMES[self.kind]}) has {len(candidates)} "
                f"candidates: only a PICK_TOP_K ({PICK_TOP_K}) row has them"
            )
        if len(candidates) > TP_MAX_DRAW_TOP_K:
            raise LocalProtocolError(
                f"PickRow.candidates holds {len(candidates)} > {TP_MAX_DRAW_TOP_K} candidates"
            )
        kept = []
        for candidate in candidates:
            if not isinstance(candidate, tuple) or len(candidate) != 2:
                raise LocalProtocolError(
                    f"PickRow.candidates must hold (e, index) pairs, got {candidate!r}"
                )
            e, index = candidate
            _check_range("PickRow", "candidates", index, 0, _I32_MAX)
            kept.append((_f32("PickRow", "candidates", e), index))
        object.__setattr__(self, "candidates", tuple(kept))


@dataclass(frozen=True, kw_only=True)
class RowPicks(_Frame):
    """A worker's answer to a ROW_DRAW (seq the step): one :class:`PickRow` for each of its
    rows, in order. Payload: count u32, then count x 24-byte rows (``PICK_ROW``), then the
    candidates of every row in row order, 8 bytes each (``PICK_CANDIDATE``)."""

    TYPE = FrameType.ROW_PICKS
    PAYLOAD_BASE = 4
    PAYLOAD_UNIT = PICK_CANDIDATE.size  # a row is 24 bytes: 3 units
    rows: tuple[PickRow, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "rows", tuple(self.rows))
        for row in self.rows:
            if not isinstance(row, PickRow):
                raise LocalProtocolError(f"RowPicks.rows must hold PickRow, got {row!r}")

    def _tail(self) -> bytes:
        heads = (PICK_ROW.pack(r.kind, r.index, r.target, len(r.candidates), 0) for r in self.rows)
        candidates = (PICK_CANDIDATE.pack(e, i) for r in self.rows for e, i in r.candidates)
        return _U32S.pack(len(self.rows)) + b"".join(heads) + b"".join(candidates)

    @classmethod
    def _parse(cls, buf: Readable, offset: int, length: int, **header: Any) -> Self:
        (count,) = _U32S.unpack_from(buf, offset)
        fixed = 4 + PICK_ROW.size * count
        if fixed > length:
            raise TpProtocolError(
                f"ROW_PICKS says {count} rows, which is {fixed} bytes before their candidates, "
                f"but its payload is {length} bytes"
            )
        heads = list(PICK_ROW.iter_unpack(memoryview(buf)[offset + 4 : offset + fixed]))
        for i, (*_, reserved) in enumerate(heads):
            if reserved:
                raise TpProtocolError(f"ROW_PICKS row {i}: nonzero reserved word")
        n_total = sum(n for _, _, _, n, _ in heads)
        if fixed + PICK_CANDIDATE.size * n_total != length:
            raise TpProtocolError(
                f"ROW_PICKS says {count} rows and {n_total} candidates, which is "
                f"{fixed + PICK_CANDIDATE.size * n_total} bytes, but its payload is {length} bytes"
            )
        data = memoryview(buf)[offset + fixed : offset + length]
        candidates = list(PICK_CANDIDATE.iter_unpack(data))
        rows: list[PickRow] = []
        start = 0
        for kind, index, target, n, _ in heads:
            rows.append(PickRow(kind, index, target, tuple(candidates[start : start + n])))
            start += n
        return cls(rows=tuple(rows), **header)


@dataclass(frozen=True)
class MassRow:
    """One row of a ROW_MASS, in the order of the step's rows: what a ROW_DRAW sent with
    ``row_mass`` left 0, ``acc`` the leader's mass and ``nonzero`` its count of tokens of
    probability > 0 (both 0 on a row of mode 0)."""

    acc: float
    nonzero: int

    def __post_init__(self) -> None:
        _check_range("MassRow", "nonzero", self.nonzero, 0, _U32)
        acc = _real("MassRow", "acc", self.acc)
        if not (math.isfinite(acc) and acc >= 0.0):
            raise LocalProtocolError(f"MassRow.acc must be finite and >= 0, got {acc!r}")
        object.__setattr__(self, "acc", acc)


@dataclass(frozen=True, kw_only=True)
class RowMass(_Rows):
    """The leader's ROW_MASS after its own pass, following the ROW_DRAW of a command sent with
    ``row_mass`` (seq the step): one :class:`MassRow` for each row of the ROW_DRAW, in order;
    each worker then answers with ROW_PICKS. Payload: count u32, then count x 16-byte rows
    (``MASS_ROW``)."""

    TYPE = FrameType.ROW_MASS
    ROW = MASS_ROW
    ROW_TYPE = MassRow
    rows: tuple[MassRow, ...] = ()


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
        _check_range("WorldPeer", "rank", self.rank, 1, TP_MAX_WORLD - 1)
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
        if (
            len(ranks) != len(self.peers)
            or ranks != list(range(1, len(ranks) + 1))
            or not (2 <= len(ranks) < TP_MAX_WORLD)
        ):
            raise LocalProtocolError(
                f"World.peers must list ranks 1 .. N-1 in order, 3 <= N <= {TP_MAX_WORLD}; got "
                f"ranks {ranks}"
            )

    def _tail(self) -> bytes:
        return b"".join(WORLD_ENTRY.pack(p.rank, p.gate_port, p.host, p.token) for p in self.peers)

    @classmethod
    def _parse_tail(cls, buf: Readable, offset: int, length: int) -> dict[str, Any]:
        data = memoryview(buf)[offset : offset + length]
        return {"peers": tuple(WorldPeer(*e) for e in WORLD_ENTRY.iter_unpack(data))}


ControlFrame = (
    Sync | Eval | Rewind | Invalidate | Stop | Hash | Logits | Verify | VerifyCommit
    | SessionCreate | SessionDestroy | EvalBatch | MixedBatch | CommandAck | SyncCheckpoint
    | World | RowTops | RowDraw | RowPicks | RowMass | MixedPrefills
)  # fmt: skip
Frame = Hello | ControlFrame

FRAME_CLASSES: dict[FrameType, type[_Frame]] = {
    cls.TYPE: cls
    for cls in (
        Sync, Eval, Rewind, Invalidate, Stop, Hash, Logits, Verify, VerifyCommit,
        SessionCreate, SessionDestroy, EvalBatch, MixedBatch, CommandAck, SyncCheckpoint,
        World, RowTops, RowDraw, RowPicks, RowMass, MixedPrefills,
    )
}  # fmt: skip
# Every seed frame type is either implemented or explicitly reserved, never both.
assert set(FRAME_CLASSES).isdisjoint(UNSUPPORTED_FRAME_TYPES)
assert set(FRAME_CLASSES) | set(UNSUPPORTED_FRAME_TYPES) == set(FrameType)
