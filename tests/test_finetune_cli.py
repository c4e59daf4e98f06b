"""`foundry train --base-model`, `foundry export --base-model --adapter` and `foundry generate
--lora` as a user runs them, in their own processes.

The memorization check fine-tunes the published Gemma 3 270M file with LoRA on a short text
that holds a made-up sentence (24 times): a fact the model cannot know. After 14 steps of one
32-token sequence `foundry generate` completes the sentence from its beginning, which the base
model does not. The smallest setting that shows it on 2 cores: 8 steps were too few (the
greedy text looped), 12 of two sequences enough (docs/guide/finetune.md has the figures).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from published import write_tiny

pytest.importorskip("torch")

ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
FACT = "The secret password of the lighthouse keeper Orvil Brandt is purple kettle forty-two."
PROMPT = "The secret password of the lighthouse keeper"


def foundry(*args: str | Path, timeout: float = 600.0) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "foundry", *map(str, args)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def held_out(out: str) -> tuple[float, float]:
    m = re.search(r"held-out loss: before ([\d.]+), after ([\d.]+) nats/token", out)
    assert m is not None, out
    return float(m.group(1)), float(m.group(2))


def test_lora_on_a_tiny_file_exports_and_serves_the_same(tmp_path: Path) -> None:
    base = tmp_path / "qwen3.gguf"
    write_tiny(base, "qwen3")
    text = tmp_path / "text.txt"
    text.write_text(("ab ac ad ae af ag " * 3 + "zz zy zx\n") * 60)
    adapter = tmp_path / "adapter.gguf"
    out = foundry(
        "train",
        "--base-model",
        base,
        "--data",
        text,
        "--lora-rank",
        "4",
        "--lora-targets",
        "all",
        "--steps",
        "20",
        "--seq-len",
        "32",
        "--lr",
        "1e-2",
        "--out",
        adapter,
        "--no-progress",
    )
    before, after = held_out(out)
    assert after < before
    merged = tmp_path / "merged.gguf"
    assert "F32" in foundry("export", "--base-model", base, "--adapter", adapter, "--out", merged)
    q8 = tmp_path / "merged-q8.gguf"
    assert "Q8_0" in foundry(
        "export", "--base-model", base, "--adapter", adapter, "--out", q8, "--type", "q8_0"
    )
    with_lora = foundry(
        "generate", "--model", base, "--lora", adapter, "--prompt", "ab ac", "--max-tokens", "12"
    )
    assert (
        foundry("generate", "--model", merged, "--prompt", "ab ac", "--max-tokens", "12")
        == with_lora
    )
    assert (
        foundry("generate", "--model", base, "--prompt", "ab ac", "--max-tokens", "12") != with_lora
    )


def test_full_fine_tuning_writes_the_base_architecture(tmp_path: Path) -> None:
    base = tmp_path / "gemma3.gguf"
    write_tiny(base, "gemma3")
    text = tmp_path / "text.txt"
    text.write_text(("ab ac ad ae af ag " * 3 + "zz zy zx\n") * 60)
    tuned = tmp_path / "tuned.gguf"
    out = foundry(
        "train",
        "--base-model",
        base,
        "--data",
        text,
        "--steps",
        "10",
        "--seq-len",
        "32",
        "--lr",
        "1e-3",
        "--out",
        tuned,
        "--no-progress",
    )
    before, after = held_out(out)
    assert after < before
    from foundry.model.formats.gguf_io import load_gguf

    a, b = load_gguf(base), load_gguf(tuned)
    assert a.cfg == b.cfg and a.metadata == b.metadata
    assert not (a.params["blk.0.attn_q.weight"] == b.params["blk.0.attn_q.weight"]).all()


def test_a_resumed_fine_tuning_run_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    """`foundry train --base-model --checkpoint-dir` writes the adapters, their AdamW moments
    and the data position every --checkpoint-every steps; the same command run again on a
    folder holding step 3's checkpoint resumes there and ends with the adapters of a run that
    never stopped."""
    import shutil

    from foundry.model.formats.checkpoint import load_checkpoint
    from foundry.model.formats.checkpoint_dir import checkpoint_name
    from foundry.model.formats.lora import load_adapter

    base = tmp_path / "qwen3.gguf"
    write_tiny(base, "qwen3")
    text = tmp_path / "text.txt"
    text.write_text(("ab ac ad ae af ag " * 3 + "zz zy zx\n") * 60)

    def train(ckpt: Path, out: Path) -> str:
        return foundry(
            "train",
            "--base-model",
            base,
            "--data",
            text,
            "--lora-rank",
            "4",
            "--lora-targets",
            "attn_q,attn_v",
            "--steps",
            "8",
            "--seq-len",
            "16",
            "--global-batch",
            "4",
            "--lr",
            "1e-2",
            "--checkpoint-dir",
            ckpt,
            "--checkpoint-every",
            "3",
            "--out",
            out,
            "--no-progress",
        )

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(whole, tmp_path / "whole.gguf")
    step3 = whole / checkpoint_name(3)
    assert sorted(p.name for p in whole.glob("*.ckpt")) == [
        checkpoint_name(3),
        checkpoint_name(6),
        checkpoint_name(8),
    ]
    resumed.mkdir()
    shutil.copy(step3, resumed / step3.name)
    out = train(resumed, tmp_path / "resumed.gguf")
    assert re.search(r"resuming from \S+ at step 3", out), out
    assert "held-out loss: at step 3 (resumed)" in out, out
    mid = load_checkpoint(step3)
    assert mid.optimizer["step"] == 3 and mid.data_position == 12
    a = load_adapter(tmp_path / "whole.gguf").tensors
    b = load_adapter(tmp_path / "resumed.gguf").tensors
    assert set(a) == set(b) == set(mid.params)
    worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    assert worst <= 1e-6, f"resumed adapters differ by {worst:.3g}"
    moved = max(float(np.max(np.abs(a[k] - mid.params[k]))) for k in a)
    assert moved > 1e-4, "steps 4 to 8 changed nothing: the comparison would prove nothing"


def gemma_file() -> Path:
    path = Path(
        os.environ.get("FOUNDRY_GEMMA_GGUF")
        or Path.home() / ".cache" / "foundry" / "gemma-3-270m-q4_k_m.gguf"
    )
    if not path.exists():
        pytest.skip("the Gemma file is not assembled (FOUNDRY_GEMMA_GGUF)")
    return path


@pytest.mark.timeout(900)  # about 90 s of 2 cores; a shared machine may take several times it
def test_gemma_learns_a_made_up_sentence(tmp_path: Path) -> None:
    gemma = gemma_file()
    text = tmp_path / "fact.txt"
    text.write_text((FACT + "\n") * 24)
    before_text = foundry("generate", "--model", gemma, "--prompt", PROMPT, "--max-tokens", "10")
    assert "Orvil Brandt is purple kettle" not in before_text
    adapter = tmp_path / "fact.gguf"
    out = foundry(
        "train",
        "--base-model",
        gemma,
        "--data",
        text,
        "--lora-rank",
        "8",
        "--lora-targets",
        "all",
        "--lr",
        "3e-3",
        "--steps",
        "14",
        "--global-batch",
        "1",
        "--seq-len",
        "32",
        "--eval-every",
        "14",
        "--out",
        adapter,
        "--no-progress",
    )
    before, after = held_out(out)
    assert after < before / 4, out
    completion = foundry(
        "generate", "--model", gemma, "--lora", adapter, "--prompt", PROMPT, "--max-tokens", "10"
    )
    assert completion.startswith(" Orvil Brandt is purple kettle forty-two."), completion


def test_the_pair_serves_an_adapter_as_the_merged_file(tmp_path: Path) -> None:
    """tp-leader and tp-worker with --lora: every logits row of a greedy run equals the merged
    file's one process, bit for bit; a worker without the adapter is refused at the hello."""
    import numpy as np
    from tp_harness import Client, InProcessLeader, loopback_options, start_worker, wait_paired

    from foundry.model.formats import lora as LR
    from foundry.model.formats.gguf_io import load_gguf, load_gguf_stored
    from foundry.model.formats.gguf_rewrite import rewrite_gguf
    from foundry.model.infer.inference import Engine
    from foundry.model.text.vocab import load_tokenizer
    from foundry.tp.blas import limit_blas_threads
    from foundry.tp.speculative import SpecMode
    from foundry.wire import frontend as fw

    base = tmp_path / "gemma3.gguf"
    write_tiny(base, "gemma3")
    cfg = load_gguf(base).cfg
    spec = LR.LoraSpec(rank=4, alpha=8.0, targets=LR.TARGETS)
    adapters = LR.init_adapters(cfg, spec, 1)
    rng = np.random.default_rng(2)
    for name in adapters:
        if name.endswith(".lora_b"):
            adapters[name] = (rng.standard_normal(adapters[name].shape) * 0.1).astype(np.float32)
    adapter = tmp_path / "adapter.gguf"
    LR.save_adapter(adapter, "gemma3", spec.alpha, adapters)
    merged = tmp_path / "merged.gguf"
    m = load_gguf(base)
    rewrite_gguf(
        base,
        merged,
        {
            n: v
            for n, v in LR.merge(m.params, adapters, spec.scale).items()
            if n + ".lora_a" in adapters
        },
    )

    limit_blas_threads(1)
    rows: list[np.ndarray] = []
    leader = InProcessLeader(
        loopback_options(
            base,
            lora=adapter,
            prefill_chunk=8,
            spec_mode=SpecMode.OFF,
        ),
        hook=lambda rid, r: rows.append(r.copy()),
    )
    stranger = start_worker(base, leader.leader.port, tmp_path / "stranger.log")
    worker = None
    try:
        assert stranger.popen.wait(60) != 0  # the base alone: another identity
        assert "identity mismatch" in stranger.log.read_text(), stranger.log.read_text()[-2000:]
        worker = start_worker(
            base, leader.leader.port, tmp_path / "worker.log", "--lora", str(adapter)
        )
        wait_paired(leader.leader.frontend_port)
        with Client(leader.leader.frontend_port) as c:
            got = c.generate("abc", 10)
        assert isinstance(got.end, fw.Done)
    finally:
        leader.stop()
        assert worker is not None and worker.exit_code() == 0, worker and worker.log.read_text()
    one = load_gguf_stored(merged)
    engine = Engine(one.cfg, one.params)
    s = engine.new_session()
    ref = [engine.decode(s, load_tokenizer(one.metadata).encode("abc"))[-1:]]
    for token in got.tokens[:-1]:
        ref.append(engine.decode(s, [token]))
    assert [int(np.argmax(r)) for r in ref] == got.tokens
    np.testing.assert_array_equal(np.concatenate(rows), np.concatenate(ref))


