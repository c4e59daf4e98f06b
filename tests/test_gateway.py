"""The gateway over real gRPC channels on loopback, in front of a real tensor-parallel pair:
auth, TLS, reflection, health, generation (streaming, cancel, deadlines), status codes,
GetPairStatus, metrics, and `foundry ctl`, down to the check of project issue 6: `foundry ctl
generate` through gateway and pair prints the bytes single-process `foundry generate` prints.

The pair is `foundry tp-leader` + `foundry tp-worker` as processes (``Pair``, from
tests/test_gateway_frontend.py); tests here kill, stall (SIGSTOP) and restart its ranks. The
gateway runs in this process, except in the `foundry ctl generate` check, where every piece is
a process. ``StandInLeader`` serves only the one test of INTERNAL, which a real leader does not
produce on demand. The training backend is left unreachable here; it is a real coordinator in
tests/test_gateway_coordinator.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from procs import ENV, Service, missing, wait_for
from test_gateway_frontend import (
    LONG,
    MODEL_CFG,
    PREFILL_CHUNK,
    PROMPT,
    REPLY,
    Pair,
    StandInLeader,
    expect_code,
    free_port,
    health_of,
    run,
    running_pair,
    wait_health,
)
from tp_harness import Result, make_model, reference_greedy

from foundry.api.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)
from foundry.gateway.server import API_SERVICES, INFERENCE_SERVICE, Gateway, GatewayOptions
from foundry.gateway.servicers import MAX_TOKENS_PER_RESPONSE
from foundry.hardware import default_threads
from foundry.wire import frontend as fw

TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GATEWAY_LINE = r"gateway listening: grpc 127\.0\.0\.1:(\d+)"
GENERATE = "foundry.v1.InferenceService/Generate"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "model.gguf", MODEL_CFG)


@pytest.fixture(scope="module")
def pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with running_pair(model, tmp_path_factory.mktemp("pair")) as p:
        yield p


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


# ---------------------------------------------------------------------------- auth


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


# ---------------------------------------------------------------------------- TLS


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


# ---------------------------------------------------------------------------- the pair


def test_get_pair_status_is_the_leaders_status(model: Path, pair: Pair) -> None:
    async def main() -> None:
        async with stack(pair.frontend) as s:
            before = await s.inference().GetPairStatus(
                inference_pb2.GetPairStatusRequest(), metadata=AUTH, timeout=5
            )
            direct = await asyncio.to_thread(pair.status)
            assert before.worker_connected and before.shared_memory
            assert (before.n_layer, before.n_embd, before.n_vocab, before.ctx_size) == (
                MODEL_CFG.n_layer,
                MODEL_CFG.n_embd,
                MODEL_CFG.n_vocab,
                MODEL_CFG.n_ctx,
            )
            assert before.model_bytes == model.stat().st_size
            assert before.model_id == direct.model_id != 0
            assert before.active_sessions == 0
            assert [(r.rank, r.share, r.connected) for r in before.ranks] == [
                (0, 1, True),
                (1, 1, True),
            ]
            await generate(s, inference_pb2.GenerateRequest(prompt="hi", max_tokens=7), timeout=10)
            after = await s.inference().GetPairStatus(
                inference_pb2.GetPairStatusRequest(), metadata=AUTH, timeout=5
            )
            assert after.tokens_generated == before.tokens_generated + 7
            assert after.requests_served == before.requests_served + 1

    run(main)


def test_generate_streams_what_the_pair_generates(pair: Pair) -> None:
    greedy = pair.generate(PROMPT, 24)
    stop = greedy.text[10:13]
    stopped = pair.generate(PROMPT, 24, stop=(stop,))
    sampled = pair.generate(PROMPT, 40, temperature=0.7, top_p=0.9, seed=3)
    unset_top_p = pair.generate(PROMPT, 16, temperature=0.9, seed=4, top_p=1.0)
    assert isinstance(stopped.end, fw.Done) and stopped.end.reason is fw.DoneReason.STOP_STRING
    assert stopped.text == greedy.text[: greedy.text.find(stop)]

    async def main() -> None:
        async with stack(pair.frontend) as s:
            streamed = 0
            for request, direct in [
                (inference_pb2.GenerateRequest(prompt=PROMPT, max_tokens=24), greedy),
                (inference_pb2.GenerateRequest(prompt=PROMPT, max_tokens=24, stop=[stop]), stopped),
                # The sampled text depends on every field: each reached the leader.
                (
                    inference_pb2.GenerateRequest(
                        prompt=PROMPT, max_tokens=40, temperature=0.7, top_p=0.9, seed=3
                    ),
                    sampled,
                ),
                # An unset top_p is 1: no filtering.
                (
                    inference_pb2.GenerateRequest(
                        prompt=PROMPT, max_tokens=16, temperature=0.9, seed=4
                    ),
                    unset_top_p,
                ),
            ]:
                tokens, done = await generate(s, request, timeout=10)
                assert_same(tokens, done, direct)
                streamed += len(tokens)
            assert s.count("foundry_gateway_generated_tokens_total") == streamed

    run(main)


def test_a_stream_that_falls_behind_sends_the_backlog_in_fewer_messages(
    model: Path, pair: Pair
) -> None:
    """The gateway is starved here: the reader blocks this process (a blocking wait, not an
    await) after each of the first messages until the pair has decoded tokens past what was
    read, so the gateway in it reads nothing while the pair keeps decoding. The next message
    then carries every token that piled up, and none is lost.
    (A reader that merely awaits between messages hardly ever gets a batch: HTTP/2 flow control
    lets the gateway write a short generation's messages ahead of the reads.)"""
    prompt, n, stalls = LONG[0], 200, 3
    ref = reference_greedy(model, prompt, n, PREFILL_CHUNK)
    direct = pair.generate(prompt, n)
    assert direct.tokens == ref.tokens

    async def main() -> None:
        async with stack(pair.frontend) as s:
            sizes: list[int] = []
            tokens: list[inference_pb2.GeneratedToken] = []
            done = None
            base = pair.status().tokens_generated
            request = inference_pb2.GenerateRequest(prompt=prompt, max_tokens=n)
            async for event in s.inference().Generate(request, metadata=AUTH, timeout=10):
                assert done is None, "a response after the one carrying done"
                sizes.append(len(event.tokens))
                tokens.extend(event.tokens)
                if event.HasField("done"):
                    done = event.done
                if len(sizes) <= stalls:
                    ahead = base + len(tokens) + 4
                    wait_for(
                        lambda ahead=ahead: pair.status().tokens_generated >= ahead,
                        30,
                        "the pair to decode four tokens past the reader",
                    )
            assert done is not None
            assert_same(tokens, done, direct)
            assert max(sizes) > 1 and len(sizes) < n, sizes
            assert max(sizes) <= MAX_TOKENS_PER_RESPONSE
            assert s.count("foundry_gateway_generated_tokens_total") == n
            assert s.count("foundry_gateway_generate_responses_total") == len(sizes)

    run(main)


def test_cancelling_generate_stops_decoding_on_the_pair(pair: Pair) -> None:
    before, tokens_before = pair.requests("cancelled"), pair.status().tokens_generated

    async def main() -> None:
        async with stack(pair.frontend) as s:
            call = s.inference().Generate(
                inference_pb2.GenerateRequest(prompt=LONG[0], max_tokens=LONG[1]), metadata=AUTH
            )
            got = 0
            async for _ in call:
                got += 1
                if got == 3:
                    break
            call.cancel()
            status = await asyncio.to_thread(pair.wait_cancelled, before)
            assert status.tokens_generated - tokens_before < LONG[1]
            assert s.count("foundry_gateway_requests_total", method=GENERATE, code="CANCELLED") == 1

    run(main)


def test_a_deadline_mid_stream_ends_the_generation_on_the_pair(pair: Pair) -> None:
    before, tokens_before = pair.requests("cancelled"), pair.status().tokens_generated

    async def main() -> None:
        async with stack(pair.frontend) as s:
            got = 0
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in s.inference().Generate(
                    inference_pb2.GenerateRequest(prompt=LONG[0], max_tokens=LONG[1]),
                    metadata=AUTH,
                    timeout=0.3,
                ):
                    got += 1
            # The code says why it ended: the 0.3 s deadline, not the end of the generation.
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert got > 0
            status = await asyncio.to_thread(pair.wait_cancelled, before)
            assert status.tokens_generated - tokens_before < LONG[1]
            assert (
                s.count("foundry_gateway_requests_total", method=GENERATE, code="DEADLINE_EXCEEDED")
                == 1
            )

    run(main)


def test_deadlines_hold_against_a_stalled_leader(pair: Pair) -> None:
    """SIGSTOP on the leader: its sockets stay open and it answers nothing."""
    before, tokens_before = pair.requests("cancelled"), pair.status().tokens_generated

    async def main() -> None:
        async with stack(pair.frontend) as s:
            await wait_health(s.channel, INFERENCE_SERVICE, SERVING)
            pair.stall_leader()
            try:
                # Each call ends with its own deadline's code, not a hang (the test's timeout)
                # nor another error.
                await expect_code(
                    s.inference().GetPairStatus(
                        inference_pb2.GetPairStatusRequest(), metadata=AUTH, timeout=0.3
                    ),
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                await expect_code(
                    generate(
                        s,
                        inference_pb2.GenerateRequest(prompt=LONG[0], max_tokens=LONG[1]),
                        timeout=0.3,
                    ),
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                await wait_health(s.channel, INFERENCE_SERVICE, NOT_SERVING)
            finally:
                pair.resume_leader()
            # The leader reads the GENERATE and the CANCEL sent at the deadline together.
            status = await asyncio.to_thread(pair.wait_cancelled, before)
            # At most the token of the prefill, if its engine thread admitted the request
            # between the two frames.
            assert status.tokens_generated - tokens_before <= 1
            await wait_health(s.channel, INFERENCE_SERVICE, SERVING)

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
        ({"max_tokens": 4, "stop": ["y" * 70000]}, "stop string of 70000 bytes"),
        ({"max_tokens": 4, "prompt": "x" * fw.MAX_PAYLOAD}, "shorten the prompt"),
    ],
)
def test_bad_generate_requests_are_invalid_argument(
    pair: Pair, request_fields: dict[str, object], wording: str
) -> None:
    refused_before = pair.requests("bad_request")

    async def main() -> None:
        async with stack(pair.frontend) as s:
            request = inference_pb2.GenerateRequest(
                **{"prompt": "x", **request_fields}  # type: ignore[arg-type]
            )
            await expect_code(
                generate(s, request, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, wording
            )

    run(main)
    assert pair.requests("bad_request") == refused_before, "the gateway let it through"


def test_the_leaders_refusals_map_to_status_codes(pair: Pair) -> None:
    refused_before = pair.requests("bad_request")
    cancelled_before = pair.requests("cancelled")

    async def stream(call: grpc.aio.UnaryStreamCall) -> None:
        async for _ in call:
            pass

    async def main() -> None:
        async with stack(pair.frontend) as s:
            details = await expect_code(
                generate(
                    s, inference_pb2.GenerateRequest(prompt="x" * 1100, max_tokens=4), timeout=10
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "longer than the context of 1024",
            )
            assert "the TP leader refused the request" in details
            assert await asyncio.to_thread(pair.requests, "bad_request") == refused_before + 1

            # Four decode and four wait on this pair: one of nine at once is refused.
            calls = [
                s.inference().Generate(
                    inference_pb2.GenerateRequest(prompt=LONG[0], max_tokens=LONG[1]),
                    metadata=AUTH,
                )
                for _ in range(9)
            ]
            tasks = [asyncio.create_task(stream(call)) for call in calls]
            done, _ = await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0.2)  # a second refusal would have come by now
            refused = [t for t in tasks if t.done()]
            assert len(done) == len(refused) == 1, refused
            await expect_code(refused[0], grpc.StatusCode.RESOURCE_EXHAUSTED, "retry later")
            for call in calls:
                call.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.to_thread(pair.wait_cancelled, cancelled_before, 8)

    run(main)


def test_an_unreachable_coordinator_is_unavailable_with_a_hint(pair: Pair) -> None:
    async def main() -> None:
        async with stack(pair.frontend) as s:
            training = s.training()
            for rpc, request in [
                (training.GetTrainingStatus, training_pb2.GetTrainingStatusRequest()),
                (training.PauseTraining, training_pb2.PauseTrainingRequest()),
                (
                    model_pb2_grpc.ModelServiceStub(s.channel).ExportModel,
                    model_pb2.ExportModelRequest(),
                ),
            ]:
                await expect_code(
                    rpc(request, metadata=AUTH, timeout=5),
                    grpc.StatusCode.UNAVAILABLE,
                    f"--admin-listen 127.0.0.1:{s.coordinator_port}",
                )
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in training.WatchTrainingStatus(
                    training_pb2.WatchTrainingStatusRequest(interval_seconds=0.01),
                    metadata=AUTH,
                    timeout=5,
                ):
                    pass
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(main)


def test_faults_of_the_leader_itself_are_internal() -> None:
    """ERROR INTERNAL and bytes that break the protocol: only the stand-in makes them."""

    async def main() -> None:
        leader = StandInLeader()
        port = await leader.start()
        try:
            async with stack(port) as s:
                for prompt, wording in [
                    ("!internal", "see the tp-leader log"),
                    ("!garbage", "same foundry version"),
                ]:
                    await expect_code(
                        generate(
                            s, inference_pb2.GenerateRequest(prompt=prompt, max_tokens=4), timeout=5
                        ),
                        grpc.StatusCode.INTERNAL,
                        wording,
                    )
                tokens, _ = await generate(
                    s, inference_pb2.GenerateRequest(prompt="hi", max_tokens=4), timeout=5
                )
                assert "".join(t.text for t in tokens) == REPLY[:4]
        finally:
            await leader.stop()

    run(main)


# ---------------------------------------------------------------------------- a rank goes away


def test_a_killed_worker_turns_inference_unavailable_until_it_is_back(pair: Pair) -> None:
    async def main() -> None:
        async with stack(pair.frontend) as s:
            await wait_health(s.channel, INFERENCE_SERVICE, SERVING)
            call = s.inference().Generate(
                inference_pb2.GenerateRequest(prompt=LONG[0], max_tokens=LONG[1]), metadata=AUTH
            )
            got = 0
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in call:
                    got += 1
                    if got == 3:
                        await asyncio.to_thread(pair.kill_worker)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "tensor-parallel worker lost" in (exc.value.details() or "")

            await wait_health(s.channel, INFERENCE_SERVICE, NOT_SERVING, 3)
            assert s.count("foundry_gateway_backend_up", backend="tp_leader") == 0
            # Refused at once for the reason, not left to its 10 s deadline (DEADLINE_EXCEEDED).
            await expect_code(
                generate(s, inference_pb2.GenerateRequest(prompt="hi", max_tokens=4), timeout=10),
                grpc.StatusCode.UNAVAILABLE,
                "not connected",
            )
            status = await s.inference().GetPairStatus(
                inference_pb2.GetPairStatusRequest(), metadata=AUTH, timeout=5
            )
            assert not status.worker_connected

            await asyncio.to_thread(pair.restart_worker)
            await wait_health(s.channel, INFERENCE_SERVICE, SERVING, 3)
            direct = await asyncio.to_thread(pair.generate, PROMPT, 12)
            tokens, done = await generate(
                s, inference_pb2.GenerateRequest(prompt=PROMPT, max_tokens=12), timeout=10
            )
            assert_same(tokens, done, direct)

    run(main, timeout_s=60)


def test_a_killed_leader_breaks_the_link_and_a_new_one_is_used(pair: Pair) -> None:
    """The gateway needs no restart when the leader restarts."""

    async def main() -> None:
        async with stack(pair.frontend) as s:
            await wait_health(s.channel, INFERENCE_SERVICE, SERVING)
            call = s.inference().Generate(
                inference_pb2.GenerateRequest(prompt=LONG[0], max_tokens=LONG[1]), metadata=AUTH
            )
            got = 0
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in call:
                    got += 1
                    if got == 3:
                        await asyncio.to_thread(pair.kill_leader)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "broke" in (exc.value.details() or "")

            await wait_health(s.channel, INFERENCE_SERVICE, NOT_SERVING, 3)
            await expect_code(
                s.inference().GetPairStatus(
                    inference_pb2.GetPairStatusRequest(), metadata=AUTH, timeout=5
                ),
                grpc.StatusCode.UNAVAILABLE,
                f"--frontend-listen 127.0.0.1:{pair.frontend}",
            )
            await expect_code(
                generate(s, inference_pb2.GenerateRequest(prompt="hi", max_tokens=4), timeout=10),
                grpc.StatusCode.UNAVAILABLE,
                "unreachable",
            )

            await asyncio.to_thread(pair.restart_leader)
            await wait_health(s.channel, INFERENCE_SERVICE, SERVING, 5)
            direct = await asyncio.to_thread(pair.generate, PROMPT, 12)
            tokens, done = await generate(
                s, inference_pb2.GenerateRequest(prompt=PROMPT, max_tokens=12), timeout=10
            )
            assert_same(tokens, done, direct)

    run(main, timeout_s=60)


# ---------------------------------------------------------------------------- health


def test_health_follows_the_backends_and_goes_first_on_shutdown(pair: Pair) -> None:
    async def main() -> None:
        async with stack(pair.frontend) as s:
            assert await health_of(s.channel, "") == SERVING
            await wait_health(s.channel, INFERENCE_SERVICE, SERVING)
            # The coordinator of this stack is unreachable.
            assert await health_of(s.channel, "foundry.v1.TrainingService") == NOT_SERVING
            assert await health_of(s.channel, "foundry.v1.ModelService") == NOT_SERVING

            watch = s.health().Watch(health_pb2.HealthCheckRequest(service=""))
            first = await watch.read()
            assert first.status == SERVING
            stopping = asyncio.create_task(s.gateway.stop())
            second = await asyncio.wait_for(watch.read(), 3.0)
            assert second.status == NOT_SERVING
            await stopping

    run(main)


# ---------------------------------------------------------------------------- foundry ctl


def _ctl(target: str, token_file: Path | None, *args: str) -> list[str]:
    auth = ["--token-file", str(token_file)] if token_file else []
    return [sys.executable, "-m", "foundry", "ctl", "--gateway", target, *auth, *args]


async def _run(cmd: list[str]) -> tuple[int, str, str]:
    """A command run while this process's event loop (and so an in-process gateway) runs."""
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=ENV
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_ctl_status_shows_the_pair_and_needs_the_token(pair: Pair, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")

    async def main() -> None:
        async with stack(pair.frontend) as s:
            code, out, err = await _run(_ctl(s.target, token_file, "status"))
            assert code == 1, "the coordinator is down, so status reports a failure"
            assert "pair: worker rank connected" in out, out + err
            assert "rank 0 (leader)  share 1/2" in out and "rank 1 (worker)  share 1/2" in out
            assert "training: unavailable" in out and "--admin-listen" in out
            code, out, err = await _run(_ctl(s.target, None, "pause"))
            assert code == 1
            assert "UNAUTHENTICATED" in err and "--token-file" in err

    run(main, timeout_s=60)


def test_ctl_generate_through_gateway_and_pair_prints_what_foundry_generate_prints(
    model: Path, tmp_path: Path
) -> None:
    """Project issue 6: every piece a process, the pair with its default flags (speculative
    decoding on), greedy text compared byte for byte with one process. The model's text is
    varied (random weights: bytes of every kind, invalid UTF-8 included, so the streamed
    pieces must join exactly as the one process joins them); one prompt runs to EOS."""
    with (
        running_pair(model, tmp_path, flags=()) as p,
        Service(
            [
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--coordinator-admin",
                f"127.0.0.1:{free_port()}",
                "--tp-frontend",
                f"127.0.0.1:{p.frontend}",
            ],
            tmp_path / "gateway.log",
        ) as gateway,
    ):
        target = f"127.0.0.1:{gateway.wait_for(GATEWAY_LINE).group(1)}"
        for prompt, n, finish in [
            ("Hello from the gateway", 80, "max_tokens"),
            ("abc", LONG[1], "eos"),
        ]:
            settings = ["--prompt", prompt, "--max-tokens", str(n), "--temperature", "0"]
            through = subprocess.Popen(
                _ctl(target, None, "generate", *settings, "--stats"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=ENV,
            )
            one = subprocess.Popen(
                [sys.executable, "-m", "foundry", "generate", "--model", str(model), *settings],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=ENV,
            )
            out, err = through.communicate(timeout=60)
            want, one_err = one.communicate(timeout=60)
            assert through.returncode == 0, err.decode()
            assert one.returncode == 0, one_err.decode()
            assert out == want
            text = out.decode()
            assert text.endswith("\n") and len(set(text)) > 10, text
            assert f"finished: {finish}" in err.decode(), err.decode()
        assert gateway.stop() == 0, gateway.text()
