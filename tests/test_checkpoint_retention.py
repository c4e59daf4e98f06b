"""Checkpoint directories: the newest that verifies, keep-last pruning, damaged files set aside."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from checkpoint_states import assert_same, corrupt_why, damage, flip_byte, make_state, save_steps

from foundry.model.formats import checkpoint as ckpt
from foundry.model.formats import checkpoint_dir as ckpt_dir
from foundry.model.formats.checkpoint import CheckpointError, load_checkpoint
from foundry.model.formats.checkpoint_dir import (
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    resume_checkpoint,
    save_checkpoint,
    set_aside,
)


def test_latest_skips_a_corrupt_newest_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (5, 10, 20):
        save_checkpoint(tmp_path, make_state(step=step, seed=step))
    newest = tmp_path / "step-000020.ckpt"
    flip_byte(newest, 200)
    with caplog.at_level(logging.WARNING, logger="foundry.model.formats.checkpoint_dir"):
        found = latest_checkpoint(tmp_path)
    assert found == tmp_path / "step-000010.ckpt"
    assert "skipping checkpoint of step 20" in caplog.text
    assert f"{newest} is corrupt or truncated" in caplog.text
    assert caplog.records[0].getMessage().startswith("skipping checkpoint of step 20: ")
    assert load_checkpoint(found).step == 10


def test_latest_checkpoint_orders_by_step_not_name(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, make_state(step=999_999))
    save_checkpoint(tmp_path, make_state(step=1_000_000))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1000000.ckpt"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [999_999, 1_000_000]


def test_keep_last_k(tmp_path: Path) -> None:
    for step in range(1, 6):
        save_checkpoint(tmp_path, make_state(step=step), keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-000004.ckpt", "step-000005.ckpt"]
    with pytest.raises(CheckpointError, match="keep_last"):
        save_checkpoint(tmp_path, make_state(step=6), keep_last=0)


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_state(step=3, seed=1))
    save_checkpoint(tmp_path, make_state(step=3, seed=2))
    assert_same(load_checkpoint(tmp_path / "step-000003.ckpt"), make_state(step=3, seed=2))


def test_pruning_counts_only_checkpoints_that_verify(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_steps(tmp_path, 1, 2, 3, 4, 5, 6)
    bad5 = damage(tmp_path / "step-000005.ckpt")
    bad3 = damage(tmp_path / "step-000003.ckpt", "truncate")
    with caplog.at_level(logging.WARNING, logger="foundry.model.formats.checkpoint_dir"):
        prune_checkpoints(tmp_path, 2)
    assert sorted(os.listdir(tmp_path)) == [
        "step-000003.ckpt.damaged",
        "step-000004.ckpt",
        "step-000005.ckpt.damaged",
        "step-000006.ckpt",
    ]
    assert (tmp_path / "step-000005.ckpt.damaged").read_bytes() == bad5
    assert (tmp_path / "step-000003.ckpt.damaged").read_bytes() == bad3
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {tmp_path / 'step-000005.ckpt'} does not verify "
        f"({corrupt_why(tmp_path / 'step-000005.ckpt')}); kept aside as "
        "step-000005.ckpt.damaged, never counted",
        f"checkpoint {tmp_path / 'step-000003.ckpt'} does not verify "
        f"({tmp_path / 'step-000003.ckpt'} is truncated (100 bytes, metadata alone "
        f"{ckpt.HEADER.unpack_from(bad3)[3]})); kept aside as step-000003.ckpt.damaged, "
        "never counted",
    ]
    deleted = [tmp_path / f"step-00000{s}.ckpt" for s in (1, 2, 3, 5)]
    assert not any(p in ckpt_dir._VERIFIED for p in deleted)  # no memory of files gone
    prune_checkpoints(tmp_path, 1)
    assert sorted(os.listdir(tmp_path)) == [
        "step-000003.ckpt.damaged",
        "step-000005.ckpt.damaged",
        "step-000006.ckpt",
    ]
    prune_checkpoints(tmp_path, 1)  # nothing more to do
    assert sorted(os.listdir(tmp_path)) == [
        "step-000003.ckpt.damaged",
        "step-000005.ckpt.damaged",
        "step-000006.ckpt",
    ]


def test_pruning_never_deletes_the_file_just_written(tmp_path: Path) -> None:
    """``keep`` counts among the kept, unread, even when older than the others: a run that
    went back to an older step keeps its own newest checkpoint."""
    save_steps(tmp_path, 5, 6, 7)
    save_checkpoint(tmp_path, make_state(step=3), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 6, 7]
    keep = tmp_path / "step-000003.ckpt"
    damage(keep)
    prune_checkpoints(tmp_path, 1, keep=keep)
    assert sorted(os.listdir(tmp_path)) == ["step-000003.ckpt", "step-000007.ckpt"]
    prune_checkpoints(tmp_path, 1, keep=tmp_path / "step-000007.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["step-000003.ckpt.damaged", "step-000007.ckpt"]


def test_files_written_or_verified_here_are_not_read_again_unless_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[str] = []
    real = ckpt.verify_checkpoint

    def counting(path: str | Path) -> None:
        read.append(Path(path).name)
        real(path)

    monkeypatch.setattr(ckpt_dir, "verify_checkpoint", counting)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, make_state(step=step), keep_last=2)
    assert read == []  # every file was written here
    newest = tmp_path / "step-000004.ckpt"
    st = newest.stat()
    os.utime(newest, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # changed: read again
    prune_checkpoints(tmp_path, 2)
    assert read == ["step-000004.ckpt"]
    prune_checkpoints(tmp_path, 2)
    assert resume_checkpoint(tmp_path) == newest
    assert read == ["step-000004.ckpt"]  # verified once, remembered
    damage(newest)
    assert resume_checkpoint(tmp_path) == tmp_path / "step-000003.ckpt"
    assert read == ["step-000004.ckpt", "step-000004.ckpt"]
    assert sorted(os.listdir(tmp_path)) == ["step-000003.ckpt", "step-000004.ckpt.damaged"]


def test_a_damaged_file_is_set_aside_under_a_free_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "step-000003.ckpt"
    bad = []
    for i in range(3):
        save_checkpoint(tmp_path, make_state(step=3, seed=i))
        assert path in ckpt_dir._VERIFIED
        bad.append(damage(path))
        with caplog.at_level(logging.WARNING, logger="foundry.model.formats.checkpoint_dir"):
            aside = set_aside(path, f"reason {i}")
        name = "step-000003.ckpt.damaged" + (f".{i}" if i else "")
        assert aside == tmp_path / name
        assert caplog.records[-1].getMessage() == (
            f"checkpoint {path} does not verify (reason {i}); kept aside as {name}, never counted"
        )
        assert path not in ckpt_dir._VERIFIED
    assert sorted(os.listdir(tmp_path)) == [
        "step-000003.ckpt.damaged",
        "step-000003.ckpt.damaged.1",
        "step-000003.ckpt.damaged.2",
    ]
    assert [(tmp_path / n).read_bytes() for n in sorted(os.listdir(tmp_path))] == bad


def test_set_aside_refuses_when_it_cannot_rename_or_every_name_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "step-000003.ckpt"
    with pytest.raises(CheckpointError) as exc:
        set_aside(path, "why")
    assert str(exc.value) == (
        f"checkpoint {path} does not verify (why) and cannot be set aside: [Errno 2] No such "
        f"file or directory: '{path}' -> '{path}.damaged'"
    )
    monkeypatch.setattr(ckpt_dir, "_ASIDE_TRIES", 3)
    for name in (
        "step-000003.ckpt",
        "step-000003.ckpt.damaged",
        "step-000003.ckpt.damaged.1",
        "step-000003.ckpt.damaged.2",
    ):
        (tmp_path / name).write_text(name)
    with pytest.raises(CheckpointError) as exc:
        set_aside(path, "why")
    assert str(exc.value) == (
        f"checkpoint {path} does not verify (why) and 3 damaged copies of "
        "it are kept already; remove some"
    )
    assert path.read_text() == "step-000003.ckpt"
    (tmp_path / "step-000003.ckpt.damaged.2").unlink()
    assert set_aside(path, "why") == tmp_path / "step-000003.ckpt.damaged.2"


def test_a_file_gone_before_it_is_set_aside_is_not_counted(tmp_path: Path) -> None:
    """Another process removed it between the listing and the check: nothing to set aside."""
    assert ckpt_dir._verify_or_set_aside(tmp_path / "step-000001.ckpt") is False
    assert os.listdir(tmp_path) == []
    path = save_checkpoint(tmp_path, make_state(step=1))
    assert ckpt_dir._verify_or_set_aside(path) is True
    damage(path)
    assert ckpt_dir._verify_or_set_aside(path) is False
    assert os.listdir(tmp_path) == ["step-000001.ckpt.damaged"]


def test_saving_over_a_damaged_checkpoint_of_its_step_sets_it_aside(tmp_path: Path) -> None:
    save_steps(tmp_path, 2, 3)
    bad = damage(tmp_path / "step-000003.ckpt")
    save_checkpoint(tmp_path, make_state(step=3, seed=7), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["step-000003.ckpt", "step-000003.ckpt.damaged"]
    assert (tmp_path / "step-000003.ckpt.damaged").read_bytes() == bad
    assert_same(load_checkpoint(tmp_path / "step-000003.ckpt"), make_state(step=3, seed=7))
