"""The fuzz frames of ``fuzz.py``: a valid frame of every FDTC type with random field values,
and the mutations each frame may get (``MUTATIONS``: unchanged, bit flips, bytes inserted or
deleted, the length field changed, the type changed, a wrong magic, the payload replaced by
noise, truncated, an oversized declared length, or plain random bytes), per protocol framing."""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass

from foundry.model.spec.config import ModelConfig
from foundry.swarm.model_config import model_config_msg
from foundry.wire import fdtc, tp
from foundry.wire import frontend as fw

# -- mutations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Framing:
    """Where a protocol keeps its magic, type and length, for the mutations."""

    header: int
    magic: bytes
    type_at: int
    length_at: int
    length_fmt: str
    max_length: int
    types: tuple[int, ...]


FDTC = Framing(
    fdtc.HEADER_SIZE,
    fdtc.MAGIC.to_bytes(4, "little"),
    4,
    5,
    "<I",
    fdtc.MAX_PAYLOAD,
    tuple(int(t) for t in fdtc.MsgType),
)
FRONTEND = Framing(
    fw.HEADER_SIZE,
    fw.MAGIC.to_bytes(4, "little"),
    4,
    9,
    "<I",
    fw.MAX_PAYLOAD,
    tuple(int(t) for t in fw.FrameType),
)
TP_FRAME = Framing(
    tp.FRAME_HEADER_SIZE,
    tp.TP_FRAME_MAGIC.to_bytes(4, "little"),
    4,
    24,
    "<I",
    tp.TP_MAX_PAYLOAD,
    tuple(int(t) for t in tp.FrameType),
)
# The hello has no type or length: its role byte and hello_size field stand in for them.
TP_HELLO = Framing(
    tp.HELLO_SIZE, tp.TP_HELLO_MAGIC.to_bytes(4, "little"), 8, 6, "<H", 0xFFFF, (0, 1)
)
MAGICS = (fdtc.MAGIC, fw.MAGIC, tp.TP_FRAME_MAGIC, tp.TP_HELLO_MAGIC, tp.TP_SLAB_MAGIC)

# kind -> weight. "valid" sends the codec's frame unchanged.
MUTATIONS = {
    "valid": 12,
    "bitflip": 12,
    "header-bitflip": 8,
    "insert": 7,
    "delete": 7,
    "length": 11,
    "type": 10,
    "magic": 6,
    "payload-noise": 6,
    "truncate": 8,
    "oversize": 5,
    "random": 5,
    "random-header": 3,
}
# The share of frames left valid when more frames follow them on their connection.
LEAD_VALID = 0.6


