"""The PyTorch backend against the numpy reference, on CPU torch (what CI has): the same batch
gives the same loss and gradients, local AdamW rounds the same pseudo-gradient, the GPU
engine the same greedy tokens and the same TP partials; and the processes that take
``--device`` run with it (a mixed swarm of a torch worker and a numpy worker, `foundry train`
with resume, `foundry generate`)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import coordinator, worker

from foundry.model.formats.gguf_io import save_gguf
from foundry.model.infer.engines import make_engine
from foundry.model.infer.generate import generate_tokens
from foundry.model.infer.inference import Engine
from foundry.model.infer.kv_cache import KVCache
from foundry.model.infer.torch_engine import TorchEngine
from foundry.model.nn import torch_model as TM
from foundry.model.nn.device import DeviceError
from foundry.model.nn.transformer import init_params, loss_and_grads
from foundry.model.shard.slices import rank_weights
from foundry.model.shard.table import ExpertSplit, Gate
from foundry.model.spec.config import ModelConfig, preset
from foundry.model.text.data import load_corpus
from foundry.model.train.backend import NUMPY, Stopped, make_trainer, select
from foundry.model.train.optim import lr_schedule
from foundry.model.train.torch_backend import TorchBackend
from foundry.model.train.training import TrainSettings

torch.set_num_threads(1)  # as `--device torch-cpu` does: spinning threads on 2 shared cores
SHARED = ModelConfig(n_ff_shared=32, n_expert=4, n_expert_used=2)
CONFIGS = [preset("tiny"), SHARED]


def sharp(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Weights scaled up so the routing and the logits are far from uniform (greedy decoding
    then has clear winners, and every expert gets rows)."""
    params = init_params(cfg, seed)
    return {k: p if k.endswith("norm.weight") else p * np.float32(20) for k, p in params.items()}


def rel_max(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_the_module_reads_the_numpy_parameter_table() -> None:
    cfg = SHARED
    params = init_params(cfg, 0)
    dev = TM.to_device(params, "cpu")
    assert list(dev) == list(cfg.param_shapes())
    assert all(
        tuple(t.shape) == s for t, s in zip(dev.values(), cfg.param_shapes().values(), strict=True)
    )
    assert all(t.dtype == torch.float32 for t in dev.values())
    back = TM.to_numpy(dev)
    assert all(np.array_equal(back[k], params[k]) for k in params)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["tiny", "shared-expert"])
def test_loss_and_gradients_match_numpy_at_f32(cfg: ModelConfig) -> None:
    params = sharp(cfg, 1)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, cfg.n_vocab, (3, 24))
    targets = rng.integers(0, cfg.n_vocab, (3, 24))
    loss, stats, grads = loss_and_grads(params, cfg, tokens, targets, aux_loss_coef=0.05)
    dev = TM.to_device(params, "cpu", requires_grad=True)
    total, ce, aux = TM.loss(dev, cfg, torch.from_numpy(tokens), torch.from_numpy(targets), 0.05)
    torch.autograd.backward(total)
    total, ce, aux = total.detach(), ce.detach(), aux.detach()
    assert abs(float(total) - loss) <= 1e-5 * abs(loss)
    assert abs(float(ce) - stats["ce_loss"]) <= 1e-5 * stats["ce_loss"]
    assert abs(float(aux) - stats["aux_loss"]) <= 1e-5 * stats["aux_loss"]
    for name, g in grads.items():
        got = dev[name].grad
        assert got is not None, name
        assert rel_max(got.numpy(), g) <= 1e-4, name


