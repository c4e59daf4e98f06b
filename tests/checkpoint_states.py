"""Small checkpoint states and damage for the checkpoint tests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from foundry.model.formats import checkpoint as ckpt
from foundry.model.formats import checkpoint_metadata as ckpt_meta
from foundry.model.formats.checkpoint import CheckpointState
from foundry.model.formats.checkpoint_dir import save_checkpoint
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


def write_raw(path: Path, meta: bytes, data: bytes) -> None:
    """A file in the checkpoint layout around any metadata and data, with a valid sha256."""
    head = ckpt.HEADER.pack(ckpt.MAGIC, ckpt.VERSION, 0, len(meta))
    body = head + meta + bytes(-(len(head) + len(meta)) % 64) + data
    path.write_bytes(body + hashlib.sha256(body).digest())


def refusal(meta: Any) -> str:
    with pytest.raises(ckpt_meta.MetadataError) as exc:
        ckpt_meta.validate_metadata(meta)
    return str(exc.value)


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
