"""The leader's frontend server (asyncio loop side): many client connections, multiplexed ids.

It validates and admits GENERATE requests (handed to the engine thread with ``submit``),
answers STATUS_REQ at once, marks CANCELs, and writes the frames the engine thread posts
(``deliver``, called on the loop). A request is refused at once with UNAVAILABLE while no
worker is paired, and with OVERLOADED when ``max_sessions`` run and ``queue_size`` wait
already. Reading goes through the one stream driver (``transport.stream.AsyncStream``), with
the frame deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from foundry.model.infer.inference import Session
from foundry.model.infer.sampling import make_rng
from foundry.model.text.chat import ChatTemplate, ChatTemplateError, Message, prompt_text
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


@dataclass(eq=False)
class Conn:
    """One frontend connection (loop side)."""

    writer: asyncio.StreamWriter
    peer: str
    requests: dict[int, Request] = field(default_factory=dict)
    closed: bool = False

    def write(self, frame: fw.Frame) -> None:
        if self.closed or self.writer.is_closing():
            return
        self.writer.write(fw.encode(frame))
        backlog = self.writer.transport.get_write_buffer_size()
        if backlog > MAX_CLIENT_BACKLOG:
            log.warning("frontend link: closing %s: it does not read what it asked for (%d "
                        "bytes wait to be sent, the limit is %d)", self.peer, backlog,
                        MAX_CLIENT_BACKLOG)
            self.closed = True
            self.writer.transport.abort()


class Request:
    """A generation. ``cancelled`` and ``closed`` are written by the loop and read by the
    engine thread; everything below them belongs to the engine thread."""

    def __init__(
        self, conn: Conn, frame: fw.Generate, prompt: list[int], tokenizer: Tokenizer,
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

    def close_all(self) -> None:
        for conn in list(self.conns):
            conn.closed = True
            conn.writer.close()

    async def serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        stream: AsyncStream[fw.Frame] = AsyncStream(
            reader, writer, fw.FrontendDecoder(), frame_deadline_s=self.options.frame_deadline_s,
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
        elif isinstance(frame, fw.StatusReq):
            conn.write(self._status(frame.request_id))
        else:
            log.warning("frontend client %s sent %s, which only the leader sends; closing",
                        conn.peer, frame.TYPE.name)
            conn.write(fw.Error(frame.request_id, fw.ErrorCode.BAD_REQUEST,
                                f"unexpected {frame.TYPE.name} from a client"))
            return False
        return True

    def _refuse(self, conn: Conn, request_id: int, code: fw.ErrorCode, message: str) -> None:
        self.metrics.requests.labels(code.name.lower()).inc()
        conn.write(fw.Error(request_id, code, message))

    def _on_generate(self, conn: Conn, g: fw.Generate) -> None:
        o = self.options
        rid = g.request_id
        bad = fw.ErrorCode.BAD_REQUEST
        if rid in conn.requests:
            return self._refuse(conn, rid, bad, f"request id {rid} is in use on this connection")
        if g.max_tokens < 1:
            return self._refuse(conn, rid, bad, f"max_tokens must be >= 1, got {g.max_tokens}")
        if not 0.0 <= g.temperature <= 100.0:
            return self._refuse(conn, rid, bad, f"temperature must be in [0, 100], got "
                                                f"{g.temperature}")
        if not 0.0 < g.top_p <= 1.0:
            return self._refuse(conn, rid, bad, f"top_p must be in (0, 1], got {g.top_p}")
        text = g.prompt
        if g.messages:
            try:
                text = prompt_text(self.template, [Message(r, c) for r, c in g.messages])
            except ChatTemplateError as exc:
                return self._refuse(conn, rid, bad, str(exc))
        # A rendered conversation holds the template's turn markers as text: they are the
        # model's special tokens (<start_of_turn>, <|im_start|>), so they are parsed as such.
        prompt = self.tokenizer.encode(text, parse_special=bool(g.messages))
        if len(prompt) > self.ctx_size:
            return self._refuse(conn, rid, bad, f"the prompt is {len(prompt)} tokens, longer "
                                                f"than the context of {self.ctx_size}")
        if self._stopping.is_set():
            return self._refuse(conn, rid, fw.ErrorCode.UNAVAILABLE,
                                "the leader is shutting down")
        if not self._paired():
            return self._refuse(conn, rid, fw.ErrorCode.UNAVAILABLE,
                                "the tensor-parallel worker is not connected; the leader waits "
                                "for it to reconnect")
        if self.inflight >= o.max_sessions + o.queue_size:
            return self._refuse(conn, rid, fw.ErrorCode.OVERLOADED,
                                f"{self.inflight} generations in flight ({o.max_sessions} "
                                f"running and {o.queue_size} waiting at most)")
        req = Request(conn, g, prompt, self.tokenizer,
                      self.template.stop if g.messages else ())
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
