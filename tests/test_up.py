"""`foundry up`: the local stack as a real process, and the pure parts of its plan."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundry.model.formats.checkpoint import CheckpointState, load_checkpoint
from foundry.model.formats.checkpoint_dir import checkpoint_name, latest_checkpoint, save_checkpoint
from foundry.model.infer.generate import printable
from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.train.optim import AdamW
from foundry.up.pipeline import CheckpointSamples
from foundry.up.plan import (
    RESTART_MAX_S,
    ServiceSpec,
    StackError,
    StackOptions,
    StackPorts,
    default_checkpoint_every,
    gives_up,
    prometheus_config,
    restart_delay,
    serving_services,
    training_services,
)
from foundry.up.supervisor import PORT_FLAGS, Stack, check_ports_free
from foundry.up.view import LiveView, TrainingSummary, waiting_note, worker_line
from foundry.wire import fdtc

ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------------------- the plan


def test_default_ports_meet_the_other_commands_defaults() -> None:
    ports = StackPorts.of(StackOptions())
    # foundry worker --coordinator, foundry ctl --gateway, tp-worker --leader defaults.
    assert (ports.coordinator, ports.gateway, ports.tp_leader) == (7070, 50051, 7090)
    assert (ports.admin, ports.tp_frontend) == (7071, 7091)
    # The metrics port plan of services/prometheus/prometheus.yml.
    assert (
        ports.coordinator_metrics,
        ports.tp_leader_metrics,
        ports.gateway_metrics,
        ports.tp_worker_metrics,
    ) == (9100, 9102, 9103, 9104)
    assert ports.worker_metrics == (9110, 9111)
    assert ports.prometheus == 9090


def test_every_port_is_distinct_and_checked() -> None:
    ports = StackPorts.of(StackOptions(workers=5, prometheus=False))
    numbers = [p for _, p in ports.named()]
    assert len(numbers) == len(set(numbers)) == 10 + 5


def test_a_taken_port_is_named_before_anything_starts() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        ports = StackPorts.of(StackOptions(gateway_port=taken, prometheus=False))
        with pytest.raises(StackError, match=rf"port {taken} \(gateway\).*is taken"):
            check_ports_free(ports, "127.0.0.1")


def test_a_taken_port_names_the_flag_that_moves_it() -> None:
    """8080 is the likeliest port to be taken: the error names --http-port for it, and every
    port flag of `foundry up` (each one a flag its --help lists)."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        ports = StackPorts.of(StackOptions(http_port=taken, prometheus=False))
        with pytest.raises(StackError) as caught:
            check_ports_free(ports, "127.0.0.1")
    text = str(caught.value)
    assert f"port {taken} (gateway http)" in text and "move it with --http-port" in text
    help_text = subprocess.run(
        [sys.executable, "-m", "foundry", "up", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    flags = set(re.findall(r"--[a-z-]+-port\b", help_text))
    assert flags == set(PORT_FLAGS)
    for flag in PORT_FLAGS:
        assert flag in text


def test_overlapping_bases_are_refused() -> None:
    ports = StackPorts.of(StackOptions(base_port=9080))  # TP leader 9100 = coordinator metrics
    with pytest.raises(StackError, match="port 9100 is both"):
        check_ports_free(ports, "127.0.0.1")


def test_bad_options_are_refused() -> None:
    with pytest.raises(StackError, match="--steps"):
        StackOptions(steps=0)
    with pytest.raises(StackError, match="--workers"):
        StackOptions(workers=0)


def test_command_lines_wire_the_services_together(tmp_path: Path) -> None:
    opt = StackOptions(steps=12, workers=2, run_dir=tmp_path)
    ports = StackPorts.of(opt)
    coordinator, gateway, *workers = training_services(opt, ports, None)
    assert "--max-steps" in coordinator.argv and "12" in coordinator.argv
    assert coordinator.argv[coordinator.argv.index("--min-workers") + 1] == "2"
    assert "--token-file" not in gateway.argv
    assert gateway.argv[gateway.argv.index("--coordinator-admin") + 1] == "127.0.0.1:7071"
    assert gateway.argv[gateway.argv.index("--tp-frontend") + 1] == "127.0.0.1:7091"
    assert [w.name for w in workers] == ["worker-0", "worker-1"]
    assert not any(w.critical for w in workers)
    leader, rank1 = serving_services(opt, ports, tmp_path / "m.gguf")
    assert leader.argv[leader.argv.index("--frontend-listen") + 1] == "127.0.0.1:7091"
    assert rank1.argv[rank1.argv.index("--leader") + 1] == "127.0.0.1:7090"
    token_gateway = training_services(opt, ports, tmp_path / "token")[1]
    assert "--token-file" in token_gateway.argv


def test_checkpoint_interval_is_a_flag_with_a_bounded_default(tmp_path: Path) -> None:
    # A quarter of the run, but never fewer than 10 nor more than 100 steps apart.
    assert [default_checkpoint_every(n) for n in (8, 200, 20000)] == [10, 50, 100]
    opt = StackOptions(steps=20000, checkpoint_every=7, run_dir=tmp_path)
    coordinator = training_services(opt, StackPorts.of(opt), None)[0]
    assert coordinator.argv[coordinator.argv.index("--checkpoint-every") + 1] == "7"
    with pytest.raises(StackError, match="--checkpoint-every"):
        StackOptions(checkpoint_every=0)


def test_restart_backoff_doubles_up_to_a_cap() -> None:
    assert [restart_delay(n) for n in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert restart_delay(50) == RESTART_MAX_S


def test_five_failures_within_a_minute_leave_a_service_down() -> None:
    assert not gives_up([0.0, 1.0, 3.0, 7.0], 7.5)
    assert gives_up([0.0, 1.0, 3.0, 7.0, 15.0], 15.5)
    # The first of five fell out of the minute: restarted again.
    assert not gives_up([0.0, 30.0, 40.0, 50.0, 60.0], 60.5)


def test_the_command_by_hand_carries_the_stacks_environment_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FOUNDRY_TLS_CERT", "/etc/cert.pem")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    stack = Stack(tmp_path / "run dir", io.StringIO())
    spec = ServiceSpec("worker-0", (sys.executable, "-c", "print('a b')"), r"a b")
    child = stack.start(spec)
    try:
        command = stack.by_hand(child)
        assert command.startswith(
            f"cd {shlex.quote(os.getcwd())} && env -u FOUNDRY_TLS_CERT OPENBLAS_NUM_THREADS=1 "
            f"PYTHONUNBUFFERED=1 {shlex.quote(sys.executable)} -c "
        ), command
        assert command.endswith(f" >> {shlex.quote(str(child.log))} 2>&1"), command
        child.proc.wait(timeout=30)
        out = subprocess.run(["bash", "-c", command], env=dict(os.environ), timeout=30)
        assert out.returncode == 0
        assert child.log.read_text().count("a b") == 2  # the child's run, then by hand
    finally:
        stack.stop_all(grace_s=1.0)


def test_prometheus_config_scrapes_every_service() -> None:
    text = prometheus_config(StackPorts.of(StackOptions(workers=2)), "0.0.0.0")
    for job in ("coordinator", "worker", "tp-leader", "tp-worker", "gateway"):
        assert f'job_name: "{job}"' in text
    assert '"127.0.0.1:9110", "127.0.0.1:9111"' in text


def test_a_waiting_run_says_how_many_workers_it_misses() -> None:
    def st(state: fdtc.SwarmState, rows: int) -> fdtc.SwarmStatus:
        row = fdtc.SwarmStatusRow(
            worker_id="w",
            profile=fdtc.HardwareProfile.SERVER,
            state=fdtc.WorkerState.IDLE,
            batch_size=1,
            accumulation_steps=1,
            samples_per_sec=0.0,
            loss=0.0,
            local_step=0,
            seconds_since_heartbeat=0.0,
        )
        return fdtc.SwarmStatus(
            global_step=3,
            max_steps=9,
            state=state,
            train_loss=1.0,
            val_loss=1.0,
            samples_per_sec=0.0,
            learning_rate=0.0,
            samples_total=0,
            rows=(row,) * rows,
        )

    assert waiting_note(st(fdtc.SwarmState.WAITING, 1), 2) == "waiting for 1 of 2 worker(s)"
    assert waiting_note(st(fdtc.SwarmState.TRAINING, 1), 2) is None
    assert waiting_note(st(fdtc.SwarmState.WAITING, 2), 2) is None


def test_the_live_view_tells_a_failure_once_and_the_workers_traffic() -> None:
    row = fdtc.SwarmStatusRow(
        worker_id="w0",
        profile=fdtc.HardwareProfile.SERVER,
        state=fdtc.WorkerState.IDLE,
        batch_size=4,
        accumulation_steps=2,
        samples_per_sec=10.0,
        loss=2.0,
        local_step=3,
        seconds_since_heartbeat=0.1,
    )
    st = fdtc.SwarmStatus(
        global_step=3,
        max_steps=9,
        state=fdtc.SwarmState.TRAINING,
        train_loss=1.0,
        val_loss=1.0,
        samples_per_sec=0.0,
        learning_rate=0.0,
        samples_total=0,
        rows=(row,),
    )
    more = fdtc.SwarmDetailRow(inner_steps=3, bytes_up=2_500_000, bytes_down=7_000_000)
    failed = fdtc.SwarmDetail(
        min_workers=1,
        seconds_since_step=0.5,
        failed=True,
        note="round loop failed: OSError: x",
        rows=(more,),
    )
    out = io.StringIO()
    view = LiveView(out, 9, tty=False, workers=1)
    view.update(st, failed)
    view.update(st, failed)
    assert out.getvalue().count("coordinator FAILED: round loop failed: OSError: x") == 1
    assert worker_line(row, more).endswith("3 steps  up 2.5 MB down 7.0 MB")


def _status(step: int) -> fdtc.SwarmStatus:
    return fdtc.SwarmStatus(
        global_step=step,
        max_steps=3000,
        state=fdtc.SwarmState.TRAINING,
        train_loss=1.0,
        val_loss=1.0,
        samples_per_sec=5.0,
        learning_rate=0.0,
        samples_total=0,
        rows=(),
    )


def test_the_live_view_draws_on_a_terminal_that_reports_no_size() -> None:
    """A pty nobody sized reports 0 columns: the bar still shows, and after a resume at step
    2000 its rate is this run's (one step a few ms apart), not 2000 steps in no time."""
    import pty

    master, slave = pty.openpty()  # a fresh pty: 0 rows, 0 columns
    try:
        out = os.fdopen(slave, "w", closefd=False)
        view = LiveView(out, 3000, tty=True, workers=0)
        detail = fdtc.SwarmDetail(
            min_workers=0, seconds_since_step=0.1, failed=False, note="", rows=()
        )
        view.update(_status(2000), detail)
        time.sleep(0.2)
        view.update(_status(2001), detail)
        view.close()
        out.flush()
        os.set_blocking(master, False)
        drawn = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(master, 65536):
                drawn += chunk
    finally:
        os.close(master)
        os.close(slave)
    text = drawn.decode(errors="replace")
    assert "training" in text and "2001/3000" in text, text
    rates = [float(r) for r in re.findall(r"([\d.]+)step/s", text)]
    assert rates and max(rates) < 100, text


def test_a_resumed_runs_summary_says_where_it_resumed() -> None:
    fresh = TrainingSummary(steps=30, first_loss=5.5, first_loss_step=1, last_loss=1.0744)
    assert fresh.loss_text() == "loss 5.5000 -> 1.0744"
    resumed = TrainingSummary(
        steps=30, first_loss=1.0717, first_loss_step=25, last_loss=1.0744, start_step=24
    )
    text = resumed.loss_text()
    assert text == (
        "resumed at step 24, 6 steps this run: loss 1.0717 after step 25, 1.0744 at the end"
    )
    assert "->" not in text


def test_printable_escapes_control_characters() -> None:
    assert printable("a\x1b[2Jb\nc\x07") == "a\\x1b[2Jb\nc\\x07"


def test_training_samples_come_from_the_first_kept_checkpoint_past_each_multiple(
    tmp_path: Path,
) -> None:
    cfg = preset("tiny")
    params = init_params(cfg)

    def write(step: int) -> None:
        save_checkpoint(
            tmp_path,
            CheckpointState(
                config=cfg,
                step=step,
                params=params,
                optimizer=AdamW(params).state_dict(),
                data_position=0,
            ),
            keep_last=10,
        )

    samples = CheckpointSamples(tmp_path, "The ", every=3)
    assert samples.poll() is None  # nothing written yet
    for step in (1, 2, 4, 5, 7):  # a poll that falls late sees steps 4 and 7 on disk
        write(step)
    assert (samples.poll() or "").startswith("step 4: 'The ")
    assert (samples.poll() or "").startswith("step 7: 'The ")
    assert samples.poll() is None  # 9 is not written yet
    write(8)
    assert samples.poll() is None
    (tmp_path / checkpoint_name(9)).write_bytes(b"damaged")  # skipped, not fatal
    write(10)
    assert (samples.poll() or "").startswith("step 10: 'The ")
    write(12)
    assert (samples.poll() or "").startswith("step 12: 'The ")
    for step in (13, 14):  # a run that ends at 14, short of the next multiple (15)
        write(step)
    assert samples.poll() is None
    assert (samples.poll(last=True) or "").startswith("step 14: 'The ")  # the final weights
    assert samples.poll(last=True) is None


# ---------------------------------------------------------------------------- the real thing


def free_layout(workers: int) -> list[str]:
    """Port flags for a layout whose every port is free now, below Linux's ephemeral range
    (32768+), so no client connection of the run itself can take one meanwhile."""
    rng = random.Random()
    for _ in range(50):
        base, gateway, metrics = (rng.randrange(20000, 32000, 100) for _ in range(3))
        opt = StackOptions(
            workers=workers,
            base_port=base,
            gateway_port=gateway,
            http_port=gateway + 1,
            metrics_port=metrics,
            prometheus=False,
        )
        try:
            check_ports_free(StackPorts.of(opt), "127.0.0.1")
        except StackError:
            continue
        return [
            "--base-port",
            str(base),
            "--gateway-port",
            str(gateway),
            "--http-port",
            str(gateway + 1),
            "--metrics-port",
            str(metrics),
        ]
    raise AssertionError("no free port layout found")


class Up:
    """`foundry up` in its own session, its terminal output in a file."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.run_dir = tmp / "run"
        self.out = tmp / "up.out"
        self._file = self.out.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "foundry",
                "up",
                "--run-dir",
                str(self.run_dir),
                "--no-prometheus",
                *args,
            ],
            stdout=self._file,
            stderr=subprocess.STDOUT,
            env=ENV,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, pattern: str, within_s: float) -> re.Match[str]:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                raise AssertionError(f"foundry up exited {self.proc.returncode}:\n{self.text()}")
            time.sleep(0.1)
        raise AssertionError(f"no /{pattern}/ within {within_s} s:\n{self.text()}")

    def children(self) -> dict[str, int]:
        state = json.loads((self.run_dir / "stack.json").read_text())
        assert state["pid"] == self.proc.pid
        children: dict[str, int] = state["children"]
        return children

    def cleanup(self) -> None:
        """Whatever a failed test left: the whole session, then every recorded child."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if (self.run_dir / "stack.json").exists():
            for pid in self.children().values():
                if running(pid):
                    os.killpg(pid, signal.SIGKILL)
        self._file.close()


def start_up(tmp: Path, workers: int, *args: str) -> tuple[Up, list[str]]:
    """`foundry up` on a free port layout; a port taken by someone else between our check and
    its own (another program on this machine) means another layout, not a failure."""
    for attempt in range(3):
        ports = free_layout(workers)
        run_tmp = tmp / f"attempt-{attempt}"
        run_tmp.mkdir()
        up = Up(run_tmp, "--workers", str(workers), *args, *ports)
        while up.proc.poll() is None and "foundry up: run dir" not in up.text():
            time.sleep(0.05)
        if up.proc.poll() == 2 and "is taken" in up.text():
            up.cleanup()
            continue
        return up, ports
    raise AssertionError("three port layouts were taken before foundry up could start")


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_gone(pids: dict[str, int], within_s: float) -> list[str]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = [name for name, pid in pids.items() if running(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return left


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
