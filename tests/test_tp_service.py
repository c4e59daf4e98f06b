"""The tensor-parallel pair as processes: exactness, batching, bring-up, failures, bad input.

Every test runs real ``foundry tp-leader`` / ``foundry tp-worker`` processes on 127.0.0.1 that
speak the real control and gate protocols (shared memory where both offer it, TCP with
``--no-shm``). The exactness test runs the leader in this process to read its logits; its
worker is still a process.
"""

from __future__ import annotations

import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from procs import wait_for
from tp_harness import (
    Client,
    InProcessLeader,
    LeaderProc,
    make_model,
    metric,
    reference_greedy,
    start_leader,
    start_worker,
    tokens_of,
    wait_paired,
)

from foundry.model.formats.gguf_io import load_gguf
from foundry.model.formats.gguf_model import FileDType
from foundry.model.shard.table import ExpertSplit
from foundry.model.spec.config import ModelConfig
from foundry.model.text.vocab.byte import decode
from foundry.tp.blas import limit_blas_threads
from foundry.tp.handshake import DEFAULT_EXPERT_SPLIT, execution_mode, identity_for
from foundry.tp.leader import LeaderOptions
from foundry.tp.speculative import SpecMode
from foundry.wire import frontend as fw
from foundry.wire.tp import (
    TP_FRAME_MAGIC,
    CommandAck,
    Hello,
    Identity,
    Role,
    TpDecoder,
    encode,
)

PROMPT = "The tensor-parallel pair decodes in lockstep; every gate is a sum."
CHUNK = 16
# --gate-timeout of the worker-death test: far enough above a loaded machine's scheduling delay
# that a dead worker's closed links are told apart from a stalled worker's deadline.
GATE_S = 3.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tp") / "model.gguf")


@pytest.fixture(scope="module")
def pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeaderProc]:
    """One pair for the tests that leave it serving (default flags: shared memory)."""
    logs = tmp_path_factory.mktemp("logs")
    leader = start_leader(model, logs / "leader.log", "--prefill-chunk", str(CHUNK))
    worker = start_worker(model, leader.port, logs / "worker.log")
    try:
        wait_paired(leader.frontend)
        yield leader
    finally:
        assert leader.proc.stop() == 0, leader.proc.text()
        assert worker.exit_code() == 0, worker.text()  # the leader's STOP ends the worker


@pytest.mark.parametrize("dtype", ["f32", "q8_0", "q4_0"])
def test_pair_logits_equal_one_process(model: Path, tmp_path: Path, dtype: FileDType) -> None:
    """Prefill plus 80 greedy tokens: the leader's full logits rows against world 1. On a
    quantized file each rank holds its half in the stored blocks."""
    if dtype != "f32":
        model = make_model(tmp_path / f"model-{dtype}.gguf", dtype=dtype)
    limit_blas_threads(1)
    rows: list[np.ndarray] = []
    leader = InProcessLeader(
        LeaderOptions(
            model=model,
            host="127.0.0.1",
            port=0,
            frontend_port=0,
            prefill_chunk=CHUNK,
            spec_mode=SpecMode.OFF,
            hash_check=True,
        ),
        hook=lambda rid, r: rows.append(r.copy()),
    )
    worker = start_worker(model, leader.leader.port, tmp_path / "worker.log")
    try:
        wait_paired(leader.leader.frontend_port)
        with Client(leader.leader.frontend_port) as c:
            got = c.generate(PROMPT, 80)
        assert isinstance(got.end, fw.Done) and got.end.reason is fw.DoneReason.MAX_TOKENS
    finally:
        leader.stop()
        assert worker.exit_code() == 0, worker.text()
    ref = reference_greedy(model, PROMPT, 80, CHUNK)
    assert got.tokens == ref.tokens
    assert got.text == decode(ref.tokens)
    assert len(rows) == len(ref.logits) == 80
    pair_logits, one = np.concatenate(rows), np.concatenate(ref.logits)
    diff = float(np.abs(pair_logits - one).max())
    assert diff <= 1e-5, diff
    # The pair adds the same two halves the single process adds, in the same order.
    assert np.array_equal(pair_logits, one), f"not bit-identical (max abs diff {diff:.3g})"
    assert leader.leader.metrics.hash_checks.labels("match")._value.get() > 0


