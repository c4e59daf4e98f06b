"""Damaged and hostile checkpoints with real processes: pruning, resuming past damage, one writer
per directory, metadata validated as a schema. Each case is a row of the fault table in
docs/guide/recovering.md ("Faults and bad input").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostile import base_params, foundry, write_checkpoint
from procs import Service, coordinator, worker

from foundry.model.formats.checkpoint import (
    ALIGN,
    HEADER,
    CheckpointError,
    CheckpointState,
    load_checkpoint,
    verify_checkpoint,
)
from foundry.model.formats.checkpoint_dir import (
    CheckpointRefused,
    list_checkpoints,
    prune_checkpoints,
    resume_checkpoint,
    save_checkpoint,
    start_fresh,
)
from foundry.model.nn import transformer as T
from foundry.model.spec.config import ModelConfig


def damage(path: Path, how: str) -> None:
    """A checkpoint damaged as a disk or a person would: one byte flipped, cut short,
    emptied."""
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    elif how == "truncate":
        data = data[: len(data) // 3]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("keep_last", [1, 2, 3])
@pytest.mark.parametrize("n_damaged", [1, 3])
def test_pruning_counts_only_checkpoints_that_verify_and_keeps_damaged_ones_aside(
    tmp_path: Path, keep_last: int, n_damaged: int
) -> None:
    d = tmp_path / "ck"
    params = base_params()
    for step in (10, 20, 30, 40, 50):
        write_checkpoint(d, step, params)
    hows = ["flip", "truncate", "empty"]
    damaged = {}
    for i, (_, path) in enumerate(reversed(list_checkpoints(d)[-n_damaged:])):
        damage(path, hows[i % 3])
        damaged[path.name] = path.read_bytes()
    # A run that resumes sets the damaged newer ones aside, never deletes them.
    resumed = resume_checkpoint(d)
    valid = [s for s in (10, 20, 30, 40, 50) if f"step-{s:06d}.ckpt" not in damaged]
    assert resumed == d / f"step-{valid[-1]:06d}.ckpt"
    for name, data in damaged.items():
        assert (d / (name + ".damaged")).read_bytes() == data
    # Its next checkpoint (the step of a damaged one, say) prunes only valid ones.
    new_step = 50
    write_checkpoint(d, new_step, params, keep_last=keep_last)
    kept = [s for s, _ in list_checkpoints(d)]
    assert kept == sorted({*valid, new_step})[-keep_last:]
    for name, data in damaged.items():
        assert (d / (name + ".damaged")).read_bytes() == data  # kept, unchanged
    # The newest kept one damaged later: pruning sets it aside and deletes no valid one.
    damage(d / f"step-{new_step:06d}.ckpt", "flip")
    prune_checkpoints(d, keep_last)
    assert [s for s, _ in list_checkpoints(d)] == kept[:-1]
    aside = sorted(p.name for p in d.iterdir() if p.name.startswith(f"step-{new_step:06d}"))
    assert aside == [f"step-{new_step:06d}.ckpt.damaged"] + (
        [f"step-{new_step:06d}.ckpt.damaged.1"] if f"step-{new_step:06d}.ckpt" in damaged else []
    )


def test_a_directory_where_no_checkpoint_verifies_is_refused_until_fresh(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    for step in (10, 20):
        write_checkpoint(d, step)
    damage(d / "step-000010.ckpt", "flip")
    damage(d / "step-000020.ckpt", "truncate")
    (d / "step-000099.ckpt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointRefused) as exc:
        resume_checkpoint(d)
    for name in ("step-000010.ckpt", "step-000020.ckpt", "step-000099.ckpt"):
        assert name in str(exc.value)
    assert "--fresh" in str(exc.value)
    assert len(list_checkpoints(d)) == 3  # refused: nothing moved
    moved = start_fresh(d)
    assert moved is not None and sorted(p.name for p in moved.iterdir()) == [
        "step-000010.ckpt",
        "step-000020.ckpt",
        "step-000099.ckpt",
    ]
    assert resume_checkpoint(d) is None


def test_train_resumes_past_a_damaged_checkpoint_and_refuses_when_none_verifies(
    tmp_path: Path,
) -> None:
    d = tmp_path / "ck"
    train = [
        "train",
        "--global-batch",
        "2",
        "--seq-len",
        "16",
        "--eval-every",
        "100",
        "--sample-every",
        "0",
        "--no-progress",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        str(d),
    ]
    run = foundry(*train, "--steps", "4")
    assert run.returncode == 0, run.stderr
    damage(d / "step-000004.ckpt", "flip")
    bad = (d / "step-000004.ckpt").read_bytes()
    run = foundry(*train, "--steps", "6")
    assert run.returncode == 0, run.stderr
    assert f"resuming from {d / 'step-000002.ckpt'} at step 2" in run.stdout
    assert "kept aside as step-000004.ckpt.damaged" in run.stderr
    assert (d / "step-000004.ckpt.damaged").read_bytes() == bad
    assert [s for s, _ in list_checkpoints(d)] == [2, 4, 6]
    for _, p in list_checkpoints(d):
        damage(p, "flip")
    run = foundry(*train, "--steps", "8")
    assert run.returncode == 2, run
    assert "no checkpoint in" in run.stderr and "step-000006.ckpt" in run.stderr
    assert "--fresh" in run.stderr and "Traceback" not in run.stderr
    run = foundry(*train, "--steps", "2", "--fresh")
    assert run.returncode == 0, run.stderr
    assert "resuming" not in run.stdout
    assert [s for s, _ in list_checkpoints(d / "previous-1")] == [2, 4, 6]
    assert [s for s, _ in list_checkpoints(d)] == [2]


def test_one_writer_per_checkpoint_directory(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    first = Service(
        [
            "train",
            "--steps",
            "100000",
            "--global-batch",
            "2",
            "--seq-len",
            "16",
            "--eval-every",
            "100000",
            "--sample-every",
            "0",
            "--no-progress",
            "--checkpoint-dir",
            str(d),
        ],
        tmp_path / "first.log",
    )
    try:
        first.wait_for(r"step 10: loss")
        run = foundry("train", "--steps", "1", "--checkpoint-dir", str(d))
        assert run.returncode == 2, run
        assert f"in use by another writer (pid {first.pid}, foundry train)" in run.stderr
        assert first.alive()
    finally:
        first.stop()
    afile = tmp_path / "afile"
    afile.write_text("x")
    run = foundry("train", "--steps", "1", "--checkpoint-dir", str(afile))
    assert run.returncode == 2 and "is not a directory" in run.stderr, run


def rewrite_metadata(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a checkpoint's metadata JSON as a person with a text editor and the format's
    description would, and recompute its hash so that it verifies."""
    raw = path.read_bytes()
    magic, version, reserved, meta_len = HEADER.unpack_from(raw)
    meta = json.loads(raw[HEADER.size : HEADER.size + meta_len])
    start = HEADER.size + meta_len + (-(HEADER.size + meta_len) % ALIGN)
    data = raw[start : len(raw) - 32]
    edit(meta)
    new = json.dumps(meta).encode()
    body = HEADER.pack(magic, version, reserved, len(new)) + new
    body += bytes(-len(body) % ALIGN) + data
    path.write_bytes(body + hashlib.sha256(body).digest())


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(meta: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = meta
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value

    return edit


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("extra.sync_every", None, "'extra.sync_every' must be an integer"),
        ("extra.sync_every", 0, "'extra.sync_every' must be in [1,"),
        ("step", -5, "'step' must be in [0, 4294967295], got -5"),
        ("step", 2**40, "'step' must be in"),
        ("data_position", "12", "'data_position' must be an integer"),
        ("config.n_ctx", 2**31, "'config.n_ctx' must be in [0, 1048576]"),
        ("config.rope_theta", "big", "'config.rope_theta' must be a finite number"),
        ("tensors.0.nbytes", 4, "'tensors[0].nbytes' is 4"),
        ("tensors.3.shape", "64", "'tensors[3].shape' must be a list"),
        ("extra", [], "'extra' must be a JSON object"),
    ],
)
def test_checkpoint_metadata_is_validated_as_a_schema_naming_the_field(
    tmp_path: Path, field: str, value: Any, says: str
) -> None:
    ckpt = write_checkpoint(tmp_path / "ck", 5)
    rewrite_metadata(ckpt, _set(field, value))
    verify_checkpoint(ckpt)  # the hash matches: only the schema can tell
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(ckpt)
    assert says in str(exc.value), str(exc.value)
    if value is None or value == -5:  # the two, through a command too
        run = foundry("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "m.gguf"))
        assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr, run


def test_the_coordinator_never_trains_over_checkpoints_that_do_not_verify(tmp_path: Path) -> None:
    """The issue's run: checkpoints every 2 steps, keep 1, the newest damaged. The restart
    refuses (it used to start again at step 1 and prune every new checkpoint); --fresh moves
    the files aside and starts at step 0. Meanwhile a second coordinator on the same folder
    is refused with the first one's pid, and a file given as the folder is refused."""
    d = tmp_path / "ckpt"
    flags = (
        "--max-steps",
        "4",
        "--global-batch",
        "4",
        "--seq-len",
        "16",
        "--checkpoint-every",
        "2",
        "--keep-checkpoints",
        "1",
    )
    coord, port, _ = coordinator(tmp_path, *flags)
    try:
        second = foundry(
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--checkpoint-dir",
            str(d),
        )
        assert second.returncode == 2, second
        assert f"in use by another writer (pid {coord.pid}, foundry coordinator)" in (second.stderr)
        w = worker(tmp_path, port, "w0")
        try:
            coord.wait_for(r"checkpoint \S+step-000004\.ckpt written at step 4")
        finally:
            w.stop()
    finally:
        coord.stop()
    assert [s for s, _ in list_checkpoints(d)] == [4]
    damage(d / "step-000004.ckpt", "flip")
    bad = (d / "step-000004.ckpt").read_bytes()
    run = foundry(
        "coordinator",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--checkpoint-dir",
        str(d),
        *flags,
    )
    assert run.returncode == 1, run
    assert "no checkpoint in" in run.stderr and "step-000004.ckpt" in run.stderr
    assert "--fresh" in run.stderr and "Traceback" not in run.stderr
    assert (d / "step-000004.ckpt").read_bytes() == bad
    coord, _, _ = coordinator(tmp_path, *flags, "--fresh", name="fresh")
    try:
        assert "resumed from" not in coord.text()
    finally:
        coord.stop()
    assert (d / "previous-1" / "step-000004.ckpt").read_bytes() == bad
    afile = tmp_path / "afile"
    afile.write_text("x")
    run = foundry("coordinator", "--checkpoint-dir", str(afile))
    assert run.returncode == 2 and "is not a directory" in run.stderr, run


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("extra.sync_every", None, "'extra.sync_every' must be an integer"),
        ("step", -5, "'step' must be in [0, 4294967295], got -5"),
    ],
)
def test_the_coordinator_refuses_checkpoint_metadata_that_does_not_fit_naming_the_field(
    tmp_path: Path, field: str, value: Any, says: str
) -> None:
    cfg = ModelConfig()
    params = T.init_params(cfg, seed=0)
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    ckpt = save_checkpoint(
        tmp_path / "ckpt",
        CheckpointState(
            config=cfg,
            step=3,
            params=params,
            optimizer={"step": 3, "m": zeros, "v": zeros},
            data_position=12,
            extra={"sync_every": 1},
        ),
    )
    rewrite_metadata(ckpt, _set(field, value))
    run = foundry(
        "coordinator",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    )
    assert run.returncode == 1, run
    assert says in run.stderr and "Traceback" not in run.stderr, run.stderr
