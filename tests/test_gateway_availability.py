"""The gateway when a rank of its pair goes away (killed, then back) and its health service.

The pair is `foundry tp-leader` + `foundry tp-worker` as processes (``Pair``, from
tests/gateway_pair.py); the gateway runs in this process (tests/gateway_stack.py).
Tests here kill and restart the pair's ranks.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from gateway_pair import LONG, PROMPT, Pair, expect_code, health_of, run, wait_health
from gateway_stack import AUTH, NOT_SERVING, SERVING, assert_same, generate, stack
from grpc_health.v1 import health_pb2

from foundry.api.v1 import inference_pb2
from foundry.gateway.server import INFERENCE_SERVICE


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
