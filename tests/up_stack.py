"""`foundry up` as a real process: a free port layout, the running stack, its processes gone."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from foundry.up.plan import StackError, StackOptions, StackPorts
from foundry.up.supervisor import check_ports_free

ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


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
