"""FDTC, the swarm training protocol (coordinator <-> workers, coordinator <-> admin), sans-IO.

Byte-compatible with ``foundry_swarm_protocol.h`` compiled on a little-endian machine: every
C struct is ``__attribute__((packed))``, so each one is a single ``struct.Struct('<...')``
here with no padding; C enums are 4-byte little-endian integers; ``bool`` is one byte, 0 or 1;
``char[N]`` is NUL-padded UTF-8. ``docs/protocol.md`` has every byte of every message.

Frame: a 9-byte header (``magic u32 = 0x46445443``, ``type u8``, ``length u32``) then
``length`` bytes of payload. The decoder checks magic, type, the length limit and the
per-type payload size as soon as the 9 header bytes are in, before it keeps a payload byte.

Decisions the header leaves open, taken here once:

- ``char[N]`` fields carry at most N-1 bytes of UTF-8 and always end in NUL, so a C peer can
  ``strlen``/``printf`` them safely; a string that does not fit is our error at construction
  (``LocalProtocolError``), and an unterminated field from a peer is theirs.
- ``float`` fields are normalised to the value the wire carries, written as the shortest
  decimal that round-trips through f32 (``Heartbeat(current_loss=0.1).current_loss == 0.1``,
  and decode(encode(m)) == m). NaN and infinities pass through (a diverged loss is news).
- Enum fields must hold a known value: an unknown profile or compression code is refused
  rather than carried, since nothing downstream could act on it.
- Messages 0x60..0x6F are project extensions (ASSIGN, MODEL_CONFIG, DATASET, SWARM_STATUS,
  CONTROL_ACK, EXPORT, ..., SWARM_DETAIL); HEARTBEAT_ACK and GRADIENTS_ACK carry a small
  payload of ours and also accept the empty payload a seed-only peer sends.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import IntEnum
from types import MappingProxyType
from typing import Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.framing import NO_PAYLOAD, FrameDecoder, payload_buffer
from foundry.wire.layout import BOOL, F32, U8, U32, U64, Layout
from foundry.wire.layout import Bytes as _Bytes
from foundry.wire.layout import Enum as _Enum
from foundry.wire.layout import Str as _Str

__all__ = [
    "FRAGMENTABLE",
    "FRAGMENT_SIZE",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_DIMS",
    "MAX_MESSAGE",
    "MAX_PATH",
    "MAX_PAYLOAD",
    "MAX_WORKER_ID",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "Assign",
    "BaseModel",
    "Checkpoint",
    "Compression",
    "ControlAck",
    "DType",
    "Dataset",
    "Deregister",
    "Error",
    "ErrorCode",
    "Export",
    "FdtcDecoder",
    "FdtcProtocolError",
    "FileType",
    "Fragment",
    "Gradients",
    "GradientsAck",
    "HardwareProfile",
    "Heartbeat",
    "HeartbeatAck",
    "LocalAssign",
    "Message",
    "ModelConfigMsg",
    "MsgType",
    "Pause",
    "Register",
    "RegisterAck",
    "Resume",
    "Shutdown",
    "Start",
    "Status",
    "StatusReq",
    "SwarmDetail",
    "SwarmDetailReq",
    "SwarmDetailRow",
    "SwarmState",
    "SwarmStatus",
    "SwarmStatusRow",
    "Sync",
    "TensorMeta",
    "TrainPlan",
    "Update",
    "Weights",
    "WeightsDigest",
    "WeightsMeta",
    "WeightsReq",
    "WorkerState",
    "decode",
    "encode",
    "encode_parts",
    "msg_type_name",
    "profile_accumulation_steps",
    "profile_batch_size",
    "profile_name",
    "weights_messages",
    "weights_tensors",
]

MAGIC = 0x46445443  # "FDTC"; on the wire 43 54 44 46
PROTOCOL_VERSION = 1
# SW_MAX_MESSAGE_SIZE: the largest payload a header may announce. A decoder refuses a bigger
# length before it buffers anything, so a hostile header cannot make us allocate.
MAX_PAYLOAD = 256 * 1024 * 1024
# FRAGMENT (ours): between peers that speak the extensions, a WEIGHTS, GRADIENTS or UPDATE
# payload larger than one frame (a model over 256 MiB in f32) travels as consecutive FRAGMENT
# frames, each a slice of at most FRAGMENT_SIZE bytes by default, reassembled by the decoder.
# MAX_MESSAGE bounds what fragments may carry: GRADIENTS' u32 uncompressed_size holds 4 GiB.
MAX_MESSAGE = 4 * 1024 * 1024 * 1024
FRAGMENT_SIZE = 64 * 1024 * 1024
MAX_WORKER_ID = 64  # SW_MAX_WORKER_ID: size of char worker_id[64]
MAX_PATH = 256  # SW_MAX_PATH: size of the path and message char arrays
MAX_DIMS = 8  # uint64_t shape[8] in sw_tensor_meta
MAX_NAME = 64  # char name[64] in sw_tensor_meta

HEADER = struct.Struct("<IBI")  # sw_msg_header: magic, type, length
HEADER_SIZE = HEADER.size  # 9

_U64_MAX = 0xFFFF_FFFF_FFFF_FFFF


# ---------------------------------------------------------------------------- enums


class MsgType(IntEnum):
    """sw_msg_type, plus the project's extensions in 0x60..0x6F."""

    REGISTER = 0x01
    REGISTER_ACK = 0x02
    DEREGISTER = 0x03
    HEARTBEAT = 0x10
    HEARTBEAT_ACK = 0x11
    WEIGHTS_REQ = 0x20
    WEIGHTS = 0x21
    WEIGHTS_META = 0x22
    GRADIENTS = 0x30
    GRADIENTS_ACK = 0x31
    START = 0x40
    SYNC = 0x45
    CHECKPOINT = 0x46
    SHUTDOWN = 0x47
    PAUSE = 0x48
    RESUME = 0x49
    STATUS_REQ = 0x50
    STATUS = 0x51
    # Extensions (ours): 0x60..0x6F.
    ASSIGN = 0x60
    MODEL_CONFIG = 0x61
    DATASET = 0x62
    SWARM_STATUS = 0x63
    CONTROL_ACK = 0x64
    EXPORT = 0x65
    TRAIN_PLAN = 0x66
    UPDATE = 0x67
    WEIGHTS_DIGEST = 0x68
    LOCAL_ASSIGN = 0x69
    SWARM_DETAIL_REQ = 0x6A
    SWARM_DETAIL = 0x6B
    FRAGMENT = 0x6C
    BASE_MODEL = 0x6D
    ERROR = 0xFF


