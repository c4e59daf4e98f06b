"""The gateway's status codes in front of a real pair: bad requests, the leader's refusals, an
unreachable coordinator, and INTERNAL, which only ``StandInLeader`` produces on demand.

The pair is `foundry tp-leader` + `foundry tp-worker` as processes (``Pair``, from
tests/gateway_pair.py); the gateway runs in this process (tests/gateway_stack.py).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from gateway_pair import LONG, REPLY, Pair, StandInLeader, expect_code, run
from gateway_stack import AUTH, generate, stack

from foundry.api.v1 import inference_pb2, model_pb2, model_pb2_grpc, training_pb2
from foundry.wire import frontend as fw


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
