"""Training checkpoints: exact round trip, atomic writes, damage detection, retention."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import resource
import signal
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest

from foundry.model import checkpoint as ckpt
from foundry.model.checkpoint import (
    CheckpointError,
    CheckpointState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from foundry.model.config import ModelConfig

CFG = ModelConfig(n_ctx=32, n_embd=16, n_layer=1, n_head=2, n_head_kv=1, n_ff=24, n_expert=3)
Params = dict[str, npt.NDArray[np.float32]]


def random_tensors(cfg: ModelConfig, seed: int) -> Params:
    rng = np.random.default_rng(seed)
    return {
        n: rng.standard_normal(s).astype(np.float32) for n, s in cfg.param_shapes().items()
    }


def make_state(step: int = 123, seed: int = 0, cfg: ModelConfig = CFG) -> CheckpointState:
    return CheckpointState(
        config=cfg,
        step=step,
        params=random_tensors(cfg, seed),
        optimizer={
            "m": random_tensors(cfg, seed + 1),
            "v": {k: np.abs(a) for k, a in random_tensors(cfg, seed + 2).items()},
            "step": step,
        },
        data_position=step * 16 + 5,
        extra={"compression": "topk", "lr": 3e-3, "schedule": {"warmup": 20}},
    )


def assert_same(a: CheckpointState, b: CheckpointState) -> None:
    assert a.config == b.config
    assert (a.step, a.data_position, a.extra) == (b.step, b.data_position, b.extra)
    assert a.optimizer["step"] == b.optimizer["step"]
    assert list(a.params) == list(b.params)
    for name in a.params:
        assert a.params[name].tobytes() == b.params[name].tobytes()
    for group in ("m", "v"):
        assert list(a.optimizer[group]) == list(b.optimizer[group])
        for name, arr in a.optimizer[group].items():
            assert arr.tobytes() == b.optimizer[group][name].tobytes()


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_round_trip_is_exact(tmp_path: Path) -> None:
    state = make_state()
    path = save_checkpoint(tmp_path, state)
    assert path == tmp_path / "step-000123.ckpt"
    assert os.listdir(tmp_path) == ["step-000123.ckpt"]
    loaded = load_checkpoint(path)
    assert_same(state, loaded)
    for arr in loaded.params.values():
        assert arr.dtype == np.float32
        assert arr.flags.writeable  # the optimizer updates loaded weights in place


def test_round_trip_with_shared_expert_and_fresh_optimizer(tmp_path: Path) -> None:
    cfg = ModelConfig(n_embd=16, n_layer=2, n_head=2, n_head_kv=2, n_ff=8, n_ff_shared=12)
    state = CheckpointState(
        config=cfg, step=0, params=random_tensors(cfg, 5),
        optimizer={"m": {}, "v": {}, "step": 0}, data_position=0,
    )
    loaded = load_checkpoint(save_checkpoint(tmp_path / "new" / "dir", state))
    assert_same(state, loaded)
    assert loaded.extra == {}


def test_layout_is_the_documented_one(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state())
    data = path.read_bytes()
    magic, version, reserved, meta_len = ckpt.HEADER.unpack_from(data)
    assert (magic, version, reserved) == (b"FDRYCKPT", 1, 0)
    assert ckpt.HEADER.size == 24
    assert hashlib.sha256(data[:-32]).digest() == data[-32:]
    meta = json.loads(data[24 : 24 + meta_len])
    data_start = 24 + meta_len + (-(24 + meta_len) % 64)
    first = meta["tensors"][0]
    assert (first["group"], first["name"]) == ("params", "token_embd.weight")
    raw = np.frombuffer(data, "<f4", count=first["nbytes"] // 4, offset=data_start)
    assert first["offset"] == 0
    np.testing.assert_array_equal(raw.reshape(first["shape"]), make_state().params[first["name"]])
    assert all(t["offset"] % 64 == 0 for t in meta["tensors"])
    assert [t["group"] for t in meta["tensors"]].count("m") == len(CFG.param_shapes())


def test_full_disk_at_fsync_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = save_checkpoint(tmp_path, make_state(step=10))
    before = good.read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match=r"step-000011\.ckpt.*No space left on device.*"
                       r"\(free disk space or choose another checkpoint directory\)$"):
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


def test_corrupt_byte_is_detected(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state())
    flip_byte(path, path.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        verify_checkpoint(path)


@pytest.mark.parametrize("keep", [0, 5, 20, 30, -1], ids=["empty", "magic", "header", "meta", "-1"])
def test_truncated_file_is_detected(tmp_path: Path, keep: int) -> None:
    path = save_checkpoint(tmp_path, make_state())
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="truncated"):
        verify_checkpoint(path)


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "model.gguf"
    other.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(CheckpointError, match="not a Foundry checkpoint"):
        load_checkpoint(other)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "absent.ckpt")
    path = save_checkpoint(tmp_path, make_state())
    data = bytearray(path.read_bytes())
    data[8] = 2  # a future format version
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="format version 2; this Foundry reads version 1"):
        load_checkpoint(path)


def test_latest_skips_a_corrupt_newest_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (5, 10, 20):
        save_checkpoint(tmp_path, make_state(step=step, seed=step))
    newest = tmp_path / "step-000020.ckpt"
    flip_byte(newest, 200)
    with caplog.at_level(logging.WARNING, logger="foundry.model.checkpoint"):
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


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / ".step-000007.ckpt.999999999.tmp"  # above any pid_max
    dead.write_bytes(b"half a checkpoint")
    alive = tmp_path / f".step-000007.ckpt.{os.getppid()}.tmp"
    alive.write_bytes(b"being written")
    save_checkpoint(tmp_path, make_state(step=8))
    assert not dead.exists()
    assert alive.exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000008.ckpt"


def test_states_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    state = make_state()
    del state.params["output.weight"]
    with pytest.raises(CheckpointError, match=r"missing \['output\.weight'\]"):
        save_checkpoint(tmp_path, state)
    state = make_state()
    state.params["output.weight"] = state.params["output.weight"].astype(np.float64)
    with pytest.raises(CheckpointError, match=r"params output\.weight: expected float32"):
        save_checkpoint(tmp_path, state)
    state = make_state()
    state.optimizer["m"]["blk.0.attn_q.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(CheckpointError, match=r"m blk\.0\.attn_q\.weight: expected float32"):
        save_checkpoint(tmp_path, state)
    state = make_state()
    cast(dict[str, Any], state.optimizer).pop("v")
    with pytest.raises(CheckpointError, match="lacks 'v'"):
        save_checkpoint(tmp_path, state)
    state = make_state()
    state.extra["when"] = {1, 2}
    with pytest.raises(CheckpointError, match="not plain JSON"):
        save_checkpoint(tmp_path, state)
    state = make_state()
    state.extra["loss"] = float("nan")
    with pytest.raises(CheckpointError, match="not plain JSON"):
        save_checkpoint(tmp_path, state)
    assert os.listdir(tmp_path) == []


def test_every_tensor_lies_at_its_documented_aligned_offset(tmp_path: Path) -> None:
    """Tensors back to back from D, each at the next multiple of 64 (zero padding between):
    with norms of 40 floats (160 bytes) the padding is not zero."""
    cfg = ModelConfig(n_embd=40, n_head=4, n_head_kv=2, n_ff=24, n_layer=1)
    state = make_state(cfg=cfg)
    data = save_checkpoint(tmp_path, state).read_bytes()
    meta_len = ckpt.HEADER.unpack_from(data)[3]
    meta = json.loads(data[24 : 24 + meta_len])
    data_start = 24 + meta_len + (-(24 + meta_len) % 64)
    groups = {"params": state.params, "m": state.optimizer["m"], "v": state.optimizer["v"]}
    offset = 0
    assert any(t["nbytes"] % 64 for t in meta["tensors"])
    for t in meta["tensors"]:
        assert t["offset"] == offset, t
        raw = np.frombuffer(data, "<f4", count=t["nbytes"] // 4, offset=data_start + offset)
        np.testing.assert_array_equal(raw.reshape(t["shape"]), groups[t["group"]][t["name"]])
        end = data_start + offset + t["nbytes"]
        offset += t["nbytes"] + (-t["nbytes"] % 64)
        assert not any(data[end : data_start + offset])  # the padding is zeros
    assert len(data) - 32 in (end, data_start + offset)  # then the sha256


def test_negative_step_or_position_and_keep_last_are_checked(tmp_path: Path) -> None:
    for step, position in ((-1, 0), (0, -1)):
        state = dataclasses.replace(make_state(), step=step, data_position=position)
        with pytest.raises(CheckpointError, match="must be >= 0"):
            save_checkpoint(tmp_path, state)
    save_checkpoint(tmp_path, make_state(step=1), keep_last=1)
    save_checkpoint(tmp_path, make_state(step=2), keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    with pytest.raises(CheckpointError, match="keep_last"):
        save_checkpoint(tmp_path, make_state(step=3), keep_last=0)


def test_further_tensor_groups_round_trip(tmp_path: Path) -> None:
    """The swarm's shadow weights and outer momentum come back as they were saved."""
    state = dataclasses.replace(make_state(), extra={"sync_every": 4}, tensors={
        "shadow": random_tensors(CFG, 7), "outer_m": random_tensors(CFG, 8)})
    loaded = load_checkpoint(save_checkpoint(tmp_path, state))
    assert_same(state, loaded)
    assert loaded.extra == {"sync_every": 4}
    assert sorted(loaded.tensors) == ["outer_m", "shadow"]
    for group, tensors in state.tensors.items():
        assert list(loaded.tensors[group]) == list(tensors)
        assert all(np.array_equal(loaded.tensors[group][k], v) for k, v in tensors.items())


