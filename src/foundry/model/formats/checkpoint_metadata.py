"""A checkpoint's metadata: the JSON its header holds, checked against its schema before
anything reads it, and the fine-tuning run's part of it (``tuning``: the base file's identity,
the LoRA settings and the trainable tensors' table of its ``tuning.TunedConfig``).

The schema is that of ``checkpoint``'s module docstring. :func:`validate_metadata` raises
:class:`MetadataError` naming the first field that does not fit; :func:`metadata_config` builds the
config the metadata holds.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from foundry.model.formats.tuning import TunedConfig
from foundry.model.spec.config import ModelConfig

# Metadata limits: the step travels as a u32 on the wire (REGISTER_ACK's global_step); a
# size beyond these is not a model this code can hold, whatever the file says.
MAX_STEP = 0xFFFFFFFF
MAX_DIM = 1 << 24
MAX_CTX = 1 << 20
# Settings of ``extra`` the code reads back, and what each must be.
_EXTRA_INTS = {"sync_every": 1, "outer_steps": 0}  # name -> least value
_EXTRA_STRS = ("compression", "down_compression", "downlink_rng")


class MetadataError(Exception):
    """One metadata field that does not fit the schema: its dotted name and why."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"metadata field {name!r} {why}")


def _int(meta: Mapping[str, Any], key: str, name: str, low: int, high: int) -> int:
    if key not in meta:
        raise MetadataError(name, "is missing")
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise MetadataError(name, f"must be an integer in [{low}, {high}], got {json.dumps(value)}")
    if not low <= value <= high:
        raise MetadataError(name, f"must be in [{low}, {high}], got {value}")
    return value


def _object(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise MetadataError(name, f"must be a JSON object, got {json.dumps(value)[:80]}")
    return value


def validate_metadata(meta: Any) -> None:
    """Check a checkpoint's metadata against its schema (module docstring) before anything
    reads it; raises MetadataError naming the first field that does not fit."""
    top = _object(meta, "(metadata)")
    if top.get("format") != "foundry-checkpoint":
        raise MetadataError(
            "format", f'must be "foundry-checkpoint", got {json.dumps(top.get("format"))}'
        )
    _int(top, "step", "step", 0, MAX_STEP)
    _int(top, "data_position", "data_position", 0, 2**63 - 1)
    _int(top, "optimizer_step", "optimizer_step", 0, 2**63 - 1)
    config = _object(top.get("config"), "config")
    known = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for key, value in config.items():
        if key not in known:
            raise MetadataError(f"config.{key}", "is not a ModelConfig field")
        if known[key].type in ("float", float):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (value == value and abs(value) != float("inf"))
            ):
                raise MetadataError(
                    f"config.{key}", f"must be a finite number, got {json.dumps(value)}"
                )
        else:
            _int(config, key, f"config.{key}", 0, MAX_CTX if key == "n_ctx" else MAX_DIM)
    if "tuning" in top:
        _validate_tuning(_object(top.get("tuning"), "tuning"))
    extra = _object(top.get("extra"), "extra")
    for key, low in _EXTRA_INTS.items():
        if key in extra:
            _int(extra, key, f"extra.{key}", low, MAX_STEP)
    for key in _EXTRA_STRS:
        if key in extra and not isinstance(extra[key], str):
            raise MetadataError(f"extra.{key}", f"must be a string, got {json.dumps(extra[key])}")
    tensors = top.get("tensors")
    if not isinstance(tensors, list):
        raise MetadataError("tensors", f"must be a list, got {json.dumps(tensors)[:80]}")
    for i, t in enumerate(tensors):
        where = f"tensors[{i}]"
        entry = _object(t, where)
        for key in ("group", "name"):
            if not isinstance(entry.get(key), str):
                raise MetadataError(
                    f"{where}.{key}", f"must be a string, got {json.dumps(entry.get(key))}"
                )
        shape = entry.get("shape")
        if not isinstance(shape, list) or len(shape) > 4:
            raise MetadataError(
                f"{where}.shape", f"must be a list of at most 4 sizes, got {shape!r}"
            )
        for j, size in enumerate(shape):
            _int({"size": size}, "size", f"{where}.shape[{j}]", 0, MAX_DIM)
        if entry.get("dtype") != "<f4":
            raise MetadataError(
                f"{where}.dtype", f'must be "<f4", got {json.dumps(entry.get("dtype"))}'
            )
        _int(entry, "offset", f"{where}.offset", 0, 2**63 - 1)
        nbytes = _int(entry, "nbytes", f"{where}.nbytes", 0, 2**63 - 1)
        if nbytes != 4 * int(np.prod(shape, dtype=np.int64)):
            raise MetadataError(
                f"{where}.nbytes",
                f"is {nbytes}, but shape {shape} holds "
                f"{4 * int(np.prod(shape, dtype=np.int64))} bytes of <f4",
            )


_TUNING_STRS = ("architecture", "base_sha256")
_TUNING_NUMS = ("lora_alpha", "lora_dropout")


def tuning_metadata(cfg: TunedConfig) -> dict[str, Any]:
    return {
        "architecture": cfg.architecture,
        "base_bytes": cfg.base_bytes,
        "base_sha256": cfg.base_sha256,
        "lora_rank": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "lora_targets": list(cfg.lora_targets),
        "trainable": [[name, list(shape)] for name, shape in cfg.trainable],
    }


def _validate_tuning(tuning: Mapping[str, Any]) -> None:
    for key in _TUNING_STRS:
        if not isinstance(tuning.get(key), str):
            raise MetadataError(
                f"tuning.{key}", f"must be a string, got {json.dumps(tuning.get(key))}"
            )
    _int(tuning, "base_bytes", "tuning.base_bytes", 0, 2**63 - 1)
    _int(tuning, "lora_rank", "tuning.lora_rank", 0, MAX_DIM)
    for key in _TUNING_NUMS:
        value = tuning.get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (value == value and abs(value) != float("inf"))
        ):
            raise MetadataError(
                f"tuning.{key}", f"must be a finite number, got {json.dumps(value)}"
            )
    targets = tuning.get("lora_targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise MetadataError("tuning.lora_targets", "must be a list of strings")
    table = tuning.get("trainable")
    if not isinstance(table, list) or not table:
        raise MetadataError("tuning.trainable", "must be a non-empty list")
    for i, row in enumerate(table):
        if not (
            isinstance(row, list)
            and len(row) == 2
            and isinstance(row[0], str)
            and isinstance(row[1], list)
            and len(row[1]) <= 4
        ):
            raise MetadataError(f"tuning.trainable[{i}]", "must be [name, shape]")
        for j, size in enumerate(row[1]):
            _int({"size": size}, "size", f"tuning.trainable[{i}][1][{j}]", 0, MAX_DIM)


def metadata_config(meta: Mapping[str, Any]) -> ModelConfig:
    """The config a checkpoint's metadata holds: a ModelConfig, or a fine-tuning run's
    TunedConfig."""
    tuning = meta.get("tuning")
    if tuning is None:
        return ModelConfig(**meta["config"])
    return TunedConfig(
        **meta["config"],
        architecture=tuning["architecture"],
        base_bytes=tuning["base_bytes"],
        base_sha256=tuning["base_sha256"],
        lora_rank=tuning["lora_rank"],
        lora_alpha=float(tuning["lora_alpha"]),
        lora_dropout=float(tuning["lora_dropout"]),
        lora_targets=tuple(tuning["lora_targets"]),
        trainable=tuple(
            (name, tuple(int(d) for d in shape)) for name, shape in tuning["trainable"]
        ),
    )
