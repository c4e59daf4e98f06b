"""The two-rank split against the whole model.

Two rank engines run in two threads, joined by an in-memory gate exchange (both post their
partial, both read the sum), and must reproduce the single-process engine: a prefill and 64
greedy tokens, logits halves joined. The single-process engine evaluates the same two halves
and adds them in the same order, so the match is asserted bit for bit (and within 1e-5 of the
training forward, which groups its sums differently).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import pytest

from foundry.model import transformer as T
from foundry.model.config import ModelConfig
from foundry.model.inference import Engine, Gate, GateExchange, Session
from foundry.model.tp_split import (
    SPLIT_TABLE,
    SplitError,
    SplitKind,
    block_range,
    rank_layout,
    rank_weights,
    rule_for,
    shard_params,
    shard_shapes,
)

F32 = npt.NDArray[np.float32]

CONFIGS = {
    "tiny-odd-vocab": ModelConfig(),  # n_vocab 259: rank 0 gets 130 rows, rank 1 129
    "shared-odd-experts": ModelConfig(n_vocab=97, n_embd=48, n_layer=3, n_head=6, n_head_kv=2,
                                      n_ff=40, n_expert=5, n_expert_used=2, n_ff_shared=25),
}


def make(name: str) -> tuple[ModelConfig, dict[str, F32]]:
    cfg = CONFIGS[name]
    rng = np.random.default_rng(5)
    params = T.init_params(cfg, seed=4)
    for p in params.values():
        p += np.float32(0.1) * rng.standard_normal(p.shape, dtype=np.float32)
    return cfg, params


class PairExchange:
    """In-memory gate exchange for two threads: each posts its partial, both read the sum."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(2, timeout=30)
        self._slots: list[F32 | None] = [None, None]
        self.log: list[list[tuple[int, Gate, tuple[int, ...]]]] = [[], []]

    def for_rank(self, rank: int) -> GateExchange:
        def exchange(layer: int, gate: Gate, partial: F32) -> F32:
            assert partial.dtype == np.float32 and partial.flags.c_contiguous
            self.log[rank].append((layer, gate, partial.shape))
            self._slots[rank] = partial
            self._barrier.wait()
            a, b = self._slots
            assert a is not None and b is not None
            total = a + b
            self._barrier.wait()  # nobody posts the next gate before both have read this one
            return total

        return exchange


class Pair:
    """Rank 0 on the calling thread, rank 1 on a helper thread, in lockstep."""

    def __init__(self, cfg: ModelConfig, params: dict[str, F32]) -> None:
        self.ranks = [Engine(cfg, rank_weights(cfg, params, r, 2), rank=r, world=2)
                      for r in range(2)]
        self.exchange = PairExchange()
        self.pool = ThreadPoolExecutor(1)

    def new_sessions(self) -> tuple[Session, Session]:
        return self.ranks[0].new_session(), self.ranks[1].new_session()

    def forward_rows(self, rows: Sequence[tuple[tuple[Session, Session], Sequence[int]]]) -> F32:
        rows1 = [(s[1], toks) for s, toks in rows]
        job = self.pool.submit(self.ranks[1].forward_rows, rows1, self.exchange.for_rank(1))
        half0 = self.ranks[0].forward_rows([(s[0], toks) for s, toks in rows],
                                           self.exchange.for_rank(0))
        half1 = job.result(timeout=60)
        return np.concatenate([half0, half1], axis=1)


