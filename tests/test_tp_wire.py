"""The tensor-parallel wire: hello, identity checks, control frames, gate header, slab layout.

Golden bytes are written out by hand (hex, little-endian) next to each layout, so a change of
any byte on the wire fails here first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry.wire import tp
from foundry.wire.errors import LocalProtocolError, ProtocolError
from foundry.wire.tp import (
    BatchItem,
    CommandAck,
    Eval,
    EvalBatch,
    FrameType,
    Gate,
    GateHeader,
    GateTransport,
    Hash,
    Hello,
    Identity,
    IdentityMismatch,
    Invalidate,
    Logits,
    MixedBatch,
    Rewind,
    Role,
    SessionCreate,
    SessionDestroy,
    SlabLayout,
    Stop,
    Sync,
    SyncCheckpoint,
    TpDecoder,
    TpProtocolError,
    Verify,
    VerifyCommit,
    VerifyCommitMode,
    VersionMismatch,
    World,
    WorldInfo,
    WorldPeer,
    check_hello,
    check_identity,
    encode,
    negotiate_gate_transport,
)

IDENTITY = Identity(
    gguf_bytes=1_000_000,
    model_id=7,
    n_layer=8,
    n_embd=1024,
    n_vocab=259,
    quant_bits=32,
    ctx_size=256,
    gate_slot_start=0,
    gate_slot_step=1,
    gates_per_token=16,
    gate_slot_mask=(0xFFFF, 0, 0, 0),
)
HOST = bytes(range(16))
LEADER_HELLO = Hello(
    role=Role.LEADER, identity=IDENTITY, host_id=HOST, shm_offered=True, shm_name="slab-1"
)

HELLO_GOLDEN = bytes.fromhex(
    "44545048"  # magic "DTPH"
    "0200"  # version 2
    "b800"  # hello size 184
    "00"  # role: leader
    "01"  # flags: shm offered
    "0000"  # execution mode 0: contiguous halves of the experts
    "40420f0000000000"  # gguf_bytes 1000000
    "07000000"  # model_id 7
    "08000000"  # n_layer 8
    "00040000"  # n_embd 1024
    "03010000"  # n_vocab 259
    "20000000"  # quant_bits 32
    "00010000"  # ctx_size 256
    "00000000"  # gate_slot_start 0
    "01000000"  # gate_slot_step 1
    "10000000"  # gates_per_token 16
    "ffff000000000000"
    "0000000000000000"
    "0000000000000000"
    "0000000000000000"  # slot mask
    "000102030405060708090a0b0c0d0e0f"  # host id
    "736c61622d31"
    + "00" * 58  # shm name "slab-1", NUL-padded to 64
    + "6c6c616d61"
    + "00" * 11  # architecture "llama", NUL-padded to 16
)

# header: magic "DTP4" | type u8 | flags u8 | reserved u16 | session_id u64 | seq u64 | length u32
GOLDEN: list[tuple[tp.ControlFrame, str]] = [
    (
        Sync(session_id=1, tokens=(1, 258, -1)),
        "44545034 01 00 0000 0100000000000000 0000000000000000 0c000000 01000000 02010000 ffffffff",
    ),
    (
        Eval(session_id=9, seq=3, token=5),
        "44545034 02 00 0000 0900000000000000 0300000000000000 04000000 05000000",
    ),
    (
        Rewind(session_id=2, pos=7),
        "44545034 03 00 0000 0200000000000000 0000000000000000 04000000 07000000",
    ),
    (
        Invalidate(session_id=2),
        "44545034 04 00 0000 0200000000000000 0000000000000000 00000000",
    ),
    (Stop(), "44545034 05 00 0000 0000000000000000 0000000000000000 00000000"),
    (
        Hash(session_id=1, seq=4, value=0x0123456789ABCDEF),
        "44545034 06 00 0000 0100000000000000 0400000000000000 08000000 efcdab8967452301",
    ),
    (
        Logits.from_array(np.array([1.0, -2.0], dtype=np.float32), session_id=1),
        "44545034 0a 00 0000 0100000000000000 0000000000000000 0c000000 02000000 0000803f 000000c0",
    ),
    (
        Verify(session_id=1, flags=tp.DS4_TP_VERIFY_HEAD_SPLIT, drafts=(10, 11)),
        "44545034 0b 00 0000 0100000000000000 0000000000000000 0c000000 01000000 0a000000 0b000000",
    ),
    (
        VerifyCommit(mode=VerifyCommitMode.COMMIT_PREFIX, token_count=3),
        "44545034 0c 00 0000 0000000000000000 0000000000000000 08000000 02000000 03000000",
    ),
    (
        SessionCreate(session_id=5, ctx_size=4096),
        "44545034 0d 00 0000 0500000000000000 0000000000000000 04000000 00100000",
    ),
    (
        SessionDestroy(session_id=5),
        "44545034 0e 00 0000 0500000000000000 0000000000000000 00000000",
    ),
    (
        EvalBatch(items=(BatchItem(5, 65), BatchItem(6, -1))),
        "44545034 0f 00 0000 0000000000000000 0000000000000000 20000000"
        " 0500000000000000 41000000 00000000"
        " 0600000000000000 ffffffff 00000000",
    ),
    (
        MixedBatch(session_id=7, prompt=(1, 2), items=(BatchItem(5, 65),)),
        "44545034 10 00 0000 0700000000000000 0000000000000000 20000000"
        " 02000000 01000000 01000000 02000000 0500000000000000 41000000 00000000",
    ),
    (
        CommandAck(session_id=5, status=-1),
        "44545034 11 00 0000 0500000000000000 0000000000000000 04000000 ffffffff",
    ),
    (
        SyncCheckpoint(session_id=5, point=2, current=100, total=300, requested=True),
        "44545034 16 00 0000 0500000000000000 0000000000000000 0d000000"
        " 02000000 64000000 2c010000 01",
    ),
    (
        World(
            peers=(
                WorldPeer(1, 7100, bytes(10) + b"\xff\xff\x7f\x00\x00\x01", 0x0102),
                WorldPeer(2, 7101, bytes(10) + b"\xff\xff\x7f\x00\x00\x02", 0xABCD),
            )
        ),
        "44545034 20 00 0000 0000000000000000 0000000000000000 38000000"
        " 0100 bc1b 00000000000000000000ffff7f000001 0201000000000000"
        " 0200 bd1b 00000000000000000000ffff7f000002 cdab000000000000",
    ),
]
FRAMES = [frame for frame, _ in GOLDEN]


def header(code: int, length: int, flags: int = 0, reserved: int = 0) -> bytes:
    return tp.FRAME_HEADER.pack(tp.TP_FRAME_MAGIC, code, flags, reserved, 0, 0, length)


def decode_all(data: bytes, **kw: int | bool) -> list[tp.Frame]:
    decoder = TpDecoder(**kw)  # type: ignore[arg-type]
    decoder.feed(data)
    out = []
    while (frame := decoder.next_event()) is not None:
        out.append(frame)
    assert decoder.buffered == 0
    return out


def test_struct_sizes() -> None:
    assert tp.IDENTITY.size == 76
    assert tp.HELLO_SIZE == 184
    assert tp.FRAME_HEADER_SIZE == 28
    assert tp.BATCH_ITEM.size == 16
    assert tp.GATE_HEADER_SIZE == 20
    assert tp.SLAB_HEADER.size == 64
    assert tp.SLOT_HEADER.size == 64
    assert tp.TP_FRAME_MAGIC.to_bytes(4, "little") == b"DTP4"


def test_every_seed_frame_type_has_its_seed_number() -> None:
    seed = {
        "SYNC": 1, "EVAL": 2, "REWIND": 3, "INVALIDATE": 4, "STOP": 5, "HASH": 6,
        "RDMA_INFO": 7, "SYNC_ACK": 8, "RDMA_READY": 9, "LOGITS": 10, "VERIFY": 11,
        "VERIFY_COMMIT": 12, "SESSION_CREATE": 13, "SESSION_DESTROY": 14, "EVAL_BATCH": 15,
        "MIXED_BATCH": 16, "COMMAND_ACK": 17, "SYNC_MULTIMODAL": 18, "RDMA_WARM": 19,
        "RDMA_POSTED": 20, "GLM_MTP": 21, "SYNC_CHECKPOINT": 22, "DSPARK_DRAFT": 23,
        "SPEC_RESTORE": 24,
        "WORLD": 32,  # Foundry's extension for N ranks, clear of the seed's numbers
    }  # fmt: skip
    assert {t.name: t.value for t in FrameType} == seed
    assert {f.TYPE for f in FRAMES} == set(tp.FRAME_CLASSES)


WORLD_EXT_GOLDEN = bytes.fromhex(
    "0300"  # world_size 3
    "0000"  # rank 0: the leader
    "0000"  # gate_port 0
    "0000"  # shares_from 0: the list below
    "0200"
    "0100"
    "0100" + "0000" * 13  # shares 2,1,1, then zeros to 16
)


def test_world_hello_golden_bytes_and_round_trip() -> None:
    """The world extension: flag bit 1, hello_size 224, the pair's 184 bytes unchanged before
    it; the plain pair sends none."""
    assert tp.WORLD_EXT.size == 40 and tp.HELLO_WORLD_SIZE == 224
    leader = dataclasses.replace(LEADER_HELLO, world=WorldInfo(world_size=3, shares=(2, 1, 1)))
    golden = (
        HELLO_GOLDEN[:6]
        + bytes.fromhex("e000")
        + HELLO_GOLDEN[8:9]
        + b"\x03"
        + HELLO_GOLDEN[10:]
        + WORLD_EXT_GOLDEN
    )
    assert encode(leader) == golden
    assert decode_all(golden, expect_hello=True) == [leader]
    worker = Hello(
        role=Role.WORKER,
        identity=IDENTITY,
        world=WorldInfo(world_size=3, shares=(2, 1, 1), rank=2, gate_port=7100),
    )
    wire = encode(worker)
    assert len(wire) == 224 and wire[9] == tp.HELLO_WORLD
    assert wire[184:192] == bytes.fromhex("0300 0200 bc1b 0000")
    assert decode_all(wire, expect_hello=True) == [worker]
    # The flag and the size must agree.
    for bad in (HELLO_GOLDEN[:9] + b"\x03" + HELLO_GOLDEN[10:], golden[:9] + b"\x01" + golden[10:]):
        with pytest.raises(TpProtocolError, match="world flag is"):
            decode_all(bad, expect_hello=True)
    with pytest.raises(TpProtocolError, match="shares_from is 5, not 0"):
        decode_all(golden[:190] + b"\x05\x00" + golden[192:], expect_hello=True)
    with pytest.raises(TpProtocolError, match="shares beyond the world of 3 are not 0"):
        decode_all(golden[:198] + b"\x01\x00" + golden[200:], expect_hello=True)
    with pytest.raises(TpProtocolError, match="world size 17 outside"):
        decode_all(golden[:184] + b"\x11\x00" + golden[186:], expect_hello=True)
    with pytest.raises(LocalProtocolError, match="plain pair"):
        WorldInfo(world_size=2, shares=(1, 1))
    assert WorldInfo(world_size=2, shares=(3, 1)).encode()[:4] == bytes.fromhex("0200 0000")


PENDING_EXT_GOLDEN = bytes.fromhex(
    "0300"  # world_size 3
    "0200"  # rank 2 asked for
    "bc1b"  # gate_port 7100
    "0100"  # shares_from 1: by speed (--shares auto), the shares still to be chosen
    + "0000"
    * 16  # shares: all 0 until chosen
)
WEIGHT_EXT_GOLDEN = bytes.fromhex(
    "0000"  # share 0: no --share given
    "0000"  # reserved
    "10270000"  # speed 10000 multiply-adds per microsecond
)


def test_weight_hello_golden_bytes_and_round_trip() -> None:
    """A worker answering a world whose shares are still to be chosen: the world extension with
    shares_from set and no shares, then its weight (flag bit 2, hello_size 232)."""
    assert tp.WEIGHT_EXT.size == 8 and tp.HELLO_WEIGHT_SIZE == 232
    worker = Hello(
        role=Role.WORKER,
        identity=IDENTITY,
        world=WorldInfo(
            world_size=3, shares=(), rank=2, gate_port=7100, shares_from=tp.SharesFrom.SPEED
        ),
        weight=tp.RankWeight(speed=10000),
    )
    wire = encode(worker)
    assert len(wire) == 232 and wire[6:8] == bytes.fromhex("e800")
    assert wire[9] == tp.HELLO_WORLD | tp.HELLO_WEIGHT
    assert wire[184:] == PENDING_EXT_GOLDEN + WEIGHT_EXT_GOLDEN
    assert decode_all(wire, expect_hello=True) == [worker]
    ranks = dataclasses.replace(
        worker,
        world=dataclasses.replace(worker.world, shares_from=tp.SharesFrom.SHARE),
        weight=tp.RankWeight(share=3),
    )
    assert encode(ranks)[190:192] == b"\x02\x00" and encode(ranks)[224:] == bytes.fromhex(
        "0300 0000 00000000"
    )
    # The leader's pending world carries no weight; a weight needs a pending world.
    leader = dataclasses.replace(
        LEADER_HELLO, world=dataclasses.replace(worker.world, rank=0, gate_port=0)
    )
    assert len(encode(leader)) == 224
    with pytest.raises(LocalProtocolError, match="still to be chosen"):
        dataclasses.replace(
            LEADER_HELLO,
            world=WorldInfo(world_size=3, shares=(1, 1, 1)),
            weight=tp.RankWeight(speed=1),
        )
    with pytest.raises(LocalProtocolError, match="must be empty"):
        WorldInfo(world_size=3, shares=(1, 1, 1), shares_from=tp.SharesFrom.SPEED)
    with pytest.raises(TpProtocolError, match="shares to be chosen are not all 0"):
        decode_all(wire[:192] + b"\x01\x00" + wire[194:], expect_hello=True)
    with pytest.raises(TpProtocolError, match="weight extension reserved word is 1"):
        decode_all(wire[:226] + b"\x01\x00" + wire[228:], expect_hello=True)
    with pytest.raises(TpProtocolError, match="so the hello is 232 bytes, but it says 224"):
        decode_all(wire[:6] + bytes.fromhex("e000") + wire[8:224], expect_hello=True)
    with pytest.raises(TpProtocolError, match="weight flag is set without the world flag"):
        decode_all(HELLO_GOLDEN[:9] + b"\x05" + HELLO_GOLDEN[10:], expect_hello=True)
    # Both sides state the same pending world: no mismatch; a decided one differs from it.
    tp.check_hello(leader, worker)
    with pytest.raises(IdentityMismatch, match="shares: leader has 2,1,1, worker has auto"):
        tp.check_hello(
            dataclasses.replace(LEADER_HELLO, world=WorldInfo(world_size=3, shares=(2, 1, 1))),
            worker,
        )


def test_the_plain_pair_sends_no_world_extension() -> None:
    """Two ranks of equal shares (however written) state no world: the pair's 184 bytes."""
    from foundry.tp.handshake import world_info

    assert world_info(2, None) is None and world_info(2, (3, 3)) is None
    uneven = world_info(2, (6, 2))
    assert uneven is not None and uneven.shares == (3, 1)
    three = world_info(3, None)
    assert three is not None and (three.world_size, three.shares, three.rank) == (3, (1, 1, 1), 0)
    assert len(encode(Hello(role=Role.LEADER, identity=IDENTITY, world=world_info(2, None)))) == 184


