"""FRAGMENT: messages larger than one FDTC frame, cut by ``encode_parts`` and reassembled by the
decoder, admitted by the connection only where the link's table takes the message, and timed
frame by frame by the stream.

Here the connection, bytes handed across without sockets: which links take fragments, and
when.
"""

from __future__ import annotations

import pytest
from fragments import BIG, G, W, frag, frames_of, gradients

from foundry.wire import fdtc
from foundry.wire.errors import FdtcProtocolError
from foundry.wire.fdtc import (
    Compression,
    Dataset,
    ErrorCode,
    HardwareProfile,
    MsgType,
    Register,
    RegisterAck,
    Update,
    Weights,
    WeightsMeta,
    weights_messages,
)
from foundry.wire.fdtc_connection import FdtcConnection
from foundry.wire.fdtc_lifecycle import Link, LinkState, Role


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
    coord.receive_data(frag(kind, 12000, 0, bytes(4096)))
    with pytest.raises(FdtcProtocolError, match=problem) as info:
        coord.next_event()
    assert info.value.error_code == code


def test_seed_and_admin_links_take_no_fragments() -> None:
    seed = FdtcConnection(Role.COORDINATOR, link=Link.WORKER)  # no DATASET: no agreement
    admin = FdtcConnection(Role.COORDINATOR, link=Link.ADMIN)
    for conn in (seed, admin):
        conn.receive_data(frag(W, 12000, 0, bytes(4096)))
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
