"""Checkpoint writes: atomic (a full disk, a failed or interrupted write), temp files cleaned up."""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import sys
from pathlib import Path

import pytest
from checkpoint_states import assert_same, make_state

from foundry.model.formats import checkpoint_dir as ckpt_dir
from foundry.model.formats.checkpoint import CheckpointError, load_checkpoint
from foundry.model.formats.checkpoint_dir import latest_checkpoint, save_checkpoint


def test_full_disk_at_fsync_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = save_checkpoint(tmp_path, make_state(step=10))
    before = good.read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(
        CheckpointError,
        match=r"step-000011\.ckpt.*No space left on device.*"
        r"\(free disk space or choose another checkpoint directory\)$",
    ):
        save_checkpoint(tmp_path, make_state(step=11, seed=9))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["step-000010.ckpt"]  # no temp file, no partial file
    assert good.read_bytes() == before
    assert latest_checkpoint(tmp_path) == good


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE semantics are Linux's")
def test_real_write_failure_leaves_no_partial_file(tmp_path: Path) -> None:
    good = save_checkpoint(tmp_path, make_state(step=1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (good.stat().st_size // 2, hard))
    try:
        with pytest.raises(CheckpointError, match="could not write checkpoint"):
            save_checkpoint(tmp_path, make_state(step=2))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert os.listdir(tmp_path) == ["step-000001.ckpt"]
    assert_same(load_checkpoint(good), make_state(step=1))


def test_interrupted_write_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(src: object, dst: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, make_state())
    assert os.listdir(tmp_path) == []


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / ".step-000007.ckpt.999999999.tmp"  # above any pid_max
    dead.write_bytes(b"half a checkpoint")
    alive = tmp_path / f".step-000007.ckpt.{os.getppid()}.tmp"
    alive.write_bytes(b"being written")
    save_checkpoint(tmp_path, make_state(step=8))
    assert not dead.exists()
    assert alive.exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000008.ckpt"


def test_interrupt_before_the_temp_file_exists_is_passed_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(directory: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_dir, "_remove_stale_temps", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, make_state())
    assert os.listdir(tmp_path) == []


def test_stale_temps_among_other_files(tmp_path: Path) -> None:
    """Other files and a temp file naming pid 0 do not stop the clean-up of the dead ones."""
    for i in range(8):
        (tmp_path / f"notes-{i}.txt").write_text("kept")
        (tmp_path / f".step-00000{i}.ckpt.0.tmp").write_text("pid 0: kept")
    dead = [tmp_path / f".step-00001{i}.ckpt.99999999{i}.tmp" for i in range(8)]
    for p in dead:
        p.write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path, make_state(step=30))
    assert not any(p.exists() for p in dead)
    assert len(os.listdir(tmp_path)) == 17


def test_a_directory_that_cannot_be_synced_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The file is already renamed into place: the checkpoint stands, the failure is logged."""

    def refuse(directory: Path) -> None:
        raise OSError(errno.EIO, "directory sync refused")

    monkeypatch.setattr(ckpt_dir, "_fsync_dir", refuse)
    with caplog.at_level(logging.WARNING, logger="foundry.model.formats.checkpoint_dir"):
        path = save_checkpoint(tmp_path, make_state())
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {path} written but its directory could not be synced: "
        "[Errno 5] directory sync refused"
    ]
    assert_same(load_checkpoint(path), make_state())


def test_a_failed_write_on_a_disk_that_refuses_the_clean_up_reports_the_first_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing the temp file fails too (a file system gone read-only): the write's error is
    the one reported, and the previous checkpoints stand."""
    good = save_checkpoint(tmp_path, make_state(step=10))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "fsync", full)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(CheckpointError) as exc:
        save_checkpoint(tmp_path, make_state(step=11))
    monkeypatch.undo()
    final = tmp_path / "step-000011.ckpt"
    assert str(exc.value) == (
        f"could not write checkpoint {final}: [Errno 28] No space left on device; the previous "
        "checkpoints are intact (free disk space or choose another checkpoint directory)"
    )
    assert sorted(os.listdir(tmp_path)) == [f".{final.name}.{os.getpid()}.tmp", good.name]
    assert latest_checkpoint(tmp_path) == good


def test_temp_files_of_writers_that_cannot_be_signalled_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's writer (os.kill says PermissionError) lives: its temp file stays."""

    def kill(pid: int, sig: int) -> None:  # no signal is sent
        assert sig == 0
        if pid == 424242:
            raise PermissionError(errno.EPERM, "not ours")
        raise ProcessLookupError(errno.ESRCH, "no such process")

    other = tmp_path / ".step-000001.ckpt.424242.tmp"
    dead = tmp_path / ".step-000002.ckpt.424243.tmp"
    for p in (other, dead):
        p.write_text("half")
    monkeypatch.setattr(os, "kill", kill)
    ckpt_dir._remove_stale_temps(tmp_path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [other.name]
