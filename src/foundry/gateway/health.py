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

Liveness is judged end to end: a call checks :meth:`HealthProbe.current` first, so it fails at
once while its backend is not serving (a backend marked down is probed again right then, so
one that just came back is not refused); and a backend that has not answered
:data:`STALL_PROBES` probes in a row (stopped, hung, or unreachable without a reset) gets its
``on_stall`` called, which fails the calls it had in flight instead of leaving them to their
deadlines.
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
# Probes in a row without an answer before a backend's calls in flight are failed: long enough
# that a loaded machine's slow answer is not taken for a dead backend (a few seconds).
STALL_PROBES = 3


@dataclass(frozen=True)
class Backend:
    """One backend: its name (a metric label), the health names it decides, and its probe,
    which returns None when the backend is fine or the reason it is not."""

    name: str
    services: tuple[str, ...]
    probe: Callable[[float], Awaitable[str | None]]
    # Called with the reason when the backend has not answered STALL_PROBES probes in a row.
    on_stall: Callable[[str], None] | None = None


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
        self._silent: dict[str, int] = {b.name: 0 for b in self.backends}
        self._recheck: dict[str, asyncio.Future[str | None]] = {}
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
        await asyncio.gather(*(self._probe_and_apply(b) for b in self.backends))

    async def current(self, name: str) -> str | None:
        """None when backend ``name`` serves; else why not. A backend marked down is probed
        again now (one probe shared by every caller asking meanwhile)."""
        if self._up.get(name):
            return None
        pending = self._recheck.get(name)
        if pending is None or pending.done():
            backend = next(b for b in self.backends if b.name == name)
            pending = asyncio.ensure_future(self._probe_and_apply(backend))
            self._recheck[name] = pending
        return await asyncio.shield(pending)

    async def _probe_and_apply(self, backend: Backend) -> str | None:
        reason = await self._probe(backend)
        up = reason is None
        self.metrics.backend_up.labels(backend=backend.name).set(1 if up else 0)
        if self._up[backend.name] != up:
            if up:
                log.info("%s is reachable: %s SERVING", backend.name, ", ".join(backend.services))
            else:
                log.warning(
                    "%s is not serving (%s): %s NOT_SERVING",
                    backend.name,
                    reason,
                    ", ".join(backend.services),
                )
            self._up[backend.name] = up
            for service in backend.services:
                await self.servicer.set(service, SERVING if up else NOT_SERVING)
        return reason

    async def _probe(self, backend: Backend) -> str | None:
        try:
            reason = await asyncio.wait_for(backend.probe(self.timeout_s), self.timeout_s)
        except TimeoutError:
            self._silent[backend.name] += 1
            silent = self._silent[backend.name]
            reason = f"no answer within {self.timeout_s:g} s"
            if silent >= STALL_PROBES and backend.on_stall is not None:
                backend.on_stall(
                    f"{backend.name} answered none of the last {silent} probes "
                    f"({reason} each): it is stopped, hung or cut off"
                )
            return reason
        except GatewayError as exc:
            reason = exc.message
        self._silent[backend.name] = 0
        return reason

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe_once()
            except Exception:
                log.exception("health probe failed; trying again in %g s", self.interval_s)
