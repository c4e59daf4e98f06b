"""FDTC's codec: the registry of message classes by type, the encoder (fragmenting a message
over one frame where both peers speak the extensions) and the incremental decoder."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from types import MappingProxyType

from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc.enums import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_MESSAGE,
    MAX_PAYLOAD,
    ErrorCode,
    MsgType,
)
from foundry.wire.fdtc.extensions import (
    FRAGMENTABLE,
    Assign,
    BaseModel,
    ControlAck,
    Dataset,
    Export,
    Fragment,
    LocalAssign,
    ModelConfigMsg,
    SwarmDetail,
    SwarmDetailReq,
    SwarmStatus,
    TrainPlan,
    Update,
    WeightsDigest,
)
from foundry.wire.fdtc.messages import (
    Checkpoint,
    Deregister,
    Error,
    Gradients,
    GradientsAck,
    Heartbeat,
    HeartbeatAck,
    Message,
    Pause,
    Register,
    RegisterAck,
    Resume,
    Shutdown,
    Start,
    Status,
    StatusReq,
    Sync,
)
from foundry.wire.fdtc.tensors import Weights, WeightsMeta, WeightsReq
from foundry.wire.framing import (
    MAPPED_PAYLOAD,
    NO_PAYLOAD,
    FrameDecoder,
    ReceiveBudget,
    payload_buffer,
)

# ---------------------------------------------------------------------------- registry

_CLASSES: tuple[type[Message], ...] = (
    Register,
    RegisterAck,
    Deregister,
    Heartbeat,
    HeartbeatAck,
    WeightsReq,
    Weights,
    WeightsMeta,
    Gradients,
    GradientsAck,
    Start,
    Sync,
    Checkpoint,
    Shutdown,
    Pause,
    Resume,
    StatusReq,
    Status,
    Assign,
    ModelConfigMsg,
    Dataset,
    SwarmStatus,
    ControlAck,
    Export,
    TrainPlan,
    Update,
    WeightsDigest,
    LocalAssign,
    SwarmDetailReq,
    SwarmDetail,
    Fragment,
    BaseModel,
    Error,
)
MESSAGE_TYPES: Mapping[MsgType, type[Message]] = MappingProxyType(
    {cls.TYPE: cls for cls in _CLASSES}
)


def _check_registry() -> None:
    """Every MsgType has exactly one class, and every fixed layout names the class's fields."""
    missing = sorted(t.name for t in MsgType if t not in MESSAGE_TYPES)
    if missing or len(MESSAGE_TYPES) != len(_CLASSES):
        raise RuntimeError(f"FDTC registry is incomplete or has duplicates; missing {missing}")
    for cls in _CLASSES:
        own = any("from_payload" in vars(k) for k in cls.__mro__ if k is not Message)
        if not own:  # decoded generically from LAYOUT alone
            names = tuple(f.name for f in fields(cls))
            if names != cls.LAYOUT.names:
                raise RuntimeError(f"{cls.__name__} fields {names} != layout {cls.LAYOUT.names}")


_check_registry()


# ---------------------------------------------------------------------------- encoding


def encode_parts(
    msg: Message, *, fragment_size: int | None = None, max_message: int = MAX_PAYLOAD
) -> list[bytes | memoryview]:
    """Header and payload pieces of ``msg``, to write in order (``writelines``) without
    copying tensor data.

    With ``fragment_size`` (a link whose peer reassembles FRAGMENT), a WEIGHTS, GRADIENTS or
    UPDATE payload larger than that goes as FRAGMENT frames of at most ``fragment_size`` bytes
    of it each, up to ``max_message`` bytes in all. Raises LocalProtocolError for a payload
    over MAX_PAYLOAD that may not be fragmented, or over ``max_message``."""
    parts = msg.payload_parts()
    length = sum(len(p) for p in parts)  # every part is bytes or a flat byte view
    if fragment_size is not None and msg.TYPE in FRAGMENTABLE and length > fragment_size:
        if not 0 < fragment_size <= MAX_PAYLOAD - Fragment.LAYOUT.size:
            raise LocalProtocolError(
                f"fragment_size {fragment_size} is outside 1..{MAX_PAYLOAD - Fragment.LAYOUT.size}"
            )
        if length > max_message:
            raise LocalProtocolError(
                f"{msg.TYPE.name} payload of {length} bytes exceeds this link's largest "
                f"message ({max_message} bytes)"
            )
        return _fragment_frames(msg.TYPE, parts, length, fragment_size)
    if length > MAX_PAYLOAD:
        raise LocalProtocolError(
            f"{msg.TYPE.name} payload of {length} bytes exceeds SW_MAX_MESSAGE_SIZE "
            f"({MAX_PAYLOAD} bytes); send fewer or smaller tensors"
        )
    return [HEADER.pack(MAGIC, msg.TYPE, length), *parts]


