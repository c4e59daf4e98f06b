"""The foundry.v1 servicers: each call translated to the native link of its backend.

Training and model calls become FDTC requests on the coordinator's admin link
(``AdminClient``); inference calls become frames on the tensor-parallel leader's frontend link
(``FrontendClient``). Failures are raised as ``GatewayError`` and turned into the call's status
by ``calls.CallInterceptor``. Every backend wait is bounded by the call's deadline, and by a
limit of the gateway's own when the call has none.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from foundry.api.v1 import inference_pb2, model_pb2, training_pb2
from foundry.gateway.admin_client import AdminClient
from foundry.gateway.errors import BackendUnavailable, InvalidRequest
from foundry.gateway.frontend_client import Event, FrontendClient
from foundry.obs.metrics import GatewayMetrics
from foundry.wire import fdtc, frontend
from foundry.wire.errors import LocalProtocolError

# Without a deadline from the caller: a status answer is immediate on a live coordinator; a
# checkpoint or an export writes the whole model (seconds on a Pi, more on a slow disk).
STATUS_LIMIT_S = 10.0
CONTROL_LIMIT_S = 300.0
# WatchTrainingStatus update interval: the default, and the bounds of what a caller may ask.
WATCH_DEFAULT_S = 1.0
WATCH_MIN_S = 0.1
WATCH_MAX_S = 60.0
# GenerateRequest.temperature above this is noise; the leader would accept it, but a caller
# asking for it has most likely mixed up a unit.
MAX_TEMPERATURE = 100.0
# Tokens in one GenerateResponse at most. A backlog this long already makes gRPC's cost per
# message negligible per token; the bound keeps a message a few KiB, far below gRPC's 4 MiB
# default receive limit, and a caller's view of progress no coarser than this.
MAX_TOKENS_PER_RESPONSE = 256


def budget(context: grpc.aio.ServicerContext, limit_s: float) -> float:
    """Seconds a backend wait may take: the call's time left, at most ``limit_s``."""
    left = context.time_remaining()
    return limit_s if left is None else max(0.0, min(limit_s, left))


# ---------------------------------------------------------------------------- conversions


def worker_pb(row: fdtc.SwarmStatusRow, more: fdtc.SwarmDetailRow) -> training_pb2.Worker:
    return training_pb2.Worker(
        worker_id=row.worker_id,
        profile=fdtc.profile_name(row.profile).lower(),
        state=_worker_state(row.state),
        batch_size=row.batch_size,
        accumulation_steps=row.accumulation_steps,
        samples_per_second=row.samples_per_sec,
        loss=row.loss,
        local_step=row.local_step,
        seconds_since_heartbeat=row.seconds_since_heartbeat,
        inner_steps=more.inner_steps,
        bytes_up=more.bytes_up,
        bytes_down=more.bytes_down,
    )


def workers_pb(status: fdtc.SwarmStatus, detail: fdtc.SwarmDetail) -> list[training_pb2.Worker]:
    return [worker_pb(row, more) for row, more in zip(status.rows, detail.rows, strict=True)]


def training_status_pb(
    status: fdtc.SwarmStatus, detail: fdtc.SwarmDetail
) -> training_pb2.TrainingStatus:
    return training_pb2.TrainingStatus(
        global_step=status.global_step,
        max_steps=status.max_steps,
        state=(
            training_pb2.TRAINING_STATE_FAILED if detail.failed else _training_state(status.state)
        ),
        train_loss=status.train_loss,
        validation_loss=status.val_loss,
        samples_per_second=status.samples_per_sec,
        learning_rate=status.learning_rate,
        samples_total=status.samples_total,
        workers=workers_pb(status, detail),
        note=detail.note,
        min_workers=detail.min_workers,
        seconds_since_step=detail.seconds_since_step,
    )


# The API's enums name the wire's values, so the mapping is by name; a value the API lacks
# (a newer coordinator) reads as UNSPECIFIED instead of failing the call.
def _worker_state(state: fdtc.WorkerState) -> training_pb2.WorkerState:
    try:
        value: training_pb2.WorkerState = training_pb2.WorkerState.Value(
            f"WORKER_STATE_{state.name}"
        )
    except ValueError:
        return training_pb2.WORKER_STATE_UNSPECIFIED
    return value


def _training_state(state: fdtc.SwarmState) -> training_pb2.TrainingState:
    try:
        value: training_pb2.TrainingState = training_pb2.TrainingState.Value(
            f"TRAINING_STATE_{state.name}"
        )
    except ValueError:
        return training_pb2.TRAINING_STATE_UNSPECIFIED
    return value


