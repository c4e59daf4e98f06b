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

A checkpoint is written to a temporary file in the same directory, flushed, fsynced, renamed
to ``step-NNNNNN.ckpt`` and the directory fsynced, so after a crash or a full disk the final
name holds either the complete new file or nothing. The trailing hash catches a file damaged
later: :func:`load_checkpoint` refuses it and :func:`latest_checkpoint` falls back to the
newest one that verifies.

A checkpoint that does not verify is never counted and never silently replaced: pruning keeps
the newest ``keep_last`` that verify (the file just written always among them), and a damaged
file is renamed aside (``step-NNNNNN.ckpt.damaged``, kept for inspection, never deleted)
before a new checkpoint of its step is written or a run resumes past it. A directory whose
checkpoint files all fail to verify is refused at start (:func:`resume_checkpoint`) rather
than trained over from step 0. One process writes a directory at a time: the coordinator and
``foundry train`` hold :class:`DirectoryLock` on it while they run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
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

from foundry.model.formats.tuning import TunedConfig
from foundry.model.spec.config import ConfigError, ModelConfig

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
# A checkpoint that failed to verify is renamed to its name plus this (then .1, .2, ...).
DAMAGED_SUFFIX = ".damaged"
# Names tried when setting a damaged file aside (step-N.ckpt.damaged, .damaged.1, ...).
_ASIDE_TRIES = 1000
LOCK_NAME = "checkpoints.lock"

