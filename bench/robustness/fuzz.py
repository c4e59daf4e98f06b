"""Fuzzing the live services: bad frames on every native port, a good peer served throughout.

Starts a real coordinator with one real worker, and a real TP pair (leader + worker) on
127.0.0.1, then sends each native port mutated, truncated, oversized and random frames over
many short connections, several connections at once:

- the coordinator's worker port (FDTC; its real peer is ``foundry worker``): every FDTC type,
  after no prefix, a REGISTER, or DATASET + REGISTER;
- the coordinator's admin port (FDTC; the gateway, ``foundry ctl``): every FDTC type;
- the TP leader's worker port (TP hello, gate-link opener, control frames; ``foundry
  tp-worker``): hellos with the right identity, another one, or the leader's role, gate-link
  openers, and every control frame type;
- the TP leader's frontend port (the gateway): every frontend frame type.

Each fuzz frame is a valid frame of a random type built by the codec (``foundry.wire``) with
random field values, then mutated (kinds in ``MUTATIONS``: unchanged, bit flips, bytes
inserted or deleted, the length field changed, the type changed, a wrong magic, the payload
replaced by noise, truncated, an oversized declared length, or plain random bytes). Where the
protocol keeps a connection open after a frame, several frames share it; the harness decodes
what it sends with the service's own sans-IO decoder and stops adding frames at the first one
that ends the connection, so every frame it counts reached the service's parser.

Every connection must end one of the ways the protocol allows, within ``--hang-after`` seconds:

- **bad bytes or a refused request**: the service closes the connection by itself (an ERROR
  first where the protocol has one);
- **a stream that ends inside a declared frame** (truncated, or a length past the bytes sent):
  the service may rightly wait for the rest, so the harness ends its side
  (``shutdown(SHUT_WR)``) and the service must close (counted as ``awaiting``). One more lane
  per port sends only such streams and leaves them open: the service must cut each one off by
  its frame deadline (started with ``--frame-deadline 2`` where the service takes it; the TP
  leader's worker port has its bring-up limit of 10 s), counted as ``held`` and
  ``cut off``;
- **only valid frames**: a probe closes the stream (a STATUS_REQ on the admin and frontend links,
  a HEARTBEAT on a registered worker link) and must be answered, then the harness ends its side
  and the service must close.

Anything else is a **hang**. A **crash** is a service process that exited. A connection the
service closed unread (its connection limit, or the leader's four bring-up slots) is counted
as ``refused unread`` and its frames do not count. After every batch
the well-behaved peers must still be served: the real worker keeps training (the global step
advances, read on the admin link), and a greedy generation through the frontend link returns
the text a single process computes. Service logs are scanned for exceptions nobody handled.

    .venv/bin/python bench/robustness/fuzz.py --frames-per-port 10000 --seed 1 --seconds 60

Prints one line per port and a summary; exit status 0 when every port reached its frame count
with no crash, no hang, no unhandled exception and every health check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import math
import os
import random
import re
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: live, harness

import harness
import live

from foundry.model.formats.gguf_io import load_gguf
from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import load_corpus
from foundry.swarm.model_config import model_config_msg
from foundry.tp.handshake import identity_for
from foundry.wire import fdtc, tp
from foundry.wire import frontend as fw

GOOD_WORKER = "good-worker"
PROMPT = "Fuzzing never stops the pair."
PROMPT_TOKENS = 12
# Fuzz frames in one connection at most (pipelined where the protocol keeps it open).
MAX_FRAMES_PER_CONNECTION = 8
# Request id of the frontend probe; fuzz frames never use it.
PROBE_ID = 0xFFFF_FFFF
# A record on the TP worker port that is complete and valid is answered and closed by the
# leader at once; if it is still open after this long (a hello that claimed a free pair waits
# for its data plane), the harness ends its side.
OPEN_WINDOW_S = 1.0
# Concurrent connections per port. The leader takes at most 4 bring-ups at once and closes
# more unread, so its worker port gets fewer.
LANES = {"coordinator-workers": 8, "coordinator-admin": 8, "tp-leader-workers": 3,
         "tp-leader-frontend": 8}
# The frame deadline the services are started with, where they take --frame-deadline: a
# stream left open inside a frame must be cut off within it (plus --hang-after).
FRAME_DEADLINE_S = 2.0
# The leader's bring-up on its worker port: 5 s without a byte, 10 s in all (docs/tp.md).
TP_BRINGUP_DEADLINE_S = 10.0
# Log lines of a service closing a connection unread: the leader's bring-up slots are full,
# or a link is at its connection limit.
REFUSED_UNREAD = re.compile(r"too many connections in their handshake"
                            r"|connections are in their bring-up already"
                            r"|refused \S+: the link has its limit of")
# A well-behaved peer must see progress within this after each batch.
HEALTH_TIMEOUT_S = 60.0


class Ending(enum.Enum):
    CLOSE = "close"  # bad bytes or a refusal: the service must close by itself
    PARTIAL = "partial"  # ends inside a declared frame: we end our side, the service closes
    OPEN = "open"  # valid frames: the probe is answered, we end our side, the service closes


@dataclass
class Plan:
    """One connection's bytes and what the service owes in return."""

    data: bytes
    fuzz: int  # fuzz frames (the count that matters)
    valid: int  # prefix and probe frames
    ending: Ending
    answers: int  # OPEN: answers to wait for before ending our side (0: OPEN_WINDOW_S)
    kinds: list[str]


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


FDTC = Framing(fdtc.HEADER_SIZE, fdtc.MAGIC.to_bytes(4, "little"), 4, 5, "<I",
               fdtc.MAX_PAYLOAD, tuple(int(t) for t in fdtc.MsgType))
FRONTEND = Framing(fw.HEADER_SIZE, fw.MAGIC.to_bytes(4, "little"), 4, 9, "<I", fw.MAX_PAYLOAD,
                   tuple(int(t) for t in fw.FrameType))
TP_FRAME = Framing(tp.FRAME_HEADER_SIZE, tp.TP_FRAME_MAGIC.to_bytes(4, "little"), 4, 24, "<I",
                   tp.TP_MAX_PAYLOAD, tuple(int(t) for t in tp.FrameType))
