"""FRAGMENT: messages larger than one FDTC frame, cut by ``encode_parts`` and reassembled by the
decoder, admitted by the connection only where the link's table takes the message, and timed
frame by frame by the stream.

The decoder and connection tests hand bytes across without sockets; the stream tests use
loopback sockets; the swarm tests run a real coordinator whose worker links must fragment.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from procs import coordinator, worker

from foundry.model.text.data import load_corpus
from foundry.transport.fdtc_stream import FdtcStream, FrameTimeout
from foundry.wire import fdtc
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import (
    FRAGMENT_SIZE,
    MAX_MESSAGE,
    MAX_PAYLOAD,
    Compression,
    Dataset,
    ErrorCode,
    FdtcDecoder,
    Fragment,
    Gradients,
    HardwareProfile,
    Heartbeat,
    MsgType,
    Register,
    RegisterAck,
    Update,
    Weights,
    WeightsMeta,
    encode,
    encode_parts,
    weights_messages,
)
from foundry.wire.fdtc_connection import FdtcConnection
from foundry.wire.fdtc_lifecycle import Link, LinkState, Role


def hexb(*parts: str) -> bytes:
    return bytes.fromhex("".join(parts).replace(" ", ""))


def frames_of(pieces: list[bytes | memoryview]) -> list[tuple[int, bytes]]:
    """(type, payload) of each frame in the pieces ``encode_parts`` returned."""
    data = b"".join(bytes(p) for p in pieces)
    out, pos = [], 0
    while pos < len(data):
        _, code, length = fdtc.HEADER.unpack_from(data, pos)
        out.append((code, data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    assert pos == len(data)
    return out


def gradients(data: bytes, n_tensors: int = 1) -> Gradients:
    return Gradients("w1", 3, n_tensors, Compression.NONE, len(data), data)


# -- bytes on the wire ----------------------------------------------------------------------


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


# -- what the decoder refuses ---------------------------------------------------------------


def _frag(kind: MsgType, total: int, offset: int, data: bytes) -> bytes:
    return encode(Fragment(kind, total_length=total, offset=offset, data=data))


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
    dec.feed(_frag(MsgType.WEIGHTS, 100, 0, b"x")[:10])  # the header and one byte
    with pytest.raises(FdtcProtocolError, match="FRAGMENT on a link that takes none") as info:
        dec.next_event()
    assert info.value.error_code == ErrorCode.UNEXPECTED
    assert dec.buffered == 0  # no payload byte was kept


W, G, U = MsgType.WEIGHTS, MsgType.GRADIENTS, MsgType.UPDATE


@pytest.mark.parametrize(
    ("stream", "problem", "code"),
    [
        (_frag(W, 100, 10, b"x"), "at offset 10 with no message begun", ErrorCode.UNEXPECTED),
        (
            _frag(W, 100, 0, b"ab") + _frag(W, 100, 3, b"c"),
            r"at offset 3; expected the WEIGHTS of 100 bytes begun, at offset 2",
            ErrorCode.UNEXPECTED,
        ),
        (
            _frag(W, 100, 0, b"ab") + _frag(W, 100, 1, b"c"),
            "at offset 1; expected",
            ErrorCode.UNEXPECTED,
        ),
        (
            _frag(W, 100, 0, b"ab") + _frag(U, 100, 2, b"c"),
            "FRAGMENT of UPDATE .* expected the WEIGHTS",
            ErrorCode.UNEXPECTED,
        ),
        (
            _frag(W, 100, 0, b"ab") + _frag(W, 99, 2, b"c"),
            r"\(99 bytes\) at offset 2; expected the WEIGHTS of 100",
            ErrorCode.UNEXPECTED,
        ),
        (
            _frag(W, 100, 0, b"ab") + encode(Heartbeat("w1", 1, 0.5, 2.0)),
            r"HEARTBEAT in the middle of a fragmented WEIGHTS \(2 of 100 bytes in\)",
            ErrorCode.UNEXPECTED,
        ),
        (_frag(W, (1 << 20) + 1, 0, b"a"), "exceeds this link's largest message", ErrorCode.BUSY),
        (_frag(G, 10, 0, b"a"), "GRADIENTS payload must be at least 80 bytes", ErrorCode.BAD_FRAME),
        (
            _frag(W, 8, 0, b"abcd")[: 9 + 0] + struct.pack("<BQQ", 0x01, 8, 0) + b"abcd",
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
        _frag(W, MAX_MESSAGE + 1, 0, b"a"),
        "exceeds this link's largest",
        ErrorCode.BAD_FRAME,
        max_message=MAX_MESSAGE,
    )
    with pytest.raises(LocalProtocolError, match=r"outside 0\.\.4294967296"):
        FdtcDecoder(max_message=MAX_MESSAGE + 1)


def test_the_reassembled_message_is_checked_like_a_whole_one() -> None:
    bad = bytearray(gradients(bytes(40)).payload())
    bad[72] = 9  # compression 9
    stream = _frag(G, len(bad), 0, bytes(bad[:60])) + _frag(G, len(bad), 60, bytes(bad[60:]))
    _refused(stream, "bad GRADIENTS payload: compression 9", ErrorCode.BAD_FRAME)


def test_a_message_before_the_bad_fragment_still_comes_out() -> None:
    beat = Heartbeat("w1", 1, 0.5, 2.0)
    dec = _refused(
        encode(beat) + _frag(W, 100, 5, b"x"),
        "with no message begun",
        ErrorCode.UNEXPECTED,
        before=1,
    )
    with pytest.raises(FdtcProtocolError, match="already failed"):
        dec.feed(b"x")


def test_the_end_of_the_stream_inside_a_fragmented_message() -> None:
    dec = FdtcDecoder(max_message=1 << 20)
    dec.feed(_frag(W, 100, 0, b"a" * 40))
    assert dec.next_event() is None
    assert (dec.buffered, dec.reassembling) == (0, 40)
    with pytest.raises(
        FdtcProtocolError,
        match=r"connection closed in the middle of a "
        r"fragmented WEIGHTS \(40 of 100 bytes received\)",
    ):
        dec.feed_eof()


# -- the connection: which link takes them, and when ---------------------------------------


def _pair() -> tuple[FdtcConnection, FdtcConnection]:
    coord = FdtcConnection(Role.COORDINATOR, link=Link.WORKER)
    work = FdtcConnection(Role.WORKER)
    coord.allow_fragments(1 << 20, 4096)
    work.allow_fragments(1 << 20, 4096)
    return coord, work


def _cross(src: FdtcConnection, dst: FdtcConnection, *msgs: fdtc.Message) -> list[fdtc.Message]:
    for piece in src.send(*msgs):
        dst.receive_data(piece)
    out = []
    while (event := dst.next_event()) is not None:
        assert isinstance(event, fdtc.Message)
        out.append(event)
    return out


def _register() -> tuple[Dataset, Register]:
    return (
        Dataset(n_tokens=1, sha256=bytes(32)),
        Register("w1", 1, HardwareProfile.RPI4_4G, 4, 2048, 8),
    )


def _ack() -> RegisterAck:
    return RegisterAck(True, 0, 1, 8, 1, Compression.NONE, 0.0, 0)


BIG = np.arange(3000, dtype="<f4")  # 12000 bytes: three fragments of 4096


def test_a_worker_link_carries_large_weights_updates_and_gradients_both_ways() -> None:
    coord, work = _pair()
    _cross(work, coord, *_register())
    meta, weights = weights_messages({"t": BIG}, 0, 0.1)
    update = Update(1, 0, Compression.NONE, 1, BIG.nbytes, BIG.tobytes())
    got = _cross(coord, work, _ack(), meta, weights, update)
    assert got == [_ack(), meta, weights, update]
    assert work.state is LinkState.READY
    grads = gradients(BIG.tobytes())
    assert _cross(work, coord, grads) == [grads]


def test_a_registered_link_is_in_step_with_the_stream_when_fragments_begin() -> None:
    """WEIGHTS and the next UPDATE's first fragment in one read: the UPDATE is admitted in
    the state WEIGHTS leads to, though WEIGHTS was not handed out yet."""
    coord, work = _pair()
    _cross(work, coord, *_register())
    meta, weights = weights_messages({"t": BIG}, 0, 0.1)
    update = Update(1, 0, Compression.NONE, 1, BIG.nbytes, BIG.tobytes())
    work.receive_data(b"".join(bytes(p) for p in coord.send(_ack(), meta, weights, update)))
    assert [type(work.next_event()) for _ in range(4)] == [
        RegisterAck,
        WeightsMeta,
        Weights,
        Update,
    ]


@pytest.mark.parametrize(
    ("before", "kind", "problem", "code"),
    [
        (
            "",
            G,
            "fragmented GRADIENTS is not allowed on a connected link",
            ErrorCode.NOT_REGISTERED,
        ),
        (
            "registered",
            G,
            "fragmented GRADIENTS is not allowed on a registered link",
            ErrorCode.UNEXPECTED,
        ),
        ("ready", W, "fragmented WEIGHTS is not allowed on a ready link", ErrorCode.UNEXPECTED),
    ],
)
def test_the_coordinator_takes_fragments_only_of_gradients_once_it_sent_weights(
    before: str, kind: MsgType, problem: str, code: ErrorCode
) -> None:
    """No unregistered peer makes the coordinator hold more than one frame."""
    coord, work = _pair()
    if before:
        _cross(work, coord, *_register())
    if before == "ready":
        meta, weights = weights_messages({"t": BIG}, 0, 0.1)
        _cross(coord, work, _ack(), meta, weights)
    coord.receive_data(_frag(kind, 12000, 0, bytes(4096)))
    with pytest.raises(FdtcProtocolError, match=problem) as info:
        coord.next_event()
    assert info.value.error_code == code


def test_seed_and_admin_links_take_no_fragments() -> None:
    seed = FdtcConnection(Role.COORDINATOR, link=Link.WORKER)  # no DATASET: no agreement
    admin = FdtcConnection(Role.COORDINATOR, link=Link.ADMIN)
    for conn in (seed, admin):
        conn.receive_data(_frag(W, 12000, 0, bytes(4096)))
        with pytest.raises(FdtcProtocolError, match="FRAGMENT on a link that takes none"):
            conn.next_event()
    # A worker link that never agreed sends one frame, and refuses one that is too large.
    plain = FdtcConnection(Role.COORDINATOR, link=Link.WORKER)
    _cross(
        FdtcConnection(Role.WORKER), plain, Register("w1", 1, HardwareProfile.RPI4_4G, 4, 2048, 8)
    )
    meta, weights = weights_messages({"t": BIG}, 0, 0.1)
    assert len(frames_of(plain.send(_ack(), meta, weights))) == 3


def test_the_peer_closing_inside_a_fragmented_message_is_its_error() -> None:
    coord, work = _pair()
    _cross(work, coord, *_register())
    meta, weights = weights_messages({"t": BIG}, 0, 0.1)
    pieces = coord.send(_ack(), meta, weights)
    data = b"".join(bytes(p) for p in pieces)
    last = 9 + 17 + (BIG.nbytes - 2 * 4096)
    work.receive_data(data[: len(data) - last])  # two fragments of three, whole
    work.receive_data(b"")
    assert [type(work.next_event()) for _ in range(2)] == [RegisterAck, WeightsMeta]
    with pytest.raises(
        FdtcProtocolError,
        match=r"in the middle of a fragmented WEIGHTS "
        r"\(8192 of 12000 bytes received\)",
    ):
        work.next_event()


# -- the stream: frame by frame in time --------------------------------------------------


def _socket_pair(rcvbuf: int | None = None) -> tuple[socket.socket, socket.socket]:
    listener = socket.socket()
    if rcvbuf:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    return client, server


def test_each_fragment_has_the_frame_deadline_to_itself() -> None:
    """Three slices, each half-sent for 0.2 s, take longer than the 0.5 s deadline in all and
    arrive; a slice stalled in mid-frame past it is cut off."""
    pieces = encode_parts(Weights(BIG.tobytes()), fragment_size=4096, max_message=1 << 20)
    frames = [bytes(f) for f in _split_frames(pieces)]
    assert len(frames) == 3

    async def main() -> None:
        client, server = _socket_pair()
        reader, writer = await asyncio.open_connection(sock=server)
        stream = FdtcStream(reader, writer, frame_deadline_s=0.5)
        stream.decoder.max_message = 1 << 20  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()

        async def trickle(stall: bool) -> None:
            for i, frame in enumerate(frames):
                if stall and i == 1:
                    await loop.sock_sendall(client, frame[:100])
                    await asyncio.sleep(1.0)
                    return
                # Each frame in two parts: the reader holds a partial frame for 0.2 s.
                await loop.sock_sendall(client, frame[:100])
                await asyncio.sleep(0.2)
                await loop.sock_sendall(client, frame[100:])
                await asyncio.sleep(0.1)

        client.setblocking(False)
        t0 = time.monotonic()
        sender = asyncio.ensure_future(trickle(stall=False))
        msg = await stream.recv()
        assert isinstance(msg, Weights) and bytes(msg.data) == BIG.tobytes()
        assert time.monotonic() - t0 > 0.5  # longer than one frame deadline in all
        await sender
        sender = asyncio.ensure_future(trickle(stall=True))
        with pytest.raises(FrameTimeout, match=r"did not finish it within 0\.5 s"):
            await stream.recv()
        await sender
        await stream.close()
        client.close()

    asyncio.run(asyncio.wait_for(main(), 20))


def _split_frames(pieces: list[bytes | memoryview]) -> list[bytes]:
    data = b"".join(bytes(p) for p in pieces)
    out, pos = [], 0
    while pos < len(data):
        length = fdtc.HEADER.unpack_from(data, pos)[2]
        out.append(data[pos : pos + 9 + length])
        pos += 9 + length
    return out


def test_a_send_to_a_slow_but_steady_reader_outlasts_the_deadline() -> None:
    """The send deadline cuts a peer that takes nothing, not one that takes little at a time:
    4 MiB read at most 64 KiB every 10 ms takes over half a second against a 0.3 s deadline."""

    async def main() -> None:
        client, server = _socket_pair(rcvbuf=64 << 10)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        reader, writer = await asyncio.open_connection(sock=client)
        stream = FdtcStream(reader, writer, frame_deadline_s=0.3)
        server.setblocking(False)
        loop = asyncio.get_running_loop()
        got = 0

        async def read_slowly() -> None:
            nonlocal got
            while got < 9 + (4 << 20):
                data = await loop.sock_recv(server, 64 << 10)
                assert data
                got += len(data)
                await asyncio.sleep(0.01)

        t0 = time.monotonic()
        slow = asyncio.ensure_future(read_slowly())
        await stream.send(Weights(bytes(4 << 20)))
        await slow
        assert time.monotonic() - t0 > 0.3 and got == 9 + (4 << 20)
        await stream.close()
        server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


# -- a real coordinator ------------------------------------------------------------------


class FragmentingPeer:
    """A worker driven by the test over our own FdtcConnection, whose decoder takes no frame
    over 64 KiB: the coordinator's 1 MB weights reach it only as fragments."""

    def __init__(self, port: int, max_payload: int = 64 << 10, fragment_size: int = 4096) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.conn = FdtcConnection(Role.WORKER, max_payload=max_payload)
        self.conn.allow_fragments(MAX_MESSAGE, fragment_size)
        self.frames_out = 0

    def join(self, worker_id: str) -> tuple[WeightsMeta, Weights]:
        """DATASET, REGISTER, then WEIGHTS_REQ: the weights the coordinator sends."""
        fp = load_corpus(None).fingerprint
        self.send(
            Dataset(n_tokens=fp.n_tokens, sha256=bytes.fromhex(fp.sha256)),
            Register(worker_id, fdtc.PROTOCOL_VERSION, HardwareProfile.LAPTOP_LIGHT, 2, 4096, 4),
        )
        self.recv(fdtc.TrainPlan)
        self.send(fdtc.WeightsReq())
        meta = self.recv(WeightsMeta)
        weights = self.recv(Weights)
        assert isinstance(meta, WeightsMeta) and isinstance(weights, Weights)
        assert len(weights.data) == meta.nbytes
        return meta, weights

    def send(self, *msgs: fdtc.Message) -> None:
        pieces = self.conn.send(*msgs)
        self.frames_out += len(_split_frames(pieces))
        self.sock.sendall(b"".join(bytes(p) for p in pieces))

    def recv(self, *types: type[fdtc.Message]) -> fdtc.Message:
        deadline = time.monotonic() + 30
        while True:
            event = self.conn.next_event()
            if isinstance(event, types):
                return event
            if event is not None:
                continue
            self.sock.settimeout(0.5)
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                assert time.monotonic() < deadline, "nothing from the coordinator in 30 s"
                self.send(Heartbeat("frag", 0, 0.0, 0.0))
                continue
            assert data, "the coordinator closed the connection"
            self.conn.receive_data(data)