F32Array = npt.NDArray[np.float32]


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; the message says which file and why."""


class CheckpointRefused(CheckpointError):
    """A checkpoint directory a run must not start on (in use, not a folder, nothing in it
    verifies); the message says what to do."""


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
    clash = [g for g in state.tensors if g in _GROUPS]
    if clash:
        raise CheckpointError(f"tensor groups {clash} are reserved")
    groups: list[tuple[str, Mapping[str, Any]]] = [
        ("params", params), ("m", opt["m"]), ("v", opt["v"]),
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
        **({"tuning": _tuning_meta(cfg)} if isinstance(cfg, TunedConfig) else {}),
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


_TUNING_STRS = ("architecture", "base_sha256")
_TUNING_NUMS = ("lora_alpha", "lora_dropout")


def _tuning_meta(cfg: TunedConfig) -> dict[str, Any]:
    return {
        "architecture": cfg.architecture, "base_bytes": cfg.base_bytes,
        "base_sha256": cfg.base_sha256, "lora_rank": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
        "lora_targets": list(cfg.lora_targets),
        "trainable": [[name, list(shape)] for name, shape in cfg.trainable],
    }


def _validate_tuning(tuning: Mapping[str, Any]) -> None:
    for key in _TUNING_STRS:
        if not isinstance(tuning.get(key), str):
            raise _Bad(f"tuning.{key}", f"must be a string, got {json.dumps(tuning.get(key))}")
    _int(tuning, "base_bytes", "tuning.base_bytes", 0, 2**63 - 1)
    _int(tuning, "lora_rank", "tuning.lora_rank", 0, MAX_DIM)
    for key in _TUNING_NUMS:
        value = tuning.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                value == value and abs(value) != float("inf")):
            raise _Bad(f"tuning.{key}", f"must be a finite number, got {json.dumps(value)}")
    targets = tuning.get("lora_targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise _Bad("tuning.lora_targets", "must be a list of strings")
    table = tuning.get("trainable")
    if not isinstance(table, list) or not table:
        raise _Bad("tuning.trainable", "must be a non-empty list")
    for i, row in enumerate(table):
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)
                and isinstance(row[1], list) and len(row[1]) <= 4):
            raise _Bad(f"tuning.trainable[{i}]", "must be [name, shape]")
        for j, size in enumerate(row[1]):
            _int({"size": size}, "size", f"tuning.trainable[{i}][1][{j}]", 0, MAX_DIM)


def _config(meta: Mapping[str, Any]) -> ModelConfig:
    """The config a checkpoint's metadata holds: a ModelConfig, or a fine-tuning run's
    TunedConfig."""
    tuning = meta.get("tuning")
    if tuning is None:
        return ModelConfig(**meta["config"])
    return TunedConfig(
        **meta["config"], architecture=tuning["architecture"], base_bytes=tuning["base_bytes"],
        base_sha256=tuning["base_sha256"], lora_rank=tuning["lora_rank"],
        lora_alpha=float(tuning["lora_alpha"]), lora_dropout=float(tuning["lora_dropout"]),
        lora_targets=tuple(tuning["lora_targets"]),
        trainable=tuple((name, tuple(int(d) for d in shape))
                        for name, shape in tuning["trainable"]),
    )


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
        if final.exists():  # a damaged file of this step is kept, not replaced
            _verify_or_set_aside(final)
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
    _remember_verified(final)
    prune_checkpoints(d, keep_last, keep=final)
    return final


def _stat_key(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# Files this process wrote or verified, by path, with their stat key then: a file written to
# since (any write changes its ctime) is verified again.
_VERIFIED: dict[Path, tuple[int, int, int, int]] = {}


def _remember_verified(path: Path) -> None:
    with contextlib.suppress(OSError):
        _VERIFIED[path] = _stat_key(path)


def _verified(path: Path) -> None:
    """verify_checkpoint, skipped for a file verified (or written) here and unchanged since."""
    try:
        key = _stat_key(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if _VERIFIED.get(path) == key:
        return
    _VERIFIED.pop(path, None)
    verify_checkpoint(path)
    _VERIFIED[path] = key


def set_aside(path: str | Path, why: str) -> Path:
    """Rename a checkpoint that does not verify to ``NAME.damaged`` (or ``.damaged.N``), out of
    every count and of the way of a new checkpoint of its step; the file is kept."""
    p = Path(path)
    for i in range(_ASIDE_TRIES):
        aside = p.with_name(p.name + DAMAGED_SUFFIX + (f".{i}" if i else ""))
        if aside.exists():
            continue
        try:
            os.rename(p, aside)
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint {p} does not verify ({why}) and cannot be set aside: {exc}"
            ) from exc
        _VERIFIED.pop(p, None)
        log.warning("checkpoint %s does not verify (%s); kept aside as %s, never counted",
                    p, why, aside.name)
        return aside
    raise CheckpointError(f"checkpoint {p} does not verify ({why}) and {_ASIDE_TRIES} damaged "
                          "copies of it are kept already; remove some")


def _verify_or_set_aside(path: Path) -> bool:
    """True if ``path`` verifies; otherwise it is set aside and False."""
    try:
        _verified(path)
    except CheckpointError as exc:
        if not path.exists():
            return False
        set_aside(path, str(exc))
        return False
    return True


def prune_checkpoints(directory: str | Path, keep_last: int, keep: Path | None = None) -> None:
    """Delete all but the newest ``keep_last`` checkpoints that verify (``keep``, the file just
    written, is never deleted). Only a checkpoint that verifies counts; one that does not is set
    aside, never deleted."""
    counted = 0
    for _, p in reversed(list_checkpoints(directory)):
        if p != keep and not _verify_or_set_aside(p):
            continue
        counted += 1
        if counted > keep_last and p != keep:
            p.unlink(missing_ok=True)
            _VERIFIED.pop(p, None)


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


# Metadata limits: the step travels as a u32 on the wire (REGISTER_ACK's global_step); a
# size beyond these is not a model this code can hold, whatever the file says.
MAX_STEP = 0xFFFFFFFF
MAX_DIM = 1 << 24
MAX_CTX = 1 << 20
# Settings of ``extra`` the code reads back, and what each must be.
_EXTRA_INTS = {"sync_every": 1, "outer_steps": 0}  # name -> least value
_EXTRA_STRS = ("compression", "down_compression", "downlink_rng")


class _Bad(Exception):
    """One metadata field that does not fit the schema: its dotted name and why."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"metadata field {name!r} {why}")


