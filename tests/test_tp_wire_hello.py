"""The tensor-parallel wire's hello: golden bytes with its world, weight and threads
extensions, the identity and execution-mode checks naming the field, the gate transport
negotiated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from tp_wire_values import (
    _U64,
    HOST,
    IDENTITY,
    IDENTITY_FIELDS,
    LEADER_HELLO,
    decode_all,
    header,
    identity_with,
)

from foundry.wire import tp
from foundry.wire.errors import LocalProtocolError, ProtocolError
from foundry.wire.tp import (
    FrameType,
    GateTransport,
    Hello,
    IdentityMismatch,
    Role,
    Stop,
    TpDecoder,
    TpProtocolError,
    VersionMismatch,
    World,
    WorldInfo,
    WorldPeer,
    check_hello,
    check_identity,
    encode,
    negotiate_gate_transport,
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


# A worker answering a world whose shares are still to be chosen, with its weight.
WEIGHT_HELLO = Hello(
    role=Role.WORKER,
    identity=IDENTITY,
    world=WorldInfo(
        world_size=3, shares=(), rank=2, gate_port=7100, shares_from=tp.SharesFrom.SPEED
    ),
    weight=tp.RankWeight(speed=10000),
)


def test_weight_hello_golden_bytes_and_round_trip() -> None:
    """A worker answering a world whose shares are still to be chosen: the world extension with
    shares_from set and no shares, then its weight (flag bit 2, hello_size 232)."""
    assert tp.WEIGHT_EXT.size == 8 and tp.HELLO_WEIGHT_SIZE == 232
    worker = WEIGHT_HELLO
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


THREADS_EXT_GOLDEN = bytes.fromhex(
    "0400"  # threads 4
    "0000"  # reserved
)


def test_threads_hello_golden_bytes_and_round_trip() -> None:
    """A worker stating the world states its threads too: flag bit 3, 4 bytes after the last
    extension (hello_size 228 after the world, 236 after the weight); only with the world."""
    assert tp.THREADS_EXT.size == 4 and tp.HELLO_THREADS == 8
    assert tp.HELLO_SIZES == (184, 224, 228, 232, 236)
    world = WorldInfo(world_size=3, shares=(2, 1, 1), rank=2, gate_port=7100)
    worker = Hello(role=Role.WORKER, identity=IDENTITY, world=world, threads=4)
    wire = encode(worker)
    assert len(wire) == 228 and wire[6:8] == bytes.fromhex("e400")
    assert wire[9] == tp.HELLO_WORLD | tp.HELLO_THREADS == 0x0A
    assert wire[184:] == bytes.fromhex("0300 0200 bc1b 0000") + WORLD_EXT_GOLDEN[8:] + (
        THREADS_EXT_GOLDEN
    )
    assert decode_all(wire, expect_hello=True) == [worker]
    assert decode_all(wire, expect_hello=True)[0].threads == 4
    # 0: a worker that does not know its threads.
    assert decode_all(encode(dataclasses.replace(worker, threads=0)), expect_hello=True) == [
        dataclasses.replace(worker, threads=0)
    ]
    # After the weight: at 232.
    weighted = dataclasses.replace(WEIGHT_HELLO, threads=4)
    both = encode(weighted)
    assert len(both) == 236 and both[6:8] == bytes.fromhex("ec00") and both[9] == 0x0E
    assert both[184:] == PENDING_EXT_GOLDEN + WEIGHT_EXT_GOLDEN + THREADS_EXT_GOLDEN
    assert decode_all(both, expect_hello=True) == [weighted]
    # Threads are not compared: ranks on other thread counts form one world.
    leader = dataclasses.replace(LEADER_HELLO, world=WorldInfo(world_size=3, shares=(2, 1, 1)))
    tp.check_hello(leader, worker)
    # Not without the world; a reserved word other than 0; a size that disagrees with the flags.
    with pytest.raises(LocalProtocolError, match="threads goes only with the world extension"):
        Hello(role=Role.WORKER, identity=IDENTITY, threads=4)
    with pytest.raises(LocalProtocolError, match=r"Hello\.threads must be an integer"):
        dataclasses.replace(worker, threads=1 << 16)
    for data, message in [
        (
            HELLO_GOLDEN[:9] + b"\x09" + HELLO_GOLDEN[10:],
            "hello: the threads flag is set without the world flag",
        ),
        (wire[:226] + b"\x01\x00", "hello: threads extension reserved word is 1, not 0"),
        (both[:235] + b"\x01", "hello: threads extension reserved word is 256, not 0"),
    ]:
        with pytest.raises(TpProtocolError) as info:
            decode_all(data, expect_hello=True)
        assert str(info.value) == message
    with pytest.raises(TpProtocolError) as info:  # the threads flag cleared, the size kept
        decode_all(wire[:9] + b"\x02" + wire[10:], expect_hello=True)
    assert str(info.value) == (
        "hello: the world flag is set, the weight flag clear, the threads flag clear, so the "
        "hello is 224 bytes, but it says 228 (184 plain, 224 with the world extension, 8 more "
        "with the weight, 4 more with the threads)"
    )
    with pytest.raises(TpProtocolError, match="so the hello is 228 bytes, but it says 224"):
        decode_all(wire[:6] + bytes.fromhex("e000") + wire[8:224], expect_hello=True)
    with pytest.raises(TpProtocolError, match="so the hello is 236 bytes, but it says 232"):
        decode_all(both[:6] + bytes.fromhex("e800") + both[8:232], expect_hello=True)
    # Fed one byte at a time, and with the next record behind it.
    decoder = TpDecoder(expect_hello=True)
    got = []
    for i in range(len(both)):
        decoder.feed(both[i : i + 1])
        if (event := decoder.next_event()) is not None:
            got.append(event)
    assert got == [weighted]
    assert decode_all(wire + encode(Stop()), expect_hello=True) == [worker, Stop()]


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
        (9, b"\x10", "unknown flags"),
        (9, b"\x08", "threads flag is set without the world flag"),
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
            "weight too, 4 more with the threads), the peer says 185",
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
    ident = identity_with(
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
        (9, b"\x10", "hello: unknown flags 0x10"),
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
    worker_ident = identity_with(ctx_size=512)
    expected = (
        "identity mismatch on ctx_size: leader has 256, worker has 512; start both "
        "ranks with the same context size"
    )
    leader = Hello(role=Role.LEADER, identity=identity_with())
    worker = Hello(role=Role.WORKER, identity=worker_ident)
    for mine, peer in ((leader, worker), (worker, leader)):
        with pytest.raises(IdentityMismatch) as info:
            check_hello(mine, peer)
        assert str(info.value) == expected
    with pytest.raises(IdentityMismatch) as info:
        check_identity(worker_ident, identity_with(), mine_role=Role.WORKER)
    assert str(info.value) == expected
    with pytest.raises(IdentityMismatch) as info:
        check_identity(identity_with(), identity_with(gate_slot_step=2))
    assert str(info.value) == (
        "identity mismatch on gate_slot_step: leader has 1, worker has 2; "
        "both ranks must load the same GGUF file with the same foundry "
        "release"
    )
    for role, other in ((Role.LEADER, "worker"), (Role.WORKER, "leader")):
        one = Hello(role=role, identity=identity_with())
        with pytest.raises(IdentityMismatch) as info:
            check_hello(one, one)
        assert str(info.value) == (
            f"role mismatch: both ranks say they are the {role.name.lower()}"
            f"; start exactly one rank as the {other}"
        )