def test_world_mismatches_name_the_field_leader_first() -> None:
    three = WorldInfo(world_size=3, shares=(1, 1, 1))
    leader = Hello(role=Role.LEADER, identity=IDENTITY, world=three)
    for worker_world, message in [
        (None, "world mismatch on world_size: leader has 3, worker has 2"),
        (WorldInfo(world_size=4, shares=(1, 1, 1, 1)), "world_size: leader has 3, worker has 4"),
        (
            WorldInfo(world_size=3, shares=(2, 1, 1)),
            "world mismatch on shares: leader has 1,1,1, worker has 2,1,1",
        ),
    ]:
        worker = Hello(role=Role.WORKER, identity=IDENTITY, world=worker_world)
        for mine, peer in ((leader, worker), (worker, leader)):
            with pytest.raises(IdentityMismatch, match=message):
                tp.check_hello(mine, peer)
    tp.check_hello(
        leader,
        Hello(
            role=Role.WORKER,
            identity=IDENTITY,
            world=dataclasses.replace(three, rank=2, gate_port=9),
        ),
    )


def test_world_frame_lists_ranks_in_order() -> None:
    host = bytes(16)
    with pytest.raises(LocalProtocolError, match=r"ranks 1 \.\. N-1 in order"):
        World(peers=(WorldPeer(2, 1, host, 0), WorldPeer(1, 1, host, 0)))
    with pytest.raises(LocalProtocolError, match=r"ranks 1 \.\. N-1"):
        World(peers=(WorldPeer(1, 1, host, 0),))  # a pair has no WORLD
    with pytest.raises(TpProtocolError, match=r"WORLD: World\.peers"):
        decode_all(
            header(FrameType.WORLD, 28)
            + bytes.fromhex("0100 0100 00000000000000000000000000000000 0000000000000000")
        )
    with pytest.raises(TpProtocolError, match="WORLD payload must be 0 \\+ a multiple of 28"):
        decode_all(header(FrameType.WORLD, 27) + bytes(27))


