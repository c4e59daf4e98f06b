"""FDTC codec: the struct sizes and the golden bytes of every message (tests/fdtc_golden.py)."""

from __future__ import annotations

import pytest
from fdtc_golden import GOLDEN, MESSAGES, hexb

from foundry.wire.fdtc import (
    HEADER,
    MESSAGE_TYPES,
    Assign,
    BaseModel,
    Checkpoint,
    ControlAck,
    Dataset,
    Deregister,
    Error,
    Export,
    Gradients,
    GradientsAck,
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
    SwarmDetail,
    SwarmDetailRow,
    SwarmStatus,
    SwarmStatusRow,
    Sync,
    TensorMeta,
    WeightsMeta,
    WeightsReq,
    decode,
    encode,
    encode_parts,
    msg_type_name,
)


def test_struct_sizes() -> None:
    assert HEADER.size == 9
    assert Register.LAYOUT.size == 85
    assert RegisterAck.LAYOUT.size == 29
    assert Heartbeat.LAYOUT.size == 76
    assert WeightsMeta.HEAD.size == 12
    assert TensorMeta.STRUCT.size == 141
    assert Gradients.LAYOUT.size == 80
    assert Status.LAYOUT.size == 93
    assert Error.LAYOUT.size == 260
    assert HeartbeatAck.LAYOUT.size == 4
    assert GradientsAck.LAYOUT.size == 5
    assert Assign.LAYOUT.size == 36
    assert ModelConfigMsg.LAYOUT.size == 52
    assert Dataset.LAYOUT.size == 40
    assert BaseModel.LAYOUT.size == 73
    assert SwarmStatus.HEAD.size == 37
    assert SwarmStatusRow.LAYOUT.size == 93
    assert ControlAck.LAYOUT.size == 262
    assert Export.LAYOUT.size == 257
    assert SwarmDetail.HEAD.size == 277
    assert SwarmDetailRow.LAYOUT.size == 20
    for cls in (
        Deregister,
        WeightsReq,
        Start,
        Sync,
        Checkpoint,
        Shutdown,
        Pause,
        Resume,
        StatusReq,
    ):
        assert cls.LAYOUT.size == 0


def test_golden_covers_every_type_and_registry_is_complete() -> None:
    # FRAGMENT is never a message of its own on a stream (the decoder reassembles what it
    # carries): its golden bytes are in test_fdtc_fragments_codec.py.
    assert {msg.TYPE for msg in MESSAGES} == set(MsgType) - {MsgType.FRAGMENT}
    assert set(MESSAGE_TYPES) == set(MsgType)
    for code, cls in MESSAGE_TYPES.items():
        assert cls.TYPE is code


@pytest.mark.parametrize(("msg", "frame"), GOLDEN, ids=[m.TYPE.name for m in MESSAGES])
def test_golden_bytes(msg: Message, frame: bytes) -> None:
    assert encode(msg) == frame
    assert b"".join(encode_parts(msg)) == frame
    assert msg.payload() == frame[9:]
    assert decode(frame) == msg


def test_seed_peers_send_empty_acks() -> None:
    assert decode(hexb("43544446 11 00000000")) == HeartbeatAck(global_step=0)
    assert decode(hexb("43544446 31 00000000")) == GradientsAck(global_step=0, accepted=True)


def test_msg_type_name() -> None:
    assert msg_type_name(0x01) == "REGISTER"
    assert msg_type_name(0x31) == "GRADIENTS_ACK"
    assert msg_type_name(0x60) == "ASSIGN"
    assert msg_type_name(0xFF) == "ERROR"
    assert msg_type_name(0x99) == "UNKNOWN"
