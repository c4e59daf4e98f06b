"""Limits on the native ports: the frame deadline, the connection limit, bounded send buffers.

Real services on 127.0.0.1 with short limits (``--frame-deadline 0.5``, one or two
connections): on the worker link, the admin link, the TP worker port (control and gate
connections) and the frontend link, a peer that begins a frame and then trickles is cut at
the deadline; a connection over the limit is refused at once; each is one warning naming the
peer, and the service goes on serving the next good peer.
"""

from __future__ import annotations

import asyncio
import re
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import Service, coordinator, wait_for
from tp_harness import Client, LeaderProc, make_model, start_leader, start_worker, wait_paired

from foundry.transport.fdtc_stream import FdtcStream, FrameTimeout
from foundry.wire import fdtc
from foundry.wire import frontend as fw
from foundry.wire.tp import CommandAck, encode

DEADLINE = 0.5
# One byte per this: every trickled frame would take seconds (the shortest, a gate connection's
# 32-byte first frame, 8 s), so being cut near DEADLINE can only be the deadline's doing.
TRICKLE_S = 0.25


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, int, int]]:
    tmp = tmp_path_factory.mktemp("swarm")
    svc, port, admin = coordinator(
        tmp,
        "--wait-for-start",
        "--frame-deadline",
        str(DEADLINE),
        "--max-connections",
        "2",
        "--admin-max-connections",
        "1",
    )
    try:
        yield svc, port, admin
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def leader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LeaderProc, Path]]:
    logs = tmp_path_factory.mktemp("tp")
    model = make_model(logs / "model.gguf")
    lead = start_leader(
        model,
        logs / "leader.log",
        "--frame-deadline",
        str(DEADLINE),
        "--frontend-max-connections",
        "1",
    )
    try:
        yield lead, model
    finally:
        lead.proc.stop()


