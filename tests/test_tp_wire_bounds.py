"""The tensor-parallel wire's bounds: payload limits that follow the model and the world, every
range checked at its bounds, exact messages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tp_wire_values import (
    _U16,
    _U32,
    _U64,
    IDENTITY,
    IDENTITY_FIELDS,
    decode_all,
    header,
    identity_with,
)

from foundry.wire import tp
from foundry.wire.errors import LocalProtocolError
from foundry.wire.tp import (
    BatchItem,
    DrawRow,
    Eval,
    EvalBatch,
    FrameType,
    Gate,
    GateHeader,
    Hello,
    Logits,
    MixedBatch,
    PickRow,
    Role,
    RowDraw,
    RowPicks,
    SlabLayout,
    Stop,
    Sync,
    TpDecoder,
    TpProtocolError,
    Verify,
    encode,
)


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


@functools.cache
def _largest_draw_frames(rows: int) -> tuple[bytes, bytes]:
    """The largest ROW_DRAW and ROW_PICKS of ``rows`` rows: every row drawn, and every row of
    the picks cut to ``TP_MAX_DRAW_TOP_K`` with all its candidates."""
    draw = RowDraw(rows=(DrawRow(1, tp.TP_MAX_DRAW_TOP_K, 3.0, 1.25, 2.0, 0.5, 7),) * rows)
    candidates = tuple((1.0 / (i + 1), i) for i in range(tp.TP_MAX_DRAW_TOP_K))
    picks = RowPicks(rows=(PickRow(tp.PICK_TOP_K, 0, 0.5, candidates),) * rows)
    return encode(draw), encode(picks)


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
    tops = tp.encode(tp.RowTops(values=(0.0,) * rows, tokens=(0,) * rows))  # the greedy reply
    assert decode_all(tops, max_payload=limit)[0].TYPE is FrameType.ROW_TOPS
    draw, picks = _largest_draw_frames(rows)  # the sampled rows' exchange, at its largest
    assert decode_all(draw, max_payload=limit)[0].TYPE is FrameType.ROW_DRAW
    (got,) = decode_all(picks, max_payload=limit)
    assert isinstance(got, RowPicks) and len(got.rows) == rows
    assert all(len(row.candidates) == tp.TP_MAX_DRAW_TOP_K for row in got.rows)
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


_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _mask_word(i: int) -> Any:
    return lambda v: identity_with(gate_slot_mask=tuple(v if j == i else 0 for j in range(4)))


RANGES: list[tuple[str, str, int, int, Any]] = [
    ("Identity", "gguf_bytes", 0, _U64, lambda v: identity_with(gguf_bytes=v)),
    *[("Identity", name, 0, _U32, (lambda n: lambda v: identity_with(**{n: v}))(name))
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
    ("DrawRow", "mode", 0, 1, lambda v: DrawRow(v, 0, 0.0, 1.0, 0.0, 0.0, 0)),
    ("DrawRow", "top_k", 0, tp.TP_MAX_DRAW_TOP_K, lambda v: DrawRow(1, v, 0.0, 1.0, 0.0, 0.0, 0)),
    ("DrawRow", "nonzero", 0, _U32, lambda v: DrawRow(1, 0, 0.0, 1.0, 0.0, 0.0, v)),
    ("PickRow", "kind", tp.PICK_NONE, tp.PICK_TOP_K, lambda v: PickRow(v, 0, 0.0)),
    ("PickRow", "index", 0, _I32_MAX, lambda v: PickRow(tp.PICK_TOKEN, v, 0.0)),
    ("PickRow", "index", _I32_MIN, _I32_MAX, lambda v: PickRow(tp.PICK_LEADER_WALK, v, 0.0)),
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
        identity_with(gate_slot_mask=(0, 0, 0, 0, 0))
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


def test_draw_and_pick_rows_exact() -> None:
    """The float fields of DrawRow and PickRow at their bounds, with exact messages; top, inv
    and the candidates' e are kept as the float32 the wire carries."""
    row = DrawRow(1, 0, 0.1, 1 / 0.7, 0.25, 0.0, 0)
    assert (row.top, row.inv) == (struct.unpack("<ff", struct.pack("<ff", 0.1, 1 / 0.7)))
    assert DrawRow(0, 0, 0, 0, 0, 0, 0) == DrawRow(0, 0, 0.0, 0.0, 0.0, 0.0, 0)  # no draw: zeros
    assert DrawRow(0, 0, math.nan, math.inf, 0.0, 0.0, 0).mode == 0  # unread on a row of mode 0
    assert DrawRow(1, 0, 0.0, 1.0, 0.0, math.nextafter(1.0, 0.0), 0).u < 1.0
    cases: list[tuple[Any, str]] = [
        (lambda: DrawRow(1, 0, 0.0, 1.0, 0.0, 1.0, 0), "DrawRow.u must be in [0, 1), got 1.0"),
        (lambda: DrawRow(1, 0, 0.0, 1.0, 0.0, -0.1, 0), "DrawRow.u must be in [0, 1), got -0.1"),
        (lambda: DrawRow(0, 0, 0.0, 0.0, 0.0, math.nan, 0), "DrawRow.u must be in [0, 1), got nan"),
        (lambda: DrawRow(1, 0, 0.0, 1.0, -1.0, 0.0, 0),
         "DrawRow.acc must be finite and >= 0, got -1.0"),
        (lambda: DrawRow(0, 0, 0.0, 0.0, math.inf, 0.0, 0),
         "DrawRow.acc must be finite and >= 0, got inf"),
        (lambda: DrawRow(1, 0, 0.0, 0.0, 0.0, 0.0, 0),
         "DrawRow.inv must be finite and > 0 on a drawn row (mode 1), got 0.0"),
        (lambda: DrawRow(1, 0, 0.0, 1e-50, 0.0, 0.0, 0),  # 0 as a float32
         "DrawRow.inv must be finite and > 0 on a drawn row (mode 1), got 0.0"),
        (lambda: DrawRow(1, 0, 0.0, math.inf, 0.0, 0.0, 0),
         "DrawRow.inv must be finite and > 0 on a drawn row (mode 1), got inf"),
        (lambda: DrawRow(1, 0, -math.inf, 1.0, 0.0, 0.0, 0),
         "DrawRow.top must be finite on a drawn row (mode 1), got -inf"),
        (lambda: DrawRow(1, 0, 1e39, 1.0, 0.0, 0.0, 0), "DrawRow.top 1e+39 does not fit a float32"),
        (lambda: DrawRow(1, 0, 0.0, True, 0.0, 0.0, 0),
         "DrawRow.inv must be a real number, got True"),
        (lambda: RowDraw(rows=(0,)), "RowDraw.rows must hold DrawRow, got 0"),
        (lambda: PickRow(tp.PICK_LEADER_WALK, 0, math.nan),
         "PickRow.target must be finite, got nan"),
        (lambda: PickRow(tp.PICK_TOKEN, 1, 0.0, ((0.5, 1),)),
         "PickRow of kind 1 (PICK_TOKEN) has 1 candidates: only a PICK_TOP_K (4) row has them"),
        (lambda: PickRow(tp.PICK_TOP_K, 0, 0.0, ((0.5, 1),) * 257),
         "PickRow.candidates holds 257 > 256 candidates"),
        (lambda: PickRow(tp.PICK_TOP_K, 0, 0.0, ([0.5, 1],)),
         "PickRow.candidates must hold (e, index) pairs, got [0.5, 1]"),
        (lambda: PickRow(tp.PICK_TOP_K, 0, 0.0, ((0.5, -1),)),
         f"PickRow.candidates must be an integer in [0, {_I32_MAX}], got -1"),
        (lambda: RowPicks(rows=(0,)), "RowPicks.rows must hold PickRow, got 0"),
    ]  # fmt: skip
    for build, message in cases:
        with pytest.raises(LocalProtocolError) as info:
            build()
        assert str(info.value) == message
    full = PickRow(tp.PICK_TOP_K, 0, 0.0, [(0.1, i) for i in range(tp.TP_MAX_DRAW_TOP_K)])
    assert isinstance(full.candidates, tuple) and len(full.candidates) == 256
    assert full.candidates[0] == (struct.unpack("<f", struct.pack("<f", 0.1))[0], 0)
    assert PickRow(tp.PICK_TOP_K, 0, 0.0, ((0.5, _I32_MAX),)).candidates == ((0.5, _I32_MAX),)


