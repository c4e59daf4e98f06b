"""FDTC codec: golden bytes for every message, the incremental decoder, limits, lifecycle.

Every golden frame below is written out by hand from foundry_swarm_protocol.h (packed,
little-endian, 4-byte enums, 1-byte bool, NUL-padded char[N]) and docs/protocol.md, not
produced by the code under test. ``z(n)`` is n zero bytes of padding.
"""

from __future__ import annotations

import math
import mmap
import struct
import time
from dataclasses import fields

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundry.hardware import profile_accumulation_steps, profile_batch_size
from foundry.model.spec.config import PRESETS, ModelConfig
from foundry.swarm.model_config import config_of, model_config_msg
from foundry.wire.errors import (
    FdtcProtocolError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from foundry.wire.fdtc import (
    HEADER,
    MAX_PAYLOAD,
    MESSAGE_TYPES,
    Assign,
    BaseModel,
    Checkpoint,
    Compression,
    ControlAck,
    Dataset,
    Deregister,
    DType,
    Error,
    ErrorCode,
    Export,
    FdtcDecoder,
    FileType,
    Gradients,
    GradientsAck,
    HardwareProfile,
    Heartbeat,
    HeartbeatAck,
    LocalAssign,
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
    SwarmDetailReq,
    SwarmDetailRow,
    SwarmState,
    SwarmStatus,
    SwarmStatusRow,
    Sync,
    TensorMeta,
    TrainPlan,
    Update,
    Weights,
    WeightsDigest,
    WeightsMeta,
    WeightsReq,
    WorkerState,
    decode,
    encode,
    encode_parts,
    msg_type_name,
    profile_name,
    train_plan_flags,
    weights_messages,
    weights_tensors,
)
from foundry.wire.fdtc_lifecycle import (
    ADMIN_REQUESTS,
    TRANSITIONS,
    Direction,
    Lifecycle,
    Link,
    LinkState,
    Role,
)
from foundry.wire.layout import BOOL, I32, U8, U16, U32, U64, Bytes, Str


def hexb(*parts: str) -> bytes:
    return bytes.fromhex("".join(parts).replace(" ", ""))


def z(n: int) -> str:
    return "00" * n


# ---------------------------------------------------------------------------- golden frames

GOLDEN: list[tuple[Message, bytes]] = [
    (
        Register(
            worker_id="w1",
            protocol_version=1,
            profile=HardwareProfile.RPI4_4G,
            num_cores=4,
            memory_mb=3800,
            suggested_batch_size=4,
        ),
        hexb(
            "43544446 01 55000000",  # magic "CTDF" LE, REGISTER, 85
            "7731",
            z(62),  # worker_id "w1"
            "01",  # protocol_version
            "02000000",  # profile RPI4_4G (4-byte enum)
            "04000000",  # num_cores
            "d80e000000000000",  # memory_mb 3800 (u64)
            "04000000",  # suggested_batch_size
        ),
    ),
    (
        RegisterAck(
            accepted=True,
            assigned_shard=1,
            total_shards=3,
            batch_size=8,
            accumulation_steps=4,
            compression=Compression.TOPK,
            topk_ratio=0.01,
            global_step=1000,
        ),
        hexb(
            "43544446 02 1d000000",  # REGISTER_ACK, 29
            "01",
            "01000000",
            "03000000",
            "08000000",
            "04000000",
            "02000000",  # compression TOPK
            "0ad7233c",  # topk_ratio 0.01 (f32 0x3c23d70a)
            "e8030000",  # global_step 1000
        ),
    ),
    (Deregister(), hexb("43544446 03 00000000")),
    (
        Heartbeat(worker_id="pi-01", local_step=7, current_loss=2.5, samples_per_sec=0.5),
        hexb(
            "43544446 10 4c000000",  # HEARTBEAT, 76
            "70692d3031",
            z(59),  # "pi-01"
            "07000000",
            "00002040",
            "0000003f",  # 7, 2.5, 0.5
        ),
    ),
    (HeartbeatAck(258), hexb("43544446 11 04000000", "02010000")),
    (WeightsReq(), hexb("43544446 20 00000000")),
    (
        Weights(hexb("0000803f 000000c0")),  # f32 1.0, -2.0
        hexb("43544446 21 08000000", "0000803f", "000000c0"),
    ),
    (
        WeightsMeta(
            global_step=5,
            learning_rate=0.5,
            tensors=(TensorMeta("a", (2, 3), DType.F32), TensorMeta("b", (), DType.F16)),
        ),
        hexb(
            "43544446 22 26010000",  # WEIGHTS_META, 12 + 2 * 141 = 294
            "02000000",
            "05000000",
            "0000003f",  # num_tensors, global_step, learning_rate
            "61",
            z(63),  # name "a"
            "02000000",  # ndim
            "0200000000000000",
            "0300000000000000",
            z(48),  # shape[8]
            "0600000000000000",  # numel
            "00",  # dtype F32
            "62",
            z(63),
            "00000000",
            z(64),
            "0100000000000000",
            "01",  # "b", scalar, F16
        ),
    ),
    (
        Gradients(
            worker_id="w",
            local_step=3,
            num_tensors=1,
            compression=Compression.NONE,
            uncompressed_size=8,
            data=hexb("0000003f 0000803e"),
        ),
        hexb(
            "43544446 30 58000000",  # GRADIENTS, 80 + 8
            "77",
            z(63),  # "w"
            "03000000",
            "01000000",
            "00000000",
            "08000000",
            "0000003f",
            "0000803e",  # data: f32 0.5, 0.25
        ),
    ),
    (GradientsAck(9, accepted=False), hexb("43544446 31 05000000", "09000000", "00")),
    (Start(), hexb("43544446 40 00000000")),
    (Sync(), hexb("43544446 45 00000000")),
    (Checkpoint(), hexb("43544446 46 00000000")),
    (Shutdown(), hexb("43544446 47 00000000")),
    (Pause(), hexb("43544446 48 00000000")),
    (Resume(), hexb("43544446 49 00000000")),
    (StatusReq(), hexb("43544446 50 00000000")),
    (
        Status(
            worker_id="w",
            local_step=10,
            samples_processed=640,
            current_loss=1.5,
            avg_loss=2.0,
            samples_per_sec=100.0,
            memory_used_mb=512,
            is_training=True,
        ),
        hexb(
            "43544446 51 5d000000",  # STATUS, 93
            "77",
            z(63),
            "0a000000",
            "80020000",  # local_step 10, samples_processed 640
            "0000c03f",
            "00000040",
            "0000c842",  # 1.5, 2.0, 100.0
            "0002000000000000",  # memory_used_mb 512 (u64)
            "01",  # is_training
        ),
    ),
    (
        Assign(
            global_step=2,
            sample_offset=2**32 + 1,
            batch_size=4,
            accumulation_steps=3,
            assigned_shard=0,
            total_shards=2,
            seq_len=64,
            n_samples=10,
        ),
        hexb(
            "43544446 60 24000000",  # ASSIGN, 36
            "02000000",
            "0100000001000000",  # global_step, sample_offset (u64)
            "04000000",
            "03000000",
            "00000000",
            "02000000",
            "40000000",
            "0a000000",  # n_samples
        ),
    ),
    (
        ModelConfigMsg(
            n_vocab=259,
            n_ctx=256,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_head_kv=2,
            n_ff=128,
            n_expert=4,
            n_expert_used=2,
            n_ff_shared=0,
            rope_theta=10000.0,
            norm_eps=1e-5,
            aux_loss_coef=0.01,
        ),
        hexb(
            "43544446 61 34000000",  # MODEL_CONFIG, 52
            "03010000",
            "00010000",
            "40000000",
            "02000000",
            "04000000",
            "02000000",
            "80000000",
            "04000000",
            "02000000",
            "00000000",
            "00401c46",
            "acc52737",
            "0ad7233c",  # 10000.0, 1e-5, 0.01
        ),
    ),
    (
        Dataset(n_tokens=1000, sha256=bytes(range(32))),
        hexb(
            "43544446 62 28000000",  # DATASET, 40
            "e803000000000000",
            "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
        ),
    ),
    (
        BaseModel(
            file_bytes=253113024,
            sha256=bytes(range(32)),
            architecture="gemma3",
            trainer=1,
            lora_rank=8,
            lora_alpha=16.0,
            lora_dropout=0.0,
            lora_targets=5,
        ),
        hexb(
            "43544446 6d 49000000",  # BASE_MODEL, 73
            "c032160f00000000",  # file_bytes 253,113,024 = 0x0f1632c0
            "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
            "67656d6d6133",
            z(10),  # "gemma3" in char[16]
            "01",
            "08000000",
            "00008041",
            "00000000",  # trainer, rank 8, alpha 16.0, dropout 0
            "05000000",  # targets attn_q | attn_v
        ),
    ),
    (
        SwarmStatus(
            global_step=3,
            max_steps=100,
            state=SwarmState.TRAINING,
            train_loss=2.0,
            val_loss=2.5,
            samples_per_sec=8.0,
            learning_rate=0.5,
            samples_total=96,
            rows=(
                SwarmStatusRow(
                    worker_id="pi",
                    profile=HardwareProfile.RPI3,
                    state=WorkerState.IDLE,
                    batch_size=1,
                    accumulation_steps=8,
                    samples_per_sec=1.0,
                    loss=2.0,
                    local_step=3,
                    seconds_since_heartbeat=0.25,
                ),
            ),
        ),
        hexb(
            "43544446 63 82000000",  # SWARM_STATUS, 37 + 93
            "03000000",
            "64000000",
            "01",  # global_step, max_steps, state TRAINING (u8)
            "00000040",
            "00002040",
            "00000041",
            "0000003f",  # 2.0, 2.5, 8.0, 0.5
            "6000000000000000",
            "01000000",  # samples_total 96, n_rows 1
            "7069",
            z(62),  # "pi"
            "00000000",
            "02",  # profile RPI3 (u32), state IDLE (u8)
            "01000000",
            "08000000",
            "0000803f",
            "00000040",
            "03000000",
            "0000803e",
        ),
    ),
    (
        ControlAck(acked_type=MsgType.PAUSE, ok=True, global_step=7, message="paused"),
        hexb("43544446 64 06010000", "48", "01", "07000000", "706175736564", z(250)),
    ),
    (
        Export(path="/tmp/m.gguf"),
        hexb("43544446 65 01010000", "2f746d702f6d2e67677566", z(245), "00"),
    ),
    (
        Export(path="", file_type=FileType.Q4_0),
        hexb("43544446 65 01010000", z(256), "03"),
    ),
    (
        TrainPlan(
            sync_every=16,
            digest_every=10,
            down_compression=Compression.FP16,
            lr=0.5,
            warmup_steps=20,
            total_steps=100,
            min_lr_ratio=0.5,
            weight_decay=0.25,
            grad_clip=1.0,
        ),
        hexb(
            "43544446 66 28000000",  # TRAIN_PLAN, 40
            "10000000",
            "0a000000",
            "01000000",  # sync_every 16, digest_every 10, FP16 (u32)
            "0000003f",
            "14000000",
            "64000000",  # lr 0.5, warmup 20, total 100
            "0000003f",
            "0000803e",
            "0000803f",
            "00000000",  # 0.5, 0.25, 1.0, flags 0
        ),
    ),
    (
        Update(
            global_step=5,
            base_step=4,
            compression=Compression.NONE,
            num_tensors=1,
            uncompressed_size=8,
            data=hexb("0000803f", "000000c0"),
        ),
        hexb(
            "43544446 67 20000000",  # UPDATE, 24 + 8
            "05000000",
            "04000000",
            "00000000",
            "01000000",  # step 5 from 4, NONE, 1 tensor
            "0800000000000000",  # uncompressed_size u64
            "0000803f",
            "000000c0",  # +1.0, -2.0
        ),
    ),
    (
        WeightsDigest(global_step=10, digest=bytes(range(32))),
        hexb(
            "43544446 68 24000000",  # WEIGHTS_DIGEST, 36
            "0a000000",
            "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
        ),
    ),
    (
        LocalAssign(
            global_step=32,
            sample_offset=2048,
            samples_per_step=8,
            inner_steps=16,
            micro_batch=8,
            seq_len=64,
        ),
        hexb(
            "43544446 69 1c000000",  # LOCAL_ASSIGN, 28
            "20000000",
            "0008000000000000",  # step 32, offset 2048 (u64)
            "08000000",
            "10000000",
            "08000000",
            "40000000",  # 8 per step, 16 steps, 8, 64
        ),
    ),
    (SwarmDetailReq(), hexb("43544446 6a 00000000")),
    (
        SwarmDetail(
            min_workers=2,
            seconds_since_step=1.5,
            failed=True,
            note="ckpt",
            first_val_loss=2.5,
            first_val_step=7,
            rows=(SwarmDetailRow(inner_steps=16, bytes_up=1024, bytes_down=4096),),
        ),
        hexb(
            "43544446 6b 29010000",  # SWARM_DETAIL, 277 + 20
            "02000000",
            "0000c03f",
            "01",  # min_workers 2, seconds_since_step 1.5, failed
            "636b7074",
            z(252),  # note "ckpt", char[256]
            "00002040",
            "07000000",  # first_val_loss 2.5 at step 7
            "01000000",  # n_rows 1
            "10000000",
            "0004000000000000",
            "0010000000000000",  # 16 steps, 1024 up, 4096 down
        ),
    ),
    (
        Error(ErrorCode.STALE, "stale"),
        hexb("43544446 ff 04010000", "06000000", "7374616c65", z(251)),
    ),
]
STREAM = b"".join(frame for _, frame in GOLDEN)
MESSAGES = [msg for msg, _ in GOLDEN]


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
    # carries): its golden bytes are in test_fdtc_fragments.py.
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


# ---------------------------------------------------------------------------- decoder


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


def _replace(frame: bytes, offset: int, new: bytes) -> bytes:
    """Change payload bytes at ``offset`` (counted from the payload start)."""
    start = 9 + offset
    return frame[:start] + new + frame[start + len(new) :]


def _golden(t: MsgType) -> bytes:
    return next(frame for msg, frame in GOLDEN if msg.TYPE is t)


BAD_PAYLOADS = [
    (_replace(_golden(MsgType.REGISTER_ACK), 0, b"\x02"), "accepted must be a bool"),
    (_replace(_golden(MsgType.REGISTER_ACK), 21, hexb("00000040")), "topk_ratio 2.0"),
    (_replace(_golden(MsgType.REGISTER_ACK), 17, b"\x04"), "compression 4 is not a Compr"),
    (_replace(_golden(MsgType.REGISTER), 65, b"\x0a"), "profile 10 is not a HardwareProfile"),
    (_replace(_golden(MsgType.REGISTER), 0, b"x" * 64), "worker_id .* not NUL-terminated"),
    (_replace(_golden(MsgType.HEARTBEAT), 0, b"\xff\xfe"), "worker_id is not valid UTF-8"),
    (_replace(_golden(MsgType.WEIGHTS_META), 0, b"\x03"), "num_tensors 3 but carries 2"),
    (_replace(_golden(MsgType.WEIGHTS_META), 12 + 64, b"\x09"), "ndim 9"),
    (_replace(_golden(MsgType.WEIGHTS_META), 12 + 132, b"\x07"), "numel 7 is not the product"),
    (_replace(_golden(MsgType.WEIGHTS_META), 12 + 140, b"\x05"), "dtype 5 is not a DType"),
    (_replace(_golden(MsgType.GRADIENTS), 72, b"\x09"), "compression 9"),
    (_replace(_golden(MsgType.GRADIENTS_ACK), 4, b"\x02"), "accepted must be a bool"),
    (_replace(_golden(MsgType.STATUS), 92, b"\x02"), "is_training must be a bool"),
    (_replace(_golden(MsgType.ASSIGN), 32, b"\x0d"), "n_samples 13 exceeds"),
    (_replace(_golden(MsgType.SWARM_STATUS), 33, b"\x02"), "n_rows 2 but carries 1"),
    (_replace(_golden(MsgType.SWARM_STATUS), 8, b"\x04"), "state 4 is not a SwarmState"),
    (_replace(_golden(MsgType.SWARM_STATUS), 37 + 68, b"\x04"), "state 4 is not a WorkerSt"),
    (_replace(_golden(MsgType.SWARM_DETAIL), 8, b"\x02"), "failed must be a bool"),
    (_replace(_golden(MsgType.SWARM_DETAIL), 9, b"c" * 256), "note .* not NUL-terminated"),
    (_replace(_golden(MsgType.SWARM_DETAIL), 273, b"\x02"), "n_rows 2 but carries 1"),
    (_replace(_golden(MsgType.CONTROL_ACK), 0, b"\x99"), "acked_type 153 is not a MsgType"),
    (_replace(_golden(MsgType.EXPORT), 0, b"\xc3\x28"), "path is not valid UTF-8"),
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


# ---------------------------------------------------------------------------- local errors


def _register(**kw: object) -> Register:
    base: dict[str, object] = dict(
        worker_id="w",
        protocol_version=1,
        profile=HardwareProfile.SERVER,
        num_cores=1,
        memory_mb=1,
        suggested_batch_size=1,
    )
    base.update(kw)
    return Register(**base)  # type: ignore[arg-type]


def test_strings_fit_char_arrays_with_their_nul() -> None:
    assert _register(worker_id="x" * 63).worker_id == "x" * 63
    assert _register(worker_id="é" * 31 + "x").worker_id == "é" * 31 + "x"  # 63 bytes
    with pytest.raises(LocalProtocolError, match=r"64 bytes of UTF-8; char\[64\] holds at most 63"):
        _register(worker_id="x" * 64)
    with pytest.raises(LocalProtocolError, match="64 bytes"):
        _register(worker_id="é" * 32)
    with pytest.raises(LocalProtocolError, match="NUL"):
        _register(worker_id="a\0b")
    with pytest.raises(LocalProtocolError):
        Error(1, "e" * 256)
    assert Error(1, "e" * 255).message == "e" * 255


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"num_cores": -1}, "num_cores -1 is outside 0..4294967295"),
        ({"num_cores": 2**32}, "outside"),
        ({"num_cores": 1.5}, "must be an integer"),
        ({"memory_mb": 2**64}, "memory_mb .* outside"),
        ({"protocol_version": 256}, "outside 0..255"),
        ({"profile": 10}, "profile 10 is not a HardwareProfile"),
        ({"worker_id": b"w"}, "must be a str"),
    ],
)
def test_values_that_do_not_fit_are_our_error(kw: dict[str, object], problem: str) -> None:
    with pytest.raises(LocalProtocolError, match=problem):
        _register(**kw)