class HardwareProfile(IntEnum):
    """sw_hardware_profile (a 4-byte enum on the wire)."""

    RPI3 = 0
    RPI4_2G = 1
    RPI4_4G = 2
    RPI4_8G = 3
    LAPTOP_LIGHT = 4
    LAPTOP_MID = 5
    DESKTOP_MID = 6
    DESKTOP_HEAVY = 7
    SERVER = 8
    UNKNOWN = 9


class Compression(IntEnum):
    """sw_compress_type (a 4-byte enum on the wire)."""

    NONE = 0
    FP16 = 1
    TOPK = 2
    QSGD = 3


class FileType(IntEnum):
    """The tensor type of the GGUF file EXPORT writes (ours); the names of ``--type``
    (``model.gguf_io.FILE_DTYPES``), in that order."""

    F32 = 0
    F16 = 1
    Q8_0 = 2
    Q4_0 = 3


class DType(IntEnum):
    """tm_dtype of sw_tensor_meta (ours to define). Codes 2..255 are free for later types."""

    F32 = 0
    F16 = 1

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.F32 else 2

    @property
    def numpy(self) -> str:
        return "<f4" if self is DType.F32 else "<f2"


class ErrorCode(IntEnum):
    """ERROR error_code values (ours; the header defines none). 0 is never sent."""

    BAD_FRAME = 1  # malformed bytes: bad magic, unknown type, wrong size, bad field value
    VERSION_MISMATCH = 2  # REGISTER protocol_version we do not speak
    REJECTED = 3  # registration refused by policy (empty id, swarm full of that id, ...)
    DATA_MISMATCH = 4  # the worker's DATASET fingerprint differs from the coordinator's
    MODEL_MISMATCH = 5  # tensors or model config do not match
    STALE = 6  # work for a step that is already closed
    NOT_REGISTERED = 7  # a worker message before REGISTER
    BUSY = 8  # a limit was reached (workers, connections, payload size)
    INTERNAL = 9  # the sender failed; not the receiver's fault
    UNEXPECTED = 10  # a known message the link's current state does not allow


class SwarmState(IntEnum):
    """SWARM_STATUS state (u8)."""

    WAITING = 0
    TRAINING = 1
    PAUSED = 2
    DONE = 3


class WorkerState(IntEnum):
    """SWARM_STATUS row state (u8)."""

    REGISTERED = 0
    TRAINING = 1
    IDLE = 2
    DROPPED = 3


def msg_type_name(code: int) -> str:
    """sw_msg_type_name: ``"REGISTER"``, ..., ``"UNKNOWN"`` for a code that is not a type."""
    try:
        return MsgType(code).name
    except ValueError:
        return "UNKNOWN"


# sw_profile_batch_size / sw_profile_accumulation_steps. Samples per round grow with the
# machine's expected compute (a Pi 4 ~ 2x a Pi 3, each class above ~ 2x the one below); the
# micro-batch is what memory allows, and accumulation makes up the rest, so small devices run
# small batches and accumulate more. The coordinator re-balances by measured samples/s later.
# profile: (micro-batch, accumulation steps), and samples per round in the comment.
_PROFILE_TABLE: Mapping[HardwareProfile, tuple[int, int]] = MappingProxyType({
    HardwareProfile.RPI3: (1, 8),  # 8
    HardwareProfile.RPI4_2G: (2, 8),  # 16
    HardwareProfile.RPI4_4G: (4, 4),  # 16
    HardwareProfile.RPI4_8G: (8, 2),  # 16
    HardwareProfile.LAPTOP_LIGHT: (8, 4),  # 32
    HardwareProfile.LAPTOP_MID: (16, 4),  # 64
    HardwareProfile.DESKTOP_MID: (32, 4),  # 128
    HardwareProfile.DESKTOP_HEAVY: (64, 4),  # 256
    HardwareProfile.SERVER: (128, 4),  # 512
    HardwareProfile.UNKNOWN: (2, 4),  # 8: as careful as a Pi 3 until measured
})


