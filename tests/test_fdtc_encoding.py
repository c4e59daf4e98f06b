"""FDTC codec: what the encoder refuses as our own error, what it normalises, the helpers."""

from __future__ import annotations

import math
import struct
from dataclasses import fields

import numpy as np
import pytest
from fdtc_golden import GOLDEN

from foundry.model.spec.config import PRESETS, ModelConfig
from foundry.swarm.model_config import config_of, model_config_msg
from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import (
    MAX_PAYLOAD,
    Compression,
    Dataset,
    DType,
    Error,
    ErrorCode,
    GradientsAck,
    HardwareProfile,
    Heartbeat,
    ModelConfigMsg,
    Register,
    RegisterAck,
    TensorMeta,
    Weights,
    WeightsMeta,
    decode,
    encode,
    encode_parts,
    weights_messages,
    weights_tensors,
)


def _register(**kw: object) -> Register:
    base: dict[str, object] = dict(
        worker_id="w",
        protocol_version=1,
        profile=HardwareProfile.SERVER,
        num_cores=1,
        memory_mb=1,
        suggested_batch_size=1,
    )
    base.update(kw)
    return Register(**base)  # type: ignore[arg-type]


def test_strings_fit_char_arrays_with_their_nul() -> None:
    assert _register(worker_id="x" * 63).worker_id == "x" * 63
    assert _register(worker_id="é" * 31 + "x").worker_id == "é" * 31 + "x"  # 63 bytes
    with pytest.raises(LocalProtocolError, match=r"64 bytes of UTF-8; char\[64\] holds at most 63"):
        _register(worker_id="x" * 64)
    with pytest.raises(LocalProtocolError, match="64 bytes"):
        _register(worker_id="é" * 32)
    with pytest.raises(LocalProtocolError, match="NUL"):
        _register(worker_id="a\0b")
    with pytest.raises(LocalProtocolError):
        Error(1, "e" * 256)
    assert Error(1, "e" * 255).message == "e" * 255


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"num_cores": -1}, "num_cores -1 is outside 0..4294967295"),
        ({"num_cores": 2**32}, "outside"),
        ({"num_cores": 1.5}, "must be an integer"),
        ({"memory_mb": 2**64}, "memory_mb .* outside"),
        ({"protocol_version": 256}, "outside 0..255"),
        ({"profile": 10}, "profile 10 is not a HardwareProfile"),
        ({"worker_id": b"w"}, "must be a str"),
    ],
)
def test_values_that_do_not_fit_are_our_error(kw: dict[str, object], problem: str) -> None:
    with pytest.raises(LocalProtocolError, match=problem):
        _register(**kw)


def test_field_normalisation() -> None:
    r = _register(profile=2, memory_mb=np.uint64(2**64 - 1))
    assert r.profile is HardwareProfile.RPI4_4G
    assert r.memory_mb == 2**64 - 1 and type(r.memory_mb) is int
    hb = Heartbeat("w", 1, 0.1, 3.0e-4)
    assert (hb.current_loss, hb.samples_per_sec) == (0.1, 3.0e-4)  # the f32 on the wire
    assert decode(encode(hb)) == hb
    third = Heartbeat("w", 1, 1 / 3, 0).current_loss
    assert third == 0.33333334 and struct.pack("<f", third) == struct.pack("<f", 1 / 3)
    assert math.isnan(Heartbeat("w", 1, float("nan"), 0).current_loss)
    assert Heartbeat("w", 1, float("inf"), 0).current_loss == math.inf
    with pytest.raises(LocalProtocolError, match="does not fit a 32-bit float"):
        Heartbeat("w", 1, 1e39, 0)
    with pytest.raises(LocalProtocolError, match="must be a number"):
        Heartbeat("w", 1, "1.0", 0)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="must be a bool"):
        GradientsAck(1, accepted=2)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="exactly 32 bytes"):
        Dataset(1, bytes(31))
    with pytest.raises(LocalProtocolError, match="topk_ratio"):
        RegisterAck(True, 0, 1, 1, 1, Compression.TOPK, 1.5, 0)
    assert RegisterAck(False, 0, 0, 0, 0, Compression.TOPK, 0.0, 0).topk_ratio == 0.0