def pair_status_pb(status: frontend.Status) -> inference_pb2.GetPairStatusResponse:
    return inference_pb2.GetPairStatusResponse(
        worker_connected=status.worker_connected,
        shared_memory=status.shared_memory,
        active_sessions=status.active_sessions,
        tokens_generated=status.tokens_generated,
        requests_served=status.requests_served,
        spec_acceptance=status.spec_acceptance,
        threads=status.threads,
        n_layer=status.n_layer,
        n_embd=status.n_embd,
        n_vocab=status.n_vocab,
        ctx_size=status.ctx_size,
        model_bytes=status.model_bytes,
        model_id=status.model_id,
        ranks=[
            inference_pb2.RankStatus(
                rank=r.rank,
                share=r.share,
                connected=r.connected,
                gate_wait_seconds=r.gate_wait_us / 1e6,
                threads=r.threads,
            )
            for r in status.ranks
        ],
    )


_FINISH = {
    frontend.DoneReason.MAX_TOKENS: inference_pb2.FINISH_REASON_MAX_TOKENS,
    frontend.DoneReason.EOS: inference_pb2.FINISH_REASON_EOS,
    frontend.DoneReason.STOP_STRING: inference_pb2.FINISH_REASON_STOP_STRING,
    frontend.DoneReason.CANCELLED: inference_pb2.FINISH_REASON_CANCELLED,
    frontend.DoneReason.CONTEXT_FULL: inference_pb2.FINISH_REASON_CONTEXT_FULL,
}
assert set(_FINISH) == set(frontend.DoneReason), "every DONE reason needs a FinishReason"


def generate_response_pb(
    events: list[Event],
) -> inference_pb2.GenerateResponse:
    """One response of the Generate stream: the tokens of ``events``, then their Done if it is
    among them (it can only be the last)."""
    tokens = [
        inference_pb2.GeneratedToken(id=e.token, position=e.position, text=e.text)
        for e in events
        if isinstance(e, frontend.Token)
    ]
    end = events[-1]
    if not isinstance(end, frontend.Done):
        return inference_pb2.GenerateResponse(tokens=tokens)
    done = inference_pb2.GenerationDone(
        reason=_FINISH[end.reason],
        prompt_tokens=end.prompt_tokens,
        generated_tokens=end.generated_tokens,
        seconds=end.seconds,
    )
    return inference_pb2.GenerateResponse(tokens=tokens, done=done)


def generate_settings(
    request: inference_pb2.GenerateRequest,
) -> tuple[int, float, float, tuple[str, ...]]:
    """(max_tokens, temperature, top_p, stop) of a request, or InvalidRequest saying what to fix."""
    if request.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    temperature = request.temperature
    if not math.isfinite(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidRequest(
            f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy), got {temperature}"
        )
    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidRequest(f"top_p must be in (0, 1] (leave it unset for 1), got {top_p}")
    stop = tuple(request.stop)
    if len(stop) > frontend.MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"at most {frontend.MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}"
        )
    if any(not s for s in stop):
        raise InvalidRequest("stop strings must not be empty")
    return request.max_tokens, temperature, top_p, stop


# ---------------------------------------------------------------------------- servicers


