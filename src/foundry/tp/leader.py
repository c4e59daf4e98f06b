"""The leader rank (rank 0): serves generations and mirrors every session command to the worker.

This module wires the leader's jobs together, each in its own module: the frontend server
(``tp.frontend_server``), bring-up and pairing (``tp.bringup``), the engine loop
(``tp.engine``, executing) with its pure scheduler (``tp.scheduler``, the pass from
``tp.policy.plan_pass``) and speculative decoding's decisions (``tp.speculative``), its
commands to every rank (``tp.commands``) and the command table both ranks share
(``tp.lockstep.COMMANDS``).

Threads
-------
- **asyncio loop** (the caller's): the frontend link (``foundry.wire.frontend``), many client
  connections with multiplexed request ids. It validates and admits GENERATE requests, answers
  STATUS_REQ at once, marks CANCELs, and writes the frames the engine thread posts. A request is
  refused at once with UNAVAILABLE while no worker is paired, and with OVERLOADED when
  ``max_sessions`` run and ``queue_size`` wait already.
- **engine thread**: owns the rank-0 engine, the session table and the pair. Admitted requests
  reach it through a queue; tokens go back with ``loop.call_soon_threadsafe`` (one call per
  step). It runs the scheduler below, blocking in numpy and in the gate exchange.
- **acceptor thread** and short-lived **handshake threads**: accept connections on ``--listen``
  and bring pairs up (``foundry.tp.handshake``), after the TLS handshake when the leader has
  a TLS context; a formed pair is handed to the engine thread.
- **watcher thread**, one per pair: polls the control socket for hang-up, so a worker that dies
  fails the requests in flight at once, even while the engine thread waits inside a gate.

Scheduling (one step of the engine thread)
------------------------------------------
1. Cancelled requests end (DONE CANCELLED), their sessions are destroyed on both ranks.
2. Waiting requests are admitted up to ``max_sessions``. A request whose prompt begins with
   what a kept session holds (below) continues that session: REWIND both ranks to the shared
   prefix, and only the rest of the prompt is evaluated. Otherwise SESSION_CREATE, acknowledged
   by the worker.
3. One model pass (``policy.plan_pass``, a pure function of the queue lengths and the drafts):
   - one prefill with no session decoding: SYNC, in chunks of ``prefill_chunk`` tokens with a
     SYNC_CHECKPOINT before each, where a cancellation is agreed by both ranks;
   - prefills while sessions decode, or several with none decoding: the next chunk of as many
     waiting prompts as fit ``prefill_batch`` tokens plus one token for every decoding session
     (MIXED_BATCH for one prompt, MIXED_PREFILLS for several), so decoding never stalls behind
     a long prompt and prompts that arrive together are evaluated together;
   - one decoding session, greedy, speculative decoding on, and the drafter has a guess:
     VERIFY of the block (its token plus up to 7 drafts) then VERIFY_COMMIT;
   - otherwise EVAL (one session) or EVAL_BATCH (one token for every decoding session).
4. The worker's LOGITS half completes the rows; each session samples its next token and
   finishes on EOS, max tokens, a stop string or a full context (DONE, SESSION_DESTROY).
5. With ``hash_check``, both ranks compare a hash of their state (HASH).

Kept sessions
-------------
A finished generation's session stays open on both ranks, up to ``keep_sessions`` of them
(least recently used evicted: SESSION_DESTROY), so that a later prompt that starts the same way
(the next turn of a conversation: the whole conversation so far, then the new message) reuses
their KV cache instead of evaluating it again. ``foundry_tp_prompt_tokens_reused_total`` counts
what it saved.

Failure: any gate error, control-link error, bad bytes or lockstep violation ends the pair.
Every request in flight fails with UNAVAILABLE ("tensor-parallel worker lost: ...; the leader
waits for it to reconnect"), and the engine thread waits for the next pair. The token history
of every session (the kept ones, and the failed requests' prompts and tokens so far; at most
``keep_sessions``, the most recently used) is remembered, and once a worker pairs again the
leader re-syncs them from it: SESSION_CREATE and SYNC of the history on both ranks, one session
at a time while no request waits (a request that arrives cancels the re-sync at its next sync
checkpoint; it resumes when the pair is idle again). A client that retries its request, or sends
the next turn of its conversation, then finds its context already evaluated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from foundry.model.formats.gguf_meta import read_metadata
from foundry.model.kernels.quant import threads as kernel_threads
from foundry.model.shard.shares import norm_shares
from foundry.model.shard.slices import heads_note, stored_blocks
from foundry.model.shard.table import Gate
from foundry.model.text.chat import template_for
from foundry.model.text.vocab import load_tokenizer
from foundry.obs.metrics import TpMetrics
from foundry.tp.bringup import BringUp
from foundry.tp.engine import LeaderEngine
from foundry.tp.engine_tokens import LogitsHook
from foundry.tp.frontend_server import FrontendServer
from foundry.tp.handshake import RankModel, load_rank
from foundry.tp.options import LeaderOptions
from foundry.tp.speculative import SpecMode
from foundry.transport.listener import Listener
from foundry.wire import frontend as fw
from foundry.wire.tp import GateTransport

__all__ = ["Leader", "LeaderOptions", "LogitsHook"]

log = logging.getLogger("foundry.tp.leader")


class Leader:
    """Rank 0 of a pair; see the module docstring. ``start`` binds, ``close`` tears down."""

    def __init__(
        self,
        options: LeaderOptions,
        model: RankModel | None = None,
        metrics: TpMetrics | None = None,
        logits_hook: LogitsHook | None = None,
    ) -> None:
        self.options = options
        # Rank 0's slices: the engine holds them (and replaces them once for shares chosen at
        # pairing), so no reference is kept here.
        model = model or load_rank(
            options.model,
            0,
            options.ctx_size,
            options.expert_split,
            options.world_size,
            options.shares,
            options.lora,
        )
        if (model.weights.world, model.weights.shares) != (
            options.world_size,
            norm_shares(options.world_size, options.shares),
        ):
            raise ValueError(
                f"the leader's slices are for rank 0 of {model.weights.world} "
                f"with shares {model.weights.shares}, not of the options' "
                f"{options.world_size}"
            )
        self.identity = model.identity
        self.cfg = model.cfg
        metadata = read_metadata(options.model)
        self.tokenizer = load_tokenizer(metadata)  # GENERATE's prompt, TOKEN's text
        # GENERATE's messages become the prompt through it (CHAT, docs/protocol.md).
        self.chat_template = template_for(metadata, options.chat_template)
        log.info("chat template: %s", self.chat_template.name)
        self.metrics = metrics or TpMetrics()
        self.logits_hook = logits_hook
        self.port = 0  # the worker port, once bound
        self.frontend_port = 0
        self._stopping = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._frontend: asyncio.Server | None = None
        self._threads: list[threading.Thread] = []
        # The engine thread: scheduler, the pair's commands, sampling.
        self.engine = LeaderEngine(
            options,
            model,
            self.metrics,
            logits_hook,
            self._stopping,
            deliver=lambda batch: self._call_on_loop(self._frontend_server.deliver, batch),
            fail_inflight=lambda why: self._call_on_loop(self._frontend_server.fail_inflight, why),
            release=lambda: self._bringup.release(),
            on_crash=self.request_stop,
        )
        # The asyncio loop: the frontend link.
        self._frontend_server = FrontendServer(
            options,
            self.identity.ctx_size,
            self.metrics,
            self._stopping,
            lambda: self.engine.worker_connected,
            self.status,
            self.engine.submit,
            self.tokenizer,
            self.chat_template,
        )
        # The acceptor and handshake threads: the worker port.
        blocks = stored_blocks(model.weights.params)
        self._bringup = BringUp(
            options,
            self.identity,
            model.execution_mode,
            self.metrics,
            self._stopping,
            self.engine.new_pair,
            architecture=model.architecture,
            cfg=self.cfg,
            blocks=blocks,
        )
        held = heads_note(self.cfg, model.weights.shares, blocks)
        if held:  # the world's kv heads go in groups: which ranks hold none
            log.info("attention: %s", held)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        o = self.options
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._bringup.start()
        self.port = self._bringup.port
        frontend = Listener(
            "frontend link",
            self._frontend_server.serve,
            log=log,
            tls=o.tls,
            max_connections=o.frontend_max_connections,
            limit_flag="--frontend-max-connections",
        )
        self._frontend = await frontend.start(o.frontend_host, o.frontend_port)
        self.frontend_port = frontend.port
        for target, name in (
            (self._bringup.accept_loop, "tp-acceptor"),
            (self.engine.run, "tp-engine"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def request_stop(self) -> None:
        self._stopping.set()
        if self._stopped is not None:
            self._call_on_loop(self._stopped.set)

    async def wait_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    async def close(self) -> None:
        self._stopping.set()
        if self._frontend is not None:
            self._frontend.close()
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 10)
        self._frontend_server.fail_inflight("the leader is shutting down")
        self._frontend_server.close_all()
        self._frontend_server.shutdown()
        if self._frontend is not None:
            await self._frontend.wait_closed()
        self._bringup.close()

    # -- what the engine thread knows, read from outside -----------------------------------

    @property
    def spec_mode(self) -> SpecMode:
        """Read at every step: adjustable while serving (the speculative benchmark switches
        it)."""
        return self.engine.spec_mode

    @spec_mode.setter
    def spec_mode(self, mode: SpecMode) -> None:
        self.engine.spec_mode = mode

    @property
    def worker_connected(self) -> bool:
        return self.engine.worker_connected

    @property
    def crashed(self) -> bool:
        """The engine thread died of a bug; the leader stops."""
        return self.engine.crashed

    @property
    def drafted(self) -> int:
        return self.engine.drafted

    @property
    def accepted(self) -> int:
        return self.engine.accepted

    def gate_latencies(self) -> list[tuple[Gate, float]]:
        """The most recent gate exchanges (up to 65536), oldest first: gate and seconds."""
        return self.engine.gate_latencies()

    def status(self, request_id: int = 0) -> fw.Status:
        i, e = self.identity, self.engine
        threads = kernel_threads()
        return fw.Status(
            request_id,
            worker_connected=e.worker_connected,
            shared_memory=e.worker_connected and e.transport is GateTransport.SHM,
            active_sessions=e.running,
            tokens_generated=e.tokens_generated,
            n_layer=i.n_layer,
            n_embd=i.n_embd,
            n_vocab=i.n_vocab,
            ctx_size=i.ctx_size,
            model_bytes=i.gguf_bytes,
            model_id=i.model_id,
            spec_acceptance=e.accepted / e.drafted if e.drafted else 0.0,
            requests_served=self._frontend_server.requests_served,
            threads=threads,
            ranks=tuple(e.rank_status(threads)),
        )

    def _call_on_loop(self, fn: Callable[..., object], *args: object) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            loop.call_soon_threadsafe(fn, *args)