def _int(meta: Mapping[str, Any], key: str, name: str, low: int, high: int) -> int:
    if key not in meta:
        raise _Bad(name, "is missing")
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(name, f"must be an integer in [{low}, {high}], got {json.dumps(value)}")
    if not low <= value <= high:
        raise _Bad(name, f"must be in [{low}, {high}], got {value}")
    return value


def _object(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(name, f"must be a JSON object, got {json.dumps(value)[:80]}")
    return value


def validate_metadata(meta: Any) -> None:
    """Check a checkpoint's metadata against its schema (module docstring) before anything
    reads it; raises _Bad naming the first field that does not fit."""
    top = _object(meta, "(metadata)")
    if top.get("format") != "foundry-checkpoint":
        raise _Bad("format", f"must be \"foundry-checkpoint\", got {json.dumps(top.get('format'))}")
    _int(top, "step", "step", 0, MAX_STEP)
    _int(top, "data_position", "data_position", 0, 2**63 - 1)
    _int(top, "optimizer_step", "optimizer_step", 0, 2**63 - 1)
    config = _object(top.get("config"), "config")
    known = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for key, value in config.items():
        if key not in known:
            raise _Bad(f"config.{key}", "is not a ModelConfig field")
        if known[key].type in ("float", float):
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    value == value and abs(value) != float("inf")):
                raise _Bad(f"config.{key}", f"must be a finite number, got {json.dumps(value)}")
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
            raise _Bad(f"extra.{key}", f"must be a string, got {json.dumps(extra[key])}")
    tensors = top.get("tensors")
    if not isinstance(tensors, list):
        raise _Bad("tensors", f"must be a list, got {json.dumps(tensors)[:80]}")
    for i, t in enumerate(tensors):
        where = f"tensors[{i}]"
        entry = _object(t, where)
        for key in ("group", "name"):
            if not isinstance(entry.get(key), str):
                raise _Bad(f"{where}.{key}", f"must be a string, got {json.dumps(entry.get(key))}")
        shape = entry.get("shape")
        if not isinstance(shape, list) or len(shape) > 4:
            raise _Bad(f"{where}.shape", f"must be a list of at most 4 sizes, got {shape!r}")
        for j, size in enumerate(shape):
            _int({"size": size}, "size", f"{where}.shape[{j}]", 0, MAX_DIM)
        if entry.get("dtype") != "<f4":
            raise _Bad(f"{where}.dtype", f"must be \"<f4\", got {json.dumps(entry.get('dtype'))}")
        _int(entry, "offset", f"{where}.offset", 0, 2**63 - 1)
        nbytes = _int(entry, "nbytes", f"{where}.nbytes", 0, 2**63 - 1)
        if nbytes != 4 * int(np.prod(shape, dtype=np.int64)):
            raise _Bad(f"{where}.nbytes", f"is {nbytes}, but shape {shape} holds "
                       f"{4 * int(np.prod(shape, dtype=np.int64))} bytes of <f4")


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
    except (ValueError, _Bad) as exc:
        raise CheckpointError(
            f"{p} has a hash that verifies but unusable metadata: {exc}; the file was edited "
            "or written by another program: restore it, or resume from another checkpoint"
        ) from None
    try:
        cfg = _config(meta)
        data_start = HEADER.size + meta_len + _pad(HEADER.size + meta_len)
        groups: dict[str, dict[str, F32Array]] = {g: {} for g in _GROUPS}
        for t in meta["tensors"]:
            shape = tuple(int(s) for s in t["shape"])
            start = data_start + int(t["offset"])
            count = int(np.prod(shape, dtype=np.int64))
            if t["dtype"] != "<f4" or start + 4 * count > len(body):
                raise ValueError(f"tensor {t['name']} lies outside the data or is not <f4")
            arr = np.frombuffer(buf, dtype="<f4", count=count, offset=start).reshape(shape)
            groups.setdefault(str(t["group"]), {})[t["name"]] = arr.astype(
                np.float32, copy=False
            )
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


