"""Local steps (--sync-every H), the update downlink and its integrity check, with real
coordinator processes on loopback."""

from __future__ import annotations

import re
import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procs import coordinator, wait_for, worker

from foundry.compression import deserialize_tensors
from foundry.model.formats.checkpoint import load_checkpoint
from foundry.model.formats.checkpoint_dir import latest_checkpoint
from foundry.model.spec.config import preset
from foundry.model.text.data import load_corpus
from foundry.model.train.training import TrainSettings
from foundry.swarm.coordinator import Coordinator, CoordinatorOptions
from foundry.swarm.sync import weights_digest
from foundry.wire import fdtc


class Link:
    """Our own FDTC messages over a plain socket: a worker driven by the test."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.dec = fdtc.FdtcDecoder()
        self.worker_id = ""  # set by register(): then heartbeats go out while recv waits

    def send(self, *msgs: fdtc.Message) -> None:
        self.sock.sendall(b"".join(fdtc.encode(m) for m in msgs))

    def recv(self) -> fdtc.Message:
        deadline = time.monotonic() + 20
        while True:
            msg = self.dec.next_event()
            if msg is not None:
                return msg
            # A registered worker heartbeats every 0.5 s while it waits, as ours do, so a
            # loaded machine never gets it dropped for silence (2.5 s).
            self.sock.settimeout(0.5 if self.worker_id else 20)
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                assert time.monotonic() < deadline, "nothing from the coordinator in 20 s"
                self.send(fdtc.Heartbeat(self.worker_id, 0, 0.0, 0.0))
                continue
            assert data, "coordinator closed the connection"
            self.dec.feed(data)

    def recv_until(self, *types: type[fdtc.Message]) -> fdtc.Message:
        while True:
            msg = self.recv()
            if isinstance(msg, types):
                return msg


def register(link: Link, worker_id: str) -> None:
    link.worker_id = worker_id
    fp = load_corpus(None).fingerprint
    link.send(
        fdtc.Dataset(n_tokens=fp.n_tokens, sha256=bytes.fromhex(fp.sha256)),
        fdtc.Register(
            worker_id=worker_id,
            protocol_version=fdtc.PROTOCOL_VERSION,
            profile=fdtc.HardwareProfile.LAPTOP_LIGHT,
            num_cores=2,
            memory_mb=4096,
            suggested_batch_size=4,
        ),
    )


class Held:
    """What a test-driven worker holds: the weights WEIGHTS gave it, moved by each UPDATE."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.numels: list[int] = []
        self.params: dict[str, np.ndarray] = {}
        self.step = -1

    def load(self, meta: fdtc.WeightsMeta, link: Link) -> None:
        self.names = [t.name for t in meta.tensors]
        self.numels = [int(np.prod(t.shape)) for t in meta.tensors]
        w = link.recv_until(fdtc.Weights)
        assert isinstance(w, fdtc.Weights)
        flat = np.frombuffer(w.data, "<f4").copy()
        self.params = dict(
            zip(self.names, np.split(flat, np.cumsum(self.numels)[:-1]), strict=True)
        )
        self.step = meta.global_step

    def add(self, update: fdtc.Update) -> None:
        assert update.base_step == self.step
        decoded = deserialize_tensors(update.data, self.numels, update.compression)
        for name, t in zip(self.names, decoded, strict=True):
            self.params[name] = self.params[name] + t
        self.step = update.global_step

    def digest(self) -> bytes:
        return weights_digest(self.params, self.names)

    def gradients(self, step: int) -> fdtc.Gradients:
        """A made-up gradient (every element 1e-3) for the round of ``step``."""
        data = b"".join(np.full(n, 1e-3, "<f4").tobytes() for n in self.numels)
        return fdtc.Gradients(
            worker_id="probe",
            local_step=step,
            num_tensors=len(self.numels),
            compression=fdtc.Compression.NONE,
            uncompressed_size=len(data),
            data=data,
        )


