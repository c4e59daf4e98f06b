"""Helpers of the FRAGMENT tests: frames cut from the bytes sent, messages to fragment."""

from __future__ import annotations

import numpy as np

from foundry.wire import fdtc
from foundry.wire.fdtc import Compression, Fragment, Gradients, MsgType, encode


def frames_of(pieces: list[bytes | memoryview]) -> list[tuple[int, bytes]]:
    """(type, payload) of each frame in the pieces ``encode_parts`` returned."""
    data = b"".join(bytes(p) for p in pieces)
    out, pos = [], 0
    while pos < len(data):
        _, code, length = fdtc.HEADER.unpack_from(data, pos)
        out.append((code, data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    assert pos == len(data)
    return out


def gradients(data: bytes, n_tensors: int = 1) -> Gradients:
    return Gradients("w1", 3, n_tensors, Compression.NONE, len(data), data)


def frag(kind: MsgType, total: int, offset: int, data: bytes) -> bytes:
    return encode(Fragment(kind, total_length=total, offset=offset, data=data))


W, G, U = MsgType.WEIGHTS, MsgType.GRADIENTS, MsgType.UPDATE

BIG = np.arange(3000, dtype="<f4")  # 12000 bytes: three fragments of 4096


def split_frames(pieces: list[bytes | memoryview]) -> list[bytes]:
    data = b"".join(bytes(p) for p in pieces)
    out, pos = [], 0
    while pos < len(data):
        length = fdtc.HEADER.unpack_from(data, pos)[2]
        out.append(data[pos : pos + 9 + length])
        pos += 9 + length
    return out
