"""Fuzzing the live services (``bench/robustness/fuzz.py``): every native port, 10,000 frames each.

The harness starts a real coordinator with a real worker and a real TP pair, sends each native
port mutated, truncated, oversized and random frames, and checks after every batch that the
real peers are still served. A second test proves the harness's hang check can fail.
``FOUNDRY_FUZZ_SEED`` picks another sequence of frames (the seed is printed either way).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # live, harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "robustness"))

import fuzz
from fuzz_drive import PortStats, drive
from fuzz_frames import MUTATIONS
from fuzz_targets import Ending, FrontendTarget, Plan

FRAMES_PER_PORT = 10_000


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_native_port_takes_10000_bad_frames_without_a_crash_or_hang(
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("FOUNDRY_FUZZ_SEED", "1"))
    lines: list[str] = []
    report = fuzz.run(tmp_path, FRAMES_PER_PORT, seed, seconds=120.0, out=lines.append)
    text = f"seed {seed}\n" + "\n".join(lines)
    print(text)
    assert [p.port for p in report.ports] == [
        "coordinator-workers",
        "coordinator-admin",
        "tp-leader-workers",
        "tp-leader-frontend",
    ], text
    for p in report.ports:
        assert p.fuzz_frames - p.refused_unread >= FRAMES_PER_PORT, text
        assert p.hangs == 0 and p.crashes == 0 and p.internal_errors == 0, text
        assert p.health_checks >= 10 and not p.health_failures, text
        assert p.connect_failures == 0 and p.garbled_answers == 0, text
        # every mutation kind was sent, and bad bytes were refused the documented way
        assert set(p.kinds) == set(MUTATIONS), (p.port, p.kinds)
        assert p.closed_by_service > 0 and p.awaiting > 0, text
        if p.frame_deadline_s is not None:
            assert p.held > 0 and p.deadline_closes == p.held, text
    assert report.ok, text


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose server reads everything and never answers nor closes."""
    srv = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            conns.append(conn)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        for c in conns:
            c.close()
        srv.close()


def test_a_service_that_neither_answers_nor_closes_is_counted_as_a_hang(
    silent_port: int,
) -> None:
    target = FrontendTarget(silent_port)
    stats = PortStats(target.name)
    plans = [
        Plan(b"FDFE garbage", 1, 0, Ending.CLOSE, 0, ["x/random"]),  # owed: a close
        Plan(b"\x46\x44\x46\x45", 1, 0, Ending.PARTIAL, 0, ["x/truncate"]),  # ditto
        Plan(b"", 0, 1, Ending.OPEN, 1, []),  # owed: an answer
    ]

    async def go() -> None:
        for plan in plans:
            await drive(target, plan, stats, hang_s=0.3)

    asyncio.run(go())
    assert stats.hangs == 3 and stats.connections == 3, stats
    assert len(stats.hang_samples) == 3
