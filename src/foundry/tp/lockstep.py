"""The session commands both ranks execute: one code path for the leader and the worker.

Lockstep by construction: the leader sends a command frame to the worker, then runs the very
same :class:`RankState` method on its own half; the worker runs it on receipt. Both ranks
therefore make the same engine calls with the same rows in the same order, meet at the same
gates, and end with the same session table (ids, positions, token histories).

Commands (the ``ds4_tp_frame_type`` they mirror) and what each returns, the logits rows the
leader needs to sample (each rank returns its vocabulary half; the worker ships it in LOGITS).
``COMMANDS`` holds this table as data, frame type -> the RankState call and the kind of reply
the worker sends (LOGITS when there are rows, COMMAND_ACK, or none): the worker dispatches
with it, the leader sends, runs and collects with it, so each command is written once:

=================  ==========================================  ==============================
SESSION_CREATE     open a session of ``ctx`` positions         -
SESSION_DESTROY    close it                                    -
SYNC               bring the context to exactly ``tokens``:    the last row, or None when
                   keep the common prefix, evaluate the rest   cancelled at a checkpoint
                   in chunks with a checkpoint before each
EVAL / EVAL_BATCH  one token for each listed session           one row per session
MIXED_BATCH        a prefill chunk for one session, appended,  the chunk's last row, then
                   plus one token for each listed session      one row per session
MIXED_PREFILLS     MIXED_BATCH with a chunk of each of         each chunk's last row, then
                   several sessions                            one row per session
VERIFY             a block: seed token + drafts                one row per block row
VERIFY_COMMIT      how the block ends (full, prefix, replay)   -
REWIND             forget positions >= pos                     -
INVALIDATE         forget everything (rewind to 0)             -
=================  ==========================================  ==============================

Every command is checked before any gate runs (unknown session, full context, a session listed
twice, a verify left uncommitted ...) and raises :class:`LockstepError`: on the leader that is a
bug caught before sending, on the worker it means the ranks are out of step.

Sync checkpoints. Before each prefill chunk both ranks call ``checkpoint(current, total)``,
which exchanges SYNC_CHECKPOINT frames and returns where the chunk ends, or None when either
rank asked to stop. Both stop at the same position because the decision is made once, from
both frames, while neither rank is inside a gate.

``state_hash`` (debug lockstep, HASH frames): a 64-bit hash of the step number, every
session's position, and the last gate sum the step produced. The gate sums are the residual
stream's updates, identical on both ranks bit for bit, so equal hashes mean both ranks hold the
same hidden state and the same session table.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from foundry.model.infer.engines import InferenceEngine
from foundry.model.infer.kv_cache import Session
from foundry.model.shard.table import Gate
from foundry.tp.policy import common_prefix
from foundry.transport.gates import GateError, StepGates
from foundry.wire.tp import (
    DS4_TP_BATCH_MAX_ROWS,
    GATE_HEADER_SIZE,
    BatchItem,
    Eval,
    FrameType,
    Sync,
    TpProtocolError,
    VerifyCommitMode,
)

F32 = npt.NDArray[np.float32]
# (current position, total) -> the position the next chunk ends at, or None: stop here.
Checkpoint = Callable[[int, int], int | None]

_STEP = struct.Struct("<Q")
_POS = struct.Struct("<Qq")


class LockstepError(ValueError):
    """A command the session table cannot carry out; names the session and the reason."""


class Transport(Protocol):
    """What a gate transport offers (``foundry.transport.gates.GateExchange``)."""

    world: int  # the ranks it joins: a gate sends to each of the other world - 1
    n_embd: int

    def exchange(self, layer: int, gate: int, partial: np.ndarray) -> F32: ...

    def step_gates(self, max_gates: int) -> object | None: ...

    def step_done(self) -> StepGates: ...


class TracingExchange:
    """The engine's gate callback over a transport: times each gate, counts its bytes and
    keeps the last sum (for ``state_hash``). ``on_gate(gate, seconds, bytes_each_way)`` is
    called after every gate (bytes to all the other ranks together)."""

    def __init__(self, transport: Transport, on_gate: Callable[[Gate, float, int], None]) -> None:
        self.transport = transport
        self.on_gate = on_gate
        self.last_sum: F32 | None = None

    def __call__(self, layer: int, gate: Gate, partial: F32) -> F32:
        t0 = time.perf_counter()
        total = self.transport.exchange(layer, gate, partial)
        self.on_gate(gate, time.perf_counter() - t0, self._sent(partial.nbytes))
        self.last_sum = total
        return total

    def _sent(self, partial_bytes: int) -> int:
        """A gate's bytes to all the other ranks together, for a partial of this size."""
        return (GATE_HEADER_SIZE + partial_bytes) * (self.transport.world - 1)

    @contextlib.contextmanager
    def in_c(self, max_gates: int) -> Iterator[object | None]:
        """The transport's gates for a C one-token step (``CGates``: a capsule, or None where
        they go through the call). After the step each of its gates is timed and counted as a
        call's, and a gate that failed raises its GateError in place of the step's error."""
        capsule = self.transport.step_gates(max_gates)
        if capsule is None:
            yield None
            return
        try:
            yield capsule
        finally:
            done = self.transport.step_done()
            nbytes = self._sent(4 * self.transport.n_embd)  # one row a gate
            for i, seconds in enumerate(done.seconds):
                self.on_gate(Gate(i % 2), seconds, nbytes)  # ATTN, FFN of each layer in turn
            if done.last is not None:
                self.last_sum = done.last
            if done.error is not None:
                raise done.error


