"""Packed little-endian C structs, declared as data: the field kinds and ``Layout``.

Theory of operation
-------------------
A wire struct is a list of (field name, kind). ``Layout`` turns that list into one
precompiled ``struct.Struct('<...')`` (little-endian, standard sizes, no padding: what
``__attribute__((packed))`` lays out) and walks it three ways: ``normalise`` validates and
stores every field of a frozen dataclass as it is built (``check``: LocalProtocolError, the
caller's mistake), ``pack`` turns the fields into bytes (``to_wire``), ``unpack`` bytes into
Python values (``from_wire``: the codec's RemoteProtocolError, the peer's mistake). A message
class holds one Layout for its fixed part and adds its variable part (text, lists, tensor
data) by hand, next to it.

The FDTC codec (``foundry.wire.fdtc``), the TP control frames (``foundry.wire.tp``) and the
frontend codec (``foundry.wire.frontend``) declare their messages this way; each subclasses
``Layout`` to name its protocol error. (The TP hello, identity and gate header are still
``struct.Struct`` objects of their own in ``wire.tp``.)
"""

from __future__ import annotations

import math
import operator
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterable
from enum import IntEnum
from typing import Any, ClassVar

import numpy as np

from foundry.wire.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "BOOL",
    "F32",
    "I32",
    "U8",
    "U16",
    "U32",
    "U64",
    "Bool",
    "Bytes",
    "Enum",
    "Float32",
    "Int",
    "Kind",
    "Layout",
    "Str",
    "UInt",
]

_U8_MAX = 0xFF
_U16_MAX = 0xFFFF
_U32_MAX = 0xFFFF_FFFF
_U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
_F32 = struct.Struct("<f")


class Kind(ABC):
    def __init__(self, fmt: str) -> None:
        self.fmt = fmt  # struct format of the field, e.g. "I" or "64s"

    @abstractmethod
    def check(self, name: str, value: Any) -> Any: ...

    def to_wire(self, value: Any) -> Any:
        return value

    def from_wire(self, name: str, raw: Any, error: type[RemoteProtocolError]) -> Any:
        """The Python value of a raw struct value; ``error`` (the codec's) for a bad one."""
        return raw


class UInt(Kind):
    def __init__(self, fmt: str, maximum: int) -> None:
        super().__init__(fmt)
        self.maximum = maximum

    def check(self, name: str, value: Any) -> int:
        try:
            number = operator.index(value)  # int, numpy integer, IntEnum; not float or str
        except TypeError:
            raise LocalProtocolError(f"{name} must be an integer, got {value!r}") from None
        if not 0 <= number <= self.maximum:
            raise LocalProtocolError(f"{name} {number} is outside 0..{self.maximum}")
        return int(number)


class Int(Kind):
    """A signed integer of ``bits + 1`` bits (two's complement on the wire)."""

    def __init__(self, fmt: str, bits: int) -> None:
        super().__init__(fmt)
        self.lo, self.hi = -(1 << bits), (1 << bits) - 1

    def check(self, name: str, value: Any) -> int:
        try:
            number = operator.index(value)
        except TypeError:
            raise LocalProtocolError(f"{name} must be an integer, got {value!r}") from None
        if not self.lo <= number <= self.hi:
            raise LocalProtocolError(f"{name} {number} is outside {self.lo}..{self.hi}")
        return int(number)


class Float32(Kind):
    def __init__(self) -> None:
        super().__init__("f")

    def check(self, name: str, value: Any) -> float:
        if not isinstance(value, int | float | np.floating | np.integer):
            raise LocalProtocolError(f"{name} must be a number, got {value!r}")
        try:
            packed = _F32.pack(float(value))
        except OverflowError:
            raise LocalProtocolError(f"{name} {value!r} does not fit a 32-bit float") from None
        exact: float = _F32.unpack(packed)[0]
        if not math.isfinite(exact):
            return exact
        # The shortest decimal that names this f32 (0.1, not 0.10000000149011612): the same
        # wire bits, and a value that compares equal to what the caller most likely wrote.
        short = float(str(np.float32(exact)))
        return short if _F32.pack(short) == packed else exact


class Bool(Kind):
    def __init__(self) -> None:
        super().__init__("B")

    def check(self, name: str, value: Any) -> bool:
        if isinstance(value, bool | np.bool_) or value in (0, 1):
            return bool(value)
        raise LocalProtocolError(f"{name} must be a bool (0 or 1), got {value!r}")


