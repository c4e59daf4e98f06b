"""FDTC's weights: WEIGHTS_REQ, WEIGHTS_META's tensor table (``TensorMeta``), WEIGHTS, and the
messages of named tensors and back (``weights_messages``, ``weights_tensors``)."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc.enums import _U64_MAX, MAX_DIMS, MAX_NAME, DType, ErrorCode, MsgType
from foundry.wire.fdtc.messages import Message, _as_buffer, _Layout
from foundry.wire.layout import F32, U32, U64
from foundry.wire.layout import Enum as _Enum
from foundry.wire.layout import Str as _Str

# --- weights


@dataclass(frozen=True)
class WeightsReq(Message):
    """WEIGHTS_REQ (worker -> coordinator): send me the current weights. Empty payload."""

    TYPE: ClassVar[MsgType] = MsgType.WEIGHTS_REQ


_TENSOR_META = struct.Struct(f"<{MAX_NAME}sI{MAX_DIMS}QQB")  # sw_tensor_meta, 141 bytes
_NAME = _Str(MAX_NAME)
_DTYPE = _Enum("B", DType)


@dataclass(frozen=True)
class TensorMeta:
    """sw_tensor_meta (141 bytes): name, ndim, shape[8] (unused dims 0), numel, dtype.

    ``numel`` is derived from the shape here; a peer's numel must equal the product of its
    first ``ndim`` dimensions.
    """

    STRUCT: ClassVar[struct.Struct] = _TENSOR_META
    name: str
    shape: tuple[int, ...]
    dtype: DType = DType.F32

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", _NAME.check("name", self.name))
        if not isinstance(self.shape, tuple | list):
            raise LocalProtocolError(f"shape of {self.name!r} must be a tuple, got {self.shape!r}")
        if len(self.shape) > MAX_DIMS:
            raise LocalProtocolError(
                f"{self.name!r} has {len(self.shape)} dimensions; sw_tensor_meta holds {MAX_DIMS}"
            )
        shape = tuple(U64.check(f"shape of {self.name!r}", d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        if math.prod(shape) > _U64_MAX:
            raise LocalProtocolError(f"{self.name!r} has more than 2**64-1 elements")
        object.__setattr__(self, "dtype", _DTYPE.check("dtype", self.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def pack(self) -> bytes:
        dims = self.shape + (0,) * (MAX_DIMS - len(self.shape))
        return _TENSOR_META.pack(
            _NAME.to_wire(self.name), len(self.shape), *dims, self.numel, int(self.dtype)
        )

    @classmethod
    def unpack(cls, buf: memoryview, offset: int) -> TensorMeta:
        raw_name, ndim, *rest = _TENSOR_META.unpack_from(buf, offset)
        dims, numel, dtype = rest[:MAX_DIMS], rest[MAX_DIMS], rest[MAX_DIMS + 1]
        name = _NAME.from_wire("tensor name", raw_name, FdtcProtocolError)
        if ndim > MAX_DIMS:
            raise FdtcProtocolError(f"tensor {name!r} has ndim {ndim}; at most {MAX_DIMS}")
        shape = tuple(dims[:ndim])
        if math.prod(shape) != numel:
            raise FdtcProtocolError(
                f"tensor {name!r}: numel {numel} is not the product of shape {shape}"
            )
        return cls(name=name, shape=shape, dtype=dtype)


@dataclass(frozen=True)
class WeightsMeta(Message):
    """WEIGHTS_META (coordinator -> worker): 12-byte sw_weights_meta_payload + 141 per tensor.

    Always followed by WEIGHTS, whose payload holds every tensor's data in this order.
    """

    TYPE: ClassVar[MsgType] = MsgType.WEIGHTS_META
    HEAD: ClassVar[_Layout] = _Layout(
        ("num_tensors", U32), ("global_step", U32), ("learning_rate", F32)
    )
    global_step: int
    learning_rate: float
    tensors: tuple[TensorMeta, ...] = ()

    def __post_init__(self) -> None:
        self.HEAD.normalise(self, skip=("num_tensors",))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        for t in self.tensors:
            if not isinstance(t, TensorMeta):
                raise LocalProtocolError(f"tensors must hold TensorMeta, got {t!r}")

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @property
    def nbytes(self) -> int:
        """Size of the WEIGHTS payload that must follow."""
        return sum(t.nbytes for t in self.tensors)

    def payload_parts(self) -> tuple[bytes | memoryview, ...]:
        head = self.HEAD.pack_obj(self, num_tensors=self.num_tensors)
        return (head, *(t.pack() for t in self.tensors))

    @classmethod
    def check_length(cls, length: int) -> None:
        if length < cls.HEAD.size or (length - cls.HEAD.size) % _TENSOR_META.size:
            raise FdtcProtocolError(
                f"WEIGHTS_META payload must be {cls.HEAD.size} + {_TENSOR_META.size} * "
                f"num_tensors bytes, header says {length}"
            )

    @classmethod
    def from_payload(cls, payload: memoryview) -> Self:
        head = cls.HEAD.unpack(payload)
        count = (len(payload) - cls.HEAD.size) // _TENSOR_META.size
        if head["num_tensors"] != count:
            raise FdtcProtocolError(
                f"WEIGHTS_META says num_tensors {head['num_tensors']} but carries {count}"
            )
        tensors = tuple(
            TensorMeta.unpack(payload, cls.HEAD.size + i * _TENSOR_META.size) for i in range(count)
        )
        return cls(
            global_step=head["global_step"],
            learning_rate=head["learning_rate"],
            tensors=tensors,
        )


@dataclass(frozen=True)
class Weights(Message):
    """WEIGHTS (coordinator -> worker): every tensor of the preceding WEIGHTS_META, in order,
    each in its tm_dtype (F32: little-endian f32, 4 bytes per element), no separators.

    ``data`` is bytes or a read-only memoryview (the decoder hands out a view of the buffer
    it received into, without copying); ``weights_tensors`` splits it into arrays.
    """

    TYPE: ClassVar[MsgType] = MsgType.WEIGHTS
    data: bytes | memoryview = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", _as_buffer("data", self.data))

    def payload_parts(self) -> tuple[bytes | memoryview, ...]:
        return (self.data,)

    @classmethod
    def check_length(cls, length: int) -> None:
        return  # any size up to the limit; its match with WEIGHTS_META is the reader's check

    @classmethod
    def from_payload(cls, payload: memoryview) -> Self:
        return cls(payload)


# ---------------------------------------------------------------------------- weights


def weights_messages(
    tensors: Mapping[str, npt.ArrayLike], global_step: int, learning_rate: float
) -> tuple[WeightsMeta, Weights]:
    """WEIGHTS_META + WEIGHTS for named tensors, sent as f32 in the mapping's order."""
    arrays = {name: np.ascontiguousarray(t, dtype="<f4") for name, t in tensors.items()}
    meta = WeightsMeta(
        global_step=global_step,
        learning_rate=learning_rate,
        tensors=tuple(TensorMeta(name, a.shape, DType.F32) for name, a in arrays.items()),
    )
    return meta, Weights(b"".join(a.tobytes() for a in arrays.values()))


def weights_tensors(meta: WeightsMeta, weights: Weights) -> dict[str, npt.NDArray[Any]]:
    """Split WEIGHTS by its WEIGHTS_META into read-only arrays (views, no copy) of the
    announced shapes and dtypes. A size mismatch is the peer's error."""
    if len(weights.data) != meta.nbytes:
        raise FdtcProtocolError(
            f"WEIGHTS holds {len(weights.data)} bytes, WEIGHTS_META announced {meta.nbytes}",
            ErrorCode.MODEL_MISMATCH,
        )
    out: dict[str, npt.NDArray[Any]] = {}
    offset = 0
    for t in meta.tensors:
        array = np.frombuffer(weights.data, dtype=t.dtype.numpy, count=t.numel, offset=offset)
        out[t.name] = array.reshape(t.shape)
        offset += t.nbytes
    return out
