"""A GGUF file's key/value metadata, read straight from its header with :mod:`struct`.

The ``gguf`` package's reader maps every string of a 262,144-token vocabulary into numpy
views, which takes tens of seconds on a small machine; this reads the same keys from the
memory-mapped file in about a second and stops before the tensor table. Values come back as
plain Python: ints, floats (float32 values as the shortest decimal that is that float32, as
gguf_io reads them), bools, strings (UTF-8, invalid bytes replaced) and lists of those.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 key
count, then per key: u64 length + UTF-8 name, u32 value type, value. A string is u64 length +
bytes; an array is u32 element type, u64 count, elements.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

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
    """Reads values from the mapped file at a moving offset; every read is bounds-checked."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFMetaError(f"{self.path}: the header ends early")
        data = self.buf[self.pos : end]
        self.pos = end
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

    def strings(self, n: int) -> list[str]:
        """``n`` strings in a row (a vocabulary: the loop is kept tight)."""
        buf, pos, size, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        for _ in range(n):
            if pos + 8 > size:
                raise GGUFMetaError(f"{self.path}: the header ends early")
            length = unpack(buf, pos)[0]
            pos += 8
            if pos + length > size:
                raise GGUFMetaError(f"{self.path}: the header ends early")
            out.append(buf[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.u32()
            n = self.count()
            if etype == _STRING:
                return self.strings(n)
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
        if os.fstat(f.fileno()).st_size < _HEADER.size:
            raise GGUFMetaError(f"{path}: the header ends early")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _read(_Reader(buf, path))


def _read(r: _Reader) -> dict[str, Any]:
    magic, version, _n_tensors, n_kv = _HEADER.unpack(r.take(_HEADER.size))
    if magic != MAGIC:
        raise GGUFMetaError(f"{r.path}: not a GGUF file (magic {magic!r})")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFMetaError(f"{r.path}: GGUF version {version} (readable: 2, 3)")
    if n_kv > MAX_ITEMS:
        raise GGUFMetaError(f"{r.path}: a count of {n_kv} in the header")
    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        out[key] = r.value(r.u32())
    return out
