"""Atomic training checkpoints: weights, AdamW state, global step and data position.

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

The metadata holds ``config`` (the ModelConfig fields), ``step``, ``data_position`` (the next
global sample index), ``optimizer_step``, ``extra`` (small JSON settings of the run, e.g.
compression and learning-rate schedule) and ``tensors``: a list of ``{group, name, shape,
dtype, offset, nbytes}`` with ``group`` one of ``params`` / ``m`` / ``v`` and ``offset``
relative to D. Parameters come in the canonical order of :meth:`ModelConfig.param_shapes`,
then the AdamW first and second moments.

A checkpoint is written to a temporary file in the same directory, flushed, fsynced, renamed
to ``step-NNNNNN.ckpt`` and the directory fsynced, so after a crash or a full disk the final
name holds either the complete new file or nothing. The trailing hash catches a file damaged
later: :func:`load_checkpoint` refuses it and :func:`latest_checkpoint` falls back to the
newest one that verifies. One process writes a directory at a time (the coordinator, or one
``foundry train``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypedDict

import numpy as np
import numpy.typing as npt

from foundry.model.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

MAGIC = b"FDRYCKPT"
VERSION = 1
HEADER = struct.Struct("<8sIIQ")  # magic, version, reserved, metadata length
TRAILER_BYTES = hashlib.sha256().digest_size
# Tensor data alignment: whole cache lines, and any numpy dtype can view it in place.
ALIGN = 64
# Checkpoints kept by default: enough to step back past one bad one, few enough for a Pi's SD.
DEFAULT_KEEP_LAST = 3
# Bytes hashed per read when verifying without loading.
_CHUNK = 1 << 20
_GROUPS = ("params", "m", "v")
_NAME_RE = re.compile(r"^step-(\d+)\.ckpt$")
_TEMP_RE = re.compile(r"^\.step-\d+\.ckpt\.(\d+)\.tmp$")

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


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}.ckpt"


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
    groups: list[tuple[str, Mapping[str, Any]]] = [
        ("params", params), ("m", opt["m"]), ("v", opt["v"])
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
    return out


def _metadata(state: CheckpointState, index: list[dict[str, Any]]) -> bytes:
    if state.step < 0 or state.data_position < 0:
        raise CheckpointError(
            f"step and data_position must be >= 0, got {state.step}, {state.data_position}"
        )
    meta = {
        "format": "foundry-checkpoint",
        "config": dataclasses.asdict(state.config),
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


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temps(directory: Path) -> None:
    """Delete temp files of writers that died mid-write (they only take disk space)."""
    for p in directory.iterdir():
        m = _TEMP_RE.match(p.name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid <= 0:
            continue
        try:
            os.kill(pid, 0)
            alive = pid != os.getpid()
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            p.unlink(missing_ok=True)


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-*.ckpt`` in ``directory``, oldest first; [] if none."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME_RE.match(p.name)
        if m is not None and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(
    directory: str | Path, state: CheckpointState, keep_last: int = DEFAULT_KEEP_LAST
) -> Path:
    """Write ``state`` atomically as ``directory/step-NNNNNN.ckpt``; keep the newest ``keep_last``.

    Raises CheckpointError (the previous checkpoints untouched, no temp file left) when the
    state does not fit its config or the disk refuses the write.
    """
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    tensors = _file_tensors(state)
    index: list[dict[str, Any]] = []
    offset = 0
    for group, name, arr in tensors:
        index.append(
            {"group": group, "name": name, "shape": list(arr.shape), "dtype": "<f4",
             "offset": offset, "nbytes": arr.nbytes}
        )
        offset += arr.nbytes + _pad(arr.nbytes)
    meta = _metadata(state, index)

    d = Path(directory)
    final = d / checkpoint_name(state.step)
    tmp = d / f".{final.name}.{os.getpid()}.tmp"
    try:
        d.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(d)
        h = hashlib.sha256()
        with tmp.open("wb") as f:
            _write(f, h, HEADER.pack(MAGIC, VERSION, 0, len(meta)))
            _write(f, h, meta)
            _write(f, h, bytes(_pad(HEADER.size + len(meta))))
            for _, _, arr in tensors:
                _write(f, h, arr.reshape(-1).view(np.uint8).data)
                _write(f, h, bytes(_pad(arr.nbytes)))
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        # On a read-only file system even removing the (absent) temp file fails: the error
        # worth telling is the first one.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"could not write checkpoint {final}: {exc}; the previous checkpoints are intact "
            "(free disk space or choose another checkpoint directory)"
        ) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        _fsync_dir(d)
    except OSError as exc:
        log.warning("checkpoint %s written but its directory could not be synced: %s", final, exc)
    for _, old in list_checkpoints(d)[:-keep_last]:
        old.unlink(missing_ok=True)
    return final


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
        cfg = ModelConfig(**meta["config"])
        data_start = HEADER.size + meta_len + _pad(HEADER.size + meta_len)
        groups: dict[str, dict[str, F32Array]] = {g: {} for g in _GROUPS}
        for t in meta["tensors"]:
            shape = tuple(int(s) for s in t["shape"])
            start = data_start + int(t["offset"])
            count = int(np.prod(shape, dtype=np.int64))
            if t["dtype"] != "<f4" or start + 4 * count > len(body):
                raise ValueError(f"tensor {t['name']} lies outside the data or is not <f4")
            arr = np.frombuffer(buf, dtype="<f4", count=count, offset=start).reshape(shape)
            groups[t["group"]][t["name"]] = arr.astype(np.float32, copy=False)
        state = CheckpointState(
            config=cfg,
            step=int(meta["step"]),
            params=groups["params"],
            optimizer={"m": groups["m"], "v": groups["v"], "step": int(meta["optimizer_step"])},
            data_position=int(meta["data_position"]),
            extra=dict(meta["extra"]),
        )
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise CheckpointError(f"{p} has a hash that verifies but unusable metadata: {exc}") from exc
    _file_tensors(state)  # every tensor the config needs is there, with its shape
    return state


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint in ``directory`` that verifies; damaged ones are skipped."""
    for step, p in reversed(list_checkpoints(directory)):
        try:
            verify_checkpoint(p)
        except CheckpointError as exc:
            log.warning("skipping checkpoint of step %d: %s", step, exc)
            continue
        return p
    return None
