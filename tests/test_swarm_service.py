"""The swarm with real processes on loopback: exactness, faults, refusals, bad bytes."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from procs import Service, coordinator, wait_for, worker

from foundry.model.formats.checkpoint import load_checkpoint
from foundry.model.formats.checkpoint_dir import latest_checkpoint
from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.text.data import load_corpus
from foundry.model.train.training import Trainer, TrainSettings
from foundry.swarm.core import HEARTBEAT_TIMEOUT_S
from foundry.wire import fdtc


def admin(port: int, msg: fdtc.Message, timeout_s: float = 10.0) -> fdtc.Message:
    """One request on the admin link, answered by one message."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(fdtc.encode(msg))
        dec = fdtc.FdtcDecoder()
        while True:
            data = s.recv(65536)
            assert data, "admin link closed without an answer"
            dec.feed(data)
            got = dec.next_event()
            if got is not None:
                return got


def status(port: int) -> fdtc.SwarmStatus:
    got = admin(port, fdtc.StatusReq())
    assert isinstance(got, fdtc.SwarmStatus)
    return got


def wait_step(port: int, step: int, within_s: float) -> fdtc.SwarmStatus:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        st = status(port)
        if st.global_step >= step:
            return st
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {within_s}s: {status(port)}")


# The learning rate of this comparison, given to both: at the default's 4e-3 three workers'
# sums, added in another order, drift 1.1e-6 from one process's in 20 steps (3e-3: under 1e-6).
LR = 3e-3


@pytest.mark.parametrize("n_workers", [2, 3])
def test_n_workers_give_the_weights_of_one_process(tmp_path: Path, n_workers: int) -> None:
    steps, batch = 20, 12
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        str(steps),
        "--global-batch",
        str(batch),
        "--checkpoint-every",
        "100",
        "--min-workers",
        str(n_workers),
        "--lr",
        str(LR),
    )
    workers = [worker(tmp_path, port, f"w{i}") for i in range(n_workers)]
    try:
        coord.wait_for(r"training done at step 20", within_s=120)
        # every round used all the workers: the global batch really was split
        assert "from 1 workers" not in coord.text()
    finally:
        for w in workers:
            w.stop()
        coord.stop()
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert ckpt is not None
    swarm = load_checkpoint(ckpt)
    assert swarm.step == steps

    cfg = preset("tiny")
    settings = TrainSettings(global_batch=batch, total_steps=steps, lr=LR)
    single = Trainer(cfg, settings, init_params(cfg, 0))
    corpus = load_corpus(None)
    for _ in range(steps):
        single.train_step(corpus)
    assert swarm.data_position == single.position
    worst = max(float(np.max(np.abs(swarm.params[k] - single.params[k]))) for k in single.params)
    assert worst <= 1e-6, f"max abs weight difference {worst:.3g} after {steps} steps"


def test_killed_worker_is_dropped_and_training_goes_on(tmp_path: Path) -> None:
    coord, port, admin_port = coordinator(
        tmp_path, "--max-steps", "100000", "--global-batch", "8", "--min-workers", "1"
    )
    a = worker(tmp_path, port, "alive")
    b = worker(tmp_path, port, "doomed")
    try:
        wait_step(admin_port, 3, 60)
        deadline = time.monotonic() + 30
        while len(status(admin_port).rows) < 2:
            assert time.monotonic() < deadline, "second worker never registered"
            time.sleep(0.1)
        before = status(admin_port).global_step
        b.kill()
        # EOF drops it at once (the log says so, not a heartbeat timeout); the swarm keeps
        # stepping with the other worker.
        st = wait_step(admin_port, before + 5, 30)
        assert [r.worker_id for r in st.rows] == ["alive"]
        assert re.search(r"dropped worker doomed \((?!heartbeat timeout)", coord.text()), (
            coord.text()[-2000:]
        )
        steps = [status(admin_port).global_step for _ in range(5)]
        assert steps == sorted(steps), "the global step went back"
        assert a.alive() and coord.alive(), "no other process may restart or die"
        assert a.pid == a.proc.pid
    finally:
        a.stop()
        coord.stop()