# The hello has no type or length: its role byte and hello_size field stand in for them.
TP_HELLO = Framing(tp.HELLO_SIZE, tp.TP_HELLO_MAGIC.to_bytes(4, "little"), 8, 6, "<H", 0xFFFF,
                   (0, 1))
MAGICS = (fdtc.MAGIC, fw.MAGIC, tp.TP_FRAME_MAGIC, tp.TP_HELLO_MAGIC, tp.TP_SLAB_MAGIC)

# kind -> weight. "valid" sends the codec's frame unchanged.
MUTATIONS = {
    "valid": 12, "bitflip": 12, "header-bitflip": 8, "insert": 7, "delete": 7, "length": 11,
    "type": 10, "magic": 6, "payload-noise": 6, "truncate": 8, "oversize": 5, "random": 5,
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
        new = rng.choice([cur + rng.randint(-8, 8), 0, f.max_length, f.max_length + 1,
                          rng.randrange(top + 1), top])
        struct.pack_into(f.length_fmt, b, f.length_at, new & top)
    elif kind == "type":
        b[f.type_at] = rng.choice(f.types) if rng.random() < 0.6 else rng.randrange(256)
    elif kind == "magic":
        b[0:4] = rng.choice([*(m.to_bytes(4, "little") for m in MAGICS), rng.randbytes(4),
                             bytes(4), f.magic[::-1]])
    elif kind == "payload-noise":
        b[f.header :] = rng.randbytes(max(0, len(b) - f.header))
    elif kind == "truncate":
        b = b[: rng.randrange(1, len(b))] if len(b) > 1 else bytearray()
    elif kind == "oversize":
        size = struct.calcsize(f.length_fmt)
        top = (1 << (8 * size)) - 1
        struct.pack_into(f.length_fmt, b, f.length_at,
                         min(top, f.max_length + 1 + rng.randrange(1 << 20)))
        b = b[: f.header] + rng.randbytes(rng.randint(0, 16))
    elif kind == "random":
        b = bytearray(rng.randbytes(rng.randint(1, 300)))
    elif kind == "random-header":
        b = bytearray(f.magic + rng.randbytes(f.header - 4 + rng.randint(0, 64)))
    return kind, bytes(b)


# -- valid frames of every type, with random field values --------------------------------------


def _word(rng: random.Random) -> str:
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
            worker_id=self.worker_id(r), profile=prof, state=r.choice(list(fdtc.WorkerState)),
            batch_size=r.randrange(64), accumulation_steps=r.randrange(8),
            samples_per_sec=_f32(r), loss=_f32(r), local_step=step,
            seconds_since_heartbeat=_f32(r),
        )
        build: dict[str, Callable[[], fdtc.Message]] = {
            "REGISTER": lambda: fdtc.Register(self.worker_id(r), fdtc.PROTOCOL_VERSION, prof,
                                              r.randrange(1, 64), r.randrange(1 << 40),
                                              r.randrange(64)),
            "REGISTER_ACK": lambda: fdtc.RegisterAck(
                accepted=r.random() < 0.5, assigned_shard=r.randrange(8), total_shards=8,
                batch_size=r.randrange(64), accumulation_steps=r.randrange(8),
                compression=comp, topk_ratio=r.random(), global_step=step),
            "DEREGISTER": fdtc.Deregister,
            "HEARTBEAT": lambda: fdtc.Heartbeat(self.worker_id(r), step, _f32(r), _f32(r)),
            "HEARTBEAT_ACK": lambda: fdtc.HeartbeatAck(step),
            "WEIGHTS_REQ": fdtc.WeightsReq,
            "WEIGHTS": lambda: fdtc.Weights(r.randbytes(r.randrange(0, 64, 4))),
            "WEIGHTS_META": lambda: fdtc.WeightsMeta(
                global_step=step, learning_rate=r.random(),
                tensors=tuple(fdtc.TensorMeta(f"blk.{i}.attn_q.weight", (r.randrange(1, 9),
                                                                         r.randrange(1, 9)))
                              for i in range(r.randrange(3)))),
            # A step no round will have for a long while: a fuzz gradient is acknowledged as
            # stale and never joins a round of the real worker.
            "GRADIENTS": lambda: fdtc.Gradients(
                self.worker_id(r), (1 << 32) - 1 - r.randrange(1 << 20),
                r.choice([self.n_tensors, r.randrange(64)]), comp,
                r.choice([self.uncompressed_size, r.randrange(1 << 20)]),
                r.randbytes(r.randrange(0, 96))),
            "GRADIENTS_ACK": lambda: fdtc.GradientsAck(step, r.random() < 0.5),
            "START": fdtc.Start, "SYNC": fdtc.Sync, "CHECKPOINT": fdtc.Checkpoint,
            "SHUTDOWN": fdtc.Shutdown, "PAUSE": fdtc.Pause, "RESUME": fdtc.Resume,
            "STATUS_REQ": fdtc.StatusReq,
            "STATUS": lambda: fdtc.Status(self.worker_id(r), step, r.randrange(1 << 32),
                                          _f32(r), _f32(r), _f32(r), r.randrange(1 << 20),
                                          r.random() < 0.5),
            "ASSIGN": lambda: fdtc.Assign(
                global_step=step, sample_offset=r.randrange(1 << 32), batch_size=8,
                accumulation_steps=8, assigned_shard=0, total_shards=1, seq_len=64,
                n_samples=r.randrange(1, 64)),
            "MODEL_CONFIG": lambda: model_config_msg(self.cfg, r.random()),
            "DATASET": lambda: self.dataset if r.random() < 0.5 else fdtc.Dataset(
                n_tokens=r.randrange(1 << 32), sha256=r.randbytes(32)),
            "SWARM_STATUS": lambda: fdtc.SwarmStatus(
                global_step=step, max_steps=step, state=r.choice(list(fdtc.SwarmState)),
                train_loss=_f32(r), val_loss=_f32(r), samples_per_sec=_f32(r),
                learning_rate=r.random(), samples_total=r.randrange(1 << 32),
                rows=(row,) * r.randrange(3)),
            "CONTROL_ACK": lambda: fdtc.ControlAck(r.choice(list(fdtc.MsgType)),
                                                   r.random() < 0.5, step, _word(r)),
            "EXPORT": lambda: fdtc.Export(_word(r)),
            "TRAIN_PLAN": lambda: fdtc.TrainPlan(
                sync_every=r.randrange(1, 64), digest_every=r.randrange(16), down_compression=comp,
                lr=_f32(r), warmup_steps=r.randrange(100), total_steps=r.randrange(1 << 20),
                min_lr_ratio=_f32(r), weight_decay=_f32(r), grad_clip=_f32(r)),
            "UPDATE": lambda: fdtc.Update(
                global_step=step, base_step=r.randrange(1 << 32), compression=comp,
                num_tensors=r.choice([self.n_tensors, r.randrange(64)]),
                uncompressed_size=r.randrange(1 << 40), data=r.randbytes(r.randrange(0, 96))),
            "WEIGHTS_DIGEST": lambda: fdtc.WeightsDigest(step, r.randbytes(32)),
            "LOCAL_ASSIGN": lambda: fdtc.LocalAssign(
                global_step=step, sample_offset=r.randrange(1 << 32),
                samples_per_step=r.randrange(1, 64), inner_steps=r.randrange(1, 64),
                micro_batch=8, seq_len=64),
            "SWARM_DETAIL_REQ": fdtc.SwarmDetailReq,
            "SWARM_DETAIL": lambda: fdtc.SwarmDetail(
                min_workers=r.randrange(8), seconds_since_step=_f32(r),
                failed=r.random() < 0.5, note=_word(r),
                rows=(fdtc.SwarmDetailRow(step, r.randrange(1 << 40), r.randrange(1 << 40)),)
                * r.randrange(3)),
            # Refused at the header on every link that did not send DATASET (only those get
            # FRAGMENT frames here: WorkerPortTarget.allowed_frame).
            "FRAGMENT": lambda: fdtc.Fragment(
                r.choice([fdtc.MsgType.WEIGHTS, fdtc.MsgType.UPDATE]),
                total_length=r.randrange(24, 1 << 40), offset=0,
                data=r.randbytes(r.randrange(1, 64))),
            "BASE_MODEL": lambda: fdtc.BaseModel(
                file_bytes=r.randrange(1 << 40), sha256=r.randbytes(32),
                architecture=r.choice(["llama", "qwen3", "gemma3", "x"]),
                trainer=r.randrange(2), lora_rank=r.choice([0, 8]), lora_alpha=_f32(r),
                lora_dropout=r.random(), lora_targets=r.randrange(128)),
            "ERROR": lambda: fdtc.Error(r.randrange(1, 12), _word(r)),
        }
        return build[name]()


