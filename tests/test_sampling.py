"""Greedy, temperature and nucleus sampling: exact sets, distributions and determinism."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from foundry.model.infer.sampling import (
    SamplingError,
    combine_tops,
    greedy_tops,
    kept_tokens,
    logprobs,
    make_rng,
    probabilities,
    sample,
    sample_rows,
    top_indices,
)
from foundry.model.kernels import quant

logit_vectors = arrays(
    np.float32,
    st.integers(1, 40),
    elements=st.floats(-30, 30, width=32),
)


def test_greedy_takes_the_first_maximum() -> None:
    assert sample(np.array([0.1, 2.0, -1.0, 2.0]), temperature=0.0) == 1
    assert sample(np.array([5.0]), temperature=0.0) == 0
    assert sample(np.array([-np.inf, -3.0, -np.inf]), temperature=0.0) == 1


# Rows with the values that decide a greedy pick: ties, -0 and +0, -inf, NaN and +inf.
special_rows = arrays(
    np.float32,
    st.tuples(st.integers(1, 6), st.integers(2, 60)),
    elements=st.one_of(
        st.sampled_from([0.0, -0.0, 1.0, 3.0, -np.inf]),
        st.floats(-5, 5, width=32),
        st.sampled_from([np.nan, np.inf]),
    ),
)


@settings(max_examples=300, deadline=None)
@given(rows=special_rows, cuts=st.lists(st.integers(1, 59), max_size=4), kernels=st.booleans())
def test_row_tops_of_vocabulary_blocks_combine_to_the_greedy_token_of_the_row(
    rows: np.ndarray, cuts: list[int], kernels: bool
) -> None:
    """A row cut into vocabulary blocks (a tensor-parallel rank's each), each reduced to its
    greedy_tops (by the C kernels, or numpy without them) and combined in order, gives what
    sample(row, 0) gives the whole row: the first maximum, or the same error (NaN or +inf
    anywhere; -inf everywhere)."""
    edges = sorted({0, rows.shape[1], *(c for c in cuts if c < rows.shape[1])})
    blocks = []
    with pytest.MonkeyPatch.context() as mp:
        if not kernels:
            mp.setattr("foundry.model.infer.sampling._kernels", None)
        for lo, hi in itertools.pairwise(edges):
            values, tokens = greedy_tops(rows[:, lo:hi])
            blocks.append((values, [t + lo if t >= 0 else t for t in tokens]))
    picks = combine_tops(blocks)
    for row, pick in zip(rows, picks, strict=True):
        try:
            want: int | str = sample(row, 0.0)
        except SamplingError as exc:
            want = str(exc)
        assert (str(pick) if isinstance(pick, SamplingError) else pick) == want


def test_rows_drawn_together_give_each_rows_own_token_and_error() -> None:
    """A step's rows in one call (on the kernels' threads): each the token ``sample`` gives it
    alone (its own rng), a broken row its SamplingError in its place, the others unharmed; in
    float32 and float64, at one thread and at four."""
    logits = 3 * np.random.default_rng(3).standard_normal((6, 20_000))
    logits[4, 7] = np.nan
    settings_of = [
        (0.8, 1.0, 0),
        (0.8, 0.9, 0),
        (0.0, 1.0, 0),
        (1.0, 1.0, 50),
        (0.8, 1.0, 0),
        (2.0, 0.5, 10),
    ]

    def text(picks: list[int | SamplingError]) -> list[int | str]:
        return [str(x) if isinstance(x, SamplingError) else x for x in picks]

    for rows in (logits.astype(np.float32), logits):
        alone: list[int | str] = []
        for i, (row, (t, p, k)) in enumerate(zip(rows, settings_of, strict=True)):
            try:
                alone.append(sample(row, t, p, make_rng(i), k))
            except SamplingError as exc:
                alone.append(str(exc))
        for threads in (1, 4):
            quant.set_threads(threads)
            try:
                together = sample_rows(
                    [
                        (row, t, p, make_rng(i), k)
                        for i, (row, (t, p, k)) in enumerate(zip(rows, settings_of, strict=True))
                    ]
                )
            finally:
                quant.set_threads(1)
            assert text(together) == alone
            assert isinstance(together[4], SamplingError) and "NaN" in str(together[4])


def test_greedy_draws_nothing_from_the_rng() -> None:
    rng = make_rng(1)
    sample(np.array([1.0, 2.0]), temperature=0.0, rng=rng)
    assert rng.random() == make_rng(1).random()


def test_probabilities_are_a_stable_softmax() -> None:
    p = probabilities(np.array([1000.0, 1000.0, -np.inf]), temperature=1.0)
    np.testing.assert_allclose(p, [0.5, 0.5, 0.0])
    p = probabilities(np.array([0.0, np.log(3.0)]), temperature=1.0)
    np.testing.assert_allclose(p, [0.25, 0.75])
    p = probabilities(np.array([0.0, np.log(3.0)]), temperature=2.0)
    np.testing.assert_allclose(p, [1 / (1 + np.sqrt(3)), np.sqrt(3) / (1 + np.sqrt(3))])
    assert p.dtype == np.float64


def test_tiny_temperature_is_greedy_without_warnings() -> None:
    rng = make_rng(0)
    logits = np.array([1.0, 1.5, 0.5])
    assert {sample(logits, 1e-300, rng=rng) for _ in range(20)} == {1}


@settings(max_examples=50, deadline=None)
@given(logit_vectors, st.floats(0.05, 1.0), st.floats(0.1, 3.0), st.integers(0, 2**32))
def test_top_p_keeps_the_smallest_sufficient_set(
    logits: np.ndarray, top_p: float, temperature: float, seed: int
) -> None:
    p = probabilities(logits, temperature)
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    reached = np.nonzero(cum >= top_p)[0]
    k = len(order) if top_p >= 1.0 or len(reached) == 0 else int(reached[0]) + 1
    allowed = set(order[:k].tolist())
    rng = make_rng(seed)
    for _ in range(5):
        tok = sample(logits, temperature, top_p, rng)
        assert tok in allowed
        assert p[tok] > 0


def test_top_p_small_is_greedy() -> None:
    rng = make_rng(3)
    logits = np.array([0.0, 3.0, 2.9, -1.0])
    assert {sample(logits, 1.0, top_p=0.01, rng=rng) for _ in range(50)} == {1}


def test_top_p_cuts_the_tail_exactly() -> None:
    # probabilities 0.5, 0.3, 0.2: any top_p in (0.5, 0.8] keeps exactly the first two.
    logits = np.log(np.array([0.2, 0.5, 0.3]))
    rng = make_rng(4)
    seen = {sample(logits, 1.0, top_p=0.79, rng=rng) for _ in range(300)}
    assert seen == {1, 2}
    seen = {sample(logits, 1.0, top_p=0.81, rng=rng) for _ in range(300)}
    assert seen == {0, 1, 2}


def test_sampling_follows_the_distribution() -> None:
    probs = np.array([0.1, 0.6, 0.3])
    rng = make_rng(5)
    n = 6000
    counts = np.bincount([sample(np.log(probs), 1.0, 1.0, rng) for _ in range(n)], minlength=3)
    # Three standard deviations of a binomial count.
    assert np.all(np.abs(counts - n * probs) < 3 * np.sqrt(n * probs * (1 - probs)))


def test_same_seed_same_tokens() -> None:
    logits = np.random.default_rng(0).standard_normal(259)
    a = [sample(logits, 0.8, 0.9, make_rng(42)) for _ in range(3)]
    rng1, rng2 = make_rng(7), make_rng(7)
    s1 = [sample(logits, 0.8, 0.95, rng1) for _ in range(50)]
    s2 = [sample(logits, 0.8, 0.95, rng2) for _ in range(50)]
    assert s1 == s2
    assert len(set(a)) == 1
    assert len(set(s1)) > 1


def test_zero_probability_tokens_are_never_drawn() -> None:
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0])
    rng = make_rng(9)
    assert {sample(logits, 1.0, 1.0, rng) for _ in range(200)} == {1, 3}


@pytest.mark.parametrize(
    ("logits", "temperature", "top_p", "match"),
    [
        (np.array([1.0, np.nan]), 1.0, 1.0, "NaN"),
        (np.array([1.0, np.inf]), 1.0, 1.0, r"\+inf"),
        (np.array([-np.inf, -np.inf]), 1.0, 1.0, "every logit is -inf"),
        (np.array([]), 1.0, 1.0, "non-empty"),
        (np.zeros((2, 3)), 1.0, 1.0, "vector"),
        (np.zeros(3), -0.5, 1.0, "temperature"),
        (np.zeros(3), float("nan"), 1.0, "temperature"),
        (np.zeros(3), 1.0, 0.0, "top_p"),
        (np.zeros(3), 1.0, 1.5, "top_p"),
    ],
)
def test_bad_input_is_a_clear_error(
    logits: np.ndarray, temperature: float, top_p: float, match: str
) -> None:
    with pytest.raises(SamplingError, match=match):
        sample(logits, temperature, top_p, make_rng(0))


def test_sampling_needs_an_rng() -> None:
    with pytest.raises(SamplingError, match="rng"):
        sample(np.zeros(3), 1.0)


def reference_kept(p: np.ndarray, top_p: float, top_k: int) -> set[int]:
    """The kept set by sorting the whole row (what the sampler must equal without sorting)."""
    order = np.lexsort((np.arange(p.size), -p))  # probability descending, ties by id
    order = order[p[order] > 0]
    if top_k:
        order = order[:top_k]
    if top_p < 1.0:
        cum = np.cumsum(p[order])
        need = top_p * cum[-1] if top_k and top_k < np.count_nonzero(p) else top_p
        order = order[: min(int(np.searchsorted(cum, need, side="left")) + 1, order.size)]
    return set(order.tolist())


@settings(max_examples=100, deadline=None)
@given(
    arrays(np.float32, st.integers(1, 300), elements=st.sampled_from([-2.0, 0.0, 0.5, 1.0, 3.0])),
    st.floats(0.01, 1.0),
    st.integers(0, 20),
    st.floats(0.2, 2.0),
)
def test_kept_set_equals_a_full_sort_ties_included(
    logits: np.ndarray, top_p: float, top_k: int, temperature: float
) -> None:
    # Few distinct values: many ties at every cut, where argpartition's order is arbitrary.
    p = probabilities(logits, temperature)
    kept = kept_tokens(p, top_p, top_k)
    assert set(kept.tolist()) == reference_kept(p, top_p, top_k)
    if top_k or top_p < 1.0:  # the draw's order: probability descending, ties by id
        assert list(kept) == sorted(kept, key=lambda t: (-p[t], t))


def test_top_k_keeps_exactly_the_k_most_probable() -> None:
    logits = np.array([0.0, 5.0, 1.0, 4.0, 3.0, 2.0])
    rng = make_rng(1)
    assert {sample(logits, 5.0, rng=rng, top_k=2) for _ in range(200)} == {1, 3}
    assert {sample(logits, 5.0, rng=rng, top_k=1) for _ in range(20)} == {1}
    assert {sample(logits, 50.0, rng=rng, top_k=100) for _ in range(400)} == set(range(6))
    # top-k, then top-p of what is left: 0.6 of {1, 3} is token 1 alone at temperature 1.
    assert {sample(logits, 1.0, 0.6, rng=rng, top_k=2) for _ in range(50)} == {1}


def test_a_262k_row_keeps_a_small_top_p_set() -> None:
    # Gemma 3's vocabulary: the kept set is found from one bucketing pass.
    logits = np.random.default_rng(0).standard_normal(262_144).astype(np.float32) * 2.5
    p = probabilities(logits, 1.0)
    kept = kept_tokens(p, top_p=0.5)
    assert set(kept.tolist()) == reference_kept(p, 0.5, 0)
    assert 1 < kept.size < 262_144 // 8
    assert top_indices(p, 40).tolist() == reference_order(p)[:40]


def reference_order(p: np.ndarray) -> list[int]:
    return np.lexsort((np.arange(p.size), -p)).tolist()


def test_top_indices_break_ties_by_id() -> None:
    values = np.array([1.0, 3.0, 3.0, 2.0, 3.0, 1.0])
    assert top_indices(values, 2).tolist() == [1, 2]
    assert top_indices(values, 4).tolist() == [1, 2, 4, 3]
    assert top_indices(values, 10).tolist() == [1, 2, 4, 3, 0, 5]


def test_logprobs_are_the_log_softmax_of_the_raw_logits() -> None:
    logits = np.array([1.0, 3.0, -np.inf, 2.0, 3.0], dtype=np.float32)
    z = logits.astype(np.float64)
    finite = z[np.isfinite(z)]
    log_total = np.log(np.exp(finite).sum())
    got = logprobs(logits, 3, top=3)
    assert got.token == 3
    assert got.logprob == pytest.approx(2.0 - log_total)
    assert [t for t, _ in got.top] == [1, 4, 3]
    assert [v for _, v in got.top] == pytest.approx([3 - log_total, 3 - log_total, 2 - log_total])
    assert logprobs(logits, 2).logprob == -np.inf and logprobs(logits, 2).top == ()
    with pytest.raises(SamplingError, match="top logprobs"):
        logprobs(logits, 0, top=21)
    with pytest.raises(SamplingError, match="outside"):
        logprobs(logits, 5)
    with pytest.raises(SamplingError, match="top_k"):
        sample(logits, 1.0, rng=make_rng(0), top_k=-1)


C_PATHS = ["portable", "avx2", "best"]


@pytest.mark.skipif(quant._kernels is None, reason="needs the C kernels")
def test_the_c_draw_is_the_same_on_every_path_and_walks_the_kept_tokens_in_order() -> None:
    """The C sampler (sample.c) directly, with chosen uniforms: u = 0 takes the first kept token
    (the most probable, the lower id among equals) and u just under 1 the last kept one; every
    u gives a token of the kept set; the portable C and the SIMD paths agree on every token."""
    kernels = quant._kernels
    assert kernels is not None
    rng = np.random.default_rng(11)
    # Few distinct values: ties everywhere; top_p values that put no cut on a rounding boundary.
    rows = [rng.choice([-3.0, -1.0, 0.0, 0.5, 2.0], 700).astype(np.float32) for _ in range(4)]
    rows[3][::3] = -np.inf
    settings_of = [(0.7, 1.0, 0), (1.3, 0.61, 0), (1.0, 1.0, 25), (0.9, 0.83, 40), (2.0, 0.33, 0)]
    us = [0.0, 0.25, 0.5, 0.75, 1.0 - 2.0**-53]
    for row in rows:
        for temperature, top_p, top_k in settings_of:
            p = probabilities(row, temperature)
            kept = reference_kept(p, top_p, top_k)
            order = [t for t in reference_order(p) if t in kept]
            picks = {}
            for path in C_PATHS:
                kernels.use(path)
                try:
                    args = np.array([[temperature, top_p, u, top_k] for u in us], np.float64)
                    out = np.empty(len(us), np.int64)
                    kernels.sample_rows([row] * len(us), args, out)
                finally:
                    kernels.use("best")
                picks[path] = out.tolist()
            assert picks["portable"] == picks["avx2"] == picks["best"]
            got = picks["best"]
            assert set(got) <= kept
            if top_k or top_p < 1.0:  # a cut: walked most probable first
                assert got[0] == order[0] and got[-1] == order[-1]
            else:  # uncut: walked in id order over the nonzero tokens
                assert got[0] == min(kept) and got[-1] == max(kept)