def test_backend_gradients_and_local_rounds_match_numpy() -> None:
    cfg = preset("tiny")
    params = init_params(cfg, 3)
    corpus = load_corpus(None)
    backend = select("torch-cpu")
    assert isinstance(backend, TorchBackend) and backend.name == "torch:cpu"
    want = NUMPY.compute_gradients(
        params, cfg, corpus, 5, 6, seq_len=32, micro_batch=2, aux_loss_coef=0.01
    )
    got = backend.compute_gradients(
        params, cfg, corpus, 5, 6, seq_len=32, micro_batch=2, aux_loss_coef=0.01
    )
    assert abs(got.loss - want.loss) <= 1e-5 * want.loss and got.n_samples == 6
    assert list(got.grads) == list(want.grads)
    for name, g in want.grads.items():
        assert got.grads[name].dtype == np.float32 and got.grads[name].shape == g.shape
        assert rel_max(got.grads[name], g) <= 1e-4, name

    # Two rounds of three inner steps: the moments carry over on both sides.
    inner_np, inner_t = NUMPY.make_inner(params, 0.01), backend.make_inner(params, 0.01)
    for r in range(2):
        kw = dict(
            lr_at=lambda s: lr_schedule(s, 3e-3, 2, 100),
            grad_clip=1.0,
            global_step=3 * r,
            sample_offset=12 * r,
            samples_per_step=4,
            steps=3,
            micro_batch=4,
            seq_len=32,
            aux_loss_coef=0.01,
        )
        a = NUMPY.local_steps(params, inner_np, cfg, corpus, **kw)  # type: ignore[arg-type]
        b = backend.local_steps(params, inner_t, cfg, corpus, **kw)  # type: ignore[arg-type]
        assert b.n_samples == a.n_samples == 12
        assert abs(b.loss - a.loss) <= 1e-5 * a.loss
        da = np.concatenate([g.ravel() for g in a.grads.values()])
        db = np.concatenate([b.grads[k].ravel() for k in a.grads])
        # Adam divides by sqrt(v): rounding in near-zero gradients moves single elements, so
        # the pseudo-gradient is compared as a whole.
        assert np.linalg.norm(db - da) <= 1e-3 * np.linalg.norm(da), r
    # Validation (the coordinator's --validate-device): the same held-out loss.
    want_val = NUMPY.evaluate_loss(params, cfg, corpus, 32, max_batches=3, batch_size=4)
    got_val = backend.evaluate_loss(params, cfg, corpus, 32, max_batches=3, batch_size=4)
    assert want_val > 0 and abs(got_val - want_val) <= 1e-5 * want_val
    with pytest.raises(Stopped, match="after 0 of 3"):
        backend.local_steps(
            params,
            inner_t,
            cfg,
            corpus,
            lr_at=lambda s: 1e-3,
            grad_clip=1.0,
            global_step=0,
            sample_offset=0,
            samples_per_step=4,
            steps=3,
            micro_batch=4,
            seq_len=32,
            aux_loss_coef=0.01,
            stop=lambda: True,
        )


def test_rounds_through_reused_host_buffers_give_the_same_bits_and_keep_the_last_result() -> None:
    cfg, corpus = preset("tiny"), load_corpus(None)
    params = init_params(cfg, 3)
    plain, buffered = TorchBackend("cpu"), TorchBackend("cpu", host_buffers=True)
    inner_p, inner_b = plain.make_inner(params, 0.01), buffered.make_inner(params, 0.01)
    views: list[dict[str, np.ndarray]] = []  # the buffered results as returned
    copies: list[dict[str, np.ndarray]] = []  # and as they were when returned
    for r in range(3):
        kw = dict(
            lr_at=lambda s: 1e-3,
            grad_clip=1.0,
            global_step=2 * r,
            sample_offset=8 * r,
            samples_per_step=4,
            steps=2,
            micro_batch=4,
            seq_len=32,
            aux_loss_coef=0.01,
        )
        want = plain.local_steps(params, inner_p, cfg, corpus, **kw)  # type: ignore[arg-type]
        got = buffered.local_steps(params, inner_b, cfg, corpus, **kw)  # type: ignore[arg-type]
        assert set(buffered.last_phases) == {"down", "steps", "up"}
        views.append(got.grads)
        copies.append({k: g.copy() for k, g in got.grads.items()})
        assert all(np.array_equal(got.grads[k], want.grads[k]) for k in params), r
        if r >= 1:  # the previous round's arrays still hold it (a worker's --overlap start)
            assert all(np.array_equal(views[r - 1][k], copies[r - 1][k]) for k in params)
    # the third round's result went into the first one's buffer: "until the call after next"
    assert all(np.array_equal(views[0][k], copies[2][k]) for k in params)
    assert not all(np.array_equal(copies[0][k], copies[2][k]) for k in params)
    g = buffered.compute_gradients(
        params, cfg, corpus, 0, 4, seq_len=32, micro_batch=4, aux_loss_coef=0.01
    )
    want_g = plain.compute_gradients(
        params, cfg, corpus, 0, 4, seq_len=32, micro_batch=4, aux_loss_coef=0.01
    )
    assert all(np.array_equal(g.grads[k], want_g.grads[k]) for k in params)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["tiny", "shared-expert"])
