"""FDTC's project extensions (0x60..0x6F): ASSIGN, MODEL_CONFIG, DATASET, SWARM_STATUS,
CONTROL_ACK, EXPORT, TRAIN_PLAN, UPDATE, WEIGHTS_DIGEST, LOCAL_ASSIGN, SWARM_DETAIL, and
FRAGMENT (a message over one frame cut into slices)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc.enums import (
    MAX_PATH,
    MAX_WORKER_ID,
    Compression,
    FileType,
    HardwareProfile,
    MsgType,
    SwarmState,
    WorkerState,
)
from foundry.wire.fdtc.messages import Message, _as_buffer, _HeaderAndData, _Layout
from foundry.wire.layout import BOOL, F32, U8, U32, U64
from foundry.wire.layout import Bytes as _Bytes
from foundry.wire.layout import Enum as _Enum
from foundry.wire.layout import Str as _Str

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
    "n_vocab",
    "n_ctx",
    "n_embd",
    "n_layer",
    "n_head",
    "n_head_kv",
    "n_ff",
    "n_expert",
    "n_expert_used",
    "n_ff_shared",
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
    per projection (bit i: ``model.formats.lora.TARGETS[i]``: attn_q, attn_k, attn_v,
    attn_output, ffn_gate, ffn_up, ffn_down)."""

    TYPE: ClassVar[MsgType] = MsgType.BASE_MODEL
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("file_bytes", U64),
        ("sha256", _Bytes(32)),
        ("architecture", _Str(MAX_ARCH)),
        ("trainer", U8),
        ("lora_rank", U32),
        ("lora_alpha", F32),
        ("lora_dropout", F32),
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
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("path", _Str(MAX_PATH)), ("file_type", _Enum("B", FileType))
    )
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
# the worker then starts from its own trained weights (swarm/worker_core.py, round_start).
TRAIN_PLAN_OVERLAP = 0x1
# TRAIN_PLAN flags bits 8-15: the QSGD levels s (1..127) for uploads; 0 = the codec's default.
TRAIN_PLAN_QSGD_LEVELS_MASK = 0xFF00
# QSGD's most levels s: its codes are at most 8 bits (7 of level, 1 of sign); the codec
# (compression/qsgd.py) and TRAIN_PLAN's flags both hold to it.
MAX_QSGD_LEVELS = 127


def train_plan_flags(*, overlap: bool, qsgd_levels: int) -> int:
    if not 0 <= qsgd_levels <= MAX_QSGD_LEVELS:
        raise LocalProtocolError(
            f"qsgd_levels {qsgd_levels} does not fit TRAIN_PLAN's flags "
            f"(0, the default, or 1..{MAX_QSGD_LEVELS})"
        )
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
    """SWARM_DETAIL (coordinator -> admin), ours: what SWARM_STATUS does not say. A 277-byte
    header, then ``n_rows`` rows of 20 bytes (``SwarmDetailRow``). ``failed``: an internal
    task failed and the coordinator is exiting (status 1), ``note`` saying why; otherwise
    ``note`` is a warning in effect (checkpoints failing) or empty. ``first_val_loss`` is
    the first held-out loss this coordinator measured, at ``first_val_step`` (a fine-tuning
    run's step 0: the base's), NaN until one is; an admin that polls cannot miss it, however
    fast the run."""

    TYPE: ClassVar[MsgType] = MsgType.SWARM_DETAIL
    HEAD: ClassVar[_Layout] = _Layout(
        ("min_workers", U32),
        ("seconds_since_step", F32),
        ("failed", BOOL),
        ("note", _Str(MAX_PATH)),
        ("first_val_loss", F32),
        ("first_val_step", U32),
        ("n_rows", U32),
    )
    ROW: ClassVar[type[SwarmDetailRow]] = SwarmDetailRow
    min_workers: int
    seconds_since_step: float
    failed: bool = False
    note: str = ""
    first_val_loss: float = float("nan")
    first_val_step: int = 0
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
                f"FRAGMENT carries {self.message_type.name}; only {names} are fragmented"
            )
        if not self.data:
            raise LocalProtocolError("FRAGMENT with no data")
        if self.offset + len(self.data) > self.total_length:
            raise LocalProtocolError(
                f"FRAGMENT bytes {self.offset}..{self.offset + len(self.data)} run past the "
                f"message's {self.total_length}"
            )

    def payload_parts(self) -> tuple[bytes | memoryview, ...]:
        return (self.LAYOUT.pack_obj(self), self.data)

    @classmethod
    def check_length(cls, length: int) -> None:
        if length <= cls.LAYOUT.size:
            raise FdtcProtocolError(
                f"FRAGMENT payload must be more than {cls.LAYOUT.size} bytes, header says {length}"
            )

    @classmethod
    def from_payload(cls, payload: memoryview) -> Self:
        return cls(**cls.LAYOUT.unpack(payload), data=payload[cls.LAYOUT.size :])