def _profile(profile: int) -> HardwareProfile:
    try:
        return HardwareProfile(profile)
    except ValueError:
        return HardwareProfile.UNKNOWN


def profile_name(profile: int) -> str:
    """sw_profile_name: the enum name (``"RPI4_4G"``); ``"UNKNOWN"`` for unknown codes."""
    return _profile(profile).name


def profile_batch_size(profile: int) -> int:
    """sw_profile_batch_size: the micro-batch a machine of this profile starts with."""
    return _PROFILE_TABLE[_profile(profile)][0]


def profile_accumulation_steps(profile: int) -> int:
    """sw_profile_accumulation_steps: micro-batches accumulated per round at the start."""
    return _PROFILE_TABLE[_profile(profile)][1]


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


# --- weights


@dataclass(frozen=True)
class WeightsReq(Message):
    """WEIGHTS_REQ (worker -> coordinator): send me the current weights. Empty payload."""

    TYPE: ClassVar[MsgType] = MsgType.WEIGHTS_REQ


_TENSOR_META = struct.Struct(f"<{MAX_NAME}sI{MAX_DIMS}QQB")  # sw_tensor_meta, 141 bytes
_NAME = _Str(MAX_NAME)
_DTYPE = _Enum("B", DType)


@dataclass(frozen=True)
class TensorMeta:
    """sw_tensor_meta (141 bytes): name, ndim, shape[8] (unused dims 0), numel, dtype.

    ``numel`` is derived from the shape here; a peer's numel must equal the product of its
    first ``ndim`` dimensions.
    """

    STRUCT: ClassVar[struct.Struct] = _TENSOR_META
    name: str
    shape: tuple[int, ...]
    dtype: DType = DType.F32

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", _NAME.check("name", self.name))
        if not isinstance(self.shape, tuple | list):
            raise LocalProtocolError(f"shape of {self.name!r} must be a tuple, got {self.shape!r}")
        if len(self.shape) > MAX_DIMS:
            raise LocalProtocolError(
                f"{self.name!r} has {len(self.shape)} dimensions; sw_tensor_meta holds {MAX_DIMS}"
            )
        shape = tuple(U64.check(f"shape of {self.name!r}", d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        if math.prod(shape) > _U64_MAX:
            raise LocalProtocolError(f"{self.name!r} has more than 2**64-1 elements")
        object.__setattr__(self, "dtype", _DTYPE.check("dtype", self.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def pack(self) -> bytes:
        dims = self.shape + (0,) * (MAX_DIMS - len(self.shape))
        return _TENSOR_META.pack(
            _NAME.to_wire(self.name), len(self.shape), *dims, self.numel, int(self.dtype)
        )

    @classmethod
    def unpack(cls, buf: memoryview, offset: int) -> TensorMeta:
        raw_name, ndim, *rest = _TENSOR_META.unpack_from(buf, offset)
        dims, numel, dtype = rest[:MAX_DIMS], rest[MAX_DIMS], rest[MAX_DIMS + 1]
        name = _NAME.from_wire("tensor name", raw_name, FdtcProtocolError)
        if ndim > MAX_DIMS:
            raise FdtcProtocolError(f"tensor {name!r} has ndim {ndim}; at most {MAX_DIMS}")
        shape = tuple(dims[:ndim])
        if math.prod(shape) != numel:
            raise FdtcProtocolError(
                f"tensor {name!r}: numel {numel} is not the product of shape {shape}"
            )
        return cls(name=name, shape=shape, dtype=dtype)


@dataclass(frozen=True)
class WeightsMeta(Message):
    """WEIGHTS_META (coordinator -> worker): 12-byte sw_weights_meta_payload + 141 per tensor.

    Always followed by WEIGHTS, whose payload holds every tensor's data in this order.
    """

    TYPE: ClassVar[MsgType] = MsgType.WEIGHTS_META
    HEAD: ClassVar[_Layout] = _Layout(
        ("num_tensors", U32), ("global_step", U32), ("learning_rate", F32)
    )
    global_step: int
    learning_rate: float
    tensors: tuple[TensorMeta, ...] = ()

    def __post_init__(self) -> None:
        self.HEAD.normalise(self, skip=("num_tensors",))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        for t in self.tensors:
            if not isinstance(t, TensorMeta):
                raise LocalProtocolError(f"tensors must hold TensorMeta, got {t!r}")

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @property
    def nbytes(self) -> int:
        """Size of the WEIGHTS payload that must follow."""
        return sum(t.nbytes for t in self.tensors)

    def payload_parts(self) -> tuple[bytes | memoryview, ...]:
        head = self.HEAD.pack_obj(self, num_tensors=self.num_tensors)
        return (head, *(t.pack() for t in self.tensors))

    @classmethod
    def check_length(cls, length: int) -> None:
        if length < cls.HEAD.size or (length - cls.HEAD.size) % _TENSOR_META.size:
            raise FdtcProtocolError(
                f"WEIGHTS_META payload must be {cls.HEAD.size} + {_TENSOR_META.size} * "
                f"num_tensors bytes, header says {length}"
            )

    @classmethod
    def from_payload(cls, payload: memoryview) -> Self:
        head = cls.HEAD.unpack(payload)
        count = (len(payload) - cls.HEAD.size) // _TENSOR_META.size
        if head["num_tensors"] != count:
            raise FdtcProtocolError(
                f"WEIGHTS_META says num_tensors {head['num_tensors']} but carries {count}"
            )
        tensors = tuple(
            TensorMeta.unpack(payload, cls.HEAD.size + i * _TENSOR_META.size)
            for i in range(count)
        )
        return cls(
            global_step=head["global_step"], learning_rate=head["learning_rate"],
            tensors=tensors,
        )


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


@dataclass(frozen=True)
class Weights(Message):
    """WEIGHTS (coordinator -> worker): every tensor of the preceding WEIGHTS_META, in order,
    each in its tm_dtype (F32: little-endian f32, 4 bytes per element), no separators.

    ``data`` is bytes or a read-only memoryview (the decoder hands out a view of the buffer
    it received into, without copying); ``weights_tensors`` splits it into arrays.
    """

    TYPE: ClassVar[MsgType] = MsgType.WEIGHTS
    data: bytes | memoryview = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", _as_buffer("data", self.data))

    def payload_parts(self) -> tuple[bytes | memoryview, ...]:
        return (self.data,)

    @classmethod
    def check_length(cls, length: int) -> None:
        return  # any size up to the limit; its match with WEIGHTS_META is the reader's check

    @classmethod
    def from_payload(cls, payload: memoryview) -> Self:
        return cls(payload)


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


# --- extensions (0x60..0x6F)


@dataclass(frozen=True)
class Assign(Message):
    """ASSIGN (coordinator -> worker), ours, 36 bytes: the work of one round.

    The worker computes the mean gradient over global samples
    ``[sample_offset, sample_offset + n_samples)`` in micro-batches of ``batch_size``
    (``accumulation_steps`` of them, the last one possibly short) and reports it as
    GRADIENTS with ``local_step = global_step``.
    """

    TYPE: ClassVar[MsgType] = MsgType.ASSIGN
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("global_step", U32),
        ("sample_offset", U64),
        ("batch_size", U32),
        ("accumulation_steps", U32),
        ("assigned_shard", U32),
        ("total_shards", U32),
        ("seq_len", U32),
        ("n_samples", U32),
    )
    global_step: int
    sample_offset: int
    batch_size: int
    accumulation_steps: int
    assigned_shard: int
    total_shards: int
    seq_len: int
    n_samples: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_samples > self.batch_size * self.accumulation_steps:
            raise LocalProtocolError(
                f"n_samples {self.n_samples} exceeds batch_size {self.batch_size} x "
                f"accumulation_steps {self.accumulation_steps}"
            )


_MODEL_INTS = (
    "n_vocab", "n_ctx", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "n_expert",
    "n_expert_used", "n_ff_shared",
)
_MODEL_FLOATS = ("rope_theta", "norm_eps")


@dataclass(frozen=True)
class ModelConfigMsg(Message):
    """MODEL_CONFIG (coordinator -> worker), ours, 52 bytes: the model to build.

    Ten u32 (the ``ModelConfig`` integers), then f32 rope_theta, norm_eps, aux_loss_coef.
    ``foundry.swarm.model_config`` converts it to and from a ``ModelConfig``.
    """

    TYPE: ClassVar[MsgType] = MsgType.MODEL_CONFIG
    LAYOUT: ClassVar[_Layout] = _Layout(
        *((name, U32) for name in _MODEL_INTS),
        *((name, F32) for name in _MODEL_FLOATS),
        ("aux_loss_coef", F32),
    )
    n_vocab: int
    n_ctx: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_expert: int
    n_expert_used: int
    n_ff_shared: int
    rope_theta: float
    norm_eps: float
    aux_loss_coef: float = 0.0


@dataclass(frozen=True)
class Dataset(Message):
    """DATASET (worker -> coordinator, optional, before REGISTER), ours, 40 bytes:
    u64 n_tokens and the sha256 of the token stream, so a worker with other data is refused
    before it trains on it. Sending it also tells the coordinator the worker speaks our
    extensions."""

    TYPE: ClassVar[MsgType] = MsgType.DATASET
    LAYOUT: ClassVar[_Layout] = _Layout(("n_tokens", U64), ("sha256", _Bytes(32)))
    n_tokens: int
    sha256: bytes


MAX_ARCH = 16  # char[16] architecture of BASE_MODEL ("gemma3", "qwen3moe", ...)


@dataclass(frozen=True)
class BaseModel(Message):
    """BASE_MODEL (ours), 73 bytes: REGISTER's extension for fine-tuning a published model.

    Worker -> coordinator, before REGISTER (after DATASET): the base file the worker loaded
    (``file_bytes``, its ``sha256``, ``architecture``) and ``trainer`` 1 if it can train that
    architecture (PyTorch is there), 0 if not; its LoRA fields are 0. A coordinator that
    fine-tunes another file, or is not fine-tuning, or gets ``trainer`` 0, refuses the
    registration with the reason. Coordinator -> worker, with REGISTER_ACK in place of
    MODEL_CONFIG: the same file, ``trainer`` 1, and what trains: ``lora_rank`` (0: every
    tensor, full fine-tuning), ``lora_alpha``, ``lora_dropout`` and ``lora_targets``, a bit
    per projection (bit i: ``model.lora.TARGETS[i]``: attn_q, attn_k, attn_v, attn_output,
    ffn_gate, ffn_up, ffn_down)."""

    TYPE: ClassVar[MsgType] = MsgType.BASE_MODEL
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("file_bytes", U64), ("sha256", _Bytes(32)), ("architecture", _Str(MAX_ARCH)),
        ("trainer", U8), ("lora_rank", U32), ("lora_alpha", F32), ("lora_dropout", F32),
        ("lora_targets", U32),
    )
    file_bytes: int
    sha256: bytes
    architecture: str
    trainer: int
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: int = 0


@dataclass(frozen=True)
class SwarmStatusRow:
    """One worker in SWARM_STATUS, 93 bytes."""

    LAYOUT: ClassVar[_Layout] = _Layout(
        ("worker_id", _Str(MAX_WORKER_ID)),
        ("profile", _Enum("I", HardwareProfile)),
        ("state", _Enum("B", WorkerState)),
        ("batch_size", U32),
        ("accumulation_steps", U32),
        ("samples_per_sec", F32),
        ("loss", F32),
        ("local_step", U32),
        ("seconds_since_heartbeat", F32),
    )
    worker_id: str
    profile: HardwareProfile
    state: WorkerState
    batch_size: int
    accumulation_steps: int
    samples_per_sec: float
    loss: float
    local_step: int
    seconds_since_heartbeat: float

    def __post_init__(self) -> None:
        self.LAYOUT.normalise(self)


class _HeadAndRows(Message):
    """A fixed header (``HEAD``, ending in ``n_rows u32``) followed by ``n_rows`` fixed rows
    (``ROW``): the payload is exactly ``HEAD.size + ROW.LAYOUT.size * n_rows`` bytes. Not a
    dataclass itself: each message declares its header fields, then ``rows``."""

    HEAD: ClassVar[_Layout]
    ROW: ClassVar[type[Any]]
    rows: tuple[Any, ...]

    def __post_init__(self) -> None:
        self.HEAD.normalise(self, skip=("n_rows",))
        object.__setattr__(self, "rows", tuple(self.rows))
        for row in self.rows:
            if not isinstance(row, self.ROW):
                raise LocalProtocolError(f"rows must hold {self.ROW.__name__}, got {row!r}")

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    def payload_parts(self) -> tuple[bytes | memoryview, ...]:
        head = self.HEAD.pack_obj(self, n_rows=self.n_rows)
        return (head, *(row.LAYOUT.pack_obj(row) for row in self.rows))

    @classmethod
    def check_length(cls, length: int) -> None:
        row = cls.ROW.LAYOUT.size
        if length < cls.HEAD.size or (length - cls.HEAD.size) % row:
            raise FdtcProtocolError(
                f"{cls.TYPE.name} payload must be {cls.HEAD.size} + {row} * n_rows bytes, "
                f"header says {length}"
            )

    @classmethod
    def from_payload(cls, payload: memoryview) -> Self:
        head = cls.HEAD.unpack(payload)
        row_size = cls.ROW.LAYOUT.size
        count = (len(payload) - cls.HEAD.size) // row_size
        n_rows = head.pop("n_rows")
        if n_rows != count:
            raise FdtcProtocolError(f"{cls.TYPE.name} says n_rows {n_rows} but carries {count}")
        rows = tuple(
            cls.ROW(**cls.ROW.LAYOUT.unpack(payload, cls.HEAD.size + i * row_size))
            for i in range(count)
        )
        # Each subclass is a dataclass whose fields are its header's then ``rows``; this base
        # is not one, so the checker sees no such constructor here.
        return cls(**head, rows=rows)  # type: ignore[call-arg]


@dataclass(frozen=True)
class SwarmStatus(_HeadAndRows):
    """SWARM_STATUS (coordinator -> admin), ours: a 37-byte header, then ``n_rows`` rows of
    93 bytes (``SwarmStatusRow``). The payload is exactly 37 + 93 * n_rows bytes."""

    TYPE: ClassVar[MsgType] = MsgType.SWARM_STATUS
    HEAD: ClassVar[_Layout] = _Layout(
        ("global_step", U32),
        ("max_steps", U32),
        ("state", _Enum("B", SwarmState)),
        ("train_loss", F32),
        ("val_loss", F32),
        ("samples_per_sec", F32),
        ("learning_rate", F32),
        ("samples_total", U64),
        ("n_rows", U32),
    )
    ROW: ClassVar[type[SwarmStatusRow]] = SwarmStatusRow
    global_step: int
    max_steps: int
    state: SwarmState
    train_loss: float
    val_loss: float
    samples_per_sec: float
    learning_rate: float
    samples_total: int
    rows: tuple[SwarmStatusRow, ...] = ()


@dataclass(frozen=True)
class ControlAck(Message):
    """CONTROL_ACK (coordinator -> admin), ours, 262 bytes: the answer to START, PAUSE,
    RESUME, CHECKPOINT, SHUTDOWN or EXPORT."""

    TYPE: ClassVar[MsgType] = MsgType.CONTROL_ACK
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("acked_type", _Enum("B", MsgType)),
        ("ok", BOOL),
        ("global_step", U32),
        ("message", _Str(MAX_PATH)),
    )
    acked_type: MsgType
    ok: bool
    global_step: int
    message: str


@dataclass(frozen=True)
class Export(Message):
    """EXPORT (admin -> coordinator), ours, 257 bytes: write the weights as a GGUF file of
    ``file_type`` to ``path`` (empty: the coordinator's default). Answered by CONTROL_ACK with
    the path written."""

    TYPE: ClassVar[MsgType] = MsgType.EXPORT
    LAYOUT: ClassVar[_Layout] = _Layout(("path", _Str(MAX_PATH)),
                                        ("file_type", _Enum("B", FileType)))
    path: str = ""
    file_type: FileType = FileType.F32


@dataclass(frozen=True)
class TrainPlan(Message):
    """TRAIN_PLAN (coordinator -> worker), ours, 40 bytes, after MODEL_CONFIG: how this swarm
    trains. ``sync_every`` 1 is synchronous training (ASSIGN, GRADIENTS, UPDATE); above 1 the
    worker runs inner AdamW steps (LOCAL_ASSIGN) with the schedule below and uploads
    pseudo-gradients. Weights after the first come as UPDATE in ``down_compression``; the
    worker reports WEIGHTS_DIGEST every ``digest_every`` steps (0: never)."""

    TYPE: ClassVar[MsgType] = MsgType.TRAIN_PLAN
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("sync_every", U32),
        ("digest_every", U32),
        ("down_compression", _Enum("I", Compression)),
        ("lr", F32),
        ("warmup_steps", U32),
        ("total_steps", U32),
        ("min_lr_ratio", F32),
        ("weight_decay", F32),
        ("grad_clip", F32),
        ("flags", U32),
    )
    sync_every: int
    digest_every: int
    down_compression: Compression
    lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    flags: int = 0  # TRAIN_PLAN_OVERLAP, QSGD levels in bits 8-15; other bits 0

    @property
    def qsgd_levels(self) -> int:
        """The QSGD levels workers encode uploads with (``--qsgd-levels``); 0: the default."""
        return (self.flags & TRAIN_PLAN_QSGD_LEVELS_MASK) >> 8