def test_local_steps_train_and_checkpoint_what_resumes_them(tmp_path: Path) -> None:
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        "16",
        "--global-batch",
        "8",
        "--sync-every",
        "4",
        "--checkpoint-every",
        "8",
        "--min-workers",
        "2",
        "--compression",
        "fp16",
        "--validate-every",
        "4",
    )
    workers = [worker(tmp_path, port, f"w{i}") for i in range(2)]
    try:
        coord.wait_for(r"training done at step 16", within_s=180)
        log = coord.text()
        # four rounds of four inner steps, each from both workers
        assert log.count("samples from 2 workers") == 4, log[-3000:]
        assert "step 4: loss" in log and "step 3: loss" not in log
        for w in workers:
            assert "sync every 4" in w.text()
    finally:
        for w in workers:
            w.stop()
        coord.stop()
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert ckpt is not None
    state = load_checkpoint(ckpt)
    # The data position moved by the samples the rounds planned: up to H x the global batch
    # each (a slower worker is given fewer inner steps, DyLU).
    planned = sum(int(n) for n in re.findall(r"(\d+) samples from 2 workers", log))
    assert state.step == 16 and state.data_position == planned and 4 * 8 <= planned <= 16 * 8
    assert state.extra["sync_every"] == 4 and state.extra["outer_steps"] == 4
    assert set(state.tensors) == {"shadow", "outer_m"}
    assert any(float(np.abs(m).max()) > 0 for m in state.tensors["outer_m"].values())

    # A coordinator built on that directory holds exactly the saved outer momentum, shadow and
    # position; one with another --sync-every refuses it with the reason.
    cfg = preset("tiny")
    opts = CoordinatorOptions(
        host="127.0.0.1",
        port=0,
        admin_host="127.0.0.1",
        admin_port=0,
        checkpoint_dir=tmp_path / "ckpt",
        cfg=cfg,
        settings=TrainSettings(global_batch=8, total_steps=16),
        max_steps=32,
        sync_every=4,
    )
    resumed = Coordinator(opts, load_corpus(None))
    assert resumed.step == 16 and resumed.trainer.position == planned
    assert resumed.outer_steps == 4
    for name, m in state.tensors["outer_m"].items():
        assert np.array_equal(resumed.outer.m[name], m)
        assert np.array_equal(resumed.shadow.params[name], state.tensors["shadow"][name])
    with pytest.raises(SystemExit, match="--sync-every 4"):
        Coordinator(CoordinatorOptions(**{**opts.__dict__, "sync_every": 1}), load_corpus(None))


def test_seed_only_peer_is_refused_in_local_step_mode(tmp_path: Path) -> None:
    coord, port, _ = coordinator(tmp_path, "--max-steps", "8", "--sync-every", "4")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            register = b"c-worker".ljust(64, b"\0") + struct.pack("<BIIQI", 1, 4, 2, 4096, 4)
            # REGISTER with no DATASET before it: a peer that speaks only the seed
            s.sendall(b"\x43\x54\x44\x46" + struct.pack("<BI", 0x01, len(register)) + register)
            link = Link.__new__(Link)
            link.sock, link.dec, link.worker_id = s, fdtc.FdtcDecoder(), ""
            ack = link.recv()
            assert isinstance(ack, fdtc.RegisterAck) and not ack.accepted
            err = link.recv()
            assert isinstance(err, fdtc.Error) and err.error_code == fdtc.ErrorCode.REJECTED
            assert "local steps (--sync-every 4)" in err.message
            assert "--sync-every 1" in err.message
    finally:
        coord.stop()


