"""The pair's commands as the leader's engine runs them: each written once for every rank.

``PairCommands.run`` sends a command (``lockstep.COMMANDS``) to the workers, runs the same
``RankState`` call here and collects the workers' replies: the acknowledgements (a session
refused by one rank is closed again on those that opened it), the workers' blocks of the
logits joined to the leader's (or, for a command sent with ``row_tops``, their rows' greedy
tops combined with the leader's: ``picks``), the prefill checkpoints every rank agrees on, and
the debug state hash.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from foundry.model.infer.block_draw import BlockRows, DrawArgs, Pick, inverse_temperature
from foundry.model.infer.sampling import SamplingError, Tops, combine_tops, greedy_tops
from foundry.obs.metrics import TpMetrics
from foundry.tp.handshake import ACK_ACCEPTED
from foundry.tp.link import ControlLink, LinkError
from foundry.tp.lockstep import COMMANDS, Checkpoint, LockstepError, RankState, Reply, failure_kind
from foundry.transport.gates import GateError
from foundry.wire.tp import (
    PICK_LEADER_LAST,
    PICK_LEADER_WALK,
    PICK_NONE,
    PICK_TOKEN,
    PICK_TOP_K,
    CommandAck,
    ControlFrame,
    DrawRow,
    FrameType,
    Hash,
    Logits,
    MassRow,
    PickRow,
    RowDraw,
    RowMass,
    RowPicks,
    RowTops,
    SessionCreate,
    SessionDestroy,
    Stop,
    SyncCheckpoint,
    TpProtocolError,
)

F32 = npt.NDArray[np.float32]
# A sampled row's draw: (temperature, top_k, its uniform).
Draw = tuple[float, int, float]

# Pair failures end one pair, never the leader.
PAIR_FAILURES = (GateError, LinkError, TpProtocolError, LockstepError)


class PairLost(Exception):
    """The watcher saw the worker hang up."""


class SessionRefused(Exception):
    """A session could not be opened (no memory on a rank); the pair itself is fine."""


class HashMismatch(LockstepError):
    """The debug lockstep check found the ranks' states different."""


