"""Faults with real processes: a disk that cannot take a checkpoint, a stop mid-run, exports
to places they must not go, a worker that cannot train. Each is a row of the fault table in
docs/guide/recovering.md."""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from gateway_pair import free_port
from procs import (
    IS_ROOT,
    NEEDS_ROOT,
    Service,
    coordinator,
    full_dir,
    needs,
    pinned_file,
    read_only_dir,
    worker,
)
from test_swarm_service import admin, status, wait_step

from foundry.model.formats.checkpoint import CheckpointState, load_checkpoint
from foundry.model.formats.checkpoint_dir import latest_checkpoint, save_checkpoint
from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.up.clients import AdminLink
from foundry.up.plan import StackError
from foundry.wire import fdtc


def scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not exposed"
    return float(m.group(1))


@needs(IS_ROOT, NEEDS_ROOT)
@pytest.mark.parametrize("disk", ["read-only", "full"])
def test_a_checkpoint_that_cannot_be_written_is_retried_while_training_goes_on(
    tmp_path: Path, disk: str
) -> None:
    mount = read_only_dir if disk == "read-only" else full_dir
    with mount(tmp_path / "ckpt"):
        coord, port, admin_port = coordinator(
            tmp_path,
            "--max-steps",
            "100000",
            "--checkpoint-every",
            "2",
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
        )
        w = worker(tmp_path, port, "w0")
        try:
            metrics_port = int(coord.wait_for(r"metrics :(\d+)").group(1))
            coord.wait_for(r"step 2: could not write checkpoint", within_s=60)
            # Training goes on past the failed checkpoint, and the next steps try again.
            st = wait_step(admin_port, 6, within_s=60)
            assert st.state is fdtc.SwarmState.TRAINING
            assert scrape(metrics_port, "foundry_swarm_checkpoint_failures_total") >= 2
            assert "retrying after the next step" in coord.text()
            # Status says so, with the step it began at, while the state stays TRAINING.
            link = AdminLink("127.0.0.1", admin_port)
            try:
                st, detail = link.status()
            finally:
                link.close()
            assert st.state is fdtc.SwarmState.TRAINING and not detail.failed
            assert detail.note.startswith(
                "checkpoints failing since step 2: could not write checkpoint"
            ), detail.note
            got = admin(admin_port, fdtc.Checkpoint())
            assert isinstance(got, fdtc.ControlAck) and not got.ok
            assert got.message.startswith("could not write checkpoint"), got.message
            assert re.search(r"Read-only file system|No space left on device", got.message)
            assert coord.alive() and "Traceback" not in coord.text()
        finally:
            w.stop()
            coord.stop()
    assert "internal task failed" not in coord.text()