# TRAIN_PLAN flag bit 0: LOCAL_ASSIGN may come before the previous round's UPDATE (--overlap);
# the worker then starts from its own trained weights (swarm/worker.py).
TRAIN_PLAN_OVERLAP = 0x1
# TRAIN_PLAN flags bits 8-15: the QSGD levels s (1..127) for uploads; 0 = the codec's default.
TRAIN_PLAN_QSGD_LEVELS_MASK = 0xFF00
# QSGD's most levels s: its codes are at most 8 bits (7 of level, 1 of sign); the codec
# (compression/qsgd.py) and TRAIN_PLAN's flags both hold to it.
MAX_QSGD_LEVELS = 127


def train_plan_flags(*, overlap: bool, qsgd_levels: int) -> int:
    if not 0 <= qsgd_levels <= MAX_QSGD_LEVELS:
        raise LocalProtocolError(f"qsgd_levels {qsgd_levels} does not fit TRAIN_PLAN's flags "
                                 f"(0, the default, or 1..{MAX_QSGD_LEVELS})")
    return (TRAIN_PLAN_OVERLAP if overlap else 0) | qsgd_levels << 8


@dataclass(frozen=True)
class Update(_HeaderAndData):
    """UPDATE (coordinator -> worker), ours: a 24-byte header, then ``num_tensors`` tensors in
    WEIGHTS_META order encoded by ``compression`` (the GRADIENTS data layout). A worker that
    holds the weights of ``base_step`` adds the decoded tensors to them and then holds
    ``global_step``'s, bit for bit what the coordinator expects."""

    TYPE: ClassVar[MsgType] = MsgType.UPDATE
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("global_step", U32),
        ("base_step", U32),
        ("compression", _Enum("I", Compression)),
        ("num_tensors", U32),
        ("uncompressed_size", U64),
    )
    global_step: int
    base_step: int
    compression: Compression
    num_tensors: int
    uncompressed_size: int
    data: bytes | memoryview = field(repr=False)


