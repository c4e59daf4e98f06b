"""FDTC codec: every bound at its value and one past it, tables of docs/protocol.md."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from fdtc_golden import hexb, replace_at, z

from foundry.hardware import profile_accumulation_steps, profile_batch_size
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import (
    MAX_PAYLOAD,
    Compression,
    DType,
    ErrorCode,
    FdtcDecoder,
    Gradients,
    HardwareProfile,
    MsgType,
    RegisterAck,
    Start,
    SwarmState,
    SwarmStatus,
    SwarmStatusRow,
    TensorMeta,
    Weights,
    WeightsMeta,
    WorkerState,
    decode,
    encode,
    profile_name,
    train_plan_flags,
    weights_messages,
    weights_tensors,
)
from foundry.wire.fdtc_lifecycle import Lifecycle, Link, LinkState, Role
from foundry.wire.layout import BOOL, I32, U8, U16, U32, U64, Bytes, Str


def _row(worker_id: str, step: int) -> SwarmStatusRow:
    return SwarmStatusRow(
        worker_id=worker_id,
        profile=HardwareProfile.RPI3,
        state=WorkerState.IDLE,
        batch_size=1,
        accumulation_steps=8,
        samples_per_sec=1.0,
        loss=2.0,
        local_step=step,
        seconds_since_heartbeat=0.25,
    )


def test_rows_and_tensors_are_stored_as_tuples_and_decode_in_order() -> None:
    rows = [_row("a", 1), _row("b", 2), _row("c", 3)]
    status = SwarmStatus(
        global_step=3,
        max_steps=100,
        state=SwarmState.TRAINING,
        train_loss=2.0,
        val_loss=2.5,
        samples_per_sec=8.0,
        learning_rate=0.5,
        samples_total=96,
        rows=rows,  # type: ignore[arg-type]
    )
    assert status.rows == tuple(rows)
    assert decode(encode(status)) == status
    tensors = [TensorMeta("a", (2,)), TensorMeta("b", (3, 1), DType.F16), TensorMeta("c", ())]
    meta = WeightsMeta(global_step=1, learning_rate=0.5, tensors=tensors)  # type: ignore[arg-type]
    assert meta.tensors == tuple(tensors)
    assert decode(encode(meta)) == meta
    with pytest.raises(LocalProtocolError) as exc:
        SwarmStatus(3, 100, SwarmState.TRAINING, 2.0, 2.5, 8.0, 0.5, 96, rows=("x",))  # type: ignore[arg-type]
    assert str(exc.value) == "rows must hold SwarmStatusRow, got 'x'"


def test_weights_tensors_of_three_sizes() -> None:
    tensors = {"a": np.arange(2.0), "b": np.arange(3.0) + 10, "c": np.arange(4.0) + 20}
    meta, weights = weights_messages(tensors, global_step=1, learning_rate=0.5)
    assert [t.dtype for t in meta.tensors] == [DType.F32] * 3
    out = weights_tensors(meta, weights)
    for name, t in tensors.items():
        np.testing.assert_array_equal(out[name], t.astype(np.float32))


def test_data_sections_are_flat_read_only_views() -> None:
    arr = np.array([0.5, 0.25], np.float32)
    for msg in (Weights(arr), Gradients("w", 3, 1, Compression.NONE, 8, arr)):  # type: ignore[arg-type]
        assert isinstance(msg.data, memoryview) and msg.data.format == "B"
        assert msg.data.readonly and msg.data == hexb("0000003f 0000803e")
    with pytest.raises(LocalProtocolError) as exc:
        Gradients("w", 3, 1, Compression.NONE, 8, "x")  # type: ignore[arg-type]
    assert str(exc.value) == "data must be a bytes-like object, got 'x'"
    # A GRADIENTS with an empty data section: the header alone is a whole payload.
    empty = Gradients("w", 3, 0, Compression.NONE, 0, b"")
    assert decode(hexb("43544446 30 50000000", "77", z(63), "03000000", z(12))) == empty


def test_tensor_meta_bounds_exact() -> None:
    assert TensorMeta("t", (2**64 - 1,)).numel == 2**64 - 1
    with pytest.raises(LocalProtocolError) as exc:
        TensorMeta("t", (2**32, 2**32))
    assert str(exc.value) == "'t' has more than 2**64-1 elements"
    with pytest.raises(LocalProtocolError) as exc:
        TensorMeta("t", 3)  # type: ignore[arg-type]
    assert str(exc.value) == "shape of 't' must be a tuple, got 3"
    with pytest.raises(LocalProtocolError) as exc:
        TensorMeta("t", (1, -1))
    assert str(exc.value) == "shape of 't' -1 is outside 0..18446744073709551615"
    with pytest.raises(LocalProtocolError) as exc:
        TensorMeta("x" * 64, (1,))
    assert str(exc.value) == (
        "name is 64 bytes of UTF-8; char[64] holds at most 63 plus the terminating NUL"
    )
    frame = encode(WeightsMeta(global_step=0, learning_rate=0.0, tensors=(TensorMeta("t", ()),)))
    bad = replace_at(frame, 12, b"x" * 64)  # the tensor name loses its NUL
    d = FdtcDecoder()
    d.feed(bad)
    with pytest.raises(FdtcProtocolError) as err:
        d.next_event()
    assert str(err.value) == (
        "bad WEIGHTS_META payload: tensor name (char[64]) is not NUL-terminated"
    )
    assert err.value.error_code == ErrorCode.BAD_FRAME


def test_register_ack_topk_ratio_bounds() -> None:
    for ratio in (0.0, 1.0):
        assert RegisterAck(True, 0, 1, 1, 1, Compression.TOPK, ratio, 0).topk_ratio == ratio
    for ratio in (-1e-6, 1.0000001):
        with pytest.raises(LocalProtocolError, match="topk_ratio"):
            RegisterAck(True, 0, 1, 1, 1, Compression.TOPK, ratio, 0)


def test_over_the_limit_codes() -> None:
    """Over this decoder's own limit but within the protocol's: BUSY (a smaller receiver); over
    the protocol's: BAD_FRAME."""
    for length, code in ((MAX_PAYLOAD, ErrorCode.BUSY), (MAX_PAYLOAD + 1, ErrorCode.BAD_FRAME)):
        d = FdtcDecoder(max_payload=100)
        d.feed(hexb("43544446 21") + struct.pack("<I", length))
        with pytest.raises(FdtcProtocolError) as exc:
            d.next_event()
        assert exc.value.error_code == code