def mutate(raw: bytes, f: Framing, rng: random.Random, lead: bool = False) -> tuple[str, bytes]:
    """One mutation of ``raw``. A ``lead`` frame (one that more frames will follow on its
    connection) is mostly left valid, so that the connection goes on."""
    if lead and rng.random() < LEAD_VALID:
        return "valid", raw
    kind = rng.choices(list(MUTATIONS), list(MUTATIONS.values()))[0]
    b = bytearray(raw)
    if kind == "bitflip":
        for _ in range(rng.randint(1, 4)):
            bit = rng.randrange(8 * len(b))
            b[bit // 8] ^= 1 << (bit % 8)
    elif kind == "header-bitflip":
        bit = rng.randrange(8 * min(f.header, len(b)))
        b[bit // 8] ^= 1 << (bit % 8)
    elif kind == "insert":
        at = rng.randrange(len(b) + 1)
        b[at:at] = rng.randbytes(rng.randint(1, 4))
    elif kind == "delete":
        at = rng.randrange(len(b))
        del b[at : at + rng.randint(1, 4)]
    elif kind == "length":
        size = struct.calcsize(f.length_fmt)
        (cur,) = struct.unpack_from(f.length_fmt, b, f.length_at)
        top = (1 << (8 * size)) - 1
        new = rng.choice(
            [
                cur + rng.randint(-8, 8),
                0,
                f.max_length,
                f.max_length + 1,
                rng.randrange(top + 1),
                top,
            ]
        )
        struct.pack_into(f.length_fmt, b, f.length_at, new & top)
    elif kind == "type":
        b[f.type_at] = rng.choice(f.types) if rng.random() < 0.6 else rng.randrange(256)
    elif kind == "magic":
        b[0:4] = rng.choice(
            [*(m.to_bytes(4, "little") for m in MAGICS), rng.randbytes(4), bytes(4), f.magic[::-1]]
        )
    elif kind == "payload-noise":
        b[f.header :] = rng.randbytes(max(0, len(b) - f.header))
    elif kind == "truncate":
        b = b[: rng.randrange(1, len(b))] if len(b) > 1 else bytearray()
    elif kind == "oversize":
        size = struct.calcsize(f.length_fmt)
        top = (1 << (8 * size)) - 1
        struct.pack_into(
            f.length_fmt, b, f.length_at, min(top, f.max_length + 1 + rng.randrange(1 << 20))
        )
        b = b[: f.header] + rng.randbytes(rng.randint(0, 16))
    elif kind == "random":
        b = bytearray(rng.randbytes(rng.randint(1, 300)))
    elif kind == "random-header":
        b = bytearray(f.magic + rng.randbytes(f.header - 4 + rng.randint(0, 64)))
    return kind, bytes(b)


# -- valid frames of every type, with random field values --------------------------------------


def random_word(rng: random.Random) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789-_ é€"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))


def _f32(rng: random.Random) -> float:
    return rng.choice([0.0, 1.5, -2.25, float("nan"), float("inf"), rng.uniform(-1e6, 1e6)])


class FdtcFrames:
    """A random valid message of each FDTC type."""

    def __init__(self, cfg: ModelConfig, n_tokens: int, sha256: bytes) -> None:
        self.cfg = cfg
        self.n_tensors = len(cfg.param_shapes())
        self.uncompressed_size = 4 * sum(math.prod(s) for s in cfg.param_shapes().values())
        self.dataset = fdtc.Dataset(n_tokens=n_tokens, sha256=sha256)

    def worker_id(self, rng: random.Random) -> str:
        return f"fz-{rng.randrange(1 << 20):x}"

    def make(self, name: str, rng: random.Random) -> fdtc.Message:
        r = rng
        step = r.randrange(1 << 32)
        prof = r.choice(list(fdtc.HardwareProfile))
        comp = r.choice(list(fdtc.Compression))
        row = fdtc.SwarmStatusRow(
            worker_id=self.worker_id(r),
            profile=prof,
            state=r.choice(list(fdtc.WorkerState)),
            batch_size=r.randrange(64),
            accumulation_steps=r.randrange(8),
            samples_per_sec=_f32(r),
            loss=_f32(r),
            local_step=step,
            seconds_since_heartbeat=_f32(r),
        )
        build: dict[str, Callable[[], fdtc.Message]] = {
            "REGISTER": lambda: fdtc.Register(
                self.worker_id(r),
                fdtc.PROTOCOL_VERSION,
                prof,
                r.randrange(1, 64),
                r.randrange(1 << 40),
                r.randrange(64),
            ),
            "REGISTER_ACK": lambda: fdtc.RegisterAck(
                accepted=r.random() < 0.5,
                assigned_shard=r.randrange(8),
                total_shards=8,
                batch_size=r.randrange(64),
                accumulation_steps=r.randrange(8),
                compression=comp,
                topk_ratio=r.random(),
                global_step=step,
            ),
            "DEREGISTER": fdtc.Deregister,
            "HEARTBEAT": lambda: fdtc.Heartbeat(self.worker_id(r), step, _f32(r), _f32(r)),
            "HEARTBEAT_ACK": lambda: fdtc.HeartbeatAck(step),
            "WEIGHTS_REQ": fdtc.WeightsReq,
            "WEIGHTS": lambda: fdtc.Weights(r.randbytes(r.randrange(0, 64, 4))),
            "WEIGHTS_META": lambda: fdtc.WeightsMeta(
                global_step=step,
                learning_rate=r.random(),
                tensors=tuple(
                    fdtc.TensorMeta(
                        f"blk.{i}.attn_q.weight", (r.randrange(1, 9), r.randrange(1, 9))
                    )
                    for i in range(r.randrange(3))
                ),
            ),
            # A step no round will have for a long while: a fuzz gradient is acknowledged as
            # stale and never joins a round of the real worker.
            "GRADIENTS": lambda: fdtc.Gradients(
                self.worker_id(r),
                (1 << 32) - 1 - r.randrange(1 << 20),
                r.choice([self.n_tensors, r.randrange(64)]),
                comp,
                r.choice([self.uncompressed_size, r.randrange(1 << 20)]),
                r.randbytes(r.randrange(0, 96)),
            ),
            "GRADIENTS_ACK": lambda: fdtc.GradientsAck(step, r.random() < 0.5),
            "START": fdtc.Start,
            "SYNC": fdtc.Sync,
            "CHECKPOINT": fdtc.Checkpoint,
            "SHUTDOWN": fdtc.Shutdown,
            "PAUSE": fdtc.Pause,
            "RESUME": fdtc.Resume,
            "STATUS_REQ": fdtc.StatusReq,
            "STATUS": lambda: fdtc.Status(
                self.worker_id(r),
                step,
                r.randrange(1 << 32),
                _f32(r),
                _f32(r),
                _f32(r),
                r.randrange(1 << 20),
                r.random() < 0.5,
            ),
            "ASSIGN": lambda: fdtc.Assign(
                global_step=step,
                sample_offset=r.randrange(1 << 32),
                batch_size=8,
                accumulation_steps=8,
                assigned_shard=0,
                total_shards=1,
                seq_len=64,
                n_samples=r.randrange(1, 64),
            ),
            "MODEL_CONFIG": lambda: model_config_msg(self.cfg, r.random()),
            "DATASET": lambda: (
                self.dataset
                if r.random() < 0.5
                else fdtc.Dataset(n_tokens=r.randrange(1 << 32), sha256=r.randbytes(32))
            ),
            "SWARM_STATUS": lambda: fdtc.SwarmStatus(
                global_step=step,
                max_steps=step,
                state=r.choice(list(fdtc.SwarmState)),
                train_loss=_f32(r),
                val_loss=_f32(r),
                samples_per_sec=_f32(r),
                learning_rate=r.random(),
                samples_total=r.randrange(1 << 32),
                rows=(row,) * r.randrange(3),
            ),
            "CONTROL_ACK": lambda: fdtc.ControlAck(
                r.choice(list(fdtc.MsgType)), r.random() < 0.5, step, random_word(r)
            ),
            "EXPORT": lambda: fdtc.Export(random_word(r)),
            "TRAIN_PLAN": lambda: fdtc.TrainPlan(
                sync_every=r.randrange(1, 64),
                digest_every=r.randrange(16),
                down_compression=comp,
                lr=_f32(r),
                warmup_steps=r.randrange(100),
                total_steps=r.randrange(1 << 20),
                min_lr_ratio=_f32(r),
                weight_decay=_f32(r),
                grad_clip=_f32(r),
            ),
            "UPDATE": lambda: fdtc.Update(
                global_step=step,
                base_step=r.randrange(1 << 32),
                compression=comp,
                num_tensors=r.choice([self.n_tensors, r.randrange(64)]),
                uncompressed_size=r.randrange(1 << 40),
                data=r.randbytes(r.randrange(0, 96)),
            ),
            "WEIGHTS_DIGEST": lambda: fdtc.WeightsDigest(step, r.randbytes(32)),
            "LOCAL_ASSIGN": lambda: fdtc.LocalAssign(
                global_step=step,
                sample_offset=r.randrange(1 << 32),
                samples_per_step=r.randrange(1, 64),
                inner_steps=r.randrange(1, 64),
                micro_batch=8,
                seq_len=64,
            ),
            "SWARM_DETAIL_REQ": fdtc.SwarmDetailReq,
            "SWARM_DETAIL": lambda: fdtc.SwarmDetail(
                min_workers=r.randrange(8),
                seconds_since_step=_f32(r),
                failed=r.random() < 0.5,
                note=random_word(r),
                rows=(fdtc.SwarmDetailRow(step, r.randrange(1 << 40), r.randrange(1 << 40)),)
                * r.randrange(3),
            ),
            # Refused at the header on every link that did not send DATASET (only those get
            # FRAGMENT frames here: WorkerPortTarget.allowed_frame).
            "FRAGMENT": lambda: fdtc.Fragment(
                r.choice([fdtc.MsgType.WEIGHTS, fdtc.MsgType.UPDATE]),
                total_length=r.randrange(24, 1 << 40),
                offset=0,
                data=r.randbytes(r.randrange(1, 64)),
            ),
            "BASE_MODEL": lambda: fdtc.BaseModel(
                file_bytes=r.randrange(1 << 40),
                sha256=r.randbytes(32),
                architecture=r.choice(["llama", "qwen3", "gemma3", "x"]),
                trainer=r.randrange(2),
                lora_rank=r.choice([0, 8]),
                lora_alpha=_f32(r),
                lora_dropout=r.random(),
                lora_targets=r.randrange(128),
            ),
            "ERROR": lambda: fdtc.Error(r.randrange(1, 12), random_word(r)),
        }
        return build[name]()
