"""The tensor-parallel protocol (seed: ``ds4_tp.h``, two ranks; N ranks by our extension) as a
sans-IO codec.

Three byte formats live here, none of them touching a socket:

- the **hello** (184 bytes), the first thing each rank sends on the control socket: protocol
  version, role, the execution mode, the engine :class:`Identity` and the shared-memory offer;
  in a world that is not the plain pair (N > 2 ranks, or unequal shares) 40 more bytes, the
  :class:`WorldInfo` (world size, rank, gate port, shares), flagged ``HELLO_WORLD``; a worker
  answering a world whose shares are still to be chosen 8 more, its :class:`RankWeight`
  (``--share`` and measured speed), flagged ``HELLO_WEIGHT``;
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
size is asserted in ``tests/test_tp_wire_frames.py``. ``docs/protocol.md`` (tensor-parallel
part) documents every byte.

The package, by job: ``hello`` (constants, identity, hello), ``control`` (the control
frames), ``codec`` (encoder, frame bounds, decoder), ``gates`` (gate header, slab). Importers
use the names here.
"""

from foundry.model.shard.table import Gate
from foundry.wire.errors import IdentityMismatch, TpProtocolError, VersionMismatch
from foundry.wire.tp.codec import TpDecoder, encode, encode_parts, logits_rows, max_payload_for
from foundry.wire.tp.control import (
    BATCH_ITEM,
    FRAME_CLASSES,
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    UNSUPPORTED_FRAME_TYPES,
    WORLD_ENTRY,
    BatchItem,
    CommandAck,
    ControlFrame,
    Eval,
    EvalBatch,
    Frame,
    FrameType,
    Hash,
    Invalidate,
    Logits,
    MixedBatch,
    Rewind,
    SessionCreate,
    SessionDestroy,
    Stop,
    Sync,
    SyncCheckpoint,
    Verify,
    VerifyCommit,
    VerifyCommitMode,
    World,
    WorldPeer,
)
from foundry.wire.tp.gates import (
    GATE_HEADER,
    GATE_HEADER_SIZE,
    SLAB_ABSENT,
    SLAB_ALIGN,
    SLAB_ATTACHED,
    SLAB_CLOSED,
    SLAB_FLAG_CHECKSUM,
    SLAB_HEADER,
    SLAB_ROUND_BYTES,
    SLAB_STATE_OFFSET,
    SLOT_CRC_END,
    SLOT_CRC_START,
    SLOT_HEADER,
    GateHeader,
    SlabLayout,
    slab_bytes,
)
from foundry.wire.tp.hello import (
    ARCH_BYTES,
    ARCH_PATTERN,
    DS4_TP_BATCH_MAX_ROWS,
    DS4_TP_GATE_MASK_WORDS,
    DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT,
    DS4_TP_MODE_V41_DSPARK,
    DS4_TP_MODE_V41_SHARED_BALANCE,
    DS4_TP_MODE_V41_SHARED_OWNER,
    DS4_TP_VERIFY_DSPARK_SEED,
    DS4_TP_VERIFY_DSPARK_TP,
    DS4_TP_VERIFY_FLAGS,
    DS4_TP_VERIFY_HEAD_SPLIT,
    EXECUTION_MODE_BITS,
    HELLO,
    HELLO_FLAGS,
    HELLO_PREFIX,
    HELLO_SHM_OFFERED,
    HELLO_SIZE,
    HELLO_WEIGHT,
    HELLO_WEIGHT_SIZE,
    HELLO_WORLD,
    HELLO_WORLD_SIZE,
    HOST_ID_BYTES,
    IDENTITY,
    SHM_NAME_BYTES,
    SHM_NAME_PATTERN,
    TP_FRAME_MAGIC,
    TP_HELLO_MAGIC,
    TP_MAX_BATCH_ITEMS,
    TP_MAX_PAYLOAD,
    TP_MAX_SHARE,
    TP_MAX_WORLD,
    TP_PROTOCOL_VERSION,
    TP_SLAB_MAGIC,
    WEIGHT_EXT,
    WORLD_EXT,
    GateTransport,
    Hello,
    Identity,
    RankWeight,
    Readable,
    Role,
    SharesFrom,
    WorldInfo,
    WorldMismatch,
    check_execution_mode,
    check_hello,
    check_identity,
    check_world,
    expert_split_name,
    negotiate_gate_transport,
)

