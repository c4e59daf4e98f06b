"""Choosing the next token from logits: greedy, temperature, top-k and nucleus (top-p)
sampling, and the log-probabilities a client may ask for.

The draw is the C kernels' (``kernels/csrc/sample.c`` defines it): the rows of a step in one
call, a row a task on the kernels' thread pool, so a batch of 262,144-token rows (Gemma 3's
vocabulary) is drawn on every core the process was given, not one row after another in
Python. No step sorts the whole row; each is O(V) passes plus a sort of the tokens kept:

- probabilities: e = exp((z - max) / temperature) in float32 (``exp_f``: the same bits on
  every machine), their sums in float64 in a fixed order;
- top-k: a heap of the k most probable;
- top-p: the smallest set of most probable tokens whose probability reaches ``top_p``, found
  by bucketing the row by binary exponent (one pass), taking the most probable buckets until
  their mass reaches ``top_p``, and sorting only the tokens in them;
- neither: the whole row is kept, in token-id order (no order is needed to draw from it).

Deterministic for a seed: :func:`sample_rows` draws exactly one uniform number from each
row's generator per sampled token (none when greedy), and turns it into a token by inverting
the cumulative distribution over the kept tokens in a fixed order: probability descending,
ties by token id, when the row was cut (top-k or top-p), token id when it was not. Ties at the
cut are broken by token id too (the lower id is kept). Every float operation is fixed, so two
processes with the same logits and the same seed produce the same tokens on any machine and
thread count, which is what lets the tensor-parallel ranks or a replayed session agree on a
generation. A build without the C kernels draws the same distribution in numpy
(``probabilities``, ``kept_tokens``: float64, ``argpartition``), in other roundings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from foundry.model.kernels.quant import _kernels

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

# OpenAI's API allows 0..20 alternatives per position (top_logprobs).
MAX_TOP_LOGPROBS = 20


class SamplingError(ValueError):
    """Sampling settings or logits that cannot give a token."""


def make_rng(seed: int | None = None) -> np.random.Generator:
    """The generator :func:`sample` draws from; ``None`` seeds it from the OS."""
    return np.random.default_rng(seed)


def probabilities(logits: npt.ArrayLike, temperature: float, top: float | None = None) -> F64:
    """softmax(logits / temperature) in float64; -inf logits get probability 0. ``top``: the
    largest logit, when the caller has it. One array, each step in place (a 262,144-token
    row is 2 MB of float64 a step otherwise)."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)  # (V,)
    p: F64 = z - (z.max() if top is None else top)
    with np.errstate(over="ignore"):  # a tiny temperature sends all but the max to -inf
        p /= temperature
    np.exp(p, out=p)
    p /= float(p.sum())
    return p


def _check_settings(temperature: float, top_p: float, top_k: int) -> None:
    if not temperature >= 0.0:
        raise SamplingError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise SamplingError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise SamplingError(f"top_k must be >= 0 (0 keeps every token), got {top_k}")


def top_indices(values: F64, m: int) -> I64:
    """The ``m`` largest of ``values`` (m <= len), largest first, ties by lower index: an
    ``argpartition`` (O(V)) and a sort of the ``m`` found, never of the whole row."""
    n = values.size
    if m >= n:
        pick = np.arange(n, dtype=np.int64)
    else:
        kth = values[np.argpartition(-values, m - 1)[m - 1]]  # the m-th largest value
        pick = np.flatnonzero(values >= kth).astype(np.int64)  # all ties at the cut, id order
    order = np.lexsort((pick, -values[pick]))  # value descending, then index ascending
    out: I64 = pick[order][:m]
    return out


def kept_tokens(p: F64, top_p: float = 1.0, top_k: int = 0) -> I64:
    """The tokens a draw may pick, in the order the draw inverts the distribution over.

    Zero-probability tokens are never kept. ``top_k`` (0: no limit) is applied first, then
    ``top_p`` over the probabilities renormalised to the top-k set, as llama.cpp and vLLM do.
    """
    nonzero = int(np.count_nonzero(p))
    limit = nonzero if top_k == 0 else min(top_k, nonzero)
    if top_p >= 1.0:
        if limit == p.size:
            return np.arange(p.size, dtype=np.int64)  # the whole row: no order needed
        return top_indices(p, limit)
    if limit < nonzero:  # top-k, then top-p of the k kept
        idx = top_indices(p, limit)
        cum = np.cumsum(p[idx])
        return idx[: _reach(cum, top_p * float(cum[-1]))]
    return _nucleus(p, top_p)