def test_split_table_covers_every_parameter() -> None:
    cfg = CONFIGS["shared-odd-experts"]
    kinds = {name: rule_for(name).kind for name in cfg.param_shapes()}
    assert kinds["blk.0.attn_q.weight"] is SplitKind.ROW
    assert kinds["blk.2.attn_output.weight"] is SplitKind.COLUMN
    assert kinds["blk.1.ffn_down_exps.weight"] is SplitKind.EXPERT
    assert kinds["blk.1.ffn_gate_inp.weight"] is SplitKind.REPLICATED
    assert kinds["output.weight"] is SplitKind.VOCAB
    assert {r.kind for r in SPLIT_TABLE} == set(SplitKind)
    with pytest.raises(KeyError, match="no tensor-parallel split rule"):
        rule_for("blk.0.mystery.weight")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rank_parts_rebuild_the_whole(name: str) -> None:
    cfg, params = make(name)
    parts = [shard_params(cfg, params, r, 2) for r in range(2)]
    for r in range(2):
        assert {k: v.shape for k, v in parts[r].items()} == shard_shapes(cfg, r, 2)
    for name_, full in params.items():
        rule = rule_for(name_)
        # Row-like cuts of a C-contiguous array are views; column cuts must be copied.
        view = rule.kind is not SplitKind.COLUMN
        assert all(np.shares_memory(p[name_], full) == view for p in parts), name_
        if rule.kind is SplitKind.REPLICATED:
            assert all(np.array_equal(p[name_], full) for p in parts)
            continue
        axis = 1 if rule.kind is SplitKind.COLUMN else 0
        np.testing.assert_array_equal(
            np.concatenate([parts[0][name_], parts[1][name_]], axis=axis), full
        )
    lay0, lay1 = rank_layout(cfg, 0, 2), rank_layout(cfg, 1, 2)
    assert lay0.vocab == (0, (cfg.n_vocab + 1) // 2)  # rank 0 takes the first ceil(V/2) rows
    assert lay1.vocab == ((cfg.n_vocab + 1) // 2, cfg.n_vocab)
    # Query heads of a rank read exactly the kv heads it holds.
    group = cfg.n_head // cfg.n_head_kv
    for lay in (lay0, lay1):
        assert (lay.heads[0] // group, lay.heads[1] // group) == lay.kv_heads


def test_block_ranges() -> None:
    assert [block_range(7, r, 2) for r in range(2)] == [(0, 4), (4, 7)]
    assert [block_range(8, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert block_range(5, 0, 1) == (0, 5)


def test_odd_kv_heads_are_refused_clearly() -> None:
    cfg = ModelConfig(n_head=6, n_head_kv=3, n_embd=48)
    with pytest.raises(SplitError, match="n_head_kv=3 is not divisible by 2"):
        rank_layout(cfg, 0, 2)
    with pytest.raises(SplitError, match="n_head_kv=3"):
        Engine(cfg, T.init_params(cfg), rank=1, world=2)


def test_rank_weights_check_shapes() -> None:
    cfg, params = make("tiny-odd-vocab")
    rw = rank_weights(cfg, params, 1, 2)
    with pytest.raises(ValueError, match="attn_q"):
        wrong = {**rw.params, "blk.0.attn_q.weight": params["blk.0.attn_q.weight"]}
        type(rw)(cfg, rw.layout, wrong)
    with pytest.raises(ValueError, match="rank 1 of 2"):
        Engine(cfg, rw, rank=0, world=2)
    rank1 = Engine(cfg, rw, rank=1, world=2)
    with pytest.raises(ValueError, match="GateExchange"):
        rank1.decode(rank1.new_session(), [1])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pair_equals_single_process_prefill_and_greedy(name: str) -> None:
    cfg, params = make(name)
    single = Engine(cfg, params)
    pair = Pair(cfg, params)
    s_ref = single.new_session()
    s_tp = pair.new_sessions()
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.n_vocab, 13)]

    ref = single.decode(s_ref, prompt)
    got = pair.forward_rows([(s_tp, prompt)])
    assert got.shape == ref.shape == (13, cfg.n_vocab)
    np.testing.assert_array_equal(got, ref)  # bit-identical
    history = list(prompt)
    for _ in range(64):
        token = int(np.argmax(got[-1]))
        assert token == int(np.argmax(ref[-1]))
        history.append(token)
        ref = single.decode(s_ref, [token])
        got = pair.forward_rows([(s_tp, [token])])
        np.testing.assert_array_equal(got, ref)
    assert s_tp[0].tokens == s_tp[1].tokens == s_ref.tokens == history

    # Both ranks passed the same gates in the same order: ATTN then FFN for every layer.
    log0, log1 = pair.exchange.log
    assert log0 == log1
    assert [(layer, gate) for layer, gate, _ in log0[: 2 * cfg.n_layer]] == [
        (i, g) for i in range(cfg.n_layer) for g in (Gate.ATTN, Gate.FFN)
    ]
    assert log0[0][2] == (13, cfg.n_embd)

    # And the single process agrees with the training forward to float tolerance.
    full, _ = T.forward(params, cfg, np.array([history]))
    np.testing.assert_allclose(ref[-1], full[0, -1], rtol=0, atol=1e-5)


def test_pair_serves_several_sessions_in_one_pass() -> None:
    cfg, params = make("shared-odd-experts")
    single = Engine(cfg, params)
    pair = Pair(cfg, params)
    rng = np.random.default_rng(2)
    refs = [single.new_session() for _ in range(3)]
    tps = [pair.new_sessions() for _ in range(3)]
    for step, lens in enumerate([(5, 1, 9), (1, 1, 1), (3, 2, 1)]):
        blocks = [[int(t) for t in rng.integers(0, cfg.n_vocab, n)] for n in lens]
        ref = single.forward_rows(list(zip(refs, blocks, strict=True)))
        got = pair.forward_rows(list(zip(tps, blocks, strict=True)))
        np.testing.assert_array_equal(got, ref, err_msg=f"step {step}")
    for s_ref, (s0, s1) in zip(refs, tps, strict=True):
        assert s_ref.pos == s0.pos == s1.pos
