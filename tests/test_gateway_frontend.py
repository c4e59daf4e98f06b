"""The gateway's client of the TP leader's frontend link: multiplexing, cancel, errors, drops.

``FrontendClient`` talks to a real pair here: `foundry tp-leader` and `foundry tp-worker` as
processes on 127.0.0.1 (started by tests/tp_harness.py), held by ``Pair``, which also kills and
restarts either rank on the same ports. tests/test_gateway.py uses the same ``Pair``.

``StandInLeader`` remains for the three things a real leader does not do on demand (see its
docstring); every other behaviour is checked against the pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tp_harness import (
    Client,
    LeaderProc,
    Proc,
    Result,
    make_model,
    metric,
    reference_greedy,
    start_leader,
    start_worker,
    wait_paired,
)

from foundry.gateway.errors import (
    BackendFailed,
    BackendTimeout,
    BackendUnavailable,
    InvalidRequest,
)
from foundry.gateway.frontend_client import FrontendClient, TokenGaps
from foundry.model.spec.config import ModelConfig
from foundry.model.text.vocab.byte import decode
from foundry.wire import frontend as fw

T = TypeVar("T")

# Room for a generation long enough to cancel, or to outlive a deadline, mid-stream.
MODEL_CFG = ModelConfig(n_ctx=1024)
# Four generations decode and four wait: a ninth at once is OVERLOADED. Speculative decoding
# off: greedy text then decodes at a steady pace (a draft block can be 3x faster), so LONG
# always outlives a 0.3 s deadline. tests/test_gateway.py checks the default flags too.
PAIR_FLAGS = ("--max-sessions", "4", "--queue", "4", "--spec-mode", "off")
# Greedy on make_model(MODEL_CFG) this prompt meets no EOS: it runs to max_tokens.
LONG = ("long", 1000)
PREFILL_CHUNK = 64  # the leader's default --prefill-chunk
PROMPT = "The gateway multiplexes every generation on one link."


# ---------------------------------------------------------------------------- the real pair


@dataclass
class Pair:
    """A running tp-leader and tp-worker. Either rank can be killed and started again on the
    same ports; a restarted worker, or the old worker after a leader restart, pairs by itself
    (it dials again every 0.2 s at most)."""

    model: Path
    logs: Path
    flags: tuple[str, ...]
    leader: LeaderProc
    worker: Proc
    starts: int = 1

    @property
    def frontend(self) -> int:
        return self.leader.frontend

    def _log(self, rank: str) -> Path:
        self.starts += 1
        return self.logs / f"{rank}-{self.starts}.log"

    def kill_worker(self) -> None:
        self.worker.stop(signal.SIGKILL)

    def restart_worker(self) -> None:
        self.worker = start_worker(self.model, self.leader.port, self._log("worker"))
        wait_paired(self.frontend)

    def kill_leader(self) -> None:
        self.leader.proc.stop(signal.SIGKILL)

    def restart_leader(self) -> None:
        """A new leader on the last one's ports. start_leader asks for port 0; argparse keeps
        the last of a repeated flag, so the ports given here win."""
        old = self.leader
        self.leader = start_leader(
            self.model,
            self._log("leader"),
            *self.flags,
            "--listen",
            f"127.0.0.1:{old.port}",
            "--frontend-listen",
            f"127.0.0.1:{old.frontend}",
        )
        wait_paired(self.frontend)

    def stall_leader(self) -> None:
        """SIGSTOP: the leader's sockets stay open and nothing answers (a hung process)."""
        os.kill(self.leader.proc.pid, signal.SIGSTOP)

    def resume_leader(self) -> None:
        os.kill(self.leader.proc.pid, signal.SIGCONT)

    def status(self) -> fw.Status:
        """The leader's STATUS, asked on a connection of its own."""
        with Client(self.frontend) as c:
            return c.status()

    def generate(
        self,
        prompt: str,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: tuple[str, ...] = (),
    ) -> Result:
        """A generation on a connection of its own, straight to the leader."""
        with Client(self.frontend) as c:
            return c.generate(
                prompt, max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop
            )

    def requests(self, outcome: str) -> float:
        """The leader's ``foundry_tp_requests_total{outcome=...}`` (counts since its start)."""
        assert self.leader.metrics is not None
        try:
            return metric(self.leader.metrics, f'foundry_tp_requests_total{{outcome="{outcome}"}}')
        except AssertionError:  # a label is exposed from its first count on
            return 0.0

    def wait_cancelled(self, before: float, n: int = 1, within_s: float = 10.0) -> fw.Status:
        """Wait until the leader has ended ``n`` more requests as cancelled, then check that
        it decodes nothing: no session open, no token generated in the next 0.3 s."""
        deadline = time.monotonic() + within_s
        while (now := self.requests("cancelled")) < before + n:
            assert time.monotonic() < deadline, f"{now - before:g} of {n} requests cancelled"
            time.sleep(0.02)
        first = self.status()
        time.sleep(0.3)
        second = self.status()
        assert first.active_sessions == second.active_sessions == 0, second
        assert second.tokens_generated == first.tokens_generated, "the pair kept decoding"
        return second

    def stop(self) -> None:
        if self.leader.proc.popen.poll() is None:
            self.resume_leader()  # a test that failed while it was stalled
        try:
            assert self.leader.proc.stop() == 0, self.leader.proc.text()
        finally:
            # The leader's STOP ends the worker; without it, the worker is stopped here.
            assert self.worker.exit_code() == 0, self.worker.text()