def test_refusals_name_what_was_given(tmp_path: Path) -> None:
    """Each refusal says which tensor or group and what it got: a dtype and shape for an array,
    the type for anything else."""
    state = make_state()
    state.params["blk.0.attn_q.weight"] = np.zeros((2, 3), np.float64)
    with pytest.raises(CheckpointError, match=r"float32 \(16, 16\), got float64 \(2, 3\)$"):
        save_checkpoint(tmp_path, state)
    state = make_state()
    cast(dict[str, Any], state.optimizer["v"])["output.weight"] = [1.0, 2.0]
    with pytest.raises(CheckpointError, match=r"v output\.weight: expected .*, got list None$"):
        save_checkpoint(tmp_path, state)
    state = make_state()
    state.params["blk.9.unknown"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['blk\.9\.unknown'\]"):
        save_checkpoint(tmp_path, state)
    state = make_state()
    state.optimizer["m"]["blk.9.unknown"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError, match=r"m holds unknown tensors \['blk\.9\.unknown'\]"):
        save_checkpoint(tmp_path, state)
    state = dataclasses.replace(make_state(), tensors={"shadow": {}, "v": random_tensors(CFG, 3)})
    with pytest.raises(CheckpointError, match=r"tensor groups \['v'\] are reserved"):
        save_checkpoint(tmp_path, state)
    assert os.listdir(tmp_path) == []


def test_metadata_is_canonical_json(tmp_path: Path) -> None:
    """The metadata names its format and is sorted-key JSON: the same state gives the same bytes."""
    data = save_checkpoint(tmp_path, make_state()).read_bytes()
    meta_len = ckpt.HEADER.unpack_from(data)[3]
    raw = data[24 : 24 + meta_len]
    meta = json.loads(raw)
    assert meta["format"] == "foundry-checkpoint"
    assert json.dumps(meta, sort_keys=True, allow_nan=False).encode() == raw
    assert save_checkpoint(tmp_path / "again", make_state()).read_bytes() == data


def write_raw(path: Path, meta: bytes, data: bytes) -> None:
    """A file in the checkpoint layout around any metadata and data, with a valid sha256."""
    head = ckpt.HEADER.pack(ckpt.MAGIC, ckpt.VERSION, 0, len(meta))
    body = head + meta + bytes(-(len(head) + len(meta)) % 64) + data
    path.write_bytes(body + hashlib.sha256(body).digest())


def test_header_limits(tmp_path: Path) -> None:
    """Metadata that ends exactly where the hash starts is read (and, empty, refused as unusable
    metadata); one byte more than the file holds is truncation."""
    path = tmp_path / "step-000001.ckpt"
    write_raw(path, b"", b"")
    assert path.stat().st_size == 24 + 32 + 40  # header, hash, padding to 64
    path.write_bytes(ckpt.HEADER.pack(ckpt.MAGIC, 1, 0, 0) + hashlib.sha256(
        ckpt.HEADER.pack(ckpt.MAGIC, 1, 0, 0)).digest())  # the smallest file: 56 bytes
    with pytest.raises(CheckpointError, match="verifies but unusable metadata"):
        load_checkpoint(path)
    verify_checkpoint(path)
    for meta_len, expect in (
        (40, "verifies but unusable metadata"),
        (41, r"truncated \(96 bytes, metadata alone 41\)"),
    ):
        head = ckpt.HEADER.pack(ckpt.MAGIC, 1, 0, meta_len)
        body = head + b"{}" + bytes(38)
        path.write_bytes(body + hashlib.sha256(body).digest())
        with pytest.raises(CheckpointError, match=expect):
            load_checkpoint(path)
        if meta_len == 41:
            with pytest.raises(CheckpointError, match=r"metadata alone 41\)"):
                verify_checkpoint(path)
        else:
            verify_checkpoint(path)


def test_tensors_outside_the_data_or_not_f32_are_refused(tmp_path: Path) -> None:
    """A tensor index that points past the data (into the hash) or names another dtype is refused,
    even though the hash verifies."""
    good = save_checkpoint(tmp_path, make_state()).read_bytes()
    meta_len = ckpt.HEADER.unpack_from(good)[3]
    meta = json.loads(good[24 : 24 + meta_len])
    data = good[24 + meta_len + (-(24 + meta_len) % 64) : -32]
    last = meta["tensors"][-1]
    path = tmp_path / "crafted.ckpt"
    for offset, dtype, problem in (
        (len(data) - last["nbytes"] + 4, "<f4",
         f"tensor {last['name']} lies outside the data or is not <f4"),
        (last["offset"], "<f8", 'dtype\' must be "<f4", got "<f8"'),
    ):
        last["offset"], last["dtype"] = offset, dtype
        write_raw(path, json.dumps(meta).encode(), data)
        with pytest.raises(CheckpointError, match=re.escape(problem)):
            load_checkpoint(path)
    last["offset"], last["dtype"] = len(data) - last["nbytes"], "<f4"
    write_raw(path, json.dumps(meta).encode(), data)
    assert load_checkpoint(path).optimizer["v"][last["name"]].shape == tuple(last["shape"])


def test_errors_name_the_file(tmp_path: Path) -> None:
    foreign = tmp_path / "short.bin"
    foreign.write_bytes(b"abc")  # shorter than the magic and not a prefix of it
    for f in (load_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError, match=re.escape(
                f"{foreign} is not a Foundry checkpoint (bad magic b'abc')")):
            f(foreign)
    foreign.write_bytes(b"GGUF\x03\x00\x00\x00\x01" + bytes(100))
    with pytest.raises(CheckpointError, match=re.escape(r"(bad magic b'GGUF\x03\x00\x00\x00')")):
        verify_checkpoint(foreign)
    path = save_checkpoint(tmp_path, make_state())
    flip_byte(path, 100)
    for f in (load_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError, match=re.escape(
                f"{path} is corrupt or truncated (sha256 does not match its content); "
                "resume from an older checkpoint")):
            f(path)
    absent = tmp_path / "absent"
    with pytest.raises(CheckpointError, match=re.escape(f"cannot read checkpoint {absent}: ")):
        verify_checkpoint(tmp_path / "absent")


@pytest.mark.parametrize("chunk", [1, 7, -1], ids=["1", "7", "all-but-one"])
def test_verify_reads_in_any_chunk_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    path = save_checkpoint(tmp_path, make_state())
    if chunk == -1:  # one byte is left for the last read
        chunk = path.stat().st_size - 32 - 24 - 1
    monkeypatch.setattr(ckpt, "_CHUNK", chunk)
    verify_checkpoint(path)
    flip_byte(path, path.stat().st_size - 33)  # the last data byte
    with pytest.raises(CheckpointError, match="corrupt"):
        verify_checkpoint(path)


def test_interrupt_before_the_temp_file_exists_is_passed_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(directory: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "_remove_stale_temps", interrupted)
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

    monkeypatch.setattr(ckpt, "_fsync_dir", refuse)
    with caplog.at_level(logging.WARNING, logger="foundry.model.checkpoint"):
        path = save_checkpoint(tmp_path, make_state())
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {path} written but its directory could not be synced: "
        "[Errno 5] directory sync refused"
    ]
    assert_same(load_checkpoint(path), make_state())
