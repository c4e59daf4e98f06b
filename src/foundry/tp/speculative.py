"""Speculative decoding's pure decisions, beside the scheduler (``tp.scheduler``).

No sockets, no engine: functions of token lists, unit-tested on their own.

- :class:`SpecMode`: how greedy requests are decoded (``--spec-mode``).
- :func:`propose_drafts`: prompt lookup (n-gram) drafting. The tokens that followed the most
  recent earlier occurrence of the session's last n tokens (n = 3, then 2, then 1) are a guess
  at what comes next; repetitive text (code, lists, quoted passages) is guessed well, and it
  needs no second model.
- :func:`draft_limit`: how many drafts a request may take.
- :func:`accepted_drafts` and :func:`commit_plan`: greedy verification of a block and how the
  block ends on both ranks (``VerifyCommitMode``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from foundry.model.infer.sessions import SessionPositions
from foundry.wire import frontend as fw
from foundry.wire.tp import DS4_TP_BATCH_MAX_ROWS, VerifyCommitMode

# A verify block is the seed row (the token to evaluate anyway) plus the drafts.
MAX_DRAFT = DS4_TP_BATCH_MAX_ROWS - 1
# Longest suffix the drafter looks up; longer matches are rarer and predict little better.
MAX_NGRAM = 3


class SpecMode(enum.Enum):
    """How the leader decodes greedy requests (``--spec-mode``).

    A fully accepted block is always kept as it is (COMMIT_FULL); the modes differ in how a
    partly accepted one ends: COMMIT_PREFIX rewinds both ranks to the accepted prefix,
    ROLLBACK_REPLAY rewinds them to where the block began and evaluates the accepted tokens
    again as one block.
    """

    OFF = "off"
    FULL_PREFIX = "full-prefix"
    ROLLBACK = "rollback"


def propose_drafts(history: Sequence[int], limit: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``limit`` tokens guessed to follow ``history`` (empty: no guess).

    For n = max_ngram down to 1: find the most recent earlier occurrence of the last n tokens
    and propose what followed it. The copy may run into the drafts themselves (as an LZ77 copy
    does): a match p tokens back predicts text repeating with period p, so a short loop is
    drafted in full rather than cut off at the end of the history.
    """
    if limit <= 0 or len(history) < 2:
        return []
    arr = np.asarray(history, dtype=np.int64)  # (L,)
    for n in range(min(max_ngram, len(arr) - 1), 0, -1):
        windows = sliding_window_view(arr[:-1], n)  # (L - n, n): starts 0 .. L-1-n
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the most recent match (< L)
            seq = [int(t) for t in arr]
            for j in range(limit):
                seq.append(seq[start + j])
            return seq[len(arr) :]
    return []


def accepted_drafts(drafts: Sequence[int], verified: Sequence[int]) -> int:
    """How many leading drafts the model agrees with.

    ``verified[i]`` is the model's greedy token after block row i (row 0 is the seed); draft i
    (block row i + 1) is accepted when it equals ``verified[i]`` and every draft before it was.
    """
    accepted = 0
    for draft, want in zip(drafts, verified, strict=False):
        if draft != want:
            break
        accepted += 1
    return accepted


@dataclass(frozen=True)
class CommitPlan:
    mode: VerifyCommitMode
    token_count: int  # block rows to keep: the seed plus the accepted drafts


def commit_plan(spec: SpecMode, n_drafts: int, accepted: int) -> CommitPlan:
    """How a verified block of ``1 + n_drafts`` rows ends when ``accepted`` drafts held."""
    if spec is SpecMode.OFF:
        raise ValueError("speculative decoding is off; there is no block to commit")
    if not 0 <= accepted <= n_drafts:
        raise ValueError(f"accepted {accepted} drafts of {n_drafts}")
    keep = 1 + accepted
    if accepted == n_drafts:
        return CommitPlan(VerifyCommitMode.COMMIT_FULL, keep)
    if spec is SpecMode.FULL_PREFIX:
        return CommitPlan(VerifyCommitMode.COMMIT_PREFIX, keep)
    return CommitPlan(VerifyCommitMode.ROLLBACK_REPLAY, keep)


def draft_limit(max_draft: int, free: int, max_tokens: int, generated: int) -> int:
    """The drafts a greedy request may take: at most ``max_draft``, the session's ``free``
    positions less the seed's, and the tokens it may still generate less the seed."""
    return min(max_draft, free - 1, max_tokens - generated - 1)


def drafts_for(
    mode: SpecMode,
    max_draft: int,
    session: SessionPositions,
    frame: fw.Generate,
    next_token: int,
    generated: int,
) -> list[int]:
    """The drafter's guess at the tokens after a request's ``next_token`` ([]: none, as for
    a request that samples, or with speculation off)."""
    if mode is SpecMode.OFF or frame.temperature != 0.0:
        return []
    limit = draft_limit(max_draft, session.free, frame.max_tokens, generated)
    return propose_drafts([*session.tokens, next_token], limit)
