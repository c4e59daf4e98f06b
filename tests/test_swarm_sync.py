"""The shared-weights rules (swarm/sync.py): shadow updates, outer Nesterov, DyLU planning."""

from __future__ import annotations

import numpy as np
import pytest

from foundry.compression import deserialize_tensors, get_codec
from foundry.swarm.sync import (
    SLOW_FILL,
    OuterNesterov,
    Shadow,
    add_update,
    all_finite,
    digest_due,
    fill_local_round,
    plan_local_round,
    weights_digest,
)
from foundry.wire.fdtc import Compression


def _params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal((4, 300)).astype(np.float32),
        "b": rng.standard_normal(70).astype(np.float32),
    }


@pytest.mark.parametrize("compression", list(Compression))
def test_worker_applying_updates_holds_exactly_the_shadow(compression: Compression) -> None:
    """A worker that adds every decoded UPDATE ends bit for bit equal to the shadow, and a
    lossy downlink's loss is carried by master - shadow until it is sent."""
    master = _params(0)
    shadow = Shadow(master)
    worker = {k: v.copy() for k, v in master.items()}
    codec = get_codec(compression, topk_ratio=0.05, seed=1)
    rng = np.random.default_rng(2)
    for _ in range(30):
        for v in master.values():
            v -= np.float32(0.01) * rng.standard_normal(v.shape).astype(np.float32)
        data = shadow.update(master, codec)
        decoded = deserialize_tensors(data, [v.size for v in master.values()], compression)
        add_update(worker, shadow.names, decoded)
        assert weights_digest(worker, shadow.names) == shadow.digest()
    if compression is Compression.NONE:
        assert shadow.residual_norm(master) < 1e-5
    else:
        # Error feedback: the residual stays bounded instead of accumulating every step's loss.
        drift = np.sqrt(sum(float(np.sum((master[k] - _params(0)[k]) ** 2)) for k in master))
        assert shadow.residual_norm(master) < drift


def test_digest_sees_one_changed_bit() -> None:
    p = _params(1)
    d = weights_digest(p, ["a", "b"])
    p["b"].view(np.uint32)[3] ^= 1
    assert weights_digest(p, ["a", "b"]) != d
    assert weights_digest(p, ["b", "a"]) != weights_digest(p, ["a", "b"])


def test_outer_nesterov_matches_the_formula() -> None:
    p = {"w": np.array([1.0, -2.0], np.float32)}
    opt = OuterNesterov(p, lr=0.5, momentum=0.9)
    g1 = {"w": np.array([0.2, 0.4], np.float32)}
    opt.step(p, g1)  # m = g; p -= lr (g + mu g)
    np.testing.assert_allclose(p["w"], [1.0 - 0.5 * 0.2 * 1.9, -2.0 - 0.5 * 0.4 * 1.9], rtol=1e-6)
    g2 = {"w": np.array([-0.1, 0.0], np.float32)}
    before = p["w"].copy()
    opt.step(p, g2)  # m = 0.9 g1 + g2
    m = 0.9 * np.array([0.2, 0.4]) + np.array([-0.1, 0.0])
    np.testing.assert_allclose(p["w"], before - 0.5 * (np.array([-0.1, 0.0]) + 0.9 * m), rtol=1e-6)
    plain = {"w": np.array([1.0], np.float32)}
    OuterNesterov(plain, lr=1.0, momentum=0.0).step(plain, {"w": np.array([0.25], np.float32)})
    assert plain["w"][0] == 0.75  # lr 1, no momentum: the average of the workers' weights


def test_local_round_is_a_time_budget() -> None:
    batch = {"fast": 8, "slow": 8, "mid": 8}
    assert plan_local_round(batch, {"fast": 0.0, "slow": 1.0, "mid": 2.0}, 16) == {
        "fast": 16,
        "slow": 16,
        "mid": 16,
    }  # not all measured: everyone runs H
    plan = plan_local_round(batch, {"fast": 30.0, "slow": 10.0, "mid": 20.0}, 12)
    assert plan == {"fast": 12, "slow": 4, "mid": 8}
    assert plan_local_round({"a": 8, "b": 8}, {"a": 100.0, "b": 1.0}, 4) == {"a": 4, "b": 1}
    assert plan_local_round({}, {}, 4) == {}
    with pytest.raises(ValueError):
        plan_local_round(batch, {}, 0)


