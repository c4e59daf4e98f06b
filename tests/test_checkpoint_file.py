"""Checkpoint files: exact round trip, the documented layout, damage detection, what is refused."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import pytest
from checkpoint_states import (
    CFG,
    assert_same,
    corrupt_why,
    flip_byte,
    make_state,
    random_tensors,
    write_raw,
)

from foundry.model.formats import checkpoint as ckpt
from foundry.model.formats.checkpoint import (
    CheckpointError,
    CheckpointState,
    load_checkpoint,
    verify_checkpoint,
)
from foundry.model.formats.checkpoint_dir import list_checkpoints, save_checkpoint
from foundry.model.spec.config import ModelConfig


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
