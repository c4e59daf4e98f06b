"""AdamW, global-norm gradient clipping and the learning-rate schedule.

AdamW follows torch.optim.AdamW (Loshchilov & Hutter's decoupled weight decay): each step
first shrinks a decayed parameter by ``lr * weight_decay`` and then applies the bias-corrected
Adam update ``lr * m_hat / (sqrt(v_hat) + eps)``. Weight decay applies to matrices only, i.e.
every parameter with two or more axes (embeddings, projections, experts, routers, output head);
norm weights (one axis) are not decayed, since pulling a gain towards 0 has no regularising
meaning. All updates are float32 and in place, so the same gradients give the same weights.

Each tensor's step runs in C where ``foundry.model.kernels._optim`` is built (one pass instead
of about a dozen, the same float32 roundings in the same order, so the same bits; ``STEPPER`` says
which runs) and in numpy otherwise.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import TypedDict

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

_optim: ModuleType | None
try:  # the one-pass step (setup.py builds it where a compiler is found; native floats)
    from foundry.model.kernels import _optim  # type: ignore[attr-defined, no-redef]
except ImportError:
    _optim = None
if sys.byteorder != "little":
    _optim = None
# Which step runs: "c" or "numpy" (the same bits).
STEPPER = "numpy" if _optim is None else "c"


def _in_place(p: F32, g: F32, m: F32, v: F32) -> bool:
    """Whether the C step can take these arrays as they are: native float32, contiguous,
    aligned, the three it writes writeable, and no two sharing memory (it reads and writes
    each element once, so an overlap would give other bits than numpy's passes)."""
    arrays = (p, g, m, v)
    return (
        all(a.dtype == np.float32 and a.flags.c_contiguous and a.flags.aligned for a in arrays)
        and all(a.flags.writeable for a in (p, m, v))
        and not any(
            np.may_share_memory(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1 :]
        )
    )


class AdamWState(TypedDict):
    step: int
    m: dict[str, F32]
    v: dict[str, F32]


def decays(value: F32) -> bool:
    """Whether weight decay applies to a parameter: matrices yes, norm weights no."""
    return value.ndim >= 2


class AdamW:
    """Adam with decoupled weight decay; the moments ``m``, ``v`` are float32 dicts by name.

    Defaults are the usual ones for language models (beta2 0.95, weight decay 0.1); torch's
    defaults differ (0.999, 0.01).
    """

    def __init__(
        self,
        params: Mapping[str, F32],
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.1,
    ):
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"betas must lie in [0, 1), got {beta1}, {beta2}")
        if eps <= 0 or weight_decay < 0:
            raise ValueError(f"need eps > 0 and weight_decay >= 0, got {eps}, {weight_decay}")
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.step_count = 0
        self.m = {name: np.zeros_like(p, dtype=np.float32) for name, p in params.items()}
        self.v = {name: np.zeros_like(p, dtype=np.float32) for name, p in params.items()}

    def step(self, params: Mapping[str, F32], grads: Mapping[str, F32], lr: float) -> None:
        """One update of every parameter in place from grads (same names and shapes)."""
        if grads.keys() != self.m.keys():
            missing = sorted(set(self.m) ^ set(grads))
            raise KeyError(f"gradients and optimizer state differ in parameters: {missing[:5]}")
        for name, p in params.items():  # before anything changes
            if grads[name].shape != p.shape:
                raise ValueError(
                    f"gradient {name} has shape {grads[name].shape}, expected {p.shape}"
                )
        self.step_count += 1
        t = self.step_count
        b1, b2 = np.float32(self.beta1), np.float32(self.beta2)
        step_size = np.float32(lr / (1.0 - self.beta1**t))
        bc2_sqrt = np.float32(math.sqrt(1.0 - self.beta2**t))
        shrink = np.float32(1.0 - lr * self.weight_decay)
        eps = np.float32(self.eps)
        omb1, omb2 = np.float32(1 - b1), np.float32(1 - b2)
        scratch: F32 | None = None
        for name, p in params.items():
            g, m, v = grads[name], self.m[name], self.v[name]
            decay = bool(self.weight_decay) and decays(p)
            if _optim is not None and _in_place(p, g, m, v):
                _optim.adamw(
                    p, g, m, v, decay, shrink, b1, omb1, b2, omb2, bc2_sqrt, eps, step_size
                )
                continue
            # Every intermediate goes to one scratch buffer: no temporary arrays per tensor.
            if scratch is None:
                scratch = np.empty(max(q.size for q in params.values()), np.float32)
            tmp = scratch[: p.size].reshape(p.shape)
            if decay:
                p *= shrink
            m *= b1  # m = b1 m + (1 - b1) g
            np.multiply(g, omb1, out=tmp)
            m += tmp
            v *= b2  # v = b2 v + (1 - b2) g^2
            np.multiply(g, g, out=tmp)
            tmp *= omb2
            v += tmp
            np.sqrt(v, out=tmp)  # sqrt(v_hat) + eps = sqrt(v) / sqrt(1 - b2^t) + eps
            tmp /= bc2_sqrt
            tmp += eps
            np.divide(m, tmp, out=tmp)  # the step: lr m_hat / (sqrt(v_hat) + eps)
            tmp *= step_size
            p -= tmp

    def state_dict(self) -> AdamWState:
        """The state as plain arrays (the moments are the optimizer's own, not copies)."""
        return {"step": self.step_count, "m": self.m, "v": self.v}

    def load_state_dict(self, state: AdamWState) -> None:
        """Take over a saved state (copied), checking it covers the same parameters."""
        self.m = _checked_copy("m", state["m"], self.m)
        self.v = _checked_copy("v", state["v"], self.v)
        self.step_count = int(state["step"])


def _checked_copy(key: str, given: Mapping[str, F32], own: Mapping[str, F32]) -> dict[str, F32]:
    if given.keys() != own.keys():
        raise KeyError(f"optimizer state {key!r} holds other parameters than the model")
    for name, value in given.items():
        if value.shape != own[name].shape:
            raise ValueError(
                f"optimizer state {key}[{name}] has shape {value.shape}, expected {own[name].shape}"
            )
    return {name: np.array(value, dtype=np.float32) for name, value in given.items()}


def clip_grad_norm(grads: Mapping[str, F32], max_norm: float) -> float:
    """Scale all gradients in place so their global L2 norm is at most max_norm.

    Returns the norm before clipping (each tensor's sum of squares in float32, their total in
    float64).
    """
    total = math.sqrt(sum(float(np.dot(g.ravel(), g.ravel())) for g in grads.values()))
    if total > max_norm:
        scale = np.float32(max_norm / (total + 1e-6))
        for g in grads.values():
            g *= scale
    return total


def lr_schedule(
    step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1
) -> float:
    """Linear warm-up to base_lr over warmup_steps, then cosine decay to min_lr_ratio * base_lr.

    Step s (0-based) of the warm-up gets base_lr * (s + 1) / warmup_steps; from total_steps on
    the rate stays at the minimum.
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    min_lr = base_lr * min_lr_ratio
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