def test_each_workers_samples_per_step_fill_the_budget() -> None:
    batch = {"fast": 32, "slow": 32}
    rates = {"fast": 64.0, "slow": 64.0 / 3}  # the budget: 8 steps of 0.5 s = 4 s
    steps = plan_local_round(batch, rates, 8)
    assert steps == {"fast": 8, "slow": 3}  # 2.67 steps fit: rounded up, 12.5 % over
    fill = fill_local_round(batch, rates, steps, 8)
    assert fill == {"fast": 32, "slow": 28}  # 3 x 28 / 21.3 = 3.94 s: within 2 %
    assert all(fill[w] * steps[w] / rates[w] <= 4.0 * 1.02 for w in batch)
    # Bounded: a worker 100x slower keeps its one step at half the batch, not 0.3 samples.
    assert fill_local_round({"a": 8, "b": 8}, {"a": 100.0, "b": 1.0}, {"a": 4, "b": 1}, 4) == {
        "a": 8,
        "b": 4,
    }
    # Equal machines whose rates jitter keep equal batches.
    assert fill_local_round(batch, {"fast": 64.0, "slow": 62.0}, {"fast": 8, "slow": 8}, 8) == batch
    # A batch that does not split evenly (16 over 3: 6, 5, 5) is no difference of speed, and
    # --no-rebalance gives every rate as 1.0: everyone runs H steps of its batch.
    uneven = {"a": 6, "b": 5, "c": 5}
    same = {"a": 1.0, "b": 1.0, "c": 1.0}
    assert plan_local_round(uneven, same, 4) == {"a": 4, "b": 4, "c": 4}
    assert fill_local_round(uneven, same, {"a": 4, "b": 4, "c": 4}, 4) == uneven
    # Unmeasured workers, or none: the batch as it is.
    assert fill_local_round(batch, {"fast": 0.0, "slow": 1.0}, steps, 8) == batch
    assert fill_local_round({}, {}, {}, 8) == {}


def test_slow_workers_round_their_steps_down_and_fill_a_share_of_the_budget() -> None:
    batch = {"gpu": 64, "cpu": 13}
    rates = {"gpu": 2048.0, "cpu": 104.0}  # the budget: 8 steps of 31.25 ms = 0.25 s
    # 0.25 s holds exactly 2 of the CPU's 13-sample steps (1.0 of which rounds to 2, too)
    assert plan_local_round(batch, rates, 8, slow={"cpu"}) == {"gpu": 8, "cpu": 2}
    assert plan_local_round(batch, {"gpu": 2048.0, "cpu": 90.0}, 8) == {"gpu": 8, "cpu": 2}
    assert plan_local_round(batch, {"gpu": 2048.0, "cpu": 90.0}, 8, slow={"cpu"}) == {
        "gpu": 8,
        "cpu": 1,
    }  # 1.73 fit: down, fuller
    fill = fill_local_round(
        batch, {"gpu": 2048.0, "cpu": 90.0}, {"gpu": 8, "cpu": 1}, 8, slow={"cpu"}
    )
    assert fill == {"gpu": 64, "cpu": 19}  # floor(0.85 x 0.25 s x 90/s)
    # One step of even half its batch outlasts the round: it goes below half.
    fill = fill_local_round(
        batch, {"gpu": 2048.0, "cpu": 20.0}, {"gpu": 8, "cpu": 1}, 8, slow={"cpu"}
    )
    assert fill["cpu"] == 4 and SLOW_FILL * 0.25 >= 4 / 20.0  # not ceil(13 / 2) = 7
    # With two steps it keeps half its batch at least, and at least one sample always.
    assert (
        fill_local_round(
            batch, {"gpu": 2048.0, "cpu": 20.0}, {"gpu": 8, "cpu": 2}, 8, slow={"cpu"}
        )["cpu"]
        == 7
    )
    assert (
        fill_local_round(batch, {"gpu": 2048.0, "cpu": 1.0}, {"gpu": 8, "cpu": 1}, 8, slow={"cpu"})[
            "cpu"
        ]
        == 1
    )


def test_a_digest_follows_each_update_that_crosses_a_multiple() -> None:
    assert [g for g in range(1, 31) if digest_due(g - 1, g, 10)] == [10, 20, 30]  # H = 1
    # Local rounds of 4 after a 5-step warm-up never land on a multiple of 10: they cross.
    rounds = [(b, b + 4) for b in range(5, 45, 4)]
    assert [g for b, g in rounds if digest_due(b, g, 10)] == [13, 21, 33, 41]
    assert not any(digest_due(b, g, 0) for b, g in rounds)


def test_all_finite_finds_nan_and_inf_in_any_tensor_and_passes_huge_finite_values() -> None:
    big = np.full(1000, np.finfo(np.float32).max, np.float32)  # their sum overflows float32
    assert all_finite([big, -big, np.zeros(3, np.float32)])
    for bad in (np.nan, np.inf, -np.inf):
        t = np.zeros(5, np.float32)
        t[3] = bad
        assert not all_finite([np.ones(2, np.float32), t])
    assert all_finite([])
