"""Checkpoints in a directory: each saved atomically as ``step-NNNNNN.ckpt``, the newest kept,
damaged ones set aside, the one a run resumes from, and one writer at a time.

A checkpoint (a file as ``checkpoint`` writes it) is written to a temporary file in the same
directory, flushed, fsynced, renamed to ``step-NNNNNN.ckpt`` and the directory fsynced, so
after a crash or a full disk the final name holds either the complete new file or nothing.
The trailing hash catches a file damaged later: ``load_checkpoint`` refuses it and
:func:`latest_checkpoint` falls back to the newest one that verifies.

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
import fcntl
import logging
import os
import re
from pathlib import Path

from foundry.model.formats.checkpoint import (
    CheckpointError,
    CheckpointState,
    encode_checkpoint,
    verify_checkpoint,
)

log = logging.getLogger(__name__)

# Checkpoints kept by default: enough to step back past one bad one, few enough for a Pi's SD.
DEFAULT_KEEP_LAST = 3
_NAME_RE = re.compile(r"^step-(\d+)\.ckpt$")
_TEMP_RE = re.compile(r"^\.step-\d+\.ckpt\.(\d+)\.tmp$")
# A checkpoint that failed to verify is renamed to its name plus this (then .1, .2, ...).
DAMAGED_SUFFIX = ".damaged"
# Names tried when setting a damaged file aside (step-N.ckpt.damaged, .damaged.1, ...).
_ASIDE_TRIES = 1000
LOCK_NAME = "checkpoints.lock"


class CheckpointRefused(CheckpointError):
    """A checkpoint directory a run must not start on (in use, not a folder, nothing in it
    verifies); the message says what to do."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}.ckpt"


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
    encoded = encode_checkpoint(state)

    d = Path(directory)
    final = d / checkpoint_name(state.step)
    tmp = d / f".{final.name}.{os.getpid()}.tmp"
    try:
        d.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(d)
        if final.exists():  # a damaged file of this step is kept, not replaced
            _verify_or_set_aside(final)
        with tmp.open("wb") as f:
            encoded.write(f)
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
        log.warning(
            "checkpoint %s does not verify (%s); kept aside as %s, never counted",
            p,
            why,
            aside.name,
        )
        return aside
    raise CheckpointError(
        f"checkpoint {p} does not verify ({why}) and {_ASIDE_TRIES} damaged "
        "copies of it are kept already; remove some"
    )


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
    olds = [
        p
        for p in d.iterdir()
        if _NAME_RE.match(p.name) or (p.name.startswith("step-") and DAMAGED_SUFFIX in p.name)
    ]
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
    log.warning(
        "--fresh: %d old checkpoint file(s) of %s moved to %s; starting at step 0",
        len(olds),
        d,
        target,
    )
    return target


def check_directory(directory: str | Path) -> Path:
    """``directory`` as a checkpoint folder, created if missing; CheckpointError (said at start,
    not at the first checkpoint) when it is a file or cannot be created."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise CheckpointRefused(
            f"--checkpoint-dir {d} is not a directory; name a folder (it is created if missing)"
        )
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
