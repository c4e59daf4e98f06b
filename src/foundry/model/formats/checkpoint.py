"""A training checkpoint file: weights, AdamW state, global step and data position.

File format (version 1), all integers little-endian::

    offset  size      field
    0       8         magic b"FDRYCKPT"
    8       4         u32 format version (1)
    12      4         u32 reserved, 0
    16      8         u64 M = length of the JSON metadata
    24      M         JSON metadata, UTF-8
    24+M    pad       zeros up to a multiple of 64: D = start of the tensor data
    D       ...       tensors, each little-endian f32 in C order, each starting at a
                      multiple of 64 from D (zero padding between)
    end-32  32        sha256 of every byte before it

The metadata holds ``config`` (the ModelConfig fields; a fine-tuning run's also ``tuning``:
the base file's identity, the LoRA settings and the trainable tensors' table of its
``tuning.TunedConfig``), ``step``, ``data_position`` (the next
global sample index), ``optimizer_step``, ``extra`` (small JSON settings of the run, e.g.
compression and learning-rate schedule) and ``tensors``: a list of ``{group, name, shape,
dtype, offset, nbytes}`` with ``group`` one of ``params`` / ``m`` / ``v`` and ``offset``
relative to D. Parameters come in the canonical order of :meth:`ModelConfig.param_shapes`,
then the AdamW first and second moments, then any further groups of parameter-shaped tensors
the run keeps (``CheckpointState.tensors``, by group name in sorted order: e.g. the swarm's
``shadow``, the weights every worker holds, and ``outer_m``, the outer optimizer's momentum).

:func:`encode_checkpoint` checks a state against its config and lays it out, ``write`` puts
the bytes in a file, :func:`verify_checkpoint` checks a file's hash and
:func:`load_checkpoint` reads one back. The metadata's schema is ``checkpoint_metadata``'s;
checkpoints in a directory (atomic saves, pruning, damaged files, resuming, the one-writer
lock) are ``checkpoint_dir``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypedDict

import numpy as np
import numpy.typing as npt

from foundry.model.formats.checkpoint_metadata import (
    MetadataError,
    metadata_config,
    tuning_metadata,
    validate_metadata,
)
from foundry.model.formats.tuning import TunedConfig
from foundry.model.spec.config import ConfigError, ModelConfig

MAGIC = b"FDRYCKPT"
VERSION = 1
HEADER = struct.Struct("<8sIIQ")  # magic, version, reserved, metadata length
TRAILER_BYTES = hashlib.sha256().digest_size
# Tensor data alignment: whole cache lines, and any numpy dtype can view it in place.
ALIGN = 64
# Bytes hashed per read when verifying without loading.
_CHUNK = 1 << 20
_GROUPS = ("params", "m", "v")

F32Array = npt.NDArray[np.float32]


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; the message says which file and why."""


class OptimizerState(TypedDict):
    """AdamW's state dict (the same shape as ``optim.AdamWState``).

    ``m`` and ``v`` map parameter names to f32 moments; they may be empty before the first step.
    """

    step: int
    m: dict[str, F32Array]
    v: dict[str, F32Array]


@dataclass(frozen=True)
class CheckpointState:
    """Everything a run needs to continue exactly where it stopped."""

    config: ModelConfig
    step: int
    params: dict[str, F32Array]
    optimizer: OptimizerState
    data_position: int
    extra: dict[str, Any] = field(default_factory=dict)
    # Further parameter-shaped tensors by group name (neither "params", "m" nor "v").
    tensors: dict[str, dict[str, F32Array]] = field(default_factory=dict)


def _pad(n: int) -> int:
    return -n % ALIGN


