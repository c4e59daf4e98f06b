"""FDTC codec: the incremental decoder, its limits and bad bytes, and properties of any bytes."""

from __future__ import annotations

import mmap
import struct
import time

import numpy as np
import pytest
from fdtc_golden import GOLDEN, MESSAGES, hexb, replace_at
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundry.wire.errors import (
    FdtcProtocolError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from foundry.wire.fdtc import (
    MAX_PAYLOAD,
    MESSAGE_TYPES,
    Compression,
    ControlAck,
    DType,
    ErrorCode,
    FdtcDecoder,
    Gradients,
    GradientsAck,
    HardwareProfile,
    Heartbeat,
    Message,
    MsgType,
    Register,
    Status,
    TensorMeta,
    Weights,
    WeightsMeta,
    decode,
    encode,
    encode_parts,
)

STREAM = b"".join(frame for _, frame in GOLDEN)


def test_decoder_whole_stream() -> None:
    d = FdtcDecoder()
    d.feed(STREAM)
    assert list(d.events()) == MESSAGES
    assert d.buffered == 0
    assert d.next_event() is None


def test_decoder_one_byte_at_a_time() -> None:
    d = FdtcDecoder()
    got: list[Message] = []
    for i in range(len(STREAM)):
        d.feed(STREAM[i : i + 1])
        got.extend(d.events())
        assert d.buffered <= 9 + MAX_PAYLOAD
    assert got == MESSAGES
    assert d.buffered == 0


@pytest.mark.parametrize("chunk", [2, 7, 9, 10, 100, 1000])
def test_decoder_chunks(chunk: int) -> None:
    d = FdtcDecoder()
    got: list[Message] = []
    for i in range(0, len(STREAM), chunk):
        d.feed(memoryview(STREAM)[i : i + chunk])
        got.extend(d.events())
    assert got == MESSAGES


def test_trailing_partial_frame_stays_buffered() -> None:
    heartbeat = GOLDEN[3][1]
    d = FdtcDecoder()
    d.feed(STREAM + heartbeat[:20])
    assert list(d.events()) == MESSAGES
    assert d.next_event() is None
    assert d.buffered == 20
    d.feed(heartbeat[20:])
    assert d.next_event() == GOLDEN[3][0]
    assert d.buffered == 0


BAD_HEADERS = [
    ("00000000 01 55000000", "bad magic 0x00000000, expected 0x46445443 \\(FDTC\\)"),
    ("46445443 01 55000000", "bad magic 0x43544446"),  # big-endian magic
    ("43544446 7f 00000000", "unknown message type 0x7f"),
    ("43544446 21 01000010", "exceeds the limit of 268435456"),  # 2**28 + 1
    ("43544446 01 54000000", "REGISTER payload must be 85 bytes, header says 84"),
    ("43544446 22 0b000000", "WEIGHTS_META payload must be 12 \\+ 141"),
    ("43544446 22 98000000", "WEIGHTS_META payload must be 12 \\+ 141"),  # 12 + 140
    ("43544446 30 4f000000", "GRADIENTS payload must be at least 80"),
    ("43544446 63 26000000", "SWARM_STATUS payload must be 37 \\+ 93"),  # 38
    ("43544446 6b 16010000", "SWARM_DETAIL payload must be 277 \\+ 20"),  # 278
    ("43544446 6a 01000000", "SWARM_DETAIL_REQ payload must be 0 bytes"),
    ("43544446 11 03000000", "HEARTBEAT_ACK payload must be 0 or 4"),
    ("43544446 31 04000000", "GRADIENTS_ACK payload must be 0 or 5"),
    ("43544446 03 01000000", "DEREGISTER payload must be 0 bytes"),
    ("43544446 ff 03010000", "ERROR payload must be 260 bytes"),
]


@pytest.mark.parametrize(("header", "problem"), BAD_HEADERS)
def test_bad_header_rejected_at_ninth_byte_before_buffering(header: str, problem: str) -> None:
    raw = hexb(header)
    d = FdtcDecoder()
    for i in range(8):
        d.feed(raw[i : i + 1])
        assert d.next_event() is None
    d.feed(raw[8:] + bytes(300))  # the payload bytes in the same chunk are never kept
    assert d.buffered == 0
    assert d.closed
    with pytest.raises(FdtcProtocolError, match=problem):
        d.next_event()
    with pytest.raises(FdtcProtocolError):  # terminal: keeps raising
        d.next_event()
    with pytest.raises(FdtcProtocolError, match="closed"):
        d.feed(b"more")


def test_messages_before_bad_bytes_come_out_first() -> None:
    d = FdtcDecoder()
    d.feed(GOLDEN[3][1] + hexb("43544446 7f 00000000"))
    assert d.next_event() == GOLDEN[3][0]
    with pytest.raises(FdtcProtocolError) as exc:
        d.next_event()
    assert exc.value.error_code == ErrorCode.BAD_FRAME
    assert isinstance(exc.value, RemoteProtocolError)
    assert isinstance(exc.value, ProtocolError)


def test_per_decoder_payload_limit() -> None:
    d = FdtcDecoder(max_payload=100)
    d.feed(hexb("43544446 21 64000000") + bytes(100))
    assert d.next_event() == Weights(bytes(100))
    d.feed(hexb("43544446 21 65000000"))
    with pytest.raises(FdtcProtocolError, match="101 bytes exceeds the limit of 100") as exc:
        d.next_event()
    assert exc.value.error_code == ErrorCode.BUSY
    with pytest.raises(LocalProtocolError):
        FdtcDecoder(max_payload=MAX_PAYLOAD + 1)


def test_default_payload_limit_and_limit_plus_one() -> None:
    d = FdtcDecoder(max_payload=MAX_PAYLOAD)
    d.feed(hexb("43544446 21 00000010"))  # 2**28: allowed, waits for the payload
    assert d.next_event() is None
    assert not d.closed
    d = FdtcDecoder()
    d.feed(hexb("43544446 21 01000010"))  # 2**28 + 1
    with pytest.raises(FdtcProtocolError, match=f"{MAX_PAYLOAD + 1} bytes exceeds the limit"):
        d.next_event()
    at_limit = np.zeros(MAX_PAYLOAD, np.uint8)  # calloc'd: never touched
    head, *_ = encode_parts(Weights(at_limit.data))
    assert bytes(head) == hexb("43544446 21 00000010")


def _golden(t: MsgType) -> bytes:
    return next(frame for msg, frame in GOLDEN if msg.TYPE is t)


BAD_PAYLOADS = [
    (replace_at(_golden(MsgType.REGISTER_ACK), 0, b"\x02"), "accepted must be a bool"),
    (replace_at(_golden(MsgType.REGISTER_ACK), 21, hexb("00000040")), "topk_ratio 2.0"),
    (replace_at(_golden(MsgType.REGISTER_ACK), 17, b"\x04"), "compression 4 is not a Compr"),
    (replace_at(_golden(MsgType.REGISTER), 65, b"\x0a"), "profile 10 is not a HardwareProfile"),
    (replace_at(_golden(MsgType.REGISTER), 0, b"x" * 64), "worker_id .* not NUL-terminated"),
    (replace_at(_golden(MsgType.HEARTBEAT), 0, b"\xff\xfe"), "worker_id is not valid UTF-8"),
    (replace_at(_golden(MsgType.WEIGHTS_META), 0, b"\x03"), "num_tensors 3 but carries 2"),
    (replace_at(_golden(MsgType.WEIGHTS_META), 12 + 64, b"\x09"), "ndim 9"),
    (replace_at(_golden(MsgType.WEIGHTS_META), 12 + 132, b"\x07"), "numel 7 is not the product"),
    (replace_at(_golden(MsgType.WEIGHTS_META), 12 + 140, b"\x05"), "dtype 5 is not a DType"),
    (replace_at(_golden(MsgType.GRADIENTS), 72, b"\x09"), "compression 9"),
    (replace_at(_golden(MsgType.GRADIENTS_ACK), 4, b"\x02"), "accepted must be a bool"),
    (replace_at(_golden(MsgType.STATUS), 92, b"\x02"), "is_training must be a bool"),
    (replace_at(_golden(MsgType.ASSIGN), 32, b"\x0d"), "n_samples 13 exceeds"),
    (replace_at(_golden(MsgType.SWARM_STATUS), 33, b"\x02"), "n_rows 2 but carries 1"),
    (replace_at(_golden(MsgType.SWARM_STATUS), 8, b"\x04"), "state 4 is not a SwarmState"),
    (replace_at(_golden(MsgType.SWARM_STATUS), 37 + 68, b"\x04"), "state 4 is not a WorkerSt"),
    (replace_at(_golden(MsgType.SWARM_DETAIL), 8, b"\x02"), "failed must be a bool"),
    (replace_at(_golden(MsgType.SWARM_DETAIL), 9, b"c" * 256), "note .* not NUL-terminated"),
    (replace_at(_golden(MsgType.SWARM_DETAIL), 273, b"\x02"), "n_rows 2 but carries 1"),
    (replace_at(_golden(MsgType.CONTROL_ACK), 0, b"\x99"), "acked_type 153 is not a MsgType"),
    (replace_at(_golden(MsgType.EXPORT), 0, b"\xc3\x28"), "path is not valid UTF-8"),
]


@pytest.mark.parametrize(("frame", "problem"), BAD_PAYLOADS)
def test_bad_payload_values_are_the_peers_error(frame: bytes, problem: str) -> None:
    d = FdtcDecoder()
    d.feed(frame)
    with pytest.raises(FdtcProtocolError, match=problem):
        d.next_event()
    assert d.buffered == 0


def test_64mib_weights_in_64kib_chunks_is_linear_and_not_copied_out() -> None:
    n = 64 << 20
    chunk = bytes(64 << 10)
    d = FdtcDecoder()
    t0 = time.perf_counter()
    d.feed(hexb("43544446 21 00000004"))  # WEIGHTS, 0x04000000 bytes
    for _ in range(n // len(chunk)):
        d.feed(chunk)
        assert d.buffered <= 9 + n
    msg = d.next_event()
    elapsed = time.perf_counter() - t0
    assert isinstance(msg, Weights)
    assert len(msg.data) == n
    # The payload is a read-only view of the one buffer it was received into (a memory map
    # of its own: unmapped, so given back to the system, when the message is dropped).
    assert isinstance(msg.data, memoryview) and msg.data.readonly
    assert isinstance(msg.data.obj, mmap.mmap) and len(msg.data.obj) == n
    # A quadratic buffer would copy ~32 GiB here (minutes); linear is a fraction of a second.
    assert elapsed < 10.0


def test_decode_one_frame_rejects_incomplete_and_trailing() -> None:
    frame = _golden(MsgType.HEARTBEAT)
    with pytest.raises(FdtcProtocolError, match="incomplete"):
        decode(frame[:-1])
    with pytest.raises(FdtcProtocolError, match="trailing"):
        decode(frame + b"\x43")


_utf8_63 = st.text(st.characters(exclude_characters="\0", exclude_categories=["Cs"])).filter(
    lambda s: len(s.encode()) <= 63
)
_u32 = st.integers(0, 2**32 - 1)
_f32 = st.floats(width=32, allow_nan=False)

_messages = st.one_of(
    st.builds(Heartbeat, _utf8_63, _u32, _f32, _f32),
    st.builds(
        Register,
        _utf8_63,
        st.integers(0, 255),
        st.sampled_from(HardwareProfile),
        _u32,
        st.integers(0, 2**64 - 1),
        _u32,
    ),
    st.builds(
        Status,
        _utf8_63,
        _u32,
        _u32,
        _f32,
        _f32,
        _f32,
        st.integers(0, 2**64 - 1),
        st.booleans(),
    ),
    st.builds(
        Gradients,
        _utf8_63,
        _u32,
        _u32,
        st.sampled_from(Compression),
        _u32,
        st.binary(max_size=64),
    ),
    st.builds(
        WeightsMeta,
        _u32,
        _f32,
        st.lists(
            st.builds(
                TensorMeta,
                _utf8_63,
                st.lists(st.integers(0, 2**8), max_size=8).map(tuple),
                st.sampled_from(DType),
            ),
            max_size=4,
        ).map(tuple),
    ),
    st.builds(GradientsAck, _u32, st.booleans()),
    st.builds(ControlAck, st.sampled_from(MsgType), st.booleans(), _u32, _utf8_63),
)


@given(_messages)
def test_round_trip_property(msg: Message) -> None:
    frame = encode(msg)
    back = decode(frame)
    assert back == msg
    assert encode(back) == frame


_MAX = 400  # a small per-decoder limit, so random lengths hit it often
_codes = st.sampled_from([int(t) for t in MsgType] + [0x00, 0x7F, 0xFE])
_fixed: dict[int, int] = {cls.TYPE: cls.LAYOUT.size for cls in MESSAGE_TYPES.values()}


@st.composite
def _frames(draw: st.DrawFn) -> bytes:
    code = draw(_codes)
    size = _fixed.get(code, 0) if code in list(MsgType) else 0
    payload = draw(
        st.binary(min_size=size, max_size=size) if draw(st.booleans()) else st.binary(max_size=300)
    )
    length = len(payload) if draw(st.integers(0, 3)) else draw(st.integers(0, 2**32 - 1))
    magic = 0x46445443 if draw(st.integers(0, 7)) else draw(st.integers(0, 2**32 - 1))
    return struct.pack("<IBI", magic, code, length) + payload


@st.composite
def _mutated_golden(draw: st.DrawFn) -> bytes:
    """A golden frame with a few bytes of its payload changed: reaches every field check."""
    frame = bytearray(draw(st.sampled_from([f for _, f in GOLDEN if len(f) <= 9 + _MAX])))
    for _ in range(draw(st.integers(1, 4))):
        if len(frame) > 9:
            frame[draw(st.integers(9, len(frame) - 1))] = draw(st.integers(0, 255))
    return bytes(frame)


_streams = st.one_of(
    st.binary(max_size=600),
    st.lists(_frames(), max_size=5).map(b"".join),
    st.lists(_mutated_golden(), max_size=4).map(b"".join),
)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(_streams, st.lists(st.integers(1, 64), min_size=1, max_size=20))
def test_any_bytes_give_messages_or_a_clean_error(data: bytes, cuts: list[int]) -> None:
    d = FdtcDecoder(max_payload=_MAX)
    pos, i = 0, 0
    while pos < len(data):
        piece = data[pos : pos + cuts[i % len(cuts)]]
        pos, i = pos + len(piece), i + 1
        try:
            d.feed(piece)
            assert d.buffered <= 9 + _MAX
            for msg in d.events():
                assert isinstance(msg, Message)
        except FdtcProtocolError:
            assert d.closed and d.buffered == 0
            return