def test_field_normalisation() -> None:
    r = _register(profile=2, memory_mb=np.uint64(2**64 - 1))
    assert r.profile is HardwareProfile.RPI4_4G
    assert r.memory_mb == 2**64 - 1 and type(r.memory_mb) is int
    hb = Heartbeat("w", 1, 0.1, 3.0e-4)
    assert (hb.current_loss, hb.samples_per_sec) == (0.1, 3.0e-4)  # the f32 on the wire
    assert decode(encode(hb)) == hb
    third = Heartbeat("w", 1, 1 / 3, 0).current_loss
    assert third == 0.33333334 and struct.pack("<f", third) == struct.pack("<f", 1 / 3)
    assert math.isnan(Heartbeat("w", 1, float("nan"), 0).current_loss)
    assert Heartbeat("w", 1, float("inf"), 0).current_loss == math.inf
    with pytest.raises(LocalProtocolError, match="does not fit a 32-bit float"):
        Heartbeat("w", 1, 1e39, 0)
    with pytest.raises(LocalProtocolError, match="must be a number"):
        Heartbeat("w", 1, "1.0", 0)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="must be a bool"):
        GradientsAck(1, accepted=2)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="exactly 32 bytes"):
        Dataset(1, bytes(31))
    with pytest.raises(LocalProtocolError, match="topk_ratio"):
        RegisterAck(True, 0, 1, 1, 1, Compression.TOPK, 1.5, 0)
    assert RegisterAck(False, 0, 0, 0, 0, Compression.TOPK, 0.0, 0).topk_ratio == 0.0