def _file_tensors(state: CheckpointState) -> list[tuple[str, str, F32Array]]:
    """(group, name, array) of every tensor in file order, checked against the config."""
    shapes = state.config.param_shapes()
    params = state.params
    missing = [n for n in shapes if n not in params]
    extra = [n for n in params if n not in shapes]
    if missing or extra:
        raise CheckpointError(
            f"params do not match the config: missing {missing}, unexpected {extra}"
        )
    opt = state.optimizer
    for key in ("m", "v", "step"):
        if key not in opt:
            raise CheckpointError(f"optimizer state lacks {key!r} (expected m, v, step)")
    clash = [g for g in state.tensors if g in _GROUPS]
    if clash:
        raise CheckpointError(f"tensor groups {clash} are reserved")
    groups: list[tuple[str, Mapping[str, Any]]] = [
        ("params", params),
        ("m", opt["m"]),
        ("v", opt["v"]),
        *sorted(state.tensors.items()),
    ]
    out = []
    for group, tensors in groups:
        unknown = [n for n in tensors if n not in shapes]
        if unknown:
            raise CheckpointError(f"optimizer {group} holds unknown tensors {unknown}")
        for name, shape in shapes.items():
            if name not in tensors:
                continue
            arr = tensors[name]
            if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.shape != shape:
                got = (getattr(arr, "shape", None), getattr(arr, "dtype", type(arr).__name__))
                raise CheckpointError(
                    f"{group} {name}: expected float32 {shape}, got {got[1]} {got[0]}"
                )
            out.append((group, name, np.ascontiguousarray(arr, dtype="<f4")))
    for key, moments in (("m", opt["m"]), ("v", opt["v"])):
        if moments and len(moments) != len(params):  # empty (before the first step) or whole
            raise CheckpointError(
                f"optimizer group {key!r} holds {len(moments)} of the {len(params)} tensors "
                "(a moment group is empty or whole)"
            )
    return out


def _metadata(state: CheckpointState, index: list[dict[str, Any]]) -> bytes:
    if state.step < 0 or state.data_position < 0:
        raise CheckpointError(
            f"step and data_position must be >= 0, got {state.step}, {state.data_position}"
        )
    cfg = state.config
    base_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    meta = {
        "format": "foundry-checkpoint",
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k in base_fields},
        **({"tuning": tuning_metadata(cfg)} if isinstance(cfg, TunedConfig) else {}),
        "step": int(state.step),
        "data_position": int(state.data_position),
        "optimizer_step": int(state.optimizer["step"]),
        "extra": state.extra,
        "tensors": index,
    }
    try:
        return json.dumps(meta, allow_nan=False, sort_keys=True).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint extra is not plain JSON: {exc}") from exc


def _write(f: BinaryIO, h: Any, data: bytes | memoryview) -> None:
    f.write(data)
    h.update(data)


@dataclass(frozen=True)
class EncodedCheckpoint:
    """A state checked against its config and laid out as its file holds it: the metadata
    JSON and the tensors in file order."""

    meta: bytes
    tensors: list[tuple[str, str, F32Array]]

    def write(self, f: BinaryIO) -> None:
        """The whole file into ``f``: header, metadata, padding, tensors, then the sha256 of
        every byte before it."""
        meta = self.meta
        h = hashlib.sha256()
        _write(f, h, HEADER.pack(MAGIC, VERSION, 0, len(meta)))
        _write(f, h, meta)
        _write(f, h, bytes(_pad(HEADER.size + len(meta))))
        for _, _, arr in self.tensors:
            _write(f, h, arr.reshape(-1).view(np.uint8).data)
            _write(f, h, bytes(_pad(arr.nbytes)))
        f.write(h.digest())


def encode_checkpoint(state: CheckpointState) -> EncodedCheckpoint:
    """``state`` as its file holds it; CheckpointError when it does not fit its config."""
    tensors = _file_tensors(state)
    index: list[dict[str, Any]] = []
    offset = 0
    for group, name, arr in tensors:
        index.append(
            {
                "group": group,
                "name": name,
                "shape": list(arr.shape),
                "dtype": "<f4",
                "offset": offset,
                "nbytes": arr.nbytes,
            }
        )
        offset += arr.nbytes + _pad(arr.nbytes)
    return EncodedCheckpoint(_metadata(state, index), tensors)