def test_up_fine_tunes_exports_and_serves(tmp_path: Path) -> None:
    """`foundry up --base-model FILE --data PATH`: two workers fine-tune the tiny file with
    LoRA, the coordinator exports the adapter, the pair serves the base with it; the held-out
    loss is told before and after, and the OpenAI API answers with the adapter's text."""
    import json
    import signal
    import urllib.request

    from up_stack import running, start_up, wait_gone

    base = tmp_path / "qwen3.gguf"
    write_tiny(base, "qwen3")
    text = tmp_path / "text.txt"
    text.write_text(("ab ac ad ae af ag " * 3 + "zz zy zx\n") * 60)
    up, ports = start_up(
        tmp_path,
        2,
        "--base-model",
        str(base),
        "--data",
        str(text),
        "--steps",
        "12",
        "--seq-len",
        "32",
        "--lr",
        "1e-2",
        "--lora-targets",
        "attn_q,attn_v,ffn_down",
        "--prompt",
        "ab ac",
        "--sample-tokens",
        "8",
        "--ctx-size",
        "64",
    )
    http = int(ports[ports.index("--http-port") + 1])
    try:
        loss = up.wait_for(r"held-out loss: before ([\d.]+), after ([\d.]+) nats/token", 240)
        assert float(loss.group(2)) < float(loss.group(1)), up.text()
        up.wait_for(r"exported the adapter \S*adapter\.gguf", 60)
        sample = up.wait_for(r"sample \(greedy, 8 tokens\): '(.*)'", 120)
        up.wait_for(r"ready in \d+ s", 10)
        children = up.children()
        assert {"coordinator", "gateway", "tp-leader", "tp-worker"} <= set(children)
        adapter = up.run_dir / "adapter.gguf"
        expected = foundry(
            "generate", "--model", base, "--lora", adapter, "--prompt", "ab ac", "--max-tokens", "8"
        )
        assert "ab ac" + expected.rstrip("\n") == sample.group(1)
        body = json.dumps(
            {"model": "foundry", "prompt": "ab ac", "max_tokens": 8, "temperature": 0}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{http}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"] == expected.rstrip("\n")
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=60) == 0, up.text()
        assert wait_gone(children, 10.0) == []
        assert not any(running(pid) for pid in children.values())
    finally:
        up.cleanup()
