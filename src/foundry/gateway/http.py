"""The OpenAI-compatible HTTP API of the gateway: Starlette on uvicorn, in the gateway process.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streamed as
server-sent events ending in ``data: [DONE]`` with ``"stream": true``), ``GET /v1/models`` and
``GET /health``. Every generation goes through the gateway's one ``FrontendClient``, the same
as the gRPC ``Generate``: one connection, one path to the pair.

Theory of operation
-------------------
A request is read with a size limit (``MAX_BODY_BYTES``: 413 past it), validated by the
pydantic models of ``openai_protocol`` (400 naming the field), then admitted by a
:class:`FairQueue`: at most ``max_active`` generations run on the pair, ``max_waiting`` more
wait, served round-robin by client address so that one client's burst cannot starve the
others; past that a 429 with ``Retry-After``. Waiting, and everything after, races the client's
connection: a client that goes away while queued leaves the queue, one that goes away while
its tokens are being generated has its generation cancelled on the pair (CANCEL on the
frontend link, written as soon as the disconnect is read; the leader stops at the next token).

The first event from the pair is awaited before the response starts, so a refusal (a prompt
longer than the context, an overloaded or absent pair) is an HTTP status, not a broken
stream. A stream then sends one chunk per batch of tokens that arrived together (as the gRPC
stream does: a client that keeps up gets one token per chunk, one that falls behind catches
up in fewer, larger chunks; nothing waits to fill a batch).

Status codes: 400 bad request (OpenAI's ``invalid_request_error``, ``param`` names the field),
401 missing or wrong bearer token, 404 unknown path or model (``model_not_found``), 405 wrong
method, 413 body too large, 429 queue full (``Retry-After``), 503 pair unavailable, 504 pair
timeout, 500 anything else (the detail goes to the log, never a traceback to the client).
Connections are bounded by ``gateway.http_limits``: headers within ``header_timeout_s``,
``max_connections`` open at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pydantic
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from foundry.gateway.errors import (
    GatewayError,
    InvalidRequest,
)
from foundry.gateway.frontend_client import Event, FrontendClient, Generation
from foundry.gateway.http_limits import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    limited_h11,
)
from foundry.gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    usage,
)
from foundry.obs.metrics import GatewayMetrics
from foundry.wire.frontend import Done, DoneReason, Logprobs, Token

log = logging.getLogger("foundry.gateway.http")

T = TypeVar("T")
M = TypeVar("M", bound=pydantic.BaseModel)

# A request body past this is refused (413) before it is read whole: a frontend frame carries
# 1 MiB of prompt at most, and JSON escaping can double that.
MAX_BODY_BYTES = 2 << 20
# Tokens per stream chunk at most, when tokens pile up (as the gRPC stream's batches).
MAX_TOKENS_PER_CHUNK = 256
# Without max_tokens a generation runs until EOS, a stop string or a full context.
UNLIMITED_TOKENS = 0xFFFF_FFFF
# What a 429 tells the client to wait before retrying.
RETRY_AFTER_S = 1
# /health's budget for the pair's STATUS answer.
HEALTH_TIMEOUT_S = 2.0
# Status recorded for a request whose client went away first (nginx's convention).
CLIENT_GONE = 499

_FINISH = {
    DoneReason.MAX_TOKENS: "length",
    DoneReason.CONTEXT_FULL: "length",
    DoneReason.EOS: "stop",
    DoneReason.STOP_STRING: "stop",
    DoneReason.CANCELLED: "stop",
}


class HttpError(Exception):
    """A request answered with ``status`` and OpenAI's error JSON."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, kind, param, code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


def http_error(exc: GatewayError) -> HttpError:
    """A gateway error (the pair's refusal, a broken link) as the HTTP answer, by its gRPC
    status as the gRPC side answers it: the leader's own UNAVAILABLE (its worker lost, or
    not yet paired) is a 503 as much as a link the gateway cannot reach."""
    if isinstance(exc, InvalidRequest):
        return HttpError(400, exc.message)
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return HttpError(504, exc.message, "timeout_error")
    if exc.code == grpc.StatusCode.UNAVAILABLE:
        return HttpError(503, exc.message, "service_unavailable",
                         headers={"Retry-After": str(RETRY_AFTER_S)})
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return HttpError(429, exc.message, "rate_limit_error",
                         headers={"Retry-After": str(RETRY_AFTER_S)})
    return HttpError(500, exc.message, "server_error")


# ---------------------------------------------------------------------------- admission


