"""The gateway's health: the stock gRPC health service, fed by a probe of each backend.

Names and what SERVING means:

- ``""`` (the whole server): the gateway runs and answers. It does not follow the backends, so a
  liveness probe never restarts a healthy gateway because the coordinator restarts.
- ``foundry.v1.TrainingService``, ``foundry.v1.ModelService``: the coordinator's admin link
  answers a status request.
- ``foundry.v1.InferenceService``: the tensor-parallel leader answers a status request and
  reports its worker rank connected (without it the pair cannot decode).

A background task probes every backend each ``interval_s`` (1 s), concurrently, each probe
bounded by ``timeout_s``. On shutdown every name turns NOT_SERVING first, before the server
stops taking calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2

from foundry.gateway.errors import GatewayError
from foundry.obs.metrics import GatewayMetrics

log = logging.getLogger("foundry.gateway.health")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
OVERALL = health.OVERALL_HEALTH

PROBE_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Backend:
    """One backend: its name (a metric label), the health names it decides, and its probe,
    which returns None when the backend is fine or the reason it is not."""

    name: str
    services: tuple[str, ...]
    probe: Callable[[float], Awaitable[str | None]]


class HealthProbe:
    def __init__(
        self,
        servicer: health.aio.HealthServicer,
        backends: Sequence[Backend],
        metrics: GatewayMetrics,
        interval_s: float = PROBE_INTERVAL_S,
        timeout_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self.servicer = servicer
        self.backends = tuple(backends)
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._up: dict[str, bool | None] = {b.name: None for b in self.backends}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Every name NOT_SERVING but the overall one, one probe round, then the loop."""
        await self.servicer.set(OVERALL, SERVING)
        for backend in self.backends:
            for service in backend.services:
                await self.servicer.set(service, NOT_SERVING)
        await self.probe_once()
        self._task = asyncio.create_task(self._loop())

    async def shutdown(self) -> None:
        """NOT_SERVING everywhere (for good), then stop probing."""
        await self.servicer.enter_graceful_shutdown()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def probe_once(self) -> None:
        reasons = await asyncio.gather(*(self._probe(b) for b in self.backends))
        for backend, reason in zip(self.backends, reasons, strict=True):
            up = reason is None
            self.metrics.backend_up.labels(backend=backend.name).set(1 if up else 0)
            if self._up[backend.name] == up:
                continue
            if up:
                log.info("%s is reachable: %s SERVING", backend.name, ", ".join(backend.services))
            else:
                log.warning(
                    "%s is not serving (%s): %s NOT_SERVING",
                    backend.name, reason, ", ".join(backend.services),
                )
            self._up[backend.name] = up
            for service in backend.services:
                await self.servicer.set(service, SERVING if up else NOT_SERVING)

    async def _probe(self, backend: Backend) -> str | None:
        try:
            return await asyncio.wait_for(backend.probe(self.timeout_s), self.timeout_s)
        except TimeoutError:
            return f"no answer within {self.timeout_s:g} s"
        except GatewayError as exc:
            return exc.message

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe_once()
            except Exception:
                log.exception("health probe failed; trying again in %g s", self.interval_s)
