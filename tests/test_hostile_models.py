"""Hostile model files with real processes: weights that overflow or are not numbers, exports
that cannot hold them or would overwrite a file, GGUF metadata of the wrong type. Each case is a
row of the fault table in docs/guide/recovering.md ("Faults and bad input").
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
from hostile import (
    F32,
    base_params,
    ctl_generate,
    foundry,
    free_port,
    gguf_value,
    gguf_with,
    serving,
    write_checkpoint,
)
from procs import ENV
from tp_harness import CFG, Client

from foundry.model.formats.gguf_io import load_gguf, save_gguf
from foundry.model.formats.gguf_model import GGUFError
from foundry.model.infer.inference import Engine
from foundry.model.text.vocab.byte import encode
from foundry.wire import frontend as fw


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
        t.tensor_type, gguf.GGML_QUANT_SIZES[t.tensor_type][1]
    )
    with path.open("r+b") as f:
        f.seek(int(t.data_offset) + index * size)
        f.write(raw)


@pytest.mark.parametrize(
    ("dtype", "tensor", "index", "raw"),
    [
        ("f32", "blk.0.attn_q.weight", 0, NAN_F32),
        ("f32", "output_norm.weight", 63, INF_F32),
        ("f16", "blk.1.ffn_down_exps.weight", 5000, INF_F16),
        ("q8_0", "token_embd.weight", 100, NAN_F16),
        ("q4_0", "blk.1.attn_v.weight", 7, INF_F16),
    ],
    ids=["f32-nan", "f32-norm-inf", "f16-inf", "q8_0-scale-nan", "q4_0-scale-inf"],
)
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
        for cmd in (
            ["tp-leader", "--listen", "127.0.0.1:0", "--frontend-listen", "127.0.0.1:0"],
            ["tp-worker", "--leader", f"127.0.0.1:{free_port()}"],
        ):
            run = foundry(*cmd, "--model", str(model))
            assert run.returncode == 2, run
            assert f"tensor {tensor!r} holds NaN" in run.stderr, run.stderr
            assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("tensor", "value", "dtype", "ok"),
    [
        ("blk.0.attn_q.weight", 70000.0, "f16", False),
        ("output.weight", -1.0e5, "f16", False),
        ("blk.1.ffn_up_exps.weight", 1.0e5, "q8_0", True),
        ("blk.1.ffn_up_exps.weight", 9.0e6, "q8_0", False),
        ("token_embd.weight", 6.0e5, "q4_0", False),
        ("token_embd.weight", 6.0e5, "f32", True),
        ("blk.0.ffn_norm.weight", np.nan, "f32", False),
    ],
    ids=[
        "f16-q",
        "f16-output-negative",
        "q8_0-fits",
        "q8_0-scale",
        "q4_0-scale",
        "f32-fits",
        "nan",
    ],
)
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
    for cmd in (
        ["model", "init", "--out", str(notes)],
        ["train", "--steps", "1", "--out", str(ck / "step-000030.ckpt")],
    ):
        run = foundry(*cmd)
        assert run.returncode == 2 and "is not a GGUF file" in run.stderr, run
    assert notes.read_text() == "my notes\n"


def nested_arrays(depth: int) -> bytes:
    """An array of an array of ... ``depth`` deep, the innermost empty (u32 elements)."""
    return struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)


GGUF_CONFUSIONS = {
    "tokens-u32": ({"tokenizer.ggml.tokens": gguf_value("u32", 7)}, "tokenizer.ggml.tokens"),
    "eot-inf": (
        {"tokenizer.ggml.eot_token_id": gguf_value("f32", float("inf"))},
        "tokenizer.ggml.eot_token_id",
    ),
    "eot-string": (
        {"tokenizer.ggml.eot_token_id": gguf_value("str", "2")},
        "tokenizer.ggml.eot_token_id",
    ),
    "eot-bool": (
        {"tokenizer.ggml.eot_token_id": gguf_value("bool", True)},
        "tokenizer.ggml.eot_token_id",
    ),
    "nested-200000": ({"foundry.nested": nested_arrays(200_000)}, "nested more than"),
    "elements-20M": (
        {"foundry.bytes": struct.pack("<IIQ", 9, 0, 20_000_000) + bytes(20_000_000)},
        "more than 16777216 elements",
    ),
    "rope-inf": ({"llama.rope.freq_base": gguf_value("f32", float("inf"))}, "llama.rope.freq_base"),
    "rope-nan": ({"llama.rope.freq_base": gguf_value("f32", float("nan"))}, "llama.rope.freq_base"),
    "eps-inf": (
        {"llama.attention.layer_norm_rms_epsilon": gguf_value("f32", float("inf"))},
        "llama.attention.layer_norm_rms_epsilon",
    ),
    "add-bos-string": (
        {"tokenizer.ggml.add_bos_token": gguf_value("str", "yes")},
        "tokenizer.ggml.add_bos_token",
    ),
    "scores-strings": (
        {"tokenizer.ggml.scores": gguf_value("str[]", ["a"] * 259)},
        "tokenizer.ggml.scores",
    ),
    "template-u32": ({"tokenizer.chat_template": gguf_value("u32", 1)}, "tokenizer.chat_template"),
    "name-i32": ({"general.name": gguf_value("i32", -1)}, "general.name"),
}


@pytest.mark.parametrize("case", sorted(GGUF_CONFUSIONS))
def test_gguf_values_of_the_wrong_type_are_one_line_naming_the_key(
    plain_model: Path, tmp_path: Path, case: str
) -> None:
    """Finding 5: a value of another type than the key's, inf where NaN is refused, arrays
    nested 200,000 deep: each was a traceback (TypeError, OverflowError, RecursionError) or a
    message naming no key; 20 million one-byte elements would be 20 million Python objects.
    ``foundry chat`` and the tp-leader now refuse the file in one line that names the key (or
    the header's bound)."""
    keys, says = GGUF_CONFUSIONS[case]
    bad = gguf_with(plain_model, tmp_path / f"{case}.gguf", keys)
    for args in (
        ["chat", "--model", str(bad)],
        [
            "tp-leader",
            "--model",
            str(bad),
            "--listen",
            "127.0.0.1:0",
            "--frontend-listen",
            "127.0.0.1:0",
        ],
    ):
        t0 = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "foundry", *args],
            input="hi\n",
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
        )
        lines = run.stderr.strip().splitlines()
        assert run.returncode != 0 and "Traceback" not in run.stderr, (args[0], run.stderr)
        assert len(lines) == 1 and says in lines[0], (args[0], run.stderr)
        assert time.monotonic() - t0 < 30


def test_a_tensor_listed_twice_is_refused(plain_model: Path, tmp_path: Path) -> None:
    """Finding 5: a duplicated tensor name loaded silently, the later entry winning."""
    bad = gguf_with(plain_model, tmp_path / "twice.gguf", repeat_tensor=True)
    with pytest.raises(GGUFError, match="listed twice"):
        load_gguf(bad)
    run = foundry("chat", "--model", str(bad))
    assert run.returncode == 2 and "listed twice" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
