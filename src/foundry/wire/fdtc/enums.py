"""FDTC's numbers: the frame constants and limits, and the enums of the protocol (message
types, hardware profiles, compression, file and data types, error codes, swarm and worker
states), with their C names (``sw_msg_type_name``, ``sw_profile_name``)."""

from __future__ import annotations

import struct
from enum import IntEnum

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
    (``model.formats.gguf_model.FILE_DTYPES``), in that order."""

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


def _profile(profile: int) -> HardwareProfile:
    try:
        return HardwareProfile(profile)
    except ValueError:
        return HardwareProfile.UNKNOWN


def profile_name(profile: int) -> str:
    """sw_profile_name: the enum name (``"RPI4_4G"``); ``"UNKNOWN"`` for unknown codes."""
    return _profile(profile).name
