"""Fine-tuning across the swarm, with real processes on loopback: exactness against one
process, and the registrations a fine-tuning coordinator refuses (BASE_MODEL).

Each machine loads the base from its own copy of the file; only the adapters travel, so what
the coordinator holds, steps and exports is the adapters alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from procs import Service, coordinator, worker
from published import write_tiny
from test_swarm_service import admin

pytest.importorskip("torch")

from foundry.model.formats import lora as LR
from foundry.model.formats.tuning import tuned_config
from foundry.model.text.finetune_data import load_tuning_corpus
from foundry.model.text.vocab import load_tokenizer
from foundry.model.train import finetune as FT
from foundry.model.train import finetune_backend as FB
from foundry.model.train.training import Trainer, TrainSettings
from foundry.wire import fdtc

STEPS, BATCH, SEQ, LR_ = 10, 6, 16, 1e-2


def tiny_run(tmp: Path) -> tuple[Path, Path]:
    base = tmp / "qwen3.gguf"
    write_tiny(base, "qwen3")
    text = tmp / "text.txt"
    text.write_text(("ab ac ad ae af ag " * 3 + "zz zy zx\n") * 40)
    return base, text


def lora_args(base: Path, text: Path) -> list[str]:
    return [
        "--base-model",
        str(base),
        "--data",
        str(text),
        "--lora-rank",
        "4",
        "--lora-targets",
        "attn_q,attn_v,ffn_down",
        "--lora-alpha",
        "8",
    ]


@pytest.mark.parametrize("n_workers", [2])
def test_n_lora_workers_give_the_adapters_of_one_process(tmp_path: Path, n_workers: int) -> None:
    base, text = tiny_run(tmp_path)
    coord, port, admin_port = coordinator(
        tmp_path,
        *lora_args(base, text),
        "--max-steps",
        str(STEPS),
        "--global-batch",
        str(BATCH),
        "--seq-len",
        str(SEQ),
        "--lr",
        str(LR_),
        "--min-workers",
        str(n_workers),
        "--export-anywhere",
    )
    workers = []
    for i in range(n_workers):  # each its own copy of the file
        mine = tmp_path / f"copy{i}.gguf"
        shutil.copy(base, mine)
        workers.append(
            worker(tmp_path, port, f"w{i}", "--base-model", str(mine), "--data", str(text))
        )
    out = tmp_path / "adapter.gguf"
    try:
        coord.wait_for(rf"training done at step {STEPS}", within_s=180)
        assert "from 1 workers" not in coord.text()
        ack = admin(admin_port, fdtc.Export(path=str(out)), timeout_s=60)
        assert isinstance(ack, fdtc.ControlAck) and ack.ok, ack
    finally:
        for w in workers:
            w.stop()
        coord.stop()
    swarm = LR.load_adapter(out)
    # only the adapters travelled and were trained
    assert all(n.endswith((".lora_a", ".lora_b")) for n in swarm.tensors)
    assert_one_process(base, text, swarm.tensors)


LORA = LR.LoraSpec(rank=4, alpha=8.0, targets=("attn_q", "attn_v", "ffn_down"))


def one_process(
    base: Path, text: Path, steps: int, spec: LR.LoraSpec | None = LORA, lr: float = LR_
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the trainable tensors before the first step, after ``steps`` steps of one process on
    the swarm's global batches)."""
    loaded = FT.load_base(base)
    cfg = tuned_config(loaded.cfg, loaded.identity, spec)
    corpus = load_tuning_corpus(text, load_tokenizer(loaded.metadata))
    backend = FB.FineTuneBackend(loaded, spec)
    settings = TrainSettings(
        global_batch=BATCH, seq_len=SEQ, lr=lr, warmup_steps=20, total_steps=steps, weight_decay=0.0
    )
    start = FT.initial_trainable(loaded, spec, 0)
    single = Trainer(cfg, settings, {k: v.copy() for k, v in start.items()})
    for _ in range(steps):
        result = backend.compute_gradients(
            single.params, cfg, corpus, single.position, BATCH, seq_len=SEQ
        )
        single.apply(result.grads)
    return start, single.params


def assert_one_process(
    base: Path, text: Path, adapters: dict[str, np.ndarray], steps: int = STEPS
) -> None:
    """``adapters`` equal those one process trains in ``steps`` steps of the same batches."""
    _, single = one_process(base, text, steps)
    assert set(adapters) == set(single)
    worst = max(float(np.max(np.abs(adapters[k] - single[k]))) for k in single)
    assert worst <= 1e-6, f"max abs adapter difference {worst:.3g} after {steps} steps"
    moved = max(float(np.max(np.abs(single[k]))) for k in single if k.endswith(".lora_b"))
    assert moved > 1e-3, "B never left zero: the comparison would prove nothing"


def test_two_workers_fine_tune_every_tensor_as_one_process(tmp_path: Path) -> None:
    """Full fine-tuning (no --lora-rank): every tensor of the base trains and travels, and two
    workers end with the tensors of one process on the same global batches."""
    from foundry.model.formats.checkpoint import load_checkpoint
    from foundry.model.formats.checkpoint_dir import latest_checkpoint

    base, text = tiny_run(tmp_path)
    steps, lr = 4, 1e-3
    coord, port, _ = coordinator(
        tmp_path,
        "--base-model",
        str(base),
        "--data",
        str(text),
        "--max-steps",
        str(steps),
        "--global-batch",
        str(BATCH),
        "--seq-len",
        str(SEQ),
        "--lr",
        str(lr),
        "--min-workers",
        "2",
    )
    workers = [
        worker(tmp_path, port, f"w{i}", "--base-model", str(base), "--data", str(text))
        for i in range(2)
    ]
    try:
        coord.wait_for(rf"training done at step {steps}", within_s=180)
        assert "from 1 workers" not in coord.text()
    finally:
        for w in workers:
            w.stop()
        coord.stop()
    saved = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"))  # type: ignore[arg-type]
    assert saved.step == steps
    start, single = one_process(base, text, steps, None, lr)
    assert set(saved.params) == set(single) == set(start)
    assert "token_embd.weight" in single and "blk.0.ffn_down.weight" in single
    worst = max(float(np.max(np.abs(saved.params[k] - single[k]))) for k in single)
    assert worst <= 1e-6, f"max abs difference {worst:.3g} after {steps} steps"
    moved = min(float(np.max(np.abs(single[k] - start[k]))) for k in single)
    assert moved > 1e-4, "a tensor did not train: the comparison would prove nothing"


