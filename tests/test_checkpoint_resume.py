"""Checkpoint directories at resume: damaged files set aside, --fresh, the directory checked."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
from checkpoint_states import assert_same, corrupt_why, damage, make_state, save_steps

from foundry.model.formats import checkpoint_dir as ckpt_dir
from foundry.model.formats.checkpoint import CheckpointError, load_checkpoint
from foundry.model.formats.checkpoint_dir import (
    CheckpointRefused,
    check_directory,
    resume_checkpoint,
    save_checkpoint,
    start_fresh,
)


def test_resume_sets_aside_only_the_damaged_ones_newer_than_the_newest_good_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert resume_checkpoint(tmp_path / "missing") is None
    assert resume_checkpoint(tmp_path) is None
    save_steps(tmp_path, 1, 2, 3, 4, 5)
    assert resume_checkpoint(tmp_path) == tmp_path / "step-000005.ckpt"
    bad5 = damage(tmp_path / "step-000005.ckpt")
    bad4 = damage(tmp_path / "step-000004.ckpt", "empty")
    bad2 = damage(tmp_path / "step-000002.ckpt")
    with caplog.at_level(logging.WARNING, logger="foundry.model.formats.checkpoint_dir"):
        assert resume_checkpoint(tmp_path) == tmp_path / "step-000003.ckpt"
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {tmp_path / 'step-000005.ckpt'} does not verify "
        f"({corrupt_why(tmp_path / 'step-000005.ckpt')}); kept aside as "
        "step-000005.ckpt.damaged, never counted",
        f"checkpoint {tmp_path / 'step-000004.ckpt'} does not verify "
        f"({tmp_path / 'step-000004.ckpt'} is truncated (0 bytes)); kept aside as "
        "step-000004.ckpt.damaged, never counted",
    ]
    assert sorted(os.listdir(tmp_path)) == [
        "step-000001.ckpt",
        "step-000002.ckpt",
        "step-000003.ckpt",
        "step-000004.ckpt.damaged",
        "step-000005.ckpt.damaged",
    ]
    assert (tmp_path / "step-000005.ckpt.damaged").read_bytes() == bad5
    assert (tmp_path / "step-000004.ckpt.damaged").read_bytes() == bad4
    assert (tmp_path / "step-000002.ckpt").read_bytes() == bad2  # older: left as it is


def test_resume_refuses_a_directory_where_nothing_verifies(tmp_path: Path) -> None:
    save_steps(tmp_path, 1, 2)
    damage(tmp_path / "step-000001.ckpt")
    damage(tmp_path / "step-000002.ckpt", "empty")
    with pytest.raises(CheckpointRefused) as exc:
        resume_checkpoint(tmp_path)
    assert str(exc.value) == (
        f"no checkpoint in {tmp_path} verifies (2 file(s): step-000002.ckpt: "
        f"{tmp_path / 'step-000002.ckpt'} is truncated (0 bytes); step-000001.ckpt: "
        f"{corrupt_why(tmp_path / 'step-000001.ckpt')}); refusing to start over them from "
        "step 0. Move them away (or restore a good copy), or pass --fresh to set them aside "
        "and start a new run"
    )
    assert sorted(os.listdir(tmp_path)) == ["step-000001.ckpt", "step-000002.ckpt"]
    # Files that failed are forgotten, and so are files that are gone.
    assert not any(p.parent == tmp_path for p in ckpt_dir._VERIFIED)
    with pytest.raises(CheckpointError) as gone:
        ckpt_dir._verified(tmp_path / "step-000009.ckpt")
    assert str(gone.value) == (
        f"cannot read checkpoint {tmp_path / 'step-000009.ckpt'}: [Errno 2] "
        f"No such file or directory: '{tmp_path / 'step-000009.ckpt'}'"
    )


def test_resume_verifies_files_this_process_has_not_seen(tmp_path: Path) -> None:
    """Checkpoints copied in (or written by an earlier run) are read once, then remembered."""
    written = save_checkpoint(tmp_path / "a", make_state(step=4))
    (tmp_path / "b").mkdir()
    copy = tmp_path / "b" / written.name
    copy.write_bytes(written.read_bytes())
    assert copy not in ckpt_dir._VERIFIED
    assert resume_checkpoint(tmp_path / "b") == copy
    assert ckpt_dir._VERIFIED[copy] == ckpt_dir._stat_key(copy)
    damage(copy)
    with pytest.raises(CheckpointRefused):
        resume_checkpoint(tmp_path / "b")
    assert copy not in ckpt_dir._VERIFIED


def test_a_checkpoint_whose_stat_fails_after_the_write_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It is not remembered as verified (it is read when next needed) and the save succeeds."""

    def refuse(path: Path) -> tuple[int, int, int, int]:
        raise OSError(errno.EIO, "stat refused")

    monkeypatch.setattr(ckpt_dir, "_stat_key", refuse)
    path = save_checkpoint(tmp_path, make_state(step=2))
    monkeypatch.undo()
    assert path not in ckpt_dir._VERIFIED
    assert_same(load_checkpoint(path), make_state(step=2))