def fdtc_verdict(data: bytes) -> tuple[Ending, list[fdtc.Message]]:
    """What the service's decoder makes of ``data``: the messages, and how the stream ends."""
    dec = fdtc.FdtcDecoder()
    dec.feed(data)
    msgs: list[fdtc.Message] = []
    try:
        while (m := dec.next_event()) is not None:
            msgs.append(m)
    except fdtc.FdtcProtocolError:
        return Ending.CLOSE, msgs
    return (Ending.PARTIAL if dec.buffered else Ending.OPEN), msgs


# -- the four targets --------------------------------------------------------------------------


class Target:
    """One native port: how to build a connection's plan and read the service's answers."""

    name = ""

    def __init__(self, port: int) -> None:
        self.port = port
        # How long the service may wait for the rest of a frame begun (None: not checked).
        self.frame_deadline_s: float | None = None

    def plan(self, rng: random.Random) -> Plan:
        raise NotImplementedError

    def reader(self) -> Answers:
        raise NotImplementedError


class Answers:
    """The service's bytes on one connection: ERROR frames and probe answers, counted."""

    def __init__(self) -> None:
        self.errors = 0
        self.answers = 0
        self.garbled = False  # the service sent bytes its own protocol cannot decode

    def feed(self, data: bytes) -> None:
        raise NotImplementedError


class FdtcAnswers(Answers):
    def __init__(self, counts: Callable[[fdtc.Message], bool]) -> None:
        super().__init__()
        self.dec = fdtc.FdtcDecoder()
        self.counts = counts

    def feed(self, data: bytes) -> None:
        if self.garbled:
            return
        try:
            self.dec.feed(data)
            while (m := self.dec.next_event()) is not None:
                if isinstance(m, fdtc.Error):
                    self.errors += 1
                elif self.counts(m):
                    self.answers += 1
        except fdtc.FdtcProtocolError:
            self.garbled = True


WORKER_MESSAGES = (fdtc.Heartbeat, fdtc.WeightsReq, fdtc.Gradients, fdtc.WeightsDigest, fdtc.Status,
                   fdtc.Error)
ADMIN_REQUESTS = (fdtc.Start, fdtc.Pause, fdtc.Resume, fdtc.Checkpoint, fdtc.Shutdown,
                  fdtc.StatusReq, fdtc.Export, fdtc.SwarmDetailReq)


