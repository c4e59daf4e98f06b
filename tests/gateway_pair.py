"""A real tensor-parallel pair for the gateway's tests, a stand-in leader, and their helpers.

``Pair`` holds `foundry tp-leader` and `foundry tp-worker` as processes on 127.0.0.1 (started by
tests/tp_harness.py), and kills and restarts either rank on the same ports.
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
from collections.abc import Awaitable, Callable, Iterator
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
    metric,
    start_leader,
    start_worker,
    wait_paired,
)

from foundry.model.spec.config import ModelConfig
from foundry.wire import frontend as fw

T = TypeVar("T")

# Room for a generation long enough to cancel, or to outlive a deadline, mid-stream.
MODEL_CFG = ModelConfig(n_ctx=1024)

# Four generations decode and four wait: a ninth at once is OVERLOADED. Speculative decoding
# off: greedy text then decodes at a steady pace (a draft block can be 3x faster), so LONG
# always outlives a 0.3 s deadline. tests/test_gateway_ctl.py checks the default flags too.
PAIR_FLAGS = ("--max-sessions", "4", "--queue", "4", "--spec-mode", "off")

# Greedy on make_model(MODEL_CFG) this prompt meets no EOS: it runs to max_tokens.
LONG = ("long", 1000)
PREFILL_CHUNK = 64  # the leader's default --prefill-chunk
PROMPT = "The gateway multiplexes every generation on one link."


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


def run(coro_fn: Callable[[], Awaitable[T]], timeout_s: float = 20.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro_fn(), timeout_s)

    return asyncio.run(bounded())


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