def _check_header(path: Path, head: bytes, size: int) -> int:
    """Metadata length from the header; raises for a foreign or cut-short file."""
    if len(head) < len(MAGIC) and MAGIC.startswith(head):
        raise CheckpointError(f"{path} is truncated ({size} bytes)")
    if head[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path} is not a Foundry checkpoint (bad magic {head[:8]!r})")
    if size < HEADER.size + TRAILER_BYTES:
        raise CheckpointError(f"{path} is truncated ({size} bytes)")
    _, version, _, meta_len = HEADER.unpack(head[: HEADER.size])
    if version != VERSION:
        raise CheckpointError(
            f"{path} is checkpoint format version {version}; this Foundry reads version {VERSION}"
        )
    if HEADER.size + meta_len + TRAILER_BYTES > size:
        raise CheckpointError(f"{path} is truncated ({size} bytes, metadata alone {meta_len})")
    return int(meta_len)


def _corrupt(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} is corrupt or truncated (sha256 does not match its content); "
        "resume from an older checkpoint"
    )


def verify_checkpoint(path: str | Path) -> None:
    """Raise CheckpointError unless ``path`` is a complete, undamaged checkpoint.

    Reads the file in chunks, so it costs disk time but little memory.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as f:
            head = f.read(HEADER.size)
            _check_header(p, head, size)
            h = hashlib.sha256(head)
            remaining = size - TRAILER_BYTES - len(head)
            while remaining > 0:
                chunk = f.read(min(_CHUNK, remaining))
                if not chunk:
                    raise _corrupt(p)
                h.update(chunk)
                remaining -= len(chunk)
            trailer = f.read(TRAILER_BYTES)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {p}: {exc}") from exc
    if h.digest() != trailer:
        raise _corrupt(p)


def load_checkpoint(path: str | Path) -> CheckpointState:
    """Read and verify a checkpoint; tensors are f32 arrays in their canonical order."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            n = f.readinto(buf)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {p}: {exc}") from exc
    if n != len(buf):
        raise _corrupt(p)
    meta_len = _check_header(p, bytes(buf[: HEADER.size]), len(buf))
    body = memoryview(buf)[: len(buf) - TRAILER_BYTES]
    if hashlib.sha256(body).digest() != bytes(buf[len(body) :]):
        raise _corrupt(p)
    try:
        meta = json.loads(bytes(buf[HEADER.size : HEADER.size + meta_len]))
        validate_metadata(meta)
    except (ValueError, MetadataError) as exc:
        raise CheckpointError(
            f"{p} has a hash that verifies but unusable metadata: {exc}; the file was edited "
            "or written by another program: restore it, or resume from another checkpoint"
        ) from None
    try:
        cfg = metadata_config(meta)
        data_start = HEADER.size + meta_len + _pad(HEADER.size + meta_len)
        groups: dict[str, dict[str, F32Array]] = {g: {} for g in _GROUPS}
        for t in meta["tensors"]:
            shape = tuple(int(s) for s in t["shape"])
            start = data_start + int(t["offset"])
            count = int(np.prod(shape, dtype=np.int64))
            if t["dtype"] != "<f4" or start + 4 * count > len(body):
                raise ValueError(f"tensor {t['name']} lies outside the data or is not <f4")
            arr = np.frombuffer(buf, dtype="<f4", count=count, offset=start).reshape(shape)
            groups.setdefault(str(t["group"]), {})[t["name"]] = arr.astype(np.float32, copy=False)
        state = CheckpointState(
            config=cfg,
            step=int(meta["step"]),
            params=groups["params"],
            optimizer={"m": groups["m"], "v": groups["v"], "step": int(meta["optimizer_step"])},
            data_position=int(meta["data_position"]),
            extra=dict(meta["extra"]),
            tensors={g: ts for g, ts in groups.items() if g not in _GROUPS},
        )
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise CheckpointError(f"{p} has a hash that verifies but unusable metadata: {exc}") from exc
    try:  # every tensor the config needs is there, with its shape; moment groups whole
        _file_tensors(state)
    except CheckpointError as exc:
        raise CheckpointError(f"{p} has a hash that verifies but unusable metadata: {exc}") from exc
    return state
