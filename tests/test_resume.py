"""A resumed run is the run that never stopped: restart from the checkpoint of step k, train to
step n, and the checkpoint of step n is the same, tensor for tensor and bit for bit, as the one
the uninterrupted run wrote. That is every piece of state a checkpoint must carry: the
parameters, AdamW's moments and step count, the data position, the swarm's shadow weights and
the outer optimizer's momentum, and the run's settings.

Through the public entry points only (``foundry train``, ``foundry coordinator`` with a real
``foundry worker``, and the checkpoint files they write): the restart is a new process that
finds the older checkpoint in its --checkpoint-dir, as after a crash. The codecs here draw no
random numbers (compression none), or only the coordinator's own downlink QSGD, whose generator
state the checkpoint carries, so two runs of the same steps are bit-identical.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from procs import ENV, coordinator, worker
from test_swarm_local import Held, Link, register

from foundry.model.formats.checkpoint import CheckpointState, load_checkpoint
from foundry.model.formats.checkpoint_dir import checkpoint_name, latest_checkpoint
from foundry.wire import fdtc


def assert_same_state(resumed: CheckpointState, straight: CheckpointState) -> None:
    assert resumed.config == straight.config
    assert resumed.step == straight.step
    assert resumed.data_position == straight.data_position
    assert resumed.extra == straight.extra
    assert resumed.optimizer["step"] == straight.optimizer["step"]
    groups = {
        "params": (resumed.params, straight.params),
        "m": (resumed.optimizer["m"], straight.optimizer["m"]),
        "v": (resumed.optimizer["v"], straight.optimizer["v"]),
    }
    assert set(resumed.tensors) == set(straight.tensors)
    groups.update({g: (resumed.tensors[g], straight.tensors[g]) for g in straight.tensors})
    for group, (got, want) in groups.items():
        assert list(got) == list(want), group
        different = [k for k in want if not np.array_equal(got[k], want[k])]
        assert not different, f"{group}: {len(different)} tensors differ, e.g. {different[:3]}"


def restart_dir(straight: Path, step: int, into: Path) -> Path:
    """A checkpoint folder holding only the straight run's checkpoint of ``step``."""
    into.mkdir(parents=True)
    shutil.copy2(straight / checkpoint_name(step), into / checkpoint_name(step))
    return into


# ---------------------------------------------------------------------------- foundry train

TRAIN = [
    "--preset",
    "tiny",
    "--steps",
    "6",
    "--global-batch",
    "4",
    "--seq-len",
    "32",
    "--checkpoint-every",
    "3",
    "--eval-every",
    "1000",
    "--sample-every",
    "0",
    "--no-progress",
]


def train(ckpt: Path) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "foundry", "train", *TRAIN, "--checkpoint-dir", str(ckpt)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=240,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout


def test_foundry_train_resumes_where_it_stopped(tmp_path: Path) -> None:
    train(tmp_path / "straight")
    resumed_dir = restart_dir(tmp_path / "straight", 3, tmp_path / "resumed")
    out = train(resumed_dir)
    assert "resuming from" in out and "at step 3" in out
    straight = load_checkpoint(tmp_path / "straight" / checkpoint_name(6))
    assert straight.step == straight.optimizer["step"] == 6 and straight.data_position == 6 * 4
    assert_same_state(load_checkpoint(resumed_dir / checkpoint_name(6)), straight)


