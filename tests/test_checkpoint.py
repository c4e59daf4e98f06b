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
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
import pytest

from foundry.model.formats import checkpoint as ckpt
from foundry.model.formats import checkpoint_dir as ckpt_dir
from foundry.model.formats import checkpoint_metadata as ckpt_meta
from foundry.model.formats.checkpoint import (
    CheckpointError,
    CheckpointState,
    load_checkpoint,
    verify_checkpoint,
)
from foundry.model.formats.checkpoint_dir import (
    CheckpointRefused,
    DirectoryLock,
    check_directory,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    resume_checkpoint,
    save_checkpoint,
    set_aside,
    start_fresh,
)
from foundry.model.spec.config import ModelConfig

CFG = ModelConfig(n_ctx=32, n_embd=16, n_layer=1, n_head=2, n_head_kv=1, n_ff=24, n_expert=3)
Params = dict[str, npt.NDArray[np.float32]]


def random_tensors(cfg: ModelConfig, seed: int) -> Params:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in cfg.param_shapes().items()}


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
        config=cfg,
        step=0,
        params=random_tensors(cfg, 5),
        optimizer={"m": {}, "v": {}, "step": 0},
        data_position=0,
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
    state = dataclasses.replace(
        make_state(),
        extra={"sync_every": 4},
        tensors={"shadow": random_tensors(CFG, 7), "outer_m": random_tensors(CFG, 8)},
    )
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
    path.write_bytes(
        ckpt.HEADER.pack(ckpt.MAGIC, 1, 0, 0)
        + hashlib.sha256(ckpt.HEADER.pack(ckpt.MAGIC, 1, 0, 0)).digest()
    )  # the smallest file: 56 bytes
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
        (
            len(data) - last["nbytes"] + 4,
            "<f4",
            f"tensor {last['name']} lies outside the data or is not <f4",
        ),
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
        with pytest.raises(
            CheckpointError,
            match=re.escape(f"{foreign} is not a Foundry checkpoint (bad magic b'abc')"),
        ):
            f(foreign)
    foreign.write_bytes(b"GGUF\x03\x00\x00\x00\x01" + bytes(100))
    with pytest.raises(CheckpointError, match=re.escape(r"(bad magic b'GGUF\x03\x00\x00\x00')")):
        verify_checkpoint(foreign)
    path = save_checkpoint(tmp_path, make_state())
    flip_byte(path, 100)
    for f in (load_checkpoint, verify_checkpoint):
        with pytest.raises(
            CheckpointError,
            match=re.escape(
                f"{path} is corrupt or truncated (sha256 does not match its content); "
                "resume from an older checkpoint"
            ),
        ):
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


# ---------------------------------------------------------------------------- metadata schema

DELETE = object()  # a field taken out of the metadata


def good_metadata(tmp_path: Path) -> dict[str, Any]:
    data = save_checkpoint(tmp_path / "meta", make_state()).read_bytes()
    meta: dict[str, Any] = json.loads(data[24 : 24 + ckpt.HEADER.unpack_from(data)[3]])
    return meta