class PairCommands:
    """The leader's side of every command (see the module docstring); ``links`` are the
    workers' control links, rank 1 first, while a pair exists."""

    def __init__(
        self,
        state: RankState,
        worker_vocab: list[int],
        world: int,
        metrics: TpMetrics,
        prefill_chunk: int,
    ) -> None:
        self.state = state
        self.worker_vocab = worker_vocab  # each worker's vocabulary block: its LOGITS per row
        self.world = world
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.links: list[ControlLink] = []
        self._link_bytes: list[tuple[int, int]] = []  # (sent, received) at the last count

    def attach(self, links: list[ControlLink]) -> None:
        """The workers' control links of a new pair (``[]``: the pair ended)."""
        self.links = links
        self._link_bytes = [(0, 0)] * len(links)

    def count_bytes(self) -> None:
        """The control links' bytes since the last count, into the metrics."""
        m = self.metrics
        for i, link in enumerate(self.links):
            sent, received = self._link_bytes[i]
            m.control_bytes.labels("sent").inc(link.bytes_sent - sent)
            m.control_bytes.labels("received").inc(link.bytes_received - received)
            self._link_bytes[i] = (link.bytes_sent, link.bytes_received)

    def send_all(self, frame: ControlFrame | Hash | Stop) -> None:
        for link in self.links:
            link.send(frame)

    def checkpoint(self, sid: int, cancelled: Callable[[], bool]) -> Checkpoint:
        """A SYNC's checkpoints: before each chunk both ranks agree on it, or on stopping
        there when ``cancelled()`` (or the worker asks to)."""
        chunk = self.prefill_chunk

        def meet(current: int, total: int) -> int | None:
            end = min(current + chunk, total)
            stop = cancelled()
            mine = SyncCheckpoint(
                session_id=sid, point=end, current=current, total=total, requested=stop
            )
            self.send_all(mine)
            for link in self.links:
                theirs = link.expect(FrameType.SYNC_CHECKPOINT, "the worker's checkpoint")
                assert isinstance(theirs, SyncCheckpoint)
                if (theirs.session_id, theirs.point, theirs.current, theirs.total) != (
                    sid,
                    end,
                    current,
                    total,
                ):
                    raise LinkError(
                        f"the worker met checkpoint {theirs.current}->{theirs.point}/"
                        f"{theirs.total} of session {theirs.session_id}, expected {current}->"
                        f"{end}/{total} of session {sid}; the ranks are out of step"
                    )
                stop = stop or theirs.requested
            if self.world > 2:  # the verdict: every rank stops, or none does
                self.send_all(dataclasses.replace(mine, requested=stop))
            return None if stop else end

        return meet

    def run(
        self, frame: ControlFrame, checkpoint: Checkpoint | None = None, *, here: bool = True
    ) -> F32 | None:
        """One command on both ranks (``lockstep.COMMANDS``): send it to the worker, run the
        same RankState call here (unless done already, ``here=False``), collect the worker's
        reply. The full logits rows when the command returned rows, else None."""
        assert not frame.row_tops, "a command sent with row_tops is run by picks()"
        rows = self._command(frame, checkpoint, here)
        if rows is None:
            return None
        self.metrics.row_replies.labels("logits").inc()
        return self.join(rows)

    def picks(
        self,
        frame: ControlFrame,
        checkpoint: Checkpoint | None = None,
        draws: Sequence[Draw | None] = (),
    ) -> list[int | SamplingError] | None:
        """``run`` of a command sent with ``row_tops`` (every row greedy, or with
        ``row_draws`` drawn in its blocks, and read by nothing else): each row's token, or
        the SamplingError of a row that cannot give one, none of the workers' logits shipped.
        ``draws[i]``: row i's (temperature, top_k, uniform) where it is sampled (ROW_DRAWS:
        the pair only), None (or past the end) where it is greedy or unused. None when a
        SYNC was cancelled."""
        assert frame.row_tops, "picks() runs a command sent with row_tops"
        rows = self._command(frame, checkpoint, True)
        if rows is None:
            return None
        self.metrics.row_replies.labels("row_draws" if frame.row_draws else "row_tops").inc()
        blocks: list[Tops] = [greedy_tops(rows)]
        offset = rows.shape[1]
        for rank, (link, width) in enumerate(
            zip(self.links, self.worker_vocab, strict=True), start=1
        ):
            tops = self._reply(rank, link, FrameType.ROW_TOPS, "the worker's row tops")
            assert isinstance(tops, RowTops)
            if len(tops.tokens) != rows.shape[0] or max(tops.tokens, default=0) >= width:
                raise LinkError(
                    f"rank {rank} sent the tops of {len(tops.tokens)} rows (largest index "
                    f"{max(tops.tokens, default=0)}), expected {rows.shape[0]} rows of its "
                    f"{width} tokens"
                )
            blocks.append((tops.values, [t + offset if t >= 0 else t for t in tops.tokens]))
            offset += width
        picks = combine_tops(blocks)
        if frame.row_draws:
            assert frame.row_mass, "the leader draws with ROW_MASS (flags 0x07)"
            self._draw(rows, blocks, picks, draws)
        return picks

    def _draw(
        self,
        rows: F32,
        blocks: list[Tops],
        picks: list[int | SamplingError],
        draws: Sequence[Draw | None],
    ) -> None:
        """The sampled rows of a ROW_DRAWS command drawn with the worker (block_draw): their
        tokens in place of ``picks``' greedy ones. The ROW_DRAW goes before this rank's pass,
        its mass and count after it in ROW_MASS: the worker runs its pass meanwhile."""
        assert len(self.links) == 1, "ROW_DRAWS is the pair's"
        args = []
        for i, pick in enumerate(picks):
            draw = draws[i] if i < len(draws) else None
            if draw is None or isinstance(pick, SamplingError):
                args.append(DrawArgs(False))
                continue
            top = max(values[i] for values, tokens in blocks if tokens[i] >= 0)
            temperature, top_k, u = draw
            args.append(DrawArgs(True, top_k, top, inverse_temperature(temperature), u=u))
        mine, link, seq = BlockRows(rows), self.links[0], self.state.step
        link.send(RowDraw(rows=tuple(_draw_row(a) for a in args), seq=seq))
        args = mine.leader_pass(args)
        link.send(RowMass(rows=tuple(MassRow(a.acc, a.nonzero) for a in args), seq=seq))
        frame = self._reply(1, link, FrameType.ROW_PICKS, "the worker's picks")
        assert isinstance(frame, RowPicks)
        width = self.worker_vocab[0]
        if len(frame.rows) != len(args) or not all(
            _pick_fits(a, p, width) for a, p in zip(args, frame.rows, strict=False)
        ):
            raise LinkError(
                f"the worker sent {len(frame.rows)} picks for {len(args)} rows, or a pick that "
                f"does not answer its row's draw (indices below its {width} tokens, a kind "
                "the row can have); the ranks are out of step"
            )
        theirs = [Pick(p.kind, p.index, p.target, p.candidates) for p in frame.rows]
        for i, token in enumerate(mine.finish(args, theirs, rows.shape[1])):
            if args[i].draw and token < 0:
                raise LinkError(
                    f"row {i}'s draw gave no token from the worker's pick {frame.rows[i]}; "
                    "the ranks are out of step"
                )
            if args[i].draw:
                picks[i] = token

    def _command(
        self, frame: ControlFrame, checkpoint: Checkpoint | None, here: bool
    ) -> F32 | None:
        """Send ``frame`` to every worker, run it here, take the acknowledgements; this
        rank's logits rows when the command returns rows (their reply still to be read)."""
        command = COMMANDS[frame.TYPE]
        self.send_all(frame)
        rows = command.run(self.state, frame, checkpoint) if here else None
        if command.reply is Reply.COMMAND_ACK:
            refused, opened = [], []
            for rank, link in enumerate(self.links, start=1):
                ack = link.expect(
                    FrameType.COMMAND_ACK, f"the worker's {frame.TYPE.name} {frame.session_id}"
                )
                assert isinstance(ack, CommandAck)
                if ack.session_id != frame.session_id:
                    raise LinkError(
                        f"rank {rank} acknowledged session {ack.session_id}, "
                        f"expected {frame.session_id}; the ranks are out of step"
                    )
                if ack.status != ACK_ACCEPTED:
                    refused.append(f"rank {rank} (status {ack.status})")
                else:
                    opened.append(link)
            if refused:
                if isinstance(frame, SessionCreate):
                    # Those that opened it close it again: every rank's table stays the same.
                    for link in opened:
                        link.send(SessionDestroy(session_id=frame.session_id))
                raise SessionRefused(f"{', '.join(refused)} could not open a session; see its log")
        return rows if command.reply is Reply.LOGITS else None

    def _reply(
        self, rank: int, link: ControlLink, ftype: FrameType, what: str
    ) -> Logits | RowTops | RowPicks:
        """A worker's LOGITS, ROW_TOPS or ROW_PICKS of this step."""
        frame = link.expect(ftype, what)
        assert isinstance(frame, Logits | RowTops | RowPicks)
        if frame.seq != self.state.step:
            raise LinkError(
                f"rank {rank} sent the {ftype.name} of step {frame.seq}, this rank is "
                f"at step {self.state.step}; the ranks are out of step"
            )
        return frame

    def join(self, mine: F32) -> F32:
        """Our logits rows joined with every worker's block of the same rows, rank order."""
        rows = mine.shape[0]
        blocks = [mine]
        for rank, (link, width) in enumerate(
            zip(self.links, self.worker_vocab, strict=True), start=1
        ):
            frame = self._reply(rank, link, FrameType.LOGITS, "the worker's half of the logits")
            assert isinstance(frame, Logits)
            block = frame.array()
            if block.size != rows * width:
                raise LinkError(
                    f"rank {rank} sent {block.size} logits, expected {rows} rows of {width}"
                )
            blocks.append(block.reshape(rows, width))
        return np.concatenate(blocks, axis=1)

    def hash_check(self) -> None:
        mine = self.state.state_hash()
        self.send_all(Hash(seq=self.state.step, value=mine))
        for rank, link in enumerate(self.links, start=1):
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


