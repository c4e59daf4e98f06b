"""FRAGMENT: messages larger than one FDTC frame, cut by ``encode_parts`` and reassembled by the
decoder, admitted by the connection only where the link's table takes the message, and timed
frame by frame by the stream.

Here the sender and the decoder, bytes handed across without sockets: golden bytes, slices
that are views, any cut reassembling, fragments out of order or past their limits refused.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from fragments import G, U, W, frag, frames_of, gradients
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry.wire import fdtc
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import (
    FRAGMENT_SIZE,
    MAX_MESSAGE,
    MAX_PAYLOAD,
    Compression,
    ErrorCode,
    FdtcDecoder,
    Fragment,
    Heartbeat,
    MsgType,
    Update,
    Weights,
    WeightsMeta,
    encode,
    encode_parts,
)


def hexb(*parts: str) -> bytes:
    return bytes.fromhex("".join(parts).replace(" ", ""))


def test_a_fragment_frame_byte_by_byte() -> None:
    frame = encode(Fragment(MsgType.WEIGHTS, total_length=8, offset=4, data=hexb("0000803f")))
    assert frame == hexb(
        "43544446 6c 15000000",  # magic, FRAGMENT, 17 + 4 bytes
        "21",  # of a WEIGHTS
        "0800000000000000",  # total_length u64: the WEIGHTS payload is 8 bytes
        "0400000000000000",  # offset u64: these are its bytes 4..8
        "0000803f",  # the slice: 1.0f
    )
    assert Fragment.LAYOUT.size == 17


def test_a_weights_payload_is_cut_into_slices_in_order() -> None:
    data = bytes(range(256)) * 40  # 10240 bytes
    pieces = encode_parts(Weights(data), fragment_size=4096, max_message=1 << 20)
    frames = frames_of(pieces)
    assert [code for code, _ in frames] == [MsgType.FRAGMENT] * 3
    heads = [Fragment.LAYOUT.unpack(memoryview(p)) for _, p in frames]
    assert [(h["message_type"], h["total_length"], h["offset"]) for h in heads] == [
        (MsgType.WEIGHTS, 10240, 0),
        (MsgType.WEIGHTS, 10240, 4096),
        (MsgType.WEIGHTS, 10240, 8192),
    ]
    assert b"".join(p[17:] for _, p in frames) == data
    assert [len(p) - 17 for _, p in frames] == [4096, 4096, 2048]


def test_slices_are_views_of_the_tensor_data_not_copies() -> None:
    arr = np.arange(5000, dtype="<f4")
    pieces = encode_parts(Weights(arr.data), fragment_size=4096, max_message=1 << 20)
    data_pieces = [p for p in pieces if isinstance(p, memoryview)]
    assert sum(len(p) for p in data_pieces) == arr.nbytes
    assert all(np.shares_memory(np.frombuffer(p, np.uint8), arr) for p in data_pieces)


def test_a_message_that_fits_a_fragment_goes_whole_as_the_seed_frames_it() -> None:
    msg = gradients(bytes(4000))
    whole = b"".join(bytes(p) for p in encode_parts(msg, fragment_size=4096, max_message=1 << 20))
    assert whole == encode(msg)
    # And only WEIGHTS, GRADIENTS and UPDATE are ever cut.
    meta = WeightsMeta(0, 0.1, tuple(fdtc.TensorMeta(f"t{i}", (2,)) for i in range(64)))
    assert len(meta.payload()) > 4096
    assert b"".join(
        bytes(p) for p in encode_parts(meta, fragment_size=4096, max_message=1 << 20)
    ) == encode(meta)


def test_the_sender_refuses_what_it_may_not_send() -> None:
    with pytest.raises(LocalProtocolError, match="exceeds this link's largest message"):
        encode_parts(Weights(bytes(10000)), fragment_size=4096, max_message=8192)
    with pytest.raises(LocalProtocolError, match="fragment_size 0 is outside"):
        encode_parts(Weights(bytes(10000)), fragment_size=0, max_message=1 << 20)
    with pytest.raises(LocalProtocolError, match="only GRADIENTS, UPDATE, WEIGHTS"):
        Fragment(MsgType.REGISTER, total_length=8, offset=0, data=b"x")
    with pytest.raises(LocalProtocolError, match="run past the message's 8"):
        Fragment(MsgType.WEIGHTS, total_length=8, offset=6, data=b"xyz")
    with pytest.raises(LocalProtocolError, match="no data"):
        Fragment(MsgType.WEIGHTS, total_length=8, offset=0, data=b"")


def _reassembled(
    pieces: list[bytes | memoryview], cuts: list[int], max_message: int
) -> list[fdtc.Message]:
    data = b"".join(bytes(p) for p in pieces)
    dec = FdtcDecoder(max_message=max_message)
    out: list[fdtc.Message] = []
    pos = 0
    for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
        dec.feed(data[pos:cut] if cut > pos else b"")
        pos = max(pos, cut)
        assert dec.buffered <= 9 + MAX_PAYLOAD
        out += list(dec.events())
    assert dec.buffered == 0 and dec.reassembling == 0 and dec.unfinished() is None
    return out


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["weights", "gradients", "update"]),
    size=st.integers(1, 20000),
    fragment=st.integers(1, 5000),
    cuts=st.lists(st.integers(0, 1 << 30), max_size=8),
)
def test_any_cut_of_any_message_reassembles_to_the_same_message(
    kind: str, size: int, fragment: int, cuts: list[int]
) -> None:
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    msg: fdtc.Message
    if kind == "weights":
        msg = Weights(data)
    elif kind == "gradients":
        msg = gradients(data)
    else:
        msg = Update(7, 6, Compression.NONE, 1, size, data)
    before, after = Heartbeat("w1", 1, 0.5, 2.0), Heartbeat("w1", 2, 0.25, 2.0)
    pieces = [
        encode(before),
        *encode_parts(msg, fragment_size=fragment, max_message=1 << 20),
        encode(after),
    ]
    assert _reassembled(pieces, cuts, max_message=1 << 20) == [before, msg, after]


def test_a_message_larger_than_one_frame_crosses_whole() -> None:
    """What fragments exist for: 300 MiB of f32 weights, more than SW_MAX_MESSAGE_SIZE."""
    arr = np.arange(300 << 18, dtype="<f4")  # 300 MiB
    assert arr.nbytes > MAX_PAYLOAD
    with pytest.raises(LocalProtocolError, match="exceeds SW_MAX_MESSAGE_SIZE"):
        encode_parts(Weights(arr.data))  # a link without fragments
    pieces = encode_parts(Weights(arr.data), fragment_size=FRAGMENT_SIZE, max_message=MAX_MESSAGE)
    dec = FdtcDecoder(max_message=MAX_MESSAGE)
    for p in pieces:
        dec.feed(p)
    (msg,) = list(dec.events())
    assert isinstance(msg, Weights) and len(msg.data) == arr.nbytes
    assert np.array_equal(np.frombuffer(msg.data, "<f4"), arr)


def _refused(
    stream: bytes, problem: str, code: ErrorCode, max_message: int = 1 << 20, before: int = 0
) -> FdtcDecoder:
    dec = FdtcDecoder(max_message=max_message)
    dec.feed(stream)
    assert len([dec.next_event() for _ in range(before)]) == before
    with pytest.raises(FdtcProtocolError, match=problem) as info:
        dec.next_event()
    assert info.value.error_code == code
    assert dec.closed
    return dec


def test_a_link_that_did_not_agree_refuses_fragments_at_the_header() -> None:
    dec = FdtcDecoder()  # max_message 0: the seed's framing
    dec.feed(frag(MsgType.WEIGHTS, 100, 0, b"x")[:10])  # the header and one byte
    with pytest.raises(FdtcProtocolError, match="FRAGMENT on a link that takes none") as info:
        dec.next_event()
    assert info.value.error_code == ErrorCode.UNEXPECTED
    assert dec.buffered == 0  # no payload byte was kept


@pytest.mark.parametrize(
    ("stream", "problem", "code"),
    [
        (frag(W, 100, 10, b"x"), "at offset 10 with no message begun", ErrorCode.UNEXPECTED),
        (
            frag(W, 100, 0, b"ab") + frag(W, 100, 3, b"c"),
            r"at offset 3; expected the WEIGHTS of 100 bytes begun, at offset 2",
            ErrorCode.UNEXPECTED,
        ),
        (
            frag(W, 100, 0, b"ab") + frag(W, 100, 1, b"c"),
            "at offset 1; expected",
            ErrorCode.UNEXPECTED,
        ),
        (
            frag(W, 100, 0, b"ab") + frag(U, 100, 2, b"c"),
            "FRAGMENT of UPDATE .* expected the WEIGHTS",
            ErrorCode.UNEXPECTED,
        ),
        (
            frag(W, 100, 0, b"ab") + frag(W, 99, 2, b"c"),
            r"\(99 bytes\) at offset 2; expected the WEIGHTS of 100",
            ErrorCode.UNEXPECTED,
        ),
        (
            frag(W, 100, 0, b"ab") + encode(Heartbeat("w1", 1, 0.5, 2.0)),
            r"HEARTBEAT in the middle of a fragmented WEIGHTS \(2 of 100 bytes in\)",
            ErrorCode.UNEXPECTED,
        ),
        (frag(W, (1 << 20) + 1, 0, b"a"), "exceeds this link's largest message", ErrorCode.BUSY),
        (frag(G, 10, 0, b"a"), "GRADIENTS payload must be at least 80 bytes", ErrorCode.BAD_FRAME),
        (
            frag(W, 8, 0, b"abcd")[: 9 + 0] + struct.pack("<BQQ", 0x01, 8, 0) + b"abcd",
            "bad FRAGMENT payload: .*only GRADIENTS, UPDATE, WEIGHTS",
            ErrorCode.BAD_FRAME,
        ),
        (
            hexb("43544446 6c 14000000") + struct.pack("<BQQ", 0x21, 8, 6) + b"xyz",
            "run past the message's 8",
            ErrorCode.BAD_FRAME,
        ),
        (
            hexb("43544446 6c 11000000") + struct.pack("<BQQ", 0x21, 8, 0),
            "FRAGMENT payload must be more than 17 bytes",
            ErrorCode.BAD_FRAME,
        ),
    ],
)
def test_fragments_out_of_order_or_out_of_bounds_are_the_peers_error(
    stream: bytes, problem: str, code: ErrorCode
) -> None:
    _refused(stream, problem, code)


def test_the_limits_of_a_fragmented_message() -> None:
    _refused(
        frag(W, MAX_MESSAGE + 1, 0, b"a"),
        "exceeds this link's largest",
        ErrorCode.BAD_FRAME,
        max_message=MAX_MESSAGE,
    )
    with pytest.raises(LocalProtocolError, match=r"outside 0\.\.4294967296"):
        FdtcDecoder(max_message=MAX_MESSAGE + 1)


def test_the_reassembled_message_is_checked_like_a_whole_one() -> None:
    bad = bytearray(gradients(bytes(40)).payload())
    bad[72] = 9  # compression 9
    stream = frag(G, len(bad), 0, bytes(bad[:60])) + frag(G, len(bad), 60, bytes(bad[60:]))
    _refused(stream, "bad GRADIENTS payload: compression 9", ErrorCode.BAD_FRAME)


def test_a_message_before_the_bad_fragment_still_comes_out() -> None:
    beat = Heartbeat("w1", 1, 0.5, 2.0)
    dec = _refused(
        encode(beat) + frag(W, 100, 5, b"x"),
        "with no message begun",
        ErrorCode.UNEXPECTED,
        before=1,
    )
    with pytest.raises(FdtcProtocolError, match="already failed"):
        dec.feed(b"x")


def test_the_end_of_the_stream_inside_a_fragmented_message() -> None:
    dec = FdtcDecoder(max_message=1 << 20)
    dec.feed(frag(W, 100, 0, b"a" * 40))
    assert dec.next_event() is None
    assert (dec.buffered, dec.reassembling) == (0, 40)
    with pytest.raises(
        FdtcProtocolError,
        match=r"connection closed in the middle of a "
        r"fragmented WEIGHTS \(40 of 100 bytes received\)",
    ):
        dec.feed_eof()