class FdtcTarget(Target):
    """Shared by both coordinator ports: frames from every FDTC type, added one by one."""

    def __init__(self, port: int, frames: FdtcFrames, weights: dict[str, int]) -> None:
        super().__init__(port)
        self.frames = frames
        self.names = [t.name for t in fdtc.MsgType]
        self.weights = [weights.get(n, 1) for n in self.names]

    def allowed(self, msgs: list[fdtc.Message]) -> bool:
        """False for a stream the harness must not send (it would stop the real peer)."""
        return True

    def allowed_frame(self, msgs: list[fdtc.Message], raw: bytes) -> bool:
        """False for a frame the harness must not send after ``msgs``."""
        return True

    def link_open(self, msgs: list[fdtc.Message]) -> bool:
        """Whether the service keeps the connection open after these messages."""
        raise NotImplementedError

    def prefix(self, rng: random.Random) -> list[fdtc.Message]:
        return []

    def probe(self, msgs: list[fdtc.Message]) -> list[fdtc.Message]:
        raise NotImplementedError

    def expected_answers(self, msgs: list[fdtc.Message]) -> int:
        raise NotImplementedError

    def plan(self, rng: random.Random) -> Plan:
        prefix = self.prefix(rng)
        data = b"".join(fdtc.encode(m) for m in prefix)
        kinds: list[str] = []
        ending, msgs = Ending.OPEN, list(prefix)
        n = rng.randint(1, MAX_FRAMES_PER_CONNECTION)
        for i in range(n):
            for _attempt in range(10):
                name = rng.choices(self.names, self.weights)[0]
                kind, raw = mutate(fdtc.encode(self.frames.make(name, rng)), FDTC, rng,
                                   lead=i < n - 1)
                v_end, v_msgs = fdtc_verdict(data + raw)
                if self.allowed(v_msgs) and self.allowed_frame(msgs, raw):
                    break
            else:
                break
            data += raw
            kinds.append(f"{name}/{kind}")
            ending, msgs = v_end, v_msgs
            if ending is not Ending.OPEN:
                break
            if not self.link_open(msgs):
                ending = Ending.CLOSE
                break
        valid = len(prefix)
        if ending is Ending.OPEN:
            extra = self.probe(msgs)
            data += b"".join(fdtc.encode(m) for m in extra)
            msgs += extra
            valid += len(extra)
        answers = self.expected_answers(msgs) if ending is Ending.OPEN else 0
        return Plan(data, len(kinds), valid, ending, answers, kinds)


class WorkerPortTarget(FdtcTarget):
    name = "coordinator-workers"

    def __init__(self, port: int, frames: FdtcFrames) -> None:
        # What a worker sends weighs more; every other type is still tried.
        super().__init__(port, frames, {"REGISTER": 6, "DATASET": 4, "HEARTBEAT": 8,
                                        "GRADIENTS": 8, "STATUS": 6, "ERROR": 3,
                                        "DEREGISTER": 2, "WEIGHTS_REQ": 1})
        self.fingerprint = (frames.dataset.n_tokens, frames.dataset.sha256)

    def prefix(self, rng: random.Random) -> list[fdtc.Message]:
        reg = self.frames.make("REGISTER", rng)
        return rng.choice([[], [reg], [self.frames.dataset, reg]])

    def allowed(self, msgs: list[fdtc.Message]) -> bool:
        # Never take the real worker's name (it would be replaced: by design, the name is
        # the identity), and never send a gradient for a step a round may be running.
        return not any(
            (isinstance(m, fdtc.Register) and m.worker_id == GOOD_WORKER)
            or (isinstance(m, fdtc.Gradients) and m.local_step < (1 << 31))
            for m in msgs
        )

    def allowed_frame(self, msgs: list[fdtc.Message], raw: bytes) -> bool:
        # A link that sent DATASET takes FRAGMENT frames past their header (the decoder
        # refuses them at the header elsewhere, as fdtc_verdict does): a slice there is
        # judged by its payload, and one of GRADIENTS waits for the rest of its message once
        # the link holds weights. Those are tested in test_fdtc_fragments.py.
        extended = bool(msgs) and isinstance(msgs[0], fdtc.Dataset)
        return not (extended and len(raw) > 4 and raw[4] == fdtc.MsgType.FRAGMENT)

    def _registered(self, msgs: list[fdtc.Message]) -> int | None:
        """Index after DATASET / BASE_MODEL + REGISTER when they open a worker link; None when
        refused, -1 while the link still waits for its REGISTER."""
        i = 0
        # DATASET and BASE_MODEL come before REGISTER, unanswered: the link waits for it.
        while i < len(msgs) and isinstance(msgs[i], fdtc.Dataset | fdtc.BaseModel):
            m = msgs[i]
            if isinstance(m, fdtc.Dataset) and (m.n_tokens, m.sha256) != self.fingerprint:
                return None
            i += 1
        if i == len(msgs):
            return -1
        reg = msgs[i]
        if not isinstance(reg, fdtc.Register) or reg.protocol_version != fdtc.PROTOCOL_VERSION \
                or not reg.worker_id:
            return None
        return i + 1

    def link_open(self, msgs: list[fdtc.Message]) -> bool:
        at = self._registered(msgs)
        if at is None:
            return False
        if at < 0:
            return True
        # GRADIENTS and WEIGHTS_DIGEST only on a link that got weights (docs/protocol.md,
        # "Lifecycle"): the coordinator answers a WEIGHTS_REQ with them, unless a step is
        # being applied just then (it closes the link then; a close counts, a hang would not).
        weights_asked = False
        for m in msgs[at:]:
            weights_asked |= isinstance(m, fdtc.WeightsReq)
            if not isinstance(m, WORKER_MESSAGES) or (
                isinstance(m, fdtc.Gradients | fdtc.WeightsDigest) and not weights_asked
            ) or (isinstance(m, fdtc.Gradients) and (
                m.num_tensors, m.uncompressed_size
            ) != (self.frames.n_tensors, self.frames.uncompressed_size)):
                return False
        return True

    def probe(self, msgs: list[fdtc.Message]) -> list[fdtc.Message]:
        rng = random.Random(len(msgs))
        extra: list[fdtc.Message] = []
        if self._registered(msgs) == -1:
            extra.append(self.frames.make("REGISTER", rng))
        return [*extra, fdtc.Heartbeat("probe", 0, 0.0, 0.0)]

    def expected_answers(self, msgs: list[fdtc.Message]) -> int:
        return sum(isinstance(m, fdtc.Heartbeat) for m in msgs)

    def reader(self) -> Answers:
        return FdtcAnswers(lambda m: isinstance(m, fdtc.HeartbeatAck))


class AdminPortTarget(FdtcTarget):
    name = "coordinator-admin"

    def __init__(self, port: int, frames: FdtcFrames) -> None:
        super().__init__(port, frames, {"STATUS_REQ": 8, "START": 3, "RESUME": 3, "PAUSE": 2,
                                        "CHECKPOINT": 2, "SHUTDOWN": 2, "EXPORT": 3})

    def allowed(self, msgs: list[fdtc.Message]) -> bool:
        # A valid SHUTDOWN, PAUSE, CHECKPOINT or EXPORT is obeyed, by design (the admin link
        # is the operator's): the harness does not send one whole.
        return not any(isinstance(m, fdtc.Shutdown | fdtc.Pause | fdtc.Checkpoint | fdtc.Export)
                       for m in msgs)

    def link_open(self, msgs: list[fdtc.Message]) -> bool:
        return all(isinstance(m, ADMIN_REQUESTS) for m in msgs)

    def probe(self, msgs: list[fdtc.Message]) -> list[fdtc.Message]:
        return [fdtc.StatusReq()]

    def expected_answers(self, msgs: list[fdtc.Message]) -> int:
        return len(msgs)  # every admin request is answered, in order

    def reader(self) -> Answers:
        # SWARM_DETAIL_REQ is answered by SWARM_STATUS and SWARM_DETAIL: one answer, counted
        # once.
        return FdtcAnswers(lambda m: not isinstance(m, fdtc.SwarmDetail))


