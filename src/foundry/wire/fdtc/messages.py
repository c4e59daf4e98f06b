"""FDTC's messages of the seed header (``foundry_swarm_protocol.h``): the ``Message`` base and
its layouts, registration, health, gradients, control and status. WEIGHTS and its
WEIGHTS_META are in ``tensors``, the project's extensions in ``extensions``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc.enums import (
    MAX_PATH,
    MAX_WORKER_ID,
    Compression,
    ErrorCode,
    HardwareProfile,
    MsgType,
)
from foundry.wire.layout import BOOL, F32, U8, U32, U64, Layout
from foundry.wire.layout import Enum as _Enum
from foundry.wire.layout import Str as _Str

# ---------------------------------------------------------------------------- field kinds
#
# A C struct is a list of (field name, kind): ``foundry.wire.layout``, shared with the frontend
# codec. Every FDTC layout raises FdtcProtocolError for a peer's bad field value.


class _Layout(Layout):
    error = FdtcProtocolError


# ---------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Message:
    """Base of every FDTC message: a frozen dataclass that validates itself when built.

    ``LAYOUT`` is the payload's C struct; a message whose payload is not one fixed struct
    overrides ``payload_parts``, ``from_payload`` and ``check_length``.
    """

    TYPE: ClassVar[MsgType]
    LAYOUT: ClassVar[_Layout] = _Layout()

    def __post_init__(self) -> None:
        self.LAYOUT.normalise(self)

    def payload(self) -> bytes:
        """The payload bytes (a copy for the large messages; see ``payload_parts``)."""
        return b"".join(self.payload_parts())

    def payload_parts(self) -> tuple[bytes | memoryview, ...]:
        """The payload as pieces to write in order, without copying large tensor data."""
        return (self.LAYOUT.pack_obj(self),)

    @classmethod
    def check_length(cls, length: int) -> None:
        """Refuse a header's payload length that this type can never have."""
        if length != cls.LAYOUT.size:
            raise FdtcProtocolError(
                f"{cls.TYPE.name} payload must be {cls.LAYOUT.size} bytes, header says {length}"
            )

    @classmethod
    def from_payload(cls, payload: memoryview) -> Self:
        """Decode a payload whose length ``check_length`` accepted."""
        return cls(**cls.LAYOUT.unpack(payload))


@dataclass(frozen=True)
class _OptionalPayload(Message):
    """A message of ours whose seed form is empty: an empty payload decodes to the defaults."""

    @classmethod
    def check_length(cls, length: int) -> None:
        if length not in (0, cls.LAYOUT.size):
            raise FdtcProtocolError(
                f"{cls.TYPE.name} payload must be 0 or {cls.LAYOUT.size} bytes, header says "
                f"{length}"
            )

    @classmethod
    def from_payload(cls, payload: memoryview) -> Self:
        return cls() if len(payload) == 0 else super().from_payload(payload)


# --- registration


@dataclass(frozen=True)
class Register(Message):
    """REGISTER (worker -> coordinator), sw_register_payload, 85 bytes."""

    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("worker_id", _Str(MAX_WORKER_ID)),
        ("protocol_version", U8),
        ("profile", _Enum("I", HardwareProfile)),
        ("num_cores", U32),
        ("memory_mb", U64),
        ("suggested_batch_size", U32),
    )
    worker_id: str
    protocol_version: int
    profile: HardwareProfile
    num_cores: int
    memory_mb: int
    suggested_batch_size: int


@dataclass(frozen=True)
class RegisterAck(Message):
    """REGISTER_ACK (coordinator -> worker), sw_register_ack_payload, 29 bytes.

    A refusal (``accepted=False``) is followed by an ERROR that says why.
    """

    TYPE: ClassVar[MsgType] = MsgType.REGISTER_ACK
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("accepted", BOOL),
        ("assigned_shard", U32),
        ("total_shards", U32),
        ("batch_size", U32),
        ("accumulation_steps", U32),
        ("compression", _Enum("I", Compression)),
        ("topk_ratio", F32),
        ("global_step", U32),
    )
    accepted: bool
    assigned_shard: int
    total_shards: int
    batch_size: int
    accumulation_steps: int
    compression: Compression
    topk_ratio: float
    global_step: int

    def __post_init__(self) -> None:
        super().__post_init__()
        # Meaningful only for TOPK, but a fraction in any case (a refusal may send 0).
        if not 0.0 <= self.topk_ratio <= 1.0:
            raise LocalProtocolError(f"topk_ratio {self.topk_ratio} is outside 0..1")


