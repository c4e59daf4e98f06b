"""Client of the tensor-parallel leader's frontend link: one connection, many generations.

Theory of operation
-------------------
One TCP connection to the leader carries every request of the gateway (``foundry.wire.frontend``
frames). A reader task decodes the frames and routes each by ``request_id`` to the queue of its
generation. GENERATE ids are allocated here (1 .. 2**32 - 1, skipping ids in use). Status
requests use id 0 and are matched to their answers in order: the leader answers STATUS_REQ as
it reads it, so a first-in first-out list of waiters pairs each STATUS with its request.

The connection is opened on first use, and again on the first use after it broke. When it
breaks, every pending request fails with UNAVAILABLE: a generation cannot continue on a new
connection, because its session on the pair belonged to the old one.

A reader of a generation takes its events one by one (``async for``) or as batches
(``Generation.batch``): the next event, waiting for it, then the events already received, without
waiting. The gateway sends each batch as one gRPC message, so a stream that falls behind the pair
catches up in fewer, larger messages and one that keeps up sends one token per message; nothing
waits to fill a batch. An error received behind tokens is raised only after those tokens have
been taken. Each batch also gives the inter-token latency of its tokens (``Generation.gaps``,
:class:`TokenGaps`), which the gateway's metrics observe.

Leaving a ``Generation`` before its DONE (the gRPC call was cancelled, or its deadline passed)
sends CANCEL, so the pair stops decoding at the next token. The write is synchronous (no
``await``), so it happens even while the leaving task is being cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import ssl as ssl_lib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from foundry.gateway.errors import (
    BackendFailed,
    BackendTimeout,
    BackendUnavailable,
    GatewayError,
    InvalidRequest,
)
from foundry.transport.stream import AsyncStream
from foundry.wire.errors import LocalProtocolError, ProtocolError
from foundry.wire.frontend import (
    MAX_PAYLOAD,
    Cancel,
    Done,
    Error,
    ErrorCode,
    Frame,
    FrontendDecoder,
    Generate,
    Logprobs,
    Status,
    StatusReq,
    Token,
    encode,
)

log = logging.getLogger("foundry.gateway.frontend")

# Bytes asked of the socket per read: many token frames (about 20 bytes each) per wake-up.
READ_CHUNK = 64 * 1024
# A frame of the leader's, once begun, must be complete within this (the leader's own default
# frame deadline): a leader stopped in mid-frame fails its generations instead of hanging them.
FRAME_DEADLINE_S = 30.0
MAX_REQUEST_ID = 0xFFFFFFFF
# A stop string's length is a u16 on the frontend link.
MAX_STOP_BYTES = 0xFFFF
STATUS_REQUEST_ID = 0

# What a generation's reader takes: tokens (each after its LOGPROBS when asked), then DONE.
Event = Token | Logprobs | Done


class TokenGaps:
    """Inter-token latency of one generation as its reader takes the tokens: a batch of k
    tokens taken t seconds after the previous batch of tokens counts k gaps of t / k (as
    ``bench/performance/serve_load.py`` counts them); the first batch's tokens are the time to
    first token's, no gap, and a batch without tokens (the Done alone) counts none."""

    def __init__(self) -> None:
        self._last: float | None = None

    def take(self, events: Sequence[Event], now: float) -> list[float]:
        """The gaps of the tokens among ``events``, taken at ``now`` (seconds, monotonic)."""
        k = sum(1 for e in events if isinstance(e, Token))
        if k == 0:
            return []
        last, self._last = self._last, now
        return [] if last is None else [(now - last) / k] * k


# The leader's ERROR codes as gRPC status codes; an unknown code is the leader's fault.
ERROR_STATUS: dict[int, grpc.StatusCode] = {
    ErrorCode.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}
_HINTS: dict[int, str] = {
    ErrorCode.UNAVAILABLE: "; retry in a few seconds",
    ErrorCode.OVERLOADED: "; retry later or lower the number of concurrent generations",
    ErrorCode.INTERNAL: "; see the tp-leader log",
}


def error_from_frame(frame: Error, address: str) -> GatewayError:
    """The leader's ERROR frame as the gateway error to answer the call with."""
    code = ERROR_STATUS.get(frame.code, grpc.StatusCode.INTERNAL)
    hint = _HINTS.get(frame.code, "")
    if frame.code == ErrorCode.BAD_REQUEST:
        return InvalidRequest(f"the TP leader refused the request: {frame.message}")
    return BackendFailed(f"TP leader at {address}: {frame.message}{hint}", code)


@dataclass
class _Link:
    """One open connection and the requests waiting on it."""

    writer: asyncio.StreamWriter
    pending: dict[int, asyncio.Queue[Frame | GatewayError]] = field(default_factory=dict)
    status_waiters: collections.deque[asyncio.Future[Status]] = field(
        default_factory=collections.deque
    )
    broken: GatewayError | None = None
    reader_task: asyncio.Task[None] | None = None

    def fail(self, error: GatewayError) -> None:
        """Mark the link dead and fail everything waiting on it (idempotent)."""
        if self.broken is not None:
            return
        self.broken = error
        for queue in self.pending.values():
            queue.put_nowait(error)
        self.pending.clear()
        while self.status_waiters:
            fut = self.status_waiters.popleft()
            if not fut.done():
                fut.set_exception(error)
        self.writer.close()


