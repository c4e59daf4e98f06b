"""The four ports ``fuzz.py`` fuzzes, one :class:`Target` each (the coordinator's worker and
admin ports, the TP leader's worker and frontend ports): each builds a connection's
:class:`Plan` (its frames, after the prefix a real peer sends, and how the service must end the
connection) and reads the service's answers with the service's own sans-IO decoder."""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import ClassVar

from fuzz_frames import FDTC, FRONTEND, TP_FRAME, TP_HELLO, FdtcFrames, Framing, mutate, random_word

from foundry.wire import fdtc, tp
from foundry.wire import frontend as fw

GOOD_WORKER = "good-worker"
# Fuzz frames in one connection at most (pipelined where the protocol keeps it open).
MAX_FRAMES_PER_CONNECTION = 8
# Request id of the frontend probe; fuzz frames never use it.
PROBE_ID = 0xFFFF_FFFF
# A record on the TP worker port that is complete and valid is answered and closed by the
# leader at once; if it is still open after this long (a hello that claimed a free pair waits
# for its data plane), the harness ends its side.
OPEN_WINDOW_S = 1.0


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


WORKER_MESSAGES = (
    fdtc.Heartbeat,
    fdtc.WeightsReq,
    fdtc.Gradients,
    fdtc.WeightsDigest,
    fdtc.Status,
    fdtc.Error,
)
ADMIN_REQUESTS = (
    fdtc.Start,
    fdtc.Pause,
    fdtc.Resume,
    fdtc.Checkpoint,
    fdtc.Shutdown,
    fdtc.StatusReq,
    fdtc.Export,
    fdtc.SwarmDetailReq,
)


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
                kind, raw = mutate(
                    fdtc.encode(self.frames.make(name, rng)), FDTC, rng, lead=i < n - 1
                )
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
        super().__init__(
            port,
            frames,
            {
                "REGISTER": 6,
                "DATASET": 4,
                "HEARTBEAT": 8,
                "GRADIENTS": 8,
                "STATUS": 6,
                "ERROR": 3,
                "DEREGISTER": 2,
                "WEIGHTS_REQ": 1,
            },
        )
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
        # the link holds weights. Those are tested in test_fdtc_fragments_connection.py.
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
        if (
            not isinstance(reg, fdtc.Register)
            or reg.protocol_version != fdtc.PROTOCOL_VERSION
            or not reg.worker_id
        ):
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
            if (
                not isinstance(m, WORKER_MESSAGES)
                or (isinstance(m, fdtc.Gradients | fdtc.WeightsDigest) and not weights_asked)
                or (
                    isinstance(m, fdtc.Gradients)
                    and (m.num_tensors, m.uncompressed_size)
                    != (self.frames.n_tensors, self.frames.uncompressed_size)
                )
            ):
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
        super().__init__(
            port,
            frames,
            {
                "STATUS_REQ": 8,
                "START": 3,
                "RESUME": 3,
                "PAUSE": 2,
                "CHECKPOINT": 2,
                "SHUTDOWN": 2,
                "EXPORT": 3,
            },
        )

    def allowed(self, msgs: list[fdtc.Message]) -> bool:
        # A valid SHUTDOWN, PAUSE, CHECKPOINT or EXPORT is obeyed, by design (the admin link
        # is the operator's): the harness does not send one whole.
        return not any(
            isinstance(m, fdtc.Shutdown | fdtc.Pause | fdtc.Checkpoint | fdtc.Export) for m in msgs
        )

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
    WEIGHTS: ClassVar[list[int]] = [
        {"GENERATE": 6, "CANCEL": 3, "STATUS_REQ": 4}.get(n, 1) for n in NAMES
    ]

    def make(self, name: str, rng: random.Random) -> fw.Frame:
        r = rng
        rid = r.randrange(PROBE_ID)
        build: dict[str, Callable[[], fw.Frame]] = {
            "GENERATE": lambda: fw.Generate(
                rid,
                random_word(r),
                r.randint(1, 8),
                temperature=r.choice([0.0, 0.7]),
                top_p=r.choice([1.0, 0.9]),
                seed=r.randrange(1 << 64),
                top_k=r.choice([0, 40]),
                logprobs=r.random() < 0.5,
                stop=tuple(random_word(r) for _ in range(r.randrange(3))),
            ),
            "CANCEL": lambda: fw.Cancel(rid),
            "TOKEN": lambda: fw.Token(rid, r.randrange(259), r.randrange(256), random_word(r)),
            "DONE": lambda: fw.Done(rid, r.choice(list(fw.DoneReason)), 3, 4, 0.5),
            "ERROR": lambda: fw.Error(rid, r.randrange(1, 5), random_word(r)),
            "STATUS_REQ": lambda: fw.StatusReq(rid),
            "STATUS": lambda: fw.Status(
                rid,
                True,
                True,
                1,
                2,
                2,
                64,
                259,
                256,
                1000,
                7,
                0.5,
                9,
                r.randrange(1, 65),
                tuple(
                    fw.RankStatus(i, 1, True, r.randrange(1 << 20), r.randrange(1 << 16))
                    for i in range(2)
                ),
            ),
            "LOGPROBS": lambda: fw.Logprobs(
                rid,
                r.randrange(259),
                -0.5,
                r.randbytes(r.randrange(4)),
                tuple((r.randrange(259), -1.5, r.randbytes(2)) for _ in range(r.randrange(3))),
            ),
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
        return Plan(
            data,
            len(kinds),
            int(ending is Ending.OPEN),
            ending,
            1 if ending is Ending.OPEN else 0,
            kinds,
        )

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
                ident = tp.Identity(
                    **{
                        **asdict(ident),
                        "n_layer": r.randrange(1, 64),
                        "model_id": r.randrange(1 << 32),
                    }
                )
            role = r.choice([tp.Role.WORKER, tp.Role.LEADER])
            shm = r.random() < 0.5
            world, weight, threads = self.extensions(r)
            hello = tp.Hello(
                role=role,
                identity=ident,
                host_id=r.randbytes(16),
                shm_offered=shm,
                shm_name=r.choice(["", "fz-slab"]) if shm else "",
                world=world,
                weight=weight,
                threads=threads,
            )
            return "HELLO", tp.encode(hello), TP_HELLO
        if choice == "gate":
            return (
                "GATE_OPENER",
                tp.encode(tp.CommandAck(status=0, seq=r.randrange(1 << 64))),
                TP_FRAME,
            )
        ftype = r.choice(list(tp.FRAME_CLASSES))
        items = tuple(
            tp.BatchItem(r.randrange(1, 9), r.randrange(259)) for _ in range(r.randrange(3))
        )
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
                session_id=1, mode=r.choice(list(tp.VerifyCommitMode)), token_count=1
            ),
            tp.FrameType.SESSION_CREATE: lambda: tp.SessionCreate(session_id=1, ctx_size=256),
            tp.FrameType.SESSION_DESTROY: lambda: tp.SessionDestroy(session_id=1),
            tp.FrameType.EVAL_BATCH: lambda: tp.EvalBatch(items=items),
            tp.FrameType.MIXED_BATCH: lambda: tp.MixedBatch(session_id=1, prompt=toks, items=items),
            tp.FrameType.MIXED_PREFILLS: lambda: tp.MixedPrefills(
                prefills=(tp.Prefill(2, toks), tp.Prefill(3, toks[:1])), items=items
            ),
            tp.FrameType.COMMAND_ACK: lambda: tp.CommandAck(status=r.randrange(3)),
            tp.FrameType.SYNC_CHECKPOINT: lambda: tp.SyncCheckpoint(
                point=4, current=0, total=8, requested=r.random() < 0.5
            ),
            tp.FrameType.WORLD: lambda: tp.World(
                peers=tuple(
                    tp.WorldPeer(
                        rank=i,
                        gate_port=r.randrange(1, 1 << 16),
                        host=bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1]),
                        token=r.randrange(1 << 64),
                    )
                    for i in range(1, r.randrange(3, 6))
                )
            ),
            tp.FrameType.ROW_TOPS: lambda: tp.RowTops(
                values=tuple(r.uniform(-9, 9) for _ in toks),
                tokens=tuple(r.randrange(-2, 259) for _ in toks),
            ),
            tp.FrameType.ROW_DRAW: lambda: tp.RowDraw(
                rows=tuple(
                    tp.DrawRow(
                        1,
                        r.randrange(41),
                        r.uniform(-9, 9),
                        1.25,
                        r.uniform(0, 99),
                        r.random(),
                        r.randrange(259),
                    )
                    for _ in toks
                )
            ),
            tp.FrameType.ROW_MASS: lambda: tp.RowMass(
                rows=tuple(tp.MassRow(r.uniform(0, 99), r.randrange(259)) for _ in toks)
            ),
            tp.FrameType.ROW_PICKS: lambda: tp.RowPicks(
                rows=tuple(
                    tp.PickRow(tp.PICK_TOP_K, 0, 0.0, ((0.5, r.randrange(259)),))
                    if r.random() < 0.3
                    else tp.PickRow(tp.PICK_TOKEN, r.randrange(259), r.uniform(0, 9))
                    for _ in toks
                )
            ),
        }
        return ftype.name, tp.encode(build[ftype]()), TP_FRAME

    @staticmethod
    def extensions(
        r: random.Random,
    ) -> tuple[tp.WorldInfo | None, tp.RankWeight | None, int | None]:
        """A hello's extensions, each flag in turn: none (the plain pair's), or a world of 2
        to 4 ranks (of shares listed or still to be chosen, the weight then), mostly with the
        threads after it. The pair the fuzzer meets states no world, so it refuses them all."""
        if r.random() < 0.6:
            return None, None, None
        n = r.randrange(2, 5)
        pending = r.random() < 0.5
        world = tp.WorldInfo(
            world_size=n,
            shares=() if pending else (2,) + (1,) * (n - 1),
            rank=r.randrange(n),
            gate_port=r.randrange(1 << 16),
            shares_from=r.choice([tp.SharesFrom.SPEED, tp.SharesFrom.SHARE])
            if pending
            else tp.SharesFrom.LIST,
        )
        weight = (
            tp.RankWeight(share=r.randrange(4), speed=r.randrange(1 << 20)) if pending else None
        )
        threads = r.choice([0, 1, r.randrange(1 << 16)]) if r.random() < 0.8 else None
        return world, weight, threads

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
