"""The leader's frontend link codec: golden bytes, round trips, incremental decoding."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry.wire.frontend import (
    HEADER_SIZE,
    Cancel,
    Done,
    DoneReason,
    Error,
    Frame,
    FrontendDecoder,
    FrontendProtocolError,
    Generate,
    Status,
    StatusReq,
    Token,
    encode,
)

FRAMES: list[Frame] = [
    Generate(7, "héllo", 32, 0.75, 0.875, 42, ("\n\n", "END")),  # f32-exact
    Generate(1, "", 1),
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
        + bytes.fromhex("0100")  # one stop string
        + bytes.fromhex("02000000")  # prompt length
        + b"hi"
        + bytes.fromhex("0100")
        + b"x"
    )
    assert got == bytes.fromhex("46444645" "01" "01000000") + struct.pack("<I", 31) + payload
    assert len(payload) == 31


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
