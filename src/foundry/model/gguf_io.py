"""GGUF model files, written and read with the ``gguf`` package in llama.cpp's conventions.

What a file holds
-----------------
- ``general.architecture = "llama"``, ``general.name``, ``general.file_type`` (0 all f32,
  1 mostly f16, 7 mostly Q8_0, 2 mostly Q4_0: llama.cpp's ``LlamaFileType``), and in a quantized
  file ``general.quantization_version`` 2.
- Hyper-parameters under ``llama.``: ``context_length`` (n_ctx), ``embedding_length``,
  ``block_count``, ``feed_forward_length`` (routed expert n_ff), ``attention.head_count``,
  ``attention.head_count_kv``, ``attention.layer_norm_rms_epsilon``, ``rope.freq_base``,
  ``rope.dimension_count`` (head_dim), ``expert_count``, ``expert_used_count``, ``vocab_size``.
  A shared expert adds ``llama.expert_shared_feed_forward_length``: our extension (the key is
  the one gguf-py names for Qwen-MoE); llama.cpp's "llama" loader knows neither the key nor the
  ``ffn_*_shexp`` tensors, so only files without a shared expert load there.
- The byte-level tokenizer: ``tokenizer.ggml.model = "llama"``, tokens ``<unk>``, ``<s>``,
  ``</s>``, ``<0x00>`` ... ``<0xFF>`` (token ``b + 3`` is byte ``b``), scores 0, token types
  2, 3, 3 then 6, BOS 1, EOS 2, UNK 0, ``add_bos_token`` true, ``add_space_prefix`` false.
  llama.cpp's SentencePiece tokenizer escapes spaces to U+2581 before looking up pieces, so
  its own tokenization of a prompt differs from ours at spaces; give it token ids to compare.
- One tensor per entry of :meth:`ModelConfig.param_shapes`, under the same name, in the same
  order. Arrays are numpy (out, in); gguf-py writes the reversed dims, so ggml sees
  ``token_embd`` as ne = [n_embd, n_vocab]. In an f16 or quantized file the norm vectors and
  the router (``ffn_gate_inp``) stay f32, as llama.cpp's converter and ``llama-quantize`` keep
  them: top-k routing is sensitive to the router's rounding. A quantized file (``q8_0``,
  ``q4_0``, quantized by the ``gguf`` package) stores every other tensor in that type, as
  ``llama-quantize`` does, except where a row is not whole blocks of 32 (then f16, its last
  fallback too) and the output head of ``q4_0``, which llama.cpp makes Q6_K and we make Q8_0
  (the ``gguf`` package writes no K-quants).

``load_gguf`` gives float32 arrays; ``load_gguf_stored`` keeps every F16 and block-quantized tensor
as a :class:`~foundry.model.quant.QTensor` in its stored type (norms and routers always float32),
so a model holds about its file size in memory. Any type of :data:`quant.SUPPORTED` is read,
which covers files that ``llama-quantize`` wrote (Q8_0, Q4_0, and Q4_K_M's Q4_K/Q5_K/Q6_K with
their Q5_0/Q5_1/Q8_0 fallbacks).

Reading checks everything against the config rebuilt from the metadata and raises
:class:`GGUFError` naming the key, tensor, shape or type that does not fit. Files are written
to a temporary name, fsynced and renamed, so a crash never leaves half a model under the final
name.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import gguf
import numpy as np
import numpy.typing as npt

from foundry.model import quant
from foundry.model.config import (
    BOS_ID,
    EOS_ID,
    N_BYTE_TOKENS,
    UNK_ID,
    VOCAB_SIZE,
    ConfigError,
    ModelConfig,
)

ARCH = "llama"
GGUF_MAGIC_BYTES = b"GGUF"
# Bytes hashed per read when identifying a model: large enough to run at disk speed,
# small enough to stay out of the way of a Raspberry Pi's memory.
_HASH_CHUNK = 1 << 20

FileDType = Literal["f32", "f16", "q8_0", "q4_0"]
FILE_DTYPES: tuple[FileDType, ...] = ("f32", "f16", "q8_0", "q4_0")
F32Array = npt.NDArray[np.float32]
# (tensor name, read-only memory-mapped tensor: float32 numpy for F32, else a QTensor over the
# file's bytes) -> the part to keep, or None.
Selector = Callable[[str, quant.Param], quant.Param | None]

TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(N_BYTE_TOKENS)))
_T = gguf.TokenType
TOKEN_TYPES: tuple[int, ...] = (
    int(_T.UNKNOWN), int(_T.CONTROL), int(_T.CONTROL), *(int(_T.BYTE),) * N_BYTE_TOKENS
)
assert len(TOKENS) == VOCAB_SIZE and (UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2)

# Config field <- metadata key. Missing keys with a default take llama.cpp's default.
_CONFIG_KEYS: dict[str, tuple[str, int | float | None]] = {
    "n_ctx": (f"{ARCH}.context_length", None),
    "n_embd": (f"{ARCH}.embedding_length", None),
    "n_layer": (f"{ARCH}.block_count", None),
    "n_ff": (f"{ARCH}.feed_forward_length", None),
    "n_head": (f"{ARCH}.attention.head_count", None),
    "n_head_kv": (f"{ARCH}.attention.head_count_kv", None),
    "norm_eps": (f"{ARCH}.attention.layer_norm_rms_epsilon", None),
    "rope_theta": (f"{ARCH}.rope.freq_base", 10000.0),
    "n_expert": (f"{ARCH}.expert_count", None),
    "n_expert_used": (f"{ARCH}.expert_used_count", None),
    "n_ff_shared": (f"{ARCH}.expert_shared_feed_forward_length", 0),
}
_KEY_ROPE_DIM = f"{ARCH}.rope.dimension_count"
_KEY_VOCAB = f"{ARCH}.vocab_size"

_QT = gguf.GGMLQuantizationType
_FILE_TYPES: dict[FileDType, int] = {
    "f32": int(gguf.LlamaFileType.ALL_F32),
    "f16": int(gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": int(gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": int(gguf.LlamaFileType.MOSTLY_Q4_0),
}
# The storage type of the big tensors of each file type, and of its output head.
_STORE: dict[FileDType, tuple[gguf.GGMLQuantizationType, gguf.GGMLQuantizationType]] = {
    "f32": (_QT.F32, _QT.F32),
    "f16": (_QT.F16, _QT.F16),
    "q8_0": (_QT.Q8_0, _QT.Q8_0),
    "q4_0": (_QT.Q4_0, _QT.Q8_0),
}
_READABLE = {_QT.F32, *quant.SUPPORTED}


class GGUFError(ValueError):
    """A GGUF file that is not a Foundry model: names the key, tensor or shape at fault."""


P = TypeVar("P", F32Array, quant.Param)


@dataclass(frozen=True)
class LoadedModel(Generic[P]):
    cfg: ModelConfig
    # In param order; only the selected ones when selecting. float32 (load_gguf), or QTensors
    # for the tensors stored in another type (load_gguf_stored).
    params: dict[str, P]
    metadata: dict[str, Any]  # every key-value pair of the file, plain Python values


def _keeps_f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or name.endswith("ffn_gate_inp.weight")


def storage_type(dtype: FileDType, name: str, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
    """The type a tensor gets in a file of type ``dtype`` (see the module docstring)."""
    if _keeps_f32(name, shape):
        return _QT.F32
    qtype = _STORE[dtype][1 if name == "output.weight" else 0]
    if shape[-1] % quant.block_values(qtype):
        return _QT.F16
    return qtype


def _check_params(cfg: ModelConfig, params: Mapping[str, quant.Param]) -> None:
    shapes = cfg.param_shapes()
    missing = [n for n in shapes if n not in params]
    extra = [n for n in params if n not in shapes]
    if missing or extra:
        raise GGUFError(f"params do not match the config: missing {missing}, unexpected {extra}")
    for name, shape in shapes.items():
        if params[name].shape != shape:
            raise GGUFError(f"param {name} has shape {params[name].shape}, expected {shape}")


def _fsync_dir(directory: Path) -> None:
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
    if dtype not in _FILE_TYPES:
        raise GGUFError(f"dtype must be one of {sorted(_FILE_TYPES)}, got {dtype!r}")
    if not name:
        raise GGUFError("name must not be empty (it is general.name)")
    _check_params(cfg, params)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, ARCH)
    w.add_name(name)
    w.add_file_type(_FILE_TYPES[dtype])
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
    _fsync_dir(path.parent)


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            # The shortest decimal that is this float32, so 1e-5 reads back as 1e-5.
            value = float(str(np.float32(value)))
        out[key] = value
    return out


def _require(meta: Mapping[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise GGUFError(f"{path}: missing metadata key {key!r}")
    return meta[key]


def config_from_metadata(meta: Mapping[str, Any], path: Path) -> ModelConfig:
    """The ModelConfig a file's metadata describes (checked: architecture, tokenizer)."""
    arch = _require(meta, "general.architecture", path)
    if arch != ARCH:
        raise GGUFError(f"{path}: architecture is {arch!r}, expected {ARCH!r}")
    values: dict[str, Any] = {}
    for field_name, (key, default) in _CONFIG_KEYS.items():
        required = default is None
        values[field_name] = _require(meta, key, path) if required else meta.get(key, default)
    tokens = _require(meta, "tokenizer.ggml.tokens", path)
    if _require(meta, "tokenizer.ggml.model", path) != "llama" or tuple(tokens) != TOKENS:
        raise GGUFError(
            f"{path}: the tokenizer is not Foundry's byte-level vocabulary "
            f"({len(tokens)} tokens, expected <unk> <s> </s> <0x00>..<0xFF>)"
        )
    values["n_vocab"] = meta.get(_KEY_VOCAB, len(tokens))
    try:
        cfg = ModelConfig(**values)
    except (ConfigError, TypeError) as exc:
        raise GGUFError(f"{path}: metadata describes no valid model: {exc}") from exc
    if cfg.n_vocab != len(tokens):
        raise GGUFError(f"{path}: {_KEY_VOCAB} is {cfg.n_vocab} but there are {len(tokens)} tokens")
    rope_dim = meta.get(_KEY_ROPE_DIM, cfg.head_dim)
    if rope_dim != cfg.head_dim:
        raise GGUFError(
            f"{path}: {_KEY_ROPE_DIM} is {rope_dim}, expected head_dim {cfg.head_dim} "
            "(partial rotary embedding is not supported)"
        )
    return cfg


