"""The one process ``tp.py`` measures the pair against: the bench's model built and written
once, decoded by a world-1 ``Engine`` in the pair's split, with each half's share of every
gate timed (the balance bound: the most a split lets a pair gain, whatever the machine)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import numpy as np

from foundry.model.formats.gguf_io import load_gguf, load_gguf_stored, save_gguf
from foundry.model.formats.gguf_model import FileDType
from foundry.model.infer.inference import Engine
from foundry.model.infer.sampling import sample
from foundry.model.kernels.quant import linear
from foundry.model.shard.table import ExpertSplit
from foundry.model.spec.config import ModelConfig


def build_model(cfg: ModelConfig, path: Path, seed: int, dtype: FileDType = "f32") -> float:
    """Write a random model (seeded normal * 0.02, norms 1), stored as ``dtype``, unless the
    file is already there."""
    if path.exists():
        try:
            if load_gguf(path, select=lambda n, v: None).cfg == cfg:
                return 0.0
        except ValueError:
            pass
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in cfg.param_shapes().items():
        if name.endswith("norm.weight"):
            params[name] = np.ones(shape, np.float32)
        else:
            w = rng.standard_normal(shape, dtype=np.float32)
            w *= np.float32(0.02)
            params[name] = w
    save_gguf(path, cfg, params, dtype=dtype)
    return time.perf_counter() - t0


def single_process(
    model: Path, prompt: list[int], n: int, mode: ExpertSplit, eog: frozenset[int]
) -> tuple[list[int], float, dict[str, float]]:
    """Greedy decode in one process: the tokens (up to an end-of-generation token in ``eog``,
    included, as the leader emits it), the decode tokens/s (after the prompt), and the balance
    of the two halves it evaluates (see ``Balance``; timed on the single operations)."""
    m = load_gguf_stored(model)
    engine = Engine(m.cfg, m.params, expert_split=mode)
    del m
    s = engine.new_session()
    logits = engine.decode(s, prompt)[-1]
    out = [sample(logits, 0.0)]
    steps: list[float] = []
    t0 = time.perf_counter()
    while len(out) < n and out[-1] not in eog:
        t1 = time.perf_counter()
        out.append(sample(engine.decode(s, [out[-1]])[-1], 0.0))
        steps.append(time.perf_counter() - t1)
    elapsed = time.perf_counter() - t0
    # The halves' shares are timed on the single operations (a token's step in C runs them in
    # one call): the same tokens again with ``step_in_c`` off.
    engine.step_in_c = False
    balance = Balance(engine)
    s = engine.new_session()
    engine.decode(s, prompt)
    op_steps: list[float] = []
    for token in out[:-1]:
        t1 = time.perf_counter()
        engine.decode(s, [token])
        op_steps.append(time.perf_counter() - t1)
    summary = balance.summary(op_steps)
    summary["step_ms"] = harness.median(steps) * 1e3 if steps else float("nan")
    # The output head alone, each part's vocabulary block: one row through it, median of 5.
    row = np.random.default_rng(0).standard_normal((1, engine.cfg.n_embd), dtype=np.float32)
    for j, head in enumerate(engine._head):
        spent = []
        for _ in range(5):
            t1 = time.perf_counter()
            linear(row, head)
            spent.append(time.perf_counter() - t1)
        summary[f"head{j}_ms"] = harness.median(spent) * 1e3
    return out, (len(out) - 1) / elapsed, summary


class Balance:
    """Times each half's share of every gate inside a world-1 engine (same routing, same work
    as the two ranks): how far apart the halves are, on one core, with no exchange at all.

    ``bound`` is the one process's time over the time a pair would take if each gate cost the
    slower half's work and nothing else (the replicated work, norms, router and head, counted
    once): the most a pair can gain from this split, whatever the machine and the transport.
    Each figure is the median over the decoded tokens, so a token slowed down by another
    process on the machine does not count.
    """

    def __init__(self, engine: Engine) -> None:
        self.gates: list[list[float]] = []  # per gate: seconds of part 0, part 1
        self.n_layer = engine.cfg.n_layer

        def timed(part_gate: Callable[..., Any]) -> Callable[..., Any]:
            """A part's share of a gate (engine._attention or _ffn: layer, part j, ...), timed."""

            def call(layer: int, j: int, *args: Any) -> Any:
                t0 = time.perf_counter()
                out = part_gate(layer, j, *args)
                self._record(j, time.perf_counter() - t0)
                return out

            return call

        engine._attention = timed(engine._attention)  # type: ignore[method-assign]
        engine._ffn = timed(engine._ffn)  # type: ignore[method-assign]

    def _record(self, j: int, seconds: float) -> None:
        if j == 0:
            self.gates.append([])
        self.gates[-1].append(seconds)

    def summary(self, steps: list[float]) -> dict[str, float]:
        """Medians over the decode steps (each ``steps[i]`` seconds, one token)."""
        per_gate = np.asarray(self.gates[-len(steps) * 2 * self.n_layer :])  # (gates, parts)
        per_token = per_gate.reshape(len(steps), -1, per_gate.shape[1])  # (tokens, gates, parts)
        elapsed = np.asarray(steps)  # (tokens,)
        split = per_token.sum(axis=(1, 2))  # (tokens,)
        rest = elapsed - split
        slowest = per_token.max(axis=2).sum(axis=1)  # (tokens,)
        halves = per_token.sum(axis=1)  # (tokens, parts)
        return {
            "bound": float(np.median(elapsed / (rest + slowest))),
            "half0_tokens_per_s": float(1 / np.median(rest + halves[:, 0])),
            "half1_tokens_per_s": float(1 / np.median(rest + halves[:, -1])),
            # the share of the split work a rank spends waiting for the other at the gates
            "idle_share": float(np.median(1 - split / (halves.shape[1] * slowest))),
        }
