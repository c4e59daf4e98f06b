"""A GGUF file's key/value metadata, read straight from its header with :mod:`struct`.

The ``gguf`` package's reader maps every string of a 262,144-token vocabulary into numpy
views, which takes tens of seconds on a small machine; this reads the same keys in well under
a second and stops before the tensor table. Values come back as plain Python: ints, floats
(float32 values as the shortest decimal that is that float32, as gguf_io reads them), bools,
strings (UTF-8, invalid bytes replaced) and lists of those.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 key
count, then per key: u64 length + UTF-8 name, u32 value type, value. A string is u64 length +
bytes; an array is u32 element type, u64 count, elements.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
# A key count or array length beyond this is a corrupt header, not a file to read.
MAX_ITEMS = 1 << 28
# GGUFValueType -> numpy dtype of its scalar (STRING 8, ARRAY 9 handled apart; BOOL 7).
_SCALARS: dict[int, np.dtype[Any]] = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("<u1"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}
_BOOL, _STRING, _ARRAY, _F32 = 7, 8, 9, 6
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")


class GGUFMetaError(ValueError):
    """The file is not a GGUF file we can read; the message names what is wrong."""


class _Reader:
    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f = f
        self.path = path

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFMetaError(f"{self.path}: the header ends early")
        return data

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def count(self) -> int:
        n = int(_U64.unpack(self.take(8))[0])
        if n > MAX_ITEMS:
            raise GGUFMetaError(f"{self.path}: a count of {n} in the header")
        return n

    def string(self) -> str:
        return self.take(self.count()).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.u32()
            n = self.count()
            if etype == _STRING:
                return [self.string() for _ in range(n)]
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            dtype = self._dtype(etype)
            arr = np.frombuffer(self.take(n * dtype.itemsize), dtype=dtype)
            if etype == _BOOL:
                return [bool(v) for v in arr]
            return arr.tolist()
        dtype = self._dtype(vtype)
        scalar = np.frombuffer(self.take(dtype.itemsize), dtype=dtype)[0]
        if vtype == _BOOL:
            return bool(scalar)
        if vtype == _F32:
            return float(str(scalar))
        return scalar.item()

    def _dtype(self, vtype: int) -> np.dtype[Any]:
        if vtype not in _SCALARS:
            raise GGUFMetaError(f"{self.path}: unknown value type {vtype} in the header")
        return _SCALARS[vtype]


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value pair of the GGUF file at ``path`` (not its tensors)."""
    path = Path(path)
    with path.open("rb") as f:
        r = _Reader(f, path)
        magic, version, _n_tensors, n_kv = _HEADER.unpack(r.take(_HEADER.size))
        if magic != MAGIC:
            raise GGUFMetaError(f"{path}: not a GGUF file (magic {magic!r})")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFMetaError(f"{path}: GGUF version {version} (readable: 2, 3)")
        if n_kv > MAX_ITEMS:
            raise GGUFMetaError(f"{path}: a count of {n_kv} in the header")
        out: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            out[key] = r.value(r.u32())
        return out
