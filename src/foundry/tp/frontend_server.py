"""The leader's frontend server (asyncio loop side): many client connections, multiplexed ids.

It validates and admits GENERATE requests (handed to the engine thread with ``submit``),
answers STATUS_REQ at once, marks CANCELs, and writes the frames the engine thread posts
(``deliver``, called on the loop). A request is refused at once with UNAVAILABLE while no
worker is paired, and with OVERLOADED when ``max_sessions`` run and ``queue_size`` wait
already. Reading goes through the one stream driver (``transport.stream.AsyncStream``), with
the frame deadline.

A conversation is rendered (a chat template is a program from the model file) and tokenized
off the loop, and so is a plain prompt of more than ``INLINE_PROMPT_CHARS`` characters, in a
pool of ``PREPARE_THREADS`` threads with ``PREPARE_QUEUE`` requests waiting at most
(OVERLOADED past it), so that a costly conversation never stalls the other clients or the
STATUS answers the gateway's ``/health`` rests on. A conversation of more than
``max_messages`` messages, or one that renders to more than ``MAX_CHARS_PER_TOKEN`` characters
per token of context, is refused before it is tokenized; a template past its limits is
refused with its one-line ``ChatTemplateError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from foundry.model.infer.kv_cache import Session
from foundry.model.infer.sampling import make_rng
from foundry.model.text.chat import ChatTemplate, Message, chat_prompt
from foundry.model.text.chat_sandbox import ChatTemplateError
from foundry.model.text.vocab import Tokenizer
from foundry.obs.metrics import TpMetrics
from foundry.tp.policy import TextStream
from foundry.transport.stream import AsyncStream, FrameTimeout
from foundry.wire import frontend as fw

if TYPE_CHECKING:
    from foundry.tp.options import LeaderOptions

log = logging.getLogger("foundry.tp.leader")

# Bytes queued for a frontend client that does not read them: past this its connection is
# closed (and its generations cancelled) rather than buffered without end. A token frame is
# about 25 bytes, so this is some 150 000 tokens behind.
MAX_CLIENT_BACKLOG = 4 << 20
# Threads that render and tokenize prompts, and the requests that may wait for one: a prompt
# takes milliseconds, a hostile one up to the template's limits (seconds).
PREPARE_THREADS = 2
PREPARE_QUEUE = 64
# A plain prompt (no chat template to run) this short is tokenized on the loop: milliseconds
# at most, linear in its length.
INLINE_PROMPT_CHARS = 1024
# A prompt longer than this many characters per token of context cannot fit it (a token of a
# published vocabulary covers at most a few dozen characters); refused before tokenizing.
MAX_CHARS_PER_TOKEN = 64


@dataclass(eq=False)
class Conn:
    """One frontend connection (loop side)."""

    writer: asyncio.StreamWriter
    peer: str
    requests: dict[int, Request] = field(default_factory=dict)
    # Ids whose prompt the pool prepares -> whether CANCEL came meanwhile.
    preparing: dict[int, bool] = field(default_factory=dict)
    closed: bool = False

    def write(self, frame: fw.Frame) -> None:
        if self.closed or self.writer.is_closing():
            return
        self.writer.write(fw.encode(frame))
        backlog = self.writer.transport.get_write_buffer_size()
        if backlog > MAX_CLIENT_BACKLOG:
            log.warning(
                "frontend link: closing %s: it does not read what it asked for (%d "
                "bytes wait to be sent, the limit is %d)",
                self.peer,
                backlog,
                MAX_CLIENT_BACKLOG,
            )
            self.closed = True
            self.writer.transport.abort()


class Request:
    """A generation. ``cancelled`` and ``closed`` are written by the loop and read by the
    engine thread; everything below them belongs to the engine thread."""

    def __init__(
        self,
        conn: Conn,
        frame: fw.Generate,
        prompt: list[int],
        tokenizer: Tokenizer,
        template_stop: tuple[str, ...] = (),
    ) -> None:
        self.conn = conn
        self.frame = frame
        self.prompt = prompt
        self.t0 = time.monotonic()
        self.cancelled = False  # CANCEL arrived, or the client went away
        self.closed = False  # DONE or ERROR delivered: nothing more goes to the client
        self.sid = 0
        self.session: Session | None = None
        self.generated = 0
        self.next_token = -1  # sampled, not yet evaluated
        self.tokenizer = tokenizer  # the file's: its eog_ids end the generation
        # A chat's reply also ends where its template's turn ends without a token.
        self.stream = TextStream((*frame.stop, *template_stop), tokenizer.stream_decoder())
        self.rng = make_rng(frame.seed)
        self.step_tokens = 0

    @property
    def gone(self) -> bool:
        return self.cancelled or self.closed


class FrontendServer:
    """The frontend link's connections and the requests in flight on them (loop side)."""

    def __init__(
        self,
        options: LeaderOptions,
        ctx_size: int,
        metrics: TpMetrics,
        stopping: threading.Event,
        paired: Callable[[], bool],
        status: Callable[[int], fw.Status],
        submit: Callable[[Request], None],
        tokenizer: Tokenizer,
        template: ChatTemplate,
    ) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.template = template
        self.ctx_size = ctx_size
        self.metrics = metrics
        self._stopping = stopping
        self._paired = paired
        self._status = status
        self._submit = submit
        self.conns: set[Conn] = set()
        self.inflight = 0
        self.requests_served = 0
        self.preparing = 0  # requests whose prompt the pool renders and tokenizes
        self._pool = concurrent.futures.ThreadPoolExecutor(
            PREPARE_THREADS, thread_name_prefix="prompt"
        )

    def shutdown(self) -> None:
        """Stop the prompt pool (the requests it still holds are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close_all(self) -> None:
        for conn in list(self.conns):
            conn.closed = True
            conn.writer.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream: AsyncStream[fw.Frame] = AsyncStream(
            reader,
            writer,
            fw.FrontendDecoder(),
            frame_deadline_s=self.options.frame_deadline_s,
            read_chunk=65536,
        )
        conn = Conn(writer, stream.peer)
        self.conns.add(conn)
        try:
            while not conn.closed:
                if not self._on_frame(conn, await stream.recv()):
                    return
        except FrameTimeout as exc:
            log.warning("frontend link: %s; closed", exc)
        except fw.FrontendProtocolError as exc:
            log.warning("frontend link: closing %s: it sent bad bytes (%s)", conn.peer, exc)
            conn.write(fw.Error(0, fw.ErrorCode.BAD_REQUEST, f"protocol error: {exc}"))
        except (ConnectionError, ssl.SSLError):  # StreamClosed included: the client left
            pass
        finally:
            self._drop_conn(conn)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _on_frame(self, conn: Conn, frame: fw.Frame) -> bool:
        """Handle one client frame; False closes the connection."""
        if isinstance(frame, fw.Generate):
            self._on_generate(conn, frame)
        elif isinstance(frame, fw.Cancel):
            req = conn.requests.get(frame.request_id)
            if req is not None:
                req.cancelled = True
            if frame.request_id in conn.preparing:
                conn.preparing[frame.request_id] = True
        elif isinstance(frame, fw.StatusReq):
            conn.write(self._status(frame.request_id))
        else:
            log.warning(
                "frontend client %s sent %s, which only the leader sends; closing",
                conn.peer,
                frame.TYPE.name,
            )
            conn.write(
                fw.Error(
                    frame.request_id,
                    fw.ErrorCode.BAD_REQUEST,
                    f"unexpected {frame.TYPE.name} from a client",
                )
            )
            return False
        return True

    def _refuse(self, conn: Conn, request_id: int, code: fw.ErrorCode, message: str) -> None:
        self.metrics.requests.labels(code.name.lower()).inc()
        conn.write(fw.Error(request_id, code, message))

    def _on_generate(self, conn: Conn, g: fw.Generate) -> None:
        o = self.options
        rid = g.request_id
        bad = fw.ErrorCode.BAD_REQUEST
        if rid in conn.requests or rid in conn.preparing:
            return self._refuse(conn, rid, bad, f"request id {rid} is in use on this connection")
        if g.max_tokens < 1:
            return self._refuse(conn, rid, bad, f"max_tokens must be >= 1, got {g.max_tokens}")
        if not 0.0 <= g.temperature <= 100.0:
            return self._refuse(
                conn, rid, bad, f"temperature must be in [0, 100], got {g.temperature}"
            )
        if not 0.0 < g.top_p <= 1.0:
            return self._refuse(conn, rid, bad, f"top_p must be in (0, 1], got {g.top_p}")
        if len(g.messages) > o.max_messages:
            return self._refuse(
                conn,
                rid,
                bad,
                f"the conversation has {len(g.messages)} messages, more than {o.max_messages}",
            )
        if not g.messages and len(g.prompt) <= INLINE_PROMPT_CHARS:
            # No template to run and a few microseconds of tokenizing: at once, so requests
            # sent together reach the engine together (and batch) as they always did.
            prompt = self._prepare(g)
            if isinstance(prompt, str):
                return self._refuse(conn, rid, bad, prompt)
            return self._admit(conn, g, prompt, False)
        if self.preparing >= PREPARE_QUEUE:
            return self._refuse(
                conn,
                rid,
                fw.ErrorCode.OVERLOADED,
                f"{self.preparing} prompts wait to be rendered and tokenized",
            )
        conn.preparing[rid] = False  # the id is taken while its prompt is prepared
        self.preparing += 1
        future = asyncio.get_running_loop().run_in_executor(self._pool, self._prepare, g)
        future.add_done_callback(functools.partial(self._prepared, conn, g))

    def _prepare(self, g: fw.Generate) -> list[int] | str:
        """The prompt's token ids, or why it is refused (a pool thread)."""
        max_chars = self.ctx_size * MAX_CHARS_PER_TOKEN
        try:
            if not g.messages:
                if len(g.prompt) > max_chars:
                    return (
                        f"the prompt is {len(g.prompt)} characters, more than the context "
                        f"of {self.ctx_size} tokens can hold"
                    )
                return self.tokenizer.encode(g.prompt)
            return chat_prompt(
                self.template,
                self.tokenizer,
                [Message(r, c) for r, c in g.messages],
                content_specials=self.options.chat_content_specials,
                max_chars=max_chars,
            )
        except ChatTemplateError as exc:
            return str(exc)

    def _prepared(
        self, conn: Conn, g: fw.Generate, future: asyncio.Future[list[int] | str]
    ) -> None:
        """The pool's answer, back on the loop: admit the request or refuse it."""
        self.preparing -= 1
        rid = g.request_id
        cancelled = conn.preparing.pop(rid, True)
        if conn.closed or future.cancelled():
            return
        if (exc := future.exception()) is not None:
            log.error("frontend link: preparing request %d of %s failed: %r", rid, conn.peer, exc)
            return self._refuse(
                conn, rid, fw.ErrorCode.INTERNAL, f"the prompt could not be prepared: {exc!r}"
            )
        prompt = future.result()
        if isinstance(prompt, str):
            return self._refuse(conn, rid, fw.ErrorCode.BAD_REQUEST, prompt)
        self._admit(conn, g, prompt, cancelled)

    def _admit(self, conn: Conn, g: fw.Generate, prompt: list[int], cancelled: bool) -> None:
        o = self.options
        rid = g.request_id
        bad = fw.ErrorCode.BAD_REQUEST
        if len(prompt) > self.ctx_size:
            return self._refuse(
                conn,
                rid,
                bad,
                f"the prompt is {len(prompt)} tokens, longer than the context of {self.ctx_size}",
            )
        if self._stopping.is_set():
            return self._refuse(conn, rid, fw.ErrorCode.UNAVAILABLE, "the leader is shutting down")
        if not self._paired():
            return self._refuse(
                conn,
                rid,
                fw.ErrorCode.UNAVAILABLE,
                "the tensor-parallel worker is not connected; the leader waits for it to reconnect",
            )
        if self.inflight >= o.max_sessions + o.queue_size:
            return self._refuse(
                conn,
                rid,
                fw.ErrorCode.OVERLOADED,
                f"{self.inflight} generations in flight ({o.max_sessions} "
                f"running and {o.queue_size} waiting at most)",
            )
        req = Request(conn, g, prompt, self.tokenizer, self.template.stop if g.messages else ())
        req.cancelled = cancelled
        conn.requests[rid] = req
        self.inflight += 1
        self._submit(req)

    def deliver(self, batch: list[tuple[Request, fw.Frame]]) -> None:
        """Frames posted by the engine thread, in order (loop side)."""
        for req, frame in batch:
            if req.closed:
                continue
            if isinstance(frame, fw.Done | fw.Error):
                self._end(req, frame)
            req.conn.write(frame)

    def _end(self, req: Request, frame: fw.Done | fw.Error | None) -> None:
        """The request is over for the client (loop side; exactly once per request)."""
        req.closed = True
        req.conn.requests.pop(req.frame.request_id, None)
        self.inflight -= 1
        if isinstance(frame, fw.Done):
            self.requests_served += 1
            self.metrics.requests.labels(frame.reason.name.lower()).inc()
        elif isinstance(frame, fw.Error):
            self.metrics.requests.labels(fw.ErrorCode(frame.code).name.lower()).inc()
        else:
            self.metrics.requests.labels("cancelled").inc()

    def fail_inflight(self, message: str) -> None:
        """Every request in flight ends with UNAVAILABLE (loop side)."""
        for conn in list(self.conns):
            for req in list(conn.requests.values()):
                frame = fw.Error(req.frame.request_id, fw.ErrorCode.UNAVAILABLE, message)
                self._end(req, frame)
                conn.write(frame)

    def _drop_conn(self, conn: Conn) -> None:
        conn.closed = True
        self.conns.discard(conn)
        for req in list(conn.requests.values()):
            req.cancelled = True
            self._end(req, None)
