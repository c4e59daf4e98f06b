"""Bearer-token authentication of gateway calls (a grpc.aio server interceptor).

A call must carry the metadata ``authorization: Bearer <token>`` with the gateway's token;
otherwise it ends with UNAUTHENTICATED before any servicer code runs. Exempt are the health
service (probes of Kubernetes, Docker and load balancers carry no secrets) and server
reflection: it serves only the API's schema, which is public in proto/, and tools such as
grpcurl use it to describe the API before they are given a token.

Both doors, this interceptor and the OpenAI HTTP routes, read the header with :func:`bearer`
and check it with :func:`check_bearer`, so they accept and refuse the same tokens.

The token travels in clear text unless the gateway runs with TLS (``--tls-cert/--tls-key``);
outside a trusted network use both.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

EXEMPT_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME})

MISSING = (
    "this gateway requires a bearer token: send the metadata 'authorization: Bearer <token>' "
    "(foundry ctl --token-file FILE)"
)
WRONG = "the bearer token was not accepted; use the token of the gateway's --token-file"


class TokenError(ValueError):
    """A token file that cannot serve as one (missing, empty, several lines)."""


def read_token(path: Path) -> str:
    """The token in ``path``: its one line, surrounding whitespace removed."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"cannot read the token file {path}: {exc}") from None
    token = text.strip()
    if not token:
        raise TokenError(f"the token file {path} is empty; put one line of secret text in it")
    if any(c.isspace() for c in token):
        raise TokenError(
            f"the token file {path} holds more than one word; a token is one line without spaces"
        )
    return token


def service_of(method: str) -> str:
    """``"/foundry.v1.TrainingService/StartTraining"`` -> ``"foundry.v1.TrainingService"``."""
    return method.lstrip("/").partition("/")[0]


def bearer(value: str | None) -> str | None:
    """The token of an ``Authorization`` value ``Bearer <token>``; None when it holds none.

    The one reading of the header for both doors (gRPC metadata and HTTP). RFC 6750 (2.1):
    ``credentials = "Bearer" 1*SP b64token``, and a b64token (token68) never holds a space, so
    the spaces around it belong to no token and are dropped, as HTTP drops a field value's own
    leading and trailing whitespace (RFC 9110, 5.5); the scheme is case-insensitive. An empty
    token is none.
    """
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class Refusal(enum.Enum):
    """Why :func:`check_bearer` refused: each door words it its own way."""

    MISSING = "missing"
    WRONG = "wrong"


def check_bearer(value: str | None, expected: str) -> Refusal | None:
    """The one bearer check of both doors: None when the ``Authorization`` value carries the
    ``expected`` token (compared in constant time), else why not."""
    given = bearer(value)
    if given is None:
        return Refusal.MISSING
    if not hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8")):
        return Refusal.WRONG
    return None


def authorization(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The ``authorization`` value of a call's metadata (None: absent)."""
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            return value
    return None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, token: str, exempt: frozenset[str] = EXEMPT_SERVICES) -> None:
        self._token = token
        self._exempt = exempt

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None if the call may proceed, else the message to refuse it with."""
        if service_of(method) in self._exempt:
            return None
        refusal = check_bearer(authorization(metadata), self._token)
        if refusal is None:
            return None
        return MISSING if refusal is Refusal.MISSING else WRONG

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        handler_call_details: Any,
    ) -> Any:
        refusal = self.check(handler_call_details.method, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if refusal is None or handler is None:
            return handler
        return _refusing(handler, refusal)


def _refusing(handler: Any, message: str) -> Any:
    """A handler of the same shape as ``handler`` that ends the call UNAUTHENTICATED."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        factory = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        factory = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        factory = grpc.unary_stream_rpc_method_handler
    else:
        factory = grpc.unary_unary_rpc_method_handler
    return factory(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