class QueueFull(Exception):
    pass


class FairQueue:
    """At most ``max_active`` holders at a time; up to ``max_waiting`` more wait, and are let
    in round-robin by key (the client's address): each key's waiters in arrival order, the
    keys taking turns. Past ``max_waiting``, :meth:`acquire` raises QueueFull at once."""

    def __init__(self, max_active: int, max_waiting: int) -> None:
        if max_active < 1 or max_waiting < 0:
            raise ValueError(f"max_active must be >= 1 and max_waiting >= 0, got "
                             f"{max_active} and {max_waiting}")
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.active = 0
        self.waiting = 0
        self._queues: collections.OrderedDict[str, collections.deque[asyncio.Future[None]]] = (
            collections.OrderedDict())

    async def acquire(self, key: str) -> None:
        if self.active < self.max_active and not self.waiting:
            self.active += 1
            return
        if self.waiting >= self.max_waiting:
            raise QueueFull(f"{self.active} requests run and {self.waiting} wait, the most "
                            f"this gateway queues")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, collections.deque()).append(fut)
        self.waiting += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # let in just as it was cancelled
                self.release()
            else:
                self._forget(key, fut)
            raise

    def release(self) -> None:
        self.active -= 1
        while self.active < self.max_active and self._queues:
            key, queue = next(iter(self._queues.items()))
            fut = queue.popleft()
            self.waiting -= 1
            if queue:
                self._queues.move_to_end(key)  # the next key's turn
            else:
                del self._queues[key]
            if fut.done():  # cancelled, its waiter not yet woken to leave: skip it
                continue
            self.active += 1
            fut.set_result(None)

    def _forget(self, key: str, fut: asyncio.Future[None]) -> None:
        queue = self._queues.get(key)
        if queue is not None and fut in queue:
            queue.remove(fut)
            self.waiting -= 1
            if not queue:
                del self._queues[key]


# ---------------------------------------------------------------------------- responses


@dataclass
class _Lease:
    """An admitted generation: ``end`` (once) closes it (CANCEL unless it finished), frees
    its place in the queue and, for a stream, counts the request with ``status``."""

    generation: Generation
    queue: FairQueue
    metrics: GatewayMetrics
    name: str
    status: int = CLIENT_GONE  # until the stream reaches its end
    ended: bool = False

    def end(self, count: bool = True) -> None:
        if self.ended:
            return
        self.ended = True
        self.generation.close()
        self.queue.release()
        if count:
            self.metrics.http_requests.labels(self.name, str(self.status)).inc()


class EventStream(StreamingResponse):
    """A streamed response that watches the client while it streams: a disconnect stops the
    stream (and closes its generator, which cancels the generation) at once, not at the next
    write. ``on_close`` runs at the end whatever happened, even if the stream never began."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, gone):
                task.cancel()
            for task in (stream, gone):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            self.on_close()


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + (
        b"\n\n")


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class _Output:
    """What a generation has produced so far, as the response needs it."""

    chat: bool
    text: list[str] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    done: Done | None = None

    def take(self, events: list[Event]) -> tuple[str, list[Logprobs]]:
        """Fold in a batch of events; the text and logprobs they added."""
        text: list[str] = []
        lps: list[Logprobs] = []
        for e in events:
            if isinstance(e, Token):
                text.append(e.text)
            elif isinstance(e, Logprobs):
                lps.append(e)
            else:
                self.done = e
        piece = "".join(text)
        self.text.append(piece)
        self.logprobs += lps
        return piece, lps


def _token_text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def chat_logprobs(lps: list[Logprobs]) -> dict[str, Any]:
    return {"content": [
        {"token": _token_text(lp.token_bytes), "logprob": lp.logprob,
         "bytes": list(lp.token_bytes),
         "top_logprobs": [{"token": _token_text(raw), "logprob": v, "bytes": list(raw)}
                          for _, v, raw in lp.top]}
        for lp in lps
    ], "refusal": None}


def legacy_logprobs(lps: list[Logprobs], offset: int) -> dict[str, Any]:
    """The completions endpoint's logprobs: parallel lists (``offset``: the text before)."""
    tokens = [_token_text(lp.token_bytes) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token_text(raw): v for _, v, raw in lp.top} for lp in lps],
            "text_offset": offsets}


# ---------------------------------------------------------------------------- the app


@dataclass(frozen=True)
class HttpOptions:
    host: str
    port: int
    model_name: str = "foundry"
    max_active: int = 16
    max_waiting: int = 64
    token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    grace_s: float = 5.0
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # gateway.http_limits
    max_connections: int = DEFAULT_MAX_CONNECTIONS


