"""The tensor-parallel wire's data plane: the gate header and the shared-memory slab layout."""

from __future__ import annotations

import pytest

from foundry.wire import tp
from foundry.wire.tp import Gate, GateHeader, SlabLayout, TpProtocolError


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
