"""The leader's engine thread: it executes; the pair's commands, sampling, the pair's life.

It owns the rank-0 engine (``RankState``), the session table and the pair; what runs next is
its ``tp.scheduler.Scheduler``'s decision, speculative decoding's is ``tp.speculative``'s.
Admitted requests reach it through a queue (``submit``); the frames for the clients go back
through ``deliver``, one call per step. Each step is the scheduling of tp/leader.py's
docstring: the cancelled end, the waiting are admitted, one model pass runs (``next_pass``), every
command of it written once (``_command`` over ``lockstep.COMMANDS``), and the sessions
sample. A pair failure ends the pair, never the leader; the histories are re-synced on the
next pair. Logits that cannot be sampled (NaN or +inf: weights that overflow on this input)
fail that one request with INTERNAL naming the model; its session, whose KV cache may hold
the same numbers, is destroyed on both ranks, and the pair serves on.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from foundry.model.infer.block_draw import BLOCK
from foundry.model.infer.engines import make_engine
from foundry.model.infer.sampling import SamplingError, combine_tops, greedy_tops
from foundry.model.shard.shares import Shares, share_blocks
from foundry.model.shard.table import Gate
from foundry.obs.metrics import TpMetrics
from foundry.tp.commands import (
    PAIR_FAILURES,
    PairCommands,
    PairLost,
    SessionRefused,
    pair_failure_kind,
    stop_links,
)
from foundry.tp.engine_tokens import EngineTokens, LogitsHook
from foundry.tp.frontend_server import Request
from foundry.tp.handshake import RankModel, load_rank
from foundry.tp.lockstep import (
    RankState,
    TracingExchange,
)
from foundry.tp.pair import Pair
from foundry.tp.policy import Pass
from foundry.tp.scheduler import Scheduler
from foundry.tp.speculative import (
    accepted_drafts,
    commit_plan,
    drafts_for,
)
from foundry.wire import frontend as fw
from foundry.wire.tp import (
    BatchItem,
    Eval,
    EvalBatch,
    GateTransport,
    MixedBatch,
    MixedPrefills,
    Prefill,
    Sync,
    Verify,
    VerifyCommit,
)

if TYPE_CHECKING:
    from foundry.tp.options import LeaderOptions

log = logging.getLogger("foundry.tp.leader")

# The engine thread's longest sleep while idle: the delay before it notices a stop.
IDLE_WAIT_S = 0.05
# Gate latencies kept for diagnostics (Leader.gate_latencies).
GATE_TRACE = 1 << 16


class LeaderEngine(EngineTokens):
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
        self._build(model)
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
        self.sched = Scheduler(options.max_sessions, options.keep_sessions)
        self._outbox: list[tuple[Request, fw.Frame]] = []
        self._next_sid = 1
        self._gate_trace: collections.deque[tuple[Gate, float]] = collections.deque(
            maxlen=GATE_TRACE
        )

    def _build(self, model: RankModel) -> None:
        """The rank-0 engine over ``model``'s slices, its session table, and the commands to
        the workers (each one's vocabulary block, rank 1 first: the LOGITS it returns)."""
        self.shares = model.weights.shares
        engine = make_engine(
            self.cfg,
            model.weights,
            rank=0,
            world=self.world,
            ctx_size=self.identity.ctx_size,
            device=self.options.device,
        )
        self.state = RankState(engine, self.identity.ctx_size)
        blocks = share_blocks(self.cfg.n_vocab, self.shares)
        self.commands = PairCommands(
            self.state, blocks[1:], self.world, self.metrics, self.options.prefill_chunk
        )
        # Sampled rows drawn in their blocks (ROW_DRAWS): the pair, its worker's block starting
        # on a block of the draw's masses.
        self.draws_split = self.world == 2 and blocks[0] % BLOCK == 0
        self._kept = dict(self.state.kept)

    def _reshape(self, shares: Shares) -> None:
        """Rank 0's slices for the shares chosen at pairing (``--shares auto`` or ``ranks``)."""
        o = self.options
        log.info("loading rank 0's slices for shares %s", ",".join(map(str, shares)))
        del self.commands, self.state  # the old slices go before the new ones come in
        self._build(load_rank(o.model, 0, o.ctx_size, o.expert_split, self.world, shares, o.lora))

    def submit(self, req: Request) -> None:
        """A request admitted by the frontend server (loop side)."""
        self._inbox.put(req)

    def new_pair(self, pair: Pair) -> None:
        """A pair formed by the bring-up (handshake thread)."""
        self._new_pairs.put(pair)

    def rank_status(self, threads: int) -> list[fw.RankStatus]:
        """Every rank, its share, the mean gate wait for its partial and its threads (rank 0's
        ``threads``, a worker's from the hello it formed with; 0 while it is out of the world),
        read from another thread: single reads of the pair's gate counters."""
        pair = self._pair if self.worker_connected else None
        out = []
        for rank, share in enumerate(self.shares):
            wait_us = 0
            if pair is not None and rank and pair.gate.gates_done:
                wait_us = round(1e6 * pair.gate.peer_wait_s[rank] / pair.gate.gates_done)
            out.append(
                fw.RankStatus(
                    rank,
                    share,
                    rank == 0 or pair is not None,
                    min(wait_us, 0xFFFFFFFF),
                    threads if rank == 0 else pair.threads[rank - 1] if pair is not None else 0,
                )
            )
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
                    elif self.sched.resync:
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
        if pair.shares != self.shares:
            self._reshape(pair.shares)
        self.state.reset()
        self.sched.kept.clear()
        self.state.exchange = TracingExchange(pair.gate, self._on_gate)
        self._pair = pair
        self.commands.attach(pair.links)
        self.transport = pair.transport
        self.worker_connected = True
        self.metrics.worker_connected.set(1)
        pair.watch(self._worker_hung_up)
        if self.world == 2:
            log.info("worker %s paired: gates over %s", pair.link.peer, pair.transport.value)
        else:
            log.info(
                "world of %d ranks formed (%s): gates reduce-scatter + allgather over %s",
                self.world,
                ", ".join(f"rank {r} {link.peer}" for r, link in enumerate(pair.links, start=1)),
                pair.transport.value,
            )
        if self.sched.resync:
            log.info(
                "re-syncing %d sessions (%d tokens) from their history while idle",
                len(self.sched.resync),
                sum(len(h.tokens) for h in self.sched.resync),
            )

    def _drop_stale_requests(self) -> None:
        """While no pair exists, requests that reached the inbox were failed by the loop."""
        while True:
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                return

    def _worker_hung_up(self, pair: Pair, rank: int) -> None:
        """Watcher thread: fail the requests now; the engine thread tears the pair down."""
        pair.lost = (
            "the worker closed the control connection"
            if self.world == 2
            else f"rank {rank} closed its control connection"
        )
        self.worker_connected = False
        message = f"tensor-parallel worker lost: {pair.lost}; the leader waits for it to reconnect"
        self._fail_inflight(message)

    def _lose_pair(self, exc: BaseException) -> None:
        kind = pair_failure_kind(exc)
        self.metrics.failures.labels(kind).inc()
        self.worker_connected = False
        message = f"tensor-parallel worker lost: {exc}; the leader waits for it to reconnect"
        log.warning("pair lost (%s): %s", kind, exc)
        self._fail_inflight(message)
        self._outbox.clear()
        self.sched.remember({sid: s.tokens for sid, s in self.state.sessions.items()})
        self._drop_all()
        self._close_pair()

    def _drop_all(self) -> None:
        self.sched.clear()
        self.state.reset()
        self._count_sessions()
        self._drop_stale_requests()

    def _close_pair(self) -> None:
        pair, self._pair = self._pair, None
        self.commands.attach([])
        self.worker_connected = False
        self.transport = None
        self.metrics.worker_connected.set(0)
        self.state.exchange = None
        if pair is not None:
            pair.close()
        self._release()

    def _shutdown_pair(self) -> None:
        if self._pair is not None:
            stop_links(self._pair.links)
            self._drop_all()
            self._close_pair()
        while not self._new_pairs.empty():
            pair = self._new_pairs.get_nowait()
            stop_links(pair.links)
            pair.close()

    def _has_work(self) -> bool:
        return self.sched.has_work() or not self._inbox.empty()

    def _wait_for_work(self) -> bool:
        try:
            self.sched.waiting.append(self._inbox.get(timeout=IDLE_WAIT_S))
        except queue.Empty:
            return False
        return True

    def _step(self) -> None:
        while True:
            try:
                self.sched.waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        try:
            for req in self.sched.cancelled():
                self._finish(req, fw.DoneReason.CANCELLED)
            self._admit()
            t0 = time.perf_counter()
            touched = self._run_pass()
            if touched and self.options.hash_check:
                self.commands.hash_check()
            self._account(touched, time.perf_counter() - t0)
        finally:
            self._flush()

    def _run_pass(self) -> list[Request]:
        """One model pass (``Scheduler.next_pass``); the requests that got tokens."""
        decoding = list(self.sched.decoding)
        spec = self.sched.speculating()
        drafts = self._drafts(spec) if spec is not None else []
        kind = self.sched.next_pass(len(drafts))
        if kind is Pass.MIXED:
            return self._mixed(decoding)
        if kind is Pass.PREFILL:
            prefill = self.sched.prefills[0]
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
        for req in self.sched.admissible():
            if req.gone:
                self._post(req, self._done(req, fw.DoneReason.CANCELLED))
                continue
            sid = self._continue_kept(req.prompt)
            if sid == 0:
                try:
                    sid = self._open_session()
                except SessionRefused as exc:
                    self._post(req, fw.Error(req.frame.request_id, fw.ErrorCode.INTERNAL, str(exc)))
                    continue
            req.sid, req.session = sid, self.state.sessions[sid]
            self.sched.prefills.append(req)
        self._count_sessions()

    def _prefill_alone(self, req: Request) -> None:
        meet = self.commands.checkpoint(req.sid, lambda: req.gone or self._stopping.is_set())
        sync = Sync(session_id=req.sid, tokens=tuple(req.prompt))
        drawn = self._command(sync, [req], [0], meet)
        if drawn is None:
            assert req.session is not None
            log.info(
                "request %d: prefill cancelled at position %d of %d; both ranks stopped "
                "at the same checkpoint",
                req.frame.request_id,
                req.session.pos,
                len(req.prompt),
            )
            if self.options.hash_check:  # compare the positions before the session goes
                self.commands.hash_check()
            self._finish(req, fw.DoneReason.CANCELLED)
            return
        self.sched.prefilled(req)
        self._take([req], drawn, [0])

    def _mixed(self, decoding: list[Request]) -> list[Request]:
        """The next chunk of the waiting prompts that fit ``--prefill-batch`` (MIXED_BATCH for
        one, MIXED_PREFILLS for several) with one token of every decoding request; the
        requests it touched."""
        chunks = self._prefill_chunks()
        items = tuple(BatchItem(r.sid, r.next_token) for r in decoding)
        frame: MixedBatch | MixedPrefills
        if len(chunks) == 1:
            req, start, end = chunks[0]
            frame = MixedBatch(session_id=req.sid, prompt=tuple(req.prompt[start:end]), items=items)
        else:
            prefills = tuple(Prefill(r.sid, tuple(r.prompt[a:b])) for r, a, b in chunks)
            frame = MixedPrefills(prefills=prefills, items=items)
        # Rows: each chunk's last, then one for each decoding request. A prompt whose last
        # chunk this is takes its first token from its row.
        done = [(req, i) for i, (req, _, end) in enumerate(chunks) if end == len(req.prompt)]
        reqs = [*decoding, *(req for req, _ in done)]
        rows_of = [*range(len(chunks), len(chunks) + len(decoding)), *(i for _, i in done)]
        drawn = self._command(frame, reqs, rows_of)
        assert drawn is not None
        for req, _ in done:
            self.sched.prefilled(req)
        self._take(reqs, drawn, rows_of)
        return [*decoding, *(req for req, _, _ in chunks)]

    def _prefill_chunks(self) -> list[tuple[Request, int, int]]:
        """The waiting prompts' next chunks for one pass, (request, start, end) each, oldest
        first: each prompt in chunks of ``--prefill-chunk`` from where its session stands (the
        same chunks alone or beside others), as many prompts as fit ``--prefill-batch``
        tokens in all (the first always; a context at most, what a frame may carry)."""
        budget = min(self.options.prefill_batch, self.identity.ctx_size)
        chunks: list[tuple[Request, int, int]] = []
        used = 0
        for req in self.sched.prefills:
            assert req.session is not None
            start = req.session.pos
            end = min(start + self.options.prefill_chunk, len(req.prompt))
            if chunks and used + end - start > budget:
                break
            chunks.append((req, start, end))
            used += end - start
        return chunks

    def _eval(self, req: Request) -> None:
        frame = Eval(session_id=req.sid, seq=self.state.step + 1, token=req.next_token)
        drawn = self._command(frame, [req], [0])
        assert drawn is not None
        self._take([req], drawn, [0])

    def _eval_batch(self, decoding: list[Request]) -> None:
        items = tuple(BatchItem(r.sid, r.next_token) for r in decoding)
        drawn = self._command(EvalBatch(items=items), decoding, range(len(decoding)))
        assert drawn is not None
        self._take(decoding, drawn, range(len(decoding)))

    def _drafts(self, req: Request) -> list[int]:
        """The drafter's guess at the tokens after a greedy request's next one ([]: none)."""
        assert req.session is not None
        return drafts_for(
            self.spec_mode,
            self.options.max_draft,
            req.session,
            req.frame,
            req.next_token,
            req.generated,
        )

    def _verify(self, req: Request, drafts: list[int]) -> None:
        """Verify a drafted block for a greedy request, commit what was accepted."""
        s = req.session
        assert s is not None
        mode = self.spec_mode
        block = [req.next_token, *drafts]
        pos0 = s.pos
        frame = Verify(session_id=req.sid, drafts=tuple(block))
        drawn = self._command(frame, [req], [0])  # greedy: row_tops, or the full rows
        assert drawn is not None
        if drawn.rows is not None:
            self._hook(req, drawn.rows)
            picks = combine_tops([greedy_tops(drawn.rows)])
        else:
            assert drawn.picks is not None
            picks = drawn.picks
        broken = next((p for p in picks if isinstance(p, SamplingError)), None)
        if broken is not None:  # the uncommitted block goes with the session
            self._broken_logits(req, broken)
            return
        verified = [p for p in picks if not isinstance(p, SamplingError)]
        accepted = accepted_drafts(drafts, verified)
        plan = commit_plan(mode, len(drafts), accepted)
        self.commands.run(
            VerifyCommit(session_id=req.sid, mode=plan.mode, token_count=plan.token_count)
        )
        self.drafted += len(drafts)
        self.accepted += accepted
        m = self.metrics
        m.spec_drafted.inc(len(drafts))
        m.spec_accepted.inc(accepted)
        m.spec_commits.labels(plan.mode.name.lower()).inc()
        new = [*drafts[:accepted], verified[accepted]]
        for i, token in enumerate(new):
            row = None if drawn.rows is None else drawn.rows[i]
            if not self._accept(req, token, pos0 + 1 + i, row):
                break

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
        self.commands.count_bytes()

    def _on_gate(self, gate: Gate, seconds: float, nbytes: int) -> None:
        self.metrics.record_gate(seconds, nbytes)
        self._gate_trace.append((gate, seconds))
