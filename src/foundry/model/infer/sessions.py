"""What both inference engines share of a session (``inference.Engine``'s numpy sessions and
``torch_engine.TorchEngine``'s device ones): its place in its context, the checks of a pass's
(session, tokens) rows, and the context a run gets unless told."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from foundry.model.spec.arch import DEFAULT_CTX_CAP
from foundry.model.spec.config import ModelConfig

__all__ = ["RowSession", "SessionPositions", "check_rows", "default_ctx"]


class SessionPositions:
    """A sequence's place in its context, for both engines' sessions: ``pos`` of ``ctx_size``
    positions evaluated, their ``tokens``."""

    ctx_size: int
    pos: int
    tokens: list[int]

    @property
    def free(self) -> int:
        """Positions left before the context is full."""
        return self.ctx_size - self.pos

    def rewind(self, pos: int) -> None:
        """Forget every position >= pos: the next token is evaluated at position pos."""
        if not 0 <= pos <= self.pos:
            raise ValueError(f"cannot rewind to {pos}: the session holds positions [0, {self.pos})")
        self.pos = pos
        del self.tokens[pos:]


class RowSession(Protocol):
    """What ``check_rows`` reads of a session (``Session`` here, the torch engine's too)."""

    @property
    def id(self) -> int: ...
    @property
    def engine_id(self) -> int: ...
    @property
    def pos(self) -> int: ...
    @property
    def ctx_size(self) -> int: ...
    @property
    def free(self) -> int: ...


def check_rows(
    engine_id: int, n_vocab: int, rows: Sequence[tuple[RowSession, Sequence[int]]]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], list[tuple[int, int]]]:
    """A pass's (session, tokens) rows checked against engine ``engine_id``: the stacked token
    ids (n,), their positions (n,) and each session's span of rows."""
    if not rows:
        raise ValueError("forward_rows needs at least one (session, tokens) row")
    seen: set[int] = set()
    spans: list[tuple[int, int]] = []
    start = 0
    for session, tokens in rows:
        if session.engine_id != engine_id:
            raise ValueError(f"session {session.id} belongs to another engine")
        if session.id in seen:
            raise ValueError(f"session {session.id} is listed twice in one pass")
        seen.add(session.id)
        if len(tokens) == 0:
            raise ValueError(f"session {session.id} has an empty block")
        if len(tokens) > session.free:
            raise ValueError(
                f"session {session.id} is full: {len(tokens)} tokens at position "
                f"{session.pos} exceed its context of {session.ctx_size}; rewind it or "
                f"start a new session"
            )
        spans.append((start, start + len(tokens)))
        start += len(tokens)
    ids = np.concatenate([np.asarray(t, dtype=np.int64) for _, t in rows])  # (n,)
    if ids.min() < 0 or ids.max() >= n_vocab:
        raise ValueError(f"token ids must lie in [0, {n_vocab})")
    pos = np.concatenate([np.arange(s.pos, s.pos + len(t)) for s, t in rows])  # (n,)
    return ids, pos, spans


def default_ctx(cfg: ModelConfig) -> int:
    """The context a run gets unless told: the file's, at most ``arch.DEFAULT_CTX_CAP``."""
    return min(cfg.n_ctx, DEFAULT_CTX_CAP)