class FrontendAnswers(Answers):
    def __init__(self) -> None:
        super().__init__()
        self.dec = fw.FrontendDecoder()

    def feed(self, data: bytes) -> None:
        if self.garbled:
            return
        try:
            self.dec.feed(data)
            while (frame := self.dec.next_event()) is not None:
                if isinstance(frame, fw.Error) and frame.code == fw.ErrorCode.BAD_REQUEST:
                    self.errors += 1
                elif isinstance(frame, fw.Status) and frame.request_id == PROBE_ID:
                    self.answers += 1
        except fw.FrontendProtocolError:
            self.garbled = True


class FrontendTarget(Target):
    name = "tp-leader-frontend"
    NAMES: ClassVar[list[str]] = [t.name for t in fw.FrameType]
    WEIGHTS: ClassVar[list[int]] = [{"GENERATE": 6, "CANCEL": 3, "STATUS_REQ": 4}.get(n, 1)
                                    for n in NAMES]

    def make(self, name: str, rng: random.Random) -> fw.Frame:
        r = rng
        rid = r.randrange(PROBE_ID)
        build: dict[str, Callable[[], fw.Frame]] = {
            "GENERATE": lambda: fw.Generate(
                rid, _word(r), r.randint(1, 8), temperature=r.choice([0.0, 0.7]),
                top_p=r.choice([1.0, 0.9]), seed=r.randrange(1 << 64),
                top_k=r.choice([0, 40]), logprobs=r.random() < 0.5,
                stop=tuple(_word(r) for _ in range(r.randrange(3)))),
            "CANCEL": lambda: fw.Cancel(rid),
            "TOKEN": lambda: fw.Token(rid, r.randrange(259), r.randrange(256), _word(r)),
            "DONE": lambda: fw.Done(rid, r.choice(list(fw.DoneReason)), 3, 4, 0.5),
            "ERROR": lambda: fw.Error(rid, r.randrange(1, 5), _word(r)),
            "STATUS_REQ": lambda: fw.StatusReq(rid),
            "STATUS": lambda: fw.Status(
                rid, True, True, 1, 2, 2, 64, 259, 256, 1000, 7, 0.5, 9, r.randrange(1, 65),
                tuple(fw.RankStatus(i, 1, True, r.randrange(1 << 20)) for i in range(2))),
            "LOGPROBS": lambda: fw.Logprobs(
                rid, r.randrange(259), -0.5, r.randbytes(r.randrange(4)),
                tuple((r.randrange(259), -1.5, r.randbytes(2)) for _ in range(r.randrange(3)))),
        }
        return build[name]()

    @staticmethod
    def verdict(data: bytes) -> tuple[Ending, list[fw.Frame]]:
        dec = fw.FrontendDecoder()
        dec.feed(data)
        frames: list[fw.Frame] = []
        try:
            while (f := dec.next_event()) is not None:
                frames.append(f)
        except fw.FrontendProtocolError:
            return Ending.CLOSE, frames
        return (Ending.PARTIAL if dec.buffered else Ending.OPEN), frames

    def plan(self, rng: random.Random) -> Plan:
        data = b""
        kinds: list[str] = []
        ending = Ending.OPEN
        n = rng.randint(1, MAX_FRAMES_PER_CONNECTION)
        for i in range(n):
            name = rng.choices(self.NAMES, self.WEIGHTS)[0]
            kind, raw = mutate(fw.encode(self.make(name, rng)), FRONTEND, rng, lead=i < n - 1)
            data += raw
            kinds.append(f"{name}/{kind}")
            ending, frames = self.verdict(data)
            if ending is not Ending.OPEN:
                break
            if any(isinstance(f, fw.Token | fw.Done | fw.Error | fw.Status) for f in frames):
                ending = Ending.CLOSE  # a frame only the leader sends: refused, closed
                break
        if ending is Ending.OPEN:
            data += fw.encode(fw.StatusReq(PROBE_ID))
        return Plan(data, len(kinds), int(ending is Ending.OPEN), ending,
                    1 if ending is Ending.OPEN else 0, kinds)

    def reader(self) -> Answers:
        return FrontendAnswers()


class TpAnswers(Answers):
    def feed(self, data: bytes) -> None:
        """The leader answers a hello with its own hello (and COMMAND_ACK busy): nothing to
        count; it sends no error frames, it closes."""


