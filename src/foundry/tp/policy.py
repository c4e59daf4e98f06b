"""Pure decisions of the tensor-parallel leader: drafting, acceptance, commits, stop strings.

No sockets, no engine: functions of token lists and text, unit-tested on their own.

- :func:`propose_drafts`: prompt lookup (n-gram) drafting. The tokens that followed the most
  recent earlier occurrence of the session's last n tokens (n = 3, then 2, then 1) are a guess
  at what comes next; repetitive text (code, lists, quoted passages) is guessed well, and it
  needs no second model.
- :func:`accepted_drafts` and :func:`commit_plan`: greedy verification of a block and how the
  block ends on both ranks (``VerifyCommitMode``).
- :class:`TextStream`: generated tokens to the text pieces sent to the client, holding back any
  tail that could be the start of a stop string, so the stop string itself is never sent.
- :func:`common_prefix` and :func:`pick_kept_session`: which kept session (the KV cache of an
  earlier generation) a new prompt continues, and how much of it is reused.
- :func:`plan_pass`: which model pass the leader's engine runs next.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from foundry.model.text.vocab import StreamDecoder, own_tokenizer
from foundry.wire.tp import DS4_TP_BATCH_MAX_ROWS, VerifyCommitMode

# A verify block is the seed row (the token to evaluate anyway) plus the drafts.
MAX_DRAFT = DS4_TP_BATCH_MAX_ROWS - 1
# Longest suffix the drafter looks up; longer matches are rarer and predict little better.
MAX_NGRAM = 3


class Pass(enum.Enum):
    """A model pass of the leader's engine (one step, see tp/leader.py "Scheduling")."""

    IDLE = "idle"  # nothing to evaluate
    PREFILL = "prefill"  # SYNC of the first waiting prompt, alone
    MIXED = "mixed"  # MIXED_BATCH: its next chunk plus one token of every decoding session
    VERIFY = "verify"  # VERIFY + VERIFY_COMMIT of the one decoding session's drafted block
    EVAL = "eval"  # EVAL of the one decoding session
    EVAL_BATCH = "eval_batch"  # EVAL_BATCH, one token of every decoding session


def plan_pass(prefills: int, decoding: int, drafts: int) -> Pass:
    """The next pass, for ``prefills`` prompts waiting to be evaluated and ``decoding``
    sessions; ``drafts`` is how many tokens the drafter proposes for the one decoding session
    (0 when there is more than one, it is not greedy, or speculation is off). A prompt never
    waits for decoding to end and decoding never stalls behind a long prompt."""
    if prefills:
        return Pass.MIXED if decoding else Pass.PREFILL
    if not decoding:
        return Pass.IDLE
    if decoding == 1:
        return Pass.VERIFY if drafts else Pass.EVAL
    return Pass.EVAL_BATCH


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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def worth_keeping(tokens: Sequence[int]) -> bool:
    """Whether a session holding ``tokens`` is worth keeping for a later prompt: it must hold
    more than the beginning-of-sequence token every prompt starts with."""
    return len(tokens) > 1


def pick_kept_session(
    prompt: Sequence[int], kept: Iterable[tuple[int, Sequence[int]]]
) -> tuple[int, int] | None:
    """The kept session a new ``prompt`` should continue, as (session id, positions reused).

    ``kept`` is (session id, the tokens it holds), oldest first. The session sharing the
    longest prefix with the prompt wins (the most recent one on a tie); positions reused stop
    one short of the whole prompt, because the prompt's last token must be evaluated for its
    logits. None when no session shares more than the beginning-of-sequence token: reusing one
    would save nothing and evict a cache that may serve a later prompt.
    """
    best: tuple[int, int] | None = None
    for sid, tokens in kept:
        n = common_prefix(tokens, prompt)
        if worth_keeping(tokens[:n]) and (best is None or n >= best[1]):
            best = (sid, n)
    if best is None:
        return None
    return best[0], min(best[1], len(prompt) - 1)


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


class TextStream:
    """Tokens in, text pieces out; stops at the first stop string, which is never sent.

    ``push`` returns the text that can be sent now and whether a stop string was completed.
    Text that could still become a stop string is held back until it cannot (or until
    ``final``, when it is released). Since held text is never sent, a stop string can only
    begin in the unsent part, so matching only that part finds every occurrence.
    """

    def __init__(self, stop: Sequence[str] = (), decoder: StreamDecoder | None = None) -> None:
        """``decoder``: the model's (Foundry's byte vocabulary by default)."""
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.stop = tuple(stop)
        self._decoder = decoder or own_tokenizer().stream_decoder()
        self._pending = ""  # decoded, not yet sent

    def push(self, token: int, final: bool = False) -> tuple[str, bool]:
        self._pending += self._decoder.feed(token)
        if final:
            self._pending += self._decoder.flush()
        cut = min((i for s in self.stop if (i := self._pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            out, self._pending = self._pending[:cut], ""
            return out, True
        hold = 0 if final else self._held_back()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out) :]
        return out, False

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:k]):
                    best = k
                    break
        return best