@dataclass(frozen=True)
class WeightsDigest(Message):
    """WEIGHTS_DIGEST (worker -> coordinator), ours, 36 bytes: the BLAKE2b-256 digest of the
    weights it holds at ``global_step`` (every tensor's little-endian f32 bytes, in
    WEIGHTS_META order). A digest that differs from the coordinator's gets full weights."""

    TYPE: ClassVar[MsgType] = MsgType.WEIGHTS_DIGEST
    LAYOUT: ClassVar[_Layout] = _Layout(("global_step", U32), ("digest", _Bytes(32)))
    global_step: int
    digest: bytes


@dataclass(frozen=True)
class LocalAssign(Message):
    """LOCAL_ASSIGN (coordinator -> worker), ours, 28 bytes: one round of local steps.

    From the weights of ``global_step`` the worker runs ``inner_steps`` AdamW steps, step k on
    global samples ``[sample_offset + k * samples_per_step, ...)`` in micro-batches of
    ``micro_batch``, at the schedule's rate for step ``global_step + k``, then reports its
    pseudo-gradient (start weights minus its weights) as GRADIENTS with
    ``local_step = global_step``."""

    TYPE: ClassVar[MsgType] = MsgType.LOCAL_ASSIGN
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("global_step", U32),
        ("sample_offset", U64),
        ("samples_per_step", U32),
        ("inner_steps", U32),
        ("micro_batch", U32),
        ("seq_len", U32),
    )
    global_step: int
    sample_offset: int
    samples_per_step: int
    inner_steps: int
    micro_batch: int
    seq_len: int


