"""FdtcConnection: the lifecycle tables of all three roles behind receive_data / next_event / send.

No sockets: the two ends of a link hand each other the bytes ``send`` returned.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry.wire import fdtc_lifecycle
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import (
    Assign,
    Checkpoint,
    Compression,
    ControlAck,
    Dataset,
    Deregister,
    DType,
    Error,
    ErrorCode,
    FdtcDecoder,
    Gradients,
    GradientsAck,
    HardwareProfile,
    Heartbeat,
    HeartbeatAck,
    Message,
    ModelConfigMsg,
    MsgType,
    Pause,
    Register,
    RegisterAck,
    Resume,
    Shutdown,
    Start,
    Status,
    StatusReq,
    SwarmState,
    SwarmStatus,
    Sync,
    TensorMeta,
    Weights,
    WeightsMeta,
    WeightsReq,
    encode,
)
from foundry.wire.fdtc_connection import ConnectionClosed, FdtcConnection
from foundry.wire.fdtc_lifecycle import ADMIN_REQUESTS, TABLES, Direction, Link, LinkState, Role


def _register() -> Register:
    return Register("w1", 1, HardwareProfile.RPI4_4G, 4, 2048, 8)


def _ack(accepted: bool = True) -> RegisterAck:
    return RegisterAck(accepted, 0, 1, 8, 1, Compression.NONE, 0.0, 0)


def _meta() -> WeightsMeta:
    return WeightsMeta(0, 0.5, (TensorMeta("t", (2,), DType.F32),))


def _weights() -> Weights:
    return Weights(bytes(8))


def _gradients() -> Gradients:
    return Gradients("w1", 0, 1, Compression.NONE, 8, bytes(8))


def _model_config() -> ModelConfigMsg:
    return ModelConfigMsg(259, 256, 64, 2, 4, 2, 128, 4, 2, 0, 10000.0, 1e-5)


def pass_bytes(pieces: list[bytes | memoryview], to: FdtcConnection, *, chunk: int = 0) -> list:
    """Hand ``pieces`` to ``to`` (whole, or ``chunk`` bytes at a time); the events out."""
    data = b"".join(pieces)
    events = []
    step = chunk or max(1, len(data))
    for i in range(0, len(data), step):
        to.receive_data(data[i : i + step])
        while (event := to.next_event()) is not None:
            events.append(event)
    return events


@pytest.mark.parametrize("chunk", [0, 1, 7])
def test_worker_and_coordinator_happy_path(chunk: int) -> None:
    worker, coord = FdtcConnection(Role.WORKER), FdtcConnection(Role.COORDINATOR)
    got = pass_bytes(worker.send(Dataset(1, bytes(32)), _register()), coord, chunk=chunk)
    assert [type(m) for m in got] == [Dataset, Register]
    assert coord.state is LinkState.REGISTERED and worker.state is LinkState.REGISTERED
    got = pass_bytes(coord.send(_ack(), _model_config()), worker, chunk=chunk)
    assert [type(m) for m in got] == [RegisterAck, ModelConfigMsg]
    pass_bytes(worker.send(WeightsReq(), Heartbeat("w1", 0, 1.0, 0.0)), coord, chunk=chunk)
    got = pass_bytes(coord.send(HeartbeatAck(0), _meta(), _weights()), worker, chunk=chunk)
    assert got[-1] == _weights()
    assert coord.state is LinkState.READY and worker.state is LinkState.READY
    for _ in range(2):
        pass_bytes(coord.send(Assign(0, 0, 4, 1, 0, 1, 64, 4), Start()), worker, chunk=chunk)
        assert pass_bytes(worker.send(_gradients()), coord, chunk=chunk) == [_gradients()]
        pass_bytes(coord.send(GradientsAck(1, True), _meta(), _weights()), worker, chunk=chunk)
    pass_bytes(coord.send(Shutdown()), worker, chunk=chunk)
    assert worker.state is LinkState.STOPPING
    pass_bytes(worker.send(Deregister()), coord, chunk=chunk)
    assert worker.state is LinkState.CLOSED and coord.state is LinkState.CLOSED


def test_admin_link() -> None:
    admin, coord = FdtcConnection(Role.ADMIN), FdtcConnection(Role.COORDINATOR)
    assert pass_bytes(admin.send(StatusReq()), coord) == [StatusReq()]
    assert coord.state is LinkState.ADMIN and admin.state is LinkState.ADMIN
    status = SwarmStatus(0, 10, SwarmState.TRAINING, 2.0, 2.5, 8.0, 0.5, 0, ())
    assert pass_bytes(coord.send(status), admin) == [status]
    for request in (Pause(), Start(), Shutdown()):
        pass_bytes(admin.send(request), coord)
        assert pass_bytes(coord.send(ControlAck(request.TYPE, True, 0, "ok")), admin)
    with pytest.raises(LocalProtocolError, match="cannot send REGISTER on a admin link"):
        admin.send(_register())
    assert admin.state is LinkState.CLOSED  # our own misstep ends the connection


def test_message_out_of_order_is_raised_by_the_connection() -> None:
    coord = FdtcConnection(Role.COORDINATOR)
    coord.receive_data(encode(Heartbeat("w1", 0, 0.0, 0.0)))
    with pytest.raises(FdtcProtocolError, match="HEARTBEAT is not allowed on a connected") as exc:
        coord.next_event()
    assert exc.value.error_code == ErrorCode.NOT_REGISTERED
    with pytest.raises(FdtcProtocolError, match="HEARTBEAT"):  # and it stays raised
        coord.next_event()
    coord.receive_data(encode(_register()))  # nothing more is decoded
    with pytest.raises(FdtcProtocolError):
        coord.next_event()
    with pytest.raises(LocalProtocolError, match="send ERROR and close"):
        coord.send(_ack())
    frame = b"".join(coord.send(Error(int(exc.value.error_code), str(exc.value))))
    assert frame == encode(Error(int(ErrorCode.NOT_REGISTERED), str(exc.value)))


def test_gradients_before_weights_is_unexpected() -> None:
    coord = FdtcConnection(Role.COORDINATOR)
    pass_bytes([encode(_register())], coord)
    coord.receive_data(encode(_gradients()))
    with pytest.raises(FdtcProtocolError, match="GRADIENTS") as exc:
        coord.next_event()
    assert exc.value.error_code == ErrorCode.UNEXPECTED


def test_weights_need_their_meta_first() -> None:
    worker = FdtcConnection(Role.WORKER)
    worker.send(_register())
    worker.receive_data(encode(_weights()))
    with pytest.raises(FdtcProtocolError, match="WEIGHTS without a WEIGHTS_META"):
        worker.next_event()
    coord = FdtcConnection(Role.COORDINATOR)
    pass_bytes([encode(_register())], coord)
    with pytest.raises(LocalProtocolError, match="WEIGHTS without a WEIGHTS_META"):
        coord.send(_weights())
    coord = FdtcConnection(Role.COORDINATOR)
    pass_bytes([encode(_register())], coord)
    coord.send(_meta(), _weights())
    with pytest.raises(LocalProtocolError, match="WEIGHTS without a WEIGHTS_META"):
        coord.send(_weights())  # one WEIGHTS_META announces one WEIGHTS


def test_worker_may_not_send_gradients_before_weights() -> None:
    worker = FdtcConnection(Role.WORKER)
    worker.send(_register())
    with pytest.raises(LocalProtocolError, match="cannot send GRADIENTS on a registered link"):
        worker.send(_gradients())
    assert worker.state is LinkState.CLOSED


def test_refusal_reaches_a_worker_that_only_sent_dataset() -> None:
    worker, coord = FdtcConnection(Role.WORKER), FdtcConnection(Role.COORDINATOR)
    pass_bytes(worker.send(Dataset(1, bytes(32))), coord)
    refusal = coord.send(_ack(False), Error(int(ErrorCode.DATA_MISMATCH), "other data"))
    assert [type(m) for m in pass_bytes(refusal, worker)] == [RegisterAck, Error]


def test_end_of_stream() -> None:
    conn = FdtcConnection(Role.COORDINATOR)
    conn.receive_data(encode(_register()))
    conn.receive_data(b"")
    assert conn.next_event() == _register()  # what came before the end still comes out
    assert conn.next_event() == ConnectionClosed()
    assert conn.next_event() == ConnectionClosed()
    assert conn.state is LinkState.CLOSED
    with pytest.raises(LocalProtocolError):
        conn.receive_data(b"x")
    half = FdtcConnection(Role.COORDINATOR)
    half.receive_data(encode(_register())[:20])
    assert half.next_event() is None
    assert half.buffered == 20
    half.receive_data(b"")
    with pytest.raises(FdtcProtocolError, match="mid-frame"):
        half.next_event()


def test_seed_only_worker_gets_the_control_messages() -> None:
    """START, PAUSE, RESUME, CHECKPOINT and SHUTDOWN go to every registered worker."""
    controls = (MsgType.START, MsgType.PAUSE, MsgType.RESUME, MsgType.CHECKPOINT)
    for role, direction in ((Role.COORDINATOR, Direction.SENT), (Role.WORKER, Direction.RECEIVED)):
        table = TABLES[role]
        for state in (LinkState.REGISTERED, LinkState.READY):
            for t in controls:
                assert table[state, direction, t] is state
            assert table[state, direction, MsgType.SHUTDOWN] is LinkState.STOPPING
    assert {t for (s, _, t) in TABLES[Role.ADMIN] if s is LinkState.ADMIN} >= ADMIN_REQUESTS


# Each side's script, in its own order. A step is taken when the side's own table allows it
# (and, for the worker's DEREGISTER, once it has seen SHUTDOWN, as the service does).
COORD_SCRIPT: tuple[Message, ...] = (
    _ack(),
    _model_config(),
    _meta(),
    _weights(),
    Assign(0, 0, 4, 1, 0, 1, 64, 4),
    Pause(),
    GradientsAck(1, True),
    StatusReq(),
    _meta(),
    _weights(),
    Shutdown(),
)
WORKER_SCRIPT: tuple[Message, ...] = (
    Dataset(1, bytes(32)),
    _register(),
    WeightsReq(),
    Heartbeat("w1", 0, 1.0, 0.0),
    _gradients(),
    Heartbeat("w1", 0, 1.0, 0.0),
    _gradients(),
    Deregister(),
)


def _may_send(conn: FdtcConnection, msg: Message) -> bool:
    if msg.TYPE is MsgType.DEREGISTER:
        return conn.state is LinkState.STOPPING
    return (conn.state, Direction.SENT, msg.TYPE) in TABLES[conn.role]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_crossing_directions_never_break_the_tables(data: st.DataObject) -> None:
    """Whatever the interleaving of the two directions, each side admits what the other sent."""
    sides = {Role.COORDINATOR: list(COORD_SCRIPT), Role.WORKER: list(WORKER_SCRIPT)}
    conns = {role: FdtcConnection(role) for role in sides}
    in_flight: dict[Role, list[bytes]] = {Role.COORDINATOR: [], Role.WORKER: []}  # towards role
    peer = {Role.COORDINATOR: Role.WORKER, Role.WORKER: Role.COORDINATOR}
    for _ in range(200):
        moves = [
            ("send", r) for r, script in sides.items() if script and _may_send(conns[r], script[0])
        ]
        moves += [("deliver", r) for r, q in in_flight.items() if q]
        if not moves:
            break
        kind, role = data.draw(st.sampled_from(moves))
        if kind == "send":
            in_flight[peer[role]].append(b"".join(conns[role].send(sides[role].pop(0))))
        else:
            frame = in_flight[role].pop(0)
            cut = data.draw(st.integers(0, len(frame)))  # delivered in two reads
            for part in (frame[:cut], frame[cut:]):
                if part:
                    conns[role].receive_data(part)
                while conns[role].next_event() is not None:
                    pass
    assert sides == {Role.COORDINATOR: [], Role.WORKER: []}
    assert conns[Role.WORKER].state is LinkState.CLOSED
    assert conns[Role.COORDINATOR].state is LinkState.CLOSED


def test_the_seed_only_sequence_of_protocol_md() -> None:
    """docs/protocol.md "A seed-only worker, from REGISTER to SHUTDOWN", through both ends."""
    worker, coord = FdtcConnection(Role.WORKER), FdtcConnection(Role.COORDINATOR)
    pass_bytes(worker.send(_register()), coord)
    pass_bytes(coord.send(_ack()), worker)
    pass_bytes(worker.send(WeightsReq()), coord)
    pass_bytes(coord.send(_meta(), _weights(), Start()), worker)
    for _ in range(2):
        pass_bytes(worker.send(_gradients()), coord)
        pass_bytes(coord.send(GradientsAck(1, True), Sync()), worker)
        pass_bytes(worker.send(WeightsReq(), Heartbeat("w1", 1, 1.0, 0.0)), coord)
        pass_bytes(coord.send(HeartbeatAck(1), _meta(), _weights()), worker)
    pass_bytes(coord.send(Pause(), Resume(), Checkpoint(), StatusReq()), worker)
    pass_bytes(worker.send(Status("w1", 1, 8, 1.0, 1.0, 1.0, 1, True)), coord)
    pass_bytes(coord.send(Checkpoint(), Shutdown()), worker)
    pass_bytes(worker.send(Deregister()), coord)
    assert worker.state is LinkState.CLOSED and coord.state is LinkState.CLOSED
    # A worker that registers after the end is told SHUTDOWN at once.
    worker, coord = FdtcConnection(Role.WORKER), FdtcConnection(Role.COORDINATOR)
    pass_bytes(worker.send(_register()), coord)
    assert [type(m) for m in pass_bytes(coord.send(_ack(), Shutdown()), worker)] == [
        RegisterAck,
        Shutdown,
    ]
    assert worker.state is LinkState.STOPPING


def test_each_port_of_the_coordinator_serves_one_kind_of_link() -> None:
    """The worker port refuses an admin request as a message before REGISTER; the admin port
    refuses REGISTER as a message no admin client sends."""
    worker_port = FdtcConnection(Role.COORDINATOR, link=Link.WORKER)
    worker_port.receive_data(encode(StatusReq()))
    with pytest.raises(FdtcProtocolError, match="STATUS_REQ is not allowed") as exc:
        worker_port.next_event()
    assert exc.value.error_code == ErrorCode.NOT_REGISTERED
    admin_port = FdtcConnection(Role.COORDINATOR, link=Link.ADMIN)
    admin_port.receive_data(encode(_register()))
    with pytest.raises(FdtcProtocolError, match="REGISTER is not allowed") as exc:
        admin_port.next_event()
    assert exc.value.error_code == ErrorCode.UNEXPECTED  # this link never waits for one
    admin_port = FdtcConnection(Role.COORDINATOR, link=Link.ADMIN)
    pass_bytes([encode(StatusReq()), encode(Start())], admin_port)
    assert admin_port.state is LinkState.ADMIN
    with pytest.raises(ValueError, match="only the coordinator"):
        FdtcConnection(Role.WORKER, link=Link.WORKER)


def test_dataset_comes_at_most_once() -> None:
    coord = FdtcConnection(Role.COORDINATOR, link=Link.WORKER)
    coord.receive_data(encode(Dataset(1, bytes(32))) * 2)
    assert isinstance(coord.next_event(), Dataset)
    with pytest.raises(FdtcProtocolError, match="a second DATASET") as exc:
        coord.next_event()
    assert exc.value.error_code == ErrorCode.NOT_REGISTERED
    worker = FdtcConnection(Role.WORKER)
    worker.send(Dataset(1, bytes(32)))
    assert not worker.may_send(Dataset(1, bytes(32)))
    with pytest.raises(LocalProtocolError, match="second DATASET"):
        worker.send(Dataset(1, bytes(32)))


def test_may_send_follows_the_table_and_the_end_of_the_link() -> None:
    coord = FdtcConnection(Role.COORDINATOR, link=Link.WORKER)
    pass_bytes([encode(_register())], coord)
    assert coord.may_send(MsgType.WEIGHTS_META) and not coord.may_send(MsgType.WEIGHTS)
    assert not coord.may_send(MsgType.ASSIGN)  # no weights on this link yet
    coord.send(_meta(), _weights(), Shutdown())
    assert coord.may_send(MsgType.GRADIENTS_ACK)
    assert not coord.may_send(MsgType.CHECKPOINT)  # after SHUTDOWN, only a round's end
    assert not coord.over
    coord.receive_data(encode(_register()))
    with pytest.raises(FdtcProtocolError):
        coord.next_event()
    assert coord.over and not coord.may_send(MsgType.HEARTBEAT_ACK)
    closed = FdtcConnection(Role.COORDINATOR)
    closed.close()
    assert closed.over and not closed.may_send(MsgType.ERROR)


def test_the_connection_is_a_decoder_of_the_framing_interface() -> None:
    """feed / feed_eof / next_event / buffered: what the stream driver reads into."""
    conn = FdtcConnection(Role.COORDINATOR)
    frame = encode(_register())
    conn.feed(frame[:10])
    assert conn.buffered == 10 and conn.next_event() is None
    conn.feed(frame[10:])
    assert conn.next_event() == _register()
    conn.feed_eof()
    assert conn.next_event() == ConnectionClosed()


# docs/protocol.md "Lifecycle", the coordinator's table row by row: a state, the direction
# (received from the worker or admin client, sent by the coordinator), the types, and the state
# they lead to (the same state when no arrow).
_COORDINATOR_TABLE = """
CONNECTED  received DATASET BASE_MODEL ERROR
CONNECTED  received REGISTER -> REGISTERED
CONNECTED  received DEREGISTER -> CLOSED
CONNECTED  received START PAUSE RESUME CHECKPOINT SHUTDOWN STATUS_REQ EXPORT SWARM_DETAIL_REQ -> ADMIN
CONNECTED  sent     REGISTER_ACK ERROR
REGISTERED received HEARTBEAT STATUS WEIGHTS_REQ ERROR
REGISTERED received DEREGISTER -> CLOSED
REGISTERED sent     REGISTER_ACK MODEL_CONFIG BASE_MODEL TRAIN_PLAN HEARTBEAT_ACK STATUS_REQ WEIGHTS_META START SYNC CHECKPOINT PAUSE RESUME ERROR
REGISTERED sent     WEIGHTS -> READY
REGISTERED sent     SHUTDOWN -> STOPPING
READY      received HEARTBEAT STATUS WEIGHTS_REQ ERROR GRADIENTS WEIGHTS_DIGEST
READY      received DEREGISTER -> CLOSED
READY      sent     REGISTER_ACK MODEL_CONFIG BASE_MODEL TRAIN_PLAN HEARTBEAT_ACK STATUS_REQ WEIGHTS_META START SYNC CHECKPOINT PAUSE RESUME ERROR WEIGHTS ASSIGN LOCAL_ASSIGN UPDATE GRADIENTS_ACK
READY      sent     SHUTDOWN -> STOPPING
STOPPING   received HEARTBEAT STATUS WEIGHTS_REQ ERROR GRADIENTS WEIGHTS_DIGEST
STOPPING   received DEREGISTER -> CLOSED
STOPPING   sent     GRADIENTS_ACK HEARTBEAT_ACK SHUTDOWN ERROR
ADMIN      received START PAUSE RESUME CHECKPOINT SHUTDOWN STATUS_REQ EXPORT SWARM_DETAIL_REQ ERROR
ADMIN      sent     CONTROL_ACK SWARM_STATUS SWARM_DETAIL ERROR
"""  # noqa: E501


def _table_of(text: str) -> dict[tuple[LinkState, Direction, MsgType], LinkState]:
    table = {}
    for line in text.strip().splitlines():
        words = line.split()
        state, direction = LinkState[words[0]], Direction(words[1])
        to = LinkState[words[-1]] if "->" in words else state
        for name in words[2 : words.index("->") if "->" in words else None]:
            table[state, direction, MsgType[name]] = to
    return table


def test_lifecycle_tables_are_the_documented_ones() -> None:
    """Every role's table entry by entry (the tables are built at import, so only a comparison
    with the documented table catches a mistake in building them)."""
    coordinator = _table_of(_COORDINATOR_TABLE)
    assert dict(TABLES[Role.COORDINATOR]) == coordinator
    swap = {Direction.RECEIVED: Direction.SENT, Direction.SENT: Direction.RECEIVED}
    # The admin link: its own rows and the ERROR either side may send before anything else.
    admin = {
        k: v
        for k, v in coordinator.items()
        if LinkState.ADMIN in (k[0], v) or (k[0] is LinkState.CONNECTED and k[2] is MsgType.ERROR)
    }
    worker = {k: v for k, v in coordinator.items() if LinkState.ADMIN not in (k[0], v)}
    assert len(admin) == 8 + 9 + 4 + 2 and len(worker) == len(coordinator) - 8 - 9 - 4
    assert dict(fdtc_lifecycle._LINK_TABLES[Link.ADMIN]) == admin
    assert dict(fdtc_lifecycle._LINK_TABLES[Link.WORKER]) == worker
    # The peers' tables: their link's rows with the directions swapped.
    assert dict(TABLES[Role.WORKER]) == {(s, swap[d], m): to for (s, d, m), to in worker.items()}
    assert dict(TABLES[Role.ADMIN]) == {(s, swap[d], m): to for (s, d, m), to in admin.items()}
    assert {
        MsgType.START,
        MsgType.PAUSE,
        MsgType.RESUME,
        MsgType.CHECKPOINT,
        MsgType.SHUTDOWN,
        MsgType.STATUS_REQ,
        MsgType.EXPORT,
        MsgType.SWARM_DETAIL_REQ,
    } == ADMIN_REQUESTS


def test_errors_stay_raised_with_their_code_and_text() -> None:
    coord = FdtcConnection(Role.COORDINATOR)
    coord.receive_data(encode(Heartbeat("w1", 0, 0.0, 0.0)))
    first = (
        "HEARTBEAT is not allowed on a connected link (expected one of: BASE_MODEL, "
        "CHECKPOINT, DATASET, DEREGISTER, ERROR, EXPORT, PAUSE, REGISTER, RESUME, "
        "SHUTDOWN, START, STATUS_REQ, SWARM_DETAIL_REQ)"
    )
    for _ in range(2):  # the second time too: the same text and the same ERROR code
        with pytest.raises(FdtcProtocolError) as exc:
            coord.next_event()
        assert str(exc.value) == first
        assert exc.value.error_code == ErrorCode.NOT_REGISTERED
    conn = FdtcConnection(Role.COORDINATOR)
    conn.feed_eof()
    with pytest.raises(LocalProtocolError) as info:
        conn.receive_data(b"x")
    assert str(info.value) == "receive_data after the end of the stream"
    half = FdtcConnection(Role.COORDINATOR)
    half.receive_data(encode(_register())[:20])
    half.feed_eof()
    with pytest.raises(FdtcProtocolError) as exc:
        half.next_event()
    assert (
        str(exc.value) == "the peer closed the connection in mid-frame (20 bytes of a frame "
        "received)"
    )


def test_decoder_end_of_stream_in_mid_frame_then_closed() -> None:
    dec = FdtcDecoder()
    dec.feed(encode(_register())[:5])
    with pytest.raises(FdtcProtocolError) as exc:
        dec.feed_eof()
    assert str(exc.value) == "connection closed in the middle of a frame (5 bytes of it received)"
    again = (
        "decoder already failed and is closed: connection closed in the middle of a frame "
        "(5 bytes of it received)"
    )
    for call in (dec.next_event, dec.feed_eof, lambda: dec.feed(b"x")):
        with pytest.raises(FdtcProtocolError) as exc:
            call()
        assert str(exc.value) == again
    dec = FdtcDecoder()
    dec.feed_eof()  # between frames: nothing wrong
    assert dec.next_event() is None