def test_hello_golden_bytes_and_round_trip() -> None:
    assert encode(LEADER_HELLO) == HELLO_GOLDEN
    [hello] = decode_all(HELLO_GOLDEN, expect_hello=True)
    assert hello == LEADER_HELLO
    # The execution mode is the u16 at offset 10 (DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT = 1).
    assert tp.DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT == 1
    split = dataclasses.replace(LEADER_HELLO, execution_mode=1)
    golden = HELLO_GOLDEN[:10] + bytes.fromhex("0100") + HELLO_GOLDEN[12:]
    assert encode(split) == golden
    assert decode_all(golden, expect_hello=True) == [split]


@pytest.mark.parametrize(("frame", "golden"), GOLDEN, ids=[f.TYPE.name for f in FRAMES])
def test_frame_golden_bytes(frame: tp.ControlFrame, golden: str) -> None:
    assert encode(frame) == bytes.fromhex(golden)
    assert decode_all(bytes.fromhex(golden)) == [frame]


def test_decoder_whole_then_byte_by_byte_then_trailing() -> None:
    stream = encode(LEADER_HELLO) + b"".join(encode(f) for f in FRAMES)
    expected = [LEADER_HELLO, *FRAMES]
    assert decode_all(stream, expect_hello=True) == expected

    decoder = TpDecoder(expect_hello=True)
    got: list[tp.Frame] = []
    for i in range(len(stream)):
        decoder.feed(stream[i : i + 1])
        while (frame := decoder.next_event()) is not None:
            got.append(frame)
    assert got == expected

    trailing = encode(Eval(token=1))[:10]
    decoder = TpDecoder()
    decoder.feed(encode(Stop()) + trailing)
    assert decoder.next_event() == Stop()
    assert decoder.next_event() is None
    assert decoder.buffered == len(trailing)
    with pytest.raises(TpProtocolError, match="closed in the middle"):
        decoder.feed_eof()


def test_logits_array_view() -> None:
    half = np.linspace(-1, 1, 130, dtype=np.float32)
    [frame] = decode_all(encode(Logits.from_array(half, seq=9)))
    assert isinstance(frame, Logits)
    assert frame.seq == 9
    np.testing.assert_array_equal(frame.array(), half)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"XXXX" + bytes(24), "bad frame magic"),
        (header(99, 0), "unknown frame type 99"),
        (header(FrameType.EVAL, 4, flags=1), "flags"),
        (header(FrameType.EVAL, 4, reserved=2), "reserved"),
        (header(FrameType.EVAL, 5), "EVAL payload must be exactly 4 bytes, got 5"),
        (header(FrameType.STOP, 1), "STOP payload must be exactly 0"),
        (header(FrameType.SYNC, 6), "SYNC payload must be 0 \\+ a multiple of 4"),
        (header(FrameType.EVAL_BATCH, 20), "multiple of 16"),
        (header(FrameType.SYNC, tp.TP_MAX_PAYLOAD + 4), "exceeds the limit"),
        (tp.encode(LEADER_HELLO), "unexpected hello"),
    ],
)
def test_bad_header_rejected_before_payload(data: bytes, message: str) -> None:
    decoder = TpDecoder()
    decoder.feed(data)
    with pytest.raises(TpProtocolError, match=message):
        decoder.next_event()
    with pytest.raises(TpProtocolError, match="already failed"):
        decoder.next_event()
    with pytest.raises(TpProtocolError, match="already failed"):
        decoder.feed(b"more")


@pytest.mark.parametrize("code", sorted(tp.UNSUPPORTED_FRAME_TYPES))
def test_reserved_seed_frame_types_are_errors(code: FrameType) -> None:
    decoder = TpDecoder()
    decoder.feed(header(code, 0))
    with pytest.raises(TpProtocolError, match=f"{code.name} \\({code.value}\\) is not supported"):
        decoder.next_event()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (header(FrameType.LOGITS, 8) + bytes.fromhex("02000000 0000803f"), "says 2 floats"),
        (header(FrameType.MIXED_BATCH, 12) + bytes.fromhex("05000000 00000000 01000000"),
         "5 prompt tokens"),
        (header(FrameType.VERIFY_COMMIT, 8) + bytes.fromhex("03000000 00000000"), "mode 3"),
        (header(FrameType.SYNC_CHECKPOINT, 13) + bytes(12) + b"\x02", "requested must be 0"),
        (header(FrameType.EVAL_BATCH, 16) + bytes(12) + b"\x01\x00\x00\x00", "reserved"),
        (header(FrameType.VERIFY, 4) + bytes(4), "1..8 rows"),
        (header(FrameType.VERIFY, 8) + bytes.fromhex("08000000 01000000"), "unknown bits"),
    ],
)  # fmt: skip
def test_bad_payload_rejected(data: bytes, message: str) -> None:
    decoder = TpDecoder()
    decoder.feed(data)
    with pytest.raises(TpProtocolError, match=message):
        decoder.next_event()


def test_max_payload_is_enforced_from_the_identity() -> None:
    limit = tp.max_payload_for(IDENTITY, tp.logits_rows(16))
    # the largest frames of this model: a MIXED_BATCH of a full context and all items
    assert limit == 8 + 4 * 256 + 16 * tp.TP_MAX_BATCH_ITEMS
    big = Sync(tokens=tuple(range(256)))
    assert decode_all(encode(big), max_payload=limit) == [big]
    decoder = TpDecoder(limit)
    decoder.feed(header(FrameType.SYNC, limit + 4))
    with pytest.raises(TpProtocolError, match="exceeds the limit"):
        decoder.next_event()


