"""Round policy: allocation, deadlines, quorum, aggregation, backoff (pure functions)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from foundry.swarm.policy import (
    GradientSum,
    Report,
    RoundDecision,
    RoundTracker,
    allocate_samples,
    contiguous_offsets,
    is_dead,
    liveness_timeout,
    local_batches,
    round_deadline,
    round_decision,
    slow_workers,
    update_rate,
    weighted_mean,
)
from foundry.swarm.sync import fill_local_round, plan_local_round
from foundry.transport.backoff import backoff_delay

rates_st = st.dictionaries(
    st.text(alphabet="abcdefgh", min_size=1, max_size=4),
    st.floats(min_value=0.0, max_value=1e4, allow_nan=False),
    min_size=1,
    max_size=12,
)


@given(st.integers(min_value=0, max_value=10_000), rates_st)
def test_allocation_sums_exactly_and_feeds_everyone(
    global_batch: int, rates: dict[str, float]
) -> None:
    shares = allocate_samples(global_batch, rates)
    assert sum(shares.values()) == global_batch
    assert set(shares) == set(rates)
    if global_batch >= len(rates):
        assert min(shares.values()) >= 1


def test_allocation_follows_throughput() -> None:
    # A desktop three times as fast as a Pi gets three times the samples.
    shares = allocate_samples(64, {"pi": 10.0, "desktop": 30.0})
    assert shares == {"desktop": 48, "pi": 16}


def test_allocation_without_measurements_is_equal() -> None:
    assert allocate_samples(9, {"a": 0.0, "b": 0.0, "c": 0.0}) == {"a": 3, "b": 3, "c": 3}


def test_offsets_are_contiguous_and_disjoint() -> None:
    shares = {"b": 5, "a": 3, "c": 2}
    offsets = contiguous_offsets(100, shares)
    assert offsets == {"a": 100, "b": 103, "c": 108}


def test_rate_ema() -> None:
    assert update_rate(None, 10.0) == 10.0
    assert update_rate(10.0, 20.0, alpha=0.5) == 15.0
    assert update_rate(10.0, float("nan")) == 10.0
    assert update_rate(None, 0.0) == 0.0


def test_deadline_adapts_to_the_slowest_expected_finish() -> None:
    shares = {"pi": 10, "desktop": 30}
    rates = {"pi": 5.0, "desktop": 30.0}  # pi expects 2 s, desktop 1 s
    assert round_deadline(100.0, shares, rates, factor=2.5, floor_s=1.0) == 105.0
    assert round_deadline(100.0, shares, rates, factor=0.1, floor_s=1.0) == 101.0
    # an unmeasured worker gets the initial allowance
    assert round_deadline(0.0, {"new": 4}, {}, initial_s=60.0) == 60.0


def test_round_closes_when_all_reported() -> None:
    d = round_decision(now=0.0, deadline=10.0, assigned={"a": 4, "b": 4}, reported={"a": 4, "b": 4})
    assert d is RoundDecision.CLOSE


def test_round_waits_before_deadline_then_closes_with_quorum() -> None:
    kw = {"assigned": {"a": 4, "b": 4}, "reported": {"a": 4}, "quorum": 0.5}
    assert round_decision(now=5.0, deadline=10.0, **kw) is RoundDecision.WAIT  # type: ignore[arg-type]
    assert round_decision(now=10.0, deadline=10.0, **kw) is RoundDecision.CLOSE  # type: ignore[arg-type]


def test_round_below_quorum_at_deadline_is_abandoned() -> None:
    d = round_decision(
        now=11.0, deadline=10.0, assigned={"a": 1, "b": 7}, reported={"a": 1}, quorum=0.5
    )
    assert d is RoundDecision.ABANDON


def test_dead_worker_removed_from_assigned_closes_round_at_once() -> None:
    # "b" died (the caller removed it); "a" reported: nobody is pending.
    d = round_decision(now=0.0, deadline=10.0, assigned={"a": 4}, reported={"a": 4})
    assert d is RoundDecision.CLOSE


def test_weighted_mean_equals_global_mean() -> None:
    rng = np.random.default_rng(0)
    per_sample = rng.standard_normal((10, 7)).astype(np.float32)
    parts = [(3, [per_sample[:3].mean(0)]), (7, [per_sample[3:].mean(0)])]
    (got,) = weighted_mean(parts)
    np.testing.assert_allclose(got, per_sample.mean(0), rtol=0, atol=1e-6)
    assert got.dtype == np.float32


def _parts(shares: dict[str, int]) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(len(shares))
    return {w: [rng.standard_normal(s).astype(np.float32) for s in ((5, 3), (7,))] for w in shares}


def test_gradient_sum_is_the_weighted_mean_in_id_order_whatever_the_arrival_order() -> None:
    shares = {"a": 5, "b": 17, "c": 10}
    parts = _parts(shares)
    expected = weighted_mean([(shares[w], parts[w]) for w in sorted(shares)])
    for arrival in itertools.permutations(shares):
        total = GradientSum(shares)
        for w in arrival:
            total.add(w, shares[w], parts[w])
        for got, want in zip(total.mean(), expected, strict=True):
            assert np.array_equal(got, want), arrival  # bit for bit


def test_gradient_sum_with_a_worker_missing_or_one_unplanned() -> None:
    shares = {"a": 5, "b": 17, "c": 10}
    parts = _parts({**shares, "seed": 8})
    missing = GradientSum(shares)
    for w in ("c", "a"):
        missing.add(w, shares[w], parts[w])
    want = weighted_mean([(5, parts["a"]), (10, parts["c"])])
    assert all(np.array_equal(g, e) for g, e in zip(missing.mean(), want, strict=True))
    extra = GradientSum(shares)
    for w in ("a", "seed", "b", "c"):
        extra.add(w, {**shares, "seed": 8}[w], parts[w])
    want = weighted_mean([(5, parts["a"]), (17, parts["b"]), (10, parts["c"]), (8, parts["seed"])])
    assert all(np.array_equal(g, e) for g, e in zip(extra.mean(), want, strict=True))


def test_heartbeat_timeout() -> None:
    assert not is_dead(10.0, 8.0, 3.0)
    assert is_dead(11.5, 8.0, 3.0)


def test_backoff_is_capped_and_grows() -> None:
    rng = random.Random(1)
    delays = [backoff_delay(a, base_s=0.5, cap_s=8.0, rng=rng) for a in range(10)]
    assert all(0.25 <= d <= 8.0 for d in delays)
    assert delays[-1] >= 4.0  # at the cap, equal jitter keeps at least half
    assert backoff_delay(0, base_s=0.5, cap_s=8.0, rng=rng) <= 0.5


def test_round_without_assignments_waits_for_its_deadline() -> None:
    # only seed-only peers: nobody is assigned, their gradients may still arrive
    assert round_decision(now=1.0, deadline=2.0, assigned={}, reported={}) is RoundDecision.WAIT
    assert round_decision(now=1.0, deadline=2.0, assigned={}, reported={"c": 4}) is (
        RoundDecision.CLOSE
    )
    assert round_decision(now=2.0, deadline=2.0, assigned={}, reported={}) is (
        RoundDecision.ABANDON
    )


def test_liveness_timeout_follows_a_seed_peers_own_cadence() -> None:
    common = {"fast_s": 2.5, "seed_default_s": 30.0}
    # Ours heartbeat every 0.5 s: the fast rule, whatever was observed.
    assert liveness_timeout(extended=True, heartbeat_intervals=[10.0], **common) == 2.5
    # A seed-only peer: the generous default until an interval was seen ...
    assert liveness_timeout(extended=False, heartbeat_intervals=[], **common) == 30.0
    # ... then four of its longest recent intervals, never below the fast rule.
    assert liveness_timeout(extended=False, heartbeat_intervals=[5.0, 4.8], **common) == 20.0
    assert liveness_timeout(extended=False, heartbeat_intervals=[10.0], **common) == 40.0
    assert liveness_timeout(extended=False, heartbeat_intervals=[0.1], **common) == 2.5
    assert not is_dead(100.0, 81.0, 20.0) and is_dead(100.0, 79.0, 20.0)


def test_round_tracker_counts_reports_and_refuses_stale_ones() -> None:
    g = [np.ones(3, np.float32)]
    t = RoundTracker(7, {"a": 6, "b": 2}, started=0.0, deadline=10.0, quorum=0.5)
    assert t.decide(1.0) is RoundDecision.WAIT and t.first_report_at is None
    assert t.report("a", 6, g, samples=1, loss=2.0, now=1.0) is Report.STALE  # other step
    assert t.report("z", 7, g, samples=1, loss=2.0, now=1.0) is Report.STALE  # not assigned
    assert t.report("a", 7, g, samples=99, loss=2.0, now=1.5) is Report.ACCEPTED
    assert t.reported == {"a": 6}  # the planned share counts, not what the worker claims
    assert t.report("a", 7, g, samples=6, loss=2.0, now=1.6) is Report.STALE  # twice
    assert t.first_report_at == 1.5 and t.missing() == ["b"]
    # a seed-only peer (assigned_only=False) counts for the samples it brings
    assert (
        t.report("seed", 7, g, samples=4, loss=1.0, now=2.0, assigned_only=False) is Report.ACCEPTED
    )
    assert t.reported["seed"] == 4
    assert t.decide(5.0) is RoundDecision.WAIT  # b still owes its share
    assert t.decide(10.0) is RoundDecision.CLOSE  # deadline, 10 of 12 samples >= quorum
    assert t.report("b", 7, g, samples=2, loss=1.0, now=3.0) is Report.ACCEPTED
    assert t.decide(3.0) is RoundDecision.CLOSE
    np.testing.assert_allclose(t.gradients.mean()[0], np.ones(3))


def test_round_tracker_drop_and_desertion() -> None:
    t = RoundTracker(0, {"a": 4, "b": 4}, started=0.0, deadline=100.0)
    assert t.drop("a") and not t.drop("a") and not t.drop("nobody")
    assert t.decide(1.0) is RoundDecision.WAIT and not t.deserted()
    assert t.drop("b") and t.deserted()
    assert t.decide(1.0) is RoundDecision.ABANDON  # at once, not at the deadline
    below = RoundTracker(0, {"a": 1, "b": 9}, started=0.0, deadline=5.0, quorum=0.5)
    below.report("a", 0, [np.zeros(1, np.float32)], samples=1, loss=0.0, now=1.0)
    assert below.decide(4.9) is RoundDecision.WAIT
    assert below.decide(5.0) is RoundDecision.ABANDON  # 1 of 10 samples at the deadline
    nobody = RoundTracker(0, {}, started=0.0, deadline=5.0)
    assert not nobody.deserted() and nobody.decide(6.0) is RoundDecision.ABANDON


def test_gradient_sum_when_a_worker_reports_another_share_than_planned() -> None:
    """All planned workers report, one with fewer samples than planned: the running sum (built
    with planned weights) is not the answer, the mean of what was reported is."""
    shares = {"a": 5, "b": 17, "c": 10}
    parts = _parts(shares)
    total = GradientSum(shares)
    for w, n in (("a", 5), ("b", 16), ("c", 10)):
        total.add(w, n, parts[w])
    want = weighted_mean([(5, parts["a"]), (16, parts["b"]), (10, parts["c"])])
    assert all(np.array_equal(g, e) for g, e in zip(total.mean(), want, strict=True))
    with pytest.raises(ValueError, match="b reported twice"):
        total.add("b", 17, parts["b"])


def test_weighted_mean_edges() -> None:
    x = [np.arange(4, dtype=np.float32)]
    (one,) = weighted_mean([(1, x)])  # a single sample is its own mean
    assert np.array_equal(one, x[0])
    with pytest.raises(ValueError, match=r"^no gradients to average$"):
        weighted_mean([])
    with pytest.raises(ValueError, match=r"^gradients cover no samples$"):
        weighted_mean([(0, x)])
    with pytest.raises(ValueError, match="expected 1 tensors, got 2"):
        weighted_mean([(1, x), (1, [*x, *x])])


def test_rate_and_liveness_boundaries() -> None:
    assert is_dead(11.0 + 1e-9, 8.0, 3.0) and not is_dead(11.0, 8.0, 3.0)  # silent > timeout
    assert update_rate(10.0, 0.5, alpha=0.5) == 5.25  # a rate below 1 sample/s still counts
    assert update_rate(0.5, 10.0, alpha=0.5) == 5.25
    assert update_rate(0.0, 4.0) == 4.0  # no usable previous rate: the measurement as is
    assert update_rate(10.0, 0.0) == 10.0 and update_rate(10.0, -1.0) == 10.0


def test_allocation_rounding_and_edges() -> None:
    # One each, then 7 x (1, 1, 2)/4 = 1.75, 1.75, 3.5: floors 2, 2, 4 and the two spare
    # samples to the largest remainders (.75, .75 before .5).
    assert allocate_samples(10, {"b": 1.0, "a": 1.0, "c": 2.0}) == {"a": 3, "b": 3, "c": 4}
    # 7 x (3, 1, 1)/5 = 4.2, 1.4, 1.4: floors 5, 2, 2, the spare to the tie of .4 at the lower id.
    assert allocate_samples(10, {"x": 3.0, "y": 1.0, "z": 1.0}) == {"x": 5, "y": 3, "z": 2}
    # Rates below one sample/s are rates; a negative one counts as none.
    assert allocate_samples(8, {"a": 0.25, "b": 0.75}) == {"a": 3, "b": 5}
    assert allocate_samples(6, {"a": -5.0, "b": 1.0}) == {"a": 1, "b": 5}
    # Exactly one sample each, and fewer samples than workers (no floor of one).
    assert allocate_samples(3, {"a": 1.0, "b": 100.0, "c": 1.0}) == {"a": 1, "b": 1, "c": 1}
    assert allocate_samples(2, {"a": 1.0, "b": 100.0, "c": 1.0}) == {"a": 0, "b": 2, "c": 0}
    assert allocate_samples(0, {"a": 1.0}) == {"a": 0} and allocate_samples(5, {}) == {}
    with pytest.raises(ValueError, match="global_batch must be >= 0, got -1"):
        allocate_samples(-1, {"a": 1.0})


def test_deadline_and_quorum_edges() -> None:
    # factor x the slowest expected finish, from zero: 1 sample at 4/s is 0.25 s, x 2.
    assert round_deadline(100.0, {"a": 1}, {"a": 4.0}, factor=2.0, floor_s=0.0) == 100.5
    # The time a worker's rounds took beyond computing (its transfers, measured) counts: a
    # round of 256 samples at 37/s (7 s) whose update and gradient take 8 s on the link ends
    # at 2.5 x 15 s, not at 2.5 x 7 s, when the gradients are still on the wire.
    assert round_deadline(
        0.0, {"a": 256, "b": 256}, {"a": 37.0, "b": 37.0}, overheads={"a": 8.0}
    ) == pytest.approx(2.5 * (256 / 37 + 8.0))
    assert round_deadline(0.0, {"a": 256}, {"a": 37.0}, overheads={}) == pytest.approx(
        2.5 * 256 / 37
    )
    # A rate below 1/s is a measured rate, not a missing one.
    assert round_deadline(0.0, {"a": 1}, {"a": 0.5}, factor=2.0, floor_s=0.0, initial_s=99.0) == 4.0
    # At the deadline, quorum counts an unplanned reporter's samples on both sides: 6 of
    # 4 + 4 + 2 reaches 0.6, not 0.7.
    assigned = {"a": 4, "b": 4}
    assert (
        round_decision(
            now=10.0, deadline=10.0, assigned=assigned, reported={"a": 4, "seed": 2}, quorum=0.6
        )
        is RoundDecision.CLOSE
    )
    assert (
        round_decision(
            now=10.0, deadline=10.0, assigned=assigned, reported={"a": 4, "seed": 2}, quorum=0.7
        )
        is RoundDecision.ABANDON
    )
    assert (
        round_decision(now=10.0, deadline=10.0, assigned=assigned, reported={"seed": 2}, quorum=0.1)
        is RoundDecision.CLOSE
    )
    assert (
        round_decision(
            now=10.0, deadline=10.0, assigned={"a": 1, "b": 9}, reported={"a": 1}, quorum=0.1
        )
        is RoundDecision.CLOSE
    )


def test_round_tracker_keeps_what_it_is_given() -> None:
    g = [np.ones(3, np.float32)]
    t = RoundTracker(3, {"a": 2, "b": 2}, started=5.0, deadline=9.0, quorum=0.9)
    assert t.started == 5.0
    assert not t.accepts("seed", 3)  # by default only assigned workers count
    assert t.accepts("seed", 3, assigned_only=False)
    assert t.report("a", 3, g, samples=2, loss=1.25, now=6.0) is Report.ACCEPTED
    assert t.losses == {"a": 1.25}
    # Its own quorum, not the default: 2 of 4 is below 0.9 at the deadline.
    assert t.decide(9.0) is RoundDecision.ABANDON


# A worker's inner step as the device measured it: a fixed cost (AdamW over every parameter,
# launches) plus a cost per sample; each round also pays a fixed exchange. Seconds.
GPU_STEP = (0.010, 1 / 12000)  # ~1850 samples/s alone at 64 a step, 8 steps a round
CPU_STEP = (0.020, 1 / 100)  # ~95 samples/s alone
ROUND_EXCHANGE = 0.1


def swarm_rate(
    costs: dict[str, tuple[float, float]],
    batches: Callable[[int, dict[str, float]], dict[str, int]],
    rounds: int = 12,
    overheads: dict[str, float] | None = None,
    measure_overheads: bool = True,
) -> float:
    """samples/s of simulated local-step rounds (G 64, H 8) planned as the coordinator plans
    them (``LocalRounds.plan``), each worker reporting samples / compute seconds as its rate;
    ``overheads`` are each worker's seconds of a round beyond its compute (the coordinator
    measures them, unless ``measure_overheads`` is off)."""
    rates: dict[str, float] = dict.fromkeys(costs, 0.0)
    over = overheads or dict.fromkeys(costs, 0.0)
    seen: dict[str, float] = dict.fromkeys(costs, 0.0)
    rate = 0.0
    for _ in range(rounds):
        per_step = batches(64, rates)
        slow = slow_workers(rates)
        steps = plan_local_round(per_step, rates, 8, slow)
        per_step = fill_local_round(per_step, rates, steps, 8, slow, seen)
        compute = {w: steps[w] * (costs[w][0] + per_step[w] * costs[w][1]) for w in costs}
        for w in costs:
            rates[w] = update_rate(rates[w] or None, per_step[w] * steps[w] / compute[w])
            if measure_overheads:
                seen[w] = over[w]
        rate = sum(per_step[w] * steps[w] for w in costs) / (
            max(compute[w] + over[w] for w in costs) + ROUND_EXCHANGE
        )
    return rate


def test_local_batches_split_equally_until_measured_and_between_equal_machines() -> None:
    assert local_batches(64, {"a": 0.0, "b": 5.0}) == {"a": 32, "b": 32}
    assert local_batches(64, {"a": 1.0, "b": 1.03, "c": 1.0}) == {"a": 22, "b": 21, "c": 21}
    assert local_batches(64, {}) == {}


def test_local_batches_split_the_fast_by_rate_and_give_the_slow_the_equal_share() -> None:
    rates = {"gpu": 1848.0, "c1": 92.0, "c2": 92.0, "c3": 92.0, "c4": 92.0}
    assert local_batches(64, rates) == {"gpu": 64, "c1": 13, "c2": 13, "c3": 13, "c4": 13}
    two = {"g1": 1800.0, "g2": 900.0, "c1": 90.0}
    assert local_batches(60, two) == {"g1": 40, "g2": 20, "c1": 20}
    assert local_batches(64, {"a": 100.0, "b": 60.0}) == {"a": 40, "b": 24}  # neither slow


def test_a_gpu_beside_cpu_workers_keeps_its_pace_and_theirs_adds_on_top() -> None:
    alone = {
        w: swarm_rate({w: c}, local_batches) for w, c in [("gpu", GPU_STEP), ("cpu", CPU_STEP)]
    }
    mixed = {"gpu": GPU_STEP, **{f"c{i}": CPU_STEP for i in range(4)}}
    total = alone["gpu"] + 4 * alone["cpu"]

    # The equal split the coordinator used before: the GPU's batch shrinks to 13 and its
    # rounds carry a fifth of its samples for the same fixed costs (the device measured 0.24).
    def equal(g: int, r: dict[str, float]) -> dict[str, int]:
        return allocate_samples(g, dict.fromkeys(r, 1.0))

    assert swarm_rate(mixed, equal) < 0.4 * total
    assert swarm_rate(mixed, local_batches) >= 0.9 * total


def test_cpu_workers_whose_one_step_outlasts_the_gpus_round_take_fewer_samples() -> None:
    # A CPU 40x slower a sample than the GPU, with its fixed cost a step: one step of its equal
    # share (13 samples, 0.45 s), even of half of it, outlasts the GPU's whole round (0.12 s
    # of compute). It fills SLOW_FILL of the GPU's round with fewer samples instead.
    slow_cpu = (0.020, 1 / 30)
    alone = {
        w: swarm_rate({w: c}, local_batches) for w, c in [("gpu", GPU_STEP), ("cpu", slow_cpu)]
    }
    mixed = {"gpu": GPU_STEP, **{f"c{i}": slow_cpu for i in range(4)}}
    assert swarm_rate(mixed, local_batches) >= 0.9 * (alone["gpu"] + 4 * alone["cpu"])
    rates = {"gpu": 64 / (0.010 + 64 / 12000), **{f"c{i}": 2 / (0.020 + 2 / 30) for i in range(4)}}
    per_step = local_batches(64, rates)
    slow = slow_workers(rates)
    assert slow == {"c0", "c1", "c2", "c3"}
    steps = plan_local_round(per_step, rates, 8, slow)
    fill = fill_local_round(per_step, rates, steps, 8, slow)
    assert steps["c0"] == 1 and 1 <= fill["c0"] < per_step["c0"] // 2
    gpu_s = 8 * (0.010 + 64 / 12000)
    assert all(steps[w] * (0.020 + fill[w] / 30) <= gpu_s for w in slow)


def test_slow_workers_leave_room_for_their_larger_round_overhead() -> None:
    # The CPU workers' round costs beyond compute (decoding the UPDATE, encoding, the upload,
    # a later place in the sends) exceed the GPU's by 40 ms of its 0.12 s round: measured and
    # left out of their fill, they report before the GPU, whose rounds keep their pace with
    # the CPU samples on top; not measured, the GPU waits and the mix trains less than it
    # alone.
    mixed = {"gpu": GPU_STEP, **{f"c{i}": CPU_STEP for i in range(4)}}
    over = {"gpu": 0.005, **{f"c{i}": 0.045 for i in range(4)}}
    gpu_alone = swarm_rate({"gpu": GPU_STEP}, local_batches, overheads={"gpu": 0.005})
    blind = swarm_rate(mixed, local_batches, overheads=over, measure_overheads=False)
    seen = swarm_rate(mixed, local_batches, overheads=over)
    assert blind < gpu_alone < seen
    rates = {"gpu": 2048.0, "cpu": 100.0}
    plain = fill_local_round({"gpu": 64, "cpu": 13}, rates, {"gpu": 8, "cpu": 2}, 8, {"cpu"})
    short = fill_local_round(
        {"gpu": 64, "cpu": 13}, rates, {"gpu": 8, "cpu": 2}, 8, {"cpu"}, {"gpu": 0.01, "cpu": 0.05}
    )
    assert plain == {"gpu": 64, "cpu": 10} and short == {"gpu": 64, "cpu": 8}


def test_local_batches_limits() -> None:
    """Rates exactly at the tolerance are equal machines (at any scale); rates below one sample
    a second are measured rates; a worker at exactly SLOW_SHARE of the mean is a fast one."""
    assert local_batches(100, {"a": 1.0, "b": 1.05}) == {"a": 50, "b": 50}
    assert local_batches(100, {"a": 10.0, "b": 10.2}) == {"a": 50, "b": 50}
    assert local_batches(100, {"a": 0.5, "b": 0.9}) == {"a": 36, "b": 64}  # 100 * 0.5 / 1.4
    split = local_batches(100, {"a": 1.0, "b": 2.5, "c": 2.5})  # mean 2: a is at 0.5 of it
    assert sum(split.values()) == 100 and split["a"] == 17  # 100 * 1 / 6, not the equal 33
