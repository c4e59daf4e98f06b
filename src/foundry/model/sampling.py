"""Choosing the next token from logits: greedy, temperature and nucleus (top-p) sampling.

Deterministic for a seed: :func:`sample` draws exactly one uniform number from the generator
per sampled token (none when greedy), and turns it into a token by inverting the cumulative
distribution over the kept tokens in a fixed order (probability descending, ties by token id).
Two processes with the same logits and the same seed therefore produce the same tokens, which
is what lets a TP pair or a replayed session agree on a generation.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class SamplingError(ValueError):
    """Sampling settings or logits that cannot give a token."""


def make_rng(seed: int | None = None) -> np.random.Generator:
    """The generator :func:`sample` draws from; ``None`` seeds it from the OS."""
    return np.random.default_rng(seed)


def probabilities(logits: npt.ArrayLike, temperature: float) -> npt.NDArray[np.float64]:
    """softmax(logits / temperature) in float64; -inf logits get probability 0."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)  # (V,)
    with np.errstate(over="ignore"):  # a tiny temperature sends all but the max to -inf
        z = (z - z.max()) / temperature
    p: npt.NDArray[np.float64] = np.exp(z)
    total = float(p.sum())
    return p / total


def _check(logits: npt.NDArray[np.float64], temperature: float, top_p: float) -> None:
    if logits.ndim != 1 or logits.size == 0:
        raise SamplingError(f"logits must be a non-empty vector, got shape {logits.shape}")
    if not temperature >= 0.0:
        raise SamplingError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise SamplingError(f"top_p must be in (0, 1], got {top_p}")
    top = float(logits.max())  # NaN if any is NaN, else +inf if any is +inf (one pass)
    if top != top or top == np.inf:
        raise SamplingError("logits contain NaN or +inf; the model output is broken")
    if top == -np.inf:
        raise SamplingError("every logit is -inf; no token can be sampled")


def sample(
    logits: npt.ArrayLike,
    temperature: float,
    top_p: float = 1.0,
    rng: np.random.Generator | None = None,
) -> int:
    """The next token id.

    ``temperature == 0`` is greedy: the first token of highest logit, no random draw.
    Otherwise tokens are drawn from softmax(logits / temperature) restricted to the smallest
    set of most probable tokens whose probability sums to at least ``top_p`` (never empty).
    """
    z = np.asarray(logits, dtype=np.float64)
    _check(z, temperature, top_p)
    if temperature == 0.0:
        return int(np.argmax(z))
    if rng is None:
        raise SamplingError("sampling with temperature > 0 needs an rng (see make_rng)")
    p = probabilities(z, temperature)  # (V,)
    order = np.argsort(-p, kind="stable")  # most probable first, ties by token id
    cum = np.cumsum(p[order])
    keep = len(order) if top_p >= 1.0 else int(np.searchsorted(cum, top_p, side="left")) + 1
    keep = min(keep, int(np.count_nonzero(p)))
    u = rng.random() * cum[keep - 1]
    pick = min(int(np.searchsorted(cum[:keep], u, side="right")), keep - 1)
    return int(order[pick])