@pytest.mark.parametrize("limit", [4, 1024, tp.TP_MAX_PAYLOAD])
def test_payload_limit_and_limit_plus_one(limit: int) -> None:
    """A payload of exactly ``max_payload`` bytes decodes; a header announcing one byte more
    (or one legal step more) is refused before any payload byte is kept."""
    at_limit = Sync(tokens=(7,) * (limit // 4))
    decoder = TpDecoder(limit)
    data = encode(at_limit)
    decoder.feed(data[: tp.FRAME_HEADER_SIZE])
    assert decoder.next_event() is None  # the header passed: waiting for the payload
    decoder.feed(data[tp.FRAME_HEADER_SIZE :])
    assert decoder.next_event() == at_limit
    for over in (limit + 1, limit + 4):
        decoder = TpDecoder(limit)
        decoder.feed(header(FrameType.SYNC, over))
        with pytest.raises(TpProtocolError, match=f"{over} bytes exceeds the limit of {limit}"):
            decoder.next_event()
        assert decoder.buffered == 0


def test_hello_must_come_first_and_versions_must_match() -> None:
    decoder = TpDecoder(expect_hello=True)
    decoder.feed(encode(Stop()))
    with pytest.raises(TpProtocolError, match="expected the peer's hello first"):
        decoder.next_event()

    # only the 8-byte prefix of a future version: the mismatch is reported at once
    future = tp.HELLO_PREFIX.pack(tp.TP_HELLO_MAGIC, 3, 400)
    decoder = TpDecoder(expect_hello=True)
    decoder.feed(future)
    with pytest.raises(VersionMismatch, match="speaks version 2, the peer speaks version 3"):
        decoder.next_event()

    decoder = TpDecoder(expect_hello=True)
    decoder.feed(tp.HELLO_PREFIX.pack(tp.TP_HELLO_MAGIC, 2, 100))
    with pytest.raises(TpProtocolError, match=r"must be 184 bytes \(224 with the world"):
        decoder.next_event()

    decoder = TpDecoder(expect_hello=True)
    decoder.feed(b"GET / HTTP/1.1\r\n")
    with pytest.raises(TpProtocolError, match="bad hello magic"):
        decoder.next_event()


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (8, b"\x02", "unknown role 2"),
        (9, b"\x08", "unknown flags"),
        (10, b"\x02\x00", "execution mode 0x2 has bits this implementation does not run"),
        (11, b"\x01", "execution mode 0x100 has bits"),
        (104, b"../etc/passwd", "not a bare file name"),
        (104, b"\xff\xfe", "not UTF-8"),
    ],
)
def test_bad_hello_fields(offset: int, value: bytes, message: str) -> None:
    data = bytearray(HELLO_GOLDEN)
    data[offset : offset + len(value)] = value
    decoder = TpDecoder(expect_hello=True)
    decoder.feed(data)
    with pytest.raises(TpProtocolError, match=message):
        decoder.next_event()


IDENTITY_FIELDS = [f.name for f in dataclasses.fields(Identity)]


@pytest.mark.parametrize("name", IDENTITY_FIELDS)
def test_identity_mismatch_names_the_field_and_both_values(name: str) -> None:
    value = getattr(IDENTITY, name)
    other = (value[0] + 1, *value[1:]) if isinstance(value, tuple) else value + 1
    changes: dict[str, Any] = {name: other}
    worker = dataclasses.replace(IDENTITY, **changes)
    with pytest.raises(IdentityMismatch) as info:
        check_identity(IDENTITY, worker)
    message = str(info.value)
    if name == "gate_slot_mask":
        assert "leader has [0xffff, 0x0, 0x0, 0x0], worker has [0x10000, 0x0, 0x0, 0x0]" in message
    else:
        assert f"identity mismatch on {name}: leader has {value}, worker has {other};" in message
    assert "both ranks must" in message or "same context size" in message
    # from the worker's side the roles stay attached to the right values
    with pytest.raises(IdentityMismatch, match=f"on {name}: leader has"):
        check_identity(worker, IDENTITY, mine_role=Role.WORKER)
    check_identity(IDENTITY, dataclasses.replace(IDENTITY))


def test_identity_mismatch_example_message() -> None:
    worker = dataclasses.replace(IDENTITY, n_layer=6)
    with pytest.raises(ProtocolError) as info:
        check_identity(IDENTITY, worker)
    assert str(info.value) == (
        "identity mismatch on n_layer: leader has 8, worker has 6; "
        "both ranks must load the same GGUF file"
    )


def test_check_hello_roles_versions_identity() -> None:
    worker = Hello(role=Role.WORKER, identity=IDENTITY, host_id=HOST, shm_offered=True)
    check_hello(LEADER_HELLO, worker)
    check_hello(worker, LEADER_HELLO)
    with pytest.raises(IdentityMismatch, match="both ranks say they are the leader"):
        check_hello(LEADER_HELLO, LEADER_HELLO)
    with pytest.raises(VersionMismatch, match="version 2, the peer speaks version 3"):
        check_hello(LEADER_HELLO, dataclasses.replace(worker, version=3))
    with pytest.raises(
        IdentityMismatch, match="architecture mismatch: this rank runs 'llama', the peer 'gemma3'"
    ):
        check_hello(LEADER_HELLO, dataclasses.replace(worker, architecture="gemma3"))
    with pytest.raises(LocalProtocolError, match=r"Hello\.architecture"):
        dataclasses.replace(worker, architecture="Gemma 3")
    with pytest.raises(IdentityMismatch, match="ctx_size: leader has 256, worker has 512"):
        check_hello(
            LEADER_HELLO,
            dataclasses.replace(worker, identity=dataclasses.replace(IDENTITY, ctx_size=512)),
        )


def test_execution_mode_mismatch_names_the_field_and_both_values() -> None:
    worker = Hello(
        role=Role.WORKER,
        identity=IDENTITY,
        host_id=HOST,
        shm_offered=True,
        execution_mode=tp.DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT,
    )
    expected = (
        "execution mode mismatch on expert_split: leader has experts, worker has "
        "intermediate; start both ranks with the same --expert-split"
    )
    for mine, peer in ((LEADER_HELLO, worker), (worker, LEADER_HELLO)):
        with pytest.raises(IdentityMismatch) as info:
            check_hello(mine, peer)
        assert str(info.value) == expected  # both ranks say the same, leader first
    both = dataclasses.replace(LEADER_HELLO, execution_mode=1)
    check_hello(both, worker)
    check_hello(worker, both)
    # The identity is checked first: a rank with another model is told that.
    other = dataclasses.replace(worker, identity=dataclasses.replace(IDENTITY, n_layer=6))
    with pytest.raises(IdentityMismatch, match="identity mismatch on n_layer"):
        check_hello(LEADER_HELLO, other)


def test_negotiate_gate_transport() -> None:
    worker = Hello(role=Role.WORKER, identity=IDENTITY, host_id=HOST, shm_offered=True)
    assert negotiate_gate_transport(LEADER_HELLO, worker) is GateTransport.SHM
    assert negotiate_gate_transport(worker, LEADER_HELLO) is GateTransport.SHM
    other_host = dataclasses.replace(worker, host_id=bytes(15) + b"\x01")
    assert negotiate_gate_transport(LEADER_HELLO, other_host) is GateTransport.TCP
    not_offered = dataclasses.replace(worker, shm_offered=False)
    assert negotiate_gate_transport(LEADER_HELLO, not_offered) is GateTransport.TCP
    unknown = bytes(16)
    assert (
        negotiate_gate_transport(
            dataclasses.replace(LEADER_HELLO, host_id=unknown),
            dataclasses.replace(worker, host_id=unknown),
        )
        is GateTransport.TCP
    )
    no_slab = dataclasses.replace(LEADER_HELLO, shm_name="")
    assert negotiate_gate_transport(no_slab, worker) is GateTransport.TCP