@needs(IS_ROOT, NEEDS_ROOT)
def test_a_task_that_fails_ends_the_coordinator_with_status_1_and_its_cause(
    tmp_path: Path,
) -> None:
    """A checkpoint dir where an old checkpoint cannot be removed (bind-mounted: EBUSY): the
    new checkpoint is written, pruning the oldest fails with an OSError that the checkpoint
    retry does not cover, and the round loop dies. The process must not stay half alive: an
    admin link open at that moment is told FAILED with the cause (SWARM_DETAIL) and ERROR for
    any other request, `foundry ctl watch` through the gateway shows FAILED with the cause
    and exits 1, the coordinator exits 1 with the cause as its last line, and `foundry ctl
    status` then says it cannot be reached, what it last reported and what to do."""
    # A valid checkpoint of step 0 (pruning counts only checkpoints that verify, and sets a
    # damaged one aside instead of deleting it), which the coordinator resumes from.
    cfg = preset("tiny")
    params = init_params(cfg, 0)
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    step0 = save_checkpoint(
        tmp_path / "step0",
        CheckpointState(
            config=cfg,
            step=0,
            params=params,
            optimizer={"step": 0, "m": zeros, "v": zeros},
            data_position=0,
            extra={"sync_every": 1},
        ),
    ).read_bytes()
    (tmp_path / "ckpt").mkdir()
    with pinned_file(tmp_path / "ckpt" / "step-000000.ckpt", step0):
        coord, port, admin_port = coordinator(
            tmp_path, "--max-steps", "100000", "--checkpoint-every", "1"
        )
        gateway = Service(
            [
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--coordinator-admin",
                f"127.0.0.1:{admin_port}",
                "--tp-frontend",
                f"127.0.0.1:{free_port()}",
            ],
            tmp_path / "gateway.log",
        )
        target = "127.0.0.1:" + gateway.wait_for(r"grpc 127\.0\.0\.1:(\d+)").group(1)
        watch = Service(
            ["ctl", "watch", "--gateway", target, "--interval", "0.1"], tmp_path / "watch.log"
        )
        link = AdminLink("127.0.0.1", admin_port)
        w: Service | None = None
        try:
            watch.wait_for(r"training: WAITING: 0 of 1 workers", within_s=30)
            w = worker(tmp_path, port, "w0")
            deadline = time.monotonic() + 60
            st, detail = link.status()
            while not detail.failed:
                assert time.monotonic() < deadline and coord.alive(), coord.text()[-3000:]
                assert st.state in (fdtc.SwarmState.WAITING, fdtc.SwarmState.TRAINING)
                time.sleep(0.05)
                st, detail = link.status()
            assert detail.note.startswith("round loop failed: OSError: [Errno 16]"), detail
            assert "step-000000.ckpt" in detail.note
            with pytest.raises(StackError, match=r"the coordinator failed \(round loop failed"):
                link.request(fdtc.Checkpoint())
            assert watch.proc.wait(timeout=30) == 1, watch.text()[-2000:]
            assert re.search(
                r"training: FAILED: round loop failed: OSError: \[Errno 16\] "
                r"Device or resource busy",
                watch.text(),
            ), watch.text()[-2000:]
            assert coord.proc.wait(timeout=30) == 1
            # Its health turned NOT_SERVING with the cause (probed every second, so at least
            # once while it told the failure).
            assert re.search(
                r"coordinator is not serving \(the coordinator failed: round loop "
                r"failed: OSError",
                gateway.text(),
            ), gateway.text()[-2000:]
            with Service(["ctl", "status", "--gateway", target], tmp_path / "status.log") as ctl:
                assert ctl.proc.wait(timeout=30) == 1
            assert "training: unavailable (UNAVAILABLE: coordinator admin link" in ctl.text()
            assert "it last reported FAILED: round loop failed: OSError" in ctl.text()
            assert "resumes from its last checkpoint" in ctl.text()
        finally:
            link.close()
            watch.stop()
            if w is not None:
                w.stop()
            gateway.stop()
            coord.stop()
    lines = coord.text().strip().splitlines()
    assert re.fullmatch(
        r"error: coordinator round loop failed: OSError: \[Errno 16\] Device or resource "
        r"busy: '.*step-000000\.ckpt'",
        lines[-1],
    ), lines[-5:]
    # The checkpoint of the step was written before the prune failed: nothing is lost.
    found = latest_checkpoint(tmp_path / "ckpt")
    assert found is not None and load_checkpoint(found).step >= 3


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_writes_a_checkpoint_of_the_last_completed_step(
    tmp_path: Path, sig: signal.Signals
) -> None:
    coord, port, admin_port = coordinator(
        tmp_path,
        "--max-steps",
        "100000",
        "--checkpoint-every",
        "100000",
    )
    w = worker(tmp_path, port, "w0")
    try:
        wait_step(admin_port, 3, within_s=60)
        assert latest_checkpoint(tmp_path / "ckpt") is None
        os.kill(coord.pid, sig)
        assert coord.proc.wait(timeout=30) == 0, coord.text()[-2000:]
    finally:
        w.stop()
        coord.stop()
    last = max(int(s) for s in re.findall(r"step (\d+): loss", coord.text()))
    found = latest_checkpoint(tmp_path / "ckpt")
    assert found is not None, coord.text()[-2000:]
    assert load_checkpoint(found).step == last >= 3
    assert f"stopping at step {last}: writing a final checkpoint" in coord.text()


