"""NONE: ``numel`` little-endian f32, 4 bytes per element (the seed's raw layout)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from foundry.compression.base import Buffer, Codec, CodecParams, F32Array, flat_f32, need
from foundry.wire.fdtc import Compression


@dataclass(frozen=True)
class NoneParams(CodecParams):
    """NONE has no parameters."""


class NoneCodec(Codec):
    compression = Compression.NONE
    lossy = False
    Params = NoneParams

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: npt.ArrayLike) -> bytes:
        return flat_f32(x).astype("<f4", copy=False).tobytes()

    def decode(self, buf: Buffer, numel: int) -> tuple[F32Array, int]:
        need(buf, 4 * numel, f"NONE tensor of {numel} elements")
        return np.frombuffer(buf, dtype="<f4", count=numel), 4 * numel

    def encode_section(self, arrays: Iterable[npt.ArrayLike]) -> memoryview:
        # The values back to back: one copy into the section, no bytes object per tensor.
        flat = [flat_f32(a) for a in arrays]
        section = np.concatenate(flat) if flat else np.empty(0, np.float32)
        return section.astype("<f4", copy=False).data.cast("B")