@pytest.mark.parametrize(
    "build",
    [
        lambda: Eval(token=1 << 31),
        lambda: Eval(token=1, seq=-1),
        lambda: Hash(value=1 << 64),
        lambda: Verify(drafts=tuple(range(9))),
        lambda: Verify(drafts=(1,), flags=8),
        lambda: EvalBatch(items=(BatchItem(1, 2),) * (tp.TP_MAX_BATCH_ITEMS + 1)),
        lambda: Logits(values=b"abc"),
        lambda: Identity(**{**dataclasses.asdict(IDENTITY), "n_layer": -1}),
        lambda: Identity(**{**dataclasses.asdict(IDENTITY), "gate_slot_mask": (0,)}),
        lambda: Hello(role=Role.LEADER, identity=IDENTITY, shm_name="x"),
        lambda: Hello(role=Role.LEADER, identity=IDENTITY, host_id=b"short"),
        lambda: Hello(role=Role.LEADER, identity=IDENTITY, execution_mode=2),
        lambda: Hello(role=Role.LEADER, identity=IDENTITY, execution_mode=-1),
        lambda: GateHeader(1 << 16, Gate.ATTN, 0, 1, 1),
    ],
)
def test_frames_validate_their_fields(build: object) -> None:
    with pytest.raises(LocalProtocolError):
        build()  # type: ignore[operator]


def test_gate_header_golden_and_describe() -> None:
    h = GateHeader(layer=3, gate=Gate.FFN, seq=17, rows=4, n_embd=1024)
    golden = bytes.fromhex("0300 01 00 1100000000000000 04000000 00040000")
    assert h.encode() == golden
    assert GateHeader.decode(golden) == h
    assert h.payload_bytes == 4 * 4 * 1024
    assert h.describe() == "layer 3 gate FFN seq 17 (4 x 1024)"
    with pytest.raises(TpProtocolError, match="gate 2"):
        GateHeader.decode(bytes.fromhex("0300 02 00") + bytes(16))


def test_slab_layout() -> None:
    lay = SlabLayout(1024)
    assert lay.slot_rows == 256  # 1 MiB rounds of 4 KiB rows
    assert lay.data_capacity == 1024 * 1024
    assert lay.slot_stride == 64 + 1024 * 1024 + 64
    assert lay.slot_offset(1, 1) == 64 + 3 * lay.slot_stride
    assert lay.seq_end_offset(0, 0) == 64 + 64 + 1024 * 1024
    assert tp.slab_bytes(1024) == lay.total_bytes == 64 + 4 * lay.slot_stride
    assert SlabLayout(1 << 20).slot_rows == tp.DS4_TP_BATCH_MAX_ROWS
    header = bytearray(lay.header_bytes(checksum=True))
    assert header[:8] == b"DTPS\x02\x00\x01\x00"  # magic, version 2, flags: checksum
    assert lay.check_header(header) is True
    assert lay.check_header(lay.header_bytes(checksum=False)) is False
    with pytest.raises(TpProtocolError, match="n_embd is 1024, expected 512"):
        SlabLayout(512).check_header(header)
    header[6] = 3  # an unknown flag
    with pytest.raises(TpProtocolError, match="flags is 3, expected 1"):
        lay.check_header(header)


