"""Hostile inputs with real processes: poisoned models, damaged checkpoints, outputs that must
not be overwritten, a frozen leader, undecodable requests, refused and garbage peers. Each
case is a row of the fault table in docs/guide/recovering.md ("Faults and bad input").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import grpc
import numpy as np
import pytest
from procs import ENV, Service, coordinator, worker
from tp_harness import (
    CFG,
    Client,
    LeaderProc,
    Proc,
    make_model,
    start_leader,
    start_worker,
    wait_paired,
)

from foundry.api.v1 import inference_pb2
from foundry.model.formats.checkpoint import (
    ALIGN,
    HEADER,
    CheckpointError,
    CheckpointRefused,
    CheckpointState,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    resume_checkpoint,
    save_checkpoint,
    start_fresh,
    verify_checkpoint,
)
from foundry.model.formats.gguf_io import load_gguf, save_gguf
from foundry.model.infer.inference import Engine
from foundry.model.nn import transformer as T
from foundry.model.spec.config import ModelConfig
from foundry.model.text.vocab.byte import encode
from foundry.wire import frontend as fw
from foundry.wire.tp import HELLO_PREFIX, HELLO_SIZE, TP_HELLO_MAGIC, TP_PROTOCOL_VERSION

GATEWAY_LINE = r"gateway listening: grpc 127\.0\.0\.1:(\d+)"
F32 = np.float32


def foundry(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """One ``foundry`` command run to its end."""
    return subprocess.run([sys.executable, "-m", "foundry", *args], capture_output=True,
                          text=True, env=ENV, timeout=timeout)


def base_params(cfg: ModelConfig = CFG) -> dict[str, np.ndarray]:
    """Random weights, perturbed beyond init so routing varies per token (tp_harness's)."""
    rng = np.random.default_rng(100)
    params = T.init_params(cfg, seed=0)
    for p in params.values():
        p += F32(0.1) * rng.standard_normal(p.shape, dtype=F32)
    return params


# ---------------------------------------------------------------------------- a poisoned model


def _finite_greedy(engine: Engine, prompt: str, n: int) -> int:
    """How many greedy steps (the prefill's row, then one per token) give finite logits."""
    s = engine.new_session()
    with np.errstate(all="ignore"):
        row = engine.decode(s, [int(t) for t in encode(prompt, bos=True)])[-1]
        for i in range(n):
            if not np.isfinite(row).all():
                return i
            row = engine.decode(s, [int(np.argmax(row))])[-1]
    return n


@dataclass(frozen=True)
class Poisoned:
    path: Path
    good: str  # a prompt whose greedy 3 tokens never meet the poisoned expert
    bad: str  # a prompt whose prefill already gives NaN logits
    late: str  # a prompt that decodes at least one token, then meets NaN


def poisoned_model(path: Path) -> Poisoned:
    """Finite weights that overflow: one routed expert of layer 0 scaled by 1e20, so that
    every token routed to it makes infinities (gate x up = 1e40 > f32 max) and then NaN. The
    file loads (no weight is NaN or infinite); which prompts meet the expert is computed here
    with the single-process engine, for the first expert that splits the prompts."""
    base = base_params()
    letters = "abcdefghijklmnopqrstuvwxyz"
    for e in range(CFG.n_expert):
        params = {k: v.copy() for k, v in base.items()}
        for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"):
            params[name][e] *= F32(1e20)
        engine = Engine(CFG, params)
        steps = {c: _finite_greedy(engine, c, 3) for c in letters}
        good = [c for c in letters if steps[c] == 3]
        bad = [c for c in letters if steps[c] == 0]
        late = [c for c in letters if 1 <= steps[c] < 3]
        if good and bad and late:
            save_gguf(path, CFG, params)
            return Poisoned(path, good[0], bad[0], late[0])
    raise AssertionError("no expert splits the prompts into good, bad and late ones")


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Poisoned:
    return poisoned_model(tmp_path_factory.mktemp("poison") / "poisoned.gguf")


@dataclass
class Stack:
    leader: LeaderProc
    worker: Proc
    gateway: Service
    target: str


@contextlib.contextmanager
def serving(model: Path, logs: Path, *leader_flags: str) -> Iterator[Stack]:
    """tp-leader + tp-worker + gateway processes on 127.0.0.1 serving ``model``."""
    leader = start_leader(model, logs / "leader.log", *leader_flags)
    worker = start_worker(model, leader.port, logs / "worker.log")
    gateway = Service(["gateway", "--listen", "127.0.0.1:0", "--coordinator-admin",
                       f"127.0.0.1:{free_port()}", "--tp-frontend",
                       f"127.0.0.1:{leader.frontend}"], logs / "gateway.log")
    try:
        wait_paired(leader.frontend)
        target = "127.0.0.1:" + gateway.wait_for(GATEWAY_LINE).group(1)
        yield Stack(leader, worker, gateway, target)
    finally:
        gateway.stop()
        leader.proc.stop(signal.SIGCONT)  # a test that stopped it
        leader.proc.stop()
        worker.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ctl_generate(target: str, prompt: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return foundry("ctl", "--gateway", target, "generate", "--prompt", prompt, *extra)


@pytest.mark.parametrize("flags", [(), ("--spec-mode", "off")], ids=["speculative", "plain"])
def test_nonfinite_logits_fail_the_request_and_the_pair_serves_on(
    poisoned: Poisoned, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    """Greedy and sampled requests whose logits turn NaN at the prefill or mid-decode fail
    alone with INTERNAL naming the model; both ranks stay up and decode the next request as
    one process does."""
    with serving(poisoned.path, tmp_path, *flags) as st:
        # The client is told the truth, through the gateway.
        run = ctl_generate(st.target, poisoned.bad, "--max-tokens", "3")
        assert run.returncode == 1, run
        assert "INTERNAL" in run.stderr and "poisoned.gguf" in run.stderr, run.stderr
        assert "cannot be sampled" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
        with Client(st.leader.frontend) as c:
            rid = 1
            for prompt in (poisoned.bad, poisoned.late):
                for temperature in (0.0, 0.8):
                    rid += 1
                    r = c.generate(prompt, 3, request_id=rid, temperature=temperature, seed=3)
                    assert isinstance(r.end, fw.Error), (prompt, temperature, r.end)
                    assert r.end.code == fw.ErrorCode.INTERNAL
                    assert "model poisoned.gguf" in r.end.message
                    assert (len(r.tokens) > 0) == (prompt == poisoned.late), r.tokens
        assert st.leader.proc.popen.poll() is None, st.leader.proc.text()
        assert st.worker.popen.poll() is None, st.worker.text()
        m = load_gguf(poisoned.path)
        engine = Engine(m.cfg, m.params)
        s = engine.new_session()
        ids = [int(t) for t in encode(poisoned.good, bos=True)]
        want = []
        row = engine.decode(s, ids)[-1]
        for _ in range(3):
            want.append(int(np.argmax(row)))
            row = engine.decode(s, [want[-1]])[-1]
        with Client(st.leader.frontend) as c:
            r = c.generate(poisoned.good, 3, request_id=7)
            assert isinstance(r.end, fw.Done), r.end
            assert r.tokens == want
            assert c.status().worker_connected
        run = ctl_generate(st.target, poisoned.good, "--max-tokens", "3")
        assert run.returncode == 0, run.stderr
        assert "request" in st.leader.proc.text() and "Traceback" not in st.leader.proc.text()
        assert "Traceback" not in st.gateway.text()


# ---------------------------------------------------------------------------- weights on load

# (tensor, file type, element or block to poison, the bytes written there)
NAN_F32 = np.array([np.nan], dtype="<f4").tobytes()
INF_F32 = np.array([-np.inf], dtype="<f4").tobytes()
INF_F16 = np.array([np.inf], dtype="<f2").tobytes()
NAN_F16 = np.array([np.nan], dtype="<f2").tobytes()


def poison_file(path: Path, tensor: str, index: int, raw: bytes) -> None:
    """Overwrite bytes of ``tensor`` in a GGUF file in place: element ``index`` of an F32 or F16
    tensor, or the f16 scale of block ``index`` of a Q8_0 / Q4_0 one."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor)
    size = {gguf.GGMLQuantizationType.F32: 4, gguf.GGMLQuantizationType.F16: 2}.get(
        t.tensor_type, gguf.GGML_QUANT_SIZES[t.tensor_type][1])
    with path.open("r+b") as f:
        f.seek(int(t.data_offset) + index * size)
        f.write(raw)


@pytest.mark.parametrize(("dtype", "tensor", "index", "raw"), [
    ("f32", "blk.0.attn_q.weight", 0, NAN_F32),
    ("f32", "output_norm.weight", 63, INF_F32),
    ("f16", "blk.1.ffn_down_exps.weight", 5000, INF_F16),
    ("q8_0", "token_embd.weight", 100, NAN_F16),
    ("q4_0", "blk.1.attn_v.weight", 7, INF_F16),
], ids=["f32-nan", "f32-norm-inf", "f16-inf", "q8_0-scale-nan", "q4_0-scale-inf"])
def test_a_weight_that_is_not_a_number_is_refused_at_load_naming_the_tensor(
    tmp_path: Path, dtype: str, tensor: str, index: int, raw: bytes
) -> None:
    model = tmp_path / "model.gguf"
    save_gguf(model, CFG, base_params(), dtype=dtype)  # type: ignore[arg-type]
    poison_file(model, tensor, index, raw)
    run = foundry("generate", "--model", str(model), "--prompt", "a", "--max-tokens", "1")
    assert run.returncode == 2, run
    assert f"tensor {tensor!r} holds NaN or infinity" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    if dtype == "q8_0":  # both ranks load the same check
        for cmd in (["tp-leader", "--listen", "127.0.0.1:0", "--frontend-listen", "127.0.0.1:0"],
                    ["tp-worker", "--leader", f"127.0.0.1:{free_port()}"]):
            run = foundry(*cmd, "--model", str(model))
            assert run.returncode == 2, run
            assert f"tensor {tensor!r} holds NaN" in run.stderr, run.stderr
            assert "Traceback" not in run.stderr


# ---------------------------------------------------------------------------- export


def write_checkpoint(directory: Path, step: int, params: dict[str, np.ndarray] | None = None,
                     keep_last: int = 100) -> Path:
    state = CheckpointState(config=CFG, step=step, params=params or base_params(),
                            optimizer={"step": 0, "m": {}, "v": {}}, data_position=0)
    return save_checkpoint(directory, state, keep_last=keep_last)


@pytest.mark.parametrize(("tensor", "value", "dtype", "ok"), [
    ("blk.0.attn_q.weight", 70000.0, "f16", False),
    ("output.weight", -1.0e5, "f16", False),
    ("blk.1.ffn_up_exps.weight", 1.0e5, "q8_0", True),
    ("blk.1.ffn_up_exps.weight", 9.0e6, "q8_0", False),
    ("token_embd.weight", 6.0e5, "q4_0", False),
    ("token_embd.weight", 6.0e5, "f32", True),
    ("blk.0.ffn_norm.weight", np.nan, "f32", False),
], ids=["f16-q", "f16-output-negative", "q8_0-fits", "q8_0-scale", "q4_0-scale", "f32-fits",
        "nan"])
def test_export_refuses_values_that_overflow_the_target_type(
    tmp_path: Path, tensor: str, value: float, dtype: str, ok: bool
) -> None:
    params = base_params()
    params[tensor].reshape(-1)[3] = value
    ckpt = write_checkpoint(tmp_path / "ck", 5, params)
    out = tmp_path / "model.gguf"
    run = foundry("export", "--checkpoint", str(ckpt), "--out", str(out), "--type", dtype)
    if ok:
        assert run.returncode == 0, run.stderr
        assert "RuntimeWarning" not in run.stderr
        got = load_gguf(out).params[tensor].reshape(-1)[3]
        assert abs(got - value) <= abs(value) * 0.01
        return
    assert run.returncode == 1, run
    assert f"cannot write tensor {tensor!r}" in run.stderr, run.stderr
    if np.isfinite(value):
        assert f"largest magnitude {abs(value):.6g}" in run.stderr, run.stderr
    else:
        assert "NaN or infinity" in run.stderr
    assert "Traceback" not in run.stderr and "RuntimeWarning" not in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # nothing written, no temp


def test_export_writes_only_new_files_or_gguf_files(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    for step in (10, 20):
        write_checkpoint(ck, step)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    before = {p: p.read_bytes() for p in [*ck.iterdir(), notes]}

    def export(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return foundry("export", "--checkpoint", str(ck), "--out", str(out), *extra)

    for target, extra in ((ck / "step-000020.ckpt", ("--force",)), (notes, ())):
        run = export(target, *extra)
        assert run.returncode == 2, run
        assert "is not a GGUF file" in run.stderr and "not overwriting it" in run.stderr
    for target, why in ((ck, "is a folder"), (tmp_path / "no" / "m.gguf", "does not exist")):
        run = export(target)
        assert run.returncode == 2 and why in run.stderr, run
    assert {p: p.read_bytes() for p in before} == before
    model = tmp_path / "model.gguf"
    assert export(model).returncode == 0
    first = model.read_bytes()
    run = export(model)
    assert run.returncode == 2 and "pass --force to replace it" in run.stderr, run
    assert model.read_bytes() == first
    write_checkpoint(ck, 30, {k: v * F32(0.5) for k, v in base_params().items()})
    run = export(model, "--force")
    assert run.returncode == 0, run.stderr
    assert "step 30" in run.stdout and model.read_bytes() != first
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # The other commands that write a model file keep a checkpoint or a text file too.
    for cmd in (["model", "init", "--out", str(notes)],
                ["train", "--steps", "1", "--out", str(ck / "step-000030.ckpt")]):
        run = foundry(*cmd)
        assert run.returncode == 2 and "is not a GGUF file" in run.stderr, run
    assert notes.read_text() == "my notes\n"


# ---------------------------------------------------------------------------- checkpoints


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
        [f"step-{new_step:06d}.ckpt.damaged.1"] if f"step-{new_step:06d}.ckpt" in damaged else [])


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
        "step-000010.ckpt", "step-000020.ckpt", "step-000099.ckpt"]
    assert resume_checkpoint(d) is None


def test_train_resumes_past_a_damaged_checkpoint_and_refuses_when_none_verifies(
    tmp_path: Path,
) -> None:
    d = tmp_path / "ck"
    train = ["train", "--global-batch", "2", "--seq-len", "16", "--eval-every", "100",
             "--sample-every", "0", "--no-progress", "--checkpoint-every", "2",
             "--checkpoint-dir", str(d)]
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
    first = Service(["train", "--steps", "100000", "--global-batch", "2", "--seq-len", "16",
                     "--eval-every", "100000", "--sample-every", "0", "--no-progress",
                     "--checkpoint-dir", str(d)], tmp_path / "first.log")
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


# ---------------------------------------------------------------------------- the gateway


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("long") / "model.gguf", ModelConfig(n_ctx=2048))


def test_a_frozen_leader_fails_generations_in_flight_and_new_ones_at_once(
    long_model: Path, tmp_path: Path
) -> None:
    """SIGSTOP of the leader mid-generation: the call in flight ends UNAVAILABLE once the
    leader has missed the health probes (not at its deadline, 120 s here); a new call while
    it is stopped ends UNAVAILABLE "not serving" at once; after SIGCONT it serves again."""
    with serving(long_model, tmp_path, "--spec-mode", "off") as st, \
            grpc.insecure_channel(st.target) as channel:
        generate = channel.unary_stream(
            "/foundry.v1.InferenceService/Generate",
            request_serializer=inference_pb2.GenerateRequest.SerializeToString,
            response_deserializer=inference_pb2.GenerateResponse.FromString,
        )
        call = generate(inference_pb2.GenerateRequest(prompt="a", max_tokens=2000),
                        timeout=120)
        got, stopped = 0, False
        with pytest.raises(grpc.RpcError) as exc:
            for response in call:
                got += len(response.tokens)
                if got >= 3 and st.leader.proc.popen.poll() is None:
                    st.leader.proc.popen.send_signal(signal.SIGSTOP)
                    stopped = True
        assert stopped
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value
        assert "stopped making progress" in (exc.value.details() or ""), exc.value.details()
        run = foundry("ctl", "--gateway", st.target, "generate", "--prompt", "a",
                      "--max-tokens", "4")
        assert run.returncode == 1, run
        assert "UNAVAILABLE" in run.stderr and "is not serving" in run.stderr, run.stderr
        seen = len(st.gateway.text())
        st.leader.proc.popen.send_signal(signal.SIGCONT)
        st.gateway.wait_for(r"tp_leader is reachable", after=seen)
        run = ctl_generate(st.target, "a", "--max-tokens", "4")
        assert run.returncode == 0, run.stderr
        assert "Traceback" not in st.gateway.text()


def test_undecodable_requests_are_invalid_arguments(tmp_path: Path) -> None:
    gateway = Service(["gateway", "--listen", "127.0.0.1:0", "--coordinator-admin",
                       f"127.0.0.1:{free_port()}", "--tp-frontend", f"127.0.0.1:{free_port()}"],
                      tmp_path / "gateway.log")
    try:
        target = "127.0.0.1:" + gateway.wait_for(GATEWAY_LINE).group(1)
        with grpc.insecure_channel(target) as channel:
            cases = [
                ("/foundry.v1.InferenceService/Generate", True, b"\x0a\x02\xff\xfe\x10\x04"),
                ("/foundry.v1.InferenceService/Generate", True, b"\x0a\x7f\x41"),  # cut short
                ("/foundry.v1.ModelService/ExportModel", False, b"\x0a\x03a\xc3("),
                ("/foundry.v1.TrainingService/GetTrainingStatus", False, b"\xff\xff\xff"),
            ]
            for method, streaming, raw in cases:
                # No serializers: the raw bytes go out as they are.
                rpc = (channel.unary_stream if streaming else channel.unary_unary)(method)
                with pytest.raises(grpc.RpcError) as exc:
                    result = rpc(raw, timeout=10)
                    if streaming:
                        list(result)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, exc.value)
                assert "is not a valid" in (exc.value.details() or ""), exc.value.details()
        assert "Traceback" not in gateway.text() and "DecodeError" not in gateway.text()
    finally:
        gateway.stop()


def test_ctl_generate_has_a_deadline(tmp_path: Path) -> None:
    """A gateway that accepts the connection and never answers (a frozen process): `ctl
    generate --timeout S` ends DEADLINE_EXCEEDED; without --timeout the default applies."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        run = ctl_generate(target, "a", "--timeout", "1.5")
        assert run.returncode == 1, run
        assert "DEADLINE_EXCEEDED" in run.stderr, run.stderr
    help_text = foundry("ctl", "generate", "--help").stdout
    assert "300 s for generate" in " ".join(help_text.split())


# ---------------------------------------------------------------------------- refused peers


def test_a_tp_worker_that_meets_garbage_hellos_keeps_waiting_for_a_good_leader(
    long_model: Path, tmp_path: Path
) -> None:
    """A stray process on the leader's port answers two hellos with garbage (a version that
    does not exist; a body of random bytes), then goes; the real leader starts there and the
    worker pairs with it."""
    rng = np.random.default_rng(5)
    hellos = [
        HELLO_PREFIX.pack(TP_HELLO_MAGIC, 0xBEEF, HELLO_SIZE) + rng.bytes(HELLO_SIZE - 8),
        HELLO_PREFIX.pack(TP_HELLO_MAGIC, TP_PROTOCOL_VERSION, HELLO_SIZE)
        + rng.bytes(HELLO_SIZE - 8),
    ]
    stray = socket.create_server(("127.0.0.1", 0))
    port = stray.getsockname()[1]
    worker = start_worker(long_model, port, tmp_path / "worker.log")
    leader: LeaderProc | None = None
    try:
        for hello in hellos:
            conn, _ = stray.accept()
            with conn:
                conn.sendall(hello)
                conn.settimeout(10)
                with contextlib.suppress(OSError):
                    while conn.recv(4096):  # until the worker hangs up on it
                        pass
        stray.close()
        leader = start_leader(long_model, tmp_path / "leader.log", "--listen",
                              f"127.0.0.1:{port}")
        wait_paired(leader.frontend)
        assert worker.popen.poll() is None
        text = worker.text()
        assert "does not match this worker" in text and "dialing again" in text, text
    finally:
        stray.close()
        if leader is not None:
            leader.proc.stop()
        worker.stop()


def test_a_worker_refused_by_tls_backs_off_and_says_why(tmp_path: Path) -> None:
    for name in ("ca", "other"):
        run = foundry("certs", "--out", str(tmp_path / name))
        assert run.returncode == 0, run.stderr
    ca, other = tmp_path / "ca", tmp_path / "other"
    coord, port, _ = coordinator(tmp_path, "--tls-cert", str(ca / "coordinator.pem"),
                                 "--tls-key", str(ca / "coordinator-key.pem"),
                                 "--tls-ca", str(ca / "ca.pem"))
    # The worker trusts the right CA, but its own certificate is from another one.
    w = worker(tmp_path, port, "w0", "--tls-cert", str(other / "worker.pem"),
               "--tls-key", str(other / "worker-key.pem"), "--tls-ca", str(ca / "ca.pem"))
    try:
        line = r"ended the link before accepting this worker: .*; retrying in ([\d.]+)s"
        m = w.wait_for(line)
        delays = [float(m.group(1))]
        for _ in range(3):
            m = w.wait_for(line, after=m.end())
            delays.append(float(m.group(1)))
        # Capped exponential backoff with jitter: attempt k waits within [c/2, c],
        # c = 0.25 * 2**k (the worker's default --backoff-cap is far above these).
        for k, delay in enumerate(delays, start=1):
            assert 0.125 * 2**k <= delay <= 0.25 * 2**k, delays
        assert "--tls-ca did not sign" in w.text()
        refusals = coord.text().count("refused 127.0.0.1")
        assert "CERTIFICATE_VERIFY_FAILED" in coord.text()
        assert refusals <= len(delays) + 2, refusals  # one per attempt, not dozens
    finally:
        w.stop()
        coord.stop()


# ---------------------------------------------------------------------------- checkpoint metadata


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


@pytest.mark.parametrize(("field", "value", "says"), [
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
])
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


# ---------------------------------------------------------------------------- the coordinator


def test_the_coordinator_never_trains_over_checkpoints_that_do_not_verify(tmp_path: Path) -> None:
    """The issue's run: checkpoints every 2 steps, keep 1, the newest damaged. The restart
    refuses (it used to start again at step 1 and prune every new checkpoint); --fresh moves
    the files aside and starts at step 0. Meanwhile a second coordinator on the same folder
    is refused with the first one's pid, and a file given as the folder is refused."""
    d = tmp_path / "ckpt"
    flags = ("--max-steps", "4", "--global-batch", "4", "--seq-len", "16",
             "--checkpoint-every", "2", "--keep-checkpoints", "1")
    coord, port, _ = coordinator(tmp_path, *flags)
    try:
        second = foundry("coordinator", "--listen", "127.0.0.1:0", "--admin-listen",
                         "127.0.0.1:0", "--checkpoint-dir", str(d))
        assert second.returncode == 2, second
        assert f"in use by another writer (pid {coord.pid}, foundry coordinator)" in (
            second.stderr)
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
    run = foundry("coordinator", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                  "--checkpoint-dir", str(d), *flags)
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


@pytest.mark.parametrize(("field", "value", "says"), [
    ("extra.sync_every", None, "'extra.sync_every' must be an integer"),
    ("step", -5, "'step' must be in [0, 4294967295], got -5"),
])
def test_the_coordinator_refuses_checkpoint_metadata_that_does_not_fit_naming_the_field(
    tmp_path: Path, field: str, value: Any, says: str
) -> None:
    cfg = ModelConfig()
    params = T.init_params(cfg, seed=0)
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    ckpt = save_checkpoint(tmp_path / "ckpt", CheckpointState(
        config=cfg, step=3, params=params, optimizer={"step": 3, "m": zeros, "v": zeros},
        data_position=12, extra={"sync_every": 1},
    ))
    rewrite_metadata(ckpt, _set(field, value))
    run = foundry("coordinator", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                  "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert run.returncode == 1, run
    assert says in run.stderr and "Traceback" not in run.stderr, run.stderr