def test_greedy_decode_gives_the_numpy_engines_tokens(cfg: ModelConfig) -> None:
    params = sharp(cfg, 5)
    want = list(generate_tokens(Engine(cfg, params), "Hello wor", 40))
    got = list(generate_tokens(TorchEngine(cfg, params, device="cpu"), "Hello wor", 40))
    assert got == want and len(set(want)) > 5
    # a block, then one token: the logits themselves
    ne, te = Engine(cfg, params), TorchEngine(cfg, params, device="cpu")
    s1, s2 = ne.new_session(), te.new_session()
    assert rel_max(te.decode(s2, [1, 50, 60, 70]), ne.decode(s1, [1, 50, 60, 70])) <= 1e-5
    assert rel_max(te.decode(s2, [80]), ne.decode(s1, [80])) <= 1e-5
    s2.rewind(2)
    assert s2.pos == 2 and s2.tokens == [1, 50]


@pytest.mark.parametrize(
    ("mode", "kv_group"),
    [*((m, 1) for m in ExpertSplit), (ExpertSplit.EXPERTS, 2)],
    ids=["experts", "intermediate", "rank-1-without-heads"],
)
def test_a_torch_pair_exchanges_float32_partials_and_joins_to_the_whole(
    mode: ExpertSplit, kv_group: int
) -> None:
    """kv_group 2 (the 2 kv heads in one group, as a file's blocks may ask): rank 1 holds no
    heads, its attention partial zero."""
    cfg = SHARED
    params = sharp(cfg, 9)
    parts = [rank_weights(cfg, params, r, 2, mode, None, kv_group) for r in range(2)]
    assert (parts[1].layout.heads[1] - parts[1].layout.heads[0] == 0) == (kv_group == 2)
    ranks = [TorchEngine(cfg, parts[r], rank=r, world=2, device="cpu") for r in range(2)]
    sessions = [e.new_session() for e in ranks]
    barrier = threading.Barrier(2, timeout=30)
    box: dict[tuple[int, Gate, int], np.ndarray] = {}
    seen: list[tuple[int, Gate]] = []

    def exchange(rank: int):  # type: ignore[no-untyped-def]
        def f(layer: int, gate: Gate, partial: np.ndarray) -> np.ndarray:
            assert partial.dtype == np.float32 and partial.shape == (4, cfg.n_embd)
            box[(layer, gate, rank)] = partial
            if rank == 0:
                seen.append((layer, gate))
            barrier.wait()
            total = box[(layer, gate, 0)] + box[(layer, gate, 1)]
            barrier.wait()
            return total

        return f

    out: list[np.ndarray | None] = [None, None]

    def run(r: int) -> None:
        out[r] = ranks[r].decode(sessions[r], [1, 50, 60, 70], exchange(r))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out[0] is not None and out[1] is not None
    ne = Engine(cfg, params)
    whole = ne.decode(ne.new_session(), [1, 50, 60, 70])
    assert rel_max(np.concatenate([out[0], out[1]], axis=1), whole) <= 1e-5
    assert seen == [(i, g) for i in range(cfg.n_layer) for g in (Gate.ATTN, Gate.FFN)]


def test_dequantized_files_decode_as_the_numpy_engine_reads_them(tmp_path: Path) -> None:
    cfg = ModelConfig(n_embd=64, n_ff=64)
    path = tmp_path / "m.gguf"
    save_gguf(path, cfg, sharp(cfg, 2), dtype="q8_0")
    from foundry.model.formats.gguf_io import load_gguf_stored

    loaded = load_gguf_stored(path)
    # a float32 cache as the PyTorch engine's (a stored file's default on numpy is float16)
    want = list(generate_tokens(Engine(cfg, loaded.params, kv_cache=KVCache.F32), "The ", 24))
    got = list(generate_tokens(make_engine(cfg, loaded.params, device="torch-cpu"), "The ", 24))
    assert got == want