def resume_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint a run in ``directory`` resumes from: the newest that verifies, any newer
    damaged ones set aside first (so the run's own checkpoints of those steps never replace
    them); None when there are no checkpoint files. Raises CheckpointError when there are
    checkpoint files and none verifies: starting again from step 0 over them is the
    operator's decision (``--fresh``), never a silent one."""
    found = list_checkpoints(directory)
    damaged: list[tuple[Path, str]] = []
    for _, p in reversed(found):
        try:
            _verified(p)
        except CheckpointError as exc:
            damaged.append((p, str(exc)))
            continue
        for bad, why in damaged:
            set_aside(bad, why)
        return p
    if damaged:
        names = "; ".join(f"{p.name}: {why}" for p, why in damaged)
        raise CheckpointRefused(
            f"no checkpoint in {directory} verifies ({len(damaged)} file(s): {names}); refusing "
            "to start over them from step 0. Move them away (or restore a good copy), or pass "
            "--fresh to set them aside and start a new run"
        )
    return None


def start_fresh(directory: str | Path) -> Path | None:
    """``--fresh``: move every checkpoint of ``directory`` (damaged ones included) into a new
    folder ``previous-N`` inside it, so a new run starts at step 0 and nothing is deleted.
    Returns that folder, or None when there was nothing to move."""
    d = Path(directory)
    if not d.is_dir():
        return None
    olds = [p for p in d.iterdir()
            if _NAME_RE.match(p.name) or (p.name.startswith("step-") and DAMAGED_SUFFIX in p.name)]
    if not olds:
        return None
    for i in range(1, _ASIDE_TRIES):
        target = d / f"previous-{i}"
        try:
            target.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise CheckpointError(f"cannot set the old checkpoints of {d} aside: {exc}") from exc
        break
    else:
        raise CheckpointError(f"{d} holds {_ASIDE_TRIES} previous-N folders already; remove some")
    try:
        for p in olds:
            os.rename(p, target / p.name)
            _VERIFIED.pop(p, None)
    except OSError as exc:
        raise CheckpointError(f"cannot set the old checkpoints of {d} aside: {exc}") from exc
    log.warning("--fresh: %d old checkpoint file(s) of %s moved to %s; starting at step 0",
                len(olds), d, target)
    return target


def check_directory(directory: str | Path) -> Path:
    """``directory`` as a checkpoint folder, created if missing; CheckpointError (said at start,
    not at the first checkpoint) when it is a file or cannot be created."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise CheckpointRefused(f"--checkpoint-dir {d} is not a directory; name a folder (it is "
                              "created if missing)")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create --checkpoint-dir {d}: {exc}") from exc
    return d


class DirectoryLock:
    """One writer per checkpoint directory: an exclusive ``flock`` on the directory itself
    (so a read-only directory can be locked too, and its first checkpoint then fails with the
    disk's own error), the holder's pid and name in ``D/checkpoints.lock`` where it can be
    written. The kernel drops the lock when the holder exits, however it exits, so a stale
    file never blocks."""

    def __init__(self, directory: str | Path, holder: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.holder = holder
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise CheckpointError(f"cannot lock checkpoint dir {self.directory}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = self.path.read_text(errors="replace").strip()[:200] or "pid unknown"
            except OSError:
                holder = "pid unknown"
            raise CheckpointRefused(
                f"checkpoint dir {self.directory} is in use by another writer ({holder}); "
                "stop that one first, or give this run its own --checkpoint-dir"
            ) from None
        with contextlib.suppress(OSError):  # a read-only or full disk: the lock still holds
            self.path.write_text(f"pid {os.getpid()}, {self.holder}\n")
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
