"""Checkpoint directories: one writer per directory, the lock naming its holder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from foundry.model.formats.checkpoint import CheckpointError
from foundry.model.formats.checkpoint_dir import CheckpointRefused, DirectoryLock


def test_one_lock_per_directory_naming_its_holder(tmp_path: Path) -> None:
    """flock locks belong to an open file: a second lock refuses even in the same process."""
    first = DirectoryLock(tmp_path, "foundry train")
    assert first.acquire() is first
    assert (tmp_path / "checkpoints.lock").read_text() == f"pid {os.getpid()}, foundry train\n"
    assert first._fd is not None and not os.get_inheritable(first._fd)
    second = DirectoryLock(tmp_path, "foundry coordinator")
    with pytest.raises(CheckpointRefused) as exc:
        second.acquire()
    assert str(exc.value) == (
        f"checkpoint dir {tmp_path} is in use by another writer (pid {os.getpid()}, foundry "
        "train); stop that one first, or give this run its own --checkpoint-dir"
    )
    assert second._fd is None
    first.release()
    first.release()  # twice is fine
    assert second.acquire() is second
    assert (tmp_path / "checkpoints.lock").read_text() == (
        f"pid {os.getpid()}, foundry coordinator\n"
    )
    second.release()


@pytest.mark.parametrize(
    ("content", "shown"),
    [
        (None, "pid unknown"),
        ("", "pid unknown"),
        ("  \n", "pid unknown"),
        ("x" * 300, "x" * 200),
        (b"pid 7, \xff\n", "pid 7, \ufffd"),
    ],
)
def test_a_lock_whose_holder_cannot_be_read_says_so(
    tmp_path: Path, content: str | bytes | None, shown: str
) -> None:
    first = DirectoryLock(tmp_path, "first").acquire()
    lock_file = tmp_path / "checkpoints.lock"
    lock_file.unlink()
    if isinstance(content, str):
        lock_file.write_text(content)
    elif isinstance(content, bytes):
        lock_file.write_bytes(content)
    with pytest.raises(CheckpointRefused) as exc:
        DirectoryLock(tmp_path, "second").acquire()
    assert f"is in use by another writer ({shown}); stop" in str(exc.value)
    first.release()


def test_a_lock_holds_where_its_file_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "checkpoints.lock").mkdir()  # neither writable nor readable as a file
    first = DirectoryLock(tmp_path, "first").acquire()
    with pytest.raises(CheckpointRefused, match=r"another writer \(pid unknown\)"):
        DirectoryLock(tmp_path, "second").acquire()
    first.release()
    DirectoryLock(tmp_path, "third").acquire().release()


def test_a_lock_needs_a_directory(tmp_path: Path) -> None:
    for path, why in (
        (tmp_path / "missing", "[Errno 2] No such file or directory"),
        (tmp_path / "afile", "[Errno 20] Not a directory"),
    ):
        if path.name == "afile":
            path.write_text("x")
        with pytest.raises(CheckpointError) as exc:
            DirectoryLock(path, "train").acquire()
        assert type(exc.value) is CheckpointError
        assert str(exc.value) == f"cannot lock checkpoint dir {path}: {why}: '{path}'"
