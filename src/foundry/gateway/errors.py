"""Why a gateway call failed, as exceptions that carry the gRPC status code to answer with.

::

    GatewayError              a call cannot be answered; ``code`` is the gRPC status, ``message``
    │                         says what happened and what to do next (it is sent to the caller)
    ├── BackendUnavailable    UNAVAILABLE: a backend link cannot be opened or broke mid-call;
    │                         retrying later is right
    ├── BackendTimeout        DEADLINE_EXCEEDED: the backend did not answer within the call's
    │                         deadline (or the gateway's own limit for that backend)
    ├── InvalidRequest        INVALID_ARGUMENT: the request cannot be served as asked
    ├── Refused               FAILED_PRECONDITION: the backend refused in its current state
    │                         (pausing a finished run); the message is the backend's reason
    └── BackendFailed         the backend answered with an error of its own; ``code`` follows
                              that error (RESOURCE_EXHAUSTED for an overloaded pair, INTERNAL
                              for a fault on its side or bytes that break the protocol)

The servicers raise these; the gateway's call interceptor turns them into the call's status,
so every method answers failures the same way.
"""

from __future__ import annotations

import grpc


class GatewayError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class BackendUnavailable(GatewayError):
    code = grpc.StatusCode.UNAVAILABLE


class BackendTimeout(GatewayError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InvalidRequest(GatewayError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Refused(GatewayError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class BackendFailed(GatewayError):
    code = grpc.StatusCode.INTERNAL
