"""The OpenAI-compatible routes over one frontend client (:class:`OpenAIApi`): the body read
with its limit and validated by ``openai.protocol``, the bearer check, admission
(``gateway.admission``), the generation, streamed or whole, and the status codes of the
package's docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pydantic
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from foundry.gateway.admission import FairQueue, QueueFull
from foundry.gateway.auth import Refusal, check_bearer
from foundry.gateway.errors import (
    GatewayError,
    InvalidRequest,
)
from foundry.gateway.frontend_client import Event, FrontendClient, Generation
from foundry.gateway.openai.limits import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
)
from foundry.gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from foundry.gateway.openai.render import SSE_DONE, _Output, _Render, sse
from foundry.obs.metrics import GatewayMetrics

log = logging.getLogger("foundry.gateway.openai")

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


class HttpError(Exception):
    """A request answered with ``status`` and OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
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
        return HttpError(
            503, exc.message, "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return HttpError(
            429, exc.message, "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    return HttpError(500, exc.message, "server_error")


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
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # openai.limits
    max_connections: int = DEFAULT_MAX_CONNECTIONS


class OpenAIApi:
    """The routes, over one frontend client."""

    def __init__(
        self, options: HttpOptions, client: FrontendClient, metrics: GatewayMetrics
    ) -> None:
        self.opt = options
        self.client = client
        self.metrics = metrics
        self.queue = FairQueue(options.max_active, options.max_waiting)
        metrics.http_queue_depth.set_function(lambda: self.queue.waiting)
        metrics.http_active.set_function(lambda: self.queue.active)
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route(
                    "/v1/chat/completions",
                    self._endpoint("chat", self.chat_completions),
                    methods=["POST"],
                ),
                Route(
                    "/v1/completions",
                    self._endpoint("completions", self.completions),
                    methods=["POST"],
                ),
                Route("/v1/models", self._endpoint("models", self.models), methods=["GET"]),
                Route(
                    "/health", self._endpoint("health", self.health, public=True), methods=["GET"]
                ),
            ],
            exception_handlers={HTTPException: self._http_exception},
        )

    # -- plumbing ----------------------------------------------------------------------

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers) if exc.headers else None
        return HttpError(exc.status_code, str(exc.detail), headers=headers).response()

    def _endpoint(
        self, name: str, handler: Callable[[Request], Awaitable[Response]], public: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
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
                response = HttpError(
                    500, "internal error in the gateway; see its log", "server_error"
                ).response()
            if not isinstance(response, EventStream):  # a stream counts itself when it ends
                self.metrics.http_requests.labels(name, str(response.status_code)).inc()
            return response

        return route

    def _authorize(self, request: Request) -> None:
        token = self.opt.token
        if token is None:
            return
        refusal = check_bearer(request.headers.get("authorization"), token)
        if refusal is Refusal.MISSING:
            raise HttpError(
                401,
                "this gateway requires a bearer token: send 'Authorization: "
                "Bearer <token>' (the openai client's api_key)",
                code="missing_api_key",
            )
        if refusal is Refusal.WRONG:
            raise HttpError(
                401,
                "the bearer token was not accepted; use the token of the gateway's --token-file",
                code="invalid_api_key",
            )

    async def _body(self, request: Request, model: type[M]) -> M:
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise HttpError(400, f"Content-Length {declared!r} is not a number")
            if int(declared) > MAX_BODY_BYTES:
                raise HttpError(
                    413,
                    f"the body of {declared} bytes is larger than the "
                    f"{MAX_BODY_BYTES} this gateway reads",
                )
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise HttpError(
                    413, f"the body is larger than the {MAX_BODY_BYTES} bytes this gateway reads"
                )
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
            raise HttpError(
                429,
                f"too many requests: {exc}; retry in {RETRY_AFTER_S} s",
                "rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
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

    async def _generate(
        self, request: Request, name: str, generation: Generation, stream: bool, render: _Render
    ) -> Response:
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
            await self._unless_gone(request, self._collect(name, generation, first, out))
        finally:
            lease.end(count=False)
        self._rate(name, out, t0, ttft)
        return JSONResponse(render.whole(out))

    async def _collect(
        self, name: str, generation: Generation, first: list[Event], out: _Output
    ) -> None:
        out.take(first)
        while events := await generation.batch(MAX_TOKENS_PER_CHUNK):
            self.metrics.observe_gaps(name, generation.gaps)
            out.take(events)

    async def _stream(
        self,
        lease: _Lease,
        first: list[Event],
        out: _Output,
        render: _Render,
        t0: float,
        ttft: float,
    ) -> AsyncIterator[bytes]:
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
                    self.metrics.observe_gaps(lease.name, lease.generation.gaps)
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
            raise HttpError(
                404,
                f"The model `{model}` does not exist or you do not have "
                f"access to it; this gateway serves `{self.opt.model_name}`",
                code="model_not_found",
            )

    async def chat_completions(self, request: Request) -> Response:
        req = await self._body(request, ChatCompletionRequest)
        self._served(req.model)
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise HttpError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        generation = self._generation(
            req.token_limit(),
            req.temperature,
            req.top_p,
            req.top_k,
            req.seed,
            req.stop_strings(),
            logprobs=req.logprobs,
            top_logprobs=top,
            messages=tuple((m.role, m.text()) for m in req.messages),
        )
        render = _Render(
            True, self._id("chatcmpl"), self.opt.model_name, req.include_usage(), req.logprobs
        )
        return await self._generate(request, "chat", generation, req.stream, render)

    async def completions(self, request: Request) -> Response:
        req = await self._body(request, CompletionRequest)
        self._served(req.model)
        generation = self._generation(
            req.token_limit(),
            req.temperature,
            req.top_p,
            req.top_k,
            req.seed,
            req.stop_strings(),
            logprobs=req.logprobs is not None,
            top_logprobs=req.logprobs or 0,
            prompt=req.prompt_text(),
        )
        render = _Render(
            False,
            self._id("cmpl"),
            self.opt.model_name,
            req.include_usage(),
            req.logprobs is not None,
        )
        return await self._generate(request, "completions", generation, req.stream, render)

    def _generation(
        self,
        max_tokens: int | None,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        stop: tuple[str, ...],
        *,
        logprobs: bool,
        top_logprobs: int,
        prompt: str = "",
        messages: tuple[tuple[str, str], ...] = (),
    ) -> Generation:
        return self.client.generate(
            prompt,
            UNLIMITED_TOKENS if max_tokens is None else max_tokens,
            temperature,
            top_p,
            secrets.randbits(64) if seed is None else seed % (1 << 64),
            stop,
            top_k=max(top_k, 0),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            messages=messages,
        )

    def _id(self, prefix: str) -> str:
        return f"{prefix}-{secrets.token_hex(12)}"

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.opt.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "foundry",
                    },
                ],
            }
        )

    async def health(self, request: Request) -> Response:
        try:
            status = await self.client.status(HEALTH_TIMEOUT_S)
        except GatewayError as exc:
            return JSONResponse({"status": "unavailable", "detail": exc.message}, 503)
        if not status.worker_connected:
            return JSONResponse(
                {"status": "unavailable", "detail": "the TP leader's worker rank is not connected"},
                503,
            )
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
