"""A published GGUF file with some of its tensors replaced: a fine-tuned model written over
its base file's key/value pairs byte for byte."""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np

from foundry.model.formats import gguf_meta
from foundry.model.formats.gguf_io import fsync_dir
from foundry.model.formats.gguf_model import F32Array, GGUFError
from foundry.model.kernels import finite, quant

_QT = gguf.GGMLQuantizationType

WRITABLE: tuple[gguf.GGMLQuantizationType, ...] = (
    _QT.F32,
    _QT.F16,
    _QT.Q8_0,
    _QT.Q4_0,
    _QT.Q4_1,
    _QT.Q5_0,
    _QT.Q5_1,
    _QT.Q4_K,
    _QT.Q6_K,
)
"""The storage types Foundry writes (``quant.quantize``); a tensor stored in another (Q5_K,
Q2_K, Q3_K, the i-quants) is written as :data:`FALLBACK` when it is replaced."""
FALLBACK = _QT.Q8_0


def replacement_type(
    stored: gguf.GGMLQuantizationType,
    shape: tuple[int, ...],
    forced: gguf.GGMLQuantizationType | None = None,
) -> gguf.GGMLQuantizationType:
    """The type a replaced tensor is written in: ``forced``, else the one it had where Foundry
    writes it, else Q8_0; F16 where a row is not whole blocks of the chosen type; vectors F32."""
    if len(shape) == 1:
        return _QT.F32
    qtype = forced or (stored if stored in WRITABLE else FALLBACK)
    if qtype not in (_QT.F32, _QT.F16) and shape[-1] % quant.block_values(qtype):
        return _QT.F16
    return qtype


def rewrite_gguf(
    src: str | Path,
    dst: str | Path,
    replaced: Mapping[str, F32Array],
    forced: gguf.GGMLQuantizationType | None = None,
) -> dict[str, str]:
    """Write ``dst`` as a copy of the GGUF file ``src`` (its key/value pairs byte for byte, its
    tensors in order) with the float32 tensors of ``replaced`` in place of the file's own,
    each stored as :func:`replacement_type` says (atomically: temp file + rename). Returns
    the type each replaced tensor was written in, by name."""
    src, dst = Path(src), Path(dst)
    with src.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        layout = gguf_meta.read_layout(buf, src)
        align = int(layout.metadata.get("general.alignment", gguf_meta.DEFAULT_ALIGNMENT))
        names = {t.name for t in layout.tensors}
        unknown = sorted(set(replaced) - names)
        if unknown:
            raise GGUFError(f"{src} has no tensor {unknown[0]!r}")
        # (tensor, type, new bytes or the (start, end) of its bytes in src)
        pieces: list[tuple[gguf_meta.TensorInfo, int, bytes | tuple[int, int]]] = []
        written: dict[str, str] = {}
        for t in layout.tensors:
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            values, size = gguf.GGML_QUANT_SIZES[qtype]
            n = math.prod(t.dims)
            if t.name in replaced:
                value = np.ascontiguousarray(replaced[t.name], np.float32)
                if value.shape != tuple(reversed(t.dims)):
                    raise GGUFError(
                        f"tensor {t.name!r} is {value.shape} in {src}, "
                        f"{tuple(reversed(t.dims))} given"
                    )
                qtype = replacement_type(qtype, value.shape, forced)
                why = finite.overflow(value, qtype)
                if why is not None:
                    raise GGUFError(f"cannot write tensor {t.name!r} as {qtype.name}: {why}")
                data: bytes | tuple[int, int] = (
                    value.tobytes()
                    if qtype == _QT.F32
                    else quant.quantize(value, qtype).data.tobytes()
                )
                written[t.name] = qtype.name
            else:
                data = (t.offset, t.offset + n // values * size)
            pieces.append((t, int(qtype), data))
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        try:
            with tmp.open("wb") as out:
                out.write(buf[: layout.kv_end])  # magic, version, counts and every key/value
                offset = 0
                for t, qt, data in pieces:
                    raw = t.name.encode("utf-8")
                    out.write(struct.pack("<Q", len(raw)) + raw)
                    out.write(struct.pack(f"<I{len(t.dims)}Q", len(t.dims), *t.dims))
                    out.write(struct.pack("<IQ", qt, offset))
                    offset += -(-_length(data) // align) * align
                out.write(b"\0" * (-out.tell() % align))
                for _, _, data in pieces:
                    out.write(data if isinstance(data, bytes) else buf[data[0] : data[1]])
                    out.write(b"\0" * (-_length(data) % align))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, dst)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise GGUFError(f"could not write {dst}: {exc}") from exc
            raise
    fsync_dir(dst.parent)
    return written


def _length(data: bytes | tuple[int, int]) -> int:
    return len(data) if isinstance(data, bytes) else data[1] - data[0]