def _fragment_frames(
    msg_type: MsgType, parts: Sequence[bytes | memoryview], length: int, size: int
) -> list[bytes | memoryview]:
    """The FRAGMENT frames of one payload given as ``parts``: slices of the parts' own
    buffers, never copied."""
    views = [memoryview(p).cast("B") for p in parts]
    out: list[bytes | memoryview] = []
    part, pos = 0, 0  # where the next fragment's bytes begin: views[part][pos:]
    for offset in range(0, length, size):
        n = min(size, length - offset)
        out += [
            HEADER.pack(MAGIC, MsgType.FRAGMENT, Fragment.LAYOUT.size + n),
            Fragment.LAYOUT.pack((msg_type, length, offset)),
        ]
        while n:
            take = min(n, len(views[part]) - pos)
            if take:
                out.append(views[part][pos : pos + take])
            n -= take
            pos += take
            if pos == len(views[part]):
                part, pos = part + 1, 0
    return out


def encode(msg: Message) -> bytes:
    """The whole frame of ``msg``: 9-byte header + payload."""
    return b"".join(encode_parts(msg))


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Exactly one whole frame to its message (tests, tools). Incomplete or trailing input
    is an FdtcProtocolError."""
    decoder = FdtcDecoder()
    decoder.feed(data)
    msg = decoder.next_event()
    if msg is None:
        raise FdtcProtocolError(f"incomplete frame: {len(bytes(data))} bytes")
    if decoder.buffered or decoder.next_event() is not None:
        raise FdtcProtocolError("trailing bytes after the first frame")
    return msg


# ---------------------------------------------------------------------------- decoding


class FdtcDecoder(FrameDecoder[Message]):
    """Incremental FDTC decoder (``foundry.wire.framing``): ``feed`` bytes, take ``next_event``.

    The header is checked (magic, type, ``length <= max_payload``, the type's size rule) the
    moment its 9th byte arrives, before any payload byte is kept, so ``buffered`` never
    exceeds 9 + ``max_payload``; WEIGHTS / GRADIENTS data is handed out as a view of the
    payload's own buffer. Bad bytes raise FdtcProtocolError, in stream order.

    FRAGMENT frames are refused unless the link agreed to them: ``max_message`` (0 by
    default) is then the largest message they may build. ``admit`` (if set) may refuse a
    message type before a large buffer is made for it: at the header of a frame of
    ``MAPPED_PAYLOAD`` bytes or more, and when a message's first fragment arrives. The
    fragments' bytes go into one buffer of the announced size (pages committed only as bytes
    arrive), and the message comes out when the last one is in; ``reassembling`` says how
    many bytes of it are held.
    """

    def __init__(
        self,
        max_payload: int = MAX_PAYLOAD,
        *,
        max_message: int = 0,
        budget: ReceiveBudget | None = None,
    ) -> None:
        if not 0 <= max_payload <= MAX_PAYLOAD:
            raise LocalProtocolError(f"max_payload {max_payload} is outside 0..{MAX_PAYLOAD}")
        super().__init__(budget)
        self._max_payload = max_payload
        self.max_message = max_message
        self.admit: Callable[[MsgType, int, bool], None] | None = None
        self._cls: type[Message] = Message
        self._whole = NO_PAYLOAD  # the fragmented message's payload, its first _held bytes in
        self._whole_type = MsgType.WEIGHTS
        self._held = 0
        self._whole_taken = 0  # bytes of the budget held for _whole

    @property
    def max_payload(self) -> int:
        return self._max_payload

    @property
    def max_message(self) -> int:
        return self._max_message

    @max_message.setter
    def max_message(self, limit: int) -> None:
        if not 0 <= limit <= MAX_MESSAGE:
            raise LocalProtocolError(f"max_message {limit} is outside 0..{MAX_MESSAGE}")
        self._max_message = limit

    @property
    def reassembling(self) -> int:
        """Bytes held of a fragmented message whose last fragment has not come yet."""
        return self._held if len(self._whole) else 0

    def _header_size(self) -> int:
        return HEADER_SIZE

    def _begin(self, header: bytes) -> int:
        magic, code, length = HEADER.unpack(header)
        if magic != MAGIC:
            raise FdtcProtocolError(f"bad magic 0x{magic:08x}, expected 0x{MAGIC:08x} (FDTC)")
        try:
            cls = MESSAGE_TYPES[MsgType(code)]
        except ValueError:
            raise FdtcProtocolError(f"unknown message type 0x{code:02x}") from None
        if length > self._max_payload:
            raise FdtcProtocolError(
                f"{cls.TYPE.name} payload of {length} bytes exceeds the limit of "
                f"{self._max_payload} bytes",
                ErrorCode.BUSY if length <= MAX_PAYLOAD else ErrorCode.BAD_FRAME,
            )
        if cls is Fragment and not self._max_message:
            raise FdtcProtocolError(
                "FRAGMENT on a link that takes none (only a peer that speaks the extensions, "
                "once registered, may send them)",
                ErrorCode.UNEXPECTED,
            )
        if cls is not Fragment and len(self._whole):
            raise FdtcProtocolError(
                f"{cls.TYPE.name} in the middle of a fragmented {self._whole_type.name} "
                f"({self._held} of {len(self._whole)} bytes in): a message's fragments come "
                "back to back",
                ErrorCode.UNEXPECTED,
            )
        cls.check_length(length)
        if cls is not Fragment and length >= MAPPED_PAYLOAD and self.admit is not None:
            self.admit(cls.TYPE, length, False)
        self._cls = cls
        return int(length)

    def _finish(self, payload: memoryview) -> Message | None:
        msg = self._decoded(self._cls, payload)
        return self._reassemble(msg) if isinstance(msg, Fragment) else msg

    def _decoded(self, cls: type[Message], payload: memoryview) -> Message:
        try:
            return cls.from_payload(payload)
        except LocalProtocolError as exc:  # a field value the dataclass refuses
            raise FdtcProtocolError(f"bad {cls.TYPE.name} payload: {exc}") from None
        except FdtcProtocolError as exc:
            raise FdtcProtocolError(f"bad {cls.TYPE.name} payload: {exc}", exc.error_code) from None

    def _reassemble(self, f: Fragment) -> Message | None:
        """Add one fragment's bytes; the whole message once the last one is in."""
        total, kind = f.total_length, f.message_type.name
        if not len(self._whole):
            if f.offset:
                raise FdtcProtocolError(
                    f"FRAGMENT of {kind} at offset {f.offset} with no message begun: a "
                    "message's first fragment has offset 0",
                    ErrorCode.UNEXPECTED,
                )
            if total > self._max_message:
                raise FdtcProtocolError(
                    f"fragmented {kind} of {total} bytes exceeds this link's largest message "
                    f"({self._max_message} bytes)",
                    ErrorCode.BUSY if total <= MAX_MESSAGE else ErrorCode.BAD_FRAME,
                )
            MESSAGE_TYPES[f.message_type].check_length(total)
            if self.admit is not None:
                self.admit(f.message_type, total, True)
            self._whole_taken = self.reserve(total, f"a fragmented {kind}")
            self._whole, self._whole_type, self._held = payload_buffer(total), f.message_type, 0
        elif (f.message_type, total, f.offset) != (self._whole_type, len(self._whole), self._held):
            raise FdtcProtocolError(
                f"FRAGMENT of {kind} ({total} bytes) at offset {f.offset}; expected the "
                f"{self._whole_type.name} of {len(self._whole)} bytes begun, at offset "
                f"{self._held}",
                ErrorCode.UNEXPECTED,
            )
        n = len(f.data)
        self._whole[self._held : self._held + n] = f.data
        self._held += n
        if self._held < total:
            return None
        whole, self._whole, self._held = self._whole.toreadonly(), NO_PAYLOAD, 0
        self.unreserve(self._whole_taken)
        self._whole_taken = 0
        return self._decoded(MESSAGE_TYPES[self._whole_type], whole)

    def release(self) -> None:
        super().release()
        self._whole, self._held = NO_PAYLOAD, 0
        self.unreserve(self._whole_taken)
        self._whole_taken = 0

    def unfinished(self) -> str | None:
        if (frame := super().unfinished()) is not None:
            return frame
        if len(self._whole):
            return (
                f"a fragmented {self._whole_type.name} ({self._held} of "
                f"{len(self._whole)} bytes received)"
            )
        return None

    def _eof_error(self, message: str) -> FdtcProtocolError:
        return FdtcProtocolError(message)

    def _busy_error(self, message: str) -> FdtcProtocolError:
        return FdtcProtocolError(message, ErrorCode.BUSY)