def _draw_row(row: DrawArgs) -> DrawRow:
    """A row's ROW_DRAW entry, before the leader's pass: its acc and nonzero follow in
    ROW_MASS."""
    return DrawRow(int(row.draw), row.top_k, row.top, row.inv, 0.0, row.u, 0)


def _pick_fits(row: DrawArgs, pick: PickRow, width: int) -> bool:
    """Whether a worker's pick can answer the row's draw: none for a row not drawn; for a
    drawn one its token inside its block, the leader's walk or last token, or (a row cut to
    top_k) at most top_k candidates inside its block."""
    if not row.draw:
        return pick.kind == PICK_NONE
    if pick.kind == PICK_TOKEN:
        return pick.index < width
    if pick.kind == PICK_TOP_K:
        return (
            row.top_k > 0
            and len(pick.candidates) <= row.top_k
            and all(j < width for _, j in pick.candidates)
        )
    return pick.kind in (PICK_LEADER_WALK, PICK_LEADER_LAST)


def stop_links(links: list[ControlLink]) -> None:
    """STOP to every worker of a pair that ends; one already gone is let be."""
    for link in links:
        with contextlib.suppress(LinkError):
            link.send(Stop())


def pair_failure_kind(exc: BaseException) -> str:
    """The failures metric's label for what ended a pair."""
    if isinstance(exc, PairLost):
        return "hangup"
    if isinstance(exc, HashMismatch):
        return "hash"
    return failure_kind(exc)
