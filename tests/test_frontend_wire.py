"""The leader's frontend link codec: golden bytes, round trips, incremental decoding."""

from __future__ import annotations

import struct

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
    Status(0, True, False, 3, 1000, 2, 64, 259, 256, 123456, 0xDEADBEEF, 0.5, 9),
]


def test_header_is_13_bytes_little_endian() -> None:
    assert HEADER_SIZE == 13
    assert encode(Cancel(0x01020304)) == bytes.fromhex("46444645" "02" "04030201" "00000000")


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
    assert got == bytes.fromhex("46444645" "01" "01000000") + struct.pack("<I", 37) + payload
    assert len(payload) == 37


def test_chat_generate_golden_bytes() -> None:
    got = encode(Generate(2, "", 16, top_k=40, logprobs=True, top_logprobs=2,
                          messages=(("user", "hi"), ("assistant", "yo"))))
    messages = (
        bytes.fromhex("04") + b"user" + bytes.fromhex("02000000") + b"hi"
        + bytes.fromhex("09") + b"assistant" + bytes.fromhex("02000000") + b"yo"
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
    assert got == bytes.fromhex("46444645" "01" "02000000" "3b000000") + payload


def test_logprobs_golden_bytes() -> None:
    got = encode(Logprobs(5, 104, -0.5, b"h", ((104, -0.5, b"h"), (7, -2.0, b""))))
    payload = (
        bytes.fromhex("68000000" "000000bf" "0100") + b"h"  # token 104, -0.5f, 1 byte
        + bytes.fromhex("02")  # two alternatives
        + bytes.fromhex("68000000" "000000bf" "0100") + b"h"
        + bytes.fromhex("07000000" "000000c0" "0000")  # token 7, -2.0f, no bytes
    )
    assert len(payload) == 33
    assert got == bytes.fromhex("46444645" "08" "05000000" "21000000") + payload


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (bytes(26) + bytes.fromhex("0000" "00000000"), None),  # the smallest valid GENERATE
        (bytes(24) + bytes.fromhex("04" "00" "0000" "00000000"), "unknown bits"),
        (bytes(24) + bytes.fromhex("02" "00" "0000" "00000000"), "no message"),
        (bytes(24) + bytes.fromhex("02" "00" "0000" "05000000" "00" "00000000"), "role"),
        (bytes(24) + bytes.fromhex("02" "00" "0000" "06000000" "01") + b"u"
         + bytes.fromhex("09000000"), "content"),
        (bytes(24) + bytes.fromhex("00" "15" "0000" "00000000"), "top_logprobs"),
    ],
)
def test_generate_flags_and_messages_are_checked(payload: bytes, words: str | None) -> None:
    dec = FrontendDecoder()
    dec.feed(bytes.fromhex("46444645" "01" "01000000") + struct.pack("<I", len(payload))
             + payload)
    if words is None:
        assert dec.next_event() == Generate(1, "", 0, top_p=0.0)
        return
    with pytest.raises(FrontendProtocolError, match=words):
        dec.next_event()


def test_logprobs_payload_is_checked() -> None:
    for payload, words in [
        (bytes.fromhex("68000000" "000000bf" "0500") + b"h", "bytes run past"),
        (bytes.fromhex("68000000" "000000bf" "0000"), "count"),
        (bytes.fromhex("68000000" "000000bf" "0000" "15"), "alternatives"),
        (bytes.fromhex("68000000" "000000bf" "0000" "01"), "entry"),
        (bytes.fromhex("68000000" "000000bf" "0000" "00" "00"), "trailing"),
    ]:
        dec = FrontendDecoder()
        dec.feed(bytes.fromhex("46444645" "08" "01000000") + struct.pack("<I", len(payload))
                 + payload)
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
    (Status(10, True, False, 3, 1000, 2, 64, 259, 256, 123456, 0xDEADBEEF, 0.5, 9),
     "46444645 07 0a000000 36000000"  # 54 bytes
     " 01 00"  # worker_connected, shared_memory
     " 03000000"  # active_sessions
     " e803000000000000"  # tokens_generated u64
     " 02000000 40000000 03010000 00010000"  # n_layer, n_embd, n_vocab, ctx_size
     " 40e2010000000000"  # model_bytes u64
     " efbeadde"  # model_id
     " 0000003f"  # spec_acceptance f32 0.5
     " 0900000000000000"),  # requests_served u64
    (Logprobs(5, 104, -0.5, b"h", ((104, -0.5, b"h"), (7, -2.0, b""))),
     "46444645 08 05000000 21000000"  # 33 bytes
     " 68000000 000000bf 0100 68"  # the chosen token: i32 104, f32 -0.5, u16 1, "h"
     " 02"  # two alternatives
     " 68000000 000000bf 0100 68"
     " 07000000 000000c0 0000"),  # token 7, -2.0, no bytes
]  # fmt: skip


@pytest.mark.parametrize(("frame", "golden"), GOLDEN,
                         ids=[f"{f.TYPE.name}-{i}" for i, (f, _) in enumerate(GOLDEN)])
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
        (bytes.fromhex("46444645" "7f") + bytes(8), "unknown frame type"),
        (bytes.fromhex("46444645" "01" "00000000" "ffffffff"), "limit"),
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
