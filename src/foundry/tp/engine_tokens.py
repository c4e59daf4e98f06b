"""What the leader engine's logits become: each request's next token sampled from its row,
accepted with its logprobs, and the request finished (end of generation, ``max_tokens``, a
full context, a stop string) or failed alone where the logits cannot be sampled; the frames for
the clients gathered in a step and delivered once. Built on the sessions of every rank
(:class:`~foundry.tp.engine_sessions.EngineSessions`); ``LeaderEngine`` is built on it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from foundry.model.infer.block_draw import MAX_TOP_K
from foundry.model.infer.sampling import SamplingError, logprobs, sample_rows
from foundry.tp.commands import Draw
from foundry.tp.engine_sessions import EngineSessions
from foundry.tp.frontend_server import Request
from foundry.tp.lockstep import Checkpoint
from foundry.wire import frontend as fw
from foundry.wire.tp import ControlFrame

log = logging.getLogger("foundry.tp.leader")

F32 = npt.NDArray[np.float32]
# (request id, the full logits rows the leader sampled from in one step): a debug hook.
LogitsHook = Callable[[int, F32], None]


@dataclass(frozen=True)
class Drawn:
    """What a command's rows gave the leader: the full logits rows, or (sent with
    ``row_tops``) each row's greedy token already."""

    rows: F32 | None = None
    picks: list[int | SamplingError] | None = None


