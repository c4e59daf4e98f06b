"""The OpenAI API's own listener (``--http-listen``): uvicorn inside the gateway's asyncio
loop, beside the grpc.aio server, with the connection limits of ``openai.limits``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import uvicorn

from foundry.gateway.frontend_client import FrontendClient
from foundry.gateway.openai.limits import (
    limited_h11,
)
from foundry.gateway.openai.routes import HttpOptions, OpenAIApi
from foundry.obs.metrics import GatewayMetrics


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
        raise OSError(
            f"cannot listen for HTTP on {host}:{port} ({exc.strerror or exc}); is "
            "another process using the port?"
        ) from None
    sock.setblocking(False)
    return sock


class HttpServer:
    """The OpenAI-compatible API on its own listener (``--http-listen``)."""

    def __init__(
        self, options: HttpOptions, client: FrontendClient, metrics: GatewayMetrics
    ) -> None:
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
            self.api.app,
            http=limited_h11(self.opt.header_timeout_s, self.opt.max_connections),
            lifespan="off",
            log_level="warning",
            access_log=False,
            ssl_certfile=self.opt.tls_cert,
            ssl_keyfile=self.opt.tls_key,
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
