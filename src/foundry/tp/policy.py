"""Pure decisions of the tensor-parallel leader: the pass, kept sessions, stop strings.

No sockets, no engine: functions of token lists and text, unit-tested on their own.

- :class:`TextStream`: generated tokens to the text pieces sent to the client, holding back any
  tail that could be the start of a stop string, so the stop string itself is never sent.
- :func:`common_prefix` and :func:`pick_kept_session`: which kept session (the KV cache of an
  earlier generation) a new prompt continues, and how much of it is reused.
- :func:`plan_pass`: which model pass the leader's engine runs next.

Speculative decoding's decisions (drafting, acceptance, commits) are in ``tp.speculative``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from foundry.model.text.vocab import StreamDecoder, own_tokenizer


class Pass(enum.Enum):
    """A model pass of the leader's engine (one step, see tp/leader.py "Scheduling")."""

    IDLE = "idle"  # nothing to evaluate
    PREFILL = "prefill"  # SYNC of the one waiting prompt, alone
    # MIXED_BATCH or MIXED_PREFILLS: the waiting prompts' next chunks (as many as fit a pass)
    # plus one token of every decoding session
    MIXED = "mixed"
    VERIFY = "verify"  # VERIFY + VERIFY_COMMIT of the one decoding session's drafted block
    EVAL = "eval"  # EVAL of the one decoding session
    EVAL_BATCH = "eval_batch"  # EVAL_BATCH, one token of every decoding session


def plan_pass(prefills: int, decoding: int, drafts: int) -> Pass:
    """The next pass, for ``prefills`` prompts waiting to be evaluated and ``decoding``
    sessions; ``drafts`` is how many tokens the drafter proposes for the one decoding session
    (0 when there is more than one, it is not greedy, or speculation is off). A prompt never
    waits for decoding to end, decoding never stalls behind a long prompt, and prompts that
    arrive together are evaluated together."""
    if prefills:
        return Pass.MIXED if decoding or prefills > 1 else Pass.PREFILL
    if not decoding:
        return Pass.IDLE
    if decoding == 1:
        return Pass.VERIFY if drafts else Pass.EVAL
    return Pass.EVAL_BATCH


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
