"""The identity, hellos and frame helpers the tensor-parallel wire tests share."""

from __future__ import annotations

import dataclasses
from typing import Any

from foundry.wire import tp
from foundry.wire.tp import Hello, Identity, Role, TpDecoder

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


IDENTITY_FIELDS = [f.name for f in dataclasses.fields(Identity)]

_U16, _U32, _U64 = 0xFFFF, 0xFFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF


def identity_with(**changes: Any) -> Identity:
    return Identity(**{**dataclasses.asdict(IDENTITY), **changes})
