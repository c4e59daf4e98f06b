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
from foundry.wire.layout import BOOL, F32, I32, U16, U32, U64, Enum, Layout

MAGIC = 0x45464446  # b"FDFE" little-endian
HEADER = struct.Struct("<IBII")
HEADER_SIZE = HEADER.size  # 13
# A prompt is at most a context of byte tokens (a few KiB at our sizes); 1 MiB leaves room
# for long stop lists while keeping one bad header from reserving much memory.
MAX_PAYLOAD = 1 << 20
MAX_STOP_STRINGS = 16


class FrameType(enum.IntEnum):
    GENERATE = 0x01
    CANCEL = 0x02
    TOKEN = 0x03
    DONE = 0x04
    ERROR = 0x05
    STATUS_REQ = 0x06
    STATUS = 0x07


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
    """The fixed part, then the prompt (``prompt_len`` bytes of UTF-8) and ``n_stop`` stop
    strings, each a u16 length and that many bytes of UTF-8."""

    TYPE: ClassVar[FrameType] = FrameType.GENERATE
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("max_tokens", U32), ("temperature", F32), ("top_p", F32), ("seed", U64),
    )
    _COUNTS: ClassVar[_Layout] = _Layout(("n_stop", U16), ("prompt_len", U32))
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.stop) > MAX_STOP_STRINGS:
            raise LocalProtocolError(
                f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        if any(not s for s in self.stop):
            raise LocalProtocolError("stop strings must not be empty")

    def payload(self) -> bytes:
        prompt = self.prompt.encode("utf-8")
        parts = [
            self.LAYOUT.pack_obj(self), self._COUNTS.pack((len(self.stop), len(prompt))), prompt,
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
        counts = cls._COUNTS.unpack(p, cls.LAYOUT.size)
        n_stop, prompt_len = counts["n_stop"], counts["prompt_len"]
        if n_stop > MAX_STOP_STRINGS:
            raise FrontendProtocolError(f"GENERATE lists {n_stop} stop strings (max 16)")
        if pos + prompt_len > len(p):
            raise FrontendProtocolError("GENERATE prompt runs past the payload")
        prompt = _text(p[pos : pos + prompt_len], "prompt")
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
        return cls(request_id, prompt, stop=tuple(stops), **fixed)


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
class Done(_Frame):
    TYPE: ClassVar[FrameType] = FrameType.DONE
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("reason", Enum("B", DoneReason)), ("prompt_tokens", U32), ("generated_tokens", U32),
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
class Status(_Frame):
    """The pair as the leader sees it."""

    TYPE: ClassVar[FrameType] = FrameType.STATUS
    LAYOUT: ClassVar[_Layout] = _Layout(
        ("worker_connected", BOOL), ("shared_memory", BOOL), ("active_sessions", U32),
        ("tokens_generated", U64), ("n_layer", U32), ("n_embd", U32), ("n_vocab", U32),
        ("ctx_size", U32), ("model_bytes", U64), ("model_id", U32), ("spec_acceptance", F32),
        ("requests_served", U64),
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


Frame = Generate | Cancel | Token | Done | Error | StatusReq | Status

_PARSERS: dict[FrameType, Callable[[int, memoryview], Frame]] = {
    FrameType.GENERATE: Generate.parse,
    FrameType.CANCEL: Cancel.parse,
    FrameType.TOKEN: Token.parse,
    FrameType.DONE: Done.parse,
    FrameType.ERROR: Error.parse,
    FrameType.STATUS_REQ: StatusReq.parse,
    FrameType.STATUS: Status.parse,
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