def test_layout_kinds_at_their_bounds_exact() -> None:
    for kind, lo, hi in (
        (U8, 0, 255),
        (U16, 0, 65535),
        (U32, 0, 2**32 - 1),
        (U64, 0, 2**64 - 1),
        (I32, -(2**31), 2**31 - 1),
    ):
        assert kind.check("f", lo) == lo and kind.check("f", hi) == hi
        for bad in (lo - 1, hi + 1):
            with pytest.raises(LocalProtocolError) as exc:
                kind.check("f", bad)
            assert str(exc.value) == f"f {bad} is outside {lo}..{hi}"
        with pytest.raises(LocalProtocolError) as exc:
            kind.check("f", 1.0)
        assert str(exc.value) == "f must be an integer, got 1.0"
    with pytest.raises(LocalProtocolError) as exc:
        Str(4).check("s", "\udc80")
    assert str(exc.value) == (
        "s is not encodable as UTF-8: 'utf-8' codec can't encode character "
        "'\\udc80' in position 0: surrogates not allowed"
    )
    with pytest.raises(LocalProtocolError) as exc:
        Bytes(2).check("b", "ab")
    assert str(exc.value) == "b must be bytes, got 'ab'"
    with pytest.raises(LocalProtocolError) as exc:
        Bytes(2).check("b", b"abc")
    assert str(exc.value) == "b must be exactly 2 bytes, got b'abc'"
    with pytest.raises(LocalProtocolError) as exc:
        BOOL.check("x", 2)
    assert str(exc.value) == "x must be a bool (0 or 1), got 2"


def test_weights_and_dataset_order_exact() -> None:
    coord = Lifecycle(Role.COORDINATOR)
    coord.receive(MsgType.REGISTER)
    with pytest.raises(LocalProtocolError) as local:
        coord.send(MsgType.WEIGHTS)
    assert str(local.value) == "cannot send WEIGHTS without a WEIGHTS_META before it"
    coord.send(MsgType.WEIGHTS_META)
    coord.send(MsgType.WEIGHTS)
    assert not coord.may_send(MsgType.WEIGHTS)  # one WEIGHTS per WEIGHTS_META
    worker = Lifecycle(Role.WORKER)
    assert worker.may_send(MsgType.DATASET)
    worker.send(MsgType.DATASET)
    assert worker.may_send(MsgType.REGISTER) and not worker.may_send(MsgType.DATASET)
    with pytest.raises(LocalProtocolError) as local:
        worker.send(MsgType.DATASET)
    assert str(local.value) == "cannot send a second DATASET on one link"
    worker.send(MsgType.REGISTER)
    with pytest.raises(FdtcProtocolError) as exc:
        worker.receive(MsgType.WEIGHTS)
    assert str(exc.value) == "WEIGHTS without a WEIGHTS_META before it"
    assert exc.value.error_code == ErrorCode.UNEXPECTED
    coord = Lifecycle(Role.COORDINATOR)
    coord.receive(MsgType.DATASET)
    with pytest.raises(FdtcProtocolError) as exc:
        coord.receive(MsgType.DATASET)
    assert str(exc.value) == (
        "a second DATASET: the link announced its data already; REGISTER is next"
    )
    assert exc.value.error_code == ErrorCode.NOT_REGISTERED
    with pytest.raises(ValueError) as info:
        Lifecycle(Role.WORKER, link=Link.WORKER)
    assert str(info.value) == "only the coordinator serves more than one link, not worker"
    ported = Lifecycle(Role.COORDINATOR, link=Link.ADMIN)
    assert (ported.role, ported.link, ported.state) == (
        Role.COORDINATOR,
        Link.ADMIN,
        LinkState.CONNECTED,
    )


