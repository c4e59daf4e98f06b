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

import pytest
from published import write_tiny

pytest.importorskip("torch")

ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
FACT = "The secret password of the lighthouse keeper Orvil Brandt is purple kettle forty-two."
PROMPT = "The secret password of the lighthouse keeper"


def foundry(*args: str | Path, timeout: float = 600.0) -> str:
    done = subprocess.run([sys.executable, "-m", "foundry", *map(str, args)],
                          capture_output=True, text=True, env=ENV, timeout=timeout, check=False)
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
    out = foundry("train", "--base-model", base, "--data", text, "--lora-rank", "4",
                  "--lora-targets", "all", "--steps", "20", "--seq-len", "32", "--lr", "1e-2",
                  "--out", adapter, "--no-progress")
    before, after = held_out(out)
    assert after < before
    merged = tmp_path / "merged.gguf"
    assert "F32" in foundry("export", "--base-model", base, "--adapter", adapter,
                            "--out", merged)
    q8 = tmp_path / "merged-q8.gguf"
    assert "Q8_0" in foundry("export", "--base-model", base, "--adapter", adapter,
                             "--out", q8, "--type", "q8_0")
    with_lora = foundry("generate", "--model", base, "--lora", adapter, "--prompt", "ab ac",
                        "--max-tokens", "12")
    assert foundry("generate", "--model", merged, "--prompt", "ab ac",
                   "--max-tokens", "12") == with_lora
    assert foundry("generate", "--model", base, "--prompt", "ab ac",
                   "--max-tokens", "12") != with_lora


def test_full_fine_tuning_writes_the_base_architecture(tmp_path: Path) -> None:
    base = tmp_path / "gemma3.gguf"
    write_tiny(base, "gemma3")
    text = tmp_path / "text.txt"
    text.write_text(("ab ac ad ae af ag " * 3 + "zz zy zx\n") * 60)
    tuned = tmp_path / "tuned.gguf"
    out = foundry("train", "--base-model", base, "--data", text, "--steps", "10",
                  "--seq-len", "32", "--lr", "1e-3", "--out", tuned, "--no-progress")
    before, after = held_out(out)
    assert after < before
    from foundry.model.gguf_io import load_gguf

    a, b = load_gguf(base), load_gguf(tuned)
    assert a.cfg == b.cfg and a.metadata == b.metadata
    assert not (a.params["blk.0.attn_q.weight"] == b.params["blk.0.attn_q.weight"]).all()


def gemma_file() -> Path:
    path = Path(os.environ.get("FOUNDRY_GEMMA_GGUF")
                or Path.home() / ".cache" / "foundry" / "gemma-3-270m-q4_k_m.gguf")
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
    out = foundry("train", "--base-model", gemma, "--data", text, "--lora-rank", "8",
                  "--lora-targets", "all", "--lr", "3e-3", "--steps", "14",
                  "--global-batch", "1", "--seq-len", "32", "--eval-every", "14",
                  "--out", adapter, "--no-progress")
    before, after = held_out(out)
    assert after < before / 4, out
    completion = foundry("generate", "--model", gemma, "--lora", adapter, "--prompt", PROMPT,
                         "--max-tokens", "10")
    assert completion.startswith(" Orvil Brandt is purple kettle forty-two."), completion
