"""The gateway's gRPC side, on loopback in front of a real pair: the token, reflection, TLS.

The pair is `foundry tp-leader` + `foundry tp-worker` as processes (``Pair``, from
tests/gateway_pair.py); the gateway runs in this process (tests/gateway_stack.py).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from gateway_pair import Pair, expect_code, health_of, run
from gateway_stack import AUTH, SERVING, TOKEN, assert_same, generate, stack
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from procs import missing

from foundry.api.v1 import inference_pb2, training_pb2
from foundry.gateway.server import API_SERVICES, INFERENCE_SERVICE
from foundry.hardware import default_threads


def test_every_call_but_health_and_reflection_needs_the_token(pair: Pair) -> None:
    served_before = pair.status().requests_served

    async def main() -> None:
        async with stack(pair.frontend) as s:
            for metadata, wording in [
                ((), "requires a bearer token"),
                ((("authorization", "Bearer nope"),), "not accepted"),
                ((("authorization", f"Basic {TOKEN}"),), "requires"),
            ]:
                await expect_code(
                    s.inference().GetPairStatus(
                        inference_pb2.GetPairStatusRequest(), metadata=metadata, timeout=5
                    ),
                    grpc.StatusCode.UNAUTHENTICATED,
                    wording,
                )
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    async for _ in s.inference().Generate(
                        inference_pb2.GenerateRequest(prompt="x", max_tokens=2),
                        metadata=metadata,
                        timeout=5,
                    ):
                        pass
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
                await expect_code(
                    s.training().ShutdownTraining(
                        training_pb2.ShutdownTrainingRequest(), metadata=metadata, timeout=5
                    ),
                    grpc.StatusCode.UNAUTHENTICATED,
                )
            tokens, _ = await generate(
                s, inference_pb2.GenerateRequest(prompt="hi", max_tokens=2), timeout=10
            )
            assert len(tokens) == 2
            pair_status = await s.inference().GetPairStatus(
                inference_pb2.GetPairStatusRequest(), metadata=AUTH, timeout=5
            )
            # One generation reached the pair: the authorised one.
            assert pair_status.requests_served == served_before + 1
            assert pair_status.worker_connected
            # the leader's --threads default, through STATUS, the gateway and the proto
            assert pair_status.threads == default_threads()
            assert await health_of(s.channel, "") == SERVING  # no token

            pair_method = "foundry.v1.InferenceService/GetPairStatus"
            refused = s.count(
                "foundry_gateway_requests_total", method=pair_method, code="UNAUTHENTICATED"
            )
            ok = s.count("foundry_gateway_requests_total", method=pair_method, code="OK")
            assert (refused, ok) == (3, 1)
            assert (
                s.count("foundry_gateway_request_duration_seconds_count", method=pair_method) == 4
            )

    run(main)


def test_reflection_lists_the_services_without_a_token(pair: Pair) -> None:
    async def main() -> None:
        async with stack(pair.frontend) as s:
            stub = reflection_pb2_grpc.ServerReflectionStub(s.channel)
            call = stub.ServerReflectionInfo(timeout=5)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = await call.read()
            await call.write(
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=INFERENCE_SERVICE)
            )
            described = await call.read()
            await call.done_writing()
            names = {svc.name for svc in listed.list_services_response.service}
            assert set(API_SERVICES) <= names
            assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
            assert described.file_descriptor_response.file_descriptor_proto

    run(main)


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        missing("the openssl command is not installed; it makes the test certificate")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


def test_tls_with_the_ca_works_and_plaintext_does_not(pair: Pair, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    direct = pair.generate("hi", 5)

    async def main() -> None:
        async with stack(pair.frontend, tls=(cert, key), channel_credentials=creds) as s:
            assert await health_of(s.channel, "") == SERVING
            tokens, done = await generate(
                s, inference_pb2.GenerateRequest(prompt="hi", max_tokens=5), timeout=10
            )
            assert_same(tokens, done, direct)
            async with grpc.aio.insecure_channel(s.target) as plain:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await health_pb2_grpc.HealthStub(plain).Check(
                        health_pb2.HealthCheckRequest(), timeout=2
                    )
                assert exc.value.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )

    run(main)