def test_tensor_meta_validation() -> None:
    assert TensorMeta("t", [2, 3]).shape == (2, 3)  # type: ignore[arg-type]
    assert TensorMeta("t", (2, 3)).numel == 6
    assert TensorMeta("t", ()).numel == 1
    assert TensorMeta("t", (4,), DType.F16).nbytes == 8
    with pytest.raises(LocalProtocolError, match="9 dimensions"):
        TensorMeta("t", (1,) * 9)
    with pytest.raises(LocalProtocolError, match="outside"):
        TensorMeta("t", (-1,))
    with pytest.raises(LocalProtocolError, match="dtype"):
        TensorMeta("t", (1,), 7)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="TensorMeta"):
        WeightsMeta(global_step=0, learning_rate=0.0, tensors=("x",))  # type: ignore[arg-type]


def test_encoding_over_the_message_limit_is_our_error() -> None:
    too_big = np.zeros(MAX_PAYLOAD + 1, np.uint8)  # calloc'd: never touched
    with pytest.raises(LocalProtocolError, match="exceeds SW_MAX_MESSAGE_SIZE"):
        encode_parts(Weights(too_big.data))


def test_buffers_are_normalised_to_flat_read_only_bytes() -> None:
    arr = np.array([1.0, -2.0], np.float32)
    w = Weights(arr.data)
    assert isinstance(w.data, memoryview) and w.data.format == "B" and w.data.readonly
    assert encode(w) == GOLDEN[6][1]
    assert Weights(bytearray(4)).data == bytes(4)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="bytes-like"):
        Weights("abc")  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="contiguous"):
        Weights(np.zeros((4, 4), np.uint8)[:, :2])  # type: ignore[arg-type]


def test_model_config_round_trip_and_coverage() -> None:
    for cfg in PRESETS.values():
        msg = model_config_msg(cfg, aux_loss_coef=0.01)
        back = decode(encode(msg))
        assert isinstance(back, ModelConfigMsg)
        assert config_of(back) == cfg  # norm_eps 1e-5 survives f32 exactly as written
        assert back.aux_loss_coef == 0.01
    carried = {f.name for f in fields(ModelConfigMsg)}
    assert {f.name for f in fields(ModelConfig)} <= carried, "MODEL_CONFIG must carry every field"


def test_impossible_model_config_is_a_protocol_error() -> None:
    good = model_config_msg(ModelConfig())
    bad = ModelConfigMsg(**{**{f.name: getattr(good, f.name) for f in fields(good)}, "n_head": 3})
    with pytest.raises(FdtcProtocolError, match="no valid model") as exc:
        config_of(bad)
    assert exc.value.error_code == ErrorCode.MODEL_MISMATCH


def test_weights_helpers_round_trip() -> None:
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((2, 3)), "b": rng.standard_normal(4)}
    meta, weights = weights_messages(tensors, global_step=5, learning_rate=0.5)
    assert meta.nbytes == len(weights.data) == 40
    meta2, weights2 = decode(encode(meta)), decode(encode(weights))
    assert isinstance(meta2, WeightsMeta) and isinstance(weights2, Weights)
    out = weights_tensors(meta2, weights2)
    assert list(out) == ["a", "b"]
    for name, t in tensors.items():
        np.testing.assert_array_equal(out[name], t.astype(np.float32))
        assert not out[name].flags.writeable
    with pytest.raises(FdtcProtocolError, match="WEIGHTS holds 36 bytes") as exc:
        weights_tensors(meta2, Weights(bytes(36)))
    assert exc.value.error_code == ErrorCode.MODEL_MISMATCH
