"""Error feedback around every lossy codec, and the one compressor a sender uses.

``ErrorFeedback`` keeps, per tensor, what compression dropped and adds it to that tensor's next
input, so nothing is lost for good. ``Compressor`` is what a sender holds: it wraps a lossy
codec in error feedback and passes a lossless one through, so the worker (gradients,
pseudo-gradients) and the coordinator (weight updates) have one path whatever the codec.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from foundry.compression.base import Codec, F32Array, flat_f32
from foundry.wire.errors import LocalProtocolError


class ErrorFeedback:
    """Error feedback (residual memory) around any codec: what compression dropped from a
    tensor is added to that tensor's next gradient, so nothing is lost for good.

    Invariant: sum of decoded transmissions + current residual == sum of inputs.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residual: dict[str, F32Array] = {}

    def compress(self, name: str, grad: npt.ArrayLike) -> bytes | bytearray:
        return self.compress_decoded(name, grad)[0]

    def compress_decoded(
        self, name: str, grad: npt.ArrayLike
    ) -> tuple[bytes | bytearray, F32Array]:
        """The encoded tensor and what the receiver decodes from it."""
        x = flat_f32(grad)
        residual = self._residual.get(name)
        if residual is not None:
            if residual.size != x.size:
                raise LocalProtocolError(
                    f"{name}: gradient has {x.size} elements, its residual {residual.size}; "
                    "call reset() when the model changes"
                )
            x = x + residual
        data, sent = self.codec.encode_decoded(x)
        self._residual[name] = x - sent
        return data, sent

    def residual(self, name: str) -> F32Array | None:
        return self._residual.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget one tensor's residual, or all of them."""
        if name is None:
            self._residual.clear()
        else:
            self._residual.pop(name, None)


class Compressor:
    """Encodes named tensors into a data section with ``codec``, behind error feedback when
    the codec is lossy. ``encode`` returns the section and, per tensor, what the receiver will
    decode (the sender's exact view of what was sent)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.feedback = ErrorFeedback(codec) if codec.lossy else None

    def encode(
        self, tensors: Mapping[str, npt.NDArray[np.float32]]
    ) -> tuple[bytes | memoryview, dict[str, F32Array]]:
        if self.feedback is None:
            flat = {k: flat_f32(t) for k, t in tensors.items()}
            return self.codec.encode_section(flat.values()), flat
        parts: list[bytes | bytearray] = []
        sent: dict[str, F32Array] = {}
        for name, t in tensors.items():
            data, decoded = self.feedback.compress_decoded(name, t)
            parts.append(data)
            sent[name] = decoded
        return b"".join(parts), sent

    def reset(self) -> None:
        if self.feedback is not None:
            self.feedback.reset()