class Generation:
    """One generation in flight: ``async with`` it, then ``async for`` its Token frames and
    the final Done, or take them in batches (``batch``). An ERROR from the leader or a broken
    link is raised as a GatewayError."""

    def __init__(self, client: FrontendClient, request: Generate) -> None:
        self._client = client
        self._request = request
        self._link: _Link | None = None
        self._queue: asyncio.Queue[Frame | GatewayError] = asyncio.Queue()
        # An error found behind the events of a batch: raised by the next take.
        self._held: Frame | GatewayError | None = None
        self.request_id = 0
        self.finished = False
        self._clock = TokenGaps()
        self.gaps: list[float] = []  # the inter-token gaps of the last batch's tokens

    async def __aenter__(self) -> Generation:
        link = await self._client._connected()
        self.request_id = self._client._allocate_id(link)
        link.pending[self.request_id] = self._queue
        self._link = link
        frame = dataclasses.replace(self._request, request_id=self.request_id)
        try:
            await self._client._write(link, encode(frame))
        except BaseException:
            self.close()  # cancelled mid-write: the leader may have the request already
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening; CANCEL on the link if the generation has not ended."""
        link = self._link
        if link is None or self.finished:
            return
        self.finished = True
        link.pending.pop(self.request_id, None)
        # A held error has ended the request already, and the link has let its id go.
        if self._held is None and link.broken is None and not link.writer.is_closing():
            link.writer.write(encode(Cancel(self.request_id)))

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Event:
        if self.finished:
            raise StopAsyncIteration
        return self._event(await self._next_item())

    async def batch(self, limit: int) -> list[Event]:
        """The next event, waiting for it, then the events already received, without waiting:
        at most ``limit`` in all, the Done last if it is among them; [] once the generation has
        ended. An error behind the first event is kept for the next call, so that the tokens
        before it are delivered first. ``gaps`` then holds the batch's inter-token gaps."""
        self.gaps = []
        if self.finished:
            return []
        events = [self._event(await self._next_item())]
        while len(events) < limit and not self.finished:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            if not isinstance(item, Token | Logprobs | Done):
                self._held = item
                break
            events.append(self._event(item))
        self.gaps = self._clock.take(events, time.monotonic())
        return events

    async def _next_item(self) -> Frame | GatewayError:
        item, self._held = self._held, None
        return item if item is not None else await self._queue.get()

    def _event(self, item: Frame | GatewayError) -> Event:
        """A received item as the event it is, or the error it carries raised."""
        if isinstance(item, Token | Logprobs):
            return item
        self.finished = True
        if isinstance(item, Done):
            return item
        if isinstance(item, GatewayError):
            raise item
        if isinstance(item, Error):
            raise error_from_frame(item, self._client.address)
        raise BackendFailed(
            f"the TP leader at {self._client.address} answered a generation with "
            f"{type(item).__name__}; are the gateway and the leader the same foundry version?"
        )