frame_st = st.one_of(
    st.builds(Sync, tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40).map(tuple),
              session_id=st.integers(0, 2**64 - 1)),
    st.builds(Eval, token=st.integers(-(2**31), 2**31 - 1), seq=st.integers(0, 2**64 - 1)),
    st.builds(Rewind, pos=st.integers(-(2**31), 2**31 - 1)),
    st.builds(Hash, value=st.integers(0, 2**64 - 1)),
    st.builds(Logits, values=st.binary(max_size=64).map(lambda b: b[: len(b) // 4 * 4])),
    st.builds(Verify, drafts=st.lists(st.integers(0, 1000), min_size=1, max_size=8).map(tuple),
              flags=st.integers(0, tp.DS4_TP_VERIFY_FLAGS)),
    st.builds(VerifyCommit, mode=st.sampled_from(VerifyCommitMode),
              token_count=st.integers(-5, 5)),
    st.builds(EvalBatch, items=st.lists(st.builds(BatchItem, st.integers(0, 2**64 - 1),
                                                  st.integers(-1, 300)), max_size=5).map(tuple)),
    st.builds(MixedBatch, prompt=st.lists(st.integers(0, 300), max_size=10).map(tuple),
              items=st.lists(st.builds(BatchItem, st.integers(0, 9), st.integers(0, 9)),
                             max_size=3).map(tuple)),
    st.builds(SyncCheckpoint, point=st.integers(0, 2**32 - 1), current=st.integers(0, 9),
              total=st.integers(0, 9), requested=st.booleans()),
    st.sampled_from([Stop(), Invalidate(session_id=3), SessionDestroy(session_id=4),
                     SessionCreate(ctx_size=7), CommandAck(status=2)]),
)  # fmt: skip


@given(st.lists(frame_st, max_size=8), st.integers(1, 50))
def test_round_trip_in_random_chunks(frames: list[tp.ControlFrame], chunk: int) -> None:
    stream = b"".join(encode(f) for f in frames)
    decoder = TpDecoder()
    got: list[tp.Frame] = []
    for i in range(0, len(stream), chunk):
        decoder.feed(stream[i : i + chunk])
        while (frame := decoder.next_event()) is not None:
            got.append(frame)
    assert got == frames
    assert decoder.buffered == 0


@settings(max_examples=300)
@given(st.binary(max_size=400), st.booleans(), st.integers(0, 200))
def test_random_bytes_give_frames_or_a_clean_error(
    data: bytes, hello_first: bool, max_payload: int
) -> None:
    decoder = TpDecoder(max_payload, expect_hello=hello_first)
    # half the time, start from a valid header so the payload parsers see random input too
    if data and data[0] % 2:
        code = sorted(tp.FRAME_CLASSES)[data[0] % len(tp.FRAME_CLASSES)]
        data = header(code, len(data) - 1) + data[1:]
    try:
        for i in range(0, len(data), 7):
            decoder.feed(data[i : i + 7])
            for _ in range(len(data) + 1):  # bounded: each frame consumes at least a header
                if decoder.next_event() is None:
                    break
            assert decoder.buffered < tp.HELLO_SIZE + tp.FRAME_HEADER_SIZE + max_payload + 7
    except TpProtocolError:
        pass


def test_max_payload_follows_the_largest_frame_of_the_model() -> None:
    """The bound is the largest of the frames' sizes: LOGITS of max_rows rows of the larger
    vocabulary half (odd and even vocabularies), a MIXED_BATCH of a long context."""
    batch_items = tp.BATCH_ITEM.size * tp.TP_MAX_BATCH_ITEMS
    for n_vocab, half in ((100_001, 50_001), (100_000, 50_000)):
        ident = dataclasses.replace(IDENTITY, n_vocab=n_vocab)
        assert tp.max_payload_for(ident, 1) == 4 + 4 * half
        assert tp.max_payload_for(ident, 8) == 4 + 4 * 8 * half
    ident = dataclasses.replace(IDENTITY, ctx_size=40_000)
    assert tp.max_payload_for(ident, 8) == 8 + 4 * 40_000 + batch_items


def test_max_payload_follows_the_largest_worker_block_of_a_world() -> None:
    """With shares a worker may return more than half the vocabulary (1,3: rank 1 holds 3/4):
    the leader's bound follows its block, and a LOGITS of it passes where the half would not."""
    from foundry.model.spec.config import ModelConfig
    from foundry.tp.handshake import largest_worker_block

    cfg = ModelConfig(n_vocab=262_144)
    assert largest_worker_block(cfg, (1, 1)) == 131_072
    assert largest_worker_block(cfg, (1, 3)) == 196_608
    assert largest_worker_block(cfg, (2, 1, 1)) == 65_536
    ident = dataclasses.replace(IDENTITY, n_vocab=262_144)
    limit = tp.max_payload_for(ident, 16, 196_608)
    assert limit == 4 + 4 * 16 * 196_608
    assert _logits_header_accepted(limit, 16, 196_608)
    assert not _logits_header_accepted(tp.max_payload_for(ident, 16), 16, 196_608)


def test_logits_rows_cover_a_verify_block_and_every_session() -> None:
    assert tp.logits_rows(1) == tp.logits_rows(8) == tp.DS4_TP_BATCH_MAX_ROWS == 8
    assert tp.logits_rows(9) == 9 and tp.logits_rows(16) == 16
    assert tp.logits_rows(tp.TP_MAX_BATCH_ITEMS) == tp.TP_MAX_BATCH_ITEMS
    for bad in (0, tp.TP_MAX_BATCH_ITEMS + 1):
        with pytest.raises(LocalProtocolError, match="max_sessions"):
            tp.logits_rows(bad)
    with pytest.raises(LocalProtocolError, match="max_rows"):
        tp.max_payload_for(IDENTITY, 0)


def _logits_header_accepted(limit: int, rows: int, half: int) -> bool:
    """Whether a decoder bounded by ``limit`` takes the header of a LOGITS frame of ``rows``
    rows of ``half`` floats (the header alone is checked before any payload byte is kept)."""
    decoder = TpDecoder(limit)
    decoder.feed(header(FrameType.LOGITS, 4 + 4 * rows * half))
    try:
        return decoder.next_event() is None  # waiting for the payload: accepted
    except TpProtocolError as exc:
        assert "exceeds the limit" in str(exc)
        return False


@settings(max_examples=200, deadline=None)
@given(
    n_vocab=st.one_of(
        st.sampled_from([259, 32_000, 32_001, 128_256, 151_936, 262_144]), st.integers(2, 300_000)
    ),
    ctx_size=st.sampled_from([256, 2048, 8192, 32_768]),
    max_sessions=st.integers(1, 64),
    drafts=st.integers(0, tp.DS4_TP_BATCH_MAX_ROWS - 1),
    batch=st.integers(1, 64),
)
def test_every_logits_reply_of_the_pair_fits_the_bound(
    n_vocab: int, ctx_size: int, max_sessions: int, drafts: int, batch: int
) -> None:
    """Whatever the vocabulary (odd, even, Gemma's 262,144), the batch and the draft length,
    the worker's LOGITS reply to a VERIFY block or to a batch of every session fits the bound
    the leader's decoder uses, and one float more than the largest reply does not when LOGITS
    is the largest frame."""
    ident = dataclasses.replace(IDENTITY, n_vocab=n_vocab, ctx_size=ctx_size)
    half = (n_vocab + 1) // 2
    rows = tp.logits_rows(max_sessions)
    limit = tp.max_payload_for(ident, rows)
    assert _logits_header_accepted(limit, drafts + 1, half)  # a VERIFY block
    assert _logits_header_accepted(limit, min(batch, max_sessions), half)  # EVAL_BATCH
    assert _logits_header_accepted(limit, rows, half)
    largest_logits = 4 + 4 * rows * half
    assert limit >= largest_logits
    if limit == largest_logits:
        decoder = TpDecoder(limit)
        decoder.feed(header(FrameType.LOGITS, largest_logits + 4))
        with pytest.raises(TpProtocolError, match="exceeds the limit"):
            decoder.next_event()


def test_gemma_sized_logits_of_sixteen_sessions_decode_under_the_bound() -> None:
    """The frame that once failed every greedy request on the Gemma 3 file: 16 rows of a
    131,072-float half, encoded and decoded whole under the leader's bound."""
    ident = dataclasses.replace(IDENTITY, n_vocab=262_144, ctx_size=4096)
    rows = np.arange(16 * 131_072, dtype=np.float32).reshape(16, 131_072)
    frame = Logits.from_array(rows)
    limit = tp.max_payload_for(ident, tp.logits_rows(16))
    assert limit == 4 + 4 * 16 * 131_072
    (got,) = decode_all(encode(frame), max_payload=limit)
    assert isinstance(got, Logits) and np.array_equal(got.array(), rows.ravel())


# -- every range check at its bounds (built inside the tests: a record built at import would be
# checked before a mutation test run chooses its mutant)

_U16, _U32, _U64 = 0xFFFF, 0xFFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _identity(**changes: Any) -> Identity:
    return Identity(**{**dataclasses.asdict(IDENTITY), **changes})


def _mask_word(i: int) -> Any:
    return lambda v: _identity(gate_slot_mask=tuple(v if j == i else 0 for j in range(4)))


RANGES: list[tuple[str, str, int, int, Any]] = [
    ("Identity", "gguf_bytes", 0, _U64, lambda v: _identity(gguf_bytes=v)),
    *[("Identity", name, 0, _U32, (lambda n: lambda v: _identity(**{n: v}))(name))
      for name in IDENTITY_FIELDS[1:-1]],
    *[("Identity", "gate_slot_mask", 0, _U64, _mask_word(i)) for i in range(4)],
    ("Hello", "version", 0, _U16, lambda v: Hello(role=Role.LEADER, identity=IDENTITY, version=v)),
    ("Stop", "session_id", 0, _U64, lambda v: Stop(session_id=v)),
    ("Eval", "seq", 0, _U64, lambda v: Eval(token=1, seq=v)),
    ("BatchItem", "session_id", 0, _U64, lambda v: BatchItem(v, 1)),
    ("BatchItem", "token", _I32_MIN, _I32_MAX, lambda v: BatchItem(1, v)),
    ("GateHeader", "layer", 0, _U16, lambda v: GateHeader(v, Gate.ATTN, 1, 1, 1)),
    ("GateHeader", "seq", 0, _U64, lambda v: GateHeader(1, Gate.ATTN, v, 1, 1)),
    ("GateHeader", "rows", 0, _U32, lambda v: GateHeader(1, Gate.ATTN, 1, v, 1)),
    ("GateHeader", "n_embd", 0, _U32, lambda v: GateHeader(1, Gate.ATTN, 1, 1, v)),
    ("SlabLayout", "n_embd", 1, _U32, lambda v: SlabLayout(v)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("owner", "name", "lo", "hi", "build"), RANGES, ids=[f"{o}.{n}" for o, n, *_ in RANGES]
)
def test_range_checks_at_their_bounds(owner: str, name: str, lo: int, hi: int, build: Any) -> None:
    """Each bound is accepted and stored, one past it is refused, naming the record, the field,
    the range and the value; a bool is no integer."""
    for value in (lo, hi):
        stored = getattr(build(value), name)
        assert value in stored if isinstance(stored, tuple) else stored == value
    for bad in (lo - 1, hi + 1, True, 1.0):
        with pytest.raises(LocalProtocolError) as info:
            build(bad)
        assert str(info.value) == (
            f"{owner}.{name} must be an integer in [{lo}, {hi}], got {bad!r}"
        )


def test_execution_mode_range_and_bits() -> None:
    def hello(mode: Any) -> Hello:
        return Hello(role=Role.LEADER, identity=IDENTITY, execution_mode=mode)

    assert hello(0).execution_mode == 0
    assert hello(1).execution_mode == tp.DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT
    for mode in (-1, _U16 + 1, True):
        with pytest.raises(LocalProtocolError) as info:
            hello(mode)
        assert str(info.value) == (
            f"Hello.execution_mode must be an integer in [0, {_U16}], got {mode!r}"
        )
    with pytest.raises(LocalProtocolError) as info:
        hello(_U16)
    assert str(info.value) == (
        "Hello.execution_mode 0xffff has bits this implementation does not run (supported: 0x1)"
    )


def test_hello_fields_are_checked_with_exact_messages() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"architecture": "x" * 17},
            "Hello.architecture 'xxxxxxxxxxxxxxxxx' is not 1-16 characters of [a-z0-9_-]",
        ),
        ({"role": 0}, "Hello.role must be a Role, got 0"),
        ({"host_id": b"short"}, "Hello.host_id must be 16 bytes, got 5"),
        ({"shm_name": "x"}, "Hello.shm_name is set but shm_offered is False"),
        (
            {"shm_name": "a/b", "shm_offered": True},
            "Hello.shm_name 'a/b' is not a bare file name of at most 63 characters from "
            "[A-Za-z0-9._-]",
        ),
    ]
    for changes, message in cases:
        with pytest.raises(LocalProtocolError) as info:
            Hello(**{"role": Role.LEADER, "identity": IDENTITY, **changes})
        assert str(info.value) == message
    longest = Hello(role=Role.WORKER, identity=IDENTITY, architecture="a" * 16)
    assert longest.architecture == "a" * 16
    assert (
        Hello(role=Role.LEADER, identity=IDENTITY, shm_offered=True, shm_name="s" * 63).shm_name
        == "s" * 63
    )
    with pytest.raises(LocalProtocolError, match="not a bare file name"):
        Hello(role=Role.LEADER, identity=IDENTITY, shm_offered=True, shm_name="s" * 64)
    with pytest.raises(LocalProtocolError) as info:
        _identity(gate_slot_mask=(0, 0, 0, 0, 0))
    assert str(info.value) == "Identity.gate_slot_mask must have 4 words, got 5"
    with pytest.raises(LocalProtocolError) as info:
        GateHeader(1, 1, 1, 1, 1)  # type: ignore[arg-type]
    assert str(info.value) == "GateHeader.gate must be a Gate, got 1"


