"""The gateway: a grpc.aio server in front of the coordinator and the tensor-parallel pair.

It serves the foundry.v1 API (``servicers``), the standard gRPC health service (``health``)
and server reflection; with ``http_host``, the OpenAI-compatible HTTP API too (``http``, its
own listener, the same frontend client). Interceptors, outermost first:
``calls.CallInterceptor`` (metrics, status codes) then, with a token,
``auth.TokenAuthInterceptor``.

Shutdown order: health turns NOT_SERVING everywhere, the HTTP server then the gRPC server stop
taking requests and give those in flight ``grace_s`` to finish, then the backend links close.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from foundry.api.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)
from foundry.gateway.admin_client import AdminClient
from foundry.gateway.auth import TokenAuthInterceptor
from foundry.gateway.calls import CallInterceptor
from foundry.gateway.frontend_client import FrontendClient
from foundry.gateway.health import Backend, HealthProbe
from foundry.gateway.openai import HttpOptions, HttpServer
from foundry.gateway.openai.limits import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
from foundry.gateway.servicers import InferenceServicer, ModelServicer, TrainingServicer
from foundry.obs.metrics import GatewayMetrics

log = logging.getLogger("foundry.gateway")

TRAINING_SERVICE: str = training_pb2.DESCRIPTOR.services_by_name["TrainingService"].full_name
MODEL_SERVICE: str = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name
INFERENCE_SERVICE: str = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
API_SERVICES = (TRAINING_SERVICE, MODEL_SERVICE, INFERENCE_SERVICE)


@dataclass(frozen=True)
class GatewayOptions:
    listen_host: str
    listen_port: int
    coordinator_host: str
    coordinator_port: int
    frontend_host: str
    frontend_port: int
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # TLS of the gateway's own links to the coordinator and the leader (transport.tls); the
    # two fields above are the gRPC server's.
    backend_tls: ssl.SSLContext | None = None
    token: str | None = None
    probe_interval_s: float = 1.0
    grace_s: float = 5.0
    # The OpenAI-compatible HTTP API on its own listener (gateway/openai/); None: off.
    http_host: str | None = None
    http_port: int = 8080
    http_max_active: int = 16
    http_queue: int = 64
    http_header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    http_max_connections: int = DEFAULT_MAX_CONNECTIONS
    model_name: str = "foundry"


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Gateway:
    def __init__(self, options: GatewayOptions, metrics: GatewayMetrics | None = None) -> None:
        if (options.tls_cert is None) != (options.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key")
        self.opt = options
        self.metrics = metrics or GatewayMetrics()
        self.admin = AdminClient(
            options.coordinator_host, options.coordinator_port, ssl=options.backend_tls
        )
        self.frontend = FrontendClient(
            options.frontend_host, options.frontend_port, ssl=options.backend_tls
        )
        self.health = health.aio.HealthServicer()
        self.probe = HealthProbe(
            self.health,
            [
                Backend("coordinator", (TRAINING_SERVICE, MODEL_SERVICE), self._probe_admin),
                Backend(
                    "tp_leader",
                    (INFERENCE_SERVICE,),
                    self._probe_frontend,
                    on_stall=self.frontend.fail_inflight,
                ),
            ],
            self.metrics,
            interval_s=options.probe_interval_s,
            timeout_s=options.probe_interval_s,
        )
        interceptors: list[grpc.aio.ServerInterceptor] = [CallInterceptor(self.metrics)]
        if options.token is not None:
            interceptors.append(TokenAuthInterceptor(options.token))
        # No SO_REUSEPORT: a second gateway on the same port must fail to start, not silently
        # share the port with the first.
        self.server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        # The generated registration functions carry no annotations (grpcio-tools makes none).
        training_pb2_grpc.add_TrainingServiceServicer_to_server(  # type: ignore[no-untyped-call]
            TrainingServicer(self.admin), self.server
        )
        model_pb2_grpc.add_ModelServiceServicer_to_server(  # type: ignore[no-untyped-call]
            ModelServicer(self.admin), self.server
        )
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            InferenceServicer(self.frontend, self.metrics, lambda: self.probe.current("tp_leader")),
            self.server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*API_SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.http: HttpServer | None = None
        if options.http_host is not None:
            self.http = HttpServer(
                HttpOptions(
                    options.http_host,
                    options.http_port,
                    options.model_name,
                    options.http_max_active,
                    options.http_queue,
                    options.token,
                    options.tls_cert,
                    options.tls_key,
                    options.grace_s,
                    options.http_header_timeout_s,
                    options.http_max_connections,
                ),
                self.frontend,
                self.metrics,
            )
        self.port = 0
        self.http_port = 0
        self._started = False

    async def start(self) -> int:
        """Bind, probe the backends once, start serving; returns the bound port."""
        address = _address(self.opt.listen_host, self.opt.listen_port)
        try:
            if self.opt.tls_cert is not None and self.opt.tls_key is not None:
                credentials = grpc.ssl_server_credentials(
                    [(self.opt.tls_key.read_bytes(), self.opt.tls_cert.read_bytes())]
                )
                self.port = self.server.add_secure_port(address, credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(
                f"cannot listen on {address} ({exc}); is another process using the port?"
            ) from None
        if not self.port:
            raise OSError(f"cannot listen on {address}; is another process using the port?")
        await self.probe.start()
        await self.server.start()
        self._started = True
        if self.http is not None:
            self.http_port = await self.http.start()
        return self.port

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    async def stop(self) -> None:
        """Health NOT_SERVING first, then stop the server (with grace), then the links."""
        await self.probe.shutdown()
        try:
            if self.http is not None:
                await self.http.stop()
            if self._started:
                await self.server.stop(self.opt.grace_s)
        finally:
            await self.frontend.close()
            await self.admin.close()

    async def _probe_admin(self, timeout_s: float) -> str | None:
        _, detail = await self.admin.status(timeout_s)
        if detail.failed:
            return f"the coordinator failed: {detail.note}"
        return None

    async def _probe_frontend(self, timeout_s: float) -> str | None:
        status = await self.frontend.status(timeout_s)
        if not status.worker_connected:
            return "the TP leader reports its worker rank not connected"
        return None