def test_exports_never_overwrite_other_files_nor_leave_the_export_dir(tmp_path: Path) -> None:
    coord, _, admin_port = coordinator(tmp_path, "--max-steps", "10", "--wait-for-start")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    outside = tmp_path.parent / f"outside-{os.getpid()}.gguf"
    try:

        def export(path: Path) -> fdtc.ControlAck:
            got = admin(admin_port, fdtc.Export(path=str(path)), timeout_s=60)
            assert isinstance(got, fdtc.ControlAck)
            return got

        got = export(notes)
        assert not got.ok and "exists and is not a GGUF file; not overwriting it" in got.message
        assert notes.read_text() == "my notes\n"
        got = export(outside)
        assert not got.ok and "is outside the export dir" in got.message
        assert "--export-anywhere" in got.message and not outside.exists()
        got = export(tmp_path / "missing" / "m.gguf")
        assert not got.ok and "does not exist; create it first" in got.message
        # Refusals are answers, not broken links: the same connection's next request works.
        got = export(tmp_path / "m.gguf")
        assert got.ok and got.message == str(tmp_path / "m.gguf")
        got = export(tmp_path / "m.gguf")  # a GGUF is replaced by a newer one
        assert got.ok, got.message
        assert isinstance(status(admin_port), fdtc.SwarmStatus)
        assert "Traceback" not in coord.text() and "Unhandled exception" not in coord.text()
    finally:
        coord.stop()
        outside.unlink(missing_ok=True)


def test_a_worker_that_cannot_train_says_so_and_no_round_waits_on_it(tmp_path: Path) -> None:
    corpus = tmp_path / "small.txt"
    corpus.write_text("too short to train on\n")
    coord, port, admin_port = coordinator(tmp_path, "--data", str(corpus), "--max-steps", "5")
    w = worker(tmp_path, port, "w0", "--data", str(corpus))
    try:
        assert w.proc.wait(timeout=60) == 2, w.text()
        assert re.search(r"cannot train step 0: corpus .* too few", w.text())
        coord.wait_for(r"worker w0 reports error 9: cannot train step 0", within_s=10)
        deadline = time.monotonic() + 10
        while status(admin_port).rows and time.monotonic() < deadline:
            time.sleep(0.1)
        st = status(admin_port)
        # Nobody left to train: WAITING (not TRAINING), and the log says how many are missing.
        assert st.state is fdtc.SwarmState.WAITING and not st.rows
        assert "waiting for 1 more worker(s)" in coord.text()
        assert "Task exception was never retrieved" not in w.text() + coord.text()
    finally:
        w.stop()
        coord.stop()


def test_a_worker_dropped_right_after_each_registration_backs_off(tmp_path: Path) -> None:
    """A coordinator that accepts the worker and closes the link at once, every time (as one
    that cannot serve it would): the worker dials again later each time, not several times a
    second (it dialled about every 200 ms before)."""

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    dials: list[float] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            dials.append(time.monotonic())
            with conn:
                conn.settimeout(5)
                dec = fdtc.FdtcDecoder()
                while not any(isinstance(m, fdtc.Register) for m in dec.queued()):
                    data = conn.recv(4096)
                    if not data:
                        break
                    dec.feed(data)
                conn.sendall(
                    fdtc.encode(
                        fdtc.RegisterAck(
                            accepted=True,
                            assigned_shard=0,
                            total_shards=1,
                            batch_size=4,
                            accumulation_steps=1,
                            compression=fdtc.Compression.NONE,
                            topk_ratio=0.0,
                            global_step=0,
                        )
                    )
                )

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    w = worker(tmp_path, port, "dropped")
    try:
        time.sleep(6.0)
        log = w.text()
    finally:
        w.stop()
        stop.set()
        server.join(timeout=5)
        listener.close()
    # Delays of 0.25-0.5, 0.5-1, 1-2, 2-4 s: at most 5 dials in 6 s (about 30 without backoff).
    assert 2 <= len(dials) <= 5, (dials, log[-2000:])
    gaps = [b - a for a, b in itertools.pairwise(dials)]
    assert gaps == sorted(gaps), gaps
    assert re.search(
        r"lost the coordinator: .*; reconnecting in \d+\.\ds \(the link held "
        r"0\.\ds\)",
        log,
    )
