"""The gateway's client of the TP leader's frontend link: multiplexing, cancel, errors, drops.

``FrontendClient`` talks to a real pair here (``Pair``, tests/gateway_pair.py):
`foundry tp-leader` and `foundry tp-worker` as processes on 127.0.0.1. ``StandInLeader`` serves
the three things a real leader does not do on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from gateway_pair import LONG, PREFILL_CHUNK, PROMPT, REPLY, Pair, StandInLeader, free_port, run
from tp_harness import reference_greedy

from foundry.gateway.errors import BackendFailed, BackendTimeout, BackendUnavailable, InvalidRequest
from foundry.gateway.frontend_client import FrontendClient, TokenGaps
from foundry.model.text.vocab.byte import decode
from foundry.wire import frontend as fw


@contextlib.asynccontextmanager
async def client_of(port: int) -> AsyncIterator[FrontendClient]:
    client = FrontendClient("127.0.0.1", port, connect_timeout_s=2.0)
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def stand_in_and_client(
    leader: StandInLeader | None = None,
) -> AsyncIterator[tuple[StandInLeader, FrontendClient]]:
    leader = leader or StandInLeader()
    port = await leader.start()
    try:
        async with client_of(port) as client:
            yield leader, client
    finally:
        await leader.stop()


async def collect(
    client: FrontendClient, prompt: str, n: int, **kw: object
) -> tuple[list[fw.Token], fw.Done]:
    tokens: list[fw.Token] = []
    async with client.generate(prompt, n, **kw) as gen:  # type: ignore[arg-type]
        async for event in gen:
            if isinstance(event, fw.Token):
                tokens.append(event)
            else:
                return tokens, event
    raise AssertionError("the generation ended without DONE")


def text_of(tokens: list[fw.Token]) -> str:
    return "".join(t.text for t in tokens)


async def stream_until_cancelled(client: FrontendClient, started: asyncio.Event) -> None:
    """Consume LONG, setting ``started`` at its first token; it must not end by itself."""
    async with client.generate(*LONG) as gen:
        async for event in gen:
            assert isinstance(event, fw.Token), event
            started.set()


def test_generate_streams_tokens_then_done(model: Path, pair: Pair) -> None:
    ref = reference_greedy(model, PROMPT, 24, PREFILL_CHUNK)
    text = decode(ref.tokens)
    stop = text[10:13]
    cut = text.find(stop)

    async def main() -> None:
        async with client_of(pair.frontend) as client:
            tokens, done = await collect(client, PROMPT, 24)
            assert [t.token for t in tokens] == ref.tokens and text_of(tokens) == text
            n_prompt = len(PROMPT) + 1
            assert [t.position for t in tokens] == list(range(n_prompt, n_prompt + 24))
            assert done.reason is fw.DoneReason.MAX_TOKENS
            assert (done.prompt_tokens, done.generated_tokens) == (n_prompt, 24)
            link = client._link
            tokens, done = await collect(client, PROMPT, 24, stop=(stop,))
            assert text_of(tokens) == text[:cut] and done.reason is fw.DoneReason.STOP_STRING
            assert client._link is link, "one shared connection for every request"

    run(main)


def test_concurrent_generations_are_demultiplexed(pair: Pair) -> None:
    prompts = [f"Request {i}: " + "abc " * i for i in range(8)]
    kinds: list[dict[str, object]] = [
        {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": i} for i in range(8)
    ]
    model_id = pair.status().model_id

    async def main() -> None:
        async with client_of(pair.frontend) as client:
            alone = [await collect(client, p, 20, **k) for p, k in zip(prompts, kinds, strict=True)]
            together = await asyncio.gather(
                *(collect(client, p, 20, **k) for p, k in zip(prompts, kinds, strict=True))
            )
            for (a_tokens, a_done), (b_tokens, b_done) in zip(alone, together, strict=True):
                assert [(t.token, t.position, t.text) for t in a_tokens] == [
                    (t.token, t.position, t.text) for t in b_tokens
                ]
                assert (a_done.reason, a_done.generated_tokens) == (
                    b_done.reason,
                    b_done.generated_tokens,
                )
            # Eight different ids were in use at once: the leader refuses an id in use.
            assert len({done.request_id for _, done in together}) == 8
            statuses = await asyncio.gather(*(client.status(5.0) for _ in range(5)))
            assert all(s.model_id == model_id for s in statuses)

    run(main)


def test_leaving_a_generation_early_sends_cancel(pair: Pair) -> None:
    before, tokens_before = pair.requests("cancelled"), pair.status().tokens_generated

    async def main() -> None:
        async with client_of(pair.frontend) as client:
            async with client.generate(*LONG) as gen:
                async for event in gen:
                    assert isinstance(event, fw.Token)
                    break
            status = await asyncio.to_thread(pair.wait_cancelled, before)
            assert status.tokens_generated - tokens_before < LONG[1]
            # The link stays usable; the late DONE(CANCELLED) of the left request is dropped.
            tokens, done = await collect(client, "next", 3)
            assert len(tokens) == done.generated_tokens == 3

    run(main)


def test_a_cancelled_task_sends_cancel(pair: Pair) -> None:
    before = pair.requests("cancelled")

    async def main() -> None:
        async with client_of(pair.frontend) as client:
            started = asyncio.Event()
            task = asyncio.create_task(stream_until_cancelled(client, started))
            await asyncio.wait_for(started.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.to_thread(pair.wait_cancelled, before)

    run(main)


def test_the_leaders_refusals_map_to_status_codes(pair: Pair) -> None:
    before = pair.requests("cancelled")

    async def main() -> None:
        async with client_of(pair.frontend) as client:
            with pytest.raises(InvalidRequest) as bad:
                await collect(client, "x" * 1100, 4)
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "longer than the context of 1024" in bad.value.message
            async with contextlib.AsyncExitStack() as running:
                for _ in range(8):  # four decode, four wait
                    await running.enter_async_context(client.generate(*LONG))
                with pytest.raises(BackendFailed) as busy:
                    await collect(client, *LONG)
            assert busy.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry later" in busy.value.message
            await asyncio.to_thread(pair.wait_cancelled, before, 8)

    run(main)


def test_a_dropped_link_fails_pending_requests_and_reconnects(pair: Pair) -> None:
    """kill -9 of the leader mid-generation, then a new leader on the same port."""

    async def main() -> None:
        async with client_of(pair.frontend) as client:
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(stream_until_cancelled(client, e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
            await asyncio.to_thread(pair.kill_leader)
            for task in tasks:
                with pytest.raises(BackendUnavailable, match="broke"):
                    await task
            with pytest.raises(
                BackendUnavailable, match=f"--frontend-listen 127.0.0.1:{pair.frontend}"
            ):
                await client.status(2.0)
            await asyncio.to_thread(pair.restart_leader)
            tokens, done = await collect(client, "again", 4)
            assert len(tokens) == done.generated_tokens == 4

    run(main, timeout_s=60)


def test_unreachable_leader_is_unavailable_with_a_hint() -> None:
    async def main() -> None:
        port = free_port()
        async with client_of(port) as client:
            with pytest.raises(BackendUnavailable) as exc:
                await client.status(2.0)
            assert f"--frontend-listen 127.0.0.1:{port}" in exc.value.message
            with pytest.raises(BackendUnavailable):
                await collect(client, "x", 3)

    run(main)


def test_status_timeout_keeps_answers_in_order() -> None:
    async def main() -> None:
        leader = StandInLeader(status_delay_s=0.4)
        async with stand_in_and_client(leader) as (_, client):
            with pytest.raises(BackendTimeout, match="status"):
                await client.status(0.1)
            leader.status_delay_s = 0.0
            # The late answer to the timed-out request arrives first and is not taken for
            # the answer to this one.
            status = await client.status(2.0)
            assert status.tokens_generated == 2

    run(main)


def test_an_internal_error_and_bytes_that_break_the_protocol() -> None:
    async def main() -> None:
        async with stand_in_and_client() as (leader, client):
            with pytest.raises(BackendFailed) as exc:
                await collect(client, "!internal", 4)
            assert exc.value.code == grpc.StatusCode.INTERNAL
            assert "no memory for a session; see the tp-leader log" in exc.value.message
            with pytest.raises(BackendFailed) as exc:
                await collect(client, "!garbage", 4)
            assert exc.value.code == grpc.StatusCode.INTERNAL
            assert "same foundry version" in exc.value.message
            # The link is closed after bad bytes; the next request opens a new one.
            tokens, _ = await collect(client, "hi", 5)
            assert text_of(tokens) == REPLY[:5]
            assert leader.connections == 2

    run(main)


def test_a_batch_takes_what_is_ready_and_an_error_waits_behind_its_tokens() -> None:
    """The stand-in writes a whole answer at once; after a pause every frame of it is queued."""

    async def main() -> None:
        async with stand_in_and_client() as (_, client):
            async with client.generate("hi", 5) as gen:
                await asyncio.sleep(0.2)
                first = await gen.batch(3)
                assert gen.gaps == []  # the first batch's tokens are time to first token's
                rest = await gen.batch(256)
                assert len(gen.gaps) == 2 and gen.gaps[0] == gen.gaps[1] >= 0  # k = 2 tokens
                assert await gen.batch(256) == [] and gen.gaps == []
            assert [type(e) for e in first + rest] == [fw.Token] * 5 + [fw.Done]
            assert "".join(e.text for e in first + rest if isinstance(e, fw.Token)) == REPLY[:5]
            async with client.generate("!garbage", 4) as gen:
                await asyncio.sleep(0.2)
                # The two tokens before the bad bytes come first; the error with the next take.
                tokens = await gen.batch(256)
                assert "".join(e.text for e in tokens if isinstance(e, fw.Token)) == REPLY[:2]
                with pytest.raises(BackendFailed, match="same foundry version"):
                    await gen.batch(256)

    run(main)


def test_token_gaps_spread_a_batchs_wait_over_its_tokens() -> None:
    """Inter-token latency as the load bench counts it: a batch of k tokens taken t after the
    previous batch of tokens is k gaps of t / k; logprobs and Done count no token."""

    def tok(i: int) -> fw.Token:
        return fw.Token(1, i, i, "x")

    lp = fw.Logprobs(1, 7, -0.5, b"x", ())
    done = fw.Done(1, fw.DoneReason.MAX_TOKENS, 3, 6, 1.0)
    gaps = TokenGaps()
    assert gaps.take([tok(0), tok(1)], 10.0) == []  # the first batch: no gap
    assert gaps.take([lp, tok(2)], 10.5) == [0.5]
    assert gaps.take([tok(3), lp, tok(4), tok(5)], 11.1) == pytest.approx([0.2] * 3)
    assert gaps.take([done], 12.0) == []  # nothing measured, and the clock stays
    assert gaps.take([tok(6)], 11.5) == pytest.approx([0.4])


def test_bad_generate_arguments_are_invalid_requests() -> None:
    client = FrontendClient("127.0.0.1", 1)
    with pytest.raises(InvalidRequest, match="stop"):
        client.generate("x", 4, stop=("",))
    # What a frontend frame cannot carry is the caller's error, not the gateway's.
    with pytest.raises(InvalidRequest, match="shorten the prompt"):
        client.generate("x" * fw.MAX_PAYLOAD, 4)
    with pytest.raises(InvalidRequest, match="stop string of 70000 bytes"):
        client.generate("x", 4, stop=("y" * 70000,))