class TrainingServicer:
    def __init__(self, admin: AdminClient) -> None:
        self.admin = admin

    async def _control(
        self, msg: fdtc.Message, context: grpc.aio.ServicerContext
    ) -> fdtc.ControlAck:
        return await self.admin.control(msg, budget(context, CONTROL_LIMIT_S))

    async def StartTraining(
        self, request: training_pb2.StartTrainingRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.StartTrainingResponse:
        ack = await self._control(fdtc.Start(), context)
        return training_pb2.StartTrainingResponse(global_step=ack.global_step, message=ack.message)

    async def PauseTraining(
        self, request: training_pb2.PauseTrainingRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.PauseTrainingResponse:
        ack = await self._control(fdtc.Pause(), context)
        return training_pb2.PauseTrainingResponse(global_step=ack.global_step, message=ack.message)

    async def ResumeTraining(
        self, request: training_pb2.ResumeTrainingRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ResumeTrainingResponse:
        ack = await self._control(fdtc.Resume(), context)
        return training_pb2.ResumeTrainingResponse(global_step=ack.global_step, message=ack.message)

    async def CreateCheckpoint(
        self, request: training_pb2.CreateCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.CreateCheckpointResponse:
        ack = await self._control(fdtc.Checkpoint(), context)
        return training_pb2.CreateCheckpointResponse(global_step=ack.global_step, path=ack.message)

    async def ShutdownTraining(
        self, request: training_pb2.ShutdownTrainingRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ShutdownTrainingResponse:
        ack = await self._control(fdtc.Shutdown(), context)
        return training_pb2.ShutdownTrainingResponse(
            global_step=ack.global_step, message=ack.message
        )

    async def GetTrainingStatus(
        self, request: training_pb2.GetTrainingStatusRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.GetTrainingStatusResponse:
        status = await self.admin.status(budget(context, STATUS_LIMIT_S))
        return training_pb2.GetTrainingStatusResponse(status=training_status_pb(*status))

    async def ListWorkers(
        self, request: training_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ListWorkersResponse:
        status = await self.admin.status(budget(context, STATUS_LIMIT_S))
        return training_pb2.ListWorkersResponse(workers=workers_pb(*status))

    async def WatchTrainingStatus(
        self, request: training_pb2.WatchTrainingStatusRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[training_pb2.WatchTrainingStatusResponse]:
        interval = request.interval_seconds or WATCH_DEFAULT_S
        if not (math.isfinite(interval) and WATCH_MIN_S <= interval <= WATCH_MAX_S):
            raise InvalidRequest(
                f"interval_seconds must be in [{WATCH_MIN_S:g}, {WATCH_MAX_S:g}] "
                f"(0 for {WATCH_DEFAULT_S:g}), got {request.interval_seconds}"
            )
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            status, detail = await self.admin.status(budget(context, STATUS_LIMIT_S))
            yield training_pb2.WatchTrainingStatusResponse(
                status=training_status_pb(status, detail)
            )
            if status.state is fdtc.SwarmState.DONE or detail.failed:
                return
            await asyncio.sleep(max(0.0, interval - (loop.time() - asked)))


class ModelServicer:
    def __init__(self, admin: AdminClient) -> None:
        self.admin = admin

    async def ExportModel(
        self, request: model_pb2.ExportModelRequest, context: grpc.aio.ServicerContext
    ) -> model_pb2.ExportModelResponse:
        name = request.type.lower() or "f32"
        types = {t.name.lower(): t for t in fdtc.FileType}
        if name not in types:
            raise InvalidRequest(f"unknown export type {request.type!r}; one of {', '.join(types)}")
        try:
            export = fdtc.Export(request.path, types[name])
        except LocalProtocolError as exc:
            raise InvalidRequest(f"the export path does not fit the admin link: {exc}") from None
        ack = await self.admin.control(export, budget(context, CONTROL_LIMIT_S))
        return model_pb2.ExportModelResponse(path=ack.message, global_step=ack.global_step)


class InferenceServicer:
    def __init__(
        self,
        client: FrontendClient,
        metrics: GatewayMetrics,
        pair_down: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        """``pair_down``: why the pair does not serve now (None: it does), from the health
        probe; a generation is then refused at once instead of waiting for its deadline."""
        self.client = client
        self.metrics = metrics
        self.pair_down = pair_down

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        max_tokens, temperature, top_p, stop = generate_settings(request)
        messages = tuple((m.role, m.content) for m in request.messages)
        if messages and request.prompt:
            raise InvalidRequest("send a prompt or messages, not both")
        if self.pair_down is not None and (why := await self.pair_down()) is not None:
            raise BackendUnavailable(
                f"the tensor-parallel pair at {self.client.address} is not serving ({why}); "
                "retry once it is back (`foundry ctl status` shows it)"
            )
        generation = self.client.generate(
            request.prompt,
            max_tokens,
            temperature,
            top_p,
            request.seed,
            stop,
            top_k=request.top_k,
            messages=messages,
        )
        # Leaving this block early (the call cancelled or past its deadline) sends CANCEL.
        async with generation:
            # One message per batch: the tokens that piled up while the last message was being
            # sent go out together (see inference.proto, GenerateResponse).
            while events := await generation.batch(MAX_TOKENS_PER_RESPONSE):
                response = generate_response_pb(events)
                self.metrics.observe_gaps("generate", generation.gaps)
                self.metrics.generated_tokens.inc(len(response.tokens))
                self.metrics.generate_responses.inc()
                yield response

    async def GetPairStatus(
        self, request: inference_pb2.GetPairStatusRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetPairStatusResponse:
        return pair_status_pb(await self.client.status(budget(context, STATUS_LIMIT_S)))