def _open_reader(path: Path) -> gguf.GGUFReader:
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
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as exc:
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


def load_gguf_stored(
    path: str | Path, select: Selector | None = None
) -> LoadedModel[quant.Param]:
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
    cfg = config_from_metadata(meta, path)
    shapes = cfg.param_shapes()
    found = {t.name: t for t in reader.tensors}
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
        got = tuple(int(d) for d in reversed(t.shape.tolist()))
        if got != shape:
            raise GGUFError(f"{path}: tensor {tname!r} has shape {got}, expected {shape}")
        stored = quant.from_stored(t.tensor_type, t.data)
        view = stored if select is None else select(tname, stored)
        if view is not None:
            params[tname] = _own_copy(view, keep_quantized and not _keeps_f32(tname, shape))
    return cfg, params, meta


def _own_copy(view: quant.Param, keep_quantized: bool) -> quant.Param:
    """A tensor read off the memory-mapped file into memory of its own."""
    if isinstance(view, np.ndarray):
        return np.array(view, dtype=np.float32, order="C")
    if not keep_quantized:
        return view.dequantize()
    return quant.QTensor(view.qtype, view.shape, np.array(view.data, order="C"))


def values_by_type(path: str | Path) -> dict[gguf.GGMLQuantizationType, int]:
    """How many weight values each storage type holds in a GGUF file (header only)."""
    out: dict[gguf.GGMLQuantizationType, int] = {}
    for t in _open_reader(Path(path)).tensors:
        out[t.tensor_type] = out.get(t.tensor_type, 0) + int(t.n_elements)
    return out


def model_id(path: str | Path) -> int:
    """The u32 a TP hello compares: the first 4 bytes (little-endian) of the file's sha256."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return int.from_bytes(h.digest()[:4], "little")