def test_updates_follow_the_weights_and_a_wrong_digest_gets_full_weights(
    tmp_path: Path,
) -> None:
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        "100",
        "--global-batch",
        "4",
        "--digest-every",
        "2",
    )
    link = Link(port)
    try:
        register(link, "probe")
        assert isinstance(link.recv_until(fdtc.RegisterAck), fdtc.RegisterAck)
        assert isinstance(link.recv_until(fdtc.ModelConfigMsg), fdtc.ModelConfigMsg)
        plan = link.recv_until(fdtc.TrainPlan)
        assert isinstance(plan, fdtc.TrainPlan) and plan.sync_every == 1
        assert plan.digest_every == 2 and plan.down_compression == fdtc.Compression.NONE
        # No WEIGHTS_REQ: the first assignment brings full weights with it.
        held = Held()
        seen: list[str] = []
        rounds = 0
        while rounds < 6:
            msg = link.recv()
            if isinstance(msg, fdtc.WeightsMeta):
                seen.append("full")
                held.load(msg, link)
            elif isinstance(msg, fdtc.Update):
                seen.append("update")
                held.add(msg)
                if held.step == 2:  # the right digest: updates go on
                    link.send(fdtc.WeightsDigest(2, held.digest()))
                if held.step == 4:  # a wrong one: full weights next
                    link.send(fdtc.WeightsDigest(4, bytes(32)))
            elif isinstance(msg, fdtc.Assign):
                assert msg.global_step == held.step
                link.send(held.gradients(msg.global_step))
                rounds += 1
        # full weights for step 0, updates to 1, 2, 3 and 4, then the digest of 4 was wrong
        assert seen == ["full", "update", "update", "update", "update", "full"], seen
        coord.wait_for(r"worker probe holds other weights than expected at step 4", 10)
        assert coord.text().count("holds other weights") == 1  # the right digest passed
    finally:
        link.sock.close()
        coord.stop()


def test_overlap_sends_the_next_assignment_before_the_update(tmp_path: Path) -> None:
    """--overlap: after a round closes, its worker gets the next LOCAL_ASSIGN first and the
    round's UPDATE after it; the last round has no next one; the shadow stays exact."""
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        "16",
        "--global-batch",
        "4",
        "--sync-every",
        "4",
        "--overlap",
        "--digest-every",
        "4",
        "--compression",
        "none",
    )
    link = Link(port)
    try:
        register(link, "probe")
        link.recv_until(fdtc.RegisterAck)
        link.recv_until(fdtc.ModelConfigMsg)
        plan = link.recv_until(fdtc.TrainPlan)
        assert isinstance(plan, fdtc.TrainPlan) and plan.flags == fdtc.TRAIN_PLAN_OVERLAP
        held = Held()
        seen: list[str] = []
        while "update 12->16" not in seen:
            msg = link.recv()
            if isinstance(msg, fdtc.WeightsMeta):
                held.load(msg, link)
                seen.append(f"full {held.step}")
            elif isinstance(msg, fdtc.Update):
                held.add(msg)
                seen.append(f"update {msg.base_step}->{held.step}")
                if held.step % 4 == 0:
                    link.send(fdtc.WeightsDigest(held.step, held.digest()))
            elif isinstance(msg, fdtc.LocalAssign):
                seen.append(f"assign {msg.global_step}")
                link.send(held.gradients(msg.global_step))
        assert seen == [
            "full 0",
            "assign 0",
            "assign 4",
            "update 0->4",
            "assign 8",
            "update 4->8",
            "assign 12",
            "update 8->12",
            "update 12->16",
        ], seen
        assert "holds other weights" not in coord.text()  # every digest matched
    finally:
        link.sock.close()
        coord.stop()


def test_overlapped_local_steps_train_with_real_workers(tmp_path: Path) -> None:
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        "24",
        "--global-batch",
        "8",
        "--sync-every",
        "4",
        "--overlap",
        "--min-workers",
        "2",
        "--compression",
        "qsgd",
        "--validate-every",
        "4",
    )
    workers = [worker(tmp_path, port, f"w{i}") for i in range(2)]
    try:
        coord.wait_for(r"training done at step 24", within_s=180)
        log = coord.text()
        assert log.count("samples from 2 workers") == 6, log[-3000:]
        losses = [float(x) for x in re.findall(r"validation loss ([\d.]+)", log)]
        assert len(losses) >= 6 and losses[-1] < losses[0], losses
        for w in workers:
            text = w.text()
            assert "ahead of that round's UPDATE (--overlap)" in text, text[-2000:]
            assert "asking for full weights" not in text
    finally:
        for w in workers:
            w.stop()
        coord.stop()