@dataclass(frozen=True)
class Deregister(Message):
    """DEREGISTER (worker -> coordinator): a clean exit. Empty payload."""

    TYPE: ClassVar[MsgType] = MsgType.DEREGISTER


# --- health


@dataclass(frozen=True)
class Heartbeat(Message):
    """HEARTBEAT (worker -> coordinator), sw_heartbeat_payload, 76 bytes."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("worker_id", _Str(MAX_WORKER_ID)),
        ("local_step", U32),
        ("current_loss", F32),
        ("samples_per_sec", F32),
    )
    worker_id: str
    local_step: int
    current_loss: float
    samples_per_sec: float


@dataclass(frozen=True)
class HeartbeatAck(_OptionalPayload):
    """HEARTBEAT_ACK (coordinator -> worker): ours, u32 global_step (4 bytes) or empty."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT_ACK
    LAYOUT: ClassVar[_Layout] = _Layout(("global_step", U32))
    global_step: int = 0  # what an empty (seed) payload decodes to: "not reported"


def _as_buffer(name: str, data: Any) -> bytes | memoryview:
    """Bytes as given, or a flat read-only byte view of any other contiguous buffer."""
    if isinstance(data, bytes):
        return data
    try:
        view = memoryview(data)
    except TypeError:
        raise LocalProtocolError(f"{name} must be a bytes-like object, got {data!r}") from None
    if not view.c_contiguous:
        raise LocalProtocolError(f"{name} must be a contiguous buffer")
    return view.cast("B").toreadonly()


# --- gradients


class _HeaderAndData(Message):
    """A fixed header (``LAYOUT``) followed by a tensor data section that runs to the end of
    the payload (``data``, kept as the view it arrived in). Not a dataclass itself: each
    message declares ``data`` last, after its header fields."""

    num_tensors: int
    uncompressed_size: int
    data: bytes | memoryview

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "data", _as_buffer("data", self.data))

    def check_tensors(self, numels: Sequence[int]) -> None:
        """Raise the peer's error (MODEL_MISMATCH) unless the header describes tensors of
        ``numels`` elements, the receiver's model in WEIGHTS_META order: ``num_tensors`` of
        them, ``uncompressed_size`` = 4 x their elements (f32 once decoded). Checked on
        receipt, before the data section is decoded."""
        name = self.TYPE.name
        if self.num_tensors != len(numels):
            raise FdtcProtocolError(
                f"{name} carries {self.num_tensors} tensors, the model has {len(numels)}",
                ErrorCode.MODEL_MISMATCH,
            )
        expected = 4 * sum(numels)
        if self.uncompressed_size != expected:
            raise FdtcProtocolError(
                f"{name} says uncompressed_size {self.uncompressed_size}, but the model's "
                f"{len(numels)} tensors hold {sum(numels)} f32 values = {expected} bytes: "
                "the peer has another model or a bad encoder",
                ErrorCode.MODEL_MISMATCH,
            )

    def payload_parts(self) -> tuple[bytes | memoryview, ...]:
        return (self.LAYOUT.pack_obj(self), self.data)

    @classmethod
    def check_length(cls, length: int) -> None:
        if length < cls.LAYOUT.size:
            raise FdtcProtocolError(
                f"{cls.TYPE.name} payload must be at least {cls.LAYOUT.size} bytes, header "
                f"says {length}"
            )

    @classmethod
    def from_payload(cls, payload: memoryview) -> Self:
        header = cls.LAYOUT.unpack(payload)
        # Each subclass is a dataclass whose fields are its header's then ``data``; this base
        # is not one, so the checker sees no such constructor here.
        return cls(**header, data=payload[cls.LAYOUT.size :])  # type: ignore[call-arg]


