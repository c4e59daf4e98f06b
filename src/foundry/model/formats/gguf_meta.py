"""The project's one reader of the GGUF layout: a file's key/value metadata and tensor infos,
read straight from its memory-mapped header with :mod:`struct`.

The ``gguf`` package's reader maps every string of a 262,144-token vocabulary into numpy
views, which takes tens of seconds on a small machine; this reads the same keys in well under
a second. :func:`read_metadata` stops before the tensor table; :func:`read_layout` reads the
table too (gguf_io builds its tensor views on it). Values come back as plain Python: ints,
floats (float32 values as the shortest decimal that is that float32), bools, strings (UTF-8;
invalid bytes replaced, or an error with ``strict``) and lists of those. Every count and length
is checked against the bytes left before it sizes anything; arrays nest at most
``MAX_NESTING`` deep and hold ``MAX_ARRAY_ELEMENTS`` elements in all, and a key or tensor name
given twice is refused.

A value is checked where it is read, by the ``expect_*`` functions: its type (an integer is no
float, a bool no integer), its range, a float finite (inf is refused wherever NaN is), each
element of a list; the error (the reader's own class) names the key in one line.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 key
count, then per key: u64 length + UTF-8 name, u32 value type, value. A string is u64 length +
bytes; an array is u32 element type, u64 count, elements. Then per tensor: name (a string),
u32 dimension count, u64 per dimension (ggml's ne, innermost first), u32 ggml type, u64 offset
of its data from the start of the data section, which begins at the first multiple of
``general.alignment`` (default 32) after the table.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
# A key count or array length beyond this is a corrupt header, not a file to read.
MAX_ITEMS = 1 << 28
# Array elements of all the keys together: each becomes a Python object (8 bytes of a list and
# more), so a header of many tiny elements is bounded in memory, not only by the file's size.
# The largest vocabularies hold a few million (262,144 tokens, scores and types; merges).
MAX_ARRAY_ELEMENTS = 1 << 24
# GGUFValueType -> numpy dtype of its scalar (STRING 8, ARRAY 9 handled apart; BOOL 7).
_SCALARS: dict[int, np.dtype[Any]] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("<u1"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_BOOL, _STRING, _ARRAY, _F32 = 7, 8, 9, 6
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")
_TYPE_OFFSET = struct.Struct("<IQ")
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
# Arrays of arrays: GGUF files in the wild nest two deep at most; a deeper header is an attack
# on the reader's recursion.
MAX_NESTING = 8


class GGUFMetaError(ValueError):
    """The file is not a GGUF file we can read; the message names what is wrong."""


class _Reader:
    """Reads values from the mapped file at a moving offset; every read is bounds-checked."""

    def __init__(self, buf: mmap.mmap, path: Path, strict: bool = False) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.errors = "strict" if strict else "replace"
        self.elements = 0  # array elements read so far (MAX_ARRAY_ELEMENTS)

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFMetaError(f"{self.path}: the header ends early")
        data = self.buf[self.pos : end]
        self.pos = end
        return data

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def count(self, each: int = 1) -> int:
        """A u64 count of items of at least ``each`` bytes, checked against the bytes left."""
        n = int(_U64.unpack(self.take(8))[0])
        self.room(n, each)
        return n

    def room(self, n: int, each: int) -> None:
        if n > MAX_ITEMS or n * each > len(self.buf) - self.pos:
            raise GGUFMetaError(f"{self.path}: a count of {n} in the header")

    def string(self) -> str:
        return self.decode(self.take(self.count()))

    def decode(self, data: bytes) -> str:
        try:
            return data.decode("utf-8", errors=self.errors)
        except UnicodeDecodeError as exc:
            raise GGUFMetaError(f"{self.path}: a string that is not UTF-8 ({exc})") from None

    def strings(self, n: int) -> list[str]:
        """``n`` strings in a row (a vocabulary: the loop is kept tight)."""
        buf, pos, size, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        errors = self.errors
        out = []
        for _ in range(n):
            if pos + 8 > size:
                raise GGUFMetaError(f"{self.path}: the header ends early")
            length = unpack(buf, pos)[0]
            pos += 8
            if pos + length > size:
                raise GGUFMetaError(f"{self.path}: the header ends early")
            try:
                out.append(buf[pos : pos + length].decode("utf-8", errors=errors))
            except UnicodeDecodeError as exc:
                raise GGUFMetaError(f"{self.path}: a string that is not UTF-8 ({exc})") from None
            pos += length
        self.pos = pos
        return out

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= MAX_NESTING:
                raise GGUFMetaError(
                    f"{self.path}: arrays nested more than {MAX_NESTING} deep in the header"
                )
            etype = self.u32()
            n = self.count(
                8 if etype == _STRING else 12 if etype == _ARRAY else self._dtype(etype).itemsize
            )
            self.elements += n
            if self.elements > MAX_ARRAY_ELEMENTS:
                raise GGUFMetaError(
                    f"{self.path}: the header's arrays hold more than {MAX_ARRAY_ELEMENTS} elements"
                )
            if etype == _STRING:
                return self.strings(n)
            if etype == _ARRAY:
                return [self.value(_ARRAY, depth + 1) for _ in range(n)]
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


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table, as stored."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]  # ggml's ne: innermost first (numpy's shape reversed)
    offset: int  # of the tensor's data in the file (the table's offset + the data section's)


@dataclass(frozen=True)
class Layout:
    """A GGUF file's key/value metadata and tensor table."""

    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_start: int  # where the data section begins in the file
    kv_end: int = 0  # where the key/value pairs end (the tensor table begins)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value pair of the GGUF file at ``path`` (not its tensors)."""
    path = Path(path)
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size < _HEADER.size:
            raise GGUFMetaError(f"{path}: the header ends early")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Reader(buf, path)
            _n_tensors, n_kv = _header(r)
            return _keys(r, n_kv)


