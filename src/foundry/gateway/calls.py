"""Every gateway call, observed and its failures answered the same way (a server interceptor).

It wraps each method handler so that:

- a ``GatewayError`` raised by a servicer ends the call with that error's status code and its
  message (the servicers never touch status codes themselves);
- any other exception ends it with INTERNAL and is logged with its traceback (a bug here);
- a request that does not decode (bytes that are not the method's message, a string field
  that is not UTF-8) ends the call INVALID_ARGUMENT saying so, with no traceback in the log
  (grpc's own answer is UNKNOWN and a logged traceback per call);
- ``foundry_gateway_requests_total{method,code}`` and
  ``foundry_gateway_request_duration_seconds{method}`` record the outcome, including calls the
  authentication interceptor refused (this interceptor sits outside it).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from foundry.gateway.errors import GatewayError
from foundry.obs.metrics import GatewayMetrics

log = logging.getLogger("foundry.gateway")


class CallInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        handler_call_details: Any,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.lstrip("/")
        if not handler.request_streaming and handler.request_deserializer is not None:
            handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        if handler.request_streaming and handler.response_streaming:
            return handler._replace(stream_stream=self._streaming(method, handler.stream_stream))
        if handler.request_streaming:
            return handler._replace(stream_unary=self._unary(method, handler.stream_unary))
        if handler.response_streaming:
            return handler._replace(unary_stream=self._streaming(method, handler.unary_stream))
        return handler._replace(unary_unary=self._unary(method, handler.unary_unary))

    def _unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                await _refuse_undecodable(request, context, method)
                return await behavior(request, context)
            except BaseException as exc:
                code = await _answer(exc, context, method)
                raise
            finally:
                self._record(method, _final_code(context, code), started)

        return unary

    def _streaming(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        # A coroutine that writes each response, not an async generator that yields it: grpc
        # drops a response generator it cancels (the caller cancelled, or the deadline passed)
        # without closing it, so the generator's cleanup, CANCEL to the pair included, would
        # wait for the garbage collector, and then run as an unexpected GeneratorExit. Here the
        # cancellation arrives as CancelledError in this coroutine and is handled at once.
        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> None:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            if isinstance(request, Undecodable):
                try:
                    await _refuse_undecodable(request, context, method)
                finally:
                    self._record(method, _final_code(context, code), started)
            result = behavior(request, context)
            try:
                if inspect.isasyncgen(result):
                    async for item in result:
                        await context.write(item)
                else:  # a handler that writes with context.write()
                    await result
            except BaseException as exc:
                code = await _answer(exc, context, method)
                raise
            finally:
                if inspect.isasyncgen(result):
                    # Cancelled in context.write, outside the handler's generator: close it now
                    # (its cleanup, such as CANCEL to the pair, runs here).
                    await result.aclose()
                self._record(method, _final_code(context, code), started)

        return streaming

    def _record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self._metrics.requests.labels(method=method, code=code.name).inc()
        self._metrics.request_duration.labels(method=method).observe(time.perf_counter() - started)


class Undecodable:
    """A request whose bytes are not the method's message; the call ends INVALID_ARGUMENT."""

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return deserialize


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(request, Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid {method} message ({request.error}); every string "
            "field must be UTF-8 text",
        )


async def _answer(
    exc: BaseException, context: grpc.aio.ServicerContext, method: str
) -> grpc.StatusCode:
    """The status code ``exc`` ends the call with; aborts the call for our own errors (which
    raises grpc's AbortError in place of ``exc``)."""
    if isinstance(exc, asyncio.CancelledError):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    if isinstance(exc, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN  # _final_code reads the real one from the context
    if isinstance(exc, GatewayError):
        await context.abort(exc.code, exc.message)
    log.exception("%s failed", method, exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL,
        f"internal error in the gateway ({type(exc).__name__}: {exc}); see the gateway log",
    )
    raise AssertionError("unreachable: context.abort raises")


def _final_code(context: grpc.aio.ServicerContext, fallback: grpc.StatusCode) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return fallback
