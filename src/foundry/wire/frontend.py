"""The frontend link of the tensor-parallel leader, as a sans-IO codec.

The gateway (or any client) submits generations to the leader over one TCP connection and
receives tokens as they are produced. Requests are multiplexed by a client-chosen
``request_id``; the leader answers each GENERATE with TOKEN frames and exactly one DONE or
ERROR. CANCEL (same id) stops a generation at the next token boundary; its DONE says so.

Frame: a 13-byte header ``magic u32 = 0x45464446 ("FDFE" on the wire), type u8,
request_id u32, length u32`` and ``length`` payload bytes, all little-endian.
Layouts of every payload are in docs/protocol.md; each has one frozen dataclass here.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from foundry.wire.errors import LocalProtocolError, RemoteProtocolError
from foundry.wire.framing import FrameDecoder

MAGIC = 0x45464446  # b"FDFE" little-endian
HEADER = struct.Struct("<IBII")
HEADER_SIZE = HEADER.size  # 13
# A prompt is at most a context of byte tokens (a few KiB at our sizes); 1 MiB leaves room
# for long stop lists while keeping one bad header from reserving much memory.
MAX_PAYLOAD = 1 << 20
MAX_STOP_STRINGS = 16


class FrontendProtocolError(RemoteProtocolError):
    """Bad bytes on the frontend link (names the problem)."""


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


_GENERATE = struct.Struct("<IffQHI")  # max_tokens, temperature, top_p, seed, n_stop, prompt_len
_U16 = struct.Struct("<H")
_TOKEN = struct.Struct("<iI")  # token id, position of the token in the session
_DONE = struct.Struct("<BIIf")  # reason, prompt tokens, generated tokens, seconds
_ERROR = struct.Struct("<I")  # code, then UTF-8 message
_STATUS = struct.Struct("<BBIQIIIIQIfQ")


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FrontendProtocolError(f"{what} is not valid UTF-8: {exc}") from None


@dataclass(frozen=True)
class Generate:
    TYPE: ClassVar[FrameType] = FrameType.GENERATE
    request_id: int
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise LocalProtocolError(
                f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        if any(not s for s in self.stop):
            raise LocalProtocolError("stop strings must not be empty")

    def payload(self) -> bytes:
        prompt = self.prompt.encode("utf-8")
        parts = [
            _GENERATE.pack(
                self.max_tokens, self.temperature, self.top_p, self.seed, len(self.stop),
                len(prompt),
            ),
            prompt,
        ]
        for s in self.stop:
            raw = s.encode("utf-8")
            parts += [_U16.pack(len(raw)), raw]
        return b"".join(parts)

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> Generate:
        if len(p) < _GENERATE.size:
            raise FrontendProtocolError(f"GENERATE payload of {len(p)} bytes is too short")
        max_tokens, temperature, top_p, seed, n_stop, prompt_len = _GENERATE.unpack_from(p)
        pos = _GENERATE.size
        if n_stop > MAX_STOP_STRINGS:
            raise FrontendProtocolError(f"GENERATE lists {n_stop} stop strings (max 16)")
        if pos + prompt_len > len(p):
            raise FrontendProtocolError("GENERATE prompt runs past the payload")
        prompt = _text(bytes(p[pos : pos + prompt_len]), "prompt")
        pos += prompt_len
        stops = []
        for _ in range(n_stop):
            if pos + 2 > len(p):
                raise FrontendProtocolError("GENERATE stop list runs past the payload")
            (n,) = _U16.unpack_from(p, pos)
            pos += 2
            if n == 0 or pos + n > len(p):
                raise FrontendProtocolError("GENERATE stop string empty or past the payload")
            stops.append(_text(bytes(p[pos : pos + n]), "stop string"))
            pos += n
        if pos != len(p):
            raise FrontendProtocolError(f"GENERATE has {len(p) - pos} trailing bytes")
        return cls(request_id, prompt, max_tokens, temperature, top_p, seed, tuple(stops))


@dataclass(frozen=True)
class Cancel:
    TYPE: ClassVar[FrameType] = FrameType.CANCEL
    request_id: int

    def payload(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> Cancel:
        _expect_len(p, 0, "CANCEL")
        return cls(request_id)


@dataclass(frozen=True)
class Token:
    """One generated token and the text it completes (may be empty mid-character)."""

    TYPE: ClassVar[FrameType] = FrameType.TOKEN
    request_id: int
    token: int
    position: int
    text: str

    def payload(self) -> bytes:
        return _TOKEN.pack(self.token, self.position) + self.text.encode("utf-8")

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> Token:
        if len(p) < _TOKEN.size:
            raise FrontendProtocolError(f"TOKEN payload of {len(p)} bytes is too short")
        token, position = _TOKEN.unpack_from(p)
        return cls(request_id, token, position, _text(bytes(p[_TOKEN.size :]), "token text"))


@dataclass(frozen=True)
class Done:
    TYPE: ClassVar[FrameType] = FrameType.DONE
    request_id: int
    reason: DoneReason
    prompt_tokens: int
    generated_tokens: int
    seconds: float

    def payload(self) -> bytes:
        return _DONE.pack(self.reason, self.prompt_tokens, self.generated_tokens, self.seconds)

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> Done:
        _expect_len(p, _DONE.size, "DONE")
        reason, prompt_tokens, generated, seconds = _DONE.unpack_from(p)
        try:
            why = DoneReason(reason)
        except ValueError:
            raise FrontendProtocolError(f"DONE reason {reason} is unknown") from None
        return cls(request_id, why, prompt_tokens, generated, seconds)


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[FrameType] = FrameType.ERROR
    request_id: int
    code: int
    message: str

    def payload(self) -> bytes:
        return _ERROR.pack(self.code) + self.message.encode("utf-8")

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> Error:
        if len(p) < _ERROR.size:
            raise FrontendProtocolError(f"ERROR payload of {len(p)} bytes is too short")
        (code,) = _ERROR.unpack_from(p)
        return cls(request_id, code, _text(bytes(p[_ERROR.size :]), "error message"))


@dataclass(frozen=True)
class StatusReq:
    TYPE: ClassVar[FrameType] = FrameType.STATUS_REQ
    request_id: int

    def payload(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> StatusReq:
        _expect_len(p, 0, "STATUS_REQ")
        return cls(request_id)


@dataclass(frozen=True)
class Status:
    """The pair as the leader sees it."""

    TYPE: ClassVar[FrameType] = FrameType.STATUS
    request_id: int
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

    def payload(self) -> bytes:
        return _STATUS.pack(
            self.worker_connected, self.shared_memory, self.active_sessions,
            self.tokens_generated, self.n_layer, self.n_embd, self.n_vocab, self.ctx_size,
            self.model_bytes, self.model_id, self.spec_acceptance, self.requests_served,
        )

    @classmethod
    def parse(cls, request_id: int, p: memoryview) -> Status:
        _expect_len(p, _STATUS.size, "STATUS")
        f = _STATUS.unpack_from(p)
        return cls(request_id, bool(f[0]), bool(f[1]), *f[2:])


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


def _expect_len(p: memoryview, n: int, what: str) -> None:
    if len(p) != n:
        raise FrontendProtocolError(f"{what} payload must be {n} bytes, got {len(p)}")


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
