"""The split against the whole model: two ranks, and N ranks with shares.

Two rank engines run in two threads, joined by an in-memory gate exchange (both post their
partial, both read the sum), and must reproduce the single-process engine: a prefill and 64
greedy tokens, logits halves joined. The single-process engine evaluates the same two halves
and adds them in the same order, so the match is asserted bit for bit (and within 1e-5 of the
training forward, which groups its sums differently). Both expert splits (whole experts per
rank, or every expert's intermediate dimension cut in two) are run. N ranks (3 and 4, equal and
uneven shares) run the same way against a single process standing for the same split.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import pytest
from quant_weights import random_blocks

from foundry.model.infer.inference import Engine, Gate, GateExchange
from foundry.model.infer.kv_cache import Session
from foundry.model.kernels.quant import QTensor, QType, quantize
from foundry.model.nn import transformer as T
from foundry.model.shard.shares import block_range, norm_shares, share_blocks, share_range
from foundry.model.shard.slices import (
    check_cuts,
    kv_group_of,
    pick_expert_split,
    rank_layout,
    rank_weights,
    shard_params,
    shard_part,
    shard_shapes,
)
from foundry.model.shard.table import (
    SPLIT_TABLE,
    SPLIT_TABLES,
    ExpertSplit,
    SplitError,
    SplitKind,
    Unit,
    rule_for,
)
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]

CONFIGS = {
    "tiny-odd-vocab": ModelConfig(),  # n_vocab 259: rank 0 gets 130 rows, rank 1 129
    "shared-odd-experts": ModelConfig(
        n_vocab=97,
        n_embd=48,
        n_layer=3,
        n_head=6,
        n_head_kv=2,
        n_ff=40,
        n_expert=5,
        n_expert_used=2,
        n_ff_shared=25,
    ),
    # 9 query heads over 3 kv heads: rank 0 holds two kv groups (6 heads), rank 1 one (3).
    "odd-kv-groups": ModelConfig(n_vocab=101, n_embd=36, n_head=9, n_head_kv=3, n_ff=40),
    # One kv head: K and V replicated, the query heads split.
    "one-kv-head": ModelConfig(n_vocab=67, n_embd=48, n_head=6, n_head_kv=1, n_ff=40),
}


def make(name: str) -> tuple[ModelConfig, dict[str, F32]]:
    cfg = CONFIGS[name]
    rng = np.random.default_rng(5)
    params = T.init_params(cfg, seed=4)
    for p in params.values():
        p += np.float32(0.1) * rng.standard_normal(p.shape, dtype=np.float32)
    return cfg, params


class PairExchange:
    """In-memory gate exchange for N threads: each posts its partial, all read the sum, added
    in rank order."""

    def __init__(self, world: int = 2) -> None:
        self._barrier = threading.Barrier(world, timeout=30)
        self._slots: list[F32 | None] = [None] * world
        self.log: list[list[tuple[int, Gate, tuple[int, ...]]]] = [[] for _ in range(world)]

    def for_rank(self, rank: int) -> GateExchange:
        def exchange(layer: int, gate: Gate, partial: F32) -> F32:
            assert partial.dtype == np.float32 and partial.flags.c_contiguous
            self.log[rank].append((layer, gate, partial.shape))
            self._slots[rank] = partial
            self._barrier.wait()
            total = self._slots[0]
            assert total is not None
            for p in self._slots[1:]:
                assert p is not None
                total = total + p
            self._barrier.wait()  # nobody posts the next gate before all have read this one
            return total

        return exchange


MODES = list(ExpertSplit)


class Pair:
    """Rank 0 on the calling thread, ranks 1 .. N-1 on helper threads, in lockstep."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict[str, F32],
        mode: ExpertSplit = ExpertSplit.EXPERTS,
        world: int = 2,
        shares: tuple[int, ...] | None = None,
    ) -> None:
        self.ranks = [
            Engine(cfg, rank_weights(cfg, params, r, world, mode, shares), rank=r, world=world)
            for r in range(world)
        ]
        assert all(e.expert_split is mode for e in self.ranks)
        self.exchange = PairExchange(world)
        self.pool = ThreadPoolExecutor(world - 1)

    def new_sessions(self) -> tuple[Session, ...]:
        return tuple(e.new_session() for e in self.ranks)

    def forward_rows(self, rows: Sequence[tuple[tuple[Session, ...], Sequence[int]]]) -> F32:
        jobs = [
            self.pool.submit(
                e.forward_rows, [(s[r], toks) for s, toks in rows], self.exchange.for_rank(r)
            )
            for r, e in enumerate(self.ranks)
            if r
        ]
        first = self.ranks[0].forward_rows(
            [(s[0], toks) for s, toks in rows], self.exchange.for_rank(0)
        )
        return np.concatenate([first, *(j.result(timeout=60) for j in jobs)], axis=1)