@contextlib.contextmanager
def running_pair(model: Path, logs: Path, flags: tuple[str, ...] = PAIR_FLAGS) -> Iterator[Pair]:
    leader = start_leader(model, logs / "leader-1.log", *flags)
    worker = start_worker(model, leader.port, logs / "worker-1.log")
    pair = Pair(model, logs, flags, leader, worker)
    try:
        wait_paired(leader.frontend)
        yield pair
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "model.gguf", MODEL_CFG)


@pytest.fixture(scope="module")
def pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with running_pair(model, tmp_path_factory.mktemp("pair")) as p:
        yield p


# ---------------------------------------------------------------------------- the stand-in


REPLY = "the quick brown fox jumps over the lazy dog. "


@dataclass
class StandInLeader:
    """A scripted stand-in for `foundry tp-leader --frontend-listen`, for what the real leader
    does not do on demand:

    - answer one STATUS_REQ late and the next at once, each answer telling which request it
      answers (``status_delay_s``; the sequence number is in ``tokens_generated``). The real
      leader answers every STATUS_REQ at once, in order; stalling it (SIGSTOP) delays all
      answers alike, and they carry the same numbers;
    - ERROR INTERNAL (prompt ``!internal``): the real leader sends it only when it has no memory
      for a session;
    - bytes that break the frontend protocol (prompt ``!garbage``: two tokens, then a frame
      header with a wrong magic), as a leader of another foundry version would.

    Any other prompt is answered by spelling ``REPLY``, one character per token.
    """

    status_delay_s: float = 0.0
    statuses_sent: int = 0
    requests: list[fw.Generate] = field(default_factory=list)
    connections: int = 0
    port: int = 0
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _serving: set[asyncio.Task[object]] = field(default_factory=set)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        # Each connection's handler ends on its own once its transport is gone.
        await asyncio.gather(*self._serving)
        await self._server.wait_closed()

    def status(self) -> fw.Status:
        self.statuses_sent += 1
        return fw.Status(
            0,
            True,
            False,
            0,
            self.statuses_sent,
            2,
            64,
            259,
            256,
            4096,
            0xC0FFEE,
            0.0,
            len(self.requests),
            2,
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        decoder = fw.FrontendDecoder()
        # STATUS answers leave in request order, each after the delay asked at its request,
        # without holding up the reading of the frames behind it.
        asked: asyncio.Queue[float] = asyncio.Queue()

        async def answer_statuses() -> None:
            while True:
                delay = await asked.get()
                if delay:
                    await asyncio.sleep(delay)
                writer.write(fw.encode(self.status()))

        answering = asyncio.create_task(answer_statuses())
        try:
            while data := await reader.read(65536):
                decoder.feed(data)
                while (frame := decoder.next_event()) is not None:
                    if isinstance(frame, fw.StatusReq):
                        asked.put_nowait(self.status_delay_s)
                    elif isinstance(frame, fw.Generate):
                        self.requests.append(frame)
                        self._generate(frame, writer)
        except (ConnectionError, fw.FrontendProtocolError):
            pass
        finally:
            answering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await answering
            self._writers.discard(writer)
            self._serving.discard(task)
            writer.close()

    def _generate(self, req: fw.Generate, writer: asyncio.StreamWriter) -> None:
        rid = req.request_id
        if req.prompt == "!internal":
            writer.write(fw.encode(fw.Error(rid, fw.ErrorCode.INTERNAL, "no memory for a session")))
            return
        text = REPLY[: req.max_tokens]
        for i, piece in enumerate(text):
            if req.prompt == "!garbage" and i == 2:
                writer.write(fw.HEADER.pack(0x12345678, fw.FrameType.TOKEN, rid, 0))
                return
            writer.write(fw.encode(fw.Token(rid, 3 + ord(piece), len(req.prompt) + i, piece)))
        reason = fw.DoneReason.MAX_TOKENS
        writer.write(fw.encode(fw.Done(rid, reason, len(req.prompt) + 1, len(text), 0.01)))


# ---------------------------------------------------------------------------- helpers


def run(coro_fn: Callable[[], Awaitable[T]], timeout_s: float = 20.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro_fn(), timeout_s)

    return asyncio.run(bounded())


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


async def expect_code(awaitable: object, code: grpc.StatusCode, wording: str = "") -> str:
    """Await a gRPC call that must fail with ``code`` and say ``wording``; its details."""
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await awaitable  # type: ignore[misc]
    assert exc.value.code() == code, exc.value.details()
    details = exc.value.details() or ""
    assert wording in details, details
    return details


async def health_of(channel: grpc.aio.Channel, service: str) -> int:
    """The standard health check's status of ``service`` ("" is the server as a whole)."""
    got = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=2
    )
    status: int = got.status
    return status


async def wait_health(
    channel: grpc.aio.Channel, service: str, want: int, within_s: float = 5.0
) -> None:
    deadline = time.monotonic() + within_s
    while (got := await health_of(channel, service)) != want:
        assert time.monotonic() < deadline, f"{service!r} stayed {got}, wanted {want}"
        await asyncio.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---------------------------------------------------------------------------- tests


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
