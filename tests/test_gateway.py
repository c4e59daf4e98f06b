"""The gateway over real gRPC channels on loopback: auth, TLS, reflection, health, generation
(streaming, cancel, deadlines), status codes, metrics, and `foundry ctl` against it.

The inference backend is ``StandInLeader`` (see tests/test_gateway_frontend.py); the
training backend is left unreachable here, and is the real coordinator in
tests/test_gateway_coordinator.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_gateway_frontend import REPLY, StandInLeader, free_port, run

from foundry.api.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)
from foundry.gateway.server import API_SERVICES, Gateway, GatewayOptions

TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Stack:
    gateway: Gateway
    leader: StandInLeader
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


@contextlib.asynccontextmanager
async def stack(
    leader: StandInLeader | None = None,
    token: str | None = TOKEN,
    tls: tuple[Path, Path] | None = None,
    channel_credentials: grpc.ChannelCredentials | None = None,
) -> AsyncIterator[Stack]:
    leader = leader or StandInLeader()
    leader_port = await leader.start()
    coordinator_port = free_port()  # nothing listens there
    options = GatewayOptions(
        listen_host="127.0.0.1",
        listen_port=0,
        coordinator_host="127.0.0.1",
        coordinator_port=coordinator_port,
        frontend_host="127.0.0.1",
        frontend_port=leader_port,
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
            f"127.0.0.1:{port}", channel_credentials,
            options=[("grpc.ssl_target_name_override", "localhost")],
        )
    else:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Stack(gateway, leader, channel, coordinator_port)
    finally:
        await channel.close()
        await gateway.stop()
        await leader.stop()


async def status_of(s: Stack, service: str) -> int:
    got = await s.health().Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    code: int = got.status
    return code


async def wait_health(s: Stack, service: str, want: int, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while (got := await status_of(s, service)) != want:
        assert time.monotonic() < deadline, f"{service!r} stayed {got}, wanted {want}"
        await asyncio.sleep(0.05)


async def generate_text(s: Stack, request: inference_pb2.GenerateRequest, **kw: object) -> tuple[
    str, inference_pb2.GenerationDone
]:
    text = ""
    done = None
    async for event in s.inference().Generate(request, metadata=AUTH, **kw):
        if event.HasField("token"):
            text += event.token.text
        else:
            done = event.done
    assert done is not None
    return text, done


# ---------------------------------------------------------------------------- auth


def test_every_call_but_health_and_reflection_needs_the_token() -> None:
    async def main() -> None:
        async with stack() as s:
            for metadata, wording in [((), "requires a bearer token"),
                                      ((("authorization", "Bearer nope"),), "not accepted"),
                                      ((("authorization", f"Basic {TOKEN}"),), "requires")]:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await s.inference().GetPairStatus(
                        inference_pb2.GetPairStatusRequest(), metadata=metadata, timeout=5
                    )
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert wording in (exc.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    async for _ in s.inference().Generate(
                        inference_pb2.GenerateRequest(prompt="x", max_tokens=2),
                        metadata=metadata, timeout=5,
                    ):
                        pass
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await s.training().ShutdownTraining(
                        training_pb2.ShutdownTrainingRequest(), metadata=metadata, timeout=5
                    )
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert s.leader.requests == [], "a refused call reached the backend"

            pair = await s.inference().GetPairStatus(
                inference_pb2.GetPairStatusRequest(), metadata=AUTH, timeout=5
            )
            assert pair.worker_connected and pair.model_id == 0xC0FFEE
            assert await status_of(s, "") == SERVING  # no token

            metrics = s.gateway.metrics.registry
            refused = metrics.get_sample_value(
                "foundry_gateway_requests_total",
                {"method": "foundry.v1.InferenceService/GetPairStatus", "code": "UNAUTHENTICATED"},
            )
            ok = metrics.get_sample_value(
                "foundry_gateway_requests_total",
                {"method": "foundry.v1.InferenceService/GetPairStatus", "code": "OK"},
            )
            assert (refused, ok) == (3, 1)
            assert metrics.get_sample_value(
                "foundry_gateway_request_duration_seconds_count",
                {"method": "foundry.v1.InferenceService/GetPairStatus"},
            ) == 4

    run(main)


def test_reflection_lists_the_services_without_a_token() -> None:
    async def main() -> None:
        async with stack() as s:
            stub = reflection_pb2_grpc.ServerReflectionStub(s.channel)
            call = stub.ServerReflectionInfo(timeout=5)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = await call.read()
            await call.write(
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="foundry.v1.InferenceService"
                )
            )
            described = await call.read()
            await call.done_writing()
            names = {svc.name for svc in listed.list_services_response.service}
            assert set(API_SERVICES) <= names
            assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
            assert described.file_descriptor_response.file_descriptor_proto

    run(main)


# ---------------------------------------------------------------------------- TLS


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed; it makes the test certificate")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


def test_tls_with_the_ca_works_and_plaintext_does_not(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())

    async def main() -> None:
        async with stack(tls=(cert, key), channel_credentials=creds) as s:
            assert await status_of(s, "") == SERVING
            text, _ = await generate_text(
                s, inference_pb2.GenerateRequest(prompt="hi", max_tokens=5), timeout=5
            )
            assert text == REPLY[:5]
            async with grpc.aio.insecure_channel(s.target) as plain:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await health_pb2_grpc.HealthStub(plain).Check(
                        health_pb2.HealthCheckRequest(), timeout=2
                    )
                assert exc.value.code() in (
                    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED
                )

    run(main)


# ---------------------------------------------------------------------------- generation


def test_generate_streams_through_the_gateway() -> None:
    async def main() -> None:
        async with stack() as s:
            text, done = await generate_text(
                s, inference_pb2.GenerateRequest(prompt="hi", max_tokens=9, seed=3), timeout=5
            )
            assert text == REPLY[:9]
            assert done.reason == inference_pb2.FINISH_REASON_MAX_TOKENS
            assert done.generated_tokens == 9 and done.prompt_tokens == 2
            text, done = await generate_text(
                s,
                inference_pb2.GenerateRequest(
                    prompt="hi", max_tokens=100, temperature=0.7, top_p=0.9, stop=["brown"]
                ),
                timeout=5,
            )
            assert text == "the quick brown"
            assert done.reason == inference_pb2.FINISH_REASON_STOP_STRING
            sent = s.leader.requests[-1]
            assert (sent.max_tokens, sent.stop) == (100, ("brown",))
            assert sent.temperature == pytest.approx(0.7) and sent.top_p == pytest.approx(0.9)
            assert s.leader.requests[0].top_p == 1.0  # unset top_p means no filtering
            assert s.gateway.metrics.registry.get_sample_value(
                "foundry_gateway_generated_tokens_total"
            ) == 9 + len("the quick brown")

    run(main)


def test_cancelling_generate_stops_decoding_on_the_pair() -> None:
    async def main() -> None:
        async with stack(StandInLeader(token_delay_s=0.01)) as s:
            call = s.inference().Generate(
                inference_pb2.GenerateRequest(prompt="long", max_tokens=5000), metadata=AUTH
            )
            got = 0
            async for _ in call:
                got += 1
                if got == 3:
                    break
            call.cancel()
            await asyncio.wait_for(s.leader.cancel_seen.wait(), 3.0)
            assert s.leader.cancelled == [s.leader.requests[0].request_id]

    run(main)


def test_deadlines_are_honoured() -> None:
    async def main() -> None:
        async with stack(StandInLeader(status_delay_s=0.0)) as s:
            await wait_health(s, "foundry.v1.InferenceService", SERVING)
            s.leader.status_delay_s = 3.0
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await s.inference().GetPairStatus(
                    inference_pb2.GetPairStatusRequest(), metadata=AUTH, timeout=0.3
                )
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 2.0
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await generate_text(
                    s, inference_pb2.GenerateRequest(prompt="!mute", max_tokens=3), timeout=0.3
                )
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 2.0
            await asyncio.wait_for(s.leader.cancel_seen.wait(), 3.0)

    run(main)


# ---------------------------------------------------------------------------- status codes


@pytest.mark.parametrize(
    ("request_fields", "wording"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"max_tokens": 4, "temperature": float("nan")}, "temperature"),
        ({"max_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"max_tokens": 4, "stop": ["x"] * 17}, "at most 16"),
        ({"max_tokens": 4, "stop": ["ok", ""]}, "empty"),
    ],
)
def test_bad_generate_requests_are_invalid_argument(
    request_fields: dict[str, object], wording: str
) -> None:
    async def main() -> None:
        async with stack() as s:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await generate_text(
                    s, inference_pb2.GenerateRequest(prompt="x", **request_fields), timeout=5
                )
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert wording in (exc.value.details() or "")
            assert s.leader.requests == []

    run(main)


def test_backend_errors_map_to_status_codes() -> None:
    async def main() -> None:
        async with stack() as s:
            for prompt, code, wording in [
                ("!bad", grpc.StatusCode.INVALID_ARGUMENT, "prompt too long"),
                ("!busy", grpc.StatusCode.RESOURCE_EXHAUSTED, "retry later"),
                ("!drop", grpc.StatusCode.UNAVAILABLE, "broke"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await generate_text(
                        s, inference_pb2.GenerateRequest(prompt=prompt, max_tokens=4), timeout=5
                    )
                assert exc.value.code() == code, prompt
                assert wording in (exc.value.details() or ""), exc.value.details()

            # The coordinator is not running: every training and model call says where to look.
            training = s.training()
            for rpc, request in [
                (training.GetTrainingStatus, training_pb2.GetTrainingStatusRequest()),
                (training.PauseTraining, training_pb2.PauseTrainingRequest()),
                (model_pb2_grpc.ModelServiceStub(s.channel).ExportModel,
                 model_pb2.ExportModelRequest()),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await rpc(request, metadata=AUTH, timeout=5)
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
                details = exc.value.details() or ""
                assert f"--admin-listen 127.0.0.1:{s.coordinator_port}" in details, details
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in training.WatchTrainingStatus(
                    training_pb2.WatchTrainingStatusRequest(interval_seconds=0.01),
                    metadata=AUTH, timeout=5,
                ):
                    pass
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            await s.leader.stop()
            await wait_health(s, "foundry.v1.InferenceService", NOT_SERVING)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await s.inference().GetPairStatus(
                    inference_pb2.GetPairStatusRequest(), metadata=AUTH, timeout=5
                )
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "--frontend-listen" in (exc.value.details() or "")
            await s.leader.start(s.leader.port)  # so the stack's teardown can stop it again

    run(main)


# ---------------------------------------------------------------------------- health


def test_health_follows_the_pair_and_goes_first_on_shutdown() -> None:
    async def main() -> None:
        async with stack() as s:
            assert await status_of(s, "") == SERVING
            await wait_health(s, "foundry.v1.InferenceService", SERVING)
            # The coordinator of this stack is unreachable.
            assert await status_of(s, "foundry.v1.TrainingService") == NOT_SERVING
            assert await status_of(s, "foundry.v1.ModelService") == NOT_SERVING
            s.leader.worker_connected = False
            await wait_health(s, "foundry.v1.InferenceService", NOT_SERVING)
            s.leader.worker_connected = True
            await wait_health(s, "foundry.v1.InferenceService", SERVING)

            watch = s.health().Watch(health_pb2.HealthCheckRequest(service=""))
            first = await watch.read()
            assert first.status == SERVING
            stopping = asyncio.create_task(s.gateway.stop())
            second = await asyncio.wait_for(watch.read(), 3.0)
            assert second.status == NOT_SERVING
            await stopping

    run(main)


# ---------------------------------------------------------------------------- foundry ctl


def _ctl(target: str, token_file: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "foundry", "ctl", "--gateway", target,
            "--token-file", str(token_file), *args]


async def _run(cmd: list[str]) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_ctl_generate_prints_only_the_text_and_status_shows_the_pair(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")

    async def main() -> None:
        async with stack() as s:
            code, out, err = await _run(_ctl(
                s.target, token_file, "generate", "--prompt", "hi", "--max-tokens", "11",
                "--temperature", "0", "--stats",
            ))
            assert code == 0, err
            assert out == REPLY[:11] + "\n"
            assert "11 tokens" in err and "max_tokens" in err

            code, out, err = await _run(_ctl(s.target, token_file, "status"))
            assert code == 1, "the coordinator is down, so status reports a failure"
            assert "pair: worker rank connected" in out
            assert "training: unavailable" in out and "--admin-listen" in out

            code, out, err = await _run(
                [sys.executable, "-m", "foundry", "ctl", "--gateway", s.target, "pause"]
            )
            assert code == 1
            assert "UNAUTHENTICATED" in err and "--token-file" in err

    run(main, timeout_s=60)
