"""The leader's engine thread: the scheduler, the pair's commands, sampling, the pair's life.

It owns the rank-0 engine (``RankState``), the session table and the pair. Admitted requests
reach it through a queue (``submit``); the frames for the clients go back through
``deliver``, one call per step. Each step is the scheduling of tp/leader.py's docstring: the
cancelled end, the waiting are admitted, one model pass runs (``policy.plan_pass``), every
command of it written once (``_command`` over ``lockstep.COMMANDS``), and the sessions
sample. A pair failure ends the pair, never the leader; the histories are re-synced on the
next pair. Logits that cannot be sampled (NaN or +inf: weights that overflow on this input)
fail that one request with INTERNAL naming the model; its session, whose KV cache may hold
the same numbers, is destroyed on both ranks, and the pair serves on.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from foundry.model.infer.engines import make_engine
from foundry.model.infer.sampling import SamplingError, logprobs, sample
from foundry.model.shard import Gate, share_blocks
from foundry.obs.metrics import TpMetrics
from foundry.tp.bringup import Pair
from foundry.tp.frontend_server import Request
from foundry.tp.handshake import ACK_ACCEPTED, RankModel
from foundry.tp.link import ControlLink, LinkError
from foundry.tp.lockstep import (
    COMMANDS,
    Checkpoint,
    LockstepError,
    RankState,
    Reply,
    TracingExchange,
    failure_kind,
)
from foundry.tp.policy import (
    Pass,
    SpecMode,
    accepted_drafts,
    commit_plan,
    pick_kept_session,
    plan_pass,
    propose_drafts,
    worth_keeping,
)
from foundry.transport.gates import GateError
from foundry.wire import frontend as fw
from foundry.wire.tp import (
    BatchItem,
    CommandAck,
    ControlFrame,
    Eval,
    EvalBatch,
    FrameType,
    GateTransport,
    Hash,
    Logits,
    MixedBatch,
    Rewind,
    SessionCreate,
    SessionDestroy,
    Stop,
    Sync,
    SyncCheckpoint,
    TpProtocolError,
    Verify,
    VerifyCommit,
)

if TYPE_CHECKING:
    from foundry.tp.options import LeaderOptions

log = logging.getLogger("foundry.tp.leader")

F32 = npt.NDArray[np.float32]
# (request id, the full logits rows the leader sampled from in one step): a debug hook.
LogitsHook = Callable[[int, F32], None]

# The engine thread's longest sleep while idle: the delay before it notices a stop.
IDLE_WAIT_S = 0.05
# Gate latencies kept for diagnostics (Leader.gate_latencies).
GATE_TRACE = 1 << 16
# Pair failures end one pair, never the leader.
PAIR_FAILURES = (GateError, LinkError, TpProtocolError, LockstepError)


class PairLost(Exception):
    """The watcher saw the worker hang up."""


class SessionRefused(Exception):
    """A session could not be opened (no memory on a rank); the pair itself is fine."""


@dataclass
class _History:
    """The tokens of a session to open again on a new pair; ``sid`` once it is open there."""

    tokens: list[int]
    sid: int = 0


class HashMismatch(LockstepError):
    """The debug lockstep check found the ranks' states different."""


