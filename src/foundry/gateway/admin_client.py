"""Client of the coordinator's admin link: FDTC requests and their answers (one each, two
for SWARM_DETAIL_REQ: SWARM_STATUS then SWARM_DETAIL).

The coordinator answers the requests of one admin connection one at a time, in order, so a
connection carries one request at a time here too. A small pool of connections lets concurrent
gRPC calls (fifty callers asking for status) proceed side by side; a connection is opened when
the pool has none idle and fewer than ``pool_size`` exist, and closed whenever a request on it
did not end cleanly (timeout, cancellation, bad bytes), so a late answer can never be taken for
the answer to the next request.

A connection that sat idle may have died with a restarted coordinator; a request that fails on
such a reused connection is sent once more on a fresh one. That is safe for every admin request:
STATUS_REQ is read-only, and START, PAUSE, RESUME, CHECKPOINT, EXPORT and SHUTDOWN have the same
effect when repeated.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_lib

from foundry.gateway.errors import (
    BackendFailed,
    BackendTimeout,
    BackendUnavailable,
    Refused,
)
from foundry.transport.fdtc_stream import FdtcStream, FrameTimeout, StreamClosed
from foundry.wire import fdtc
from foundry.wire.errors import ProtocolError

log = logging.getLogger("foundry.gateway.admin")

# Concurrent requests to one coordinator: status is cheap there, so a few connections serve
# many callers; more would only add coordinator tasks.
DEFAULT_POOL_SIZE = 4


class AdminClient:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        pool_size: int = DEFAULT_POOL_SIZE,
        connect_timeout_s: float = 5.0,
        ssl: ssl_lib.SSLContext | None = None,
    ) -> None:
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self._ssl = ssl
        self._slots = asyncio.Semaphore(pool_size)
        self._idle: list[FdtcStream] = []
        self._closed = False
        # The failure the coordinator last reported (SWARM_DETAIL failed): named when it
        # then cannot be reached, since it exited because of it.
        self.last_failure: str | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def status(self, timeout_s: float) -> tuple[fdtc.SwarmStatus, fdtc.SwarmDetail]:
        """The run (SWARM_STATUS) and what it does not say (SWARM_DETAIL), taken together."""
        msg = fdtc.SwarmDetailReq()
        replies = await self._request(msg, timeout_s, 2)
        status, detail = replies
        if not isinstance(status, fdtc.SwarmStatus):
            raise self._unexpected(msg, status)
        if not isinstance(detail, fdtc.SwarmDetail) or detail.n_rows != status.n_rows:
            raise self._unexpected(msg, detail)
        self.last_failure = detail.note if detail.failed else None
        return status, detail

    async def control(self, msg: fdtc.Message, timeout_s: float) -> fdtc.ControlAck:
        """Send a control request; its CONTROL_ACK, or Refused with the coordinator's reason."""
        reply = await self.request(msg, timeout_s)
        if not isinstance(reply, fdtc.ControlAck) or reply.acked_type != msg.TYPE:
            raise self._unexpected(msg, reply)
        if not reply.ok:
            raise Refused(
                f"the coordinator refused {fdtc.msg_type_name(msg.TYPE)}: {reply.message}"
            )
        return reply

    async def request(self, msg: fdtc.Message, timeout_s: float) -> fdtc.Message:
        """One request, its one answer (an ERROR answer is raised as BackendFailed)."""
        return (await self._request(msg, timeout_s, 1))[0]

    async def _request(self, msg: fdtc.Message, timeout_s: float, count: int) -> list[fdtc.Message]:
        """One request and its ``count`` answers; an ERROR in their place is raised as
        BackendFailed."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self._slots:
                    replies = await self._exchange(msg, count)
        except TimeoutError:
            raise BackendTimeout(
                f"the coordinator at {self.address} did not answer "
                f"{fdtc.msg_type_name(msg.TYPE)} within {timeout_s:.3g} s"
            ) from None
        error = replies[-1]
        if isinstance(error, fdtc.Error):
            raise BackendFailed(
                f"the coordinator at {self.address} answered "
                f"{fdtc.msg_type_name(msg.TYPE)} with error {error.error_code}: {error.message}"
            )
        return replies

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for stream in idle:
            await stream.close()

    # ------------------------------------------------------------------ internals

    async def _exchange(self, msg: fdtc.Message, count: int) -> list[fdtc.Message]:
        reused = bool(self._idle)
        stream = self._idle.pop() if reused else await self._connect()
        try:
            replies = await self._send_recv(stream, msg, count)
        except (StreamClosed, ConnectionError, OSError) as exc:
            if not reused:
                raise self._broken(exc) from None
            log.info("idle admin connection to %s was gone (%s); reconnecting", self.address, exc)
            stream = await self._connect()
            try:
                replies = await self._send_recv(stream, msg, count)
            except (StreamClosed, ConnectionError, OSError) as exc2:
                raise self._broken(exc2) from None
        if self._closed:
            await stream.close()
        else:
            self._idle.append(stream)
        return replies

    async def _send_recv(
        self, stream: FdtcStream, msg: fdtc.Message, count: int
    ) -> list[fdtc.Message]:
        """The request's ``count`` answers, or fewer ending in the ERROR sent instead."""
        done = False
        try:
            await stream.send(msg)
            replies = [await stream.recv()]
            while len(replies) < count and not isinstance(replies[-1], fdtc.Error):
                replies.append(await stream.recv())
            done = True
            return replies
        except (FrameTimeout, ProtocolError) as exc:
            raise BackendFailed(
                f"the coordinator at {self.address} sent bytes that break the admin protocol "
                f"({exc}); are the gateway and the coordinator the same foundry version?"
            ) from None
        finally:
            if not done:
                # Synchronous close: runs even while this task is being cancelled.
                stream.writer.close()

    async def _connect(self) -> FdtcStream:
        try:
            return await FdtcStream.connect(
                self.host, self.port, ssl=self._ssl, timeout_s=self.connect_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            raise BackendUnavailable(
                f"coordinator admin link {self.address} unreachable: "
                f"{exc or type(exc).__name__}; is `foundry coordinator` running with "
                f"--admin-listen {self.address}?{self._exited()}"
            ) from None

    def _broken(self, exc: BaseException) -> BackendUnavailable:
        return BackendUnavailable(
            f"the admin link to the coordinator at {self.address} broke mid-request: "
            f"{exc or type(exc).__name__}; retry once the coordinator is back{self._exited()}"
        )

    def _exited(self) -> str:
        if self.last_failure is None:
            return ""
        return (
            f" (it last reported FAILED: {self.last_failure}; started again, it resumes "
            "from its last checkpoint)"
        )

    def _unexpected(self, sent: fdtc.Message, reply: fdtc.Message) -> BackendFailed:
        return BackendFailed(
            f"the coordinator at {self.address} answered {fdtc.msg_type_name(sent.TYPE)} with "
            f"{fdtc.msg_type_name(reply.TYPE)}; are the gateway and the coordinator the same "
            "foundry version?"
        )