@dataclass(frozen=True)
class SwarmDetailReq(Message):
    """SWARM_DETAIL_REQ (admin -> coordinator), ours, empty: answered by SWARM_STATUS and
    then SWARM_DETAIL, both taken at the same moment (row i of one is row i of the other)."""

    TYPE: ClassVar[MsgType] = MsgType.SWARM_DETAIL_REQ


@dataclass(frozen=True)
class SwarmDetailRow:
    """One worker in SWARM_DETAIL, 20 bytes, in the order of SWARM_STATUS's rows."""

    LAYOUT: ClassVar[_Layout] = _Layout(
        ("inner_steps", U32),
        ("bytes_up", U64),
        ("bytes_down", U64),
    )
    inner_steps: int  # training steps its taken reports held (inner steps with --sync-every)
    bytes_up: int  # gradient bytes received from it
    bytes_down: int  # weight and update bytes sent to it

    def __post_init__(self) -> None:
        self.LAYOUT.normalise(self)


@dataclass(frozen=True)
class SwarmDetail(_HeadAndRows):
    """SWARM_DETAIL (coordinator -> admin), ours: what SWARM_STATUS does not say. A 269-byte
    header, then ``n_rows`` rows of 20 bytes (``SwarmDetailRow``). ``failed``: an internal
    task failed and the coordinator is exiting (status 1), ``note`` saying why; otherwise
    ``note`` is a warning in effect (checkpoints failing) or empty."""

    TYPE: ClassVar[MsgType] = MsgType.SWARM_DETAIL
    HEAD: ClassVar[_Layout] = _Layout(
        ("min_workers", U32),
        ("seconds_since_step", F32),
        ("failed", BOOL),
        ("note", _Str(MAX_PATH)),
        ("n_rows", U32),
    )
    ROW: ClassVar[type[SwarmDetailRow]] = SwarmDetailRow
    min_workers: int
    seconds_since_step: float
    failed: bool = False
    note: str = ""
    rows: tuple[SwarmDetailRow, ...] = ()


