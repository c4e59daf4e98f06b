"""The leader's frontend link codec: golden bytes, round trips, incremental decoding."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry.wire.errors import LocalProtocolError
from foundry.wire.frontend import (
    HEADER_SIZE,
    MAX_PAYLOAD,
    Cancel,
    Done,
    DoneReason,
    Error,
    Frame,
    FrontendDecoder,
    FrontendProtocolError,
    Generate,
    Logprobs,
    RankStatus,
    Status,
    StatusReq,
    Token,
    encode,
)

FRAMES: list[Frame] = [
    Generate(7, "héllo", 32, 0.75, 0.875, 42, ("\n\n", "END")),  # f32-exact
    Generate(1, "", 1),
    Generate(3, "", 4, 0.5, 0.25, 1, top_k=40, logprobs=True, top_logprobs=20),
    Generate(4, "", 9, messages=(("system", "Be brief."), ("user", "héllo"), ("assistant", ""))),
    Logprobs(7, 104, -0.25, b"h", ((104, -0.25, b"h"), (200, -1.5, b"\xc3"))),
    Logprobs(7, 3, float("-inf"), b""),
    Cancel(7),
    Token(7, 104, 12, "h"),
    Token(7, 200, 13, ""),
    Done(7, DoneReason.STOP_STRING, 5, 17, 0.5),
    Error(9, 2, "worker rank is re-syncing; retry"),
    StatusReq(0),
    Status(0, True, False, 3, 1000, 2, 64, 259, 256, 123456, 0xDEADBEEF, 0.5, 9, 4),
]


def test_header_is_13_bytes_little_endian() -> None:
    assert HEADER_SIZE == 13
    assert encode(Cancel(0x01020304)) == bytes.fromhex("46444645020403020100000000")


def test_generate_golden_bytes() -> None:
    got = encode(Generate(1, "hi", 8, 0.5, 1.0, 3, ("x",)))
    payload = (
        struct.pack("<I", 8)
        + bytes.fromhex("0000003f")  # 0.5f
        + bytes.fromhex("0000803f")  # 1.0f
        + bytes.fromhex("0300000000000000")
        + bytes.fromhex("00000000")  # top_k 0: every token
        + bytes.fromhex("00")  # flags: no logprobs, a text prompt
        + bytes.fromhex("00")  # top_logprobs
        + bytes.fromhex("0100")  # one stop string
        + bytes.fromhex("02000000")  # prompt length
        + b"hi"
        + bytes.fromhex("0100")
        + b"x"
    )
    assert got == bytes.fromhex("464446450101000000") + struct.pack("<I", 37) + payload
    assert len(payload) == 37


def test_chat_generate_golden_bytes() -> None:
    got = encode(
        Generate(
            2,
            "",
            16,
            top_k=40,
            logprobs=True,
            top_logprobs=2,
            messages=(("user", "hi"), ("assistant", "yo")),
        )
    )
    messages = (
        bytes.fromhex("04")
        + b"user"
        + bytes.fromhex("02000000")
        + b"hi"
        + bytes.fromhex("09")
        + b"assistant"
        + bytes.fromhex("02000000")
        + b"yo"
    )
    payload = (
        bytes.fromhex("10000000")  # max_tokens 16
        + bytes.fromhex("00000000")  # temperature 0.0f
        + bytes.fromhex("0000803f")  # top_p 1.0f
        + bytes.fromhex("0000000000000000")  # seed
        + bytes.fromhex("28000000")  # top_k 40
        + bytes.fromhex("03")  # flags: LOGPROBS | CHAT
        + bytes.fromhex("02")  # top_logprobs 2
        + bytes.fromhex("0000")  # no stop string
        + bytes.fromhex("1b000000")  # the messages take 27 bytes
        + messages
    )
    assert len(messages) == 27 and len(payload) == 59
    assert got == bytes.fromhex("4644464501020000003b000000") + payload


def test_logprobs_golden_bytes() -> None:
    got = encode(Logprobs(5, 104, -0.5, b"h", ((104, -0.5, b"h"), (7, -2.0, b""))))
    payload = (
        bytes.fromhex("68000000000000bf0100")
        + b"h"  # token 104, -0.5f, 1 byte
        + bytes.fromhex("02")  # two alternatives
        + bytes.fromhex("68000000000000bf0100")
        + b"h"
        + bytes.fromhex("07000000000000c00000")  # token 7, -2.0f, no bytes
    )
    assert len(payload) == 33
    assert got == bytes.fromhex("46444645080500000021000000") + payload


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (bytes(26) + bytes.fromhex("000000000000"), None),  # the smallest valid GENERATE
        (bytes(24) + bytes.fromhex("0400000000000000"), "unknown bits"),
        (bytes(24) + bytes.fromhex("0200000000000000"), "no message"),
        (bytes(24) + bytes.fromhex("02000000050000000000000000"), "role"),
        (
            bytes(24) + bytes.fromhex("020000000600000001") + b"u" + bytes.fromhex("09000000"),
            "content",
        ),
        (bytes(24) + bytes.fromhex("0015000000000000"), "top_logprobs"),
    ],
)
def test_generate_flags_and_messages_are_checked(payload: bytes, words: str | None) -> None:
    dec = FrontendDecoder()
    dec.feed(bytes.fromhex("464446450101000000") + struct.pack("<I", len(payload)) + payload)
    if words is None:
        assert dec.next_event() == Generate(1, "", 0, top_p=0.0)
        return
    with pytest.raises(FrontendProtocolError, match=words):
        dec.next_event()


def test_logprobs_payload_is_checked() -> None:
    for payload, words in [
        (bytes.fromhex("68000000000000bf0500") + b"h", "bytes run past"),
        (bytes.fromhex("68000000000000bf0000"), "count"),
        (bytes.fromhex("68000000000000bf000015"), "alternatives"),
        (bytes.fromhex("68000000000000bf000001"), "entry"),
        (bytes.fromhex("68000000000000bf00000000"), "trailing"),
    ]:
        dec = FrontendDecoder()
        dec.feed(bytes.fromhex("464446450801000000") + struct.pack("<I", len(payload)) + payload)
        with pytest.raises(FrontendProtocolError, match=words):
            dec.next_event()


# Every frame but GENERATE (above), byte for byte as docs/protocol.md lays it out: header
# "FDFE", type u8, request_id u32, length u32, then the payload. Distinct values in every field,
# so two fields swapped on either side change the bytes.
GOLDEN: list[tuple[Frame, str]] = [
    (Cancel(7), "46444645 02 07000000 00000000"),
    (Token(7, -2, 12, "é"),
     "46444645 03 07000000 0a000000" " feffffff 0c000000 c3a9"),  # i32 token, u32 position, text
    (Token(8, 104, 13, ""), "46444645 03 08000000 08000000" " 68000000 0d000000"),
    (Done(7, DoneReason.STOP_STRING, 5, 17, 0.5),  # u8 reason, u32 prompt, u32 generated, f32 s
     "46444645 04 07000000 0d000000" " 02 05000000 11000000 0000003f"),
    (Done(3, DoneReason.CONTEXT_FULL, 300, 2, 1.0),
     "46444645 04 03000000 0d000000" " 04 2c010000 02000000 0000803f"),
    (Error(9, 2, "retry"), "46444645 05 09000000 09000000" " 02000000 7265747279"),
    (StatusReq(0x0102), "46444645 06 02010000 00000000"),
    (Status(10, True, False, 3, 1000, 2, 64, 259, 256, 123456, 0xDEADBEEF, 0.5, 9, 16,
            (RankStatus(0, 2, True, 0, 16), RankStatus(1, 1, True, 1234, 3))),
     "46444645 07 0a000000 53000000"  # 58 + 1 + 2 x 12 = 83 bytes
     " 01 00"  # worker_connected, shared_memory
     " 03000000"  # active_sessions
     " e803000000000000"  # tokens_generated u64
     " 02000000 40000000 03010000 00010000"  # n_layer, n_embd, n_vocab, ctx_size
     " 40e2010000000000"  # model_bytes u64
     " efbeadde"  # model_id
     " 0000003f"  # spec_acceptance f32 0.5
     " 0900000000000000"  # requests_served u64
     " 10000000"  # threads
     " 02"  # two ranks: rank u8, connected u8, share u16, gate_wait_us u32, threads u16,
     # reserved u16
     " 00 01 0200 00000000 1000 0000"
     " 01 01 0100 d2040000 0300 0000"),
    (Logprobs(5, 104, -0.5, b"h", ((104, -0.5, b"h"), (7, -2.0, b""))),
     "46444645 08 05000000 21000000"  # 33 bytes
     " 68000000 000000bf 0100 68"  # the chosen token: i32 104, f32 -0.5, u16 1, "h"
     " 02"  # two alternatives
     " 68000000 000000bf 0100 68"
     " 07000000 000000c0 0000"),  # token 7, -2.0, no bytes
]  # fmt: skip


@pytest.mark.parametrize(
    ("frame", "golden"), GOLDEN, ids=[f"{f.TYPE.name}-{i}" for i, (f, _) in enumerate(GOLDEN)]
)
def test_frame_golden_bytes(frame: Frame, golden: str) -> None:
    raw = bytes.fromhex(golden)
    assert encode(frame) == raw
    dec = FrontendDecoder()
    dec.feed(raw)
    assert dec.next_event() == frame
    assert dec.next_event() is None


def test_every_frame_type_has_golden_bytes() -> None:
    assert {f.TYPE for f, _ in GOLDEN} | {Generate.TYPE} == set(type(f).TYPE for f in FRAMES)


def _token_of_payload(size: int) -> Token:
    return Token(1, 5, 6, "x" * (size - 8))  # 8 bytes of fixed part, then the text


def test_payload_limit_and_limit_plus_one() -> None:
    # Encoding: a payload of exactly MAX_PAYLOAD goes out, one byte more is our error.
    at_limit = encode(_token_of_payload(MAX_PAYLOAD))
    assert len(at_limit) == HEADER_SIZE + MAX_PAYLOAD
    with pytest.raises(LocalProtocolError, match=f"exceeds {MAX_PAYLOAD}"):
        encode(_token_of_payload(MAX_PAYLOAD + 1))
    # Decoding, default limit: a header announcing MAX_PAYLOAD waits for it and decodes it ...
    dec = FrontendDecoder()
    dec.feed(at_limit[:HEADER_SIZE])
    assert dec.next_event() is None
    dec.feed(at_limit[HEADER_SIZE:])
    assert dec.next_event() == _token_of_payload(MAX_PAYLOAD)
    # ... one announcing MAX_PAYLOAD + 1 is refused from the header alone.
    dec = FrontendDecoder()
    dec.feed(bytes.fromhex("46444645 03 01000000") + struct.pack("<I", MAX_PAYLOAD + 1))
    with pytest.raises(FrontendProtocolError, match=f"{MAX_PAYLOAD + 1} payload bytes"):
        dec.next_event()
    # A decoder's own limit, the same way.
    for limit in (8, 64):
        dec = FrontendDecoder(max_payload=limit)
        dec.feed(encode(_token_of_payload(limit)))
        assert dec.next_event() == _token_of_payload(limit)
        dec.feed(encode(_token_of_payload(limit + 1)))
        with pytest.raises(FrontendProtocolError, match=f"the limit is {limit}$"):
            dec.next_event()


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_round_trip_whole_and_byte_by_byte(frame: Frame) -> None:
    data = encode(frame)
    dec = FrontendDecoder()
    dec.feed(data + encode(Cancel(99))[:5])  # trailing partial frame stays buffered
    assert dec.next_event() == frame
    assert dec.next_event() is None
    assert dec.buffered == 5
    one = FrontendDecoder()
    got = []
    for b in data:
        one.feed(bytes([b]))
        f = one.next_event()
        if f is not None:
            got.append(f)
    assert got == [frame]


def test_bad_magic_type_and_length_fail_after_the_header() -> None:
    for header, words in [
        (b"XXXX" + bytes(9), "magic"),
        (bytes.fromhex("464446457f") + bytes(8), "unknown frame type"),
        (bytes.fromhex("464446450100000000ffffffff"), "limit"),
    ]:
        dec = FrontendDecoder()
        dec.feed(header)
        with pytest.raises(FrontendProtocolError, match=words):
            dec.next_event()
        with pytest.raises(FrontendProtocolError):
            dec.feed(b"more")  # terminal after an error


def test_malformed_payloads_are_protocol_errors() -> None:
    bad = encode(Generate(1, "hi", 8))[:-1]
    bad = bad[:9] + struct.pack("<I", len(bad) - HEADER_SIZE) + bad[HEADER_SIZE:]
    dec = FrontendDecoder()
    dec.feed(bad)
    with pytest.raises(FrontendProtocolError, match="prompt"):
        dec.next_event()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_give_frames_or_a_protocol_error(data: bytes) -> None:
    dec = FrontendDecoder(max_payload=64)
    try:
        dec.feed(data)
        while dec.next_event() is not None:
            pass
    except FrontendProtocolError:
        return
    assert dec.buffered <= HEADER_SIZE + 64


# -- every check at its bound and one past it, with its exact error (records built inside the
# tests: one built at import is checked before a mutation test run chooses its mutant)


def _generate_payload(
    prompt: bytes = b"",
    stops: bytes = b"",
    n_stop: int = 0,
    flags: int = 0,
    top_logprobs: int = 0,
    prompt_len: int | None = None,
) -> bytes:
    """A GENERATE payload from docs/protocol.md's layout: max_tokens 9, temperature 0.5, top_p
    0.25, seed 3, top_k 0, flags, top_logprobs, n_stop, prompt_len, the prompt field, ``stops``."""
    return (
        struct.pack(
            "<IffQIBBHI",
            9,
            0.5,
            0.25,
            3,
            0,
            flags,
            top_logprobs,
            n_stop,
            len(prompt) if prompt_len is None else prompt_len,
        )
        + prompt
        + stops
    )


def _decode_one(ftype: int, payload: bytes) -> Frame | None:
    dec = FrontendDecoder()
    dec.feed(bytes.fromhex("46444645") + struct.pack("<BII", ftype, 5, len(payload)) + payload)
    return dec.next_event()


def _refused(ftype: int, payload: bytes) -> str:
    with pytest.raises(FrontendProtocolError) as info:
        _decode_one(ftype, payload)
    return str(info.value)


def _stop(raw: bytes) -> bytes:
    return struct.pack("<H", len(raw)) + raw


BAD_UTF8 = "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"
CHAT = 0x02
GENERATE_REFUSED: list[tuple[bytes, str]] = [
    (_generate_payload()[:31], "GENERATE payload of 31 bytes is too short"),
    (_generate_payload(flags=0x04), "GENERATE flags 0x04 set unknown bits"),
    (_generate_payload(flags=0x80), "GENERATE flags 0x80 set unknown bits"),
    (
        _generate_payload(n_stop=17, stops=_stop(b"x") * 17),
        "GENERATE lists 17 stop strings (max 16)",
    ),
    (_generate_payload(b"hi", prompt_len=3), "GENERATE prompt runs past the payload"),
    (_generate_payload(b"\xff"), f"prompt is not valid UTF-8: {BAD_UTF8}"),
    (_generate_payload(n_stop=1), "GENERATE stop list runs past the payload"),
    (_generate_payload(n_stop=1, stops=b"\x01"), "GENERATE stop list runs past the payload"),
    (
        _generate_payload(n_stop=1, stops=b"\x00\x00"),
        "GENERATE stop string empty or past the payload",
    ),
    (
        _generate_payload(n_stop=1, stops=b"\x02\x00x"),
        "GENERATE stop string empty or past the payload",
    ),
    (_generate_payload(n_stop=2, stops=_stop(b"x")), "GENERATE stop list runs past the payload"),
    (
        _generate_payload(n_stop=1, stops=_stop(b"\xff")),
        f"stop string is not valid UTF-8: {BAD_UTF8}",
    ),
    (_generate_payload(n_stop=1, stops=_stop(b"x") + b"\x00"), "GENERATE has 1 trailing bytes"),
    (_generate_payload(b"hi") + b"abc", "GENERATE has 3 trailing bytes"),
    (_generate_payload(top_logprobs=21), "GENERATE: top_logprobs must be in [0, 20], got 21"),
    (_generate_payload(flags=CHAT), "a CHAT GENERATE carries no message"),
    (
        _generate_payload(b"\x00\x00\x00\x00\x00", flags=CHAT),
        "GENERATE message role empty or past the prompt field",
    ),
    (
        _generate_payload(b"\x02u\x00\x00\x00\x00", flags=CHAT),
        "GENERATE message role empty or past the prompt field",
    ),
    (
        _generate_payload(b"\x01u\x00\x00\x00", flags=CHAT),
        "GENERATE message role empty or past the prompt field",
    ),
    (
        _generate_payload(b"\x01u\x01\x00\x00\x00", flags=CHAT),
        "GENERATE message content runs past the prompt field",
    ),
    (
        _generate_payload(b"\x01u\x00\x00\x00\x00\x01", flags=CHAT),
        "GENERATE message role empty or past the prompt field",
    ),
    (
        _generate_payload(b"\x01\xff\x00\x00\x00\x00", flags=CHAT),
        f"message role is not valid UTF-8: {BAD_UTF8}",
    ),
    (
        _generate_payload(b"\x01u\x01\x00\x00\x00\xff", flags=CHAT),
        f"message content is not valid UTF-8: {BAD_UTF8}",
    ),
]


@pytest.mark.parametrize(
    ("payload", "message"), GENERATE_REFUSED, ids=[m[:40] for _, m in GENERATE_REFUSED]
)
def test_generate_malformed_fields_exact(payload: bytes, message: str) -> None:
    assert _refused(0x01, payload) == message


def test_generate_fields_at_their_limits_decode() -> None:
    sixteen = (*(f"s{i}" for i in range(15)), "x")  # the last one byte, ending the payload
    stops = b"".join(_stop(s.encode()) for s in sixteen)
    got = _decode_one(0x01, _generate_payload(b"hi", stops, n_stop=16, flags=0x01, top_logprobs=20))
    assert got == Generate(5, "hi", 9, 0.5, 0.25, 3, sixteen, logprobs=True, top_logprobs=20)
    # the prompt field exactly to the payload's end; a message with empty content ending it
    got = _decode_one(0x01, _generate_payload(b"\x01u\x00\x00\x00\x00", flags=CHAT))
    assert got == Generate(5, "", 9, 0.5, 0.25, 3, messages=(("u", ""),))
    assert got.flags == CHAT and got.logprobs is False
    role = "r" * 255
    chat = Generate(5, "", 9, 0.5, 0.25, 3, messages=((role, "é"), ("u", "x")))
    assert _decode_one(0x01, chat.payload()) == chat
    assert chat.payload()[32:33] == b"\xff"


def test_generate_is_checked_when_built() -> None:
    def refused(message: str, *args: Any, **kwargs: Any) -> None:
        with pytest.raises(LocalProtocolError) as info:
            Generate(*args, **kwargs)
        assert str(info.value) == message

    assert Generate(1, "p", 1, stop=("x",) * 16).stop == ("x",) * 16
    refused("at most 16 stop strings, got 17", 1, "p", 1, stop=("x",) * 17)
    refused("stop strings must not be empty", 1, "p", 1, stop=("x", ""))
    for n in (0, 20):
        assert Generate(1, "p", 1, top_logprobs=n).top_logprobs == n
    refused("top_logprobs must be in [0, 20], got 21", 1, "p", 1, top_logprobs=21)
    refused("top_logprobs -1 is outside 0..255", 1, "p", 1, top_logprobs=-1)  # the u8 first
    refused(
        "a GENERATE carries a prompt or messages, not both", 1, "p", 1, messages=(("user", "x"),)
    )
    refused("a message role must be 1..255 bytes, got ''", 1, "", 1, messages=(("", "x"),))
    refused(
        f"a message role must be 1..255 bytes, got {'é' * 128!r}",
        1,
        "",
        1,
        messages=(("é" * 128, "x"),),
    )  # 256 bytes of UTF-8
    for rid in (0, 0xFFFF_FFFF):
        assert Cancel(rid).request_id == rid
    for rid in (-1, 1 << 32):
        with pytest.raises(LocalProtocolError) as info:
            Cancel(rid)
        assert str(info.value) == f"request_id {rid} is outside 0..4294967295"


def test_logprobs_limits_exact() -> None:
    top = tuple((i, -1.0, b"") for i in range(20))
    frame = Logprobs(1, 2, 0.1, b"x" * 0xFFFF, top)
    assert frame.logprob == 0.1 and len(frame.top) == 20
    assert _decode_one(0x08, frame.payload()) == dataclasses.replace(frame, request_id=5)
    with pytest.raises(LocalProtocolError) as info:
        Logprobs(1, 2, 0.1, b"", ((1, -1.0, b""),) * 21)
    assert str(info.value) == "at most 20 alternatives, got 21"
    for chosen, alternative in ((b"x" * 0x10000, b""), (b"", b"x" * 0x10000)):
        with pytest.raises(LocalProtocolError) as info:
            Logprobs(1, 2, 0.1, chosen, ((1, -1.0, alternative),))
        assert str(info.value) == "a token of more than 65535 bytes"
    with pytest.raises(LocalProtocolError) as info:
        Logprobs(1, 1 << 31, 0.1, b"")
    assert str(info.value) == "token 2147483648 is outside -2147483648..2147483647"
    with pytest.raises(LocalProtocolError) as info:
        Logprobs(1, 1, 0.1, b"", ((-(1 << 31) - 1, 0.0, b""),))
    assert str(info.value) == "token -2147483649 is outside -2147483648..2147483647"
    entry = bytes.fromhex("68000000 000000bf 0000")
    for payload, message in [
        (entry[:9], "LOGPROBS entry runs past the payload"),
        (
            bytes.fromhex("68000000 000000bf 0200") + b"h",
            "LOGPROBS token bytes run past the payload",
        ),
        (entry, "LOGPROBS ends before its alternative count"),
        (entry + b"\x15" + entry * 21, "LOGPROBS lists 21 alternatives (max 20)"),
        (entry + b"\x02" + entry, "LOGPROBS entry runs past the payload"),
        (entry + b"\x00\x00\x00", "LOGPROBS has 2 trailing bytes"),
    ]:
        assert _refused(0x08, payload) == message
    assert _decode_one(0x08, entry + b"\x14" + entry * 20) == Logprobs(
        5, 0x68, -0.5, b"", ((0x68, -0.5, b""),) * 20
    )


def test_fixed_and_text_frames_exact() -> None:
    for ftype, payload, message in [
        (0x02, b"\x00", "CANCEL payload must be 0 bytes, got 1"),
        (0x06, b"\x00", "STATUS_REQ payload must be 0 bytes, got 1"),
        (0x04, bytes(12), "DONE payload must be 13 bytes, got 12"),
        (0x04, bytes(14), "DONE payload must be 13 bytes, got 14"),
        (0x07, bytes(57), "STATUS payload must be 58 + 1 + 12 x its rank count bytes, got 57"),
        (0x07, bytes(58), "STATUS payload must be 58 + 1 + 12 x its rank count bytes, got 58"),
        (
            0x07,
            bytes(59) + bytes(7),
            "STATUS payload must be 58 + 1 + 12 x its rank count bytes, got 66",
        ),
        (  # a rank entry of the old 8 bytes
            0x07,
            bytes(58) + b"\x01" + bytes.fromhex("00 01 0100 00000000"),
            "STATUS payload must be 58 + 1 + 12 x its rank count bytes, got 67",
        ),
        (
            0x07,
            bytes(58) + b"\x01" + bytes.fromhex("00 02 0100 00000000 0100 0000"),
            "STATUS rank 0: connected must be 0 or 1",
        ),
        (
            0x07,
            bytes(58) + b"\x02" + bytes(12) + bytes.fromhex("01 01 0100 00000000 0100 0100"),
            "STATUS rank 1: reserved is 1, not 0",
        ),
        (0x03, bytes(7), "TOKEN payload of 7 bytes is too short"),
        (0x05, bytes(3), "ERROR payload of 3 bytes is too short"),
        (0x03, bytes(8) + b"\xff", f"TOKEN text is not valid UTF-8: {BAD_UTF8}"),
        (0x05, bytes(4) + b"\xff", f"ERROR message is not valid UTF-8: {BAD_UTF8}"),
        (
            0x04,
            b"\x05" + bytes(12),
            "DONE: reason 5 is not a DoneReason (0 MAX_TOKENS, 1 EOS, "
            "2 STOP_STRING, 3 CANCELLED, 4 CONTEXT_FULL)",
        ),
        (0x07, b"\x02" + bytes(58), "STATUS: worker_connected must be a bool (0 or 1), got 2"),
    ]:
        assert _refused(ftype, payload) == message
    assert _decode_one(0x03, bytes.fromhex("ffffffff 00000000")) == Token(5, -1, 0, "")
    assert _decode_one(0x05, bytes.fromhex("07000000")) == Error(5, 7, "")
    for header, message in [
        (b"XXXX" + bytes(9), "bad magic 0x58585858, expected 0x45464446 (FDFE)"),
        (bytes.fromhex("46444645 09") + bytes(8), "unknown frame type 0x09"),
        (
            bytes.fromhex("46444645 01 00000000 01001000"),
            "GENERATE declares 1048577 payload bytes, the limit is 1048576",
        ),
    ]:
        dec = FrontendDecoder()
        dec.feed(header)
        with pytest.raises(FrontendProtocolError) as info:
            dec.next_event()
        assert str(info.value) == message


def test_end_of_stream_in_mid_frame() -> None:
    dec = FrontendDecoder()
    dec.feed(encode(Cancel(1)) + encode(Cancel(2))[:4])
    with pytest.raises(FrontendProtocolError) as info:
        dec.feed_eof()
    assert str(info.value) == "connection closed in the middle of a frame (4 bytes of it received)"
    assert dec.next_event() == Cancel(1)  # what came whole before still comes out
    with pytest.raises(FrontendProtocolError, match=r"^decoder already failed and is closed: "):
        dec.next_event()


def test_fields_are_stored_in_their_normal_form() -> None:
    """A numpy integer becomes an int, alternatives a tuple of (int, f32 value, bytes)."""
    cancel = Cancel(np.uint32(7))  # type: ignore[arg-type]
    assert cancel.request_id == 7 and type(cancel.request_id) is int
    frame = Logprobs(
        1,
        np.int32(5),
        0.5,
        bytearray(b"h"),  # type: ignore[arg-type]
        [(np.int32(6), 1 / 3, bytearray(b"x"))],
    )  # type: ignore[arg-type]
    assert type(frame.token) is int and frame.token == 5
    assert frame.top == ((6, 0.33333334, b"x"),) and type(frame.top[0][0]) is int
    assert frame.token_bytes == b"h"
    with pytest.raises(LocalProtocolError) as info:
        Logprobs(1, 5, "x", b"")  # type: ignore[arg-type]
    assert str(info.value) == "logprob must be a number, got 'x'"