def test_status_counts_each_workers_inner_steps_and_bytes(tmp_path: Path) -> None:
    """Per worker, the inner steps its taken reports held and the bytes each way
    (SWARM_DETAIL), in local-step mode."""
    from foundry.up.clients import AdminLink

    coord, port, admin_port = coordinator(
        tmp_path,
        "--max-steps",
        "100000",
        "--global-batch",
        "8",
        "--sync-every",
        "4",
        "--checkpoint-every",
        "100000",
    )
    w = worker(tmp_path, port, "w0")
    link = AdminLink("127.0.0.1", admin_port)
    try:

        def after_two_rounds() -> tuple[Any, Any] | None:
            st, detail = link.status()
            return (st, detail) if st.global_step >= 8 and st.rows else None

        st, detail = wait_for(after_two_rounds, 120, "two rounds of four inner steps")
    finally:
        link.close()
        w.stop()
        coord.stop()
    row = detail.rows[0]
    # The only worker is the fastest: it runs all four inner steps of every round. A report
    # is counted when it is taken, the step advances after the outer step: one round apart
    # at most.
    assert row.inner_steps in (st.global_step, st.global_step + 4), (row, st.global_step)
    numel = sum(int(np.prod(s)) for s in preset("tiny").param_shapes().values())
    assert row.bytes_up == row.inner_steps // 4 * 4 * numel  # f32 pseudo-gradients
    assert row.bytes_down >= 4 * numel * (st.global_step // 4)  # weights, then updates
    assert detail.min_workers == 1 and not detail.failed and detail.note == ""


def test_overlapped_rounds_survive_a_killed_worker(tmp_path: Path) -> None:
    """kill -9 of a worker while rounds are opened ahead: it is dropped from the round it was
    given in advance, and the other worker trains on to the end."""
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        "400",
        "--global-batch",
        "8",
        "--sync-every",
        "4",
        "--overlap",
        "--min-workers",
        "1",
        "--compression",
        "fp16",
        "--validate-every",
        "100",
    )
    a = worker(tmp_path, port, "w0")
    b = worker(tmp_path, port, "w1")
    try:
        coord.wait_for(r"step \d+: loss .* from 2 workers", within_s=120)
        b.kill()
        coord.wait_for(r"dropped worker w1", within_s=20)
        coord.wait_for(r"training done at step 400", within_s=180)
        log = coord.text()
        assert "step 400: loss" in log
        after = log[log.index("dropped worker w1") :]
        assert re.search(r"step \d+: loss [\d.]+, \d+ samples from 1 workers", after), after[-2000:]
        a.wait_for(r"training done at step 400; exiting", within_s=20)
    finally:
        a.stop()
        b.stop()
        coord.stop()


def test_a_worker_that_stops_reading_does_not_hold_up_the_others_assignments(
    tmp_path: Path,
) -> None:
    """Assignments go out one worker at a time (``_send_staggered``), each for a bounded
    time: a registered worker that takes none of its 13.7 MB of weights (it only sends
    heartbeats) does not keep the next worker from its weights and ASSIGN."""
    coord, port, _ = coordinator(
        tmp_path,
        "--preset",
        "small",
        "--max-steps",
        "4",
        "--global-batch",
        "8",
        "--min-workers",
        "2",
        "--compression",
        "none",
    )
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.settimeout(20)
    stuck.connect(("127.0.0.1", port))
    fp = load_corpus(None).fingerprint
    stuck.sendall(
        b"".join(
            fdtc.encode(m)
            for m in (
                fdtc.Dataset(n_tokens=fp.n_tokens, sha256=bytes.fromhex(fp.sha256)),
                fdtc.Register(
                    worker_id="a-stuck",
                    protocol_version=fdtc.PROTOCOL_VERSION,
                    profile=fdtc.HardwareProfile.LAPTOP_LIGHT,
                    num_cores=2,
                    memory_mb=4096,
                    suggested_batch_size=4,
                ),
            )
        )
    )
    link = Link(port)
    try:
        coord.wait_for(r"a-stuck", within_s=20)
        register(link, "b-reads")
        got: fdtc.Message | None = None
        while not isinstance(got, fdtc.Assign):  # each recv fails after 20 s of nothing
            stuck.sendall(fdtc.encode(fdtc.Heartbeat("a-stuck", 0, 0.0, 0.0)))
            got = link.recv()
        # b-reads has its ASSIGN while a-stuck is still a member whose weights are not sent
        # (it reads nothing): had the send to a-stuck no bound, b-reads would wait until
        # a-stuck was dropped, or forever.
        assert "a-stuck" not in re.findall(r"dropped worker (\S+)", coord.text())
    finally:
        stuck.close()
        link.sock.close()
        coord.stop()