def test_coordinator_restart_resumes_and_workers_reconnect(tmp_path: Path) -> None:
    args = ("--max-steps", "100000", "--global-batch", "8", "--checkpoint-every", "5")
    coord, port, admin_port = coordinator(tmp_path, *args)
    w = worker(tmp_path, port, "w0")
    try:
        wait_step(admin_port, 11, 60)
        coord.kill()
        saved = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"))  # type: ignore[arg-type]
        assert saved.step >= 10
        # same ports again, so the worker finds it by itself
        coord = Service(
            [
                "coordinator",
                "--listen",
                f"127.0.0.1:{port}",
                "--admin-listen",
                f"127.0.0.1:{admin_port}",
                "--checkpoint-dir",
                str(tmp_path / "ckpt"),
                *args,
            ],
            tmp_path / "coordinator2.log",
        )
        coord.wait_for(rf"resumed from .* at step {saved.step}")
        # The checkpoint is read before the ports open: wait for them, then ask.
        coord.wait_for(rf"workers 127\.0\.0\.1:{port}, admin 127\.0\.0\.1:{admin_port}")
        first = wait_step(admin_port, saved.step, 30)
        assert first.global_step >= saved.step, "the step went back after the restart"
        wait_step(admin_port, saved.step + 3, 60)
        assert w.alive(), "the worker must survive the coordinator's restart"
        assert "reconnecting" in w.text() or "unreachable" in w.text()
    finally:
        w.stop()
        coord.stop()


def test_worker_with_other_data_is_refused_with_the_reason(tmp_path: Path) -> None:
    other = tmp_path / "other.txt"
    other.write_text("not the swarm's corpus " * 200)
    coord, port, _ = coordinator(tmp_path, "--max-steps", "5")
    try:
        with worker(tmp_path, port, "stranger", "--data", str(other)) as w:
            assert w.proc.wait(timeout=60) == 2
            assert "differs from the swarm's" in w.text()
            assert "--data" in w.text()
        assert coord.alive()
    finally:
        coord.stop()


def test_silent_worker_is_dropped_at_its_heartbeat_timeout(tmp_path: Path) -> None:
    coord, port, admin_port = coordinator(tmp_path, "--max-steps", "100000", "--wait-for-start")
    try:
        corpus = load_corpus(None)
        fp = corpus.fingerprint
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(
                fdtc.encode(fdtc.Dataset(n_tokens=fp.n_tokens, sha256=bytes.fromhex(fp.sha256)))
                + fdtc.encode(
                    fdtc.Register(
                        "mute", fdtc.PROTOCOL_VERSION, fdtc.HardwareProfile.LAPTOP_MID, 4, 8000, 8
                    )
                )
            )
            t0 = time.monotonic()
            wait_for(lambda: status(admin_port).rows, 10, "the worker listed")
            # Dropped for its silence: not before the timeout, and for that reason.
            wait_for(
                lambda: not status(admin_port).rows,
                10 * HEARTBEAT_TIMEOUT_S,
                "the silent worker dropped",
            )
            assert time.monotonic() - t0 >= HEARTBEAT_TIMEOUT_S
        assert "dropped worker mute (heartbeat timeout)" in coord.text()
    finally:
        coord.stop()


def test_bad_bytes_on_both_ports_never_stop_the_service(tmp_path: Path) -> None:
    coord, port, admin_port = coordinator(tmp_path, "--max-steps", "100000")
    w = worker(tmp_path, port, "good")
    rng = np.random.default_rng(7)
    garbage = [
        b"GARBAGE!" * 4,
        bytes.fromhex("43544446") + b"\x01" + (85).to_bytes(4, "little") + b"\x00" * 10,
        bytes.fromhex("43544446") + b"\x01" + (2**31).to_bytes(4, "little"),
        bytes.fromhex("43544446") + b"\x77" + bytes(4),
        bytes.fromhex("43544446") + b"\x01" + (3).to_bytes(4, "little") + b"abc",
        *[rng.bytes(int(rng.integers(1, 300))) for _ in range(40)],
    ]
    try:
        wait_step(admin_port, 2, 60)
        for target in (port, admin_port):
            for blob in garbage:
                with socket.create_connection(("127.0.0.1", target), timeout=5) as s:
                    s.sendall(blob)
                    s.shutdown(socket.SHUT_WR)
                    s.settimeout(5)
                    while s.recv(4096):
                        pass  # the service answers (ERROR) and closes, or just closes
        before = status(admin_port).global_step
        wait_step(admin_port, before + 3, 30)  # the good worker is still being served
        assert coord.alive() and w.alive()
        assert [r.worker_id for r in status(admin_port).rows] == ["good"]
    finally:
        w.stop()
        coord.stop()