def test_fresh_moves_every_checkpoint_file_into_a_new_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert start_fresh(tmp_path / "missing") is None
    others = [
        "checkpoints.lock",
        "notes.txt",
        "step-000001.ckpt.bak",
        "step-notes.txt",
        "xstep-000001.ckpt.damaged",
        f".step-000004.ckpt.{os.getppid()}.tmp",
    ]
    for name in others:
        (tmp_path / name).write_text(name)
    assert start_fresh(tmp_path) is None  # nothing to move: no folder made
    assert sorted(os.listdir(tmp_path)) == sorted(others)
    save_steps(tmp_path, 1, 2)
    (tmp_path / "step-000003.ckpt.damaged").write_text("3")
    (tmp_path / "step-000003.ckpt.damaged.1").write_text("3.1")
    with caplog.at_level(logging.WARNING, logger="foundry.model.formats.checkpoint_dir"):
        moved = start_fresh(tmp_path)
    assert moved == tmp_path / "previous-1"
    assert sorted(os.listdir(moved)) == [
        "step-000001.ckpt",
        "step-000002.ckpt",
        "step-000003.ckpt.damaged",
        "step-000003.ckpt.damaged.1",
    ]
    assert sorted(os.listdir(tmp_path)) == sorted([*others, "previous-1"])
    assert [r.getMessage() for r in caplog.records] == [
        f"--fresh: 4 old checkpoint file(s) of {tmp_path} moved to {moved}; starting at step 0"
    ]
    assert not any(p.parent == tmp_path for p in ckpt_dir._VERIFIED)
    assert resume_checkpoint(tmp_path) is None
    save_steps(tmp_path, 1)
    assert start_fresh(tmp_path) == tmp_path / "previous-2"
    assert os.listdir(tmp_path / "previous-2") == ["step-000001.ckpt"]
    assert_same(load_checkpoint(moved / "step-000001.ckpt"), make_state(step=1, seed=1))


def test_fresh_refuses_when_it_cannot_move_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_steps(tmp_path, 1)
    monkeypatch.setattr(ckpt_dir, "_ASIDE_TRIES", 3)
    (tmp_path / "previous-1").mkdir()
    (tmp_path / "previous-2").write_text("a file of that name")
    with pytest.raises(CheckpointError) as exc:
        start_fresh(tmp_path)
    assert str(exc.value) == f"{tmp_path} holds 3 previous-N folders already; remove some"
    monkeypatch.setattr(ckpt_dir, "_ASIDE_TRIES", 4)

    def refuse(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(CheckpointError) as exc:
        start_fresh(tmp_path)
    assert str(exc.value) == (
        f"cannot set the old checkpoints of {tmp_path} aside: [Errno 18] Invalid cross-device link"
    )
    monkeypatch.undo()

    def read_only(
        self: Path, mode: int = 0o777, parents: bool = False, exist_ok: bool = False
    ) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(CheckpointError) as exc:
        start_fresh(tmp_path)
    assert str(exc.value) == (
        f"cannot set the old checkpoints of {tmp_path} aside: [Errno 30] Read-only file system"
    )
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [
        "previous-1",
        "previous-2",
        "previous-3",
        "step-000001.ckpt",
    ]


def test_check_directory(tmp_path: Path) -> None:
    d = tmp_path / "a" / "b"
    assert check_directory(d) == d and d.is_dir()
    assert check_directory(d) == d
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointRefused) as refused:
        check_directory(afile)
    assert str(refused.value) == (
        f"--checkpoint-dir {afile} is not a directory; name a folder (it is created if missing)"
    )
    with pytest.raises(CheckpointError) as exc:
        check_directory(afile / "sub")
    assert type(exc.value) is CheckpointError
    assert str(exc.value) == (
        f"cannot create --checkpoint-dir {afile / 'sub'}: [Errno 20] Not a "
        f"directory: '{afile / 'sub'}'"
    )
    assert afile.read_text() == "x"
