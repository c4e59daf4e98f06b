"""What a Foundry GGUF model file holds, and the config a GGUF file's metadata describes.

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

A published file of any architecture of :data:`~foundry.model.spec.arch.ARCHS` is described
by :func:`config_from_metadata`, which range-checks every number before it sizes anything
and raises :class:`GGUFError` naming the key that does not fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
import numpy.typing as npt

from foundry.model.formats import gguf_meta
from foundry.model.formats.gguf_meta import expect_list, shown
from foundry.model.kernels import quant
from foundry.model.spec.arch import ARCHS, LIMITS, ArchConfig
from foundry.model.spec.config import (
    BOS_ID,
    EOS_ID,
    N_BYTE_TOKENS,
    UNK_ID,
    VOCAB_SIZE,
    ConfigError,
    ModelConfig,
)

ARCH = "llama"
GGUF_MAGIC_BYTES = gguf_meta.MAGIC

FileDType = Literal["f32", "f16", "q8_0", "q4_0"]
FILE_DTYPES: tuple[FileDType, ...] = ("f32", "f16", "q8_0", "q4_0")
F32Array = npt.NDArray[np.float32]

TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(N_BYTE_TOKENS)))
_T = gguf.TokenType
TOKEN_TYPES: tuple[int, ...] = (
    int(_T.UNKNOWN),
    int(_T.CONTROL),
    int(_T.CONTROL),
    *(int(_T.BYTE),) * N_BYTE_TOKENS,
)
assert len(TOKENS) == VOCAB_SIZE and (UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2)

_QT = gguf.GGMLQuantizationType
# general.file_type of each: llama.cpp's LlamaFileType.
FILE_TYPES: dict[FileDType, int] = {
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


class GGUFError(ValueError):
    """A GGUF file that is not a Foundry model: names the key, tensor or shape at fault."""


def keeps_f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or name.endswith("ffn_gate_inp.weight")


def storage_type(dtype: FileDType, name: str, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
    """The type a tensor gets in a file of type ``dtype`` (see the module docstring)."""
    if keeps_f32(name, shape):
        return _QT.F32
    qtype = _STORE[dtype][1 if name == "output.weight" else 0]
    if shape[-1] % quant.block_values(qtype):
        return _QT.F16
    return qtype


def _require(meta: Mapping[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise GGUFError(f"{path}: missing metadata key {key!r}")
    return meta[key]


def config_from_metadata(meta: Mapping[str, Any], path: Path) -> ModelConfig:
    """The config a file's metadata describes, every number range-checked before it sizes
    anything: a plain ``ModelConfig`` for Foundry's own files (llama with experts and the byte
    vocabulary), an :class:`~foundry.model.spec.arch.ArchConfig` for any other architecture of
    :data:`~foundry.model.spec.arch.ARCHS`. A file we cannot run raises one line naming the
    architecture or the key."""
    name = _require(meta, "general.architecture", path)
    spec = ARCHS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise GGUFError(
            f"{path}: architecture {name!r} is not supported (Foundry runs "
            f"{', '.join(sorted(ARCHS))}; docs/models.md)"
        )
    a = name

    def num(key: str, default: int | float | None = None, kind: type = int) -> Any:
        full = f"{a}.{key}"
        value = meta.get(full, default)
        if value is None:
            raise GGUFError(f"{path}: missing metadata key {full!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GGUFError(f"{path}: {full} is {shown(value)}, expected a number")
        if not math.isfinite(value):
            raise GGUFError(f"{path}: {full} is {value!r}, expected a finite number")
        if kind is int and (not float(value).is_integer() or value < 0):
            raise GGUFError(f"{path}: {full} is {value!r}, expected a whole number >= 0")
        return kind(value)

    for key in (
        "rope.scaling.type",
        "final_logit_softcapping",
        "expert_gating_func",
        "expert_weights_scale",
        "attention.sliding_window_pattern",
    ):
        value = meta.get(f"{a}.{key}")
        if (
            value not in (None, "none", 0, 0.0)
            and not (key == "expert_gating_func" and value == 1)
            and not (key == "expert_weights_scale" and value == 1.0)
        ):
            raise GGUFError(f"{path}: {a}.{key} = {value!r} is not supported")
    try:
        tokens = expect_list(
            "tokenizer.ggml.tokens", _require(meta, "tokenizer.ggml.tokens", path), str, GGUFError
        )
    except GGUFError as exc:
        raise GGUFError(f"{path}: {exc}") from None
    n_tokens = len(tokens)
    n_vocab = num("vocab_size", n_tokens)
    if n_vocab != n_tokens:
        raise GGUFError(f"{path}: {a}.vocab_size is {n_vocab} but there are {n_tokens} tokens")
    for key in (
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
    ):
        tid = meta.get(key)
        if tid is not None and not (isinstance(tid, int) and 0 <= tid < n_vocab):
            raise GGUFError(f"{path}: {key} is {tid!r}, outside the vocabulary [0, {n_vocab})")
    n_expert = num("expert_count", 0)
    values: dict[str, Any] = {
        "n_vocab": n_vocab,
        "n_ctx": num("context_length"),
        "n_embd": num("embedding_length"),
        "n_layer": num("block_count"),
        "n_head": num("attention.head_count"),
        "norm_eps": num("attention.layer_norm_rms_epsilon", kind=float),
        "rope_theta": num("rope.freq_base", 10000.0, float),
        "n_expert": n_expert,
        "n_expert_used": num("expert_used_count", 0 if n_expert == 0 else None),
        "n_ff_shared": num("expert_shared_feed_forward_length", 0),
    }
    values["n_head_kv"] = num("attention.head_count_kv", values["n_head"])
    values["n_ff"] = (
        num("expert_feed_forward_length") if spec.name == "qwen3moe" else num("feed_forward_length")
    )
    for field_name, value in values.items():
        top = LIMITS.get(field_name)
        if top is not None and value > top:
            raise GGUFError(f"{path}: metadata states {field_name} = {value}, above {top}")
    ours = (
        a == "llama"
        and n_expert > 0
        and tuple(tokens) == TOKENS
        and meta.get("tokenizer.ggml.model") == "llama"
    )
    key_length = num("attention.key_length", 0)
    value_length = num("attention.value_length", key_length)
    if value_length != key_length:
        raise GGUFError(
            f"{path}: {a}.attention.value_length {value_length} differs from "
            f"key_length {key_length} (not supported)"
        )
    try:
        if ours and key_length in (0, values["n_embd"] // max(values["n_head"], 1)):
            cfg: ModelConfig = ModelConfig(**values)
        else:
            extra: dict[str, Any] = {"architecture": a, "key_length": key_length}
            if spec.sliding_window:
                extra["sliding_window"] = num("attention.sliding_window", 0)
                extra["swa_pattern"] = spec.swa_pattern
                extra["rope_theta_swa"] = num("rope.freq_base_swa", 10000.0, float)
            cfg = ArchConfig(**values, **extra)
    except (ConfigError, TypeError) as exc:
        raise GGUFError(f"{path}: metadata describes no valid model: {exc}") from exc
    rope_dim = num("rope.dimension_count", cfg.head_dim)
    if rope_dim != cfg.head_dim:
        raise GGUFError(
            f"{path}: {a}.rope.dimension_count is {rope_dim}, expected head_dim {cfg.head_dim} "
            "(partial rotary embedding is not supported)"
        )
    return cfg