def test_a_coordinator_sends_weights_and_takes_gradients_in_fragments(tmp_path: Path) -> None:
    coord, port, _ = coordinator(
        tmp_path, "--max-steps", "2", "--global-batch", "4", "--fragment-size", "4096"
    )
    peer = FragmentingPeer(port)
    try:
        meta, _ = peer.join("frag")
        assert meta.nbytes > 64 << 10  # more than the peer's decoder takes in one frame
        assign = peer.recv(fdtc.Assign)
        assert isinstance(assign, fdtc.Assign)
        numels = [t.numel for t in meta.tensors]
        data = np.full(sum(numels), 1e-3, "<f4").tobytes()
        before = peer.frames_out
        peer.send(
            Gradients("frag", assign.global_step, len(numels), Compression.NONE, len(data), data)
        )
        assert peer.frames_out - before == -(-len(data) // 4096)  # in fragments of 4096
        ack = peer.recv(fdtc.GradientsAck)
        assert isinstance(ack, fdtc.GradientsAck) and ack.accepted
        coord.wait_for(r"step 1: loss", within_s=30)
    finally:
        peer.sock.close()
        coord.stop()
    assert "worker link: closing" not in coord.text()


def test_workers_train_with_fragments_both_ways(tmp_path: Path) -> None:
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        "4",
        "--global-batch",
        "8",
        "--sync-every",
        "2",
        "--min-workers",
        "2",
        "--fragment-size",
        "4096",
    )
    workers = [worker(tmp_path, port, f"w{i}", "--fragment-size", "4096") for i in range(2)]
    try:
        coord.wait_for(r"training done at step 4", within_s=180)
        log = coord.text()
        assert log.count("samples from 2 workers") == 2, log[-3000:]
        for w in workers:
            w.wait_for(r"training done at step 4; exiting", within_s=30)
    finally:
        for w in workers:
            w.stop()
        coord.stop()
    assert "worker link: closing" not in log, log[-3000:]