class TpWorkerPortTarget(Target):
    """The port a TP worker dials: one record per connection (the leader reads the first
    record, a hello or a gate-link opener, and answers or closes)."""

    name = "tp-leader-workers"

    def __init__(self, port: int, identity: tp.Identity) -> None:
        super().__init__(port)
        self.identity = identity

    def record(self, rng: random.Random) -> tuple[str, bytes, Framing]:
        r = rng
        ident = self.identity
        choice = r.choices(["hello", "gate", "frame"], [5, 2, 4])[0]
        if choice == "hello":
            if r.random() < 0.4:
                ident = tp.Identity(**{**asdict(ident), "n_layer": r.randrange(1, 64),
                                       "model_id": r.randrange(1 << 32)})
            role = r.choice([tp.Role.WORKER, tp.Role.LEADER])
            shm = r.random() < 0.5
            hello = tp.Hello(role=role, identity=ident, host_id=r.randbytes(16),
                             shm_offered=shm, shm_name=r.choice(["", "fz-slab"]) if shm else "")
            return "HELLO", tp.encode(hello), TP_HELLO
        if choice == "gate":
            return "GATE_OPENER", tp.encode(tp.CommandAck(status=0, seq=r.randrange(1 << 64))), \
                TP_FRAME
        ftype = r.choice(list(tp.FRAME_CLASSES))
        items = tuple(tp.BatchItem(r.randrange(1, 9), r.randrange(259))
                      for _ in range(r.randrange(3)))
        toks = tuple(r.randrange(259) for _ in range(r.randrange(1, 9)))
        build: dict[tp.FrameType, Callable[[], tp.Frame]] = {
            tp.FrameType.SYNC: lambda: tp.Sync(session_id=1, tokens=toks),
            tp.FrameType.EVAL: lambda: tp.Eval(session_id=1, seq=3, token=toks[0]),
            tp.FrameType.REWIND: lambda: tp.Rewind(session_id=1, pos=r.randrange(9)),
            tp.FrameType.INVALIDATE: lambda: tp.Invalidate(session_id=1),
            tp.FrameType.STOP: tp.Stop,
            tp.FrameType.HASH: lambda: tp.Hash(seq=2, value=r.randrange(1 << 64)),
            tp.FrameType.LOGITS: lambda: tp.Logits(values=r.randbytes(4 * r.randrange(5))),
            tp.FrameType.VERIFY: lambda: tp.Verify(session_id=1, drafts=toks[:8]),
            tp.FrameType.VERIFY_COMMIT: lambda: tp.VerifyCommit(
                session_id=1, mode=r.choice(list(tp.VerifyCommitMode)), token_count=1),
            tp.FrameType.SESSION_CREATE: lambda: tp.SessionCreate(session_id=1, ctx_size=256),
            tp.FrameType.SESSION_DESTROY: lambda: tp.SessionDestroy(session_id=1),
            tp.FrameType.EVAL_BATCH: lambda: tp.EvalBatch(items=items),
            tp.FrameType.MIXED_BATCH: lambda: tp.MixedBatch(session_id=1, prompt=toks,
                                                            items=items),
            tp.FrameType.COMMAND_ACK: lambda: tp.CommandAck(status=r.randrange(3)),
            tp.FrameType.SYNC_CHECKPOINT: lambda: tp.SyncCheckpoint(
                point=4, current=0, total=8, requested=r.random() < 0.5),
            tp.FrameType.WORLD: lambda: tp.World(peers=tuple(
                tp.WorldPeer(rank=i, gate_port=r.randrange(1, 1 << 16),
                             host=bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1]),
                             token=r.randrange(1 << 64))
                for i in range(1, r.randrange(3, 6)))),
        }
        return ftype.name, tp.encode(build[ftype]()), TP_FRAME

    def plan(self, rng: random.Random) -> Plan:
        name, raw, framing = self.record(rng)
        kind, data = mutate(raw, framing, rng)
        head = data[:4]
        if len(data) < 4:
            ending = Ending.PARTIAL
        elif head == TP_HELLO.magic:
            dec = tp.TpDecoder(expect_hello=True)
            dec.feed(data)
            try:
                hello = dec.next_event()
            except tp.TpProtocolError:
                hello, ending = None, Ending.CLOSE
            else:
                ending = Ending.PARTIAL if hello is None else Ending.OPEN
        elif head == TP_FRAME.magic:
            # The leader reads exactly one frame header and a 4-byte token, then decides.
            ending = Ending.PARTIAL if len(data) < 4 + tp.FRAME_HEADER_SIZE else Ending.CLOSE
        else:
            ending = Ending.CLOSE
        return Plan(data, 1, 0, ending, 0, [f"{name}/{kind}"])

    def reader(self) -> Answers:
        return TpAnswers()


# -- driving connections -----------------------------------------------------------------------


@dataclass
class PortStats:
    port: str
    lanes: int = 0
    fuzz_frames: int = 0
    valid_frames: int = 0
    connections: int = 0
    errors_answered: int = 0  # connections that got an ERROR frame before the close
    closed_by_service: int = 0  # the service closed on its own (bad bytes or a refusal)
    closed_after_eof: int = 0  # the service closed after the harness ended its side
    resets: int = 0  # the service reset the connection (closed with our bytes unread)
    probes_answered: int = 0
    awaiting: int = 0  # streams that ended inside a declared frame (then we ended ours)
    held: int = 0  # ... and were left open for the service's frame deadline
    deadline_closes: int = 0  # held streams the service cut off
    frame_deadline_s: float | None = None  # the service's, where the harness could set it
    refused_unread: int = 0  # closed unread: bring-up slots full, or a connection limit
    connect_failures: int = 0
    garbled_answers: int = 0  # the service answered with bytes its own protocol refuses
    hangs: int = 0
    crashes: int = 0
    internal_errors: int = 0
    health_checks: int = 0
    health_failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    hang_samples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.hangs or self.crashes or self.internal_errors or self.health_failures
                    or self.connect_failures or self.garbled_answers)

    def line(self) -> str:
        return (f"{self.port:20s} frames {self.fuzz_frames:7d} (+{self.valid_frames} valid)  "
                f"connections {self.connections:6d}  errors answered {self.errors_answered:6d}"
                f"  closes {self.closed_by_service + self.closed_after_eof + self.resets:6d}"
                f" (awaiting {self.awaiting}, cut off at the frame deadline "
                f"{self.deadline_closes}/{self.held})  probes {self.probes_answered:5d}  "
                f"hangs {self.hangs}  crashes {self.crashes}  unhandled {self.internal_errors}"
                f"{f'  refused unread {self.refused_unread}' if self.refused_unread else ''}"
                f"  health {self.health_checks - len(self.health_failures)}/"
                f"{self.health_checks}  {self.seconds:5.1f} s "
                f"({self.fuzz_frames / max(self.seconds, 1e-9):,.0f} frames/s)")


