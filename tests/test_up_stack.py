"""`foundry up`: the local stack as a real process, trained, served, killed, restarted."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from up_stack import ENV, Up, free_layout, running, start_up, wait_gone

from foundry.model.formats.checkpoint import CheckpointState, load_checkpoint
from foundry.model.formats.checkpoint_dir import latest_checkpoint, save_checkpoint
from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.train.optim import AdamW


@pytest.mark.slow
def test_up_trains_serves_answers_ctl_and_stops_clean(tmp_path: Path) -> None:
    up, ports = start_up(tmp_path, 2, "--steps", "30")
    gateway = f"127.0.0.1:{ports[ports.index('--gateway-port') + 1]}"
    try:
        done = up.wait_for(
            r"training done at step 30: loss ([\d.]+) -> ([\d.]+), held-out "
            r"([\d.]+) bits/byte: \d+% (?:below|above) gzip -9",
            90,
        )
        assert float(done.group(2)) < float(done.group(1)), "loss did not go down"
        # Samples while training, from the checkpoints (every tenth of the run): each from the
        # first kept checkpoint at or after a multiple of 3, the last one the final weights.
        steps = [int(m) for m in re.findall(r"^step (\d+): 'The ", up.text(), re.M)]
        assert len(steps) >= 2 and steps == sorted(set(steps)), up.text()
        assert steps[-1] == 30, up.text()
        up.wait_for(r"the model beats .*; it does not beat .*xz -9e primed", 10)
        sample = up.wait_for(
            r"sample \(temperature 0\.7, top-p 0\.9, seed 0, 64 tokens\): '(.*)'", 60
        )
        assert sample.group(1).startswith("The ")
        # foundry as the user's shell can run it: the venv's script when it is not on PATH
        foundry = (
            "foundry" if shutil.which("foundry") else str(Path(sys.executable).parent / "foundry")
        )
        up.wait_for(rf"ready in \d+ s: `{re.escape(foundry)} ctl --gateway {gateway} status`", 10)

        status = subprocess.run(
            [sys.executable, "-m", "foundry", "ctl", "--gateway", gateway, "status"],
            capture_output=True,
            text=True,
            timeout=60,
            env=ENV,
        )
        assert status.returncode == 0, status.stderr
        assert "training: DONE  step 30/30" in status.stdout
        assert "worker rank connected" in status.stdout

        children = up.children()
        assert set(children) == {
            "coordinator",
            "gateway",
            "worker-0",
            "worker-1",
            "tp-leader",
            "tp-worker",
        }
        assert all(running(children[n]) for n in ("coordinator", "gateway", "tp-leader"))
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=30) == 0, up.text()
        assert wait_gone(children, 1.0) == []
        assert "stopped 6 processes" in up.text()
        assert "had to be killed" not in up.text()
        assert (up.run_dir / "model.gguf").is_file()
        assert (up.run_dir / "logs" / "coordinator.log").is_file()
    finally:
        up.cleanup()


def test_a_resumed_up_says_from_which_step(tmp_path: Path) -> None:
    cfg = preset("tiny")
    params = init_params(cfg)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    save_checkpoint(
        tmp_path / "run" / "checkpoints",
        CheckpointState(
            config=cfg,
            step=7,
            params=params,
            optimizer=AdamW(params).state_dict(),
            data_position=7 * 16,
        ),
    )
    up = Up(tmp_path, "--workers", "1", "--steps", "100000", *free_layout(1))
    try:
        up.wait_for(
            r"resuming from step 7 \(the newest checkpoint in \S+; --fresh starts at "
            r"step 0\)",
            90,
        )
        up.proc.send_signal(signal.SIGINT)
        up.proc.wait(timeout=30)
    finally:
        up.cleanup()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_up_killed_while_training_leaves_no_process(tmp_path: Path, sig: signal.Signals) -> None:
    up, _ = start_up(tmp_path, 1, "--steps", "100000")
    try:
        up.wait_for(r"training tiny for 100000 steps", 60)
        children = up.children()
        assert len(children) == 3
        os.kill(up.proc.pid, sig)
        up.proc.wait(timeout=30)
        # After SIGKILL the kernel's parent-death signal (SIGKILL) ends them.
        assert wait_gone(children, 15.0) == [], up.text()
    finally:
        up.cleanup()


def test_one_stack_per_run_dir_and_dead_services_come_back(tmp_path: Path) -> None:
    """A second `foundry up` in a running stack's run dir (on other ports, with --fresh) is
    refused with the holder's pid and touches nothing; a worker and the coordinator killed
    with SIGKILL are restarted, and training goes on from the last checkpoint."""
    up, _ = start_up(tmp_path, 1, "--steps", "100000", "--checkpoint-every", "2")
    try:
        up.wait_for(r"training tiny for 100000 steps", 60)
        ckpts = up.run_dir / "checkpoints"
        deadline = time.monotonic() + 60
        while not list(ckpts.glob("*.ckpt")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(ckpts.glob("*.ckpt")), up.text()
        sentinel = ckpts / "sentinel"
        sentinel.write_text("the first stack's\n")

        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "foundry",
                "up",
                "--run-dir",
                str(up.run_dir),
                "--fresh",
                "--no-prometheus",
                *free_layout(1),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=ENV,
        )
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"in use by another `foundry up` (pid {up.proc.pid})" in second.stderr
        assert "--run-dir" in second.stderr
        assert sentinel.exists(), "--fresh deleted the running stack's checkpoints"
        assert up.children()  # stack.json is still the first stack's

        worker = up.children()["worker-0"]
        os.kill(worker, signal.SIGKILL)
        up.wait_for(r"restarted worker-0 \(exit -9\) after 1\.0 s", 30)
        assert up.children()["worker-0"] != worker
        assert "restarted worker-0 (exit -9)" in (up.run_dir / "logs/worker-0.log").read_text()

        os.kill(up.children()["coordinator"], signal.SIGKILL)
        up.wait_for(r"restarted coordinator \(exit -9\) after 1\.0 s", 30)
        log = up.run_dir / "logs" / "coordinator.log"

        def since_restart() -> str:
            return log.read_text().rpartition("restarted coordinator (exit -9)")[2]

        pattern = r"resumed from \S+ at step (\d+)(?s:.*)step (\d+): loss"
        deadline = time.monotonic() + 60
        while not re.search(pattern, since_restart()) and time.monotonic() < deadline:
            assert up.proc.poll() is None, up.text()
            time.sleep(0.2)
        m = re.search(pattern, since_restart())
        assert m is not None, since_restart()[-3000:]
        assert int(m.group(2)) > int(m.group(1)), "training did not go on after the restart"
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=30) == 0, up.text()
        # Ctrl+C loses no step: the coordinator wrote its last completed one.
        last = max(int(s) for s in re.findall(r"step (\d+): loss", since_restart()))
        found = latest_checkpoint(ckpts)
        assert found is not None and load_checkpoint(found).step == last, since_restart()[-2000:]
    finally:
        up.cleanup()


def test_a_service_that_keeps_failing_is_left_down_with_the_command_to_start_it(
    tmp_path: Path,
) -> None:
    """worker-0 killed with SIGKILL five times within a minute: restarted after each of the
    first four (1, 2, 4, 8 s of backoff), then left down; the live view and its log say so
    and give the command that starts it by hand, and that command, run as printed, brings
    it back into the run."""
    up, _ = start_up(tmp_path, 1, "--steps", "100000")
    by_hand: subprocess.Popen[bytes] | None = None
    try:
        up.wait_for(r"training tiny for 100000 steps", 60)
        for kill in range(1, 6):
            pid = up.children()["worker-0"]
            os.kill(pid, signal.SIGKILL)
            if kill < 5:
                deadline = time.monotonic() + 30
                while up.text().count("restarted worker-0 (exit -9)") < kill:
                    assert time.monotonic() < deadline, up.text()
                    time.sleep(0.05)
                assert up.children()["worker-0"] != pid
        m = up.wait_for(
            r"worker-0 failed 5 times within 60 s \(last exit -9\); not restarting it "
            r"\(log (\S+)\)\. To start it by hand: (.+)\n",
            30,
        )
        log = Path(m.group(1))
        assert log == up.run_dir / "logs" / "worker-0.log"
        assert "worker-0 failed 5 times within 60 s" in log.read_text()
        time.sleep(2.0)  # RESTART_MAX_S is far off: nothing restarts it meanwhile
        assert "restarted worker-0 (exit -9)" not in up.text().rpartition("not restarting")[2]
        assert not running(up.children()["worker-0"])
        # The printed command, run as it is, starts the worker: it joins the run again.
        before = len(log.read_text())
        coordinator_log = up.run_dir / "logs" / "coordinator.log"

        def registrations() -> int:
            return coordinator_log.read_text().count("worker worker-0 registered")

        registered = registrations()
        by_hand = subprocess.Popen(["bash", "-c", m.group(2)], start_new_session=True)
        deadline = time.monotonic() + 60
        while registrations() == registered or not re.search(
            r"metrics :\d+", log.read_text()[before:]
        ):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=30) == 0, up.text()
    finally:
        if by_hand is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(by_hand.pid, signal.SIGKILL)
            by_hand.wait(timeout=10)
        up.cleanup()