class OpenAIApi:
    """The routes, over one frontend client."""

    def __init__(self, options: HttpOptions, client: FrontendClient,
                 metrics: GatewayMetrics) -> None:
        self.opt = options
        self.client = client
        self.metrics = metrics
        self.queue = FairQueue(options.max_active, options.max_waiting)
        metrics.http_queue_depth.set_function(lambda: self.queue.waiting)
        metrics.http_active.set_function(lambda: self.queue.active)
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._endpoint("chat", self.chat_completions),
                      methods=["POST"]),
                Route("/v1/completions", self._endpoint("completions", self.completions),
                      methods=["POST"]),
                Route("/v1/models", self._endpoint("models", self.models), methods=["GET"]),
                Route("/health", self._endpoint("health", self.health, public=True),
                      methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_exception},
        )

    # -- plumbing ----------------------------------------------------------------------

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers) if exc.headers else None
        return HttpError(exc.status_code, str(exc.detail), headers=headers).response()

    def _endpoint(self, name: str, handler: Callable[[Request], Awaitable[Response]],
                  public: bool = False) -> Callable[[Request], Awaitable[Response]]:
        """A route: the token check, errors as OpenAI's JSON, the request counted."""

        async def route(request: Request) -> Response:
            try:
                if not public:
                    self._authorize(request)
                response = await handler(request)
            except HttpError as exc:
                response = exc.response()
            except ClientGone:
                self.metrics.http_requests.labels(name, str(CLIENT_GONE)).inc()
                return Response(status_code=CLIENT_GONE)
            except GatewayError as exc:
                response = http_error(exc).response()
            except Exception:
                log.exception("HTTP %s failed", name)
                response = HttpError(500, "internal error in the gateway; see its log",
                                     "server_error").response()
            if not isinstance(response, EventStream):  # a stream counts itself when it ends
                self.metrics.http_requests.labels(name, str(response.status_code)).inc()
            return response

        return route

    def _authorize(self, request: Request) -> None:
        token = self.opt.token
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise HttpError(401, "this gateway requires a bearer token: send 'Authorization: "
                            "Bearer <token>' (the openai client's api_key)", code="missing_api_key")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise HttpError(401, "the bearer token was not accepted; use the token of the "
                            "gateway's --token-file", code="invalid_api_key")

    async def _body(self, request: Request, model: type[M]) -> M:
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise HttpError(400, f"Content-Length {declared!r} is not a number")
            if int(declared) > MAX_BODY_BYTES:
                raise HttpError(413, f"the body of {declared} bytes is larger than the "
                                f"{MAX_BODY_BYTES} this gateway reads")
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise HttpError(413, f"the body is larger than the {MAX_BODY_BYTES} bytes this "
                                "gateway reads")
            chunks.append(chunk)
        try:
            return model.model_validate_json(b"".join(chunks))
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"] if _is_field(p)) or None
            if first["type"] == "json_invalid":
                raise HttpError(400, f"the body is not valid JSON: {first['msg']}") from None
            where = f"'{param}': " if param else ""
            raise HttpError(400, f"{where}{first['msg']}", param=param) from None

    async def _unless_gone(self, request: Request, work: Coroutine[Any, Any, T]) -> T:
        """``work``, cancelled if the client disconnects first (ClientGone)."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if task.cancelled():
            raise ClientGone
        return task.result()

    # -- generation --------------------------------------------------------------------

    async def _admit(self, request: Request) -> None:
        try:
            await self.queue.acquire(request.client.host if request.client else "")
        except QueueFull as exc:
            raise HttpError(429, f"too many requests: {exc}; retry in {RETRY_AFTER_S} s",
                            "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)},
                            ) from None

    async def _begin(self, request: Request, generation: Generation) -> list[Event]:
        """Queue, send the GENERATE, await the first events (admitted: the caller releases)."""
        await self._admit(request)
        try:
            await generation.__aenter__()
            return await generation.batch(MAX_TOKENS_PER_CHUNK)
        except BaseException:
            generation.close()
            self.queue.release()
            raise

    async def _generate(self, request: Request, name: str, generation: Generation,
                        stream: bool, render: _Render) -> Response:
        t0 = time.monotonic()
        first = await self._unless_gone(request, self._begin(request, generation))
        ttft = time.monotonic() - t0
        self.metrics.http_ttft.labels(name).observe(ttft)
        lease = _Lease(generation, self.queue, self.metrics, name)
        out = _Output(chat=render.chat)
        if stream:
            body = self._stream(lease, first, out, render, t0, ttft)
            return EventStream(body, on_close=lease.end)
        try:
            await self._unless_gone(request, self._collect(generation, first, out))
        finally:
            lease.end(count=False)
        self._rate(name, out, t0, ttft)
        return JSONResponse(render.whole(out))

    async def _collect(self, generation: Generation, first: list[Event], out: _Output) -> None:
        out.take(first)
        while events := await generation.batch(MAX_TOKENS_PER_CHUNK):
            out.take(events)

    async def _stream(self, lease: _Lease, first: list[Event], out: _Output, render: _Render,
                      t0: float, ttft: float) -> AsyncIterator[bytes]:
        try:
            yield render.opening()
            events = first
            while events:
                piece, lps = out.take(events)
                if piece or lps:
                    yield render.chunk(piece, lps)
                if out.done is not None:
                    break
                try:
                    events = await lease.generation.batch(MAX_TOKENS_PER_CHUNK)
                except GatewayError as exc:  # the response has begun: report it in the stream
                    error = http_error(exc)
                    lease.status = error.status
                    yield sse(error.body)
                    break
            if out.done is not None:
                yield render.closing(out)
                lease.status = 200
                self._rate(lease.name, out, t0, ttft)
            yield SSE_DONE
        finally:
            lease.end()

    def _rate(self, name: str, out: _Output, t0: float, ttft: float) -> None:
        done = out.done
        if done is None:
            return
        self.metrics.http_tokens.labels(name).inc(done.generated_tokens)
        decode_s = time.monotonic() - t0 - ttft
        if done.generated_tokens > 1 and decode_s > 0:
            self.metrics.http_rate.labels(name).observe((done.generated_tokens - 1) / decode_s)

    # -- endpoints ---------------------------------------------------------------------

    def _served(self, model: str | None) -> None:
        """A request for a model this gateway does not serve gets OpenAI's 404 (no answer from
        another model); one that names none is served."""
        if model is not None and model != self.opt.model_name:
            raise HttpError(404, f"The model `{model}` does not exist or you do not have "
                            f"access to it; this gateway serves `{self.opt.model_name}`",
                            code="model_not_found")

    async def chat_completions(self, request: Request) -> Response:
        req = await self._body(request, ChatCompletionRequest)
        self._served(req.model)
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise HttpError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        generation = self._generation(
            req.token_limit(), req.temperature, req.top_p, req.top_k, req.seed,
            req.stop_strings(), logprobs=req.logprobs, top_logprobs=top,
            messages=tuple((m.role, m.text()) for m in req.messages),
        )
        render = _Render(True, self._id("chatcmpl"), self.opt.model_name, req.include_usage(),
                         req.logprobs)
        return await self._generate(request, "chat", generation, req.stream, render)

    async def completions(self, request: Request) -> Response:
        req = await self._body(request, CompletionRequest)
        self._served(req.model)
        generation = self._generation(
            req.token_limit(), req.temperature, req.top_p, req.top_k, req.seed,
            req.stop_strings(), logprobs=req.logprobs is not None,
            top_logprobs=req.logprobs or 0, prompt=req.prompt_text(),
        )
        render = _Render(False, self._id("cmpl"), self.opt.model_name, req.include_usage(),
                         req.logprobs is not None)
        return await self._generate(request, "completions", generation, req.stream, render)

    def _generation(self, max_tokens: int | None, temperature: float, top_p: float,
                    top_k: int, seed: int | None, stop: tuple[str, ...], *, logprobs: bool,
                    top_logprobs: int, prompt: str = "",
                    messages: tuple[tuple[str, str], ...] = ()) -> Generation:
        return self.client.generate(
            prompt, UNLIMITED_TOKENS if max_tokens is None else max_tokens, temperature,
            top_p, secrets.randbits(64) if seed is None else seed % (1 << 64), stop,
            top_k=max(top_k, 0), logprobs=logprobs, top_logprobs=top_logprobs,
            messages=messages,
        )

    def _id(self, prefix: str) -> str:
        return f"{prefix}-{secrets.token_hex(12)}"

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.opt.model_name, "object": "model", "created": self.created,
             "owned_by": "foundry"},
        ]})

    async def health(self, request: Request) -> Response:
        try:
            status = await self.client.status(HEALTH_TIMEOUT_S)
        except GatewayError as exc:
            return JSONResponse({"status": "unavailable", "detail": exc.message}, 503)
        if not status.worker_connected:
            return JSONResponse({"status": "unavailable",
                                 "detail": "the TP leader's worker rank is not connected"}, 503)
        return JSONResponse({"status": "ok"})


# The tags pydantic puts in an error's location for the member of a union that failed.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _is_field(part: int | str) -> bool:
    """Whether a part of a pydantic error location names a field or an index (not a type)."""
    return isinstance(part, int) or (part.isidentifier() and part not in _TYPE_TAGS)


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has disconnected (the body was read already)."""
    while True:  # ends with the connection: uvicorn answers http.disconnect then
        if (await receive())["type"] == "http.disconnect":
            return