class RankState:
    """One rank's sessions (by the leader's u64 session id) over its engine half."""

    def __init__(self, engine: InferenceEngine, ctx_size: int) -> None:
        self.engine = engine
        self.ctx_size = ctx_size
        self.sessions: dict[int, Session] = {}
        self.exchange: TracingExchange | None = None
        # Commands that ran (or may have run) the model since the pair formed: both ranks
        # count the same commands, so the LOGITS and HASH of a step carry the same number.
        self.step = 0
        # Positions kept in sessions, by phase: prompt chunks are prefill, decoded tokens
        # (including accepted drafts) decode. Cumulative; the services export the deltas.
        self.kept = {"prefill": 0, "decode": 0}
        self._verifying: dict[int, tuple[int, int]] = {}  # session -> (pos before, rows)

    # -- the session table ---------------------------------------------------------------

    def reset(self) -> None:
        """Forget every session (a new pair starts from an empty table)."""
        self.sessions.clear()
        self._verifying.clear()
        self.step = 0

    def create(self, sid: int, ctx: int) -> None:
        if sid == 0 or sid in self.sessions:
            raise LockstepError(f"session {sid}: cannot create (id 0 or already open)")
        if not 0 < ctx <= self.ctx_size:
            raise LockstepError(f"session {sid}: context {ctx} outside [1, {self.ctx_size}]")
        self.sessions[sid] = self.engine.new_session(ctx)

    def destroy(self, sid: int) -> None:
        self._session(sid)
        del self.sessions[sid]
        self._verifying.pop(sid, None)

    def rewind(self, sid: int, pos: int) -> None:
        s = self._idle_session(sid)
        if not 0 <= pos <= s.pos:
            raise LockstepError(f"session {sid}: cannot rewind to {pos}, it holds {s.pos}")
        s.rewind(pos)

    def invalidate(self, sid: int) -> None:
        self._idle_session(sid).rewind(0)

    # -- commands that run the model -----------------------------------------------------

    def sync(self, sid: int, tokens: Sequence[int], checkpoint: Checkpoint) -> F32 | None:
        s = self._idle_session(sid)
        total = len(tokens)
        if not 0 < total <= s.ctx_size:
            raise LockstepError(f"session {sid}: SYNC of {total} tokens, context {s.ctx_size}")
        self._check_tokens(sid, tokens)
        self.step += 1
        common = common_prefix(s.tokens, tokens)
        # Keep the common prefix, but always evaluate at least the last token: its logits
        # are the point of a sync.
        s.rewind(min(common, total - 1))
        last: F32 | None = None
        while s.pos < total:
            end = checkpoint(s.pos, total)
            if end is None:
                return None
            if not s.pos < end <= total:
                raise LockstepError(
                    f"session {sid}: checkpoint chunk [{s.pos}, {end}) outside the sync of "
                    f"{total} tokens"
                )
            chunk = end - s.pos
            last = self._forward([(s, tokens[s.pos : end])], last_only=True)  # (1, V)
            self.kept["prefill"] += chunk
        assert last is not None
        return last

    def eval_batch(self, items: Sequence[tuple[int, int]]) -> F32:
        if not items:
            raise LockstepError("EVAL_BATCH with no items")
        rows = self._decode_rows(items, exclude=set())
        self.step += 1
        logits = self._forward(rows)
        self.kept["decode"] += len(rows)
        return logits

    def mixed(
        self, prefills: Sequence[tuple[int, Sequence[int]]], items: Sequence[tuple[int, int]]
    ) -> F32:
        """MIXED_BATCH (one prefill) and MIXED_PREFILLS: each prefill's chunk appended to its
        session, one token for each item, in one pass."""
        rows: list[tuple[Session, Sequence[int]]] = []
        seen: set[int] = set()
        for sid, prompt in prefills:
            if sid in seen:
                raise LockstepError(f"session {sid} listed twice in one batch")
            seen.add(sid)
            s = self._idle_session(sid)
            if not prompt or len(prompt) > s.free:
                raise LockstepError(
                    f"session {sid}: mixed prefill of {len(prompt)} tokens with "
                    f"{s.free} positions free"
                )
            self._check_tokens(sid, prompt)
            rows.append((s, prompt))
        rows += self._decode_rows(items, exclude=seen)
        self.step += 1
        # Each session's last row: each chunk's last, then the one row of each item.
        logits = self._forward(rows, last_only=True)  # (prefills + items, V)
        self.kept["prefill"] += sum(len(prompt) for _, prompt in prefills)
        self.kept["decode"] += len(items)
        return logits

    def verify(self, sid: int, block: Sequence[int]) -> F32:
        s = self._idle_session(sid)
        if not 1 <= len(block) <= min(DS4_TP_BATCH_MAX_ROWS, s.free):
            raise LockstepError(
                f"session {sid}: VERIFY of {len(block)} rows ({s.free} positions free, at "
                f"most {DS4_TP_BATCH_MAX_ROWS})"
            )
        self._check_tokens(sid, block)
        self.step += 1
        self._verifying[sid] = (s.pos, len(block))
        try:
            return self._forward([(s, block)])
        except BaseException:
            del self._verifying[sid]
            raise

    def commit(self, sid: int, mode: VerifyCommitMode, token_count: int) -> None:
        s = self._session(sid)
        if sid not in self._verifying:
            raise LockstepError(f"session {sid}: VERIFY_COMMIT without a VERIFY")
        pos0, rows = self._verifying.pop(sid)
        if not 1 <= token_count <= rows or (
            mode is VerifyCommitMode.COMMIT_FULL and token_count != rows
        ):
            raise LockstepError(
                f"session {sid}: {mode.name} of {token_count} rows of a {rows}-row block"
            )
        self.step += 1
        self.kept["decode"] += token_count
        if mode is VerifyCommitMode.COMMIT_PREFIX:
            s.rewind(pos0 + token_count)
        elif mode is VerifyCommitMode.ROLLBACK_REPLAY:
            kept = s.tokens[pos0 : pos0 + token_count]
            s.rewind(pos0)
            self._forward([(s, kept)], last_only=True)  # the caches only: logits unused

    # -- debug lockstep ------------------------------------------------------------------

    def state_hash(self) -> int:
        h = hashlib.blake2b(digest_size=8)
        h.update(_STEP.pack(self.step))
        for sid in sorted(self.sessions):
            h.update(_POS.pack(sid, self.sessions[sid].pos))
        last = self.exchange.last_sum if self.exchange is not None else None
        if last is not None:
            h.update(np.ascontiguousarray(last).data)
        return int.from_bytes(h.digest(), "little")

    # -- helpers -------------------------------------------------------------------------

    def _session(self, sid: int) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise LockstepError(f"session {sid} is not open")
        return s

    def _idle_session(self, sid: int) -> Session:
        if sid in self._verifying:
            raise LockstepError(f"session {sid} has a verify block awaiting its commit")
        return self._session(sid)

    def _check_tokens(self, sid: int, tokens: Sequence[int]) -> None:
        n_vocab = self.engine.cfg.n_vocab
        if any(not 0 <= t < n_vocab for t in tokens):
            raise LockstepError(f"session {sid}: a token id outside [0, {n_vocab})")

    def _decode_rows(
        self, items: Sequence[tuple[int, int]], exclude: set[int]
    ) -> list[tuple[Session, list[int]]]:
        rows: list[tuple[Session, list[int]]] = []
        seen = set(exclude)
        for sid, token in items:
            if sid in seen:
                raise LockstepError(f"session {sid} listed twice in one batch")
            seen.add(sid)
            s = self._idle_session(sid)
            if s.free < 1:
                raise LockstepError(f"session {sid} is full ({s.pos} of {s.ctx_size})")
            self._check_tokens(sid, [token])
            rows.append((s, [token]))
        return rows

    def _forward(
        self, rows: Sequence[tuple[Session, Sequence[int]]], *, last_only: bool = False
    ) -> F32:
        if self.exchange is None:
            raise LockstepError("no pair: the gate exchange is not connected")
        return self.engine.forward_rows(rows, self.exchange, last_only=last_only)


