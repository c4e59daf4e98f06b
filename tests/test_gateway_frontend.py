"""The gateway's client of the TP leader's frontend link: multiplexing, cancel, errors, drops.

``StandInLeader`` below is a stand-in for the frontend link of `foundry tp-leader`, which is not
finished yet: a small asyncio server that speaks ``foundry.wire.frontend`` with a scripted
"model" (it spells a fixed reply byte by byte). The end-to-end tests against the real leader
replace it for everything but the failure scripts (errors on demand, silence, dropped links).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import pytest

from foundry.gateway.errors import (
    BackendFailed,
    BackendTimeout,
    BackendUnavailable,
    GatewayError,
    InvalidRequest,
)
from foundry.gateway.frontend_client import FrontendClient
from foundry.wire import frontend as fw

T = TypeVar("T")

REPLY = "the quick brown fox jumps over the lazy dog. "


@dataclass
class StandInLeader:
    """Stand-in for `foundry tp-leader --frontend-listen` (see the module docstring).

    Prompts that start with ``!`` script a failure: ``!bad`` and ``!busy`` answer ERROR
    (BAD_REQUEST, OVERLOADED), ``!drop`` closes the connection after two tokens, ``!mute``
    never answers. ``token_delay_s`` paces the tokens; ``status_delay_s`` delays each STATUS
    answer (in order, as the real leader answers them). Each STATUS carries its sequence
    number in ``tokens_generated``.
    """

    token_delay_s: float = 0.0
    worker_connected: bool = True
    status_delay_s: float = 0.0
    statuses_sent: int = 0
    cancelled: list[int] = field(default_factory=list)
    requests: list[fw.Generate] = field(default_factory=list)
    connections: int = 0
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    cancel_seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Stop listening and drop every connection (as a killed leader would)."""
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._server.wait_closed()

    def status(self) -> fw.Status:
        self.statuses_sent += 1
        return fw.Status(
            0, self.worker_connected, False, len(self._tasks), self.statuses_sent, 2, 64, 259,
            256, 4096, 0xC0FFEE, 0.0, len(self.requests),
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        decoder = fw.FrontendDecoder()
        running: dict[int, asyncio.Task[None]] = {}
        # STATUS answers leave in request order, each after the delay asked at its request,
        # without holding up the reading of CANCEL and GENERATE frames.
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
                while (frame := decoder.next_frame()) is not None:
                    if isinstance(frame, fw.StatusReq):
                        asked.put_nowait(self.status_delay_s)
                    elif isinstance(frame, fw.Cancel):
                        self.cancelled.append(frame.request_id)
                        self.cancel_seen.set()
                        task = running.pop(frame.request_id, None)
                        if task is not None:
                            task.cancel()
                    elif isinstance(frame, fw.Generate):
                        self.requests.append(frame)
                        task = asyncio.create_task(self._generate(frame, writer))
                        running[frame.request_id] = task
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
        except (ConnectionError, fw.FrontendProtocolError):
            pass
        finally:
            answering.cancel()
            for task in running.values():
                task.cancel()
            self._writers.discard(writer)
            writer.close()

    async def _generate(self, req: fw.Generate, writer: asyncio.StreamWriter) -> None:
        rid = req.request_id
        if req.prompt == "!bad":
            writer.write(fw.encode(fw.Error(rid, fw.ErrorCode.BAD_REQUEST, "prompt too long")))
            return
        if req.prompt == "!busy":
            writer.write(fw.encode(fw.Error(rid, fw.ErrorCode.OVERLOADED, "8 sessions busy")))
            return
        if req.prompt == "!mute":
            await asyncio.Event().wait()
        text = ""
        reason = fw.DoneReason.MAX_TOKENS
        try:
            for i in range(req.max_tokens):
                if req.prompt == "!drop" and i == 2:
                    writer.transport.abort()
                    return
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                piece = REPLY[i % len(REPLY)]
                text += piece
                writer.write(fw.encode(fw.Token(rid, 3 + ord(piece), len(req.prompt) + i, piece)))
                if self.token_delay_s == 0 and i % 8 == 7:
                    await asyncio.sleep(0)
                if any(text.endswith(s) for s in req.stop):
                    reason = fw.DoneReason.STOP_STRING
                    break
        except asyncio.CancelledError:
            writer.write(fw.encode(fw.Done(rid, fw.DoneReason.CANCELLED, len(req.prompt), 0, 0.0)))
            raise
        writer.write(fw.encode(fw.Done(rid, reason, len(req.prompt), len(text), 0.01)))


def run(coro_fn: Callable[[], Awaitable[T]], timeout_s: float = 20.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro_fn(), timeout_s)

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def leader_and_client(
    leader: StandInLeader | None = None,
) -> AsyncIterator[tuple[StandInLeader, FrontendClient]]:
    leader = leader or StandInLeader()
    port = await leader.start()
    client = FrontendClient("127.0.0.1", port, connect_timeout_s=2.0)
    try:
        yield leader, client
    finally:
        await client.close()
        await leader.stop()


async def collect(client: FrontendClient, prompt: str, n: int, **kw: object) -> tuple[str, fw.Done]:
    text = ""
    async with client.generate(prompt, n, **kw) as gen:  # type: ignore[arg-type]
        async for event in gen:
            if isinstance(event, fw.Token):
                text += event.text
            else:
                return text, event
    raise AssertionError("the generation ended without DONE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---------------------------------------------------------------------------- tests


def test_generate_streams_tokens_then_done() -> None:
    async def main() -> None:
        async with leader_and_client() as (leader, client):
            text, done = await collect(client, "hi", 12)
            assert text == REPLY[:12]
            assert done.reason is fw.DoneReason.MAX_TOKENS and done.generated_tokens == 12
            text, done = await collect(client, "hi", 40, stop=("fox",))
            assert text == "the quick brown fox" and done.reason is fw.DoneReason.STOP_STRING
            assert leader.connections == 1, "one shared connection for every request"

    run(main)


def test_concurrent_generations_are_demultiplexed() -> None:
    async def main() -> None:
        async with leader_and_client(StandInLeader(token_delay_s=0.001)) as (leader, client):
            results = await asyncio.gather(*(collect(client, f"p{i}", 5 + i) for i in range(8)))
            for i, (text, done) in enumerate(results):
                assert text == REPLY[: 5 + i]
                assert done.generated_tokens == 5 + i
            ids = [r.request_id for r in leader.requests]
            assert len(set(ids)) == 8 and 0 not in ids
            statuses = await asyncio.gather(*(client.status(2.0) for _ in range(5)))
            assert all(s.model_id == 0xC0FFEE for s in statuses)

    run(main)


def test_leaving_a_generation_early_sends_cancel() -> None:
    async def main() -> None:
        async with leader_and_client(StandInLeader(token_delay_s=0.01)) as (leader, client):
            async with client.generate("long", 1000) as gen:
                async for event in gen:
                    assert isinstance(event, fw.Token)
                    break
                rid = gen.request_id
            await asyncio.wait_for(leader.cancel_seen.wait(), 2.0)
            assert leader.cancelled == [rid]
            # The link stays usable, and the late DONE(CANCELLED) of rid is dropped.
            text, _ = await collect(client, "next", 3)
            assert text == REPLY[:3]

    run(main)


def test_a_cancelled_task_sends_cancel() -> None:
    async def main() -> None:
        async with leader_and_client(StandInLeader(token_delay_s=0.01)) as (leader, client):
            task = asyncio.create_task(collect(client, "long", 1000))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(leader.cancel_seen.wait(), 2.0)
            assert len(leader.cancelled) == 1

    run(main)


@pytest.mark.parametrize(
    ("prompt", "error", "code"),
    [
        ("!bad", InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
        ("!busy", BackendFailed, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
def test_leader_errors_map_to_status_codes(
    prompt: str, error: type[GatewayError], code: grpc.StatusCode
) -> None:
    async def main() -> GatewayError:
        async with leader_and_client() as (_, client):
            with pytest.raises(error) as exc:
                await collect(client, prompt, 4)
            return exc.value

    err = run(main)
    assert err.code == code
    assert err.message


def test_a_dropped_link_fails_pending_requests_and_reconnects() -> None:
    async def main() -> None:
        async with leader_and_client(StandInLeader(token_delay_s=0.005)) as (leader, client):
            other = asyncio.create_task(collect(client, "slow", 500))
            with pytest.raises(BackendUnavailable, match="broke"):
                await collect(client, "!drop", 10)
            with pytest.raises(BackendUnavailable):
                await other
            text, _ = await collect(client, "again", 4)
            assert text == REPLY[:4]
            assert leader.connections == 2

    run(main)


def test_unreachable_leader_is_unavailable_with_a_hint() -> None:
    async def main() -> None:
        port = free_port()
        client = FrontendClient("127.0.0.1", port, connect_timeout_s=1.0)
        try:
            with pytest.raises(BackendUnavailable) as exc:
                await client.status(2.0)
            assert f"--frontend-listen 127.0.0.1:{port}" in exc.value.message
            with pytest.raises(BackendUnavailable):
                await collect(client, "x", 3)
        finally:
            await client.close()

    run(main)


def test_status_timeout_keeps_answers_in_order() -> None:
    async def main() -> None:
        leader = StandInLeader(status_delay_s=0.4)
        async with leader_and_client(leader) as (_, client):
            with pytest.raises(BackendTimeout, match="status"):
                await client.status(0.1)
            leader.status_delay_s = 0.0
            # The late answer to the timed-out request arrives first and is not taken for
            # the answer to this one.
            status = await client.status(2.0)
            assert status.tokens_generated == 2

    run(main)


def test_bad_generate_arguments_are_invalid_requests() -> None:
    client = FrontendClient("127.0.0.1", 1)
    with pytest.raises(InvalidRequest, match="stop"):
        client.generate("x", 4, stop=("",))
