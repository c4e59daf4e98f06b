"""The leader engine's sessions on every rank: opened (SESSION_CREATE, here first), a kept
one continued by a prompt that shares its prefix (rewound to it), kept for a later prompt or
destroyed when a generation ends, and re-synced from their histories (SYNC, yielding to a new
request) once a lost pair forms again. :class:`~foundry.tp.engine.LeaderEngine` is built on it
and holds what it reads."""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

from foundry.obs.metrics import TpMetrics
from foundry.tp.commands import PairCommands, SessionRefused
from foundry.tp.frontend_server import Request
from foundry.tp.lockstep import RankState
from foundry.tp.policy import pick_kept_session
from foundry.tp.scheduler import Scheduler
from foundry.wire.tp import Identity, Rewind, SessionCreate, SessionDestroy, Sync

if TYPE_CHECKING:
    from foundry.tp.options import LeaderOptions

log = logging.getLogger("foundry.tp.leader")


class EngineSessions:
    """The session table of every rank, kept in step by the pair's commands."""

    # Set by LeaderEngine.__init__ (and ``state``, ``commands`` again when the shares change).
    options: LeaderOptions
    identity: Identity
    metrics: TpMetrics
    state: RankState
    commands: PairCommands
    sched: Scheduler
    running: int
    _stopping: threading.Event
    _inbox: queue.Queue[Request]
    _next_sid: int

    def _open_session(self) -> int:
        """SESSION_CREATE on both ranks; the new session's id."""
        sid = self._next_sid
        self._next_sid += 1
        ctx = self.identity.ctx_size
        try:
            self.state.create(sid, ctx)
        except MemoryError:
            raise SessionRefused(f"no memory for a session of {ctx} positions") from None
        try:  # created here first: a session that does not fit is refused without the worker
            self.commands.run(SessionCreate(session_id=sid, ctx_size=ctx), here=False)
        except SessionRefused:
            self.state.destroy(sid)
            raise
        return sid

    def _continue_kept(self, prompt: list[int]) -> int:
        """The kept session ``prompt`` continues, rewound on both ranks to the prefix they
        share (0: none does)."""
        kept = [(sid, self.state.sessions[sid].tokens) for sid in self.sched.kept]
        pick = pick_kept_session(prompt, kept)
        if pick is None:
            return 0
        sid, reused = pick
        self.sched.continue_kept(sid)
        if reused < self.state.sessions[sid].pos:
            self.commands.run(Rewind(session_id=sid, pos=reused))
        self.metrics.prompt_tokens_reused.inc(reused)
        return sid

    def _keep_or_destroy(self, sid: int) -> None:
        """A finished generation's session: kept for a later prompt (the least recently
        used kept one goes when there are too many), or destroyed on both ranks."""
        for gone in self.sched.keep(sid, self.state.sessions[sid].tokens):
            self._destroy(gone)

    def _destroy(self, sid: int) -> None:
        self.commands.run(SessionDestroy(session_id=sid))

    def _count_sessions(self) -> None:
        self.running = self.sched.running
        self.metrics.active_sessions.set(len(self.state.sessions))
        self.metrics.kept_sessions.set(len(self.sched.kept))

    def _resync_next(self) -> None:
        """Re-sync the next remembered history (the pair is idle): open its session on both
        ranks and SYNC its tokens; then it is a kept session like any other. A request that
        arrives meanwhile cancels the sync at its next checkpoint and goes first; the sync
        resumes from where both ranks stopped."""
        history = self.sched.resync[0]
        if history.sid == 0:
            try:
                history.sid = self._open_session()
            except SessionRefused as exc:
                log.warning(
                    "a remembered session of %d tokens was not re-synced: %s",
                    len(history.tokens),
                    exc,
                )
                self.sched.resync.popleft()
                return
        sid, tokens = history.sid, history.tokens
        rows = self.commands.run(
            Sync(session_id=sid, tokens=tuple(tokens)),
            self.commands.checkpoint(sid, self._resync_yields),
        )
        if rows is None:
            log.info(
                "re-sync paused at position %d of %d: a request goes first",
                self.state.sessions[sid].pos,
                len(tokens),
            )
            return
        if self.options.hash_check:
            self.commands.hash_check()
        self.sched.resync.popleft()
        self._keep_or_destroy(sid)
        self._count_sessions()
        self.metrics.sessions_resynced.inc()
        log.info(
            "session re-synced from its history: %d tokens (%d more to re-sync)",
            len(tokens),
            len(self.sched.resync),
        )

    def _resync_yields(self) -> bool:
        return self._stopping.is_set() or not self._inbox.empty()
