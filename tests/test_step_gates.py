"""A world's gates run by the C one-token step itself (``MeshGateExchange.step_gates``: each
peer's chunk of a gate's product posted as soon as its rows are made, the rest moved by the C
loop, no Python at any gate): every rank an engine on a thread of this process over real
loopback sockets. The logits equal one process standing for the world bit for bit, as with the
gates through Python; every gate is counted as a call's is; a rank that dies is named by the
others' GateError, and their sessions stay as they were.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from procs import missing
from test_gate_mesh import mesh, run_world
from test_tp_world import _dense_q8_model
from tp_harness import make_model, tokens_of

from foundry.model.formats.gguf_io import load_gguf_stored
from foundry.model.infer.engines import InferenceEngine, make_engine
from foundry.model.infer.inference import Engine
from foundry.model.infer.sampling import sample
from foundry.model.shard.table import ExpertSplit, Gate
from foundry.model.spec.config import ModelConfig
from foundry.tp.handshake import load_rank
from foundry.tp.lockstep import TracingExchange
from foundry.transport.gates import GateError, MeshGateExchange, StepGates, channel

PROMPT = "The gates of a step in C."
TOKENS = 6


@pytest.fixture(autouse=True)
def built() -> None:
    if channel.native is None:
        missing("the C gate loop (foundry.transport.gates._gates) is not built")


def model_of(kind: str, tmp_path: Path) -> Path:
    """A dense Q8_0 llama file (both gates' products posted chunk by chunk), or routed experts
    in Q8_0 (the FFN's partial goes out whole) whose kv heads go out 2 at a time, so some
    ranks hold none (their attention partial is zero, posted as such)."""
    if kind == "dense":
        return _dense_q8_model(tmp_path / "dense.gguf")
    cfg = ModelConfig(n_ctx=256, n_embd=192, n_head=12, n_head_kv=4, n_ff=96)
    return make_model(tmp_path / "moe.gguf", cfg, dtype="q8_0")


def world_of(model: Path, world: int) -> list[InferenceEngine]:
    ranks = [load_rank(model, r, None, ExpertSplit.EXPERTS, world) for r in range(world)]
    return [make_engine(m.cfg, m.weights, rank=r, world=world) for r, m in enumerate(ranks)]


class Counted:
    """The exchange a rank's engine is given: a TracingExchange over the rank's mesh, counting
    each gate it reports and each step whose gates ran in C."""

    def __init__(self, gates: MeshGateExchange) -> None:
        self.gates: list[Gate] = []
        self.in_c = 0
        self.traced = TracingExchange(gates, lambda gate, s, n: self.gates.append(gate))
        done = gates.step_done

        def step_done() -> StepGates:
            self.in_c += 1
            return done()

        gates.step_done = step_done  # type: ignore[method-assign]


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("world", [3, 4])
def test_the_steps_gates_in_c_equal_one_process(tmp_path: Path, world: int, kind: str) -> None:
    model = model_of(kind, tmp_path)
    stored = load_gguf_stored(model)
    one = Engine(stored.cfg, stored.params, expert_split=ExpertSplit.EXPERTS, shares=(1,) * world)
    s = one.new_session()
    ids = tokens_of(PROMPT)
    want = [one.decode(s, ids)[-1:]]
    fed = []
    for _ in range(TOKENS):
        fed.append(sample(want[-1][0], 0.0))
        want.append(one.decode(s, [fed[-1]]))

    engines = world_of(model, world)
    gates = mesh(world, n_embd=stored.cfg.n_embd)
    counted = [Counted(g) for g in gates]

    def rank(r: int) -> list[np.ndarray]:
        e, ex = engines[r], counted[r].traced
        sess = e.new_session()
        rows = [e.forward_rows([(sess, ids)], ex)[-1:]]  # the prompt: gates through the call
        rows += [e.forward_rows([(sess, [t])], ex) for t in fed]  # a token: the C step's
        return rows

    got = run_world([lambda r=r: rank(r) for r in range(world)])
    for g in gates:
        g.close()
    for r, res in enumerate(got):
        assert not isinstance(res, BaseException), f"rank {r}: {res!r}"
    n_layer = stored.cfg.n_layer
    for c in counted:
        assert c.in_c == TOKENS  # every one-token step ran its gates in C
        assert c.gates == [Gate.ATTN, Gate.FFN] * n_layer * (1 + TOKENS)
        assert c.traced.transport.gates_done == 2 * n_layer * (1 + TOKENS)
    for i, row in enumerate(want):
        ours = np.concatenate([got[r][i] for r in range(world)], axis=-1)
        assert np.array_equal(ours, row), f"row {i}: max abs diff {np.abs(ours - row).max():.3g}"


def test_a_rank_that_dies_mid_step_is_named_and_sessions_stay(tmp_path: Path) -> None:
    model = model_of("dense", tmp_path)
    engines = world_of(model, 3)
    gates = mesh(3, timeout_s=2.0, n_embd=engines[0].cfg.n_embd)
    ex = [TracingExchange(g, lambda gate, s, n: None) for g in gates]
    ids = tokens_of(PROMPT)
    sessions = [e.new_session() for e in engines]
    prompt = run_world(
        [lambda r=r: engines[r].forward_rows([(sessions[r], ids)], ex[r]) for r in range(3)]
    )
    assert not any(isinstance(p, BaseException) for p in prompt)
    gates[2].close()  # rank 2 dies: the others' next step fails at its first gate
    step = run_world(
        [lambda r=r: engines[r].forward_rows([(sessions[r], [5])], ex[r]) for r in range(2)]
    )
    for r, res in enumerate(step):
        assert isinstance(res, GateError), f"rank {r}: {res!r}"
        assert "rank 2" in str(res), res
        assert sessions[r].pos == len(ids)
        with pytest.raises(GateError, match="failed earlier"):  # unusable until re-formed
            gates[r].step_gates(4)
    for g in gates:
        g.close()