@dataclass
class _Render:
    """The JSON of one endpoint's responses (chat or completions), streamed or whole."""

    chat: bool
    id: str
    model: str
    include_usage: bool
    logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = 0  # text sent so far (legacy logprobs' text_offset)
    _around: tuple[bytes, bytes] | None = None  # a text chunk's bytes before and after the text

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else (
            "text_completion")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def _logprobs(self, lps: list[Logprobs], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return chat_logprobs(lps) if self.chat else legacy_logprobs(lps, offset)

    def opening(self) -> bytes:
        if not self.chat:
            return b""
        return sse(self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}], True))

    def _choice(self, piece: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        if self.chat:
            return {"index": 0, "delta": {"content": piece}, "logprobs": logprobs,
                    "finish_reason": None}
        return {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": None}

    def chunk(self, piece: str, lps: list[Logprobs]) -> bytes:
        logprobs = self._logprobs(lps, self._offset)
        self._offset += len(piece)
        if logprobs is not None:
            return sse(self._envelope([self._choice(piece, logprobs)], True))
        # The hot path, once per batch of tokens: only the text varies, so the chunk is the
        # JSON around it (rendered once per stream) with the text's JSON string in between.
        if self._around is None:
            marker = "\u2063piece\u2063"
            head, _, tail = sse(self._envelope([self._choice(marker, None)], True)).rpartition(
                json.dumps(marker, ensure_ascii=False).encode())
            self._around = (head, tail)
        head, tail = self._around
        return head + json.dumps(piece, ensure_ascii=False).encode() + tail

    def closing(self, out: _Output) -> bytes:
        assert out.done is not None
        finish = _FINISH[out.done.reason]
        if self.chat:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
        parts = [sse(self._envelope([choice], True))]
        if self.include_usage:
            tail = self._envelope([], True)
            tail["usage"] = usage(out.done.prompt_tokens, out.done.generated_tokens)
            parts.append(sse(tail))
        return b"".join(parts)

    def whole(self, out: _Output) -> dict[str, Any]:
        done = out.done
        assert done is not None
        text = "".join(out.text)
        logprobs = self._logprobs(out.logprobs, 0)
        finish = _FINISH[done.reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        body = self._envelope([choice], False)
        body["usage"] = usage(done.prompt_tokens, done.generated_tokens)
        return body


# ---------------------------------------------------------------------------- the server


class _Server(uvicorn.Server):
    """uvicorn inside the gateway's own loop: the gateway handles the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen for HTTP on {host}:{port} ({exc.strerror or exc}); is "
                      "another process using the port?") from None
    sock.setblocking(False)
    return sock


class HttpServer:
    """The OpenAI-compatible API on its own listener (``--http-listen``)."""

    def __init__(self, options: HttpOptions, client: FrontendClient,
                 metrics: GatewayMetrics) -> None:
        if (options.tls_cert is None) != (options.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key")
        self.opt = options
        self.api = OpenAIApi(options, client, metrics)
        self.port = 0
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        sock = _bind(self.opt.host, self.opt.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.api.app, http=limited_h11(self.opt.header_timeout_s, self.opt.max_connections),
            lifespan="off", log_level="warning", access_log=False,
            ssl_certfile=self.opt.tls_cert, ssl_keyfile=self.opt.tls_key,
            timeout_graceful_shutdown=max(1, round(self.opt.grace_s)),
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        # uvicorn's startup is a few loop turns; it sets ``started`` or the task ends.
        for _ in range(1000):
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if not self._server.started:
            await self.stop()
            raise OSError(f"the HTTP server on {self.opt.host}:{self.port} did not start")
        return self.port

    async def stop(self) -> None:
        server, task = self._server, self._task
        if server is None or task is None:
            return
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await task
        self._server = self._task = None
