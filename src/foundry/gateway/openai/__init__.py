"""The OpenAI-compatible HTTP API of the gateway: Starlette on uvicorn, in the gateway process.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streamed as
server-sent events ending in ``data: [DONE]`` with ``"stream": true``), ``GET /v1/models`` and
``GET /health``. Every generation goes through the gateway's one ``FrontendClient``, the same
as the gRPC ``Generate``: one connection, one path to the pair.

Theory of operation
-------------------
A request is read with a size limit (``MAX_BODY_BYTES``: 413 past it), validated by the
pydantic models of ``openai.protocol`` (400 naming the field), then admitted by
``gateway.admission.FairQueue``: at most ``max_active`` generations run on the pair,
``max_waiting`` more wait, served round-robin by client address so that one client's burst
cannot starve the others; past that a 429 with ``Retry-After``. Waiting, and everything after,
races the client's connection: a client that goes away while queued leaves the queue, one that
goes away while its tokens are being generated has its generation cancelled on the pair (CANCEL
on the frontend link, written as soon as the disconnect is read; the leader stops at the next
token).

The first event from the pair is awaited before the response starts, so a refusal (a prompt
longer than the context, an overloaded or absent pair) is an HTTP status, not a broken
stream. A stream then sends one chunk per batch of tokens that arrived together (as the gRPC
stream does: a client that keeps up gets one token per chunk, one that falls behind catches
up in fewer, larger chunks; nothing waits to fill a batch).

Status codes: 400 bad request (OpenAI's ``invalid_request_error``, ``param`` names the field),
401 missing or wrong bearer token, 404 unknown path or model (``model_not_found``), 405 wrong
method, 413 body too large, 429 queue full (``Retry-After``), 503 pair unavailable, 504 pair
timeout, 500 anything else (the detail goes to the log, never a traceback to the client).
Connections are bounded by ``openai.limits``: headers within ``header_timeout_s``,
``max_connections`` open at once.

The package, by job: ``protocol`` (the typed requests and responses, validated at the door),
``render`` (the chunks and bodies as bytes), ``routes`` (the endpoints over the frontend
client), ``server`` (uvicorn on its own listener), ``limits`` (the connection limits). The
admission queue is ``gateway.admission``'s, the bearer check ``gateway.auth``'s. Importers use
the names here.
"""

from foundry.gateway.openai.render import SSE_DONE, chat_logprobs, legacy_logprobs, sse
from foundry.gateway.openai.routes import (
    ClientGone,
    EventStream,
    HttpError,
    HttpOptions,
    OpenAIApi,
    http_error,
)
from foundry.gateway.openai.server import HttpServer

__all__ = [
    "SSE_DONE",
    "ClientGone",
    "EventStream",
    "HttpError",
    "HttpOptions",
    "HttpServer",
    "OpenAIApi",
    "chat_logprobs",
    "http_error",
    "legacy_logprobs",
    "sse",
]