@pytest.mark.parametrize(
    ("build", "owner"),
    [
        (lambda t: Sync(tokens=t), "Sync.tokens"),
        (lambda t: Verify(drafts=t), "Verify.drafts"),
        (lambda t: MixedBatch(prompt=t), "MixedBatch.prompt"),
    ],
)
def test_token_lists_hold_int32_and_are_stored_as_tuples(build: Any, owner: str) -> None:
    edge = build([_I32_MIN, _I32_MAX])
    field = owner.split(".")[1]
    assert getattr(edge, field) == (_I32_MIN, _I32_MAX)  # a list given is stored as a tuple
    assert edge == build((_I32_MIN, _I32_MAX))
    for bad in ((_I32_MIN - 1, 0), (0, _I32_MAX + 1)):
        with pytest.raises(LocalProtocolError) as info:
            build(bad)
        assert str(info.value) == f"{owner} holds a token outside int32"


@pytest.mark.parametrize(
    ("build", "owner"),
    [(lambda i: EvalBatch(items=i), "EvalBatch"), (lambda i: MixedBatch(items=i), "MixedBatch")],
)
def test_batch_items_at_their_limit(build: Any, owner: str) -> None:
    full = [BatchItem(i, i) for i in range(tp.TP_MAX_BATCH_ITEMS)]
    frame = build(full)
    assert frame.items == tuple(full)  # stored as a tuple
    assert frame == build(tuple(full))
    [decoded] = decode_all(encode(frame))
    assert decoded == frame
    with pytest.raises(LocalProtocolError) as info:
        build([*full, BatchItem(0, 0)])
    assert str(info.value) == f"{owner}.items holds 1025 > 1024 items"
    with pytest.raises(LocalProtocolError) as info:
        build([(1, 2)])
    assert str(info.value) == f"{owner}.items must hold BatchItem, got (1, 2)"


def test_verify_rows_and_flags_exact() -> None:
    for n in (1, tp.DS4_TP_BATCH_MAX_ROWS):
        assert Verify(drafts=list(range(n))).drafts == tuple(range(n))  # type: ignore[arg-type]
    for n in (0, tp.DS4_TP_BATCH_MAX_ROWS + 1):
        with pytest.raises(LocalProtocolError) as info:
            Verify(drafts=tuple(range(n)))
        assert str(info.value) == f"Verify.drafts must hold 1..8 rows, got {n}"
    assert Verify(drafts=(1,), flags=tp.DS4_TP_VERIFY_FLAGS).flags == 7
    with pytest.raises(LocalProtocolError) as info:
        Verify(drafts=(1,), flags=0x1F)
    assert str(info.value) == "Verify.flags has unknown bits 0x18"


def test_logits_from_array_and_whole_floats() -> None:
    frame = Logits.from_array(np.array([1.0, -2.0]))  # float64 in: float32 on the wire
    assert frame.values == bytes.fromhex("0000803f 000000c0")
    assert (frame.session_id, frame.seq) == (0, 0)
    assert Logits.from_array(np.zeros(1, np.float32), session_id=3, seq=4).session_id == 3
    with pytest.raises(LocalProtocolError) as info:
        Logits(values=b"abcde")
    assert str(info.value) == "Logits.values must be whole float32s, got 5 bytes"


def test_payload_size_rules_of_every_frame() -> None:
    """PAYLOAD_BASE + k * PAYLOAD_UNIT per type (set when the classes are made, at import)."""
    rules = {t.name: (cls.PAYLOAD_BASE, cls.PAYLOAD_UNIT) for t, cls in tp.FRAME_CLASSES.items()}
    assert rules == {
        "SYNC": (0, 4), "EVAL": (4, 0), "REWIND": (4, 0), "INVALIDATE": (0, 0), "STOP": (0, 0),
        "HASH": (8, 0), "LOGITS": (4, 4), "VERIFY": (4, 4), "VERIFY_COMMIT": (8, 0),
        "SESSION_CREATE": (4, 0), "SESSION_DESTROY": (0, 0), "EVAL_BATCH": (0, 16),
        "MIXED_BATCH": (8, 4), "COMMAND_ACK": (4, 0), "SYNC_CHECKPOINT": (13, 0),
        "WORLD": (0, 28),
    }  # fmt: skip


