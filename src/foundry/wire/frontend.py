"""The frontend link of the tensor-parallel leader, as a sans-IO codec.

The gateway (or any client) submits generations to the leader over one TCP connection and
receives tokens as they are produced. Requests are multiplexed by a client-chosen
``request_id``; the leader answers each GENERATE with TOKEN frames and exactly one DONE or
ERROR. CANCEL (same id) stops a generation at the next token boundary; its DONE says so.

Frame: a 13-byte header ``magic u32 = 0x45464446 ("FDFE" on the wire), type u8,
request_id u32, length u32`` and ``length`` payload bytes, all little-endian.
Layouts of every payload are in docs/protocol.md; each has one frozen dataclass here, its
fixed part declared as a ``Layout`` (``foundry.wire.layout``, the FDTC codec's field kinds):
a field value out of range is a LocalProtocolError when built, FrontendProtocolError when
received.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Self

from foundry.wire.errors import FrontendProtocolError as FrontendProtocolError
from foundry.wire.errors import LocalProtocolError
from foundry.wire.framing import FrameDecoder
from foundry.wire.layout import BOOL, F32, I32, U8, U16, U32, U64, Enum, Layout

MAGIC = 0x45464446  # b"FDFE" little-endian
HEADER = struct.Struct("<IBII")
HEADER_SIZE = HEADER.size  # 13
# A prompt is at most a context of byte tokens (a few KiB at our sizes); 1 MiB leaves room
# for long stop lists while keeping one bad header from reserving much memory.
MAX_PAYLOAD = 1 << 20
MAX_STOP_STRINGS = 16
# OpenAI's API allows 0..20 alternatives per token (top_logprobs).
MAX_TOP_LOGPROBS = 20


class FrameType(enum.IntEnum):
    GENERATE = 0x01
    CANCEL = 0x02
    TOKEN = 0x03
    DONE = 0x04
    ERROR = 0x05
    STATUS_REQ = 0x06
    STATUS = 0x07
    LOGPROBS = 0x08


class GenerateFlags(enum.IntFlag):
    """GENERATE's ``flags`` byte; the other bits must be 0."""

    LOGPROBS = 0x01  # a LOGPROBS frame before each TOKEN
    CHAT = 0x02  # the prompt field holds messages, rendered by the leader's chat template


_KNOWN_FLAGS = int(GenerateFlags.LOGPROBS | GenerateFlags.CHAT)


class DoneReason(enum.IntEnum):
    MAX_TOKENS = 0
    EOS = 1
    STOP_STRING = 2
    CANCELLED = 3
    CONTEXT_FULL = 4


class ErrorCode(enum.IntEnum):
    BAD_REQUEST = 1  # the request cannot be served as asked (fix the arguments)
    UNAVAILABLE = 2  # the worker rank is down or re-syncing; retry shortly
    OVERLOADED = 3  # too many concurrent generations; retry later
    INTERNAL = 4


class _Layout(Layout):
    error = FrontendProtocolError


_U16 = struct.Struct("<H")  # the length before each stop string
_U8 = struct.Struct("<B")  # a message's role length; LOGPROBS' alternative count
_U32 = struct.Struct("<I")  # a message's content length
_ALTERNATIVE = struct.Struct("<ifH")  # LOGPROBS: token, logprob, length of the token's bytes


def _text(raw: bytes | memoryview, *what: str) -> str:
    """``raw`` as UTF-8; ``what`` names it in the error (joined only then: TOKEN frames come
    once per generated token)."""
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FrontendProtocolError(f"{' '.join(what)} is not valid UTF-8: {exc}") from None