def test_split_table_covers_every_parameter() -> None:
    cfg = CONFIGS["shared-odd-experts"]
    kinds = {name: rule_for(name).kind for name in cfg.param_shapes()}
    assert kinds["blk.0.attn_q.weight"] is SplitKind.ROW
    assert kinds["blk.2.attn_output.weight"] is SplitKind.COLUMN
    assert kinds["blk.1.ffn_down_exps.weight"] is SplitKind.EXPERT
    assert kinds["blk.1.ffn_gate_inp.weight"] is SplitKind.REPLICATED
    assert kinds["output.weight"] is SplitKind.VOCAB
    assert SPLIT_TABLES[ExpertSplit.EXPERTS] == SPLIT_TABLE
    assert {r.kind for t in SPLIT_TABLES.values() for r in t} == set(SplitKind)
    with pytest.raises(KeyError, match="no tensor-parallel split rule"):
        rule_for("blk.0.mystery.weight")
    # The mode selects the rules of the expert tensors only.
    mid = ExpertSplit.INTERMEDIATE
    assert rule_for("blk.1.ffn_gate_exps.weight", mid).kind is SplitKind.EXPERT_ROW
    assert rule_for("blk.1.ffn_up_exps.weight", mid).kind is SplitKind.EXPERT_ROW
    assert rule_for("blk.1.ffn_down_exps.weight", mid).kind is SplitKind.EXPERT_COLUMN
    changed = [a.pattern for a, b in zip(SPLIT_TABLE, SPLIT_TABLES[mid], strict=True) if a != b]
    assert changed == [f"blk.*.ffn_{w}_exps.weight" for w in ("gate", "up", "down")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_rank_parts_rebuild_the_whole(name: str, mode: ExpertSplit) -> None:
    cfg, params = make(name)
    parts = [shard_params(cfg, params, r, 2, mode) for r in range(2)]
    for r in range(2):
        assert {k: v.shape for k, v in parts[r].items()} == shard_shapes(cfg, r, 2, mode)
    for name_, full in params.items():
        rule = rule_for(name_, mode)
        # Row-like cuts of a C-contiguous array are views; column cuts (and the cuts of every
        # expert's intermediate block) must be copied.
        view = rule.kind not in (SplitKind.COLUMN, SplitKind.EXPERT_ROW, SplitKind.EXPERT_COLUMN)
        assert all(np.shares_memory(p[name_], full) == view for p in parts), name_
        assert all(p[name_].flags.c_contiguous for p in parts), name_
        if rule.kind is SplitKind.REPLICATED or (
            cfg.n_head_kv == 1 and rule.unit in (Unit.KV_HEAD, Unit.K_ROWS)
        ):
            assert all(np.array_equal(p[name_], full) for p in parts)  # replicated K/V too
            continue
        axis = {SplitKind.COLUMN: 1, SplitKind.EXPERT_ROW: 1, SplitKind.EXPERT_COLUMN: 2}.get(
            rule.kind, 0
        )
        np.testing.assert_array_equal(
            np.concatenate([parts[0][name_], parts[1][name_]], axis=axis), full
        )
    lay0, lay1 = rank_layout(cfg, 0, 2, mode), rank_layout(cfg, 1, 2, mode)
    if mode is ExpertSplit.INTERMEDIATE:
        assert lay0.experts == lay1.experts == (0, cfg.n_expert)
        assert (lay0.expert_ff, lay1.expert_ff) == ((0, cfg.n_ff // 2), (cfg.n_ff // 2, cfg.n_ff))
    else:
        assert lay0.expert_ff == lay1.expert_ff == (0, cfg.n_ff)
        assert lay0.experts == (0, (cfg.n_expert + 1) // 2)
    # Memory per rank is the same in both modes.
    other = ExpertSplit.EXPERTS if mode is ExpertSplit.INTERMEDIATE else ExpertSplit.INTERMEDIATE
    if cfg.n_expert % 2 == 0:
        assert shard_shapes(cfg, 0, 2, mode) != shard_shapes(cfg, 0, 2, other)
        assert all(
            sum(int(np.prod(s)) for s in shard_shapes(cfg, r, 2, mode).values())
            == sum(int(np.prod(s)) for s in shard_shapes(cfg, r, 2, other).values())
            for r in range(2)
        )
    assert lay0.vocab == (0, (cfg.n_vocab + 1) // 2)  # rank 0 takes the first ceil(V/2) rows
    assert lay1.vocab == ((cfg.n_vocab + 1) // 2, cfg.n_vocab)
    # Query heads of a rank read exactly the kv heads it holds.
    group = cfg.n_head // cfg.n_head_kv
    if cfg.n_head_kv == 1:
        return
    for lay in (lay0, lay1):
        assert (lay.heads[0] // group, lay.heads[1] // group) == lay.kv_heads


def test_block_ranges() -> None:
    assert [block_range(7, r, 2) for r in range(2)] == [(0, 4), (4, 7)]
    assert [block_range(8, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert block_range(5, 0, 1) == (0, 5)


def test_uneven_attention_splits() -> None:
    odd = CONFIGS["odd-kv-groups"]
    assert [(lay.kv_heads, lay.heads) for lay in (rank_layout(odd, r, 2) for r in range(2))] == [
        ((0, 2), (0, 6)),
        ((2, 3), (6, 9)),
    ]
    one = CONFIGS["one-kv-head"]
    assert [(lay.kv_heads, lay.heads) for lay in (rank_layout(one, r, 2) for r in range(2))] == [
        ((0, 1), (0, 3)),
        ((0, 1), (3, 6)),
    ]
    shapes = [shard_shapes(one, r, 2) for r in range(2)]
    assert shapes[0]["blk.0.attn_k.weight"] == shapes[1]["blk.0.attn_k.weight"] == (8, 48)
    assert shapes[0]["blk.0.attn_q.weight"] == shapes[1]["blk.0.attn_q.weight"] == (24, 48)


def test_kv_heads_go_in_groups_that_fill_whole_blocks() -> None:
    """Llama-3.2-3B's shapes in Q4_K (3 query heads of 128 a kv head: 384 attn_output columns,
    1.5 blocks of 256). 4 ranks cut kv heads one by one as before (2 each: whole blocks); 8
    ranks hand them out 2 at a time, so ranks 4-7 hold no heads; FFN and vocabulary rows go
    by the shares as ever (the gates end the attention and the FFN apart, so more FFN rows
    for the ranks without heads would only lengthen the FFN). The cut is no longer refused."""
    from foundry.model.spec.arch import ArchConfig

    cfg = ArchConfig(
        n_vocab=128256,
        n_embd=3072,
        n_layer=2,
        n_head=24,
        n_head_kv=8,
        n_ff=8192,
        n_expert=0,
        n_expert_used=0,
        key_length=128,
    )
    blocks = {
        f"blk.{i}.{n}.weight": 256
        for i in range(2)
        for n in ("attn_q", "attn_output", "ffn_gate", "ffn_down")
    }
    assert kv_group_of(cfg, (1,) * 4, blocks) == 1 and kv_group_of(cfg, (1,) * 8, blocks) == 2
    assert kv_group_of(cfg, (1,) * 8, {}) == 1  # float32: any cut is whole
    four = [rank_layout(cfg, r, 4, ExpertSplit.INTERMEDIATE) for r in range(4)]
    assert [(lay.kv_heads, lay.ff) for lay in four] == [
        ((2 * r, 2 * r + 2), (2048 * r, 2048 * r + 2048)) for r in range(4)
    ]
    eight = [rank_layout(cfg, r, 8, ExpertSplit.INTERMEDIATE, None, 2) for r in range(8)]
    assert [lay.kv_heads for lay in eight] == [(0, 2), (2, 4), (4, 6), (6, 8)] + [(8, 8)] * 4
    assert [lay.heads for lay in eight] == [(0, 6), (6, 12), (12, 18), (18, 24)] + [(24, 24)] * 4
    assert [lay.ff for lay in eight] == [(1024 * r, 1024 * r + 1024) for r in range(8)]
    assert [lay.vocab for lay in eight] == [(16032 * r, 16032 * (r + 1)) for r in range(8)]
    check_cuts(cfg, ExpertSplit.INTERMEDIATE, (1,) * 8, blocks)  # no longer refused
    one_by_one = rank_layout(cfg, 1, 8, ExpertSplit.INTERMEDIATE)  # kv heads a unit each
    with pytest.raises(SplitError, match=r"rank 1 of 8: its columns \[384, 768\) of 3072"):
        shard_part("blk.0.attn_output.weight", random_blocks(QType.Q4_K, 3072, 3072), one_by_one)


def test_auto_expert_split_takes_whole_experts_where_blocks_of_every_expert_do_not_fit() -> None:
    blocks = {"blk.0.ffn_down_exps.weight": 32, "blk.1.ffn_down_exps.weight": 32}
    moe = ModelConfig(n_ff=128, n_head_kv=4)
    assert pick_expert_split(moe, (1, 1), blocks)[0] is ExpertSplit.INTERMEDIATE  # 64 a rank
    assert pick_expert_split(moe, (1, 1, 1, 1), blocks) == (  # 32 a rank
        ExpertSplit.INTERMEDIATE,
        "each rank holds a block of every expert",
    )
    assert pick_expert_split(moe, (3, 1), blocks) == (  # 96 and 32
        ExpertSplit.INTERMEDIATE,
        "each rank holds a block of every expert",
    )
    assert pick_expert_split(moe, (1, 1, 1), {})[0] is ExpertSplit.EXPERTS  # 128 / 3
    assert pick_expert_split(moe, (1, 1, 1), {})[1] == (
        "cannot split the experts' intermediate dimension over 3 ranks: n_ff=128 is not "
        "divisible by 3 (each rank must hold an equal block of every expert)"
    )
    assert pick_expert_split(moe, (5, 3), blocks) == (  # 80 and 48
        ExpertSplit.EXPERTS,
        "intermediate would cut blk.0.ffn_down_exps.weight (128 columns) inside its blocks of 32",
    )


def test_odd_intermediate_size_is_refused_for_the_intermediate_split() -> None:
    cfg = ModelConfig(n_ff=45)
    params = T.init_params(cfg)
    with pytest.raises(SplitError, match=r"n_ff=45 is not divisible by 2.*--expert-split experts"):
        rank_layout(cfg, 0, 2, ExpertSplit.INTERMEDIATE)
    with pytest.raises(SplitError, match="n_ff=45"):
        Engine(cfg, params, rank=0, world=2, expert_split=ExpertSplit.INTERMEDIATE)
    assert rank_layout(cfg, 0, 2).expert_ff == (0, 45)  # whole experts need no even n_ff
    # One process of a model no pair can run in this mode holds everything in one part.
    assert len(Engine(cfg, params, expert_split=ExpertSplit.INTERMEDIATE).parts) == 1


def test_rank_weights_check_shapes() -> None:
    cfg, params = make("tiny-odd-vocab")
    rw = rank_weights(cfg, params, 1, 2)
    with pytest.raises(ValueError, match="attn_q"):
        wrong = {**rw.params, "blk.0.attn_q.weight": params["blk.0.attn_q.weight"]}
        type(rw)(cfg, rw.layout, wrong)
    with pytest.raises(ValueError, match="rank 1 of 2"):
        Engine(cfg, rw, rank=0, world=2)
    with pytest.raises(ValueError, match=r"cut with expert split experts.*asked for intermediate"):
        Engine(cfg, rw, rank=1, world=2, expert_split=ExpertSplit.INTERMEDIATE)
    rank1 = Engine(cfg, rw, rank=1, world=2)
    assert rank1.expert_split is ExpertSplit.EXPERTS
    with pytest.raises(ValueError, match="GateExchange"):
        rank1.decode(rank1.new_session(), [1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_pair_equals_single_process_prefill_and_greedy(name: str, mode: ExpertSplit) -> None:
    cfg, params = make(name)
    single = Engine(cfg, params, expert_split=mode)
    assert single.expert_split is mode and len(single.parts) == 2
    pair = Pair(cfg, params, mode)
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
    assert all(s.tokens == history for s in (*s_tp, s_ref))

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


@pytest.mark.parametrize("mode", MODES)
def test_pair_serves_several_sessions_in_one_pass(mode: ExpertSplit) -> None:
    cfg, params = make("shared-odd-experts")
    single = Engine(cfg, params, expert_split=mode)
    pair = Pair(cfg, params, mode)
    rng = np.random.default_rng(2)
    refs = [single.new_session() for _ in range(3)]
    tps = [pair.new_sessions() for _ in range(3)]
    for step, lens in enumerate([(5, 1, 9), (1, 1, 1), (3, 2, 1)]):
        blocks = [[int(t) for t in rng.integers(0, cfg.n_vocab, n)] for n in lens]
        ref = single.forward_rows(list(zip(refs, blocks, strict=True)))
        got = pair.forward_rows(list(zip(tps, blocks, strict=True)))
        np.testing.assert_array_equal(got, ref, err_msg=f"step {step}")
    for s_ref, tp in zip(refs, tps, strict=True):
        assert all(s.pos == s_ref.pos for s in tp)


def test_quantized_parts_are_cut_on_whole_blocks_only() -> None:
    """Stored blocks stay blocks: each rank's part of a Q8_0 tensor (32 values a block) is the
    same blocks, its values those of the whole; a cut inside a block is refused, naming it."""
    rng = np.random.default_rng(3)
    cfg = ModelConfig()  # attn_output (64, 64): columns [0, 32) and [32, 64), whole blocks
    q = quantize(rng.standard_normal((64, 64)).astype(np.float32), QType.Q8_0)
    whole = q.dequantize()
    for r in range(2):
        part = shard_part("blk.0.attn_output.weight", q, rank_layout(cfg, r, 2))
        assert isinstance(part, QTensor) and part.qtype is QType.Q8_0 and part.shape == (64, 32)
        np.testing.assert_array_equal(part.dequantize(), whole[:, 32 * r : 32 * (r + 1)])
    # Six heads of 16 over two ranks: columns [0, 48) and [48, 96) end and start mid-block.
    odd = ModelConfig(n_embd=96, n_head=6, n_head_kv=2)
    q96 = quantize(rng.standard_normal((96, 96)).astype(np.float32), QType.Q8_0)
    for r, cols in enumerate(("[0, 48)", "[48, 96)")):
        with pytest.raises(
            SplitError,
            match=(
                rf"cannot split blk\.0\.attn_output\.weight \(Q8_0, blocks of 32 values\) for rank "
                rf"{r} of 2: its columns \{cols[:-1]}\) of 96 do not start and end on a block"
            ),
        ):
            shard_part("blk.0.attn_output.weight", q96, rank_layout(odd, r, 2))
    # The experts' intermediate cut of ffn_down_exps (its last axis of n_ff = 96) likewise.
    ff = ModelConfig(n_ff=96)
    down = quantize(rng.standard_normal((4, 64, 96)).astype(np.float32), QType.Q8_0)
    with pytest.raises(SplitError, match=r"columns \[0, 48\) of 96"):
        shard_part(
            "blk.0.ffn_down_exps.weight", down, rank_layout(ff, 0, 2, ExpertSplit.INTERMEDIATE)
        )


def test_world_and_rank_out_of_range_are_refused() -> None:
    cfg = ModelConfig()
    with pytest.raises(SplitError, match=r"world size must be >= 1, got 0"):
        rank_layout(cfg, 0, 0)
    with pytest.raises(SplitError, match=r"rank must lie in \[0, 2\), got 2"):
        rank_layout(cfg, 2, 2)
    with pytest.raises(SplitError, match=r"got -1"):
        rank_layout(cfg, -1, 2)


# -- N ranks and shares ----------------------------------------------------------------------


def test_equal_shares_give_the_plain_blocks() -> None:
    for n in range(40):
        for world in range(1, 9):
            assert [share_range(n, r, (1,) * world) for r in range(world)] == [
                block_range(n, r, world) for r in range(world)
            ]
    # Largest remainder: 10 units by 2,1,1 are 5, 2.5, 2.5: the earlier rank takes the tie.
    assert share_blocks(10, (2, 1, 1)) == [5, 3, 2]
    assert share_blocks(7, (3, 1)) == [5, 2]
    assert norm_shares(3, (4, 2, 2)) == (2, 1, 1)
    assert norm_shares(2) == (1, 1)


def test_two_equal_ranks_are_cut_as_before_shares() -> None:
    for name, cfg in CONFIGS.items():
        for mode in MODES:
            for r in range(2):
                plain = rank_layout(cfg, r, 2, mode)
                assert rank_layout(cfg, r, 2, mode, (3, 3)) == plain, name
                assert plain.vocab == block_range(cfg.n_vocab, r, 2)


def test_shares_the_model_cannot_take_are_refused_with_the_nearest_that_works() -> None:
    cfg = ModelConfig(n_head=4, n_head_kv=4)  # 4 kv heads over 3 ranks
    assert [rank_layout(cfg, r, 3).kv_heads for r in range(3)] == [(0, 2), (2, 3), (3, 4)]
    with pytest.raises(
        SplitError,
        match=(
            r"^cannot split the model by shares 4,1,1: a rank would hold none of its 4 kv "
            r"heads; the nearest shares that work are 2,1,1$"
        ),
    ):
        rank_layout(cfg, 0, 3, shares=(4, 1, 1))
    assert [rank_layout(cfg, r, 3, shares=(2, 1, 1)).kv_heads for r in range(3)] == [
        (0, 2),
        (2, 3),
        (3, 4),
    ]
    with pytest.raises(
        SplitError,
        match=(
            r"^cannot split the model over 5 ranks: it has 4 query heads and every rank needs "
            r"at least one; the nearest world size that works is 4$"
        ),
    ):
        rank_layout(ModelConfig(n_head_kv=1), 0, 5)
    with pytest.raises(
        SplitError,
        match=(
            r"^cannot split the model over 3 ranks: it has 2 kv heads and every rank needs "
            r"at least one; the nearest world size that works is 2$"
        ),
    ):
        rank_layout(ModelConfig(), 0, 3)
    with pytest.raises(SplitError, match=r"2 shares given for a world of 3 ranks"):
        rank_layout(cfg, 0, 3, shares=(1, 1))
    with pytest.raises(SplitError, match=r"shares must be integers in \[1, 65535\], got 1,0"):
        norm_shares(2, (1, 0))


NWORLDS = [
    ("odd-kv-groups", 3, None),  # 3 kv heads, one each
    ("one-kv-head", 3, (3, 2, 1)),  # one kv head, replicated; queries 3, 2 and 1
    ("one-kv-head", 4, None),  # one kv head, replicated; 6 query heads over 4
    ("shared-one-kv", 4, (3, 1, 1, 1)),
    ("kv4", 3, (2, 1, 1)),  # uneven: 3 ranks on 4 kv heads
    ("kv4", 3, None),
]
CONFIGS["shared-one-kv"] = ModelConfig(
    n_vocab=97,
    n_embd=48,
    n_layer=2,
    n_head=6,
    n_head_kv=1,
    n_ff=40,
    n_expert=6,
    n_expert_used=2,
    n_ff_shared=25,
)
CONFIGS["kv4"] = ModelConfig(
    n_vocab=89, n_embd=64, n_head=4, n_head_kv=4, n_ff=40, n_expert=5, n_expert_used=2
)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "world", "shares"), NWORLDS)
def test_n_ranks_equal_single_process_standing_for_them(
    name: str, world: int, shares: tuple[int, ...] | None, mode: ExpertSplit
) -> None:
    cfg, params = make(name)
    if mode is ExpertSplit.INTERMEDIATE and cfg.n_ff % world and shares is None:
        with pytest.raises(SplitError, match=rf"n_ff={cfg.n_ff} is not divisible by {world}"):
            Pair(cfg, params, mode, world, shares)
        return
    norm = norm_shares(world, shares)
    single = Engine(cfg, params, expert_split=mode, shares=norm)
    assert len(single.parts) == world and single.shares == norm
    pair = Pair(cfg, params, mode, world, shares)
    s_ref, s_tp = single.new_session(), pair.new_sessions()
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.n_vocab, 11)]
    ref = single.decode(s_ref, prompt)
    got = pair.forward_rows([(s_tp, prompt)])
    np.testing.assert_array_equal(got, ref)
    for _ in range(16):
        token = int(np.argmax(ref[-1]))
        ref = single.decode(s_ref, [token])
        got = pair.forward_rows([(s_tp, [token])])
        np.testing.assert_array_equal(got, ref)
    assert all(log == pair.exchange.log[0] for log in pair.exchange.log)