def test_payload_length_messages_exact() -> None:
    for data, message in [
        (
            header(FrameType.LOGITS, 8) + bytes.fromhex("02000000 0000803f"),
            "LOGITS says 2 floats but its payload is 8 bytes (expected 12)",
        ),
        (
            header(FrameType.MIXED_BATCH, 12) + bytes.fromhex("01000000 01000000 00000000"),
            "MIXED_BATCH says 1 prompt tokens and 1 items, which is 28 bytes, but its payload is "
            "12 bytes",
        ),
        (header(FrameType.EVAL, 5), "EVAL payload must be exactly 4 bytes, got 5"),
        (header(FrameType.SYNC, 6), "SYNC payload must be 0 + a multiple of 4 bytes, got 6"),
        (
            header(FrameType.EVAL, 4, flags=1, reserved=2),
            "EVAL: header flags 0x1 / reserved 2 must be 0 in protocol version 2",
        ),
        (header(99, 0), "unknown frame type 99"),
        (
            header(FrameType.SYNC_CHECKPOINT, 13) + bytes(12) + b"\x02",
            "SYNC_CHECKPOINT: requested must be 0 or 1, got 2",
        ),
        (
            header(FrameType.EVAL_BATCH, 16) + bytes.fromhex("0300000000000000 00000000 01000000"),
            "batch item for session 3: nonzero reserved word",
        ),
        (
            b"XXXX" + bytes(24),
            "bad frame magic 0x58585858 (expected 0x34505444, 'DTP4'): the "
            "stream is out of step or the peer does not speak the TP protocol",
        ),
        (
            tp.HELLO_PREFIX.pack(tp.TP_HELLO_MAGIC, 2, 184) + bytes(20),
            "unexpected hello after the handshake",
        ),
        (
            header(FrameType.VERIFY, 8) + bytes.fromhex("08000000 01000000"),
            "VERIFY: Verify.flags has unknown bits 0x8",
        ),
    ]:
        decoder = TpDecoder()
        decoder.feed(data)
        with pytest.raises(TpProtocolError) as info:
            decoder.next_event()
        assert str(info.value) == message
    # MIXED_BATCH: the payload at its stated size decodes, with the prompt before the items.
    data = header(FrameType.MIXED_BATCH, 28) + bytes.fromhex(
        "01000000 01000000 05000000 0700000000000000 09000000 00000000"
    )
    assert decode_all(data) == [MixedBatch(prompt=(5,), items=(BatchItem(7, 9),))]


def test_hello_prefix_messages_exact() -> None:
    for data, kind, message in [
        (encode(Stop()), TpProtocolError, "expected the peer's hello first, got a control frame"),
        (
            b"GET / HT",
            TpProtocolError,
            "bad hello magic 0x20544547 (expected 0x48505444, "
            "'DTPH'): the peer does not speak the TP protocol",
        ),
        (
            tp.HELLO_PREFIX.pack(tp.TP_HELLO_MAGIC, 1, 184),
            VersionMismatch,
            "TP protocol version mismatch: this rank speaks version 2, the peer speaks version 1; "
            "run the same foundry release on both ranks",
        ),
        (
            tp.HELLO_PREFIX.pack(tp.TP_HELLO_MAGIC, 2, 185),
            TpProtocolError,
            "hello of version 2 must be 184 bytes (224 with the world extension, 232 with the "
            "weight too), the peer says 185",
        ),
    ]:
        decoder = TpDecoder(expect_hello=True)
        decoder.feed(data)
        with pytest.raises(kind) as info:
            decoder.next_event()
        assert str(info.value) == message
    with pytest.raises(ValueError, match=r"^max_payload must be >= 0, got -1$"):
        TpDecoder(-1)
    [stop] = decode_all(encode(Stop()), max_payload=0)  # a limit of 0 takes empty payloads
    assert stop == Stop()


def test_hello_fields_round_trip() -> None:
    """Every identity and hello field travels in its own place, both ways (a hello built here,
    with values that differ from the defaults)."""
    ident = _identity(
        gate_slot_start=3, gate_slot_step=2, gates_per_token=5, gate_slot_mask=(1, 2, 3, _U64)
    )
    hello = Hello(
        role=Role.WORKER,
        identity=ident,
        host_id=HOST,
        shm_offered=True,
        shm_name="slab-X",
        execution_mode=1,
        architecture="gemma3",
    )
    data = encode(hello)
    assert data[8:12] == bytes.fromhex("01 01 0100")  # role worker, flags: shm, mode 1
    assert data[44:56] == bytes.fromhex("03000000 02000000 05000000")  # start, step, per token
    assert data[104:111] == b"slab-X\0" and data[168:175] == b"gemma3\0"
    assert decode_all(data, expect_hello=True) == [hello]
    plain = Hello(role=Role.LEADER, identity=ident)
    data = encode(plain)
    assert data[8:12] == bytes.fromhex("00 00 0000")  # no shm offered: flags 0
    [decoded] = decode_all(data, expect_hello=True)
    assert decoded == plain and decoded.shm_offered is False


def test_hello_field_errors_exact() -> None:
    data = bytearray(encode(Hello(role=Role.LEADER, identity=IDENTITY)))
    for offset, value, message in [
        (
            10,
            b"\x02\x00",
            "hello: execution mode 0x2 has bits this implementation does not run "
            "(supported: 0x1: 1 = experts cut by their intermediate size)",
        ),
        (9, b"\x08", "hello: unknown flags 0x8"),
        (8, b"\x02", "hello: unknown role 2 (0 leader, 1 worker)"),
        (104, b"\xff", "hello: shm name b'\\xff' is not UTF-8"),
        (168, b"llamaX", "hello: Hello.architecture 'llamaX' is not 1-16 characters of [a-z0-9_-]"),
        (
            168,
            b"\xc3\xa9",
            "hello: Hello.architecture '\ufffd\ufffdama' is not 1-16 characters of [a-z0-9_-]",
        ),  # not ASCII: each byte replaced, refused like any other
    ]:
        bad = bytearray(data)
        bad[offset : offset + len(value)] = value
        decoder = TpDecoder(expect_hello=True)
        decoder.feed(bad)
        with pytest.raises(TpProtocolError) as info:
            decoder.next_event()
        assert str(info.value) == message


def test_identity_and_role_messages_exact_from_both_sides() -> None:
    worker_ident = _identity(ctx_size=512)
    expected = (
        "identity mismatch on ctx_size: leader has 256, worker has 512; start both "
        "ranks with the same context size"
    )
    leader = Hello(role=Role.LEADER, identity=_identity())
    worker = Hello(role=Role.WORKER, identity=worker_ident)
    for mine, peer in ((leader, worker), (worker, leader)):
        with pytest.raises(IdentityMismatch) as info:
            check_hello(mine, peer)
        assert str(info.value) == expected
    with pytest.raises(IdentityMismatch) as info:
        check_identity(worker_ident, _identity(), mine_role=Role.WORKER)
    assert str(info.value) == expected
    with pytest.raises(IdentityMismatch) as info:
        check_identity(_identity(), _identity(gate_slot_step=2))
    assert str(info.value) == (
        "identity mismatch on gate_slot_step: leader has 1, worker has 2; "
        "both ranks must load the same GGUF file with the same foundry "
        "release"
    )
    for role, other in ((Role.LEADER, "worker"), (Role.WORKER, "leader")):
        one = Hello(role=role, identity=_identity())
        with pytest.raises(IdentityMismatch) as info:
            check_hello(one, one)
        assert str(info.value) == (
            f"role mismatch: both ranks say they are the {role.name.lower()}"
            f"; start exactly one rank as the {other}"
        )


def test_slab_header_mismatch_names_each_field() -> None:
    lay = SlabLayout(1024)
    good = lay.header_bytes(checksum=False)
    got = tp.SLAB_HEADER.unpack(good)
    names = ("magic", "version", "flags", "n_embd", "slot_rows", "slot_stride", "bytes")
    for i, name in enumerate(names):
        values = list(got)
        values[i] += 2  # flags 2: an unknown bit (1 is the checksum)
        with pytest.raises(TpProtocolError) as info:
            lay.check_header(tp.SLAB_HEADER.pack(*values))
        assert str(info.value) == (
            f"shared-memory slab {name} is {values[i]}, expected {got[i]}: the slab was made by "
            "another foundry release or for another model"
        )
