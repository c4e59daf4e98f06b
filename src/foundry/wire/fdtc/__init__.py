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

The package, by job: ``enums`` (constants, enums), ``messages`` (the seed header's messages),
``tensors`` (weights), ``extensions`` (0x60..0x6F and FRAGMENT), ``codec`` (registry, encoder,
decoder). Importers use the names here.
"""

from foundry.wire.errors import FdtcProtocolError
from foundry.wire.fdtc.codec import MESSAGE_TYPES, FdtcDecoder, decode, encode, encode_parts
from foundry.wire.fdtc.enums import (
    FRAGMENT_SIZE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_DIMS,
    MAX_MESSAGE,
    MAX_PATH,
    MAX_PAYLOAD,
    MAX_WORKER_ID,
    PROTOCOL_VERSION,
    Compression,
    DType,
    ErrorCode,
    FileType,
    HardwareProfile,
    MsgType,
    SwarmState,
    WorkerState,
    msg_type_name,
    profile_name,
)
from foundry.wire.fdtc.extensions import (
    FRAGMENTABLE,
    MAX_QSGD_LEVELS,
    TRAIN_PLAN_OVERLAP,
    TRAIN_PLAN_QSGD_LEVELS_MASK,
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
    SwarmDetailRow,
    SwarmStatus,
    SwarmStatusRow,
    TrainPlan,
    Update,
    WeightsDigest,
    train_plan_flags,
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
from foundry.wire.fdtc.tensors import (
    TensorMeta,
    Weights,
    WeightsMeta,
    WeightsReq,
    weights_messages,
    weights_tensors,
)

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
    "MAX_QSGD_LEVELS",
    "MAX_WORKER_ID",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "TRAIN_PLAN_OVERLAP",
    "TRAIN_PLAN_QSGD_LEVELS_MASK",
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
    "profile_name",
    "train_plan_flags",
    "weights_messages",
    "weights_tensors",
]