@dataclass(frozen=True)
class _Frame:
    """Base of every frontend frame: a frozen dataclass that validates itself when built.

    ``request_id`` travels in the frame header; ``LAYOUT`` is the payload's fixed part. A
    frame with UTF-8 text after it names the field in ``TEXT``; GENERATE, whose payload
    goes on with a prompt and a stop list, overrides ``payload`` and ``parse``.
    """

    TYPE: ClassVar[FrameType]
    LAYOUT: ClassVar[_Layout] = _Layout()
    TEXT: ClassVar[str | None] = None  # the field of UTF-8 text after the fixed part
    request_id: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_id", U32.check("request_id", self.request_id))
        self.LAYOUT.normalise(self)

    def payload(self) -> bytes:
        head = self.LAYOUT.pack_obj(self)
        return head if self.TEXT is None else head + getattr(self, self.TEXT).encode("utf-8")

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> Self:
        size = cls.LAYOUT.size
        if cls.TEXT is None:
            if len(p) != size:
                raise FrontendProtocolError(
                    f"{cls.TYPE.name} payload must be {size} bytes, got {len(p)}"
                )
            return cls(request_id, **cls.LAYOUT.unpack(p))
        if len(p) < size:
            raise FrontendProtocolError(f"{cls.TYPE.name} payload of {len(p)} bytes is too short")
        text = _text(p[size:], cls.TYPE.name, cls.TEXT)
        return cls(request_id, **cls.LAYOUT.unpack(p), **{cls.TEXT: text})


