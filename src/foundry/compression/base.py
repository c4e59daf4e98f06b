"""The codec interface, the registry keyed by the wire enum, and whole data sections.

A codec is sans-IO and works on one flat f32 tensor at a time; ``serialize_tensors`` /
``deserialize_tensors`` do a whole data section (GRADIENTS, UPDATE), tensors back to back in
WEIGHTS_META order, no padding between them. Each codec subclass registers itself for its
``Compression`` value and names its parameters dataclass (``Params``); ``get_codec`` builds one
from keyword arguments, taking the ones its dataclass declares.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from foundry.wire import fdtc
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import Compression

F32Array = npt.NDArray[np.float32]
Buffer = bytes | bytearray | memoryview


def flat_f32(x: npt.ArrayLike) -> F32Array:
    """A C-contiguous 1-D float32 view of x (a copy only if x is not already that)."""
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def need(buf: Buffer, nbytes: int, what: str) -> None:
    if len(buf) < nbytes:
        raise FdtcProtocolError(f"{what} needs {nbytes} bytes, only {len(buf)} left")


@dataclass(frozen=True)
class CodecParams:
    """A codec's parameters; each codec's own dataclass adds its fields (none for lossless)."""


class Codec(ABC):
    """One wire compression: ``encode`` a flat f32 tensor, ``decode`` it back.

    ``encoded_size(numel)`` is exact: it equals ``len(encode(x))`` for every x of that size,
    so a sender can size buffers and the receiver's estimate never lies. ``lossy`` codecs are
    used behind error feedback (``foundry.compression.feedback``).
    """

    compression: ClassVar[Compression]
    lossy: ClassVar[bool] = True
    Params: ClassVar[type[CodecParams]] = CodecParams

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.compression in CODECS:
            raise RuntimeError(f"two codecs for {cls.compression.name}")
        CODECS[cls.compression] = cls

    @classmethod
    def from_params(cls, params: CodecParams) -> Self:
        """Build from this codec's ``Params``."""
        return cls(**dataclasses.asdict(params))

    def random_state(self) -> str | None:
        """The state of the codec's random draws as text (a checkpoint keeps it), or None for
        a codec that draws nothing."""
        return None

    def set_random_state(self, state: str) -> None:
        """Continue the draws from ``random_state``'s text (a resumed run)."""
        raise LocalProtocolError(f"{self.compression.name} draws no random numbers")

    @abstractmethod
    def encoded_size(self, numel: int) -> int: ...

    @abstractmethod
    def encode(self, x: npt.ArrayLike) -> bytes | bytearray:
        """x flattened (C order) to f32, encoded."""

    @abstractmethod
    def decode(self, buf: Buffer, numel: int) -> tuple[F32Array, int]:
        """The f32 tensor at the start of ``buf`` and the bytes it took. ``buf`` may hold
        more (the rest of a data section). The array may be a read-only view of ``buf``."""

    def encode_decoded(self, x: npt.ArrayLike) -> tuple[bytes | bytearray, F32Array]:
        """``encode(x)`` and what a receiver decodes from it (error feedback's residual and
        the coordinator's shadow need both); a codec may compute the second as it encodes."""
        data = self.encode(x)
        return data, self.decode(data, flat_f32(x).size)[0]

    def encode_section(self, arrays: Iterable[npt.ArrayLike]) -> bytes | memoryview:
        """A data section: each array encoded, back to back."""
        return b"".join(self.encode(a) for a in arrays)


CODECS: dict[Compression, type[Codec]] = {}


def check_registry() -> None:
    """Every wire compression value has a codec (called once every codec module is imported)."""
    missing = sorted(c.name for c in Compression if c not in CODECS)
    if missing:
        raise RuntimeError(f"no codec for compression {', '.join(missing)}")


def get_codec(compression: Compression | int, **params: Any) -> Codec:
    """The codec for a wire compression value; ``params`` are keyword arguments, of which each
    codec takes those its ``Params`` dataclass declares (``topk_ratio``; ``qsgd_levels``,
    ``qsgd_bucket``, ``seed``) and ignores the rest."""
    try:
        cls = CODECS[Compression(compression)]
    except ValueError:
        raise LocalProtocolError(f"unknown compression {compression!r}") from None
    names = {f.name for f in dataclasses.fields(cls.Params)}
    return cls.from_params(cls.Params(**{k: v for k, v in params.items() if k in names}))


def largest_section(numels: Iterable[int]) -> int:
    """An upper bound on any codec's data section for tensors of ``numels`` elements, with any
    parameters: what a receiver may size its largest message by. TOPK at ratio 1 takes the
    most, 6 bytes an element plus a 4-byte head and a 4-byte offset per block; NONE takes 4,
    QSGD at most 1 plus a 4-byte norm per bucket and a head."""
    return sum(10 * n + 64 for n in numels)


def largest_message(numels: Iterable[int]) -> int:
    """The largest WEIGHTS, GRADIENTS or UPDATE payload a worker link carries for tensors of
    ``numels`` elements (the larger header and ``largest_section``), at most FDTC's
    ``MAX_MESSAGE``: what either side lets the other's FRAGMENT frames build."""
    header = max(fdtc.Gradients.LAYOUT.size, fdtc.Update.LAYOUT.size)
    return min(fdtc.MAX_MESSAGE, header + largest_section(numels))


def estimate_compressed_size(numel: int, compression: Compression | int, **params: Any) -> int:
    """sw_estimate_compressed_size, exact: bytes ``numel`` elements take on the wire."""
    return get_codec(compression, **params).encoded_size(numel)


def serialize_tensors(
    arrays: Iterable[npt.ArrayLike], compression: Compression | int, **params: Any
) -> bytes | memoryview:
    """sw_serialize_tensor for each tensor, back to back: a GRADIENTS data section."""
    return get_codec(compression, **params).encode_section(arrays)


def deserialize_tensors(
    buf: Buffer, numels: Sequence[int], compression: Compression | int
) -> list[F32Array]:
    """sw_deserialize_tensor for each tensor of a data section; every byte must be used."""
    codec = get_codec(compression)  # the layouts carry their own parameters
    view = memoryview(buf).cast("B")
    out: list[F32Array] = []
    pos = 0
    for i, numel in enumerate(numels):
        try:
            array, used = codec.decode(view[pos:], numel)
        except FdtcProtocolError as exc:
            raise FdtcProtocolError(f"tensor {i} of {len(numels)}: {exc}") from None
        out.append(array)
        pos += used
    if pos != len(view):
        raise FdtcProtocolError(f"{len(view) - pos} bytes left over after {len(numels)} tensors")
    return out