@dataclass(frozen=True)
class Gradients(_HeaderAndData):
    """GRADIENTS (worker -> coordinator): the 80-byte sw_gradients_payload header, then
    ``num_tensors`` tensors in WEIGHTS_META order, each serialised by the ``compression``
    codec (``foundry.compression``). ``uncompressed_size`` is 4 * total elements.
    """

    TYPE: ClassVar[MsgType] = MsgType.GRADIENTS
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("worker_id", _Str(MAX_WORKER_ID)),
        ("local_step", U32),
        ("num_tensors", U32),
        ("compression", _Enum("I", Compression)),
        ("uncompressed_size", U32),
    )
    worker_id: str
    local_step: int
    num_tensors: int
    compression: Compression
    uncompressed_size: int
    data: bytes | memoryview = field(repr=False)


@dataclass(frozen=True)
class GradientsAck(_OptionalPayload):
    """GRADIENTS_ACK (coordinator -> worker): ours, u32 global_step + u8 accepted (5 bytes),
    or empty from a seed-only peer. ``accepted=False``: stale or refused, not aggregated."""

    TYPE: ClassVar[MsgType] = MsgType.GRADIENTS_ACK
    LAYOUT: ClassVar[_Layout] = _Layout(("global_step", U32), ("accepted", BOOL))
    global_step: int = 0
    accepted: bool = True  # a seed ack means "got them"


# --- control (empty payloads)


@dataclass(frozen=True)
class Start(Message):
    """START: training on. Coordinator -> worker, and admin -> coordinator."""

    TYPE: ClassVar[MsgType] = MsgType.START


@dataclass(frozen=True)
class Sync(Message):
    """SYNC: a sync point (informational for workers)."""

    TYPE: ClassVar[MsgType] = MsgType.SYNC


@dataclass(frozen=True)
class Checkpoint(Message):
    """CHECKPOINT: checkpoint now. Coordinator -> worker, and admin -> coordinator."""

    TYPE: ClassVar[MsgType] = MsgType.CHECKPOINT


@dataclass(frozen=True)
class Shutdown(Message):
    """SHUTDOWN: training is done. Coordinator -> worker, and admin -> coordinator."""

    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN


@dataclass(frozen=True)
class Pause(Message):
    """PAUSE. Coordinator -> worker, and admin -> coordinator."""

    TYPE: ClassVar[MsgType] = MsgType.PAUSE


@dataclass(frozen=True)
class Resume(Message):
    """RESUME. Coordinator -> worker, and admin -> coordinator."""

    TYPE: ClassVar[MsgType] = MsgType.RESUME


# --- status


@dataclass(frozen=True)
class StatusReq(Message):
    """STATUS_REQ: coordinator -> worker (answered by STATUS), admin -> coordinator
    (answered by SWARM_STATUS)."""

    TYPE: ClassVar[MsgType] = MsgType.STATUS_REQ


@dataclass(frozen=True)
class Status(Message):
    """STATUS (worker -> coordinator), sw_status_payload, 93 bytes."""

    TYPE: ClassVar[MsgType] = MsgType.STATUS
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("worker_id", _Str(MAX_WORKER_ID)),
        ("local_step", U32),
        ("samples_processed", U32),
        ("current_loss", F32),
        ("avg_loss", F32),
        ("samples_per_sec", F32),
        ("memory_used_mb", U64),
        ("is_training", BOOL),
    )
    worker_id: str
    local_step: int
    samples_processed: int
    current_loss: float
    avg_loss: float
    samples_per_sec: float
    memory_used_mb: int
    is_training: bool


@dataclass(frozen=True)
class Error(Message):
    """ERROR (either direction), sw_error_payload, 260 bytes: u32 error_code, char[256].

    ``error_code`` is any u32 (a peer may send codes we do not know); ours are ``ErrorCode``.
    """

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    LAYOUT: ClassVar[_Layout] = _Layout(("error_code", U32), ("message", _Str(MAX_PATH)))
    error_code: int
    message: str
