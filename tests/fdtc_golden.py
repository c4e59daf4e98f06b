"""FDTC golden frames: one of every message, each written out by hand.

Every golden frame below is written out by hand from foundry_swarm_protocol.h (packed,
little-endian, 4-byte enums, 1-byte bool, NUL-padded char[N]) and docs/protocol.md, not
produced by the code under test. ``z(n)`` is n zero bytes of padding.
"""

from __future__ import annotations

from foundry.wire.fdtc import (
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
)


def hexb(*parts: str) -> bytes:
    return bytes.fromhex("".join(parts).replace(" ", ""))


def z(n: int) -> str:
    return "00" * n


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

MESSAGES = [msg for msg, _ in GOLDEN]


def replace_at(frame: bytes, offset: int, new: bytes) -> bytes:
    """Change payload bytes at ``offset`` (counted from the payload start)."""
    start = 9 + offset
    return frame[:start] + new + frame[start + len(new) :]