# --- fragments


FRAGMENTABLE = frozenset({MsgType.WEIGHTS, MsgType.GRADIENTS, MsgType.UPDATE})


@dataclass(frozen=True)
class Fragment(Message):
    """FRAGMENT (either direction on a worker link whose peers speak the extensions), ours:
    a 17-byte header, then bytes ``[offset, offset + len(data))`` of one WEIGHTS, GRADIENTS
    or UPDATE payload of ``total_length`` bytes. A message's fragments come back to back, in
    order, the first at offset 0; the decoder reassembles them and hands out the message
    itself, so nothing above the decoder sees a FRAGMENT."""

    TYPE: ClassVar[MsgType] = MsgType.FRAGMENT
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("message_type", _Enum("B", MsgType)),
        ("total_length", U64),
        ("offset", U64),
    )
    message_type: MsgType
    total_length: int
    offset: int
    data: bytes | memoryview = field(repr=False)

    def __post_init__(self) -> None:
        self.LAYOUT.normalise(self)
        object.__setattr__(self, "data", _as_buffer("data", self.data))
        if self.message_type not in FRAGMENTABLE:
            names = ", ".join(sorted(t.name for t in FRAGMENTABLE))
            raise LocalProtocolError(
                f"FRAGMENT carries {self.message_type.name}; only {names} are fragmented")
        if not self.data:
            raise LocalProtocolError("FRAGMENT with no data")
        if self.offset + len(self.data) > self.total_length:
            raise LocalProtocolError(
                f"FRAGMENT bytes {self.offset}..{self.offset + len(self.data)} run past the "
                f"message's {self.total_length}")

    def payload_parts(self) -> tuple[bytes | memoryview, ...]:
        return (self.LAYOUT.pack_obj(self), self.data)

    @classmethod
    def check_length(cls, length: int) -> None:
        if length <= cls.LAYOUT.size:
            raise FdtcProtocolError(
                f"FRAGMENT payload must be more than {cls.LAYOUT.size} bytes, header says "
                f"{length}")

    @classmethod
    def from_payload(cls, payload: memoryview) -> Self:
        return cls(**cls.LAYOUT.unpack(payload), data=payload[cls.LAYOUT.size:])


# ---------------------------------------------------------------------------- registry