def test_device_cuda_without_a_gpu_says_how_to_get_one() -> None:
    assert not torch.cuda.is_available()  # CI's torch is the CPU build
    with pytest.raises(DeviceError, match=r"sees no CUDA GPU.*--device cpu"):
        select("cuda")
    assert select("auto") is NUMPY and select("cpu") is NUMPY
    proc = subprocess.run(
        [sys.executable, "-m", "foundry", "train", "--device", "cuda", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "pip install 'foundry[gpu]'" in proc.stderr


def test_the_torch_trainer_resumes_from_its_own_state() -> None:
    cfg, corpus = preset("tiny"), load_corpus(None)
    settings = TrainSettings(global_batch=4, seq_len=32, warmup_steps=2, total_steps=10)
    backend = TorchBackend("cpu")
    straight = make_trainer(backend, cfg, settings, init_params(cfg, 4))
    for _ in range(2):
        straight.train_step(corpus)
    resumed = make_trainer(backend, cfg, settings, init_params(cfg, 0))
    resumed.load(
        straight.host_params(), straight.optimizer_state(), straight.step, straight.position
    )
    state = resumed.optimizer_state()
    assert state["step"] == 2 and any(float(np.abs(m).max()) > 0 for m in state["m"].values())
    a, b = straight.train_step(corpus), resumed.train_step(corpus)
    assert a.loss == b.loss and resumed.position == 12
    pa, pb = straight.host_params(), resumed.host_params()
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    # and it learns what the numpy trainer learns, to rounding
    numpy_trainer = make_trainer(NUMPY, cfg, settings, init_params(cfg, 4))
    for _ in range(3):
        numpy_trainer.train_step(corpus)
    pn = numpy_trainer.host_params()
    assert all(rel_max(pa[k], pn[k]) <= 1e-3 for k in pn)


def test_train_and_generate_take_the_device_flag(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "train",
            "--preset",
            "tiny",
            "--device",
            "torch-cpu",
            "--no-progress",
            "--sample-every",
            "0",
            "--global-batch",
            "4",
            "--seq-len",
            "32",
            "--steps",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "on torch:cpu" in train.stdout and "step 2: loss" in train.stdout
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "generate",
            "--model",
            str(out),
            "--prompt",
            "The ",
            "--max-tokens",
            "12",
            "--device",
            "torch-cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    from foundry.model.formats.gguf_io import load_gguf_stored
    from foundry.model.text.vocab.byte import decode

    loaded = load_gguf_stored(out)
    want = decode(list(generate_tokens(Engine(loaded.cfg, loaded.params), "The ", 12)))
    assert gen.stdout == want + "\n"


def test_a_torch_worker_and_a_numpy_worker_train_one_swarm(tmp_path: Path) -> None:
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        "8",
        "--global-batch",
        "8",
        "--sync-every",
        "2",
        "--min-workers",
        "2",
        "--validate-every",
        "4",
        "--validate-device",
        "torch-cpu",
    )
    workers = [
        worker(tmp_path, port, "gpu", "--device", "torch-cpu"),
        worker(tmp_path, port, "cpu"),
    ]
    try:
        coord.wait_for(r"training done at step 8", within_s=240)
        log = coord.text()
        assert log.count("samples from 2 workers") >= 2, log[-3000:]
        assert "worker computes on torch:cpu" in workers[0].text()
        assert "validation computes on torch:cpu" in log
        assert re.search(r"step 8: validation loss \d+\.\d+", log), log[-3000:]
    finally:
        for w in workers:
            w.stop()
        coord.stop()


def test_a_torch_leader_pairs_with_a_numpy_worker_and_decodes_the_same_text(
    tmp_path: Path,
) -> None:
    """The TP pair with rank 0 on the PyTorch engine and rank 1 on numpy: the gates go over
    the same exchange (shared memory) as float32, and greedy text equals one process's."""
    from tp_harness import (
        Client,
        make_model,
        reference_greedy,
        start_leader,
        start_worker,
        wait_paired,
    )

    model = make_model(tmp_path / "model.gguf")
    prompt = "A pair of one GPU rank and one CPU rank."
    leader = start_leader(
        model, tmp_path / "leader.log", "--prefill-chunk", "16", "--device", "torch-cpu"
    )
    rank1 = start_worker(model, leader.port, tmp_path / "worker.log")
    try:
        wait_paired(leader.frontend)
        with Client(leader.frontend) as c:
            got = c.generate(prompt, 24)
    finally:
        assert leader.proc.stop() == 0, leader.proc.text()
        assert rank1.exit_code() == 0, rank1.text()
    assert got.tokens == reference_greedy(model, prompt, 24, 16).tokens
