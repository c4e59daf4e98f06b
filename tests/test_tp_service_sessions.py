"""The tensor-parallel pair's sessions as processes: bounded (the least recently used goes),
resynced from their history when the worker returns, cancel at a sync checkpoint.

Every test runs real ``foundry tp-leader`` / ``foundry tp-worker`` processes on 127.0.0.1 that
speak the real control and gate protocols (shared memory where both offer it, TCP with
``--no-shm``).
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from procs import wait_for
from tp_harness import (
    Client,
    make_model,
    metric,
    reference_greedy,
    start_leader,
    start_worker,
    tokens_of,
    wait_paired,
)
from tp_service_prompt import CHUNK

from foundry.model.spec.config import ModelConfig
from foundry.wire import frontend as fw


# This file's tiny model of the default shape (conftest.py's, shared with other files).
@pytest.fixture(scope="module")
def model(plain_model: Path) -> Path:
    return plain_model


def test_kept_sessions_are_bounded_and_the_least_recently_used_goes(tmp_path: Path) -> None:
    """--keep-sessions 2: a third finished generation evicts the first on both ranks (the
    lockstep hash covers every session and position), and only kept sessions are reused."""
    model = make_model(tmp_path / "m.gguf")
    leader = start_leader(
        model, tmp_path / "leader.log", "--keep-sessions", "2", "--spec-mode", "off", "--hash-check"
    )
    worker = start_worker(model, leader.port, tmp_path / "worker.log")
    first, second, third = "First conversation: ", "Second conversation: ", "Third one: "
    try:
        assert leader.metrics is not None
        m = leader.metrics
        wait_paired(leader.frontend)
        with Client(leader.frontend) as c:
            for i, prompt in enumerate((first, second, third), start=1):
                assert isinstance(c.generate(prompt, 4, request_id=i).end, fw.Done)
            assert metric(m, "foundry_tp_kept_sessions") == 2
            before = metric(m, "foundry_tp_prompt_tokens_reused_total")
            evicted = c.generate(first + "again", 4, request_id=4)
            after_evicted = metric(m, "foundry_tp_prompt_tokens_reused_total")
            kept = c.generate(third + "again", 4, request_id=5)
            after_kept = metric(m, "foundry_tp_prompt_tokens_reused_total")
        assert after_evicted == before  # the first conversation's session was evicted
        assert after_kept - after_evicted >= len(tokens_of(third))
        for prompt, got in ((first + "again", evicted), (third + "again", kept)):
            assert got.tokens == reference_greedy(model, prompt, 4, 64).tokens
        assert metric(m, "foundry_tp_kept_sessions") == 2
        assert metric(m, 'foundry_tp_hash_checks_total{result="match"}') > 0
        assert metric(m, 'foundry_tp_hash_checks_total{result="mismatch"}') == 0
    finally:
        assert leader.proc.stop() == 0, leader.proc.text()
        assert worker.exit_code() == 0, worker.text()


def test_sessions_are_resynced_from_their_history_when_the_worker_returns(
    tmp_path: Path,
) -> None:
    """A kept session and a generation cut off by kill -9 of the worker are re-synced on the
    next pair; retrying the request and continuing the conversation then reuse them, exactly."""
    model = make_model(tmp_path / "m.gguf", ModelConfig(n_ctx=1024))
    leader = start_leader(
        model,
        tmp_path / "leader.log",
        "--hash-check",
        "--spec-mode",
        "off",
        "--prefill-chunk",
        str(CHUNK),
    )
    workers = [start_worker(model, leader.port, tmp_path / "first.log")]
    kept = "A finished generation stays open: "
    cut = "This generation is cut off when the worker dies: "
    try:
        assert leader.metrics is not None
        m = leader.metrics
        wait_paired(leader.frontend)
        with Client(leader.frontend) as c:
            assert isinstance(c.generate(kept, 8, request_id=1).end, fw.Done)
            c.send(fw.Generate(2, cut, 1000))
            while len(c.results[2].tokens) < 5:
                assert c.pump(time.monotonic() + 10)
            workers[0].popen.send_signal(signal.SIGKILL)
            (lost,) = c.wait([2], timeout=10)
            assert isinstance(lost.end, fw.Error) and lost.end.code == fw.ErrorCode.UNAVAILABLE
        wait_paired(leader.frontend, connected=False, timeout=5)
        workers.append(start_worker(model, leader.port, tmp_path / "second.log"))
        wait_paired(leader.frontend)
        wait_for(
            lambda: metric(m, "foundry_tp_sessions_resynced_total") >= 2,
            30,
            "two sessions re-synced",
        )
        assert "re-syncing 2 sessions" in leader.proc.text()
        before = metric(m, "foundry_tp_prompt_tokens_reused_total")
        with Client(leader.frontend) as c:
            retried = c.generate(cut, 20, request_id=3)
            follow_up = c.generate(kept + "more", 20, request_id=4)
        reused = metric(m, "foundry_tp_prompt_tokens_reused_total") - before
        assert retried.tokens == reference_greedy(model, cut, 20, CHUNK).tokens
        assert follow_up.tokens == reference_greedy(model, kept + "more", 20, CHUNK).tokens
        # The retried prompt was held whole (its last token is evaluated again), the kept
        # session's prompt too.
        assert reused >= len(tokens_of(cut)) - 1 + len(tokens_of(kept)), reused
        # Both ranks agreed on every session and position after the re-sync.
        assert metric(m, 'foundry_tp_hash_checks_total{result="match"}') > 0
        assert metric(m, 'foundry_tp_hash_checks_total{result="mismatch"}') == 0
    finally:
        assert leader.proc.stop() == 0, leader.proc.text()
        for w in workers:
            w.stop(signal.SIGKILL)


def test_a_request_during_a_resync_goes_first_and_the_resync_resumes(tmp_path: Path) -> None:
    """A long history re-syncs one token per checkpoint; a request sent meanwhile pauses it at
    a checkpoint, is served, and the re-sync then finishes with both ranks in lockstep."""
    model = make_model(tmp_path / "m.gguf", ModelConfig(n_ctx=1024))
    leader = start_leader(
        model, tmp_path / "leader.log", "--hash-check", "--spec-mode", "off", "--prefill-chunk", "1"
    )
    workers = [start_worker(model, leader.port, tmp_path / "first.log")]
    try:
        assert leader.metrics is not None
        wait_paired(leader.frontend)
        with Client(leader.frontend) as c:
            long = c.generate("A long history: ", 700, request_id=1)
            assert isinstance(long.end, fw.Done) and len(long.tokens) == 700, long.end
        workers[0].stop(signal.SIGKILL)
        wait_paired(leader.frontend, connected=False, timeout=5)
        gates = 'foundry_tp_gate_bytes_total{direction="sent"}'
        before = metric(leader.metrics, gates)
        workers.append(start_worker(model, leader.port, tmp_path / "second.log"))
        wait_paired(leader.frontend)
        # The re-sync has run a chunk through the new pair (gates moved), so the request
        # below meets it past its first checkpoint, not before it began.
        metrics = leader.metrics
        wait_for(
            lambda: metric(metrics, gates) > before, 60, "the re-sync's first gates", poll_s=0.01
        )
        with Client(leader.frontend) as c:
            served = c.generate("hi", 5, request_id=2)
        assert served.tokens == reference_greedy(model, "hi", 5, 1).tokens
        wait_for(
            lambda: metric(metrics, "foundry_tp_sessions_resynced_total") >= 1,
            60,
            "the session re-synced",
        )
        text = leader.proc.text()
        paused = re.search(r"re-sync paused at position (\d+) of (\d+)", text)
        assert paused is not None, text
        assert 0 < int(paused.group(1)) < int(paused.group(2))
        assert text.index("re-sync paused") < text.index("session re-synced from its history")
        assert metric(leader.metrics, 'foundry_tp_hash_checks_total{result="mismatch"}') == 0
    finally:
        assert leader.proc.stop() == 0, leader.proc.text()
        for w in workers:
            w.stop(signal.SIGKILL)


def test_cancel_at_a_sync_checkpoint_leaves_both_ranks_at_one_position(
    tmp_path: Path,
) -> None:
    model = make_model(tmp_path / "m.gguf", ModelConfig(n_ctx=1024))
    leader = start_leader(model, tmp_path / "leader.log", "--prefill-chunk", "2", "--hash-check")
    worker = start_worker(
        model,
        leader.port,
        tmp_path / "worker.log",
        "--metrics-port",
        "0",
        "--metrics-host",
        "127.0.0.1",
    )
    try:
        wait_paired(leader.frontend)
        metrics = leader.metrics
        assert metrics is not None
        gates = 'foundry_tp_gate_bytes_total{direction="sent"}'
        before = metric(metrics, gates)
        with Client(leader.frontend) as c:
            c.send(fw.Generate(1, "long prompt " * 80, 10))
            # Cancel once the prefill is under way (its first chunk's gates moved).
            wait_for(
                lambda: metric(metrics, gates) > before,
                30,
                "the prefill's first gates",
                poll_s=0.01,
            )
            c.send(fw.Cancel(1))
            (r,) = c.wait([1])
            assert isinstance(r.end, fw.Done) and r.end.reason is fw.DoneReason.CANCELLED
            assert r.end.generated_tokens == 0 and not r.tokens
            assert isinstance(c.generate("hi", 3, request_id=2).end, fw.Done)  # still serving
        lead = wait_for(
            lambda: re.search(r"prefill cancelled at position (\d+) of (\d+)", leader.proc.text()),
            10,
            "the leader's cancel line",
        )
        work = wait_for(
            lambda: re.search(r"sync of session \d+ cancelled at (\d+) of (\d+)", worker.text()),
            10,
            "the worker's cancel line",
        )
        assert lead is not None and work is not None, (leader.proc.text(), worker.text())
        assert lead.groups() == work.groups()
        # Stopped before the end of the prompt (0 when the cancel beat the first chunk).
        assert 0 <= int(lead.group(1)) < int(lead.group(2))
        assert leader.metrics is not None
        assert metric(leader.metrics, 'foundry_tp_hash_checks_total{result="match"}') >= 2
        assert metric(leader.metrics, 'foundry_tp_hash_checks_total{result="mismatch"}') == 0
    finally:
        leader.proc.stop()
        worker.stop()