def edited(meta: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``meta`` with the dotted ``field`` (list items by index) set or deleted."""
    out: dict[str, Any] = json.loads(json.dumps(meta))
    *parents, last = field.split(".")
    node: Any = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    index: Any = int(last) if isinstance(node, list) else last
    if value is DELETE:
        del node[index]
    else:
        node[index] = value
    return out


def refusal(meta: Any) -> str:
    with pytest.raises(ckpt_meta.MetadataError) as exc:
        ckpt_meta.validate_metadata(meta)
    return str(exc.value)


I64 = "[0, 9223372036854775807]"
U32 = "[0, 4294967295]"
DIM = "[0, 16777216]"


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("format", DELETE, 'must be "foundry-checkpoint", got null'),
        ("format", "foundry-ckpt", 'must be "foundry-checkpoint", got "foundry-ckpt"'),
        ("step", DELETE, "is missing"),
        ("step", True, f"must be an integer in {U32}, got true"),
        ("step", 2.0, f"must be an integer in {U32}, got 2.0"),
        ("step", -1, f"must be in {U32}, got -1"),
        ("step", 2**32, f"must be in {U32}, got 4294967296"),
        ("data_position", DELETE, "is missing"),
        ("data_position", "12", f'must be an integer in {I64}, got "12"'),
        ("data_position", -1, f"must be in {I64}, got -1"),
        ("data_position", 2**63, f"must be in {I64}, got 9223372036854775808"),
        ("optimizer_step", DELETE, "is missing"),
        ("optimizer_step", None, f"must be an integer in {I64}, got null"),
        ("optimizer_step", -1, f"must be in {I64}, got -1"),
        ("optimizer_step", 2**63, f"must be in {I64}, got 9223372036854775808"),
        ("config", DELETE, "must be a JSON object, got null"),
        ("config", [1, 2], "must be a JSON object, got [1, 2]"),
        ("config.n_layers", 2, "is not a ModelConfig field"),
        ("config.rope_theta", True, "must be a finite number, got true"),
        ("config.rope_theta", "1e4", 'must be a finite number, got "1e4"'),
        ("config.rope_theta", None, "must be a finite number, got null"),
        ("config.rope_theta", float("nan"), "must be a finite number, got NaN"),
        ("config.norm_eps", float("inf"), "must be a finite number, got Infinity"),
        ("config.norm_eps", float("-inf"), "must be a finite number, got -Infinity"),
        ("config.n_ctx", 2**20 + 1, "must be in [0, 1048576], got 1048577"),
        ("config.n_ctx", -1, "must be in [0, 1048576], got -1"),
        ("config.n_embd", 2**24 + 1, f"must be in {DIM}, got 16777217"),
        ("config.n_vocab", -1, f"must be in {DIM}, got -1"),
        ("config.n_head", 4.0, f"must be an integer in {DIM}, got 4.0"),
        ("config.n_expert", False, f"must be an integer in {DIM}, got false"),
        ("extra", DELETE, "must be a JSON object, got null"),
        ("extra", "x", 'must be a JSON object, got "x"'),
        ("extra.sync_every", 0, "must be in [1, 4294967295], got 0"),
        ("extra.sync_every", 2**32, "must be in [1, 4294967295], got 4294967296"),
        ("extra.sync_every", "4", 'must be an integer in [1, 4294967295], got "4"'),
        ("extra.outer_steps", -1, f"must be in {U32}, got -1"),
        ("extra.outer_steps", 2**32, f"must be in {U32}, got 4294967296"),
        ("extra.outer_steps", None, f"must be an integer in {U32}, got null"),
        ("extra.compression", 3, "must be a string, got 3"),
        ("extra.down_compression", None, "must be a string, got null"),
        ("tensors", DELETE, "must be a list, got null"),
        ("tensors", {"a": 1}, 'must be a list, got {"a": 1}'),
        ("tensors", "x" * 100, 'must be a list, got "' + "x" * 79),
        ("tensors.1", 5, "must be a JSON object, got 5"),
        ("tensors.1", [0] * 40, "must be a JSON object, got [" + "0, " * 26 + "0"),
        ("tensors.1.group", DELETE, "must be a string, got null"),
        ("tensors.1.group", 1, "must be a string, got 1"),
        ("tensors.1.name", 7, "must be a string, got 7"),
        ("tensors.1.shape", "16", "must be a list of at most 4 sizes, got '16'"),
        ("tensors.1.shape", DELETE, "must be a list of at most 4 sizes, got None"),
        ("tensors.1.shape", [1] * 5, "must be a list of at most 4 sizes, got [1, 1, 1, 1, 1]"),
        ("tensors.1.dtype", "<f8", 'must be "<f4", got "<f8"'),
        ("tensors.1.dtype", DELETE, 'must be "<f4", got null'),
        ("tensors.1.offset", DELETE, "is missing"),
        ("tensors.1.offset", -1, f"must be in {I64}, got -1"),
        ("tensors.1.offset", 2**63, f"must be in {I64}, got 9223372036854775808"),
        ("tensors.1.offset", "0", f'must be an integer in {I64}, got "0"'),
        ("tensors.1.nbytes", DELETE, "is missing"),
        ("tensors.1.nbytes", -4, f"must be in {I64}, got -4"),
        ("tensors.1.nbytes", 2**63, f"must be in {I64}, got 9223372036854775808"),
        ("tensors.1.nbytes", 60, "is 60, but shape [16] holds 64 bytes of <f4"),
        ("tensors.1.nbytes", 68, "is 68, but shape [16] holds 64 bytes of <f4"),
    ],
)
def test_each_metadata_field_out_of_its_schema_is_refused_naming_it(
    tmp_path: Path, field: str, value: Any, says: str
) -> None:
    meta = edited(good_metadata(tmp_path), field, value)
    name = field
    for m in re.finditer(r"\.(\d+)", field):
        name = name.replace(m.group(0), f"[{m.group(1)}]", 1)
    assert refusal(meta) == f"metadata field {name!r} {says}"


@pytest.mark.parametrize(
    ("shape", "says"),
    [
        ([16, -1], f"'tensors[1].shape[1]' must be in {DIM}, got -1"),
        ([2**24 + 1], f"'tensors[1].shape[0]' must be in {DIM}, got 16777217"),
        ([1, 1, 16.0], f"'tensors[1].shape[2]' must be an integer in {DIM}, got 16.0"),
        ([True], f"'tensors[1].shape[0]' must be an integer in {DIM}, got true"),
    ],
)
def test_each_size_of_a_shape_is_checked(tmp_path: Path, shape: list[Any], says: str) -> None:
    meta = edited(good_metadata(tmp_path), "tensors.1.shape", shape)
    assert refusal(meta) == f"metadata field {says}"


def test_metadata_that_is_not_an_object_is_refused() -> None:
    assert refusal([]) == "metadata field '(metadata)' must be a JSON object, got []"
    assert refusal(list(range(40))) == (
        "metadata field '(metadata)' must be a JSON object, got " + json.dumps(list(range(40)))[:80]
    )
    assert refusal(None) == "metadata field '(metadata)' must be a JSON object, got null"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("step", 0),
        ("step", 2**32 - 1),
        ("data_position", 0),
        ("data_position", 2**63 - 1),
        ("optimizer_step", 0),
        ("optimizer_step", 2**63 - 1),
        ("config", {}),
        ("config.n_ctx", 2**20),
        ("config.n_ctx", 0),
        ("config.n_embd", 2**24),
        ("config.n_ff_shared", 0),
        ("config.n_vocab", 1),
        ("config.rope_theta", 10000),
        ("config.rope_theta", 1.5e308),
        ("config.rope_theta", -2.5),
        ("config.norm_eps", 0.0),
        ("extra", {}),
        ("extra.lr", "any JSON"),
        ("extra.schedule", None),
        ("extra.sync_every", 1),
        ("extra.sync_every", 2**32 - 1),
        ("extra.outer_steps", 0),
        ("extra.outer_steps", 2**32 - 1),
        ("extra.compression", ""),
        ("extra.down_compression", "qsgd"),
        ("tensors", []),
        ("tensors.1.shape", []),
        ("tensors.1.shape", [1, 1, 1, 1]),
        ("tensors.1.offset", 0),
        ("tensors.1.offset", 2**63 - 1),
        ("tensors.1.group", "anything"),
        ("tensors.1.name", ""),
    ],
)
def test_each_metadata_field_at_its_bounds_is_accepted(
    tmp_path: Path, field: str, value: Any
) -> None:
    meta = edited(good_metadata(tmp_path), field, value)
    if field == "tensors.1.shape":
        meta["tensors"][1]["nbytes"] = 4
    ckpt_meta.validate_metadata(meta)


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ([0], 0),
        ([2**24], 4 * 2**24),
        ([0, 2**24], 0),
        ([2**24, 2**24], 4 * 2**48),
        ([3, 5, 7, 11], 4 * 3 * 5 * 7 * 11),
    ],
)
def test_tensor_sizes_at_their_bounds_are_accepted(
    tmp_path: Path, shape: list[int], nbytes: int
) -> None:
    meta = good_metadata(tmp_path)
    meta["tensors"][0].update(shape=shape, nbytes=nbytes)
    ckpt_meta.validate_metadata(meta)
    meta["tensors"][0]["nbytes"] = nbytes + 4
    assert refusal(meta) == (
        f"metadata field 'tensors[0].nbytes' is {nbytes + 4}, but shape "
        f"{shape} holds {nbytes} bytes of <f4"
    )


def test_unusable_metadata_is_refused_at_load_naming_the_file_and_field(tmp_path: Path) -> None:
    meta = good_metadata(tmp_path)
    meta["extra"]["sync_every"] = 0
    path = tmp_path / "step-000123.ckpt"
    write_raw(path, json.dumps(meta).encode(), b"")
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (
        f"{path} has a hash that verifies but unusable metadata: metadata field "
        "'extra.sync_every' must be in [1, 4294967295], got 0; the file was edited or written "
        "by another program: restore it, or resume from another checkpoint"
    )
    assert exc.value.__cause__ is None and exc.value.__suppress_context__
    write_raw(path, b'{"format": "foundry-checkpoint", ', b"")
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    assert str(exc.value).startswith(
        f"{path} has a hash that verifies but unusable metadata: Expecting property name"
    )
    assert str(exc.value).endswith(
        "; the file was edited or written by another program: "
        "restore it, or resume from another checkpoint"
    )


# ---------------------------------------------------------------------------- pruning, set-aside


def damage(path: Path, how: str = "flip") -> bytes:
    """Flip a byte in the middle (or cut the file to 100 bytes, or empty it) and move its mtime
    on, so that the change shows even within one tick of the file system's clock; the new
    bytes."""
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: 100 if how == "truncate" else 0]
    st = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    return bytes(data)


def corrupt_why(path: Path) -> str:
    return (
        f"{path} is corrupt or truncated (sha256 does not match its content); "
        "resume from an older checkpoint"
    )


def save_steps(d: Path, *steps: int) -> None:
    for step in steps:
        save_checkpoint(d, make_state(step=step, seed=step), keep_last=100)


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


# ---------------------------------------------------------------------------- resume, --fresh


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


# ---------------------------------------------------------------------------- the directory lock


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


def test_further_groups_holding_some_parameters_round_trip(tmp_path: Path) -> None:
    """A group may hold a subset of the parameters: each one held comes back, none is added."""
    full = random_tensors(CFG, 7)
    names = list(full)
    some = {n: full[n] for n in (names[3], names[-1])}
    state = dataclasses.replace(make_state(), tensors={"shadow": some, "outer_m": {}})
    loaded = load_checkpoint(save_checkpoint(tmp_path, state))
    assert list(loaded.tensors) == ["shadow"]
    assert list(loaded.tensors["shadow"]) == [names[3], names[-1]]
    for n, arr in some.items():
        assert loaded.tensors["shadow"][n].tobytes() == arr.tobytes()


@pytest.mark.parametrize("group", ["m", "v"])
def test_a_moment_group_that_is_neither_empty_nor_whole_is_refused(
    tmp_path: Path, group: Literal["m", "v"]
) -> None:
    good = save_checkpoint(tmp_path, make_state()).read_bytes()
    meta_len = ckpt.HEADER.unpack_from(good)[3]
    meta = json.loads(good[24 : 24 + meta_len])
    data = good[24 + meta_len + (-(24 + meta_len) % 64) : -32]
    held = [t for t in meta["tensors"] if t["group"] == group]
    meta["tensors"].remove(held[2])
    path = tmp_path / "crafted.ckpt"
    write_raw(path, json.dumps(meta).encode(), data)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (
        f"{path} has a hash that verifies but unusable metadata: optimizer group {group!r} "
        f"holds {len(held) - 1} of the {len(held)} tensors (a moment group is empty or whole)"
    )
    meta["tensors"] = [t for t in meta["tensors"] if t["group"] != group]
    write_raw(path, json.dumps(meta).encode(), data)
    assert load_checkpoint(path).optimizer[group] == {}  # empty: before the first step
    # and such a state is refused when saved, rather than written and refused at load
    state = make_state(step=5)
    del state.optimizer[group][sorted(state.optimizer[group])[2]]
    with pytest.raises(CheckpointError, match=rf"optimizer group '{group}' holds 12 of the 13 "):
        save_checkpoint(tmp_path / "save", state)
    assert not (tmp_path / "save").exists() or not list((tmp_path / "save").glob("*.ckpt"))


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


def test_a_file_that_shrinks_while_it_is_read_is_reported_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size taken before reading is 100 bytes more than the reads find (the file was cut
    meanwhile): corrupt, naming the file."""
    path = save_checkpoint(tmp_path, make_state())
    real_fstat, real_stat = os.fstat, Path.stat

    def grown(st: os.stat_result) -> os.stat_result:
        fields = list(st)
        fields[6] += 100  # st_size
        return os.stat_result(fields)

    def fstat(fd: int) -> os.stat_result:
        return grown(real_fstat(fd))

    def stat(self: Path, *, follow_symlinks: bool = True) -> os.stat_result:
        st = real_stat(self, follow_symlinks=follow_symlinks)
        return grown(st) if self == path else st

    expect = re.escape(corrupt_why(path))
    monkeypatch.setattr(os, "fstat", fstat)
    with pytest.raises(CheckpointError, match=f"^{expect}$"):
        load_checkpoint(path)
    monkeypatch.undo()
    monkeypatch.setattr(Path, "stat", stat)
    with pytest.raises(CheckpointError, match=f"^{expect}$"):
        verify_checkpoint(path)