def read_layout(buf: mmap.mmap, path: Path, strict: bool = True) -> Layout:
    """The metadata and tensor table of the GGUF file mapped as ``buf`` (``path`` names it in
    errors); strings must be UTF-8 unless ``strict`` is false."""
    if len(buf) < _HEADER.size:
        raise GGUFMetaError(f"{path}: the header ends early")
    r = _Reader(buf, path, strict)
    n_tensors, n_kv = _header(r)
    meta = _keys(r, n_kv)
    kv_end = r.pos
    r.room(n_tensors, 24)  # name length, dimension count, type, offset
    table = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = r.string()
        if name in names:
            raise GGUFMetaError(f"{path}: tensor {name!r} is listed twice in the tensor table")
        names.add(name)
        n_dims = r.u32()
        if n_dims > MAX_DIMS:
            raise GGUFMetaError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        dims = struct.unpack(f"<{n_dims}Q", r.take(8 * n_dims))
        ggml_type, offset = _TYPE_OFFSET.unpack(r.take(_TYPE_OFFSET.size))
        table.append((name, int(ggml_type), tuple(int(d) for d in dims), int(offset)))
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFMetaError(f"{path}: general.alignment {align!r} is not a power of two")
    start = -(-r.pos // align) * align
    tensors = [TensorInfo(name, t, dims, start + offset) for name, t, dims, offset in table]
    return Layout(meta, tensors, start, kv_end)


def _header(r: _Reader) -> tuple[int, int]:
    """Checks magic and version; the tensor and key counts."""
    magic, version, n_tensors, n_kv = _HEADER.unpack(r.take(_HEADER.size))
    if magic != MAGIC:
        raise GGUFMetaError(f"{r.path}: not a GGUF file (magic {magic!r})")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFMetaError(f"{r.path}: GGUF version {version} (readable: 2, 3)")
    r.room(n_kv, 12)  # key length, value type
    return int(n_tensors), int(n_kv)


def _keys(r: _Reader, n_kv: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        if key in out:
            raise GGUFMetaError(f"{r.path}: metadata key {key!r} is given twice")
        out[key] = r.value(r.u32())
    return out


# ---------------------------------------------------------------------------- typed reading


def shown(value: Any) -> str:
    """A metadata value as an error message names it: short, with its kind."""
    kind = (
        "a bool"
        if isinstance(value, bool)
        else "an integer"
        if isinstance(value, int)
        else "a float"
        if isinstance(value, float)
        else "a string"
        if isinstance(value, str)
        else f"an array of {len(value)}"
        if isinstance(value, list)
        else type(value).__name__
    )
    text = repr(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({kind})"


def expect_int(
    key: str, value: Any, lo: int, hi: int, error: type[ValueError] = GGUFMetaError
) -> int:
    """``value`` of metadata key ``key`` as an integer in [lo, hi] (a bool or float is not one)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"metadata key {key!r} is {shown(value)}, expected an integer")
    if not lo <= value <= hi:
        raise error(f"metadata key {key!r} is {value}, outside [{lo}, {hi}]")
    return value


def expect_number(
    key: str, value: Any, lo: float, hi: float, error: type[ValueError] = GGUFMetaError
) -> float:
    """``value`` as a finite number in [lo, hi] (NaN and inf refused alike)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise error(f"metadata key {key!r} is {shown(value)}, expected a number")
    if not math.isfinite(value):
        raise error(f"metadata key {key!r} is {value}, expected a finite number")
    if not lo <= value <= hi:
        raise error(f"metadata key {key!r} is {value}, outside [{lo:g}, {hi:g}]")
    return float(value)


def expect_bool(key: str, value: Any, error: type[ValueError] = GGUFMetaError) -> bool:
    if not isinstance(value, bool):
        raise error(f"metadata key {key!r} is {shown(value)}, expected a bool")
    return value


def expect_str(key: str, value: Any, error: type[ValueError] = GGUFMetaError) -> str:
    if not isinstance(value, str):
        raise error(f"metadata key {key!r} is {shown(value)}, expected a string")
    return value


_ELEMENTS: dict[type, str] = {str: "strings", int: "integers", float: "numbers"}


def expect_list(
    key: str, value: Any, element: type, error: type[ValueError] = GGUFMetaError
) -> list[Any]:
    """``value`` as an array whose every element is ``element`` (``float``: any finite
    number; ``int``: an integer, no bool)."""
    if not isinstance(value, list):
        raise error(
            f"metadata key {key!r} is {shown(value)}, expected an array of {_ELEMENTS[element]}"
        )
    if element is float:
        ok = all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        ok = ok and all(map(math.isfinite, value))
    elif element is int:
        ok = all(type(v) is int for v in value)
    else:
        ok = all(isinstance(v, element) for v in value)
    if not ok:
        bad = next(
            (
                i
                for i, v in enumerate(value)
                if not (
                    type(v) is int
                    if element is int
                    else isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                    if element is float
                    else isinstance(v, element)
                )
            ),
            0,
        )
        raise error(
            f"metadata key {key!r}: element {bad} is {shown(value[bad])}, expected "
            f"an array of {_ELEMENTS[element]}"
        )
    return value