def test_tensor_meta_validation() -> None:
    assert TensorMeta("t", [2, 3]).shape == (2, 3)  # type: ignore[arg-type]
    assert TensorMeta("t", (2, 3)).numel == 6
    assert TensorMeta("t", ()).numel == 1
    assert TensorMeta("t", (4,), DType.F16).nbytes == 8
    with pytest.raises(LocalProtocolError, match="9 dimensions"):
        TensorMeta("t", (1,) * 9)
    with pytest.raises(LocalProtocolError, match="outside"):
        TensorMeta("t", (-1,))
    with pytest.raises(LocalProtocolError, match="dtype"):
        TensorMeta("t", (1,), 7)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="TensorMeta"):
        WeightsMeta(global_step=0, learning_rate=0.0, tensors=("x",))  # type: ignore[arg-type]


def test_encoding_over_the_message_limit_is_our_error() -> None:
    too_big = np.zeros(MAX_PAYLOAD + 1, np.uint8)  # calloc'd: never touched
    with pytest.raises(LocalProtocolError, match="exceeds SW_MAX_MESSAGE_SIZE"):
        encode_parts(Weights(too_big.data))


def test_buffers_are_normalised_to_flat_read_only_bytes() -> None:
    arr = np.array([1.0, -2.0], np.float32)
    w = Weights(arr.data)
    assert isinstance(w.data, memoryview) and w.data.format == "B" and w.data.readonly
    assert encode(w) == GOLDEN[6][1]
    assert Weights(bytearray(4)).data == bytes(4)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="bytes-like"):
        Weights("abc")  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="contiguous"):
        Weights(np.zeros((4, 4), np.uint8)[:, :2])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- helpers