__all__ = [
    "ARCH_BYTES",
    "ARCH_PATTERN",
    "BATCH_ITEM",
    "DS4_TP_BATCH_MAX_ROWS",
    "DS4_TP_GATE_MASK_WORDS",
    "DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT",
    "DS4_TP_MODE_V41_DSPARK",
    "DS4_TP_MODE_V41_SHARED_BALANCE",
    "DS4_TP_MODE_V41_SHARED_OWNER",
    "DS4_TP_VERIFY_DSPARK_SEED",
    "DS4_TP_VERIFY_DSPARK_TP",
    "DS4_TP_VERIFY_FLAGS",
    "DS4_TP_VERIFY_HEAD_SPLIT",
    "EXECUTION_MODE_BITS",
    "FRAME_CLASSES",
    "FRAME_HEADER",
    "FRAME_HEADER_SIZE",
    "GATE_HEADER",
    "GATE_HEADER_SIZE",
    "HELLO",
    "HELLO_FLAGS",
    "HELLO_PREFIX",
    "HELLO_SHM_OFFERED",
    "HELLO_SIZE",
    "HELLO_WEIGHT",
    "HELLO_WEIGHT_SIZE",
    "HELLO_WORLD",
    "HELLO_WORLD_SIZE",
    "HOST_ID_BYTES",
    "IDENTITY",
    "SHM_NAME_BYTES",
    "SHM_NAME_PATTERN",
    "SLAB_ABSENT",
    "SLAB_ALIGN",
    "SLAB_ATTACHED",
    "SLAB_CLOSED",
    "SLAB_FLAG_CHECKSUM",
    "SLAB_HEADER",
    "SLAB_ROUND_BYTES",
    "SLAB_STATE_OFFSET",
    "SLOT_CRC_END",
    "SLOT_CRC_START",
    "SLOT_HEADER",
    "TP_FRAME_MAGIC",
    "TP_HELLO_MAGIC",
    "TP_MAX_BATCH_ITEMS",
    "TP_MAX_PAYLOAD",
    "TP_MAX_SHARE",
    "TP_MAX_WORLD",
    "TP_PROTOCOL_VERSION",
    "TP_SLAB_MAGIC",
    "UNSUPPORTED_FRAME_TYPES",
    "WEIGHT_EXT",
    "WORLD_ENTRY",
    "WORLD_EXT",
    "BatchItem",
    "CommandAck",
    "ControlFrame",
    "Eval",
    "EvalBatch",
    "Frame",
    "FrameType",
    "Gate",
    "GateHeader",
    "GateTransport",
    "Hash",
    "Hello",
    "Identity",
    "IdentityMismatch",
    "Invalidate",
    "Logits",
    "MixedBatch",
    "RankWeight",
    "Readable",
    "Rewind",
    "Role",
    "SessionCreate",
    "SessionDestroy",
    "SharesFrom",
    "SlabLayout",
    "Stop",
    "Sync",
    "SyncCheckpoint",
    "TpDecoder",
    "TpProtocolError",
    "Verify",
    "VerifyCommit",
    "VerifyCommitMode",
    "VersionMismatch",
    "World",
    "WorldInfo",
    "WorldMismatch",
    "WorldPeer",
    "check_execution_mode",
    "check_hello",
    "check_identity",
    "check_world",
    "encode",
    "encode_parts",
    "expert_split_name",
    "logits_rows",
    "max_payload_for",
    "negotiate_gate_transport",
    "slab_bytes",
]