def test_a_restarted_coordinator_resumes_the_adapters(tmp_path: Path) -> None:
    """Checkpoints of a fine-tuning run hold the adapters, their moments and the base's
    identity: a coordinator killed after step 5's checkpoint resumes there, and the run ends
    with the adapters of an uninterrupted one."""
    from foundry.model.formats.checkpoint import load_checkpoint
    from foundry.model.formats.checkpoint_dir import latest_checkpoint
    from foundry.model.formats.tuning import TunedConfig

    base, text = tiny_run(tmp_path)
    # Far more steps than the first checkpoint's 5: the run must still be going when it is
    # killed (with 10, a fast machine wrote step 10's checkpoint, the last, before the kill).
    steps = 30
    args = (
        *lora_args(base, text),
        "--max-steps",
        str(steps),
        "--global-batch",
        str(BATCH),
        "--seq-len",
        str(SEQ),
        "--lr",
        str(LR_),
        "--checkpoint-every",
        "5",
        "--export-anywhere",
    )
    coord, port, admin_port = coordinator(tmp_path, *args)
    w = worker(tmp_path, port, "w0", "--base-model", str(base), "--data", str(text))
    out = tmp_path / "adapter.gguf"
    try:
        coord.wait_for(r"checkpoint \S+ written at step 5", within_s=180)
        coord.kill()
        saved = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"))  # type: ignore[arg-type]
        assert isinstance(saved.config, TunedConfig) and saved.step >= 5
        assert set(saved.params) == {n for n, _ in saved.config.trainable}
        coord = Service(
            [
                "coordinator",
                "--listen",
                f"127.0.0.1:{port}",
                "--admin-listen",
                f"127.0.0.1:{admin_port}",
                "--checkpoint-dir",
                str(tmp_path / "ckpt"),
                *args,
            ],
            tmp_path / "coordinator2.log",
        )
        assert saved.step < steps
        coord.wait_for(rf"resumed from .* at step {saved.step}", within_s=120)
        coord.wait_for(rf"training done at step {steps}", within_s=180)
        ack = admin(admin_port, fdtc.Export(path=str(out)), timeout_s=60)
        assert isinstance(ack, fdtc.ControlAck) and ack.ok, ack
    finally:
        w.stop()
        coord.stop()
    assert_one_process(base, text, LR.load_adapter(out).tensors, steps)


def test_registrations_a_fine_tuning_swarm_refuses(tmp_path: Path) -> None:
    base, text = tiny_run(tmp_path)
    other = tmp_path / "qwen2.gguf"
    write_tiny(other, "qwen2")
    coord, port, _ = coordinator(tmp_path, *lora_args(base, text), "--max-steps", "1000")
    workers = []
    try:
        stranger = worker(
            tmp_path, port, "stranger", "--base-model", str(other), "--data", str(text)
        )
        workers.append(stranger)
        assert stranger.proc.wait(timeout=120) != 0
        assert "differs from the swarm's" in stranger.text(), stranger.text()[-2000:]
        plain = worker(tmp_path, port, "plain", "--data", str(text))
        workers.append(plain)
        assert plain.proc.wait(timeout=120) != 0
        assert "start the worker with --base-model" in plain.text(), plain.text()[-2000:]
    finally:
        for w in workers:
            w.stop()
        coord.stop()


def test_base_model_refusals_name_the_reason() -> None:
    from published import TINY

    from foundry.model.formats.tuning import FileIdentity, targets_mask
    from foundry.model.spec.arch import ArchConfig
    from foundry.swarm.worker_port import base_model_msg, base_model_refusal

    t = TINY["qwen3"]
    base_cfg = ArchConfig(
        architecture="qwen3",
        n_vocab=t.n_vocab,
        n_embd=t.n_embd,
        n_layer=t.n_layer,
        n_head=t.n_head,
        n_head_kv=t.n_head_kv,
        n_ff=t.n_ff,
        n_expert=0,
        n_expert_used=0,
        key_length=t.head_dim,
    )
    cfg = tuned_config(
        base_cfg, FileIdentity(1000, "ab" * 32), LR.LoraSpec(rank=4, targets=("attn_q", "attn_v"))
    )
    mine = base_model_msg(cfg)
    assert (mine.lora_rank, mine.lora_targets) == (4, targets_mask(("attn_q", "attn_v"))) == (4, 5)
    assert base_model_refusal(cfg, mine) is None
    assert base_model_refusal(None, None) is None
    no_torch = fdtc.BaseModel(1000, bytes.fromhex("ab" * 32), "qwen3", trainer=0)
    assert "PyTorch is not installed" in (base_model_refusal(cfg, no_torch) or "")
    other = fdtc.BaseModel(999, bytes.fromhex("ab" * 32), "qwen3", trainer=1)
    assert "differs from the swarm's" in (base_model_refusal(cfg, other) or "")
    assert "start the worker with --base-model" in (base_model_refusal(cfg, None) or "")
    assert "from scratch" in (base_model_refusal(None, mine) or "")