async def drive(target: Target, plan: Plan, stats: PortStats, hang_s: float,
                hold: bool = False) -> None:
    """One connection: send the plan's bytes, then wait for what the service owes.

    ``hold``: a stream that ends inside a frame is left open (the service's frame deadline
    must close it within ``hang_s``) instead of being ended by us at once.
    """
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(live.HOST, target.port), hang_s)
    except (OSError, TimeoutError):
        stats.connect_failures += 1
        return
    stats.connections += 1
    stats.fuzz_frames += plan.fuzz
    stats.valid_frames += plan.valid
    for k in plan.kinds:
        kind = k.split("/")[1]
        stats.kinds[kind] = stats.kinds.get(kind, 0) + 1
    answers = target.reader()
    eof_sent = False

    def end_ours() -> None:
        nonlocal eof_sent
        if not eof_sent:
            eof_sent = True
            if not writer.is_closing():
                writer.write_eof()

    def hang(why: str) -> None:
        stats.hangs += 1
        if len(stats.hang_samples) < 10:
            stats.hang_samples.append(
                f"{why}: {plan.ending.value} {plan.kinds} answers {answers.answers}/"
                f"{plan.answers} eof_sent {eof_sent}: {plan.data[:96].hex()}")

    holding = False
    try:
        writer.write(plan.data)
        try:
            await asyncio.wait_for(writer.drain(), hang_s)
        except TimeoutError:
            hang("took none of our bytes")
            return
        if plan.ending is Ending.PARTIAL:
            if hold:
                stats.held += 1
                holding = True
            else:
                stats.awaiting += 1
                end_ours()
        deadline = time.monotonic() + hang_s
        if plan.ending is Ending.OPEN and plan.answers == 0:
            deadline = time.monotonic() + OPEN_WINDOW_S
        while True:
            if plan.ending is Ending.OPEN and not eof_sent and (
                plan.answers and answers.answers >= plan.answers
            ):
                stats.probes_answered += 1
                end_ours()
                deadline = time.monotonic() + hang_s
            try:
                data = await asyncio.wait_for(reader.read(1 << 16),
                                              max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if plan.ending is Ending.OPEN and plan.answers == 0 and not eof_sent:
                    end_ours()
                    deadline = time.monotonic() + hang_s
                    continue
                hang("neither answered nor closed")
                return
            if not data:
                if eof_sent:
                    stats.closed_after_eof += 1
                else:
                    stats.closed_by_service += 1
                    stats.deadline_closes += int(hold and plan.ending is Ending.PARTIAL)
                return
            answers.feed(data)
    except OSError:  # reset, broken pipe: the service closed with our bytes unread
        stats.resets += 1
        # A held stream reset rather than closed was cut off all the same (the service closed
        # it with some of our partial frame still unread in its socket).
        stats.deadline_closes += int(holding)
    finally:
        stats.errors_answered += int(answers.errors > 0)
        stats.garbled_answers += int(answers.garbled)
        writer.transport.abort()


async def held_lane(target: Target, rng: random.Random, stats: PortStats, deadline_s: float,
                    hang_s: float, done: asyncio.Event) -> None:
    """Streams that stop inside a frame and stay open: the service must cut each one off by
    its frame deadline (``deadline_s``)."""
    while not done.is_set():
        for _ in range(100):
            plan = target.plan(rng)
            if plan.ending is Ending.PARTIAL and plan.data:
                break
        else:
            continue
        await drive(target, plan, stats, deadline_s + hang_s, hold=True)
        if stats.connect_failures > 10:
            return


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Stack:
    work: Path
    coordinator: live.Service
    good_worker: live.Service
    leader: live.Service
    tp_worker: live.Service
    worker_port: int
    admin_port: int
    tp_port: int
    frontend_port: int
    model: Path
    reference: list[int]
    coordinator_deadline_s: float | None
    leader_deadline_s: float | None
    last_step: int = 0

    def services(self) -> list[live.Service]:
        return [self.coordinator, self.good_worker, self.leader, self.tp_worker]

    def stop(self) -> None:
        for svc in (self.good_worker, self.tp_worker, self.coordinator, self.leader):
            svc.stop()


def start_stack(work: Path) -> Stack:
    model = live.make_model(work / "model.gguf")
    reference = live.greedy_reference(model, PROMPT, PROMPT_TOKENS)
    short = ["--frame-deadline", f"{FRAME_DEADLINE_S:g}"]
    coord_deadline = FRAME_DEADLINE_S if live.has_flag("coordinator", short[0]) else None
    leader_deadline = FRAME_DEADLINE_S if live.has_flag("tp-leader", short[0]) else None
    started: list[live.Service] = []
    try:
        coord, wport, aport = live.start_coordinator(
            work, "--max-steps", "100000000", "--global-batch", "8",
            "--checkpoint-every", "100000000", *(short if coord_deadline else []))
        started.append(coord)
        good = live.start_worker(work, wport, GOOD_WORKER)
        started.append(good)
        leader, tport, fport = live.start_leader(work, model,
                                                 *(short if leader_deadline else []))
        started.append(leader)
        tpw = live.start_tp_worker(work, model, tport)
        started.append(tpw)
        live.wait_paired(fport)
        stack = Stack(work, coord, good, leader, tpw, wport, aport, tport, fport, model,
                      reference, coord_deadline, leader_deadline)
        stack.last_step = wait_training(stack, 0)
        return stack
    except BaseException:
        for svc in reversed(started):
            svc.stop()
        raise


def wait_training(stack: Stack, after: int) -> int:
    """The global step once it passed ``after`` with the real worker registered."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        st = live.swarm_status(stack.admin_port)
        if st.global_step > after and any(r.worker_id == GOOD_WORKER for r in st.rows):
            return st.global_step
        if time.monotonic() > deadline:
            raise live.ServiceError(f"training did not pass step {after} within "
                                    f"{HEALTH_TIMEOUT_S:g} s (now {st.global_step}, workers "
                                    f"{[r.worker_id for r in st.rows]})")
        time.sleep(0.05)


def check_pair(stack: Stack) -> None:
    with live.FrontendClient(stack.frontend_port) as c:
        got = c.generate(PROMPT, PROMPT_TOKENS, HEALTH_TIMEOUT_S)
    if not isinstance(got.end, fw.Done) or got.tokens != stack.reference:
        raise live.ServiceError(f"generation after fuzzing: {got.end}, tokens {got.tokens}, "
                                f"expected {stack.reference}")


def health(stack: Stack, target: Target) -> None:
    """The well-behaved peers are served; raises ServiceError if not."""
    dead = [s.name for s in stack.services() if not s.alive()]
    if dead:
        raise live.ServiceError(f"exited: {dead}")
    stack.last_step = wait_training(stack, stack.last_step)
    if target.name.startswith("tp-"):
        check_pair(stack)


async def fuzz_port(stack: Stack, target: Target, frames: int, seconds: float, seed: int,
                    hang_s: float, batches: int, refused: Callable[[], int]) -> PortStats:
    """Fuzz one port until ``frames`` fuzz frames reached its parser (``refused``: how many
    connections the service closed unread so far) or ``seconds`` passed."""
    lanes = LANES[target.name]
    stats = PortStats(target.name, lanes=lanes, frame_deadline_s=target.frame_deadline_s)
    t0 = time.monotonic()
    stop_at = t0 + seconds
    batch = max(1, -(-frames // batches))
    rngs = [random.Random(f"{seed}-{target.name}-{lane}") for lane in range(lanes)]

    async def lane(rng: random.Random, until: int) -> None:
        while stats.fuzz_frames < until and time.monotonic() < stop_at:
            await drive(target, target.plan(rng), stats, hang_s)
            if stats.connect_failures > 10:
                return

    done = asyncio.Event()
    held = None
    if target.frame_deadline_s is not None:
        held = asyncio.create_task(held_lane(
            target, random.Random(f"{seed}-{target.name}-held"), stats,
            target.frame_deadline_s, hang_s, done))
    while stats.fuzz_frames - stats.refused_unread < frames and time.monotonic() < stop_at:
        until = stats.fuzz_frames + min(batch, frames - stats.fuzz_frames + stats.refused_unread)
        await asyncio.gather(*(lane(r, until) for r in rngs))
        stats.refused_unread = refused()
        stats.health_checks += 1
        try:
            await asyncio.to_thread(health, stack, target)
        except live.ServiceError as exc:
            stats.health_failures.append(str(exc))
            break
        if stats.connect_failures > 10:
            break
    done.set()
    if held is not None:
        await held  # at most one connection in flight: bounded by its deadline
    stats.seconds = time.monotonic() - t0
    stats.crashes = sum(not s.alive() for s in stack.services())
    return stats


@dataclass
class Report:
    ports: list[PortStats]
    frames_per_port: int
    seed: int
    seconds: float
    unhandled: list[str]

    @property
    def ok(self) -> bool:
        return not self.unhandled and all(
            p.ok and p.fuzz_frames - p.refused_unread >= self.frames_per_port for p in self.ports
        )

    def summary(self) -> str:
        frames = sum(p.fuzz_frames for p in self.ports)
        return (f"fuzz: {frames:,} frames on {len(self.ports)} ports in {self.seconds:.0f} s, "
                f"hangs {sum(p.hangs for p in self.ports)}, crashes "
                f"{max((p.crashes for p in self.ports), default=0)}, unhandled exceptions "
                f"{len(self.unhandled)}: {'PASS' if self.ok else 'FAIL'}")


def run(work: Path, frames_per_port: int, seed: int, seconds: float, hang_s: float = 5.0,
        batches: int = 10, ports: list[str] | None = None, out: live.Printer = print,
        ) -> Report:
    """Start the services in ``work``, fuzz each port, stop everything; the results."""
    t0 = time.monotonic()
    stack = start_stack(work)
    try:
        corpus = load_corpus(None)
        fp = corpus.fingerprint
        frames = FdtcFrames(ModelConfig(), fp.n_tokens, bytes.fromhex(fp.sha256))
        header = load_gguf(stack.model, select=lambda name, view: None)
        identity = identity_for(stack.model, header.cfg, header.cfg.n_ctx)
        targets: list[Target] = [
            WorkerPortTarget(stack.worker_port, frames),
            AdminPortTarget(stack.admin_port, frames),
            TpWorkerPortTarget(stack.tp_port, identity),
            FrontendTarget(stack.frontend_port),
        ]
        deadlines = [stack.coordinator_deadline_s, stack.coordinator_deadline_s,
                     TP_BRINGUP_DEADLINE_S, stack.leader_deadline_s]
        for target, deadline in zip(targets, deadlines, strict=True):
            target.frame_deadline_s = deadline
        results = []
        unhandled: list[str] = []
        for target in targets:
            if ports and target.name not in ports:
                continue
            service = stack.leader if target.name.startswith("tp-") else stack.coordinator
            before = len(REFUSED_UNREAD.findall(service.text()))

            def refused(service: live.Service = service, before: int = before) -> int:
                return len(REFUSED_UNREAD.findall(service.text())) - before

            stats = asyncio.run(fuzz_port(stack, target, frames_per_port, seconds, seed,
                                          hang_s, batches, refused))
            now = [f"{s.name}: {line}" for s in stack.services() for line in
                   s.internal_errors()]
            stats.internal_errors = len(now) - len(unhandled)
            unhandled = now
            results.append(stats)
            out(stats.line())
            if stats.crashes:
                break
    finally:
        stack.stop()
    report = Report(results, frames_per_port, seed, time.monotonic() - t0, unhandled)
    for p in results:
        for sample in p.hang_samples:
            out(f"  hang on {p.port}: {sample}")
        for failure in p.health_failures:
            out(f"  health check failed on {p.port}: {failure}")
    for line in unhandled[:20]:
        out(f"  unhandled: {line}")
    out(report.summary())
    return report


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames-per-port", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=120.0,
                    help="time limit per port (default 120)")
    ap.add_argument("--hang-after", type=float, default=5.0,
                    help="seconds a connection may stay open past what it is owed (default 5)")
    ap.add_argument("--batches", type=int, default=10,
                    help="health checks per port, one after each batch (default 10)")
    ap.add_argument("--ports", nargs="*", default=None,
                    help="only these ports (coordinator-workers, coordinator-admin, "
                         "tp-leader-workers, tp-leader-frontend)")
    ap.add_argument("--work", type=Path, default=None, help="keep logs here (default: temp)")
    harness.add_json_flag(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="foundry-fuzz-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        report = run(work, args.frames_per_port, args.seed, args.seconds, args.hang_after,
                     args.batches, args.ports)
    harness.emit("fuzz", asdict(report), report.ok, args.json)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