def test_greedy_text_over_the_frontend_equals_one_process(model: Path, pair: LeaderProc) -> None:
    ref = reference_greedy(model, PROMPT, 64, CHUNK)
    with Client(pair.frontend) as c:
        got = c.generate(PROMPT, 64)
        st = c.status()
    assert got.tokens == ref.tokens and got.text == decode(ref.tokens)
    n_prompt = len(PROMPT) + 1
    assert got.positions == list(range(n_prompt, n_prompt + 64))
    assert st.worker_connected and st.shared_memory and st.requests_served >= 1
    assert (st.n_layer, st.n_embd, st.n_vocab, st.ctx_size) == (2, 64, 259, 256)
    assert st.model_bytes == model.stat().st_size


def test_concurrent_sessions_equal_the_same_sessions_alone(pair: LeaderProc) -> None:
    prompts = [f"Request {i}: " + "abc " * i + "the end." for i in range(8)]
    kinds = [
        {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": i} for i in range(8)
    ]
    with Client(pair.frontend) as c:
        alone = [
            c.generate(p, 40, request_id=100 + i, **k)
            for i, (p, k) in enumerate(zip(prompts, kinds, strict=True))
        ]
        for i, (p, k) in enumerate(zip(prompts, kinds, strict=True)):
            c.send(fw.Generate(i + 1, p, 40, **k))  # type: ignore[arg-type]
        together = c.wait(list(range(1, 9)))
    for a, b in zip(alone, together, strict=True):
        assert isinstance(b.end, fw.Done) and a.tokens == b.tokens and a.text == b.text
    # They really ran together: the last request's first token came before the first's last.
    assert together[-1].token_times[0] < together[0].token_times[-1]


def test_stop_strings_and_bad_requests(model: Path, pair: LeaderProc) -> None:
    ref = reference_greedy(model, PROMPT, 64, CHUNK)
    text = decode(ref.tokens)
    stop = text[20:23]
    cut = text.find(stop)
    with Client(pair.frontend) as c:
        got = c.generate(PROMPT, 64, stop=(stop,))
        assert isinstance(got.end, fw.Done) and got.end.reason is fw.DoneReason.STOP_STRING
        assert got.text == text[:cut]
        for frame, message in [
            (fw.Generate(5, "hi", 0), "max_tokens"),
            (fw.Generate(6, "hi", 4, temperature=-1.0), "temperature"),
            (fw.Generate(7, "hi", 4, top_p=0.0), "top_p"),
            (fw.Generate(8, "x" * 300, 4), "longer than the context"),
        ]:
            c.send(frame)
            (r,) = c.wait([frame.request_id])
            assert isinstance(r.end, fw.Error) and r.end.code == fw.ErrorCode.BAD_REQUEST
            assert message in r.end.message


def test_identity_mismatch_aborts_both_then_a_correct_worker_pairs(
    model: Path, tmp_path: Path
) -> None:
    other = make_model(tmp_path / "other.gguf", seed=7)  # same shape and size, other weights
    assert other.stat().st_size == model.stat().st_size
    leader = start_leader(model, tmp_path / "leader.log")
    try:
        wrong = start_worker(other, leader.port, tmp_path / "wrong.log")
        assert wrong.popen.wait(30) == 2  # no retry can fix it
        message = re.search(
            r"identity mismatch on model_id: leader has \d+, worker has \d+", wrong.text()
        )
        assert message is not None, wrong.text()
        wait_for(
            lambda: message.group(0) in leader.proc.text(), 10, "the leader to name the same field"
        )
        right = start_worker(model, leader.port, tmp_path / "right.log")
        wait_paired(leader.frontend)
        with Client(leader.frontend) as c:
            assert isinstance(c.generate("hi", 5).end, fw.Done)
    finally:
        leader.proc.stop()
        right.stop()


def test_expert_split_mismatch_aborts_then_the_same_split_pairs_and_decodes_exactly(
    model: Path, tmp_path: Path
) -> None:
    """A leader in the non-default expert split: a default worker is refused (both name the
    field and both values), a worker in the same split pairs and decodes the single process's
    tokens in that split."""
    other = next(m for m in ExpertSplit if m is not DEFAULT_EXPERT_SPLIT)
    leader = start_leader(
        model,
        tmp_path / "leader.log",
        "--expert-split",
        other.value,
        "--prefill-chunk",
        str(CHUNK),
        "--hash-check",
    )
    right = None
    try:
        wrong = start_worker(model, leader.port, tmp_path / "wrong.log")
        assert wrong.popen.wait(30) == 2  # no retry can fix it
        expected = (
            f"execution mode mismatch on expert_split: leader has {other.value}, "
            f"worker has {DEFAULT_EXPERT_SPLIT.value}; start both ranks with the same "
            "--expert-split"
        )
        assert expected in wrong.text(), wrong.text()
        wait_for(lambda: expected in leader.proc.text(), 10, "the leader to name the same field")
        right = start_worker(
            model, leader.port, tmp_path / "right.log", "--expert-split", other.value
        )
        wait_paired(leader.frontend)
        with Client(leader.frontend) as c:
            got = c.generate(PROMPT, 40)
        assert got.tokens == reference_greedy(model, PROMPT, 40, CHUNK, other).tokens
        assert leader.metrics is not None
        assert metric(leader.metrics, 'foundry_tp_hash_checks_total{result="mismatch"}') == 0
        assert metric(leader.metrics, 'foundry_tp_hash_checks_total{result="match"}') > 0
    finally:
        assert leader.proc.stop() == 0, leader.proc.text()
        if right is not None:
            assert right.exit_code() == 0, right.text()


def test_worker_death_fails_requests_fast_and_the_pair_comes_back(
    tmp_path: Path,
) -> None:
    """kill -9 (over shared memory and over TCP) and SIGSTOP of the worker mid-generation."""
    model = make_model(tmp_path / "long.gguf", ModelConfig(n_ctx=1024))
    leader = start_leader(
        model, tmp_path / "leader.log", "--spec-mode", "off", "--gate-timeout", str(GATE_S)
    )
    workers = []
    try:
        with Client(leader.frontend) as c:
            r = c.generate("hi", 10, request_id=1)
            assert isinstance(r.end, fw.Error) and r.end.code == fw.ErrorCode.UNAVAILABLE
            assert "not connected" in r.end.message
            measured = {}
            for i, (how, flags) in enumerate(
                [("kill9-shm", ()), ("kill9-tcp", ("--no-shm",)), ("stall-shm", ())]
            ):
                worker = start_worker(model, leader.port, tmp_path / f"{how}.log", *flags)
                workers.append(worker)
                st = wait_paired(leader.frontend)
                assert st.shared_memory == (how != "kill9-tcp")
                rid = 10 + i
                c.send(fw.Generate(rid, "hi", 1000))
                while len(c.results[rid].tokens) < 5:
                    assert c.pump(time.monotonic() + 10)
                    assert c.results[rid].end is None, c.results[rid].end
                t0 = time.monotonic()
                worker.popen.send_signal(
                    signal.SIGKILL if how.startswith("kill") else signal.SIGSTOP
                )
                (res,) = c.wait([rid], timeout=10 * GATE_S)
                measured[how] = res.end_time - t0
                assert isinstance(res.end, fw.Error), res.end
                assert res.end.code == fw.ErrorCode.UNAVAILABLE
                assert "tensor-parallel worker lost" in res.end.message
                assert "waits for it to reconnect" in res.end.message
                wait_paired(leader.frontend, connected=False, timeout=5)
                r = c.generate("hi", 5, request_id=50 + i)
                assert isinstance(r.end, fw.Error) and r.end.code == fw.ErrorCode.UNAVAILABLE
                assert "not connected" in r.end.message  # refused at once, for that reason
                worker.stop(signal.SIGKILL)
            print(f"request failed after the worker died/stalled: {measured}")
            # A dead worker is noticed by its closed links, before the gate deadline; a
            # stalled one (its links open) by the deadline, not before it.
            assert measured["kill9-shm"] < GATE_S and measured["kill9-tcp"] < GATE_S, measured
            assert measured["stall-shm"] >= 0.9 * GATE_S, measured
            workers.append(start_worker(model, leader.port, tmp_path / "back.log"))
            wait_paired(leader.frontend)
            ref = reference_greedy(model, "hi", 30, 64)
            assert c.generate("hi", 30, request_id=99).tokens == ref.tokens
        assert leader.metrics is not None
        assert metric(leader.metrics, 'foundry_tp_requests_total{outcome="unavailable"}') >= 6
    finally:
        leader.proc.stop()
        for w in workers:
            w.stop(signal.SIGKILL)


def test_a_prompt_that_continues_a_finished_generation_reuses_its_session(
    model: Path, pair: LeaderProc
) -> None:
    """The next turn of a conversation: the kept session's tokens are not evaluated again, and
    the text equals a single process evaluating the whole prompt."""
    assert pair.metrics is not None
    first = "Turn one of a conversation: "
    with Client(pair.frontend) as c:
        r1 = c.generate(first, 12, request_id=1)
        assert isinstance(r1.end, fw.Done)
        follow_up = first + r1.text + " and turn two."
        before = metric(pair.metrics, "foundry_tp_prompt_tokens_reused_total")
        r2 = c.generate(follow_up, 24, request_id=2)
        st = c.status()
    reused = metric(pair.metrics, "foundry_tp_prompt_tokens_reused_total") - before
    assert r2.tokens == reference_greedy(model, follow_up, 24, CHUNK).tokens
    # At least the first prompt was held; the new turn's text was evaluated.
    assert len(tokens_of(first)) <= reused < len(tokens_of(follow_up)), reused
    assert st.active_sessions == 0  # kept sessions are not running generations
    assert metric(pair.metrics, "foundry_tp_kept_sessions") >= 1


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


def test_garbage_on_every_port_never_stops_the_pair(pair: LeaderProc) -> None:
    rng = np.random.default_rng(0)
    garbage = [rng.bytes(n) for n in (1, 3, 16, 200, 5000)]
    hello_prefix = b"DTPH" + b"\x01\x00\xa8\x00" + rng.bytes(100)
    frames = [
        b"DTPH\x07\x00\xa8\x00" + bytes(160),  # a hello of another version
        hello_prefix,  # a hello cut short
        encode(CommandAck(status=0, seq=12345)),  # a gate link with an unknown token
        TP_FRAME_MAGIC.to_bytes(4, "little") + rng.bytes(40),  # a frame header of noise
        b"",  # connect and close
    ]
    for payload in [*garbage, *frames]:
        with socket.create_connection(("127.0.0.1", pair.port), timeout=5) as s:
            s.sendall(payload)
    front = [
        *garbage,
        fw.HEADER.pack(0x12345678, 1, 1, 0),  # bad magic
        fw.HEADER.pack(fw.MAGIC, 0x66, 1, 0),  # unknown type
        fw.HEADER.pack(fw.MAGIC, 1, 1, 1 << 30),  # oversized
        fw.HEADER.pack(fw.MAGIC, 1, 1, 3) + b"abc",  # GENERATE too short
        fw.encode(fw.Token(1, 5, 0, "x")),  # a frame only the leader sends
        fw.encode(fw.Status(1, True, True, 0, 0, 1, 1, 1, 1, 1, 1, 0.0, 0, 1)),
    ]
    for payload in front:
        with socket.create_connection(("127.0.0.1", pair.frontend), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(0.5)
            try:
                while s.recv(4096):
                    pass
            except (TimeoutError, ConnectionResetError):
                pass
    st = wait_paired(pair.frontend)
    assert pair.proc.popen.poll() is None
    with Client(pair.frontend) as c:
        r = c.generate(PROMPT, 8)
    assert isinstance(r.end, fw.Done) and len(r.tokens) == 8 and st.worker_connected


def test_a_worker_that_sends_garbage_after_the_hello_is_dropped(
    model: Path, tmp_path: Path
) -> None:
    """A peer that passes the bring-up, then breaks the protocol: the leader drops it, fails
    the request in flight, and pairs with the next worker."""
    header = load_gguf(model, select=lambda name, view: None)
    identity = identity_for(model, header.cfg, header.cfg.n_ctx)
    leader = start_leader(model, tmp_path / "leader.log", "--no-shm")
    worker = None
    try:
        ctl = socket.create_connection(("127.0.0.1", leader.port), timeout=5)
        ctl.sendall(
            encode(
                Hello(
                    role=Role.WORKER,
                    identity=identity,
                    execution_mode=execution_mode(DEFAULT_EXPERT_SPLIT),
                )
            )
        )
        decoder = TpDecoder(expect_hello=True)
        frames: list[object] = []
        while len(frames) < 2:
            decoder.feed(ctl.recv(4096))
            while (f := decoder.next_event()) is not None:
                frames.append(f)
        ack = frames[1]
        assert isinstance(ack, CommandAck) and ack.status == 0 and ack.seq != 0
        gate = socket.create_connection(("127.0.0.1", leader.port), timeout=5)
        gate.sendall(encode(CommandAck(status=0, seq=ack.seq)))
        ctl.sendall(encode(CommandAck(status=0)))
        wait_paired(leader.frontend)
        ctl.sendall(TP_FRAME_MAGIC.to_bytes(4, "little") + bytes(range(60)))  # noise
        with Client(leader.frontend) as c:
            r = c.generate("hi", 5)
            assert isinstance(r.end, fw.Error) and r.end.code == fw.ErrorCode.UNAVAILABLE
            assert "tensor-parallel worker lost" in r.end.message
            ctl.close()
            gate.close()
            worker = start_worker(model, leader.port, tmp_path / "worker.log")
            wait_paired(leader.frontend)
            assert isinstance(c.generate("hi", 5, request_id=2).end, fw.Done)
        assert "pair lost (protocol)" in leader.proc.text()
    finally:
        leader.proc.stop()
        if worker is not None:
            worker.stop()


def test_overload_is_refused_at_once(model: Path, tmp_path: Path) -> None:
    leader = start_leader(model, tmp_path / "leader.log", "--max-sessions", "1", "--queue", "1")
    worker = start_worker(model, leader.port, tmp_path / "worker.log")
    try:
        wait_paired(leader.frontend)
        with Client(leader.frontend) as c:
            for rid in (1, 2, 3):
                c.send(fw.Generate(rid, "hi", 200))
            c.send(fw.Generate(1, "hi", 5))  # an id in use on this connection
            (third,) = c.wait([3], timeout=5)
            assert isinstance(third.end, fw.Error)
            assert third.end.code == fw.ErrorCode.OVERLOADED
            results = c.wait([1, 2])
            assert all(isinstance(r.end, fw.Done) for r in results)
    finally:
        leader.proc.stop()
        worker.stop()


def test_identity_names_the_hello_fields() -> None:
    # The mismatch test above relies on model_id being the first field two same-shaped
    # files differ in; the order of the identity is the seed's.
    names = list(Identity.__dataclass_fields__)
    assert names[:2] == ["gguf_bytes", "model_id"]


def test_a_clean_stop_with_clients_connected_logs_no_traceback(model: Path, tmp_path: Path) -> None:
    """SIGTERM while frontend clients hold open connections: exit 0, and the log holds no
    error (the cancelled connection tasks end quietly)."""
    leader = start_leader(model, tmp_path / "leader.log")
    clients = [Client(leader.frontend) for _ in range(3)]
    try:
        for c in clients:
            assert not c.status().worker_connected  # each connection's task is serving
        assert leader.proc.stop() == 0, leader.proc.text()
    finally:
        for c in clients:
            c.close()
    text = leader.proc.text()
    assert "Traceback" not in text and " ERROR " not in text, text