@dataclass(frozen=True)
class Generate(_Frame):
    """The fixed part, then the prompt (``prompt_len`` bytes) and ``n_stop`` stop strings,
    each a u16 length and that many bytes of UTF-8.

    The prompt is UTF-8 text, or with ``CHAT`` in ``flags`` a conversation: ``messages``, each
    ``u8 role_len``, the role, ``u32 content_len``, the content (UTF-8), back to back, at least
    one. ``top_k`` 0 keeps every token; ``top_logprobs`` (0..20) alternatives go in each
    LOGPROBS frame when ``logprobs`` is set.
    """

    TYPE: ClassVar[FrameType] = FrameType.GENERATE
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("max_tokens", U32),
        ("temperature", F32),
        ("top_p", F32),
        ("seed", U64),
        ("top_k", U32),
        ("flags", U8),
        ("top_logprobs", U8),
    )
    _COUNTS: ClassVar[_Layout] = _Layout(("n_stop", U16), ("prompt_len", U32))
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    top_k: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    messages: tuple[tuple[str, str], ...] = ()  # (role, content); non-empty: a chat

    @property
    def flags(self) -> int:
        return int(
            (GenerateFlags.LOGPROBS if self.logprobs else 0)
            | (GenerateFlags.CHAT if self.messages else 0)
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.stop) > MAX_STOP_STRINGS:
            raise LocalProtocolError(
                f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        if any(not s for s in self.stop):
            raise LocalProtocolError("stop strings must not be empty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise LocalProtocolError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.messages and self.prompt:
            raise LocalProtocolError("a GENERATE carries a prompt or messages, not both")
        for role, _ in self.messages:
            if not role or len(role.encode("utf-8")) > 0xFF:
                raise LocalProtocolError(f"a message role must be 1..255 bytes, got {role!r}")

    def _prompt_bytes(self) -> bytes:
        if not self.messages:
            return self.prompt.encode("utf-8")
        parts = []
        for role, content in self.messages:
            r, c = role.encode("utf-8"), content.encode("utf-8")
            parts += [_U8.pack(len(r)), r, _U32.pack(len(c)), c]
        return b"".join(parts)

    def payload(self) -> bytes:
        prompt = self._prompt_bytes()
        parts = [
            self.LAYOUT.pack_obj(self),
            self._COUNTS.pack((len(self.stop), len(prompt))),
            prompt,
        ]
        for s in self.stop:
            raw = s.encode("utf-8")
            parts += [_U16.pack(len(raw)), raw]
        return b"".join(parts)

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> Self:
        pos = cls.LAYOUT.size + cls._COUNTS.size
        if len(p) < pos:
            raise FrontendProtocolError(f"GENERATE payload of {len(p)} bytes is too short")
        fixed = cls.LAYOUT.unpack(p)
        flags = fixed.pop("flags")
        if flags & ~_KNOWN_FLAGS:
            raise FrontendProtocolError(f"GENERATE flags 0x{flags:02x} set unknown bits")
        counts = cls._COUNTS.unpack(p, cls.LAYOUT.size)
        n_stop, prompt_len = counts["n_stop"], counts["prompt_len"]
        if n_stop > MAX_STOP_STRINGS:
            raise FrontendProtocolError(f"GENERATE lists {n_stop} stop strings (max 16)")
        if pos + prompt_len > len(p):
            raise FrontendProtocolError("GENERATE prompt runs past the payload")
        raw = p[pos : pos + prompt_len]
        messages: tuple[tuple[str, str], ...] = ()
        prompt = ""
        if flags & GenerateFlags.CHAT:
            messages = _parse_messages(raw)
        else:
            prompt = _text(raw, "prompt")
        pos += prompt_len
        stops = []
        for _ in range(n_stop):
            if pos + 2 > len(p):
                raise FrontendProtocolError("GENERATE stop list runs past the payload")
            (n,) = _U16.unpack_from(p, pos)
            pos += 2
            if n == 0 or pos + n > len(p):
                raise FrontendProtocolError("GENERATE stop string empty or past the payload")
            stops.append(_text(p[pos : pos + n], "stop string"))
            pos += n
        if pos != len(p):
            raise FrontendProtocolError(f"GENERATE has {len(p) - pos} trailing bytes")
        return cls(
            request_id,
            prompt,
            stop=tuple(stops),
            messages=messages,
            logprobs=bool(flags & GenerateFlags.LOGPROBS),
            **fixed,
        )


def _parse_messages(raw: memoryview) -> tuple[tuple[str, str], ...]:
    """A CHAT prompt field: ``u8 role_len, role, u32 content_len, content`` repeated."""
    out = []
    pos = 0
    while pos < len(raw):  # each round consumes at least 5 bytes, or raises
        if pos + 1 > len(raw):
            raise FrontendProtocolError("GENERATE message runs past the prompt field")
        (n,) = _U8.unpack_from(raw, pos)
        if n == 0 or pos + 1 + n + 4 > len(raw):
            raise FrontendProtocolError("GENERATE message role empty or past the prompt field")
        role = _text(raw[pos + 1 : pos + 1 + n], "message role")
        pos += 1 + n
        (m,) = _U32.unpack_from(raw, pos)
        pos += 4
        if pos + m > len(raw):
            raise FrontendProtocolError("GENERATE message content runs past the prompt field")
        out.append((role, _text(raw[pos : pos + m], "message content")))
        pos += m
    if not out:
        raise FrontendProtocolError("a CHAT GENERATE carries no message")
    return tuple(out)


@dataclass(frozen=True)
class Cancel(_Frame):
    TYPE: ClassVar[FrameType] = FrameType.CANCEL


@dataclass(frozen=True)
class Token(_Frame):
    """One generated token and the text it completes (may be empty mid-character)."""

    TYPE: ClassVar[FrameType] = FrameType.TOKEN
    LAYOUT: ClassVar[_Layout] = _Layout(("token", I32), ("position", U32))
    TEXT: ClassVar[str | None] = "text"
    token: int
    position: int  # of the token in the session
    text: str


@dataclass(frozen=True)
class Logprobs(_Frame):
    """The log-probabilities of the next TOKEN of the same request (sent just before it):
    the chosen token, then ``u8 n_top`` alternatives, most probable first. Each entry is
    ``i32 token, f32 logprob, u16 len`` and the token's ``len`` bytes (a token's bytes need
    not be UTF-8 on their own)."""

    TYPE: ClassVar[FrameType] = FrameType.LOGPROBS
    token: int
    logprob: float
    token_bytes: bytes
    top: tuple[tuple[int, float, bytes], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.top) > MAX_TOP_LOGPROBS:
            raise LocalProtocolError(
                f"at most {MAX_TOP_LOGPROBS} alternatives, got {len(self.top)}"
            )
        # Stored as they travel (f32), so that a frame equals its decoded copy.
        chosen, *top = (
            (I32.check("token", t), F32.check("logprob", lp), bytes(raw))
            for t, lp, raw in ((self.token, self.logprob, self.token_bytes), *self.top)
        )
        if any(len(raw) > 0xFFFF for _, _, raw in (chosen, *top)):
            raise LocalProtocolError("a token of more than 65535 bytes")
        object.__setattr__(self, "token", chosen[0])
        object.__setattr__(self, "logprob", chosen[1])
        object.__setattr__(self, "top", tuple(top))

    def payload(self) -> bytes:
        parts = [
            _ALTERNATIVE.pack(self.token, self.logprob, len(self.token_bytes)),
            self.token_bytes,
            _U8.pack(len(self.top)),
        ]
        for token, logprob, raw in self.top:
            parts += [_ALTERNATIVE.pack(token, logprob, len(raw)), raw]
        return b"".join(parts)

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> Self:
        (token, logprob, raw), pos = _logprob_entry(p, 0)
        if pos + 1 > len(p):
            raise FrontendProtocolError("LOGPROBS ends before its alternative count")
        (n_top,) = _U8.unpack_from(p, pos)
        pos += 1
        if n_top > MAX_TOP_LOGPROBS:
            raise FrontendProtocolError(
                f"LOGPROBS lists {n_top} alternatives (max {MAX_TOP_LOGPROBS})"
            )
        top = []
        for _ in range(n_top):
            entry, pos = _logprob_entry(p, pos)
            top.append(entry)
        if pos != len(p):
            raise FrontendProtocolError(f"LOGPROBS has {len(p) - pos} trailing bytes")
        return cls(request_id, token, logprob, raw, tuple(top))


def _logprob_entry(p: memoryview, pos: int) -> tuple[tuple[int, float, bytes], int]:
    """One ``i32 token, f32 logprob, u16 len, bytes`` entry at ``pos``, and the next pos."""
    if pos + _ALTERNATIVE.size > len(p):
        raise FrontendProtocolError("LOGPROBS entry runs past the payload")
    token, logprob, n = _ALTERNATIVE.unpack_from(p, pos)
    pos += _ALTERNATIVE.size
    if pos + n > len(p):
        raise FrontendProtocolError("LOGPROBS token bytes run past the payload")
    return (token, logprob, bytes(p[pos : pos + n])), pos + n


@dataclass(frozen=True)
class Done(_Frame):
    TYPE: ClassVar[FrameType] = FrameType.DONE
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("reason", Enum("B", DoneReason)),
        ("prompt_tokens", U32),
        ("generated_tokens", U32),
        ("seconds", F32),
    )
    reason: DoneReason
    prompt_tokens: int
    generated_tokens: int
    seconds: float


@dataclass(frozen=True)
class Error(_Frame):
    TYPE: ClassVar[FrameType] = FrameType.ERROR
    LAYOUT: ClassVar[_Layout] = _Layout(("code", U32))
    TEXT: ClassVar[str | None] = "message"
    code: int  # an ErrorCode; a code this side does not know still decodes
    message: str


@dataclass(frozen=True)
class StatusReq(_Frame):
    TYPE: ClassVar[FrameType] = FrameType.STATUS_REQ


@dataclass(frozen=True)
class RankStatus:
    """One rank of the pair or world in STATUS: its share of the model, whether it is in the
    formed world, the mean time the leader waited for its partial at a gate beyond its own
    (microseconds over the gates since the world formed; 0 for the leader itself): the rank
    that gates everyone shows the largest; and the CPU threads it computes on (a worker's as
    its hello stated them; 0: not reported, the plain pair's worker or a rank out of the
    world)."""

    rank: int
    share: int
    connected: bool
    gate_wait_us: int
    threads: int = 0

    def __post_init__(self) -> None:
        U8.check("rank", self.rank)
        U16.check("share", self.share)
        U32.check("gate_wait_us", self.gate_wait_us)
        U16.check("threads", self.threads)


# rank u8, connected u8, share u16, gate_wait_us u32, threads u16, reserved u16 (0)
_RANK = struct.Struct("<BBHIHH")


@dataclass(frozen=True)
class Status(_Frame):
    """The pair (or world) as the leader sees it; then ``ranks``, one entry per rank (a count
    u8 and 12 bytes each), rank 0 first."""

    TYPE: ClassVar[FrameType] = FrameType.STATUS
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("worker_connected", BOOL),
        ("shared_memory", BOOL),
        ("active_sessions", U32),
        ("tokens_generated", U64),
        ("n_layer", U32),
        ("n_embd", U32),
        ("n_vocab", U32),
        ("ctx_size", U32),
        ("model_bytes", U64),
        ("model_id", U32),
        ("spec_acceptance", F32),
        ("requests_served", U64),
        ("threads", U32),
    )
    worker_connected: bool
    shared_memory: bool
    active_sessions: int
    tokens_generated: int
    n_layer: int
    n_embd: int
    n_vocab: int
    ctx_size: int
    model_bytes: int
    model_id: int
    spec_acceptance: float
    requests_served: int
    threads: int  # CPU threads the leader computes on (--threads)
    ranks: tuple[RankStatus, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if len(self.ranks) > 255 or not all(isinstance(r, RankStatus) for r in self.ranks):
            raise LocalProtocolError("Status.ranks holds at most 255 RankStatus entries")

    def payload(self) -> bytes:
        tail = [_U8.pack(len(self.ranks))] + [
            _RANK.pack(r.rank, r.connected, r.share, r.gate_wait_us, r.threads, 0)
            for r in self.ranks
        ]
        return self.LAYOUT.pack_obj(self) + b"".join(tail)

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> Self:
        size = cls.LAYOUT.size
        if len(p) < size + 1 or len(p) != size + 1 + _RANK.size * p[size]:
            raise FrontendProtocolError(
                f"STATUS payload must be {size} + 1 + {_RANK.size} x its rank count bytes, got "
                f"{len(p)}"
            )
        ranks = []
        for rank, connected, share, wait, threads, reserved in _RANK.iter_unpack(p[size + 1 :]):
            if connected > 1:
                raise FrontendProtocolError(f"STATUS rank {rank}: connected must be 0 or 1")
            if reserved:
                raise FrontendProtocolError(f"STATUS rank {rank}: reserved is {reserved}, not 0")
            ranks.append(RankStatus(rank, share, bool(connected), wait, threads))
        return cls(request_id, **cls.LAYOUT.unpack(p), ranks=tuple(ranks))


Frame = Generate | Cancel | Token | Logprobs | Done | Error | StatusReq | Status

_PARSERS: dict[FrameType, Callable[[int, memoryview], Frame]] = {
    FrameType.GENERATE: Generate.parse,
    FrameType.CANCEL: Cancel.parse,
    FrameType.TOKEN: Token.parse,
    FrameType.DONE: Done.parse,
    FrameType.ERROR: Error.parse,
    FrameType.STATUS_REQ: StatusReq.parse,
    FrameType.STATUS: Status.parse,
    FrameType.LOGPROBS: Logprobs.parse,
}
assert set(_PARSERS) == set(FrameType), "every frontend frame type needs a parser"


def encode(frame: Frame) -> bytes:
    payload = frame.payload()
    if len(payload) > MAX_PAYLOAD:
        raise LocalProtocolError(
            f"{frame.TYPE.name} payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}"
        )
    return HEADER.pack(MAGIC, frame.TYPE, frame.request_id, len(payload)) + payload


class FrontendDecoder(FrameDecoder[Frame]):
    """Bytes in (``feed``), whole frames out (``next_event``; None means "need more");
    ``foundry.wire.framing`` does the buffering."""

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        super().__init__()
        self.max_payload = max_payload
        self._header: tuple[FrameType, int] = (FrameType.CANCEL, 0)

    def _header_size(self) -> int:
        return HEADER_SIZE

    def _begin(self, header: bytes) -> int:
        magic, ftype, request_id, length = HEADER.unpack(header)
        if magic != MAGIC:
            raise FrontendProtocolError(f"bad magic 0x{magic:08x}, expected 0x{MAGIC:08x} (FDFE)")
        try:
            kind = FrameType(ftype)
        except ValueError:
            raise FrontendProtocolError(f"unknown frame type 0x{ftype:02x}") from None
        if length > self.max_payload:
            raise FrontendProtocolError(
                f"{kind.name} declares {length} payload bytes, the limit is {self.max_payload}"
            )
        self._header = (kind, request_id)
        return int(length)

    def _finish(self, payload: memoryview) -> Frame:
        kind, request_id = self._header
        try:
            return _PARSERS[kind](request_id, payload)
        except LocalProtocolError as exc:  # a field value the dataclass refuses
            raise FrontendProtocolError(f"{kind.name}: {exc}") from None

    def _eof_error(self, message: str) -> FrontendProtocolError:
        return FrontendProtocolError(message)