def test_rounds_abandoned_again_and_again_show_in_status(tmp_path: Path) -> None:
    """A run that diverged (--lr 1e30: after the first step every gradient is NaN and is
    dropped) re-runs its step at each deadline; status carries a note that says so, rather
    than a bare TRAINING."""
    coord, port, admin_port = coordinator(
        tmp_path,
        "--max-steps",
        "50",
        "--global-batch",
        "4",
        "--lr",
        "1e30",
        "--warmup-steps",
        "1",
    )
    w = worker(tmp_path, port, "w0")
    try:
        abandoned = coord.wait_for(r"step (\d+) abandoned: .* re-running", within_s=60)
        # The round named is the one after the last loss line (the step it was to make).
        losses = re.findall(r"step (\d+): loss", coord.text()[: abandoned.start()])
        assert int(abandoned.group(1)) == int(losses[-1]) + 1, coord.text()[-3000:]
        deadline = time.monotonic() + 60
        note = ""
        while time.monotonic() < deadline and "times in a row" not in note:
            with socket.create_connection(("127.0.0.1", admin_port), timeout=10) as s:
                s.sendall(fdtc.encode(fdtc.SwarmDetailReq()))
                dec = fdtc.FdtcDecoder()
                got: list[fdtc.Message] = []
                while len(got) < 2:
                    data = s.recv(65536)
                    assert data, "admin link closed without an answer"
                    dec.feed(data)
                    got += list(dec.events())
            st, detail = got
            assert isinstance(st, fdtc.SwarmStatus) and isinstance(detail, fdtc.SwarmDetail)
            note = detail.note
            time.sleep(0.5)
        assert re.search(r"step \d+ abandoned \d+ times in a row", note), note
        assert "holds NaN/inf" in coord.text()
    finally:
        w.stop()
        coord.stop()


def test_copies_of_the_master_state_wait_for_the_step_under_way(tmp_path: Path) -> None:
    """CHECKPOINT and EXPORT from the admin link run while the round loop may be applying a
    step in a thread: they wait for it, then copy one step's state (weights and moments)."""
    import asyncio

    from foundry.model.formats.gguf_io import load_gguf
    from foundry.swarm.coordinator import Coordinator, CoordinatorOptions

    opts = CoordinatorOptions(
        host="127.0.0.1",
        port=0,
        admin_host="127.0.0.1",
        admin_port=0,
        checkpoint_dir=tmp_path / "ckpt",
        cfg=preset("tiny"),
        settings=TrainSettings(global_batch=8, total_steps=4),
        max_steps=4,
    )
    coord = Coordinator(opts, load_corpus(None))
    name = next(iter(coord.trainer.params))

    async def scenario() -> tuple[Path, Path]:
        coord._applied.clear()  # a step is being applied
        ckpt = asyncio.create_task(coord.checkpoint())
        export = asyncio.create_task(coord.export(tmp_path / "m.gguf"))
        await asyncio.sleep(0.2)
        assert not ckpt.done() and not export.done()  # neither copied a half-done step
        coord.trainer.params[name][...] = 7.0  # the step's result lands
        coord.trainer.optimizer.m[name][...] = 3.0
        coord._applied.set()
        return await ckpt, await export

    ckpt_path, gguf_path = asyncio.run(scenario())
    state = load_checkpoint(ckpt_path)
    assert float(state.params[name].min()) == float(state.params[name].max()) == 7.0
    assert float(state.optimizer["m"][name].max()) == 3.0
    # The checkpoint holds copies: the next step changing the moments does not reach it.
    coord.trainer.optimizer.m[name][...] = 5.0
    assert float(state.optimizer["m"][name].max()) == 3.0
    assert float(load_gguf(gguf_path).params[name].max()) == 7.0