def test_payload_size_rules_of_every_frame() -> None:
    """PAYLOAD_BASE + k * PAYLOAD_UNIT per type (set when the classes are made, at import)."""
    rules = {t.name: (cls.PAYLOAD_BASE, cls.PAYLOAD_UNIT) for t, cls in tp.FRAME_CLASSES.items()}
    assert rules == {
        "SYNC": (0, 4), "EVAL": (4, 0), "REWIND": (4, 0), "INVALIDATE": (0, 0), "STOP": (0, 0),
        "HASH": (8, 0), "LOGITS": (4, 4), "VERIFY": (4, 4), "VERIFY_COMMIT": (8, 0),
        "SESSION_CREATE": (4, 0), "SESSION_DESTROY": (0, 0), "EVAL_BATCH": (0, 16),
        "MIXED_BATCH": (8, 4), "COMMAND_ACK": (4, 0), "SYNC_CHECKPOINT": (13, 0),
        "WORLD": (0, 28), "ROW_TOPS": (4, 8), "ROW_DRAW": (4, 40), "ROW_PICKS": (4, 8),
        "ROW_MASS": (4, 16), "MIXED_PREFILLS": (8, 4),
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
            "EVAL: header flags 0x1 / reserved 2 must be 0, 0x1 (ROW_TOPS), 0x3 "
            "(ROW_TOPS | ROW_DRAWS) or 0x7 (ROW_TOPS | ROW_DRAWS | ROW_MASS) / 0 in protocol "
            "version 2",
        ),
        (
            header(FrameType.EVAL, 4, flags=2),
            "EVAL: header flags 0x2: ROW_DRAWS (0x2) needs ROW_TOPS (0x1); the flags must be 0, "
            "0x1, 0x3 or 0x7",
        ),
        (
            header(FrameType.EVAL, 4, flags=5),
            "EVAL: header flags 0x5: ROW_MASS (0x4) needs ROW_DRAWS (0x2); the flags must be 0, "
            "0x1, 0x3 or 0x7",
        ),
        (
            header(FrameType.STOP, 0, flags=3),
            "STOP: header flags 0x3 / reserved 0 must be 0 in protocol version 2",
        ),
        (
            header(FrameType.ROW_DRAW, 44) + bytes.fromhex("02000000") + bytes(40),
            "ROW_DRAW says 2 rows but its payload is 44 bytes (expected 84)",
        ),
        (
            header(FrameType.ROW_DRAW, 44)
            + struct.pack("<I", 1)
            + tp.DRAW_ROW.pack(0, 0, 0.0, 0.0, 0.0, 0.0, 0, 5),
            "ROW_DRAW row 0: nonzero reserved word",
        ),
        (
            header(FrameType.ROW_DRAW, 44)
            + struct.pack("<I", 1)
            + tp.DRAW_ROW.pack(1, 0, 0.0, 1.0, 0.0, 1.0, 0, 0),
            "ROW_DRAW: DrawRow.u must be in [0, 1), got 1.0",
        ),
        (
            header(FrameType.ROW_PICKS, 28) + bytes.fromhex("02000000") + bytes(24),
            "ROW_PICKS says 2 rows, which is 52 bytes before their candidates, but its payload "
            "is 28 bytes",
        ),
        (
            header(FrameType.ROW_PICKS, 36)
            + struct.pack("<I", 1)
            + tp.PICK_ROW.pack(tp.PICK_TOP_K, 0, 0.0, 2, 0)
            + tp.PICK_CANDIDATE.pack(0.5, 1),
            "ROW_PICKS says 1 rows and 2 candidates, which is 44 bytes, but its payload is 36 "
            "bytes",
        ),
        (
            header(FrameType.ROW_PICKS, 28)
            + struct.pack("<I", 1)
            + tp.PICK_ROW.pack(tp.PICK_TOKEN, 0, 0.0, 0, 9),
            "ROW_PICKS row 0: nonzero reserved word",
        ),
        (
            header(FrameType.ROW_PICKS, 28)
            + struct.pack("<I", 1)
            + tp.PICK_ROW.pack(7, 0, 0.0, 0, 0),
            "ROW_PICKS: PickRow.kind must be an integer in [0, 4], got 7",
        ),
        (
            header(FrameType.ROW_PICKS, 36)
            + struct.pack("<I", 1)
            + tp.PICK_ROW.pack(tp.PICK_LEADER_LAST, 0, 0.0, 1, 0)
            + tp.PICK_CANDIDATE.pack(0.5, 1),
            "ROW_PICKS: PickRow of kind 3 (PICK_LEADER_LAST) has 1 candidates: only a "
            "PICK_TOP_K (4) row has them",
        ),
        (
            header(FrameType.STOP, 0, flags=1),
            "STOP: header flags 0x1 / reserved 0 must be 0 in protocol version 2",
        ),
        (
            header(FrameType.ROW_TOPS, 12) + bytes.fromhex("02000000 0000803f 07000000"),
            "ROW_TOPS says 2 rows but its payload is 12 bytes (expected 20)",
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