def trickle(port: int, frame: bytes) -> tuple[int, float]:
    """Send ``frame`` a byte at a time until the server hangs up; (our port, seconds from the
    first byte to the hang-up)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        local = int(sock.getsockname()[1])
        t0 = time.monotonic()
        for i in range(len(frame)):
            try:
                sock.sendall(frame[i : i + 1])
            except OSError:
                return local, time.monotonic() - t0
            ready, _, _ = select.select([sock], [], [], TRICKLE_S)
            if ready:
                try:
                    while sock.recv(4096):  # an ERROR frame may come first
                        pass
                except OSError:
                    pass
                return local, time.monotonic() - t0
    raise AssertionError(f"the server took all {len(frame)} bytes of a trickled frame")


def wait_for_line(text: Service | Log, pattern: str, within_s: float = 10.0) -> None:
    wait_for(
        lambda: re.search(pattern, text.text()), within_s, f"/{pattern}/ in:\n{text.text()[-3000:]}"
    )


class Log:
    """A leader process's log read like a Service's."""

    def __init__(self, lead: LeaderProc) -> None:
        self.lead = lead

    def text(self) -> str:
        return self.lead.proc.text()


def assert_cut(log: Service | Log, port: int, frame: bytes, line: str) -> None:
    # Not before the deadline; the log line says the deadline is why (a slower cut for
    # another reason would name that one).
    local, seconds = trickle(port, frame)
    assert seconds >= DEADLINE * 0.8, seconds
    wait_for_line(log, line.format(peer=re.escape(f"127.0.0.1:{local}")))


def refused_over_limit(port: int) -> int:
    """A connection past the limit: accepted by the kernel, closed at once by the service.
    Tried again until one is (the service may not have taken the held ones in yet)."""

    def refused() -> int | None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            local = int(sock.getsockname()[1])
            sock.settimeout(0.5)  # an accepted connection stays silent: it is not refused
            try:
                return local if sock.recv(16) == b"" else None
            except ConnectionResetError:
                return local
            except TimeoutError:
                return None

    return wait_for(refused, 20, f"a connection to :{port} refused over the limit")


def hold(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def served(port: int, request: bytes, within_s: float = 10.0) -> bytes:
    """Some answer to ``request`` on a fresh connection (retrying while the service still
    counts connections that just closed)."""

    def answer() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request)
            try:
                return sock.recv(65536)
            except ConnectionResetError:
                return b""

    return wait_for(answer, within_s, "an answer: the service serves no one any more", poll_s=0.1)


# -- the frame deadline --------------------------------------------------------------------


def test_trickling_peers_are_cut_at_the_frame_deadline(
    swarm: tuple[Service, int, int], leader: tuple[LeaderProc, Path]
) -> None:
    coord, port, admin = swarm
    lead, _ = leader
    register = fdtc.encode(
        fdtc.Register(
            worker_id="slow",
            protocol_version=1,
            profile=fdtc.HardwareProfile.RPI3,
            num_cores=1,
            memory_mb=512,
            suggested_batch_size=1,
        )
    )
    late = r"began a frame and did not finish it within 0\.5 s \(frame deadline\)"
    assert_cut(coord, port, register, r"worker link: {peer} " + late)
    assert_cut(coord, admin, fdtc.encode(fdtc.Export(path="x" * 40)), r"admin link: {peer} " + late)
    log = Log(lead)
    assert_cut(
        log,
        lead.frontend,
        fw.encode(fw.Generate(1, "a prompt", 8)),
        r"frontend link: {peer} " + late,
    )
    # The worker port: a control connection's hello, and a gate connection's first frame.
    assert_cut(log, lead.port, b"DTPH" + bytes(164), r"bring-up with {peer} failed: .*" + late)
    assert_cut(
        log,
        lead.port,
        encode(CommandAck(status=0, seq=7)),
        r"bring-up with {peer} failed: .*" + late,
    )
    # Still serving.
    decoder = fdtc.FdtcDecoder()
    decoder.feed(served(admin, fdtc.encode(fdtc.StatusReq())))
    assert isinstance(decoder.next_event(), fdtc.SwarmStatus)
    with Client(lead.frontend) as c:
        assert not c.status().worker_connected


# -- the connection limit ------------------------------------------------------------------


def test_connections_over_the_limit_are_refused_and_service_goes_on(
    swarm: tuple[Service, int, int], leader: tuple[LeaderProc, Path], tmp_path: Path
) -> None:
    coord, port, admin = swarm
    lead, model = leader
    log = Log(lead)
    cases = [
        (coord, "worker link", port, 2, "--max-connections", fdtc.encode(fdtc.StatusReq())),
        (coord, "admin link", admin, 1, "--admin-max-connections", fdtc.encode(fdtc.StatusReq())),
        (
            log,
            "frontend link",
            lead.frontend,
            1,
            "--frontend-max-connections",
            fw.encode(fw.StatusReq(0)),
        ),
    ]
    for text, link, p, limit, flag, request in cases:
        held = hold(p, limit)
        local = refused_over_limit(p)
        wait_for_line(
            text,
            rf"{link}: refused 127\.0\.0\.1:{local}: the link has its limit of "
            rf"{limit} open connections \({flag}\)",
        )
        for s in held:
            s.close()
        assert served(p, request)  # a REGISTER_ACK refusal, a SWARM_STATUS, a STATUS

    # The TP worker port: four connections in their bring-up at most, then one pair.
    held = hold(lead.port, 4)
    local = refused_over_limit(lead.port)
    wait_for_line(
        log,
        rf"worker port: refused 127\.0\.0\.1:{local}: 4 connections are in their "
        r"bring-up already",
    )
    for s in held:
        s.close()
    worker = start_worker(model, lead.port, tmp_path / "tp-worker.log")
    try:
        wait_paired(lead.frontend)
    finally:
        worker.stop()


# -- bounded buffers -----------------------------------------------------------------------


def test_a_peer_that_stops_reading_is_cut_instead_of_buffered() -> None:
    """FdtcStream.send waits for the write buffer to drain, at most the frame deadline: a
    worker that stops reading weights cannot make the coordinator buffer without end."""

    async def main() -> None:
        stalled = asyncio.Event()

        async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.transport.pause_reading()
            await stalled.wait()
            writer.close()

        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        listener.bind(("127.0.0.1", 0))
        srv = await asyncio.start_server(never_read, sock=listener)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client.connect(listener.getsockname())
        reader, writer = await asyncio.open_connection(sock=client)
        stream = FdtcStream(reader, writer, frame_deadline_s=0.3)
        # It ends (the test's timeout would catch a hang) for the frame deadline's reason.
        with pytest.raises(FrameTimeout, match="did not take a frame"):
            await stream.send(fdtc.Weights(bytes(8 << 20)))
        assert writer.transport.is_closing()
        stalled.set()
        srv.close()
        await srv.wait_closed()

    asyncio.run(main())
