"""FDTC link lifecycle: the order of messages a worker, a seed-only peer and an admin link keep."""

from __future__ import annotations

import pytest

from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import Dataset, ErrorCode, FileType, MsgType, StatusReq
from foundry.wire.fdtc_lifecycle import (
    ADMIN_REQUESTS,
    TRANSITIONS,
    Direction,
    Lifecycle,
    LinkState,
    Role,
)


def test_worker_lifecycle_happy_path() -> None:
    link = Lifecycle(Role.COORDINATOR)
    assert link.receive(Dataset(1, bytes(32))) is LinkState.CONNECTED
    assert link.receive(MsgType.REGISTER) is LinkState.REGISTERED
    for t in (MsgType.REGISTER_ACK, MsgType.MODEL_CONFIG):
        link.send(t)
    link.receive(MsgType.WEIGHTS_REQ)
    link.receive(MsgType.HEARTBEAT)
    link.send(MsgType.WEIGHTS_META)
    assert link.send(MsgType.WEIGHTS) is LinkState.READY
    for _ in range(3):
        link.send(MsgType.ASSIGN)
        link.receive(MsgType.GRADIENTS)
        link.send(MsgType.GRADIENTS_ACK)
        link.send(MsgType.WEIGHTS_META)
        link.send(MsgType.WEIGHTS)
    link.send(MsgType.PAUSE)
    link.receive(MsgType.GRADIENTS)  # sent before the worker saw PAUSE
    assert link.send(MsgType.SHUTDOWN) is LinkState.STOPPING
    link.receive(MsgType.GRADIENTS)  # still in flight
    assert link.receive(MsgType.DEREGISTER) is LinkState.CLOSED


def test_seed_only_worker_lifecycle() -> None:
    link = Lifecycle(Role.COORDINATOR)
    link.receive(MsgType.REGISTER)
    link.send(MsgType.REGISTER_ACK)
    link.receive(MsgType.WEIGHTS_REQ)
    link.send(MsgType.WEIGHTS_META)
    link.send(MsgType.WEIGHTS)
    link.send(MsgType.START)
    link.receive(MsgType.GRADIENTS)
    link.send(MsgType.GRADIENTS_ACK)
    link.send(MsgType.STATUS_REQ)
    link.receive(MsgType.STATUS)
    assert link.state is LinkState.READY


def test_lifecycle_violations() -> None:
    link = Lifecycle(Role.COORDINATOR)
    with pytest.raises(FdtcProtocolError, match="HEARTBEAT is not allowed on a connected") as exc:
        link.receive(MsgType.HEARTBEAT)
    assert exc.value.error_code == ErrorCode.NOT_REGISTERED
    link.receive(MsgType.REGISTER)
    with pytest.raises(FdtcProtocolError, match="GRADIENTS") as exc:
        link.receive(MsgType.GRADIENTS)  # no weights on this link yet
    assert exc.value.error_code == ErrorCode.UNEXPECTED
    with pytest.raises(FdtcProtocolError):
        link.receive(MsgType.DATASET)  # only before REGISTER
    with pytest.raises(FdtcProtocolError):
        link.receive(MsgType.REGISTER)
    with pytest.raises(LocalProtocolError, match="cannot send ASSIGN on a registered link"):
        link.send(MsgType.ASSIGN)
    link.close()
    with pytest.raises(FdtcProtocolError, match="expected one of: nothing"):
        link.receive(MsgType.HEARTBEAT)


def test_admin_lifecycle() -> None:
    link = Lifecycle(Role.COORDINATOR)
    assert link.receive(StatusReq()) is LinkState.ADMIN
    link.send(MsgType.SWARM_STATUS)
    for t in ADMIN_REQUESTS:
        link.receive(t)
        link.send(MsgType.CONTROL_ACK)
    with pytest.raises(FdtcProtocolError):
        link.receive(MsgType.REGISTER)
    with pytest.raises(LocalProtocolError):
        link.send(MsgType.WEIGHTS)


def test_transition_table_shape() -> None:
    open_states = set(LinkState) - {LinkState.CLOSED}
    for state in open_states:  # ERROR is legal both ways in every open state
        assert TRANSITIONS[state, Direction.RECEIVED, MsgType.ERROR] is state
        assert TRANSITIONS[state, Direction.SENT, MsgType.ERROR] is state
    assert not [key for key in TRANSITIONS if key[0] is LinkState.CLOSED]
    reachable = {LinkState.CONNECTED} | set(TRANSITIONS.values())
    assert reachable == set(LinkState)


def test_exports_file_types_are_the_gguf_writers_in_order() -> None:
    from foundry.model.formats.gguf_model import FILE_DTYPES

    assert tuple(t.name.lower() for t in FileType) == FILE_DTYPES
    assert [int(t) for t in FileType] == list(range(len(FILE_DTYPES)))
