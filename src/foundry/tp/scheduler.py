"""What the leader's engine runs next, decided from its queues alone (the engine executes).

No sockets, no engine, no model: the queues of requests and sessions, and the decisions read
from them (the rules themselves are ``tp.policy``'s and ``tp.speculative``'s functions):

- the **waiting** requests, admitted while fewer than ``max_sessions`` generations run;
- the **prefills** (admitted, prompt not evaluated yet) and the **decoding** requests;
- the **kept** sessions (finished generations whose KV cache may serve a later prompt), least
  recently used first, at most ``keep_sessions``;
- the **histories** to re-sync on a new pair, most recently used first.

The engine asks it what pass comes next (:meth:`Scheduler.next_pass`), which requests to admit,
to finish, to keep or to evict, and carries the answers out on both ranks.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from foundry.tp.frontend_server import Request
from foundry.tp.policy import Pass, plan_pass, worth_keeping


@dataclass
class History:
    """The tokens of a session to open again on a new pair; ``sid`` once it is open there."""

    tokens: list[int]
    sid: int = 0


class Scheduler:
    """The engine thread's queues and the decisions read from them (see the module docstring)."""

    def __init__(self, max_sessions: int, keep_sessions: int) -> None:
        self.max_sessions = max_sessions
        self.keep_sessions = keep_sessions
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefills: collections.deque[Request] = collections.deque()
        self.decoding: list[Request] = []
        self.kept: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.resync: collections.deque[History] = collections.deque()

    @property
    def running(self) -> int:
        """Generations admitted and not finished."""
        return len(self.prefills) + len(self.decoding)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefills or self.decoding)

    def cancelled(self) -> list[Request]:
        """The running requests whose client went away."""
        return [req for req in [*self.prefills, *self.decoding] if req.gone]

    def admissible(self) -> Iterator[Request]:
        """The waiting requests to admit now, oldest first, while there is room; the caller
        appends each one it opened a session for to ``prefills``."""
        while self.waiting and self.running < self.max_sessions:
            yield self.waiting.popleft()

    def speculating(self) -> Request | None:
        """The request whose next block may be drafted: the one decoding request, when no
        prompt waits for its prefill."""
        return self.decoding[0] if len(self.decoding) == 1 and not self.prefills else None

    def next_pass(self, drafts: int) -> Pass:
        """The next model pass (``policy.plan_pass``), ``drafts`` drafted for
        :meth:`speculating`'s request."""
        return plan_pass(len(self.prefills), len(self.decoding), drafts)

    def prefilled(self, req: Request) -> None:
        """``req``'s prompt is evaluated: it decodes from now on."""
        self.prefills.remove(req)
        self.decoding.append(req)

    def remove(self, req: Request) -> None:
        """``req`` ended, however."""
        if req in self.decoding:
            self.decoding.remove(req)
        if req in self.prefills:
            self.prefills.remove(req)

    def continue_kept(self, sid: int) -> None:
        """Kept session ``sid`` serves a new prompt: no longer kept."""
        del self.kept[sid]

    def keep(self, sid: int, tokens: Sequence[int]) -> list[int]:
        """A finished generation's session: kept for a later prompt when worth it. The
        sessions to destroy on both ranks: ``sid`` itself when not kept, else the least
        recently used kept ones beyond ``keep_sessions``."""
        if not (worth_keeping(tokens) and self.keep_sessions > 0):
            return [sid]
        self.kept[sid] = None
        evicted = []
        while len(self.kept) > self.keep_sessions:
            evicted.append(self.kept.popitem(last=False)[0])
        return evicted

    def remember(self, tokens_of: dict[int, list[int]]) -> None:
        """The pair is lost: the histories to re-sync on the next pair are the running
        generations, then the kept sessions (``tokens_of``: a session id's tokens), then the
        histories not re-synced yet; most recent first, no repeats, at most
        ``keep_sessions``."""
        running = [r.session.tokens for r in [*self.decoding, *self.prefills] if r.session]
        kept = [tokens_of[sid] for sid in reversed(self.kept)]
        seen: set[tuple[int, ...]] = set()
        histories: list[History] = []
        for tokens in [*running, *kept, *(h.tokens for h in self.resync)]:
            key = tuple(tokens)
            if worth_keeping(tokens) and key not in seen and len(histories) < self.keep_sessions:
                seen.add(key)
                histories.append(History(list(tokens)))
        self.resync = collections.deque(histories)

    def clear(self) -> None:
        """Every request and kept session dropped (the histories stay)."""
        self.waiting.clear()
        self.prefills.clear()
        self.decoding.clear()
        self.kept.clear()