def test_the_medium_preset_reaches_a_worker_and_a_seed_only_peer_is_told_why_not(
    tmp_path: Path,
) -> None:
    """482 MiB of float32 weights: more than one frame carries, so a seed-only peer is refused
    with the reason, and a peer of ours gets them in FRAGMENT frames of 64 MiB."""
    coord, port, _ = coordinator(tmp_path, "--preset", "medium", "--max-steps", "1")
    try:
        seed = socket.create_connection(("127.0.0.1", port), timeout=30)
        seed.sendall(encode(Register("seed", 1, HardwareProfile.LAPTOP_LIGHT, 2, 4096, 4)))
        dec = FdtcDecoder()
        got: list[fdtc.Message] = []
        while len(got) < 2:
            data = seed.recv(1 << 16)
            assert data, f"closed after {got}"
            dec.feed(data)
            got += list(dec.events())
        ack, error = got
        assert isinstance(ack, RegisterAck) and not ack.accepted
        assert isinstance(error, fdtc.Error) and error.error_code == ErrorCode.REJECTED
        assert "482 MiB of float32 weights" in error.message and "FRAGMENT" in error.message
        seed.close()

        # A peer of ours as shipped: frames up to 256 MiB, slices of 64 MiB.
        peer = FragmentingPeer(port, max_payload=MAX_PAYLOAD, fragment_size=FRAGMENT_SIZE)
        meta, weights = peer.join("ours")
        assert meta.nbytes > MAX_PAYLOAD
        tensors = fdtc.weights_tensors(meta, weights)
        assert all(np.isfinite(t).all() for t in tensors.values())
        peer.sock.close()
    finally:
        coord.stop()