def test_admin_shutdown_while_training_ends_on_a_checkpointed_last_step(tmp_path: Path) -> None:
    """SHUTDOWN from the admin link while two workers train: training ends after the round
    under way, and the final checkpoint is the step the acknowledgement names."""
    coord, port, admin_port = coordinator(
        tmp_path, "--max-steps", "100000", "--checkpoint-every", "1000"
    )
    workers = [worker(tmp_path, port, f"w{i}") for i in range(2)]
    try:
        wait_step(admin_port, 3, within_s=60)
        ack = admin(admin_port, fdtc.Shutdown(), timeout_s=60)
        assert isinstance(ack, fdtc.ControlAck) and ack.ok, ack
        m = re.fullmatch(r"shut down at step (\d+)", ack.message)
        assert m, ack.message
        assert coord.proc.wait(timeout=30) == 0, coord.text()
        ckpt = latest_checkpoint(tmp_path / "ckpt")
        assert ckpt is not None and load_checkpoint(ckpt).step == int(m.group(1)), coord.text()
        assert "abandoned" not in coord.text()
        for w in workers:
            assert w.proc.wait(timeout=30) == 0, w.text()
    finally:
        for w in workers:
            w.stop()
        coord.stop()


def test_a_seed_only_peer_asking_for_weights_during_a_step_gets_them_after_it(
    tmp_path: Path,
) -> None:
    """A seed-only peer has no assignment to carry the weights: a WEIGHTS_REQ that arrives
    while a step is applied is answered once it is done (it used to wait for ever)."""
    import asyncio
    import struct

    from foundry.swarm.coordinator import Coordinator, CoordinatorOptions

    magic = b"\x43\x54\x44\x46"
    opts = CoordinatorOptions(
        host="127.0.0.1",
        port=0,
        admin_host="127.0.0.1",
        admin_port=0,
        checkpoint_dir=tmp_path / "ckpt",
        cfg=preset("tiny"),
        settings=TrainSettings(global_batch=8, total_steps=4),
        max_steps=4,
        autostart=False,
    )

    def frame(msg_type: int, payload: bytes = b"") -> bytes:
        return magic + struct.pack("<BI", msg_type, len(payload)) + payload

    def types_within(sock: socket.socket, seconds: float) -> list[int]:
        """The message types that arrive within ``seconds`` (whole frames)."""
        sock.settimeout(0.1)
        buf, seen, deadline = b"", [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                continue
            assert data, "the coordinator closed the connection"
            buf += data
            while len(buf) >= 9 and len(buf) >= 9 + struct.unpack_from("<I", buf, 5)[0]:
                seen.append(buf[4])
                buf = buf[9 + struct.unpack_from("<I", buf, 5)[0] :]
        return seen

    async def scenario() -> tuple[list[int], list[int]]:
        coord = Coordinator(opts, load_corpus(None))
        await coord.start()
        sock = socket.create_connection(("127.0.0.1", coord.bound_port), timeout=10)
        try:
            register = b"c-worker".ljust(64, b"\0") + struct.pack("<BIIQI", 1, 4, 2, 4096, 4)
            sock.sendall(frame(0x01, register))  # REGISTER, no DATASET: seed-only
            assert 0x02 in await asyncio.to_thread(types_within, sock, 1.0)  # REGISTER_ACK
            coord._applied.clear()  # a step is being applied
            sock.sendall(frame(0x20))  # WEIGHTS_REQ
            during = await asyncio.to_thread(types_within, sock, 0.5)
            coord._applied.set()  # the step is done
            await coord._answer_weights_wanted()
            after = await asyncio.to_thread(types_within, sock, 2.0)
            return during, after
        finally:
            sock.close()
            coord.request_stop()
            await coord.close()

    during, after = asyncio.run(scenario())
    assert 0x22 not in during and 0x21 not in during  # not while the weights change
    assert after[:2] == [0x22, 0x21], after  # then WEIGHTS_META and WEIGHTS


@pytest.mark.parametrize("codec", ["fp16", "qsgd"])
def test_a_non_finite_gradient_is_not_sent_through_a_lossy_codec(
    tmp_path: Path, codec: str
) -> None:
    """QSGD cannot encode NaN (its task used to die without a word) and FP16's residual would
    carry it into every later upload: the worker says so, does not send it, starts its
    residuals again, and stays connected; the rounds are re-run as for a dropped gradient."""
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        "50",
        "--global-batch",
        "4",
        "--lr",
        "1e30",
        "--warmup-steps",
        "1",
        "--compression",
        codec,
    )
    w = worker(tmp_path, port, "w0")
    try:
        w.wait_for(r"step \d+: this worker's gradient holds NaN or inf; not sent", within_s=60)
        coord.wait_for(r"step \d+ abandoned: .* re-running", within_s=60)
        assert w.alive() and coord.alive()
        assert "Traceback" not in w.text() + coord.text()
    finally:
        w.stop()
        coord.stop()
