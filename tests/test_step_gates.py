"""A world's gates run by the C one-token step itself (``MeshGateExchange.step_gates``: each
peer's chunk of a gate's product posted as soon as its rows are made, the rest moved by the C
loop, no Python at any gate), and a pair's (``TcpGateExchange``, ``ShmGateExchange``: the same
bytes and rounds as their Python calls): every rank an engine on a thread of this process over
real loopback sockets or a real slab. The logits equal one process standing for the world bit
for bit, as with the gates through Python; every gate is counted as a call's is; a rank that
dies or is out of step is named by the others' GateError, and their sessions stay as they were.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from procs import missing
from test_gate_exchange import tcp_pair
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
from foundry.transport.gates import (
    GateError,
    GateExchange,
    ShmGateExchange,
    StepGates,
    TcpGateExchange,
    channel,
)

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


def pair(
    transport: str, n_embd: int, timeout_s: float = 2.0, seqs: tuple[int, int] = (1, 1)
) -> list[GateExchange]:
    """The two ranks' gates of a pair: over a loopback TCP link, or a slab (with checksums,
    as weakly ordered machines make it, for "slab-crc")."""
    if transport == "tcp":
        socks = tcp_pair()
        return [
            TcpGateExchange(socks[r], rank=r, n_embd=n_embd, timeout_s=timeout_s, first_seq=seqs[r])
            for r in (0, 1)
        ]
    leader = ShmGateExchange.create(
        n_embd=n_embd, timeout_s=timeout_s, first_seq=seqs[0], checksum=transport == "slab-crc"
    )
    worker = ShmGateExchange.attach(
        leader.name, n_embd=n_embd, timeout_s=timeout_s, first_seq=seqs[1]
    )
    return [leader, worker]


def gates_of(transport: str, world: int, n_embd: int) -> list[GateExchange]:
    return list(mesh(world, n_embd=n_embd)) if transport == "mesh" else pair(transport, n_embd)


class Counted:
    """The exchange a rank's engine is given: a TracingExchange over the rank's gates, counting
    each gate it reports and each step whose gates ran in C."""

    def __init__(self, gates: GateExchange) -> None:
        self.gates: list[Gate] = []
        self.in_c = 0
        self.traced = TracingExchange(gates, lambda gate, s, n: self.gates.append(gate))
        done = gates.step_done

        def step_done() -> StepGates:
            self.in_c += 1
            return done()

        gates.step_done = step_done  # type: ignore[method-assign]


# (transport, world, whether the one-token steps run their gates in C): a slab with checksums
# keeps its gates in Python (its readers check them there).
WORLDS = [("mesh", 3, True), ("mesh", 4, True), ("tcp", 2, True), ("slab", 2, True)]
WORLDS += [("slab-crc", 2, False)]


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize(
    ("transport", "world", "in_c"), WORLDS, ids=[f"{t}-{w}" for t, w, _ in WORLDS]
)
def test_the_steps_gates_in_c_equal_one_process(
    tmp_path: Path, transport: str, world: int, in_c: bool, kind: str
) -> None:
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
    gates = gates_of(transport, world, stored.cfg.n_embd)
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
        assert c.in_c == (TOKENS if in_c else 0)  # every one-token step ran its gates in C
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


# A fault's GateError on rank 0 (and on rank 1, out of step), as the Python calls raise it.
FAULTS = {
    ("tcp", "dies"): r"peer closed the gate connection during layer 0 gate ATTN seq \d+ "
    r"\(1 x \d+\) \(received 0 of \d+ bytes\)",
    ("slab", "dies"): r"peer closed the shared-memory slab during layer 0 gate ATTN",
    ("tcp", "stalls"): r"peer stalled: no progress for 0.5 s during layer 0 gate ATTN .*"
    r"\(sent (\d+) of \1 bytes, received 0 of \1\)",
    ("slab", "stalls"): r"peer stalled: no partial for layer 0 gate ATTN .* within 0.5 s on the "
    r"shared-memory slab",
    ("tcp", "out of step"): r"gate desync: expected layer 0 gate ATTN seq \d+ .*, peer sent "
    r"layer 0 gate ATTN seq \d+",
}
FAULTS["slab", "out of step"] = FAULTS["tcp", "out of step"]


@pytest.mark.parametrize("fault", ["dies", "stalls", "out of step"])
@pytest.mark.parametrize("transport", ["tcp", "slab"])
def test_a_pairs_failed_step_is_named_and_sessions_stay(
    tmp_path: Path, transport: str, fault: str
) -> None:
    """A pair's C step that meets a closed peer, a silent one, or one a gate ahead (its seq)
    fails with the GateError the Python call raises; the sessions keep their positions."""
    model = model_of("dense", tmp_path)
    engines = world_of(model, 2)
    n_embd = engines[0].cfg.n_embd
    seqs = (1, 2) if fault == "out of step" else (1, 1)
    gates = pair(transport, n_embd, timeout_s=0.5, seqs=seqs)
    ex = [TracingExchange(g, lambda gate, s, n: None) for g in gates]
    sessions = [e.new_session() for e in engines]
    ranks = (0, 1)
    if fault != "out of step":
        ids = tokens_of(PROMPT)
        prompt = run_world(
            [lambda r=r: engines[r].forward_rows([(sessions[r], ids)], ex[r]) for r in ranks]
        )
        assert not any(isinstance(p, BaseException) for p in prompt)
        if fault == "dies":
            gates[1].close()  # rank 1 dies: rank 0's next step fails at its first gate
        ranks = (0,)  # rank 1 takes no step
    before = [s.pos for s in sessions]
    step = run_world(
        [lambda r=r: engines[r].forward_rows([(sessions[r], [5])], ex[r]) for r in ranks]
    )
    for r, res in zip(ranks, step, strict=True):
        assert isinstance(res, GateError), f"rank {r}: {res!r}"
        assert re.search(FAULTS[transport, fault], str(res)), res
        assert sessions[r].pos == before[r]
        with pytest.raises(GateError, match="failed earlier"):  # unusable until re-formed
            gates[r].step_gates(4)
    for g in gates:
        g.close()