def _nucleus(p: F64, top_p: float) -> I64:
    """The top-p set of the whole row, most probable first, found without sorting the row.

    Each token falls in a bucket by its probability's binary exponent (``frexp``: bucket b
    holds probabilities in [2**-b, 2**(1-b))); one ``bincount`` gives each bucket's mass. The
    buckets, most probable first, are taken until their mass reaches ``top_p``: only the
    tokens in them are sorted. The last bucket may hold more than is kept, never less. If
    float rounding leaves the sorted candidates just short of ``top_p``, one more bucket is
    taken (at most as many rounds as there are buckets).
    """
    _, exponent = np.frexp(p)  # p = m * 2**e, m in [0.5, 1); e <= 1
    bucket = (1 - exponent).astype(np.intp)  # 0: p == 1, then halving ranges
    bucket[p == 0] = bucket.max() + 1  # zero probabilities are never candidates
    mass = np.cumsum(np.bincount(bucket, weights=p))  # (B,) mass of buckets 0..b
    # At most the last bucket: rounding may leave the whole row's mass just under top_p.
    last = min(int(np.searchsorted(mass, top_p, side="left")), mass.size - 1)
    for b in range(last, mass.size):
        cand = np.flatnonzero((bucket <= b) & (p > 0))
        idx = cand[np.lexsort((cand, -p[cand]))]  # probability descending, ties by id
        cum = np.cumsum(p[idx])
        if cum[-1] >= top_p or b == mass.size - 1:
            return idx[: _reach(cum, top_p)]
    raise AssertionError("unreachable: the last bucket returns")


def _reach(cum: F64, need: float) -> int:
    """How many leading entries of ``cum`` (a cumulative sum) it takes to reach ``need``."""
    return min(int(np.searchsorted(cum, need, side="left")) + 1, cum.size)


def sample(
    logits: npt.ArrayLike,
    temperature: float,
    top_p: float = 1.0,
    rng: np.random.Generator | None = None,
    top_k: int = 0,
) -> int:
    """The next token id.

    ``temperature == 0`` is greedy: the first token of highest logit, no random draw.
    Otherwise tokens are drawn from softmax(logits / temperature) restricted to the ``top_k``
    most probable (0: all), then to the smallest set of most probable tokens whose probability
    sums to at least ``top_p`` of what is left (never empty).
    """
    pick = sample_rows([(np.asarray(logits), temperature, top_p, rng, top_k)])[0]
    if isinstance(pick, SamplingError):
        raise pick
    return pick


# One row's draw: (logits, temperature, top_p, rng, top_k), ``sample``'s arguments.
Draw = tuple[npt.NDArray[np.floating], float, float, np.random.Generator | None, int]

# What the kernels' sampler returns for a row that cannot give a token.
BROKEN, ALL_MASKED = -1, -2
_ROW_ERRORS = {
    BROKEN: "logits contain NaN or +inf; the model output is broken",
    ALL_MASKED: "every logit is -inf; no token can be sampled",
}


def sample_rows(draws: Sequence[Draw]) -> list[int | SamplingError]:
    """``sample`` of each draw, in order: its token, or the SamplingError it raised.

    With the C kernels, the rows of one width are one call: a row a task on the kernels'
    thread pool (``sample.c``, the GIL let go), each row's token the same whatever the thread
    count or the rows beside it. Each sampled row draws its one uniform from its own ``rng``
    first, in order. Without them (a build without a C compiler), the numpy code above draws
    the same distribution row by row, in other roundings.
    """
    picks: list[int | SamplingError] = [SamplingError("not drawn")] * len(draws)
    ready: dict[int, list[tuple[int, npt.NDArray[np.float32], tuple[float, float, float, int]]]]
    ready = {}
    for i, (logits, temperature, top_p, rng, top_k) in enumerate(draws):
        try:
            _check_settings(temperature, top_p, top_k)
            row = np.ascontiguousarray(logits, dtype=np.float32)
            if row.ndim != 1 or row.size == 0:
                raise SamplingError(f"logits must be a non-empty vector, got shape {row.shape}")
            if temperature > 0.0 and rng is None:
                raise SamplingError("sampling with temperature > 0 needs an rng (see make_rng)")
        except SamplingError as exc:
            picks[i] = exc
            continue
        u = rng.random() if rng is not None and temperature > 0.0 else 0.0
        ready.setdefault(row.size, []).append((i, row, (temperature, top_p, u, top_k)))
    for rows in ready.values():
        if _kernels is None:
            for i, row, (temperature, top_p, u, top_k) in rows:
                picks[i] = _draw_numpy(row, temperature, top_p, u, top_k)
            continue
        settings = np.array([a for _, _, a in rows], dtype=np.float64)  # (R, 4)
        out = np.empty(len(rows), dtype=np.int64)
        _kernels.sample_rows([row for _, row, _ in rows], settings, out)
        for (i, _, _), token in zip(rows, out.tolist(), strict=True):
            if token == -3:
                raise MemoryError("no memory for a row's probabilities while sampling")
            picks[i] = SamplingError(_ROW_ERRORS[token]) if token < 0 else token
    return picks


