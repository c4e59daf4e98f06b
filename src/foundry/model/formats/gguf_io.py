"""GGUF model files, written and read with the ``gguf`` package in llama.cpp's conventions;
what a Foundry file holds is :mod:`~foundry.model.formats.gguf_model`.

``load_gguf`` gives float32 arrays; ``load_gguf_stored`` keeps every F16 and block-quantized
tensor as a :class:`~foundry.model.kernels.quant.QTensor` in its stored type (norms and routers
always float32), so a model holds about its file size in memory. Any type of
:data:`types.SUPPORTED` is read, which covers files that ``llama-quantize`` wrote (Q8_0, Q4_0,
and Q4_K_M's Q4_K/Q5_K/Q6_K with their Q5_0/Q5_1/Q8_0 fallbacks).

Reading checks everything against the config rebuilt from the metadata and raises
:class:`GGUFError` naming the key, tensor, shape or type that does not fit. Files are written
to a temporary name, fsynced and renamed, so a crash never leaves half a model under the final
name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import mmap
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import gguf
import numpy as np
import numpy.typing as npt

from foundry.model.formats import gguf_meta
from foundry.model.formats.gguf_model import (
    ARCH,
    FILE_TYPES,
    GGUF_MAGIC_BYTES,
    TOKEN_TYPES,
    TOKENS,
    F32Array,
    FileDType,
    GGUFError,
    config_from_metadata,
    keeps_f32,
    storage_type,
)
from foundry.model.kernels import finite, quant
from foundry.model.kernels.types import TYPES
from foundry.model.spec.arch import ArchConfig
from foundry.model.spec.arch import spec as spec_of
from foundry.model.spec.config import BOS_ID, EOS_ID, UNK_ID, VOCAB_SIZE, ModelConfig

# Bytes hashed per read when identifying a model: large enough to run at disk speed,
# small enough to stay out of the way of a Raspberry Pi's memory.
_HASH_CHUNK = 1 << 20

# (tensor name, read-only memory-mapped tensor: float32 numpy for F32, else a QTensor over the
# file's bytes) -> the part to keep, or None.
Selector = Callable[[str, quant.Param], quant.Param | None]

_QT = gguf.GGMLQuantizationType
_READABLE = set(TYPES)


P = TypeVar("P", F32Array, quant.Param)


@dataclass(frozen=True)
class LoadedModel(Generic[P]):
    cfg: ModelConfig
    # In param order; only the selected ones when selecting. float32 (load_gguf), or QTensors
    # for the tensors stored in another type (load_gguf_stored).
    params: dict[str, P]
    metadata: dict[str, Any]  # every key-value pair of the file, plain Python values


def _check_params(cfg: ModelConfig, params: Mapping[str, quant.Param]) -> None:
    shapes = cfg.param_shapes()
    missing = [n for n in shapes if n not in params]
    extra = [n for n in params if n not in shapes]
    if missing or extra:
        raise GGUFError(f"params do not match the config: missing {missing}, unexpected {extra}")
    for name, shape in shapes.items():
        if params[name].shape != shape:
            raise GGUFError(f"param {name} has shape {params[name].shape}, expected {shape}")


def _check_storable(cfg: ModelConfig, params: Mapping[str, quant.Param], dtype: FileDType) -> None:
    """GGUFError naming the first float32 tensor that ``dtype`` cannot hold (a NaN, or a value
    that would overflow to infinity: finite.overflow), before anything is written."""
    for pname, shape in cfg.param_shapes().items():
        value = params[pname]
        if isinstance(value, quant.QTensor):
            continue
        qtype = storage_type(dtype, pname, shape)
        why = finite.overflow(value, qtype)
        if why is not None:
            raise GGUFError(
                f"cannot write tensor {pname!r} as {qtype.name}: {why}; nothing was written"
            )


def fsync_dir(directory: Path) -> None:
    """fsync ``directory``, so a file renamed into it is there after a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_gguf(
    path: str | Path,
    cfg: ModelConfig,
    params: Mapping[str, quant.Param],
    dtype: FileDType = "f32",
    name: str = "foundry",
) -> None:
    """Write the model as a GGUF file llama.cpp can load (atomically: temp file + rename).

    float32 parameters are stored as ``dtype`` says (module docstring); a QTensor is written in
    the type it already has (a file read with ``load_gguf_stored`` writes back unchanged)."""
    if dtype not in FILE_TYPES:
        raise GGUFError(f"dtype must be one of {sorted(FILE_TYPES)}, got {dtype!r}")
    if not name:
        raise GGUFError("name must not be empty (it is general.name)")
    _check_params(cfg, params)
    _check_storable(cfg, params, dtype)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, ARCH)
    w.add_name(name)
    w.add_file_type(FILE_TYPES[dtype])
    w.add_context_length(cfg.n_ctx)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_expert_count(cfg.n_expert)
    w.add_expert_used_count(cfg.n_expert_used)
    w.add_vocab_size(cfg.n_vocab)
    if cfg.n_ff_shared:
        w.add_expert_shared_feed_forward_length(cfg.n_ff_shared)
    w.add_tokenizer_model("llama")
    w.add_token_list(list(TOKENS))
    w.add_token_scores([0.0] * VOCAB_SIZE)
    w.add_token_types(list(TOKEN_TYPES))
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if dtype not in ("f32", "f16"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for pname, shape in cfg.param_shapes().items():
        stored = params[pname]
        if isinstance(stored, quant.QTensor):  # already in a storage type: written as it is
            w.add_tensor(pname, stored.data, raw_dtype=stored.qtype)
            continue
        qtype = storage_type(dtype, pname, shape)
        value = stored
        if qtype == _QT.F32:
            w.add_tensor(pname, np.ascontiguousarray(value, dtype=np.float32))
        elif qtype == _QT.F16:
            w.add_tensor(pname, np.ascontiguousarray(value, dtype=np.float16))
        else:
            w.add_tensor(pname, quant.quantize(value, qtype).data, raw_dtype=qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        assert w.fout is not None
        for f in w.fout:
            f.flush()
            os.fsync(f.fileno())
        w.close()
        os.replace(tmp, path)
    except BaseException as exc:
        w.close()
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise GGUFError(f"could not write {path}: {exc}") from exc
        raise
    fsync_dir(path.parent)


def _metadata(reader: _Reader) -> dict[str, Any]:
    return dict(reader.fields)


def _tied(cfg: ModelConfig, names: set[str], path: Path) -> ModelConfig:
    """The config with ``tied_output`` set when the file has no output head (token_embd is),
    and ``rope_freqs`` when a llama file has per-pair rope factors (Llama 3's scaling)."""
    if "rope_freqs.weight" in names and spec_of(cfg).name == "llama":
        if not isinstance(cfg, ArchConfig):  # ours never has them: read as a published llama
            cfg = ArchConfig(**dataclasses.asdict(cfg), architecture="llama")
        cfg = dataclasses.replace(cfg, rope_freqs=True)
    if "output.weight" in names or not isinstance(cfg, ArchConfig):
        return cfg
    if not spec_of(cfg).tied_ok:
        raise GGUFError(f"{path}: missing tensor 'output.weight' ({cfg.architecture} needs it)")
    return dataclasses.replace(cfg, tied_output=True)


def _open_reader(path: Path) -> _Reader:
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        raise GGUFError(f"GGUF file {path} does not exist") from None
    except OSError as exc:
        raise GGUFError(f"cannot read {path}: {exc}") from exc
    if head != GGUF_MAGIC_BYTES:
        raise GGUFError(
            f"{path} is not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC_BYTES!r}); "
            "pass a model exported by `foundry export` or another llama.cpp GGUF"
        )
    try:
        return _Reader(path)
    except gguf_meta.GGUFMetaError as exc:  # says what, naming the file
        raise GGUFError(str(exc)) from exc
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as exc:
        size = path.stat().st_size
        raise GGUFError(
            f"{path} is truncated or damaged ({size} bytes; {exc}); export the model again"
        ) from exc


def load_gguf(path: str | Path, select: Selector | None = None) -> LoadedModel[F32Array]:
    """Read and check a Foundry GGUF model; tensors come back as f32 numpy arrays (any stored
    type dequantized: what training and the reference engine take).

    ``select`` lets a caller take only what it needs: it is called with each tensor's name and
    a read-only view of the memory-mapped file (numpy float32 for F32 tensors, a QTensor over
    the file's bytes otherwise) and returns the part to keep (a slice of the view, e.g. one
    rank's experts, or ``QTensor.take`` of whole blocks) or None to skip the tensor. Only the
    returned part is read from disk and copied. Every tensor's presence, type and shape is
    checked whatever is selected.
    """
    cfg, params, meta = _load(Path(path), select, keep_quantized=False)
    return LoadedModel(cfg, {n: quant.dequantize(p) for n, p in params.items()}, meta)


def load_gguf_stored(path: str | Path, select: Selector | None = None) -> LoadedModel[quant.Param]:
    """As :func:`load_gguf`, but every tensor stored in another type than F32 stays in it (a
    QTensor; norms and routers are always float32): a model in about its file's size of memory,
    for the inference engine."""
    cfg, params, meta = _load(Path(path), select, keep_quantized=True)
    return LoadedModel(cfg, params, meta)


def _load(
    path: Path, select: Selector | None, keep_quantized: bool
) -> tuple[ModelConfig, dict[str, quant.Param], dict[str, Any]]:
    reader = _open_reader(path)
    meta = _metadata(reader)
    found = {t.name: t for t in reader.tensors}
    cfg = _tied(config_from_metadata(meta, path), set(found), path)
    shapes = cfg.param_shapes()
    for tname in found:
        if tname not in shapes:
            raise GGUFError(f"{path}: unexpected tensor {tname!r} for this config")
    params: dict[str, quant.Param] = {}
    for tname, shape in shapes.items():
        t = found.get(tname)
        if t is None:
            raise GGUFError(f"{path}: missing tensor {tname!r} (shape {shape})")
        if t.tensor_type not in _READABLE:
            raise GGUFError(
                f"{path}: tensor {tname!r} has type {t.tensor_type.name}; Foundry reads "
                + ", ".join(q.name for q in sorted(_READABLE))
                + " tensors (re-quantize the file to one of these, e.g. with llama-quantize)"
            )
        got = t.shape
        if got != shape:
            raise GGUFError(f"{path}: tensor {tname!r} has shape {got}, expected {shape}")
        stored = quant.from_stored(t.tensor_type, t.data)
        view = stored if select is None else select(tname, stored)
        if view is not None:
            params[tname] = _own_copy(
                view, keep_quantized and not keeps_f32(tname, shape), reader.release_view
            )
            why = finite.nonfinite(params[tname])
            if why is not None:
                raise GGUFError(
                    f"{path}: tensor {tname!r} holds {why}; the file is damaged or was written "
                    "from a run that diverged: export it again from a good checkpoint"
                )
        reader.release(t)
    return cfg, params, meta


COPY_CHUNK_BYTES = 16 << 20


def _own_copy(
    view: quant.Param, keep_quantized: bool, release: Callable[[npt.NDArray[Any]], None]
) -> quant.Param:
    """A tensor read off the memory-mapped file into memory of its own. A tensor kept as it
    is stored is copied in slices of rows of about COPY_CHUNK_BYTES, each slice's pages
    unmapped (``release``) once copied: a large one (Gemma's 178 MB embedding) is then never
    held twice."""
    if not isinstance(view, np.ndarray) and not keep_quantized:
        return view.dequantize()
    src = view if isinstance(view, np.ndarray) else view.data
    out = np.empty(src.shape, src.dtype if not isinstance(view, np.ndarray) else np.float32)
    rows = max(1, COPY_CHUNK_BYTES // max(1, src[:1].nbytes)) if src.ndim else 1
    for at in range(0, src.shape[0] if src.ndim else 1, rows):
        part = src[at : at + rows] if src.ndim else src
        out[at : at + rows] = part
        release(part)
    if isinstance(view, np.ndarray):
        return out
    return quant.QTensor(view.qtype, view.shape, out)


def values_by_type(path: str | Path) -> dict[gguf.GGMLQuantizationType, int]:
    """How many weight values each storage type holds in a GGUF file (header only)."""
    out: dict[gguf.GGMLQuantizationType, int] = {}
    for t in _open_reader(Path(path)).tensors:
        out[t.tensor_type] = out.get(t.tensor_type, 0) + int(t.n_elements)
    return out


def block_sizes(path: str | Path) -> dict[str, int]:
    """The values a block holds of every tensor a stored load keeps in blocks of more than one
    value (header only): a rank's column cut must fall on them (``shard.slices.misaligned``)."""
    out: dict[str, int] = {}
    for t in _open_reader(Path(path)).tensors:
        block = gguf.GGML_QUANT_SIZES[t.tensor_type][0]
        if block > 1 and not keeps_f32(t.name, t.shape):
            out[t.name] = block
    return out


def model_id(path: str | Path) -> int:
    """The u32 a TP hello compares: the first 4 bytes (little-endian) of the file's sha256."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return int.from_bytes(h.digest()[:4], "little")


# -- reading -------------------------------------------------------------------------------------
# The layout (header, key/value pairs, tensor table) is read by gguf_meta, not gguf.GGUFReader:
# that one maps every element of every array as its own numpy view, which takes 43 s for a
# 262,144-token vocabulary. Here each tensor becomes a numpy view of the mapped file.


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (the reverse of ggml's ne)
    n_elements: int
    data: npt.NDArray[Any]  # F32/F16: the values; blocks: uint8 (..., row bytes)
    offset: int  # of data in the file
    nbytes: int


class _Reader:
    def __init__(self, path: Path):
        with path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.mm = np.frombuffer(self._map, dtype=np.uint8)
        layout = gguf_meta.read_layout(self._map, path)
        self.fields: dict[str, Any] = layout.metadata
        self.tensors: list[_TensorInfo] = []
        for info in layout.tensors:
            name, at = info.name, info.offset
            qtype = gguf.GGMLQuantizationType(info.ggml_type)
            shape = tuple(reversed(info.dims))
            n = math.prod(shape)
            values, size = gguf.GGML_QUANT_SIZES[qtype]
            if not shape or shape[-1] % values:
                raise ValueError(
                    f"tensor {name!r} of shape {shape} is not whole {qtype.name} blocks"
                )
            nbytes = n // values * size
            if at + nbytes > self.mm.size:
                raise ValueError(f"tensor {name!r} ends past the end of the file")
            raw = self.mm[at : at + nbytes]
            data: npt.NDArray[Any]
            if qtype == gguf.GGMLQuantizationType.F32:
                data = raw.view(np.float32).reshape(shape)
            elif qtype == gguf.GGMLQuantizationType.F16:
                data = raw.view(np.float16).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], shape[-1] // values * size)
            self.tensors.append(_TensorInfo(name, qtype, shape, n, data, at, nbytes))

    def release_view(self, view: npt.NDArray[Any]) -> None:
        """``release`` the pages under ``view`` (a contiguous view of the mapped file; anything
        else is left alone)."""
        start = view.__array_interface__["data"][0] - self.mm.__array_interface__["data"][0]
        if view.flags.c_contiguous and start >= 0 and start + view.nbytes <= self.mm.size:
            self._release(start, view.nbytes)

    def release(self, t: _TensorInfo) -> None:
        """``release`` tensor ``t``'s pages."""
        self._release(t.offset, t.nbytes)

    def _release(self, offset: int, nbytes: int) -> None:
        """Unmap these bytes' pages from this process once they have been copied (they stay in
        the page cache; reading the view again maps them back): without this, a process
        that loads a model holds each page of the file twice, once mapped and once copied,
        until the whole file is read."""
        if nbytes and hasattr(mmap, "MADV_DONTNEED") and hasattr(self._map, "madvise"):
            start = offset - offset % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
