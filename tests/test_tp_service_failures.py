"""The tensor-parallel pair as processes, at bring-up and when things fail: identity and expert
split mismatches, a worker's death, a worker that sends garbage, overload, a clean stop.

Every test runs real ``foundry tp-leader`` / ``foundry tp-worker`` processes on 127.0.0.1 that
speak the real control and gate protocols (shared memory where both offer it, TCP with
``--no-shm``).
"""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path

import pytest
from procs import wait_for
from quant_weights import perturbed
from tiny_bpe import write_tiny_bpe
from tp_harness import (
    Client,
    InProcessLeader,
    loopback_options,
    make_model,
    metric,
    reference_greedy,
    start_leader,
    start_worker,
    wait_paired,
)
from tp_service_prompt import CHUNK, PROMPT

from foundry.model.formats.gguf_io import load_gguf, save_gguf
from foundry.model.shard.table import ExpertSplit
from foundry.model.spec.config import ModelConfig
from foundry.tp.handshake import DEFAULT_EXPERT_SPLIT, execution_mode, identity_for
from foundry.tp.speculative import SpecMode
from foundry.wire import frontend as fw
from foundry.wire.tp import TP_FRAME_MAGIC, CommandAck, Hello, Identity, Role, TpDecoder, encode


# This file's tiny model of the default shape (conftest.py's, shared with other files).
@pytest.fixture(scope="module")
def model(plain_model: Path) -> Path:
    return plain_model


# --gate-timeout of the worker-death test: far enough above a loaded machine's scheduling delay
# that a dead worker's closed links are told apart from a stalled worker's deadline.
GATE_S = 3.0


def test_auto_expert_split_takes_whole_experts_where_halves_would_cut_a_block(
    tmp_path: Path,
) -> None:
    """A Q8_0 file whose experts' 96 intermediate rows halve into 48, inside its blocks of 32:
    the leader left at 'auto' cuts whole experts and says why, a worker left at 'auto' follows
    it, and the pair decodes one process's tokens in that split."""
    cfg = ModelConfig(n_ctx=256, n_ff=96)
    path = tmp_path / "q8.gguf"
    save_gguf(path, cfg, perturbed(cfg), dtype="q8_0")
    leader = start_leader(path, tmp_path / "leader.log", "--prefill-chunk", str(CHUNK))
    worker = None
    try:
        worker = start_worker(path, leader.port, tmp_path / "worker.log")
        wait_paired(leader.frontend)
        with Client(leader.frontend) as c:
            got = c.generate(PROMPT, 24)
        want = reference_greedy(path, PROMPT, 24, CHUNK, ExpertSplit.EXPERTS)
        assert got.tokens == want.tokens
        assert (
            "expert split: experts (intermediate would cut blk.0.ffn_down_exps.weight "
            "(96 columns) inside its blocks of 32)" in leader.proc.text()
        ), leader.proc.text()
    finally:
        assert leader.proc.stop() == 0, leader.proc.text()
        if worker is not None:
            assert worker.exit_code() == 0, worker.text()


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
    """A leader in the non-default expert split: a worker told the default split is refused
    (both name the field and both values); a worker left at 'auto' takes the leader's split,
    pairs and decodes the single process's tokens in that split."""
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
        wrong = start_worker(
            model, leader.port, tmp_path / "wrong.log", "--expert-split", DEFAULT_EXPERT_SPLIT.value
        )
        assert wrong.popen.wait(30) == 2  # no retry can fix it
        expected = (
            f"execution mode mismatch on expert_split: leader has {other.value}, "
            f"worker has {DEFAULT_EXPERT_SPLIT.value}; start both ranks with the same "
            "--expert-split"
        )
        assert expected in wrong.text(), wrong.text()
        wait_for(lambda: expected in leader.proc.text(), 10, "the leader to name the same field")
        right = start_worker(model, leader.port, tmp_path / "right.log")  # auto
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


def test_a_leader_whose_row_draw_breaks_the_row_mass_rules_loses_its_worker_then_pairs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ROW_MASS (flags 0x07) a ROW_DRAW's acc and nonzero are 0 and come in ROW_MASS: a
    leader that sends them in the ROW_DRAW is out of step, and the real worker drops the pair
    (naming the rule) instead of drawing from a mass counted twice; a correct leader pairs with
    it again and its sampled requests are served."""
    from foundry.tp import commands
    from foundry.wire.tp import DrawRow

    # A vocabulary whose halves start on a block of the draw's masses (the byte vocabulary's
    # 259 tokens do not: its sampled rows ship LOGITS).
    model = write_tiny_bpe(tmp_path / "tiny-llama3.gguf")
    leader = InProcessLeader(
        loopback_options(
            model,
            spec_mode=SpecMode.OFF,
            gate_timeout_s=GATE_S,
            shm=False,
        )
    )
    worker = start_worker(model, leader.leader.port, tmp_path / "worker.log")
    try:
        wait_paired(leader.leader.frontend_port)
        sound = commands._draw_row
        monkeypatch.setattr(
            commands,
            "_draw_row",
            lambda row: DrawRow(int(row.draw), row.top_k, row.top, row.inv, 1.0, row.u, 1),
        )
        with Client(leader.leader.frontend_port) as c:
            r = c.generate("hi", 8, request_id=1, temperature=0.8, seed=3)
            assert isinstance(r.end, fw.Error) and r.end.code == fw.ErrorCode.UNAVAILABLE, r.end
            assert "tensor-parallel worker lost" in r.end.message
            rule = "carries a row's acc or nonzero; they come in ROW_MASS"
            wait_for(lambda: rule in worker.text(), 10 * GATE_S, "the worker's log naming it")
            monkeypatch.setattr(commands, "_draw_row", sound)
            wait_paired(leader.leader.frontend_port)  # the worker dialed again
            r = c.generate("hi", 8, request_id=2, temperature=0.8, seed=3)
            assert isinstance(r.end, fw.Done) and len(r.tokens) == 8, r.end
    finally:
        leader.stop()
        worker.stop()