# -- the command table -----------------------------------------------------------------------


class Reply(Enum):
    """What the worker answers a command with."""

    NONE = "none"
    LOGITS = "logits"  # its half of the rows, when the command returned rows
    COMMAND_ACK = "command_ack"  # whether it could (a session's caches may not fit)


@dataclass(frozen=True)
class Command:
    """One command: the RankState call both ranks make for its frame, and the reply."""

    run: Callable[[RankState, Any, Checkpoint | None], F32 | None]
    reply: Reply


def _sync(st: RankState, f: Sync, checkpoint: Checkpoint | None) -> F32 | None:
    assert checkpoint is not None, "SYNC meets the peer at checkpoints"
    return st.sync(f.session_id, f.tokens, checkpoint)


def _eval(st: RankState, f: Eval, _: Checkpoint | None) -> F32:
    if f.seq != st.step + 1:
        raise LockstepError(f"EVAL of step {f.seq}, this rank is at step {st.step}")
    return st.eval_batch([(f.session_id, f.token)])


def _items(items: Sequence[BatchItem]) -> list[tuple[int, int]]:
    return [(i.session_id, i.token) for i in items]


COMMANDS: Mapping[FrameType, Command] = MappingProxyType({
    FrameType.SESSION_CREATE: Command(
        lambda st, f, _: st.create(f.session_id, f.ctx_size), Reply.COMMAND_ACK),
    FrameType.SESSION_DESTROY: Command(lambda st, f, _: st.destroy(f.session_id), Reply.NONE),
    FrameType.SYNC: Command(_sync, Reply.LOGITS),
    FrameType.EVAL: Command(_eval, Reply.LOGITS),
    FrameType.EVAL_BATCH: Command(lambda st, f, _: st.eval_batch(_items(f.items)), Reply.LOGITS),
    FrameType.MIXED_BATCH: Command(
        lambda st, f, _: st.mixed([(f.session_id, f.prompt)], _items(f.items)), Reply.LOGITS),
    FrameType.MIXED_PREFILLS: Command(
        lambda st, f, _: st.mixed([(p.session_id, p.tokens) for p in f.prefills],
                                  _items(f.items)), Reply.LOGITS),
    FrameType.VERIFY: Command(lambda st, f, _: st.verify(f.session_id, f.drafts), Reply.LOGITS),
    FrameType.VERIFY_COMMIT: Command(
        lambda st, f, _: st.commit(f.session_id, f.mode, f.token_count), Reply.NONE),
    FrameType.REWIND: Command(lambda st, f, _: st.rewind(f.session_id, f.pos), Reply.NONE),
    FrameType.INVALIDATE: Command(lambda st, f, _: st.invalidate(f.session_id), Reply.NONE),
})  # fmt: skip


def failure_kind(exc: BaseException) -> str:
    """The ``kind`` label of a pair failure in both ranks' failure metric."""
    if isinstance(exc, GateError):
        return "gate"
    if isinstance(exc, TpProtocolError):
        return "protocol"
    if isinstance(exc, LockstepError):
        return "lockstep"
    return "control"