class FrontendClient:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = 5.0,
        ssl: ssl_lib.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self._ssl = ssl
        self._link: _Link | None = None
        self._connect_lock = asyncio.Lock()
        self._ever_connected = False  # a refusal before the first link: not up yet
        self._next_id = 1

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def generate(
        self,
        prompt: str,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: tuple[str, ...] = (),
        *,
        top_k: int = 0,
        logprobs: bool = False,
        top_logprobs: int = 0,
        messages: tuple[tuple[str, str], ...] = (),
    ) -> Generation:
        """A generation of ``prompt``, or of a reply to ``messages`` (role, content) rendered
        by the leader's chat template; see ``wire.frontend.Generate`` for the fields."""
        try:
            request = Generate(
                0,
                prompt,
                max_tokens,
                temperature,
                top_p,
                seed,
                stop,
                top_k=top_k,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                messages=messages,
            )
            longest = max((len(s.encode("utf-8")) for s in stop), default=0)
            if longest > MAX_STOP_BYTES:
                raise InvalidRequest(
                    f"a stop string of {longest} bytes is longer than the "
                    f"{MAX_STOP_BYTES} the frontend link carries"
                )
            size = len(request.payload())
        except (LocalProtocolError, ValueError) as exc:  # ValueError: a lone surrogate
            raise InvalidRequest(str(exc)) from None
        if size > MAX_PAYLOAD:
            raise InvalidRequest(
                f"the prompt and stop strings take {size} bytes, more than the {MAX_PAYLOAD} "
                f"a frontend frame carries; shorten the prompt (the model's context holds "
                f"far fewer tokens)"
            )
        return Generation(self, request)

    async def status(self, timeout_s: float) -> Status:
        async def ask() -> Status:
            link = await self._connected()
            fut: asyncio.Future[Status] = asyncio.get_running_loop().create_future()
            link.status_waiters.append(fut)
            await self._write(link, encode(StatusReq(STATUS_REQUEST_ID)))
            return await fut

        try:
            return await asyncio.wait_for(ask(), timeout_s)
        except TimeoutError:
            raise BackendTimeout(
                f"the TP leader at {self.address} did not answer a status request within "
                f"{timeout_s:.3g} s"
            ) from None

    def fail_inflight(self, why: str) -> None:
        """The leader stopped answering (the health probe says so): every request on the link
        fails now with UNAVAILABLE, and the next one dials again."""
        link, self._link = self._link, None
        if link is None or link.broken is not None:
            return
        if link.pending:
            log.warning("failing %d generation(s) in flight: %s", len(link.pending), why)
        link.fail(
            BackendUnavailable(
                f"the TP leader at {self.address} stopped making progress ({why}); the generation "
                "was failed, retry once the pair is back"
            )
        )
        if link.reader_task is not None:
            link.reader_task.cancel()

    async def close(self) -> None:
        link, self._link = self._link, None
        if link is None:
            return
        link.fail(BackendUnavailable("the gateway is shutting down"))
        if link.reader_task is not None:
            link.reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await link.reader_task

    # ------------------------------------------------------------------ internals

    async def _connected(self) -> _Link:
        link = self._link
        if link is not None and link.broken is None:
            return link
        async with self._connect_lock:
            link = self._link
            if link is not None and link.broken is None:
                return link
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port, ssl=self._ssl),
                    self.connect_timeout_s,
                )
            except (OSError, TimeoutError) as exc:
                if not self._ever_connected:
                    # Not down: not up yet (`foundry up` starts the pair after training).
                    raise BackendUnavailable(
                        f"no tensor-parallel pair at {self.address} yet (not reached since "
                        "the gateway started; `foundry up` starts it once training is done, "
                        f"by hand `foundry tp-leader --frontend-listen {self.address}`)"
                    ) from None
                raise BackendUnavailable(
                    f"TP leader frontend link {self.address} unreachable: "
                    f"{exc or type(exc).__name__}; is `foundry tp-leader` running with "
                    f"--frontend-listen {self.address}?"
                ) from None
            self._ever_connected = True
            link = _Link(writer)
            stream: AsyncStream[Frame] = AsyncStream(
                reader,
                writer,
                FrontendDecoder(),
                frame_deadline_s=FRAME_DEADLINE_S,
                read_chunk=READ_CHUNK,
            )
            link.reader_task = asyncio.create_task(self._read_loop(link, stream))
            self._link = link
            log.info("frontend link to %s open", self.address)
            return link

    def _allocate_id(self, link: _Link) -> int:
        for _ in range(len(link.pending) + 1):
            rid = self._next_id
            self._next_id = rid % MAX_REQUEST_ID + 1
            if rid not in link.pending:
                return rid
        raise AssertionError("unreachable: one of len(pending) + 1 ids is free")

    async def _write(self, link: _Link, data: bytes) -> None:
        if link.broken is not None:
            raise link.broken
        link.writer.write(data)
        try:
            await link.writer.drain()
        except (OSError, ConnectionError) as exc:
            error = self._broken(exc)
            link.fail(error)
            raise error from None

    def _broken(self, exc: BaseException) -> BackendUnavailable:
        return BackendUnavailable(
            f"the frontend link to the TP leader at {self.address} broke: "
            f"{exc or type(exc).__name__}; retry once the leader is back"
        )

    async def _read_loop(self, link: _Link, stream: AsyncStream[Frame]) -> None:
        try:
            while True:
                self._dispatch(link, await stream.recv())
        except (OSError, ConnectionError) as exc:  # StreamClosed and FrameTimeout included
            log.warning("frontend link to %s lost: %s", self.address, exc)
            link.fail(self._broken(exc))
        except ProtocolError as exc:
            log.error("frontend link to %s: bad bytes from the leader: %s", self.address, exc)
            link.fail(
                BackendFailed(
                    f"the TP leader at {self.address} sent bytes that break the frontend "
                    f"protocol ({exc}); are the gateway and the leader the same foundry version?"
                )
            )

    def _dispatch(self, link: _Link, frame: Frame) -> None:
        if isinstance(frame, Status):
            self._answer_status(link, frame)
            return
        if isinstance(frame, Token | Logprobs | Done | Error):
            queue = link.pending.get(frame.request_id)
            if queue is not None:
                queue.put_nowait(frame)
                if not isinstance(frame, Token | Logprobs):
                    del link.pending[frame.request_id]
                return
            if isinstance(frame, Error) and link.status_waiters:
                fut = link.status_waiters.popleft()
                if not fut.done():
                    fut.set_exception(error_from_frame(frame, self.address))
                return
            # Frames of a generation this side already left (cancelled): expected, dropped.
            log.debug("frontend frame for finished request %d dropped", frame.request_id)
            return
        raise ProtocolError(f"the leader sent {type(frame).__name__}, which only clients send")

    def _answer_status(self, link: _Link, frame: Status) -> None:
        # The oldest request owns this answer, even if its caller gave up waiting for it.
        if not link.status_waiters:
            log.debug("unrequested STATUS from %s dropped", self.address)
            return
        fut = link.status_waiters.popleft()
        if not fut.done():
            fut.set_result(frame)