def test_profile_table_of_protocol_md() -> None:
    table = {  # docs/protocol.md "Hardware profiles": code, name, micro-batch, accumulation
        0: ("RPI3", 1, 8), 1: ("RPI4_2G", 2, 8), 2: ("RPI4_4G", 4, 4), 3: ("RPI4_8G", 8, 2),
        4: ("LAPTOP_LIGHT", 8, 4), 5: ("LAPTOP_MID", 16, 4), 6: ("DESKTOP_MID", 32, 4),
        7: ("DESKTOP_HEAVY", 64, 4), 8: ("SERVER", 128, 4), 9: ("UNKNOWN", 2, 4),
        10: ("UNKNOWN", 2, 4), 0xFFFFFFFF: ("UNKNOWN", 2, 4),  # unknown codes: as UNKNOWN
    }  # fmt: skip
    for code, row in table.items():
        assert (
            profile_name(code),
            profile_batch_size(code),
            profile_accumulation_steps(code),
        ) == row


def test_train_plan_flags_bits() -> None:
    assert train_plan_flags(overlap=False, qsgd_levels=0) == 0
    assert train_plan_flags(overlap=True, qsgd_levels=0) == 0x1
    assert train_plan_flags(overlap=False, qsgd_levels=127) == 0x7F00
    assert train_plan_flags(overlap=True, qsgd_levels=1) == 0x101
    for levels in (-1, 128, 255, 256):  # docs/protocol.md: 0 (the default) or 1..127
        with pytest.raises(LocalProtocolError) as exc:
            train_plan_flags(overlap=True, qsgd_levels=levels)
        assert str(exc.value) == (
            f"qsgd_levels {levels} does not fit TRAIN_PLAN's flags (0, the default, or 1..127)"
        )


def test_check_tensors_against_the_model() -> None:
    grads = Gradients("w", 1, 2, Compression.NONE, 4 * (6 + 4), bytes(40))
    grads.check_tensors([6, 4])
    with pytest.raises(FdtcProtocolError) as exc:
        grads.check_tensors([6, 4, 1])
    assert str(exc.value) == "GRADIENTS carries 2 tensors, the model has 3"
    assert exc.value.error_code == ErrorCode.MODEL_MISMATCH
    with pytest.raises(FdtcProtocolError) as exc:
        grads.check_tensors([6, 5])
    assert str(exc.value) == (
        "GRADIENTS says uncompressed_size 40, but the model's 2 tensors hold 11 f32 values = 44 "
        "bytes: the peer has another model or a bad encoder"
    )
    assert exc.value.error_code == ErrorCode.MODEL_MISMATCH


def test_decoder_limits_and_helpers_exact() -> None:
    d = FdtcDecoder(max_payload=0)  # the smallest limit: empty payloads only
    d.feed(encode(Start()))
    assert d.next_event() == Start()
    for limit in (-1, MAX_PAYLOAD + 1):
        with pytest.raises(LocalProtocolError) as local:
            FdtcDecoder(max_payload=limit)
        assert str(local.value) == f"max_payload {limit} is outside 0..{MAX_PAYLOAD}"
    with pytest.raises(FdtcProtocolError) as exc:
        decode(encode(Start()) + b"\x00")
    assert str(exc.value) == "trailing bytes after the first frame"
    with pytest.raises(LocalProtocolError) as local:
        Weights("abc")  # type: ignore[arg-type]
    assert str(local.value) == "data must be a bytes-like object, got 'abc'"


def test_weights_meta_head_fields_are_checked_after_the_skipped_count() -> None:
    """num_tensors (a property) is skipped; the fields after it are still checked."""
    with pytest.raises(LocalProtocolError) as local:
        WeightsMeta(global_step=2**32, learning_rate=0.5)
    assert str(local.value) == "global_step 4294967296 is outside 0..4294967295"
    assert WeightsMeta(global_step=1, learning_rate=1 / 3).learning_rate == 0.33333334