class LeaderEngine:
    """The engine thread's side of the leader (see tp/leader.py, "Scheduling")."""

    def __init__(
        self,
        options: LeaderOptions,
        model: RankModel,
        metrics: TpMetrics,
        logits_hook: LogitsHook | None,
        stopping: threading.Event,
        *,
        deliver: Callable[[list[tuple[Request, fw.Frame]]], None],
        fail_inflight: Callable[[str], None],
        release: Callable[[], None],
        on_crash: Callable[[], None],
    ) -> None:
        """``deliver`` and ``fail_inflight`` reach the frontend server (on its loop),
        ``release`` frees the bring-up's claim when a pair ends, ``on_crash`` stops the
        leader."""
        self.options = options
        self.identity = model.identity
        self.cfg = model.cfg
        self.metrics = metrics
        self.logits_hook = logits_hook
        self._stopping = stopping
        self._deliver = deliver
        self._fail_inflight = fail_inflight
        self._release = release
        self._on_crash = on_crash
        # Read at every step: adjustable while serving (the speculative benchmark switches it).
        self.spec_mode = options.spec_mode
        self.world = model.weights.world
        self.shares = model.weights.shares
        engine = make_engine(self.cfg, model.weights, rank=0, world=self.world,
                             ctx_size=self.identity.ctx_size, device=options.device)
        self.state = RankState(engine, self.identity.ctx_size)
        # Each worker's vocabulary block, rank 1 first: the LOGITS it returns per row.
        self._worker_vocab = share_blocks(self.cfg.n_vocab, self.shares)[1:]
        # Shared between threads (single attribute reads and writes).
        self.worker_connected = False
        self.transport: GateTransport | None = None
        self.tokens_generated = 0
        self.running = 0  # generations admitted and not finished (the engine thread writes it)
        self.drafted = 0
        self.accepted = 0
        self.crashed = False  # the engine thread died of a bug; the leader stops
        # Engine thread side.
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._new_pairs: queue.Queue[Pair] = queue.Queue()
        self._pair: Pair | None = None
        self._waiting: collections.deque[Request] = collections.deque()
        self._prefills: collections.deque[Request] = collections.deque()
        self._decoding: list[Request] = []
        # Kept sessions, least recently used first, and the histories to re-sync on a new pair,
        # most recently used first (see the module docstring).
        self._kept_sessions: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._resync: collections.deque[_History] = collections.deque()
        self._outbox: list[tuple[Request, fw.Frame]] = []
        self._next_sid = 1
        self._kept = dict(self.state.kept)
        self._link_bytes = [(0, 0)] * (self.world - 1)
        self._gate_trace: collections.deque[tuple[Gate, float]] = collections.deque(
            maxlen=GATE_TRACE
        )

    def submit(self, req: Request) -> None:
        """A request admitted by the frontend server (loop side)."""
        self._inbox.put(req)

    def new_pair(self, pair: Pair) -> None:
        """A pair formed by the bring-up (handshake thread)."""
        self._new_pairs.put(pair)

    def rank_status(self) -> list[fw.RankStatus]:
        """Every rank, its share and the mean gate wait for its partial (read from another
        thread: single reads of the pair's gate counters)."""
        pair = self._pair
        gate = pair.gate if pair is not None and self.worker_connected else None
        out = []
        for rank, share in enumerate(self.shares):
            wait_us = 0
            if gate is not None and rank and gate.gates_done:
                wait_us = round(1e6 * gate.peer_wait_s[rank] / gate.gates_done)
            out.append(fw.RankStatus(rank, share, rank == 0 or gate is not None,
                                     min(wait_us, 0xFFFFFFFF)))
        return out

    def gate_latencies(self) -> list[tuple[Gate, float]]:
        """The most recent gate exchanges (up to 65536), oldest first: gate and seconds."""
        return list(self._gate_trace)

    def run(self) -> None:
        """The engine thread's body: until the leader stops."""
        try:
            while not self._stopping.is_set():
                if self._pair is None:
                    self._wait_for_pair()
                    continue
                try:
                    if self._pair.lost:  # the watcher saw the worker hang up
                        raise PairLost(self._pair.lost)
                    if self._has_work():
                        self._step()
                    elif self._resync:
                        self._resync_next()
                    elif self._wait_for_work():
                        self._step()
                except (*PAIR_FAILURES, PairLost) as exc:
                    self._lose_pair(exc)
        except Exception:
            log.exception("the engine thread failed; the leader stops")
            self.crashed = True
            self._on_crash()
        finally:
            self._shutdown_pair()

    def _wait_for_pair(self) -> None:
        try:
            pair = self._new_pairs.get(timeout=IDLE_WAIT_S)
        except queue.Empty:
            self._drop_stale_requests()
            return
        self.state.reset()
        self._kept_sessions.clear()
        self.state.exchange = TracingExchange(pair.gate, self._on_gate)
        self._link_bytes = [(0, 0)] * (self.world - 1)
        self._pair = pair
        self.transport = pair.transport
        self.worker_connected = True
        self.metrics.worker_connected.set(1)
        pair.watch(self._worker_hung_up)
        if self.world == 2:
            log.info("worker %s paired: gates over %s", pair.link.peer, pair.transport.value)
        else:
            log.info("world of %d ranks formed (%s): gates all-to-all over %s", self.world,
                     ", ".join(f"rank {r} {link.peer}" for r, link in
                               enumerate(pair.links, start=1)), pair.transport.value)
        if self._resync:
            log.info("re-syncing %d sessions (%d tokens) from their history while idle",
                     len(self._resync), sum(len(h.tokens) for h in self._resync))

    def _drop_stale_requests(self) -> None:
        """While no pair exists, requests that reached the inbox were failed by the loop."""
        while True:
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                return

    def _worker_hung_up(self, pair: Pair, rank: int) -> None:
        """Watcher thread: fail the requests now; the engine thread tears the pair down."""
        pair.lost = ("the worker closed the control connection" if self.world == 2
                     else f"rank {rank} closed its control connection")
        self.worker_connected = False
        message = f"tensor-parallel worker lost: {pair.lost}; the leader waits for it to reconnect"
        self._fail_inflight(message)

    def _lose_pair(self, exc: BaseException) -> None:
        kind = _failure_kind(exc)
        self.metrics.failures.labels(kind).inc()
        self.worker_connected = False
        message = f"tensor-parallel worker lost: {exc}; the leader waits for it to reconnect"
        log.warning("pair lost (%s): %s", kind, exc)
        self._fail_inflight(message)
        self._outbox.clear()
        self._remember_sessions()
        self._drop_all()
        self._close_pair()

    def _remember_sessions(self) -> None:
        """The histories to re-sync on the next pair: running generations, then kept
        sessions, then histories not re-synced yet; most recent first, no repeats."""
        keep = self.options.keep_sessions
        running = [r.session.tokens for r in [*self._decoding, *self._prefills] if r.session]
        kept = [self.state.sessions[sid].tokens for sid in reversed(self._kept_sessions)]
        seen: set[tuple[int, ...]] = set()
        histories: list[_History] = []
        for tokens in [*running, *kept, *(h.tokens for h in self._resync)]:
            key = tuple(tokens)
            if worth_keeping(tokens) and key not in seen and len(histories) < keep:
                seen.add(key)
                histories.append(_History(list(tokens)))
        self._resync = collections.deque(histories)

    def _drop_all(self) -> None:
        self._waiting.clear()
        self._prefills.clear()
        self._decoding.clear()
        self._kept_sessions.clear()
        self.state.reset()
        self._count_sessions()
        self._drop_stale_requests()

    def _close_pair(self) -> None:
        pair, self._pair = self._pair, None
        self.worker_connected = False
        self.transport = None
        self.metrics.worker_connected.set(0)
        self.state.exchange = None
        if pair is not None:
            pair.close()
        self._release()

    def _shutdown_pair(self) -> None:
        if self._pair is not None:
            for link in self._pair.links:
                with contextlib.suppress(LinkError):
                    link.send(Stop())
            self._drop_all()
            self._close_pair()
        while not self._new_pairs.empty():
            pair = self._new_pairs.get_nowait()
            for link in pair.links:
                with contextlib.suppress(LinkError):
                    link.send(Stop())
            pair.close()

    def _has_work(self) -> bool:
        return bool(self._waiting or self._prefills or self._decoding or not self._inbox.empty())

    def _wait_for_work(self) -> bool:
        try:
            self._waiting.append(self._inbox.get(timeout=IDLE_WAIT_S))
        except queue.Empty:
            return False
        return True

    @property
    def _links(self) -> list[ControlLink]:
        """The workers' control links, rank 1 first."""
        assert self._pair is not None
        return self._pair.links

    def _send_all(self, frame: ControlFrame | Hash | Stop) -> None:
        for link in self._links:
            link.send(frame)

    def _step(self) -> None:
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        try:
            for req in [*self._prefills, *self._decoding]:
                if req.gone:
                    self._finish(req, fw.DoneReason.CANCELLED)
            self._admit()
            t0 = time.perf_counter()
            touched = self._run_pass()
            if touched and self.options.hash_check:
                self._hash_check()
            self._account(touched, time.perf_counter() - t0)
        finally:
            self._flush()

    def _run_pass(self) -> list[Request]:
        """One model pass (``policy.plan_pass``); the requests that got tokens."""
        decoding = list(self._decoding)
        drafts = self._drafts(decoding[0]) if len(decoding) == 1 and not self._prefills else []
        kind = plan_pass(len(self._prefills), len(decoding), len(drafts))
        if kind is Pass.MIXED:
            prefill = self._prefills[0]
            self._mixed(prefill, decoding)
            return [*decoding, prefill]
        if kind is Pass.PREFILL:
            prefill = self._prefills[0]
            self._prefill_alone(prefill)
            return [prefill]
        if kind is Pass.VERIFY:
            self._verify(decoding[0], drafts)
        elif kind is Pass.EVAL:
            self._eval(decoding[0])
        elif kind is Pass.EVAL_BATCH:
            self._eval_batch(decoding)
        return decoding

    def _admit(self) -> None:
        o = self.options
        while self._waiting and len(self._prefills) + len(self._decoding) < o.max_sessions:
            req = self._waiting.popleft()
            if req.gone:
                self._post(req, self._done(req, fw.DoneReason.CANCELLED))
                continue
            sid = self._continue_kept(req.prompt)
            if sid == 0:
                try:
                    sid = self._open_session()
                except SessionRefused as exc:
                    self._post(req, fw.Error(req.frame.request_id, fw.ErrorCode.INTERNAL,
                                             str(exc)))
                    continue
            req.sid, req.session = sid, self.state.sessions[sid]
            self._prefills.append(req)
        self._count_sessions()

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
            self._command(SessionCreate(session_id=sid, ctx_size=ctx), here=False)
        except SessionRefused:
            self.state.destroy(sid)
            raise
        return sid

    def _continue_kept(self, prompt: list[int]) -> int:
        """The kept session ``prompt`` continues, rewound on both ranks to the prefix they
        share (0: none does)."""
        kept = [(sid, self.state.sessions[sid].tokens) for sid in self._kept_sessions]
        pick = pick_kept_session(prompt, kept)
        if pick is None:
            return 0
        sid, reused = pick
        del self._kept_sessions[sid]
        if reused < self.state.sessions[sid].pos:
            self._command(Rewind(session_id=sid, pos=reused))
        self.metrics.prompt_tokens_reused.inc(reused)
        return sid

    def _keep_or_destroy(self, sid: int) -> None:
        """A finished generation's session: kept for a later prompt (the least recently
        used kept one goes when there are too many), or destroyed on both ranks."""
        if worth_keeping(self.state.sessions[sid].tokens) and self.options.keep_sessions > 0:
            self._kept_sessions[sid] = None
            while len(self._kept_sessions) > self.options.keep_sessions:
                self._destroy(self._kept_sessions.popitem(last=False)[0])
        else:
            self._destroy(sid)

    def _destroy(self, sid: int) -> None:
        self._command(SessionDestroy(session_id=sid))

    def _count_sessions(self) -> None:
        self.running = len(self._prefills) + len(self._decoding)
        self.metrics.active_sessions.set(len(self.state.sessions))
        self.metrics.kept_sessions.set(len(self._kept_sessions))

    def _resync_next(self) -> None:
        """Re-sync the next remembered history (the pair is idle): open its session on both
        ranks and SYNC its tokens; then it is a kept session like any other. A request that
        arrives meanwhile cancels the sync at its next checkpoint and goes first; the sync
        resumes from where both ranks stopped."""
        history = self._resync[0]
        if history.sid == 0:
            try:
                history.sid = self._open_session()
            except SessionRefused as exc:
                log.warning("a remembered session of %d tokens was not re-synced: %s",
                            len(history.tokens), exc)
                self._resync.popleft()
                return
        sid, tokens = history.sid, history.tokens
        rows = self._command(Sync(session_id=sid, tokens=tuple(tokens)),
                             self._checkpoint(sid, self._resync_yields))
        if rows is None:
            log.info("re-sync paused at position %d of %d: a request goes first",
                     self.state.sessions[sid].pos, len(tokens))
            return
        if self.options.hash_check:
            self._hash_check()
        self._resync.popleft()
        self._keep_or_destroy(sid)
        self._count_sessions()
        self.metrics.sessions_resynced.inc()
        log.info("session re-synced from its history: %d tokens (%d more to re-sync)",
                 len(tokens), len(self._resync))

    def _resync_yields(self) -> bool:
        return self._stopping.is_set() or not self._inbox.empty()

    def _prefill_alone(self, req: Request) -> None:
        meet = self._checkpoint(req.sid, lambda: req.gone or self._stopping.is_set())
        full = self._command(Sync(session_id=req.sid, tokens=tuple(req.prompt)), meet)
        if full is None:
            assert req.session is not None
            log.info("request %d: prefill cancelled at position %d of %d; both ranks stopped "
                     "at the same checkpoint", req.frame.request_id, req.session.pos,
                     len(req.prompt))
            if self.options.hash_check:  # compare the positions before the session goes
                self._hash_check()
            self._finish(req, fw.DoneReason.CANCELLED)
            return
        self._hook(req, full)
        self._prefills.popleft()
        self._decoding.append(req)
        self._sample(req, full[0])

    def _checkpoint(self, sid: int, cancelled: Callable[[], bool]) -> Checkpoint:
        """A SYNC's checkpoints: before each chunk both ranks agree on it, or on stopping
        there when ``cancelled()`` (or the worker asks to)."""
        chunk = self.options.prefill_chunk

        def meet(current: int, total: int) -> int | None:
            end = min(current + chunk, total)
            stop = cancelled()
            mine = SyncCheckpoint(session_id=sid, point=end, current=current, total=total,
                                  requested=stop)
            self._send_all(mine)
            for link in self._links:
                theirs = link.expect(FrameType.SYNC_CHECKPOINT, "the worker's checkpoint")
                assert isinstance(theirs, SyncCheckpoint)
                if (theirs.session_id, theirs.point, theirs.current, theirs.total) != (
                    sid, end, current, total
                ):
                    raise LinkError(
                        f"the worker met checkpoint {theirs.current}->{theirs.point}/"
                        f"{theirs.total} of session {theirs.session_id}, expected {current}->"
                        f"{end}/{total} of session {sid}; the ranks are out of step"
                    )
                stop = stop or theirs.requested
            if self.world > 2:  # the verdict: every rank stops, or none does
                self._send_all(dataclasses.replace(mine, requested=stop))
            return None if stop else end

        return meet

    def _mixed(self, prefill: Request, decoding: list[Request]) -> None:
        s = prefill.session
        assert s is not None
        end = min(s.pos + self.options.prefill_chunk, len(prefill.prompt))
        chunk = prefill.prompt[s.pos : end]
        full = self._rows(MixedBatch(session_id=prefill.sid, prompt=tuple(chunk),
                                     items=tuple(BatchItem(r.sid, r.next_token) for r in decoding)))
        for i, req in enumerate(decoding, start=1):
            self._hook(req, full[i : i + 1])
            self._sample(req, full[i])
        if end == len(prefill.prompt):
            self._hook(prefill, full[:1])
            self._prefills.popleft()
            self._decoding.append(prefill)
            self._sample(prefill, full[0])

    def _eval(self, req: Request) -> None:
        full = self._rows(Eval(session_id=req.sid, seq=self.state.step + 1, token=req.next_token))
        self._hook(req, full)
        self._sample(req, full[0])

    def _eval_batch(self, decoding: list[Request]) -> None:
        full = self._rows(EvalBatch(items=tuple(BatchItem(r.sid, r.next_token) for r in decoding)))
        for i, req in enumerate(decoding):
            self._hook(req, full[i : i + 1])
            self._sample(req, full[i])

    def _drafts(self, req: Request) -> list[int]:
        """The drafter's guess at the tokens after a greedy request's next one ([]: none)."""
        s = req.session
        assert s is not None
        if self.spec_mode is SpecMode.OFF or req.frame.temperature != 0.0:
            return []
        limit = min(self.options.max_draft, s.free - 1, req.frame.max_tokens - req.generated - 1)
        return propose_drafts([*s.tokens, req.next_token], limit)

    def _verify(self, req: Request, drafts: list[int]) -> None:
        """Verify a drafted block for a greedy request, commit what was accepted."""
        s = req.session
        assert s is not None
        mode = self.spec_mode
        block = [req.next_token, *drafts]
        pos0 = s.pos
        full = self._rows(Verify(session_id=req.sid, drafts=tuple(block)))
        self._hook(req, full)
        try:
            verified = [sample(row, 0.0) for row in full]
        except SamplingError as exc:  # the uncommitted block goes with the session
            self._broken_logits(req, exc)
            return
        accepted = accepted_drafts(drafts, verified)
        plan = commit_plan(mode, len(drafts), accepted)
        self._command(VerifyCommit(session_id=req.sid, mode=plan.mode,
                                   token_count=plan.token_count))
        self.drafted += len(drafts)
        self.accepted += accepted
        m = self.metrics
        m.spec_drafted.inc(len(drafts))
        m.spec_accepted.inc(accepted)
        m.spec_commits.labels(plan.mode.name.lower()).inc()
        new = [*drafts[:accepted], verified[accepted]]
        for i, token in enumerate(new):
            if not self._accept(req, token, pos0 + 1 + i, full[i]):
                break

    def _command(self, frame: ControlFrame, checkpoint: Checkpoint | None = None, *,
                 here: bool = True) -> F32 | None:
        """One command on both ranks (``lockstep.COMMANDS``): send it to the worker, run the
        same RankState call here (unless done already, ``here=False``), collect the worker's
        reply. The full logits rows when the command returned rows, else None."""
        command = COMMANDS[frame.TYPE]
        self._send_all(frame)
        rows = command.run(self.state, frame, checkpoint) if here else None
        if command.reply is Reply.COMMAND_ACK:
            refused, opened = [], []
            for rank, link in enumerate(self._links, start=1):
                ack = link.expect(FrameType.COMMAND_ACK,
                                  f"the worker's {frame.TYPE.name} {frame.session_id}")
                assert isinstance(ack, CommandAck)
                if ack.session_id != frame.session_id:
                    raise LinkError(f"rank {rank} acknowledged session {ack.session_id}, "
                                    f"expected {frame.session_id}; the ranks are out of step")
                if ack.status != ACK_ACCEPTED:
                    refused.append(f"rank {rank} (status {ack.status})")
                else:
                    opened.append(link)
            if refused:
                if isinstance(frame, SessionCreate):
                    # Those that opened it close it again: every rank's table stays the same.
                    for link in opened:
                        link.send(SessionDestroy(session_id=frame.session_id))
                raise SessionRefused(f"{', '.join(refused)} could not open a session; see its "
                                     "log")
        if command.reply is Reply.LOGITS and rows is not None:
            return self._join(rows)
        return None

    def _rows(self, frame: ControlFrame) -> F32:
        """``_command`` of a command that always returns rows."""
        rows = self._command(frame)
        assert rows is not None
        return rows

    def _join(self, mine: F32) -> F32:
        """Our logits rows joined with every worker's block of the same rows, rank order."""
        rows = mine.shape[0]
        blocks = [mine]
        for rank, (link, width) in enumerate(zip(self._links, self._worker_vocab, strict=True),
                                             start=1):
            frame = link.expect(FrameType.LOGITS, "the worker's half of the logits")
            assert isinstance(frame, Logits)
            if frame.seq != self.state.step:
                raise LinkError(f"rank {rank} sent the logits of step {frame.seq}, this rank is "
                                f"at step {self.state.step}; the ranks are out of step")
            block = frame.array()
            if block.size != rows * width:
                raise LinkError(f"rank {rank} sent {block.size} logits, expected {rows} rows of "
                                f"{width}")
            blocks.append(block.reshape(rows, width))
        return np.concatenate(blocks, axis=1)

    def _hook(self, req: Request, rows: F32) -> None:
        if self.logits_hook is not None:
            self.logits_hook(req.frame.request_id, rows)

    def _sample(self, req: Request, row: F32) -> None:
        g = req.frame
        assert req.session is not None
        try:
            token = sample(row, g.temperature, g.top_p, req.rng if g.temperature > 0 else None,
                           g.top_k)
        except SamplingError as exc:
            self._broken_logits(req, exc)
            return
        self._accept(req, token, req.session.pos, row)

    def _broken_logits(self, req: Request, exc: SamplingError) -> None:
        """Fail ``req`` alone: INTERNAL naming the model; its session is destroyed on both
        ranks (never kept: its KV cache may hold the same NaN or infinity)."""
        assert req.session is not None
        model = self.options.model.name
        message = (f"model {model} gave logits that cannot be sampled at position "
                   f"{req.session.pos} ({exc}); its weights overflow on this input. This "
                   "request failed; the pair serves on")
        log.warning("request %d: %s", req.frame.request_id, message)
        self._post(req, fw.Error(req.frame.request_id, fw.ErrorCode.INTERNAL, message))
        if req in self._decoding:
            self._decoding.remove(req)
        if req in self._prefills:
            self._prefills.remove(req)
        if req.sid in self.state.sessions:
            self._destroy(req.sid)
        self._count_sessions()

    def _accept(self, req: Request, token: int, pos: int, row: F32) -> bool:
        """Emit one generated token at position ``pos`` (``row``: the logits it was chosen
        from); False when the request ended."""
        assert req.session is not None
        if req.frame.logprobs:
            lp = logprobs(row, token, req.frame.top_logprobs)
            self._post(req, fw.Logprobs(
                req.frame.request_id, token, lp.logprob, req.tokenizer.token_bytes(token),
                tuple((t, v, req.tokenizer.token_bytes(t)) for t, v in lp.top),
            ))
        req.generated += 1
        req.step_tokens += 1
        self.tokens_generated += 1
        reason: fw.DoneReason | None = None
        if token in req.tokenizer.eog_ids:
            reason = fw.DoneReason.EOS
        elif req.generated >= req.frame.max_tokens:
            reason = fw.DoneReason.MAX_TOKENS
        elif pos >= req.session.ctx_size:
            reason = fw.DoneReason.CONTEXT_FULL
        text, hit = req.stream.push(token, final=reason is not None)
        if hit:
            reason = fw.DoneReason.STOP_STRING
        self._post(req, fw.Token(req.frame.request_id, token, pos, text))
        if reason is not None:
            self._finish(req, reason)
            return False
        req.next_token = token
        return True

    def _done(self, req: Request, reason: fw.DoneReason) -> fw.Done:
        return fw.Done(req.frame.request_id, reason, len(req.prompt), req.generated,
                       time.monotonic() - req.t0)

    def _finish(self, req: Request, reason: fw.DoneReason) -> None:
        self._post(req, self._done(req, reason))
        if req in self._decoding:
            self._decoding.remove(req)
        if req in self._prefills:
            self._prefills.remove(req)
        if req.sid in self.state.sessions:
            self._keep_or_destroy(req.sid)
        self._count_sessions()

    def _hash_check(self) -> None:
        mine = self.state.state_hash()
        self._send_all(Hash(seq=self.state.step, value=mine))
        for rank, link in enumerate(self._links, start=1):
            theirs = link.expect(FrameType.HASH, "the worker's state hash")
            assert isinstance(theirs, Hash)
            if (theirs.seq, theirs.value) != (self.state.step, mine):
                self.metrics.hash_checks.labels("mismatch").inc()
                who = "worker" if self.world == 2 else f"rank {rank}"
                raise HashMismatch(
                    f"lockstep hash mismatch: leader step {self.state.step} hash {mine:#018x}, "
                    f"{who} step {theirs.seq} hash {theirs.value:#018x}; the ranks diverged"
                )
        self.metrics.hash_checks.labels("match").inc()

    def _post(self, req: Request, frame: fw.Frame) -> None:
        self._outbox.append((req, frame))

    def _flush(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._deliver(batch)

    def _account(self, touched: list[Request], seconds: float) -> None:
        m = self.metrics
        for req in touched:
            if req.step_tokens:
                per = seconds / req.step_tokens
                for _ in range(req.step_tokens):
                    m.token_duration.observe(per)
                req.step_tokens = 0
        for phase, n in self.state.kept.items():
            if n > self._kept[phase]:
                m.tokens.labels(phase).inc(n - self._kept[phase])
        self._kept = dict(self.state.kept)
        for i, link in enumerate(self._links):
            sent, received = self._link_bytes[i]
            m.control_bytes.labels("sent").inc(link.bytes_sent - sent)
            m.control_bytes.labels("received").inc(link.bytes_received - received)
            self._link_bytes[i] = (link.bytes_sent, link.bytes_received)

    def _on_gate(self, gate: Gate, seconds: float, nbytes: int) -> None:
        self.metrics.record_gate(seconds, nbytes)
        self._gate_trace.append((gate, seconds))


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, PairLost):
        return "hangup"
    if isinstance(exc, HashMismatch):
        return "hash"
    return failure_kind(exc)
