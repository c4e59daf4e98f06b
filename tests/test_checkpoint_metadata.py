"""Checkpoint metadata: every field checked against its schema, at its bounds and past them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from checkpoint_states import make_state, refusal, write_raw

from foundry.model.formats import checkpoint as ckpt
from foundry.model.formats import checkpoint_metadata as ckpt_meta
from foundry.model.formats.checkpoint import CheckpointError, load_checkpoint
from foundry.model.formats.checkpoint_dir import save_checkpoint

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
