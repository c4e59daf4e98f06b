"""The tensor-parallel pair as processes, exact and steady: logits and greedy text equal one
process, concurrent sessions equal the same sessions alone, a continued conversation reuses its
session, stop strings, bad requests and garbage on every port.

Every test runs real ``foundry tp-leader`` / ``foundry tp-worker`` processes on 127.0.0.1 that
speak the real control and gate protocols (shared memory where both offer it, TCP with
``--no-shm``).
The logits test runs the leader in this process to read its logits; its worker is still a
process.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tp_harness import (
    Client,
    InProcessLeader,
    LeaderProc,
    loopback_options,
    make_model,
    metric,
    reference_greedy,
    start_leader,
    start_worker,
    tokens_of,
    wait_paired,
)
from tp_service_prompt import CHUNK, PROMPT

from foundry.model.formats.gguf_model import FileDType
from foundry.model.text.vocab.byte import decode
from foundry.tp.blas import limit_blas_threads
from foundry.tp.speculative import SpecMode
from foundry.wire import frontend as fw
from foundry.wire.tp import TP_FRAME_MAGIC, CommandAck, encode


# This file's tiny model of the default shape (conftest.py's, shared with other files).
@pytest.fixture(scope="module")
def model(plain_model: Path) -> Path:
    return plain_model


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
        loopback_options(
            model,
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
    """Greedy passes ask the worker for its rows' greedy picks (ROW_TOPS), not its logits: the
    same tokens as one process, by speculative VERIFY blocks and the prompt's SYNC alike; a
    request with logprobs still gets the full rows."""
    assert pair.metrics is not None
    ref = reference_greedy(model, PROMPT, 64, CHUNK)

    def replies() -> tuple[float, float]:
        assert pair.metrics is not None
        name = "foundry_tp_row_replies_total"
        return metric(pair.metrics, name + '{kind="row_tops"}'), metric(
            pair.metrics, name + '{kind="logits"}'
        )

    tops0, logits0 = replies()
    with Client(pair.frontend) as c:
        got = c.generate(PROMPT, 64)
        st = c.status()
        tops1, logits1 = replies()
        with_logprobs = c.generate(PROMPT, 8, request_id=2, logprobs=True, top_logprobs=2)
    tops2, logits2 = replies()
    assert got.tokens == ref.tokens and got.text == decode(ref.tokens)
    assert tops1 - tops0 >= 1 and logits1 == logits0  # every pass of it by its rows' tops
    assert with_logprobs.tokens == ref.tokens[:8]
    assert logits2 - logits1 >= 1 and tops2 == tops1
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
    # They really ran together: the last request's first token came before the first's last,
    # and prompts that waited together were evaluated in one pass (MIXED_PREFILLS).
    assert together[-1].token_times[0] < together[0].token_times[-1]
    assert pair.metrics is not None
    assert metric(pair.metrics, 'foundry_tp_passes_total{kind="mixed_prefills"}') >= 1


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
