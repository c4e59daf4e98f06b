"""AdamW, clipping and the schedule against torch and against their definitions."""

from __future__ import annotations

import itertools
import math

import numpy as np
import numpy.typing as npt
import pytest
import torch

from foundry.model.train import optim
from foundry.model.train.optim import AdamW, clip_grad_norm, decays, lr_schedule

F32 = npt.NDArray[np.float32]


def make_params(seed: int = 0) -> dict[str, F32]:
    rng = np.random.default_rng(seed)
    return {
        "token_embd.weight": rng.standard_normal((11, 6), dtype=np.float32),
        "blk.0.attn_norm.weight": np.ones(6, np.float32) + rng.standard_normal(6, np.float32),
        "blk.0.ffn_gate_exps.weight": rng.standard_normal((3, 4, 6), dtype=np.float32),
        "output.weight": rng.standard_normal((11, 6), dtype=np.float32),
    }


@pytest.fixture(params=["c", "numpy"])
def stepper(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each AdamW test that takes it runs with the C step and with numpy's."""
    if request.param == "numpy":
        monkeypatch.setattr(optim, "_optim", None)
    return str(request.param)


def test_the_c_step_is_built() -> None:
    """``pip install`` builds it wherever a C compiler is (CI has one)."""
    assert optim.STEPPER == "c"


def awkward_gradients(rng: np.random.Generator, shape: tuple[int, ...]) -> F32:
    """Gaussian values with zeros, subnormals, huge values and signed zeros mixed in."""
    g = rng.standard_normal(shape, dtype=np.float32)
    flat = g.reshape(-1)
    specials = np.array([0.0, -0.0, 1e-40, -3e-42, 1e-30, 3e18, -3e18], np.float32)
    flat[::5] = specials[rng.integers(0, len(specials), flat[::5].shape)]
    return g


def test_the_c_step_gives_numpys_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty steps through both, from the same state: every weight and moment bit-equal."""
    runs = []
    for use_c in (True, False):
        if not use_c:
            monkeypatch.setattr(optim, "_optim", None)
        params = make_params()
        opt = AdamW(params, weight_decay=0.1)
        rng = np.random.default_rng(7)
        for step in range(20):
            grads = {k: awkward_gradients(rng, v.shape) for k, v in params.items()}
            opt.step(params, grads, lr=lr_schedule(step, 3e-2, 3, 20))
        runs.append((params, opt.m, opt.v))
    (p_c, m_c, v_c), (p_np, m_np, v_np) = runs
    for k in p_c:
        for a, b in ((p_c, p_np), (m_c, m_np), (v_c, v_np)):
            assert a[k].tobytes() == b[k].tobytes(), k


def test_a_strided_gradient_takes_the_numpy_step_and_the_same_bits() -> None:
    params, twin = make_params(), make_params()
    opt, twin_opt = AdamW(params), AdamW(twin)
    rng = np.random.default_rng(3)
    grads = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in params.items()}
    wide = {k: np.repeat(g[..., None], 2, axis=-1)[..., 0] for k, g in grads.items()}
    assert not all(g.flags.c_contiguous for g in wide.values())
    opt.step(params, grads, lr=1e-2)
    twin_opt.step(twin, wide, lr=1e-2)
    for k in params:
        assert params[k].tobytes() == twin[k].tobytes(), k


def test_a_gradient_of_another_shape_is_refused_before_anything_changes(stepper: str) -> None:
    params = make_params()
    before = {k: v.copy() for k, v in params.items()}
    grads = {k: np.ones_like(v) for k, v in params.items()}
    grads["output.weight"] = np.zeros((6, 11), np.float32)
    opt = AdamW(params)
    with pytest.raises(ValueError, match=r"output.weight has shape \(6, 11\)"):
        opt.step(params, grads, lr=1e-2)
    assert opt.step_count == 0
    assert all(params[k].tobytes() == before[k].tobytes() for k in params)


def test_unaligned_or_overlapping_arrays_take_the_numpy_step() -> None:
    p = np.ones(8, np.float32)
    raw = np.zeros(8 * 4 + 1, np.uint8)
    unaligned = np.frombuffer(raw.data, np.float32, 8, offset=1)
    assert not unaligned.flags.aligned
    assert not optim._in_place(p, unaligned, np.zeros(8, np.float32), np.zeros(8, np.float32))
    m = np.zeros(8, np.float32)
    assert not optim._in_place(p, p, m, np.zeros(8, np.float32))  # the gradient is the weight
    assert optim._in_place(p, np.ones(8, np.float32), m, np.zeros(8, np.float32))


def test_decay_applies_to_matrices_only() -> None:
    params = make_params()
    assert [decays(p) for p in params.values()] == [True, False, True, True]


def test_adamw_matches_torch_with_decay_on_matrices_only(stepper: str) -> None:
    params = make_params()
    ref = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in params.items()}
    wd, betas, eps = 0.1, (0.9, 0.95), 1e-8
    opt = AdamW(params, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd)
    ref_opt = torch.optim.AdamW(
        [
            {"params": [t for k, t in ref.items() if params[k].ndim >= 2], "weight_decay": wd},
            {"params": [t for k, t in ref.items() if params[k].ndim < 2], "weight_decay": 0.0},
        ],
        lr=1.0,
        betas=betas,
        eps=eps,
        foreach=False,
    )
    rng = np.random.default_rng(1)
    for step in range(12):
        lr = lr_schedule(step, 3e-2, 3, 12)
        grads = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in params.items()}
        opt.step(params, grads, lr=lr)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        for k, t in ref.items():
            t.grad = torch.tensor(grads[k])
        ref_opt.step()
        for k, p in params.items():
            assert p.dtype == np.float32
            np.testing.assert_allclose(
                p, ref[k].detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{k} step {step}"
            )
    assert opt.state_dict()["step"] == 12


def test_zero_gradient_decays_matrices_but_not_norms(stepper: str) -> None:
    params = make_params()
    before = {k: v.copy() for k, v in params.items()}
    opt = AdamW(params, weight_decay=0.5)
    opt.step(params, {k: np.zeros_like(v) for k, v in params.items()}, lr=0.1)
    norm = "blk.0.attn_norm.weight"
    np.testing.assert_array_equal(params[norm], before[norm])
    np.testing.assert_allclose(params["output.weight"], before["output.weight"] * 0.95, rtol=1e-6)


def test_state_dict_round_trip_resumes_exactly() -> None:
    rng = np.random.default_rng(2)
    grads = [
        {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in make_params().items()}
        for _ in range(6)
    ]
    a = make_params()
    opt_a = AdamW(a)
    for g in grads:
        opt_a.step(a, g, lr=1e-2)

    b = make_params()
    opt_b = AdamW(b)
    for g in grads[:3]:
        opt_b.step(b, g, lr=1e-2)
    saved = opt_b.state_dict()
    resumed = AdamW(b)
    resumed.load_state_dict(
        {
            "step": saved["step"],
            "m": {k: v.copy() for k, v in saved["m"].items()},
            "v": {k: v.copy() for k, v in saved["v"].items()},
        }
    )
    for g in grads[3:]:
        resumed.step(b, g, lr=1e-2)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])

    with pytest.raises(KeyError):
        resumed.load_state_dict({"step": 1, "m": {}, "v": {}})
    with pytest.raises(KeyError):
        resumed.step(b, {"output.weight": grads[0]["output.weight"]}, lr=1e-2)


def test_clip_grad_norm_matches_torch() -> None:
    rng = np.random.default_rng(3)
    grads = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in make_params().items()}
    tensors = [torch.tensor(g.copy(), requires_grad=True) for g in grads.values()]
    for t, g in zip(tensors, grads.values(), strict=True):
        t.grad = torch.tensor(g.copy())
    ref_norm = torch.nn.utils.clip_grad_norm_(tensors, max_norm=1.5)
    norm = clip_grad_norm(grads, 1.5)
    assert norm == pytest.approx(float(ref_norm), rel=1e-6)
    for g, t in zip(grads.values(), tensors, strict=True):
        assert t.grad is not None
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-6)
    total = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    assert total == pytest.approx(1.5, rel=1e-5)
    # Below the limit nothing changes.
    before = {k: v.copy() for k, v in grads.items()}
    assert clip_grad_norm(grads, 100.0) == pytest.approx(total, rel=1e-6)
    for k in grads:
        np.testing.assert_array_equal(grads[k], before[k])


def test_lr_schedule_values() -> None:
    base, warm, total = 1e-3, 10, 110
    assert lr_schedule(0, base, warm, total) == pytest.approx(1e-4)
    assert lr_schedule(4, base, warm, total) == pytest.approx(5e-4)
    assert lr_schedule(9, base, warm, total) == pytest.approx(base)
    assert lr_schedule(10, base, warm, total) == pytest.approx(base)  # cosine starts at the top
    assert lr_schedule(60, base, warm, total) == pytest.approx(0.55e-3)  # halfway: (1 + 0.1) / 2
    assert lr_schedule(110, base, warm, total) == pytest.approx(1e-4)  # min_lr_ratio 0.1
    assert lr_schedule(500, base, warm, total) == pytest.approx(1e-4)
    decay = [lr_schedule(s, base, warm, total) for s in range(warm, total + 1)]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert lr_schedule(0, base, 0, 10, min_lr_ratio=0.0) == pytest.approx(base)