class EngineTokens(EngineSessions):
    """Sampling and delivery over the sessions (``LeaderEngine`` sets what it reads)."""

    logits_hook: LogitsHook | None
    draws_split: bool
    tokens_generated: int
    _outbox: list[tuple[Request, fw.Frame]]
    _deliver: Callable[[list[tuple[Request, fw.Frame]]], None]

    def _hook(self, req: Request, rows: F32) -> None:
        if self.logits_hook is not None:
            self.logits_hook(req.frame.request_id, rows)

    def _greedy(self, reqs: Sequence[Request]) -> bool:
        """Whether each of ``reqs`` takes its row's greedy token and nothing else reads the
        row (no logprobs, no logits hook; ``--no-row-tops`` not given): their command is then
        sent with ``row_tops``."""
        return (
            self.options.row_tops
            and self.logits_hook is None
            and all(r.frame.temperature == 0.0 and not r.frame.logprobs for r in reqs)
        )

    def _drawable(self, reqs: Sequence[Request]) -> bool:
        """Whether the sampled rows of ``reqs`` can be drawn in their blocks (ROW_DRAWS): the
        pair's worker block starts on a block of the masses, no request asks for logprobs or
        cuts by top_p, none cuts to more than MAX_TOP_K, no logits hook."""
        return (
            self.options.row_tops
            and self.draws_split
            and self.logits_hook is None
            and all(
                not r.frame.logprobs and r.frame.top_p >= 1.0 and r.frame.top_k <= MAX_TOP_K
                for r in reqs
            )
        )

    def _command(
        self,
        frame: ControlFrame,
        reqs: Sequence[Request],
        rows_of: Sequence[int],
        checkpoint: Checkpoint | None = None,
    ) -> Drawn | None:
        """Run a command whose rows ``reqs`` draw from (request i from row ``rows_of[i]``):
        with ``row_tops`` when every one of them is greedy (``_greedy``; the workers send
        their rows' tops, not their logits), with ``row_draws`` too when the sampled ones can
        be drawn in their blocks (``_drawable``: each row's token then comes back drawn), else
        for the full rows. None when a SYNC was cancelled."""
        self.metrics.passes.labels(frame.TYPE.name.lower()).inc()
        if self._greedy(reqs):
            picks = self.commands.picks(dataclasses.replace(frame, row_tops=True), checkpoint)
            return None if picks is None else Drawn(picks=picks)
        if self._drawable(reqs):
            draws: list[Draw | None] = [None] * (max(rows_of, default=-1) + 1)
            for req, i in zip(reqs, rows_of, strict=True):
                t = req.frame.temperature
                if t > 0.0:
                    draws[i] = (t, req.frame.top_k, req.rng.random())
            picks = self.commands.picks(
                dataclasses.replace(frame, row_tops=True, row_draws=True, row_mass=True),
                checkpoint,
                draws,
            )
            return None if picks is None else Drawn(picks=picks)
        rows = self.commands.run(frame, checkpoint)
        return None if rows is None else Drawn(rows=rows)

    def _take(self, reqs: Sequence[Request], drawn: Drawn, rows_of: Sequence[int]) -> None:
        """Each request's next token from row ``rows_of[i]`` of what its command gave."""
        if drawn.rows is not None:
            self._sample(list(reqs), [drawn.rows[i] for i in rows_of])
            return
        assert drawn.picks is not None
        for req, i in zip(reqs, rows_of, strict=True):
            pick = drawn.picks[i]
            assert req.session is not None
            if isinstance(pick, SamplingError):
                self._broken_logits(req, pick)
            else:
                self._accept(req, pick, req.session.pos, None)

    def _sample(self, reqs: list[Request], rows: list[F32]) -> None:
        """Each request's next token from its row of ``rows`` (in order; ``sample_rows``
        draws the rows on the kernels' threads), then accepted in order."""
        picks = sample_rows(
            [
                (
                    row,
                    r.frame.temperature,
                    r.frame.top_p,
                    r.rng if r.frame.temperature > 0 else None,
                    r.frame.top_k,
                )
                for r, row in zip(reqs, rows, strict=True)
            ]
        )
        for i, (req, pick) in enumerate(zip(reqs, picks, strict=True)):
            assert req.session is not None
            self._hook(req, rows[i][None])
            if isinstance(pick, SamplingError):
                self._broken_logits(req, pick)
            else:
                self._accept(req, pick, req.session.pos, rows[i])

    def _broken_logits(self, req: Request, exc: SamplingError) -> None:
        """Fail ``req`` alone: INTERNAL naming the model; its session is destroyed on both
        ranks (never kept: its KV cache may hold the same NaN or infinity)."""
        assert req.session is not None
        model = self.options.model.name
        message = (
            f"model {model} gave logits that cannot be sampled at position "
            f"{req.session.pos} ({exc}); its weights overflow on this input. This "
            "request failed; the pair serves on"
        )
        log.warning("request %d: %s", req.frame.request_id, message)
        self._post(req, fw.Error(req.frame.request_id, fw.ErrorCode.INTERNAL, message))
        self.sched.remove(req)
        if req.sid in self.state.sessions:
            self._destroy(req.sid)
        self._count_sessions()

    def _accept(self, req: Request, token: int, pos: int, row: F32 | None) -> bool:
        """Emit one generated token at position ``pos`` (``row``: the logits it was chosen
        from, None where the workers sent their rows' tops: no logprobs were asked for);
        False when the request ended."""
        assert req.session is not None
        if req.frame.logprobs:
            assert row is not None, "a request with logprobs is drawn from its full row"
            lp = logprobs(row, token, req.frame.top_logprobs)
            self._post(
                req,
                fw.Logprobs(
                    req.frame.request_id,
                    token,
                    lp.logprob,
                    req.tokenizer.token_bytes(token),
                    tuple((t, v, req.tokenizer.token_bytes(t)) for t, v in lp.top),
                ),
            )
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
        return fw.Done(
            req.frame.request_id, reason, len(req.prompt), req.generated, time.monotonic() - req.t0
        )

    def _finish(self, req: Request, reason: fw.DoneReason) -> None:
        self._post(req, self._done(req, reason))
        self.sched.remove(req)
        if req.sid in self.state.sessions:
            self._keep_or_destroy(req.sid)
        self._count_sessions()

    def _post(self, req: Request, frame: fw.Frame) -> None:
        self._outbox.append((req, frame))

    def _flush(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._deliver(batch)
