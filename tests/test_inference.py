"""KV-cache inference against the training forward, and sessions against each other.

Tolerances: the training forward and the engine group their float sums differently (whole
batches vs rows, whole model vs two halves), so they agree to ~1e-6; runs that perform the
very same operations (one session alone or interleaved with others, a rewind and replay) must
agree bit for bit.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from foundry.model.infer.inference import Engine, Gate
from foundry.model.infer.kv_cache import KVCache, Session
from foundry.model.kernels import quant
from foundry.model.kernels.quant import QType
from foundry.model.nn import transformer as T
from foundry.model.shard.table import ExpertSplit
from foundry.model.spec.config import ModelConfig

ATOL = 1e-5

CONFIGS = {
    # Splits in two: the single-process engine evaluates both rank halves.
    "tiny": ModelConfig(),
    # n_head_kv = 1: both halves compute and cache the one kv head, the query heads are split.
    "single-kv-shared": ModelConfig(
        n_embd=32,
        n_head=4,
        n_head_kv=1,
        n_ff=48,
        n_expert=3,
        n_expert_used=2,
        n_ff_shared=40,
        n_ctx=64,
    ),
}


def make(name: str) -> tuple[ModelConfig, dict[str, npt.NDArray[np.float32]]]:
    cfg = CONFIGS[name]
    rng = np.random.default_rng(3)
    params = T.init_params(cfg, seed=2)
    for p in params.values():  # stronger than init, so routing and attention vary per token
        p += np.float32(0.1) * rng.standard_normal(p.shape, dtype=np.float32)
    return cfg, params


def prompt(n: int, seed: int = 0, vocab: int = 259) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def one_by_one(engine: Engine, session: Session, tokens: list[int]) -> npt.NDArray[np.float32]:
    return np.concatenate([engine.decode(session, [t]) for t in tokens])


@pytest.mark.parametrize("mode", list(ExpertSplit))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_equals_training_forward(name: str, mode: ExpertSplit) -> None:
    cfg, params = make(name)
    tokens = prompt(40)
    ref, _ = T.forward(params, cfg, np.array([tokens]))  # (1, 40, V)
    engine = Engine(cfg, params, expert_split=mode, kv_cache=KVCache.F32)  # exact, as training
    assert len(engine.parts) == 2
    kv = [p.layout.kv_heads for p in engine.parts]
    heads = [p.layout.heads for p in engine.parts]
    assert kv == ([(0, 1), (1, 2)] if name == "tiny" else [(0, 1), (0, 1)])
    assert heads == [(0, 2), (2, 4)]
    assert engine.expert_split is mode
    session = engine.new_session()
    got = one_by_one(engine, session, tokens)
    assert got.shape == (40, cfg.n_vocab) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref[0], rtol=0, atol=ATOL)
    assert session.pos == 40 and session.tokens == tokens


@pytest.mark.parametrize("mode", list(ExpertSplit))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_decode_equals_token_by_token(name: str, mode: ExpertSplit) -> None:
    cfg, params = make(name)
    tokens = prompt(37, seed=1)
    # float32 weights: BLAS may sum a block's K and V differently from one row's, by an ulp,
    # which a float16 cache could round one step apart; the float32 cache keeps them at ATOL
    engine = Engine(cfg, params, expert_split=mode, kv_cache=KVCache.F32)
    single = one_by_one(engine, engine.new_session(), tokens)
    s = engine.new_session()
    blocks = np.concatenate(
        [
            engine.decode(s, tokens[:20]),
            engine.decode(s, tokens[20:21]),
            engine.decode(s, tokens[21:]),
        ]
    )
    np.testing.assert_allclose(blocks, single, rtol=0, atol=ATOL)


def test_rewind_and_replay_give_the_same_logits() -> None:
    cfg, params = make("tiny")
    engine = Engine(cfg, params)
    s = engine.new_session()
    tokens = prompt(30, seed=2)
    first = one_by_one(engine, s, tokens)
    s.rewind(12)
    assert s.pos == 12 and s.tokens == tokens[:12]
    one_by_one(engine, s, prompt(9, seed=7))  # a different continuation, then back again
    s.rewind(12)
    again = one_by_one(engine, s, tokens[12:])
    np.testing.assert_array_equal(again, first[12:])
    with pytest.raises(ValueError, match="rewind"):
        s.rewind(31)


def test_interleaved_sessions_equal_each_alone() -> None:
    cfg, params = make("tiny")
    engine = Engine(cfg, params)
    streams = [prompt(n, seed=10 + n) for n in (25, 18, 31)]
    alone = [one_by_one(engine, engine.new_session(), toks) for toks in streams]
    sessions = [engine.new_session() for _ in streams]
    got: list[list[npt.NDArray[np.float32]]] = [[] for _ in streams]
    for step in range(max(len(t) for t in streams)):
        for i, toks in enumerate(streams):
            if step < len(toks):
                got[i].append(engine.decode(sessions[i], [toks[step]]))
    for g, a in zip(got, alone, strict=True):
        np.testing.assert_array_equal(np.concatenate(g), a)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_rows_of_several_sessions_equals_them_alone(name: str) -> None:
    cfg, params = make(name)
    engine = Engine(cfg, params, kv_cache=KVCache.F32)  # float32 weights: as in the test above
    prefixes = [prompt(n, seed=20 + n) for n in (5, 0, 11)]
    blocks = [prompt(n, seed=30 + n) for n in (1, 7, 4)]

    alone = []
    for pre, blk in zip(prefixes, blocks, strict=True):
        s = engine.new_session()
        if pre:
            engine.decode(s, pre)
        alone.append(engine.decode(s, blk))

    sessions = [engine.new_session() for _ in prefixes]
    for s, pre in zip(sessions, prefixes, strict=True):
        if pre:
            engine.decode(s, pre)
    together = engine.forward_rows(list(zip(sessions, blocks, strict=True)))
    np.testing.assert_allclose(together, np.concatenate(alone), rtol=0, atol=ATOL)
    for s, pre, blk in zip(sessions, prefixes, blocks, strict=True):
        assert s.pos == len(pre) + len(blk) and s.tokens == pre + blk

    # Continuing them one at a time afterwards still matches a fresh single run.
    follow = prompt(3, seed=99)
    ref = engine.new_session()
    one_by_one(engine, ref, prefixes[2] + blocks[2])
    np.testing.assert_allclose(
        one_by_one(engine, sessions[2], follow),
        one_by_one(engine, ref, follow),
        rtol=0,
        atol=ATOL,
    )


def test_a_float16_cache_rounds_k_and_v_and_nothing_else() -> None:
    """The float16 cache (llama.cpp's -ctk f16 -ctv f16) holds K and V rounded to float16, half
    the bytes of float32; attention over it is the same bits as over a float32 cache holding
    the rounded values (the conversion is exact, the operations the same), on every path."""
    cfg, params = make("single-kv-shared")
    half, full = Engine(cfg, params, kv_cache=KVCache.F16), Engine(cfg, params)
    assert full.kv_cache is KVCache.F32  # the default for float32 matrices, F16 for blocks:
    stored = {
        k: quant.quantize(v, QType.Q8_0) if k == "output.weight" else v for k, v in params.items()
    }
    assert Engine(cfg, stored).kv_cache is KVCache.F16  # type: ignore[arg-type]
    sh, sf = half.new_session(), full.new_session()
    assert sh.k[0][0].dtype == np.float16 and sh.v[0][0].dtype == np.float16
    assert sh.k[0][0].nbytes * 2 == sf.k[0][0].nbytes
    tokens = prompt(30, seed=4)
    got, want = half.decode(sh, tokens), full.decode(sf, tokens)
    diff = float(np.abs(got - want).max())
    assert 0 < diff < 0.02 * float(np.abs(want).max()), diff  # rounded, and only that
    # The kernel on the float16 cache against the float32 cache of the same values.
    rng = np.random.default_rng(6)
    k16, v16 = (rng.standard_normal((21, 2, 64)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((6, 64)).astype(np.float32)
    paths = ["best", "portable"]
    assert quant._kernels is not None
    outs = []
    try:
        for path in paths:
            quant._kernels.use(path)
            for k, v in ((k16, v16), (k16.astype(np.float32), v16.astype(np.float32))):
                out = np.empty_like(q)
                quant.attend(q, k, v, 17, out)
                outs.append(out)
    finally:
        quant._kernels.use("best")
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])
    with pytest.raises(quant.QuantError, match="float16"):
        quant.attend(q, k16, v16.astype(np.float32), 17, np.empty_like(q))


def test_bad_rows_are_refused_and_change_nothing() -> None:
    cfg, params = make("tiny")
    engine = Engine(cfg, params)
    s = engine.new_session(ctx_size=8)
    engine.decode(s, [5, 6, 7])
    with pytest.raises(ValueError, match="full"):
        engine.decode(s, list(range(6)))
    with pytest.raises(ValueError, match="twice"):
        engine.forward_rows([(s, [1]), (s, [2])])
    with pytest.raises(ValueError, match="token ids"):
        engine.decode(s, [cfg.n_vocab])
    with pytest.raises(ValueError, match="empty"):
        engine.decode(s, [])
    with pytest.raises(ValueError, match="another engine"):
        Engine(cfg, params).decode(s, [1])
    assert s.pos == 3 and s.tokens == [5, 6, 7]


def test_a_failing_exchange_leaves_sessions_unchanged() -> None:
    cfg, params = make("tiny")
    engine = Engine(cfg, params)
    ref = engine.new_session()
    expected = one_by_one(engine, ref, [1, 2, 3, 4])
    s = engine.new_session()
    one_by_one(engine, s, [1, 2])

    def broken(layer: int, gate: Gate, partial: npt.NDArray[np.float32]) -> np.ndarray:
        if layer == 1 and gate is Gate.FFN:
            raise ConnectionError("peer went away")
        return partial

    with pytest.raises(ConnectionError):
        engine.decode(s, [9, 9, 9], exchange=broken)
    assert s.pos == 2 and s.tokens == [1, 2]
    np.testing.assert_array_equal(one_by_one(engine, s, [3, 4]), expected[2:])