def greedy_tops(rows: npt.NDArray[np.floating]) -> tuple[list[float], list[int]]:
    """Each row's greedy pick over a block of the vocabulary: its largest logit and the index
    of its first occurrence, or (0.0, ``BROKEN``) where the row holds a NaN or +inf and
    (0.0, ``ALL_MASKED``) where every logit is -inf. What :func:`combine_tops` takes from
    each block of a row split by vocabulary (a tensor-parallel worker's part of the head)."""
    block = np.ascontiguousarray(rows, dtype=np.float32)  # (R, V)
    if block.ndim != 2 or block.shape[1] == 0:
        raise SamplingError(f"rows must be a non-empty 2-d block, got shape {block.shape}")
    if _kernels is not None:
        settings = np.zeros((block.shape[0], 4), dtype=np.float64)  # temperature 0: greedy
        settings[:, 1] = 1.0  # top_p
        out = np.empty(block.shape[0], dtype=np.int64)
        _kernels.sample_rows(list(block), settings, out)
        tokens = out.tolist()
    else:
        tokens = [_greedy_numpy(row) for row in block]
    values = [float(row[t]) if t >= 0 else 0.0 for row, t in zip(block, tokens, strict=True)]
    return values, tokens


# A block's greedy_tops: (values, indices), a row each.
Tops = tuple[Sequence[float], Sequence[int]]


def combine_tops(blocks: Sequence[Tops]) -> list[int | SamplingError]:
    """The greedy token of each whole row from its blocks' :func:`greedy_tops`, the blocks in
    vocabulary order with their indices made the row's own: the first block that holds the
    row's largest logit gives its first occurrence, exactly what :func:`sample` at temperature
    0 picks from the whole row. A NaN or +inf in any block fails the row, as does a row -inf
    everywhere."""
    picks: list[int | SamplingError] = []
    for r in range(len(blocks[0][1])):
        best, value, broken = ALL_MASKED, 0.0, False
        for values, tokens in blocks:
            token = tokens[r]
            if token == BROKEN:
                broken = True
            elif token >= 0 and (best < 0 or values[r] > value):
                best, value = token, values[r]
        code = BROKEN if broken else best
        picks.append(SamplingError(_ROW_ERRORS[code]) if code < 0 else code)
    return picks


def _row_error(top: float) -> int | None:
    """BROKEN or ALL_MASKED for a row whose largest logit is ``top`` (NaN if any is NaN, else
    +inf if any is +inf: numpy's max), None for a row that can give a token."""
    if top != top or top == np.inf:
        return BROKEN
    return ALL_MASKED if top == -np.inf else None


def _greedy_numpy(row: npt.NDArray[np.float32]) -> int:
    """A row's first index of its largest logit, or BROKEN / ALL_MASKED (no C kernels)."""
    error = _row_error(float(row.max()))
    return int(np.argmax(row)) if error is None else error


def _draw_numpy(
    row: npt.NDArray[np.float32], temperature: float, top_p: float, u: float, top_k: int
) -> int | SamplingError:
    """One row's token by numpy (no C kernels), ``u`` its uniform."""
    top = float(row.max())  # one pass
    error = _row_error(top)
    if error is not None:
        return SamplingError(_ROW_ERRORS[error])
    if temperature == 0.0:
        return int(np.argmax(row))
    p = probabilities(row, temperature, top)  # (V,)
    kept = kept_tokens(p, top_p, top_k)  # (K,)
    # Uncut (kept_tokens' whole row, in token-id order): p itself, no gather.
    whole = top_p >= 1.0 and kept.size == p.size
    cum = np.cumsum(p if whole else p[kept])  # (K,)
    pick = min(int(np.searchsorted(cum, u * cum[-1], side="right")), kept.size - 1)
    return pick if whole else int(kept[pick])


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of the chosen token and of the ``top`` most probable tokens
    (most probable first), under the model's distribution: log_softmax of the raw logits,
    before temperature, top-k and top-p, as OpenAI's API and vLLM report them."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def logprobs(logits: npt.ArrayLike, token: int, top: int = 0) -> TokenLogprobs:
    """``token``'s log-probability and the ``top`` (0..20) most probable alternatives."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise SamplingError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    z = np.asarray(logits, dtype=np.float64).reshape(-1)  # (V,)
    if not 0 <= token < z.size:
        raise SamplingError(f"token {token} is outside the {z.size} logits")
    zmax = float(z.max())
    log_total = zmax + float(np.log(np.exp(z - zmax).sum()))  # logsumexp, one pass
    best = top_indices(z, min(top, z.size)) if top else np.zeros(0, np.int64)
    return TokenLogprobs(
        token,
        float(z[token]) - log_total,
        tuple((int(i), float(z[i]) - log_total) for i in best),
    )