def test_model_config_round_trip_and_coverage() -> None:
    for cfg in PRESETS.values():
        msg = model_config_msg(cfg, aux_loss_coef=0.01)
        back = decode(encode(msg))
        assert isinstance(back, ModelConfigMsg)
        assert config_of(back) == cfg  # norm_eps 1e-5 survives f32 exactly as written
        assert back.aux_loss_coef == 0.01
    carried = {f.name for f in fields(ModelConfigMsg)}
    assert {f.name for f in fields(ModelConfig)} <= carried, "MODEL_CONFIG must carry every field"


def test_impossible_model_config_is_a_protocol_error() -> None:
    good = model_config_msg(ModelConfig())
    bad = ModelConfigMsg(**{**{f.name: getattr(good, f.name) for f in fields(good)}, "n_head": 3})
    with pytest.raises(FdtcProtocolError, match="no valid model") as exc:
        config_of(bad)
    assert exc.value.error_code == ErrorCode.MODEL_MISMATCH


def test_weights_helpers_round_trip() -> None:
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((2, 3)), "b": rng.standard_normal(4)}
    meta, weights = weights_messages(tensors, global_step=5, learning_rate=0.5)
    assert meta.nbytes == len(weights.data) == 40
    meta2, weights2 = decode(encode(meta)), decode(encode(weights))
    assert isinstance(meta2, WeightsMeta) and isinstance(weights2, Weights)
    out = weights_tensors(meta2, weights2)
    assert list(out) == ["a", "b"]
    for name, t in tensors.items():
        np.testing.assert_array_equal(out[name], t.astype(np.float32))
        assert not out[name].flags.writeable
    with pytest.raises(FdtcProtocolError, match="WEIGHTS holds 36 bytes") as exc:
        weights_tensors(meta2, Weights(bytes(36)))
    assert exc.value.error_code == ErrorCode.MODEL_MISMATCH


# ---------------------------------------------------------------------------- properties

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


# ---------------------------------------------------------------------------- lifecycle


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


# ---------------------------------------------------------------------------- bounds, exactly
# (messages built inside the tests: one built at import is checked before a mutation test run
# chooses its mutant)


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
    bad = _replace(frame, 12, b"x" * 64)  # the tensor name loses its NUL
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