_CLASSES: tuple[type[Message], ...] = (
    Register, RegisterAck, Deregister, Heartbeat, HeartbeatAck, WeightsReq, Weights,
    WeightsMeta, Gradients, GradientsAck, Start, Sync, Checkpoint, Shutdown, Pause, Resume,
    StatusReq, Status, Assign, ModelConfigMsg, Dataset, SwarmStatus, ControlAck, Export,
    TrainPlan, Update, WeightsDigest, LocalAssign, SwarmDetailReq, SwarmDetail, Fragment,
    BaseModel, Error,
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
                f"fragment_size {fragment_size} is outside 1..{MAX_PAYLOAD - Fragment.LAYOUT.size}")
        if length > max_message:
            raise LocalProtocolError(
                f"{msg.TYPE.name} payload of {length} bytes exceeds this link's largest "
                f"message ({max_message} bytes)")
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
        out += [HEADER.pack(MAGIC, MsgType.FRAGMENT, Fragment.LAYOUT.size + n),
                Fragment.LAYOUT.pack((msg_type, length, offset))]
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
    default) is then the largest message they may build, and ``admit_fragments`` (if set)
    may refuse a message type when its first fragment arrives. The fragments' bytes go into
    one buffer of the announced size (pages committed only as bytes arrive), and the message
    comes out when the last one is in; ``reassembling`` says how many bytes of it are held.
    """

    def __init__(self, max_payload: int = MAX_PAYLOAD, *, max_message: int = 0) -> None:
        if not 0 <= max_payload <= MAX_PAYLOAD:
            raise LocalProtocolError(f"max_payload {max_payload} is outside 0..{MAX_PAYLOAD}")
        super().__init__()
        self._max_payload = max_payload
        self.max_message = max_message
        self.admit_fragments: Callable[[MsgType], None] | None = None
        self._cls: type[Message] = Message
        self._whole = NO_PAYLOAD  # the fragmented message's payload, its first _held bytes in
        self._whole_type = MsgType.WEIGHTS
        self._held = 0

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
                "once registered, may send them)", ErrorCode.UNEXPECTED)
        if cls is not Fragment and len(self._whole):
            raise FdtcProtocolError(
                f"{cls.TYPE.name} in the middle of a fragmented {self._whole_type.name} "
                f"({self._held} of {len(self._whole)} bytes in): a message's fragments come "
                "back to back", ErrorCode.UNEXPECTED)
        cls.check_length(length)
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
                    "message's first fragment has offset 0", ErrorCode.UNEXPECTED)
            if total > self._max_message:
                raise FdtcProtocolError(
                    f"fragmented {kind} of {total} bytes exceeds this link's largest message "
                    f"({self._max_message} bytes)",
                    ErrorCode.BUSY if total <= MAX_MESSAGE else ErrorCode.BAD_FRAME)
            MESSAGE_TYPES[f.message_type].check_length(total)
            if self.admit_fragments is not None:
                self.admit_fragments(f.message_type)
            self._whole, self._whole_type, self._held = payload_buffer(total), f.message_type, 0
        elif (f.message_type, total, f.offset) != (self._whole_type, len(self._whole),
                                                   self._held):
            raise FdtcProtocolError(
                f"FRAGMENT of {kind} ({total} bytes) at offset {f.offset}; expected the "
                f"{self._whole_type.name} of {len(self._whole)} bytes begun, at offset "
                f"{self._held}", ErrorCode.UNEXPECTED)
        n = len(f.data)
        self._whole[self._held : self._held + n] = f.data
        self._held += n
        if self._held < total:
            return None
        whole, self._whole, self._held = self._whole.toreadonly(), NO_PAYLOAD, 0
        return self._decoded(MESSAGE_TYPES[self._whole_type], whole)

    def unfinished(self) -> str | None:
        if (frame := super().unfinished()) is not None:
            return frame
        if len(self._whole):
            return (f"a fragmented {self._whole_type.name} ({self._held} of "
                    f"{len(self._whole)} bytes received)")
        return None

    def _eof_error(self, message: str) -> FdtcProtocolError:
        return FdtcProtocolError(message)


# ---------------------------------------------------------------------------- weights


def weights_messages(
    tensors: Mapping[str, npt.ArrayLike], global_step: int, learning_rate: float
) -> tuple[WeightsMeta, Weights]:
    """WEIGHTS_META + WEIGHTS for named tensors, sent as f32 in the mapping's order."""
    arrays = {name: np.ascontiguousarray(t, dtype="<f4") for name, t in tensors.items()}
    meta = WeightsMeta(
        global_step=global_step,
        learning_rate=learning_rate,
        tensors=tuple(TensorMeta(name, a.shape, DType.F32) for name, a in arrays.items()),
    )
    return meta, Weights(b"".join(a.tobytes() for a in arrays.values()))


def weights_tensors(meta: WeightsMeta, weights: Weights) -> dict[str, npt.NDArray[Any]]:
    """Split WEIGHTS by its WEIGHTS_META into read-only arrays (views, no copy) of the
    announced shapes and dtypes. A size mismatch is the peer's error."""
    if len(weights.data) != meta.nbytes:
        raise FdtcProtocolError(
            f"WEIGHTS holds {len(weights.data)} bytes, WEIGHTS_META announced {meta.nbytes}",
            ErrorCode.MODEL_MISMATCH,
        )
    out: dict[str, npt.NDArray[Any]] = {}
    offset = 0
    for t in meta.tensors:
        array = np.frombuffer(weights.data, dtype=t.dtype.numpy, count=t.numel, offset=offset)
        out[t.name] = array.reshape(t.shape)
        offset += t.nbytes
    return out
