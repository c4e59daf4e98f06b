"""A gateway in this process in front of a real pair, over real gRPC channels on loopback.

The training backend is left unreachable here; it is a real coordinator in
tests/test_gateway_coordinator.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from gateway_pair import free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tp_harness import Result

from foundry.api.v1 import inference_pb2, inference_pb2_grpc, training_pb2_grpc
from foundry.gateway.server import Gateway, GatewayOptions
from foundry.wire import frontend as fw

TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Stack:
    gateway: Gateway
    channel: grpc.aio.Channel
    coordinator_port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def training(self) -> training_pb2_grpc.TrainingServiceStub:
        return training_pb2_grpc.TrainingServiceStub(self.channel)

    def inference(self) -> inference_pb2_grpc.InferenceServiceStub:
        return inference_pb2_grpc.InferenceServiceStub(self.channel)

    def health(self) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(self.channel)

    def count(self, metric: str, **labels: str) -> float:
        return self.gateway.metrics.registry.get_sample_value(metric, labels) or 0.0


@contextlib.asynccontextmanager
async def stack(
    frontend_port: int,
    token: str | None = TOKEN,
    tls: tuple[Path, Path] | None = None,
    channel_credentials: grpc.ChannelCredentials | None = None,
) -> AsyncIterator[Stack]:
    """A gateway in this process in front of the leader at ``frontend_port``."""
    coordinator_port = free_port()  # nothing listens there
    options = GatewayOptions(
        listen_host="127.0.0.1",
        listen_port=0,
        coordinator_host="127.0.0.1",
        coordinator_port=coordinator_port,
        frontend_host="127.0.0.1",
        frontend_port=frontend_port,
        tls_cert=tls[0] if tls else None,
        tls_key=tls[1] if tls else None,
        token=token,
        probe_interval_s=0.2,
        grace_s=0.5,
    )
    gateway = Gateway(options)
    port = await gateway.start()
    if channel_credentials is not None:
        channel = grpc.aio.secure_channel(
            f"127.0.0.1:{port}",
            channel_credentials,
            options=[("grpc.ssl_target_name_override", "localhost")],
        )
    else:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Stack(gateway, channel, coordinator_port)
    finally:
        await channel.close()
        await gateway.stop()


async def generate(
    s: Stack, request: inference_pb2.GenerateRequest, **kw: object
) -> tuple[list[inference_pb2.GeneratedToken], inference_pb2.GenerationDone]:
    tokens = []
    done = None
    async for event in s.inference().Generate(request, metadata=AUTH, **kw):
        assert done is None, "a response after the one carrying done"
        assert event.tokens or event.HasField("done"), "an empty response"
        tokens.extend(event.tokens)
        if event.HasField("done"):
            done = event.done
    assert done is not None
    return tokens, done


def assert_same(
    tokens: list[inference_pb2.GeneratedToken], done: inference_pb2.GenerationDone, direct: Result
) -> None:
    """What the gateway streamed is what the leader sends on a direct frontend connection."""
    assert [(t.id, t.position) for t in tokens] == list(
        zip(direct.tokens, direct.positions, strict=True)
    )
    assert "".join(t.text for t in tokens) == direct.text
    assert isinstance(direct.end, fw.Done)
    reason = inference_pb2.FinishReason.Name(done.reason)
    assert reason == f"FINISH_REASON_{direct.end.reason.name}"
    assert (done.prompt_tokens, done.generated_tokens) == (
        direct.end.prompt_tokens,
        direct.end.generated_tokens,
    )