def test_ctrl_c_in_foundry_train_says_how_to_resume(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "foundry",
            "train",
            *TRAIN[:2],
            "--steps",
            "100000",
            *TRAIN[4:],
            "--checkpoint-dir",
            str(ckpt),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    try:
        assert proc.stdout is not None
        for _ in range(200):  # up to the first progress line (every 10 steps)
            line = proc.stdout.readline()
            if not line or line.startswith("step 10: loss"):
                break
        assert line.startswith("step 10: loss"), line
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == 130
    assert re.search(
        rf"interrupted at step (\d+); checkpoint written to {re.escape(str(ckpt))}: "
        r"run the same command again to resume from this step",
        rest,
    ), rest
    assert latest_checkpoint(ckpt) is not None


# ---------------------------------------------------------------------------- the swarm


def swarm(run: Path, *extra: str) -> CheckpointState:
    """A coordinator on ``run/ckpt`` and one worker, to --max-steps; its last checkpoint."""
    run.mkdir(exist_ok=True)
    coord, port, _ = coordinator(
        run,
        "--global-batch",
        "4",
        "--compression",
        "none",
        "--validate-every",
        "1000",
        "--min-workers",
        "1",
        *extra,
    )
    w = worker(run, port, "w0")
    try:
        coord.wait_for(r"training done at step \d+", within_s=180)
    finally:
        w.stop()
        coord.stop()
    found = latest_checkpoint(run / "ckpt")
    assert found is not None
    return load_checkpoint(found)


def test_synchronous_coordinator_resumes_where_it_stopped(tmp_path: Path) -> None:
    """With a real worker: a worker of the resumed run starts from the weights it is sent, so
    the whole swarm's state is the coordinator's checkpoint. (The local-step mode's workers
    keep inner AdamW moments of their own: the next test resumes that coordinator under a
    worker the test drives.)"""
    straight = swarm(tmp_path / "straight", "--max-steps", "4", "--checkpoint-every", "2")
    assert straight.step == straight.optimizer["step"] == 4 and straight.data_position == 16
    assert set(straight.tensors) == {"shadow"}
    resumed_run = tmp_path / "resumed"
    restart_dir(tmp_path / "straight" / "ckpt", 2, resumed_run / "ckpt")
    resumed = swarm(resumed_run, "--max-steps", "4", "--checkpoint-every", "2")
    assert "resumed from" in (resumed_run / "coordinator.log").read_text()
    assert_same_state(resumed, straight)


def test_coordinator_with_a_random_downlink_codec_resumes_where_it_stopped(
    tmp_path: Path,
) -> None:
    """QSGD on the UPDATEs rounds stochastically: the codec's generator state is part of the
    checkpoint, so the resumed run draws what the straight one drew from step 2 on (the
    uploads stay uncompressed: a worker's own draws are not the coordinator's to restore)."""
    args = ("--max-steps", "4", "--checkpoint-every", "2", "--down-compression", "qsgd")
    straight = swarm(tmp_path / "straight", *args)
    assert straight.extra["down_compression"] == "qsgd" and "downlink_rng" in straight.extra
    resumed_run = tmp_path / "resumed"
    restart_dir(tmp_path / "straight" / "ckpt", 2, resumed_run / "ckpt")
    resumed = swarm(resumed_run, *args)
    assert "resumed from" in (resumed_run / "coordinator.log").read_text()
    assert_same_state(resumed, straight)


def probed_local_steps(run: Path, steps: int) -> CheckpointState:
    """A coordinator in local-step mode (H = 2) on ``run/ckpt`` to ``steps``, its one worker
    driven by the test: each round's pseudo-gradient is the same made-up tensor, so the outer
    optimizer's path depends on nothing but the coordinator's own state."""
    run.mkdir(exist_ok=True)
    coord, port, _ = coordinator(
        run,
        "--max-steps",
        str(steps),
        "--global-batch",
        "4",
        "--sync-every",
        "2",
        "--checkpoint-every",
        "4",
        "--compression",
        "none",
        "--validate-every",
        "1000",
    )
    link = Link(port)
    try:
        register(link, "probe")
        held = Held()
        while True:
            msg = link.recv()
            if isinstance(msg, fdtc.WeightsMeta):
                held.load(msg, link)
            elif isinstance(msg, fdtc.Update):
                held.add(msg)
            elif isinstance(msg, fdtc.LocalAssign):
                link.send(held.gradients(msg.global_step))
            elif isinstance(msg, fdtc.Shutdown):
                break
        coord.wait_for(rf"training done at step {steps}")
    finally:
        link.sock.close()
        coord.stop()
    found = latest_checkpoint(run / "ckpt")
    assert found is not None
    return load_checkpoint(found)


def test_local_step_coordinator_resumes_where_it_stopped(tmp_path: Path) -> None:
    straight = probed_local_steps(tmp_path / "straight", 8)
    assert straight.step == 8 and straight.extra["outer_steps"] == 4
    assert set(straight.tensors) == {"shadow", "outer_m"}
    assert all(np.abs(m).max() > 0 for m in straight.tensors["outer_m"].values())
    resumed_run = tmp_path / "resumed"
    restart_dir(tmp_path / "straight" / "ckpt", 4, resumed_run / "ckpt")
    resumed = probed_local_steps(resumed_run, 8)
    assert "resumed from" in (resumed_run / "coordinator.log").read_text()
    assert_same_state(resumed, straight)


def test_ctrl_c_is_taken_at_the_end_of_a_step_and_twice_at_once() -> None:
    """The first SIGINT only asks the loop to stop (``check`` raises at the step's end, so
    no finalizer that happens to run can swallow it); a second raises at once; the handler
    before is back afterwards."""
    import os

    from foundry.commands.train_checkpoints import StepInterrupt

    before = signal.getsignal(signal.SIGINT)
    with StepInterrupt() as ctrl_c:
        ctrl_c.check()  # nothing asked yet
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs at the next bytecode boundaries
            if ctrl_c.requested:
                break
        assert ctrl_c.requested
        try:
            ctrl_c.check()
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("check did not raise after a Ctrl+C")
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("a second Ctrl+C did not stop at once")
    assert signal.getsignal(signal.SIGINT) is before