class Enum(Kind):
    def __init__(self, fmt: str, enum: type[IntEnum]) -> None:
        super().__init__(fmt)
        self.enum = enum

    def check(self, name: str, value: Any) -> IntEnum:
        try:
            return self.enum(value)
        except ValueError:
            known = ", ".join(f"{m.value} {m.name}" for m in self.enum)
            raise LocalProtocolError(
                f"{name} {value!r} is not a {self.enum.__name__} ({known})"
            ) from None


class Str(Kind):
    """char[size]: at most size-1 bytes of UTF-8, NUL-terminated and NUL-padded."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size}s")
        self.size = size

    def check(self, name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise LocalProtocolError(f"{name} must be a str, got {value!r}")
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise LocalProtocolError(f"{name} is not encodable as UTF-8: {exc}") from None
        if b"\0" in raw:
            raise LocalProtocolError(f"{name} contains a NUL character, which ends a C string")
        if len(raw) >= self.size:
            raise LocalProtocolError(
                f"{name} is {len(raw)} bytes of UTF-8; char[{self.size}] holds at most "
                f"{self.size - 1} plus the terminating NUL"
            )
        return value

    def to_wire(self, value: Any) -> bytes:
        return str(value).encode("utf-8")  # struct pads with NULs to the field size

    def from_wire(self, name: str, raw: Any, error: type[RemoteProtocolError]) -> str:
        end = bytes(raw).find(b"\0")
        if end < 0:
            raise error(f"{name} (char[{self.size}]) is not NUL-terminated")
        try:
            return bytes(raw[:end]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{name} is not valid UTF-8: {exc}") from None


class Bytes(Kind):
    def __init__(self, size: int) -> None:
        super().__init__(f"{size}s")
        self.size = size

    def check(self, name: str, value: Any) -> bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise LocalProtocolError(f"{name} must be bytes, got {value!r}")
        raw = bytes(value)
        if len(raw) != self.size:
            raise LocalProtocolError(f"{name} must be exactly {self.size} bytes, got {value!r}")
        return raw


U8 = UInt("B", _U8_MAX)
U16 = UInt("H", _U16_MAX)
I32 = Int("i", 31)
U32 = UInt("I", _U32_MAX)
U64 = UInt("Q", _U64_MAX)
F32 = Float32()
BOOL = Bool()


class Layout:
    """One packed C struct: its fields in order and the precompiled little-endian Struct.

    A codec subclasses it to name its protocol error (``error``), raised by ``unpack`` for a
    field value the peer got wrong."""

    error: ClassVar[type[RemoteProtocolError]] = RemoteProtocolError

    def __init__(self, *spec: tuple[str, Kind]) -> None:
        self.names = tuple(name for name, _ in spec)
        self.kinds = tuple(kind for _, kind in spec)
        # '<': little-endian, standard sizes, no alignment padding, as __attribute__((packed)).
        self.struct = struct.Struct("<" + "".join(kind.fmt for kind in self.kinds))
        # Kinds whose values struct takes and gives as they are (numbers, bools, enums): a
        # layout of only those packs and unpacks without a call per field (frames of the
        # decode loop pass here several times per token).
        self._plain_out = all(type(k).to_wire is Kind.to_wire for k in self.kinds)
        self._plain_in = all(type(k).from_wire is Kind.from_wire for k in self.kinds)
        self._values = operator.attrgetter(*self.names) if len(self.names) > 1 else None
        self._fields = tuple(zip(self.names, self.kinds, strict=True))

    @property
    def size(self) -> int:
        return self.struct.size

    def normalise(self, obj: object, skip: tuple[str, ...] = ()) -> None:
        """Validate every field of the frozen dataclass ``obj`` and store its normal form
        (only where it differs from the value given: an int in range is kept as it is)."""
        for name, kind in self._fields:
            if skip and name in skip:
                continue
            value = getattr(obj, name)
            normal = kind.check(name, value)
            if normal is not value:
                object.__setattr__(obj, name, normal)

    def pack(self, values: Iterable[Any]) -> bytes:
        if self._plain_out:
            return self.struct.pack(*values)
        return self.struct.pack(
            *(kind.to_wire(v) for kind, v in zip(self.kinds, values, strict=True))
        )

    def pack_obj(self, obj: object, **override: Any) -> bytes:
        if self._values is not None and not override:
            return self.pack(self._values(obj))
        return self.pack(override[n] if n in override else getattr(obj, n) for n in self.names)

    def unpack(self, buf: memoryview, offset: int = 0) -> dict[str, Any]:
        raw = self.struct.unpack_from(buf, offset)
        if self._plain_in:
            return dict(zip(self.names, raw, strict=True))
        return {
            name: kind.from_wire(name, value, self.error)
            for name, kind, value in zip(self.names, self.kinds, raw, strict=True)
        }
