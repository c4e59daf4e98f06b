"""The gateway's generation in front of a real pair: GetPairStatus, streaming, a backlog in
fewer messages, cancel, deadlines (also against a stalled leader).

The pair is `foundry tp-leader` + `foundry tp-worker` as processes (``Pair``, from
tests/gateway_pair.py); the gateway runs in this process (tests/gateway_stack.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from gateway_pair import LONG, MODEL_CFG, PREFILL_CHUNK, PROMPT, Pair, expect_code, run, wait_health
from gateway_stack import AUTH, NOT_SERVING, SERVING, assert_same, generate, stack
from procs import wait_for
from tp_harness import reference_greedy

from foundry.api.v1 import inference_pb2
from foundry.gateway.server import INFERENCE_SERVICE
from foundry.gateway.servicers import MAX_TOKENS_PER_RESPONSE
from foundry.wire import frontend as fw

GENERATE = "foundry.v1.InferenceService/Generate"


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
