"""The supervisor of `foundry up`: the children as processes in their own sessions, started,
watched and stopped together, and the check that the port layout is free before any start."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TextIO

from foundry.up.plan import ServiceSpec, StackError, StackPorts

# A child must print its startup line within this time (the TP ranks load a model first).
START_TIMEOUT_S = 60.0
# Children get this long after SIGTERM before SIGKILL: the gateway's own grace is 5 s.
STOP_GRACE_S = 10.0
# Linux prctl option: signal the child when its parent dies (<linux/prctl.h>).
_PR_SET_PDEATHSIG = 1


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived (not an error: the operator asked to stop)."""


def check_ports_free(ports: StackPorts, host: str) -> None:
    """Raise StackError naming the first port of the layout that cannot be bound."""
    seen: dict[int, str] = {}
    for name, port in ports.named():
        if port in seen:
            raise StackError(f"port {port} is both {seen[port]} and {name}; pick other bases")
        seen[port] = name
        for bind_host in {host, "127.0.0.1"}:
            with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET) as s:
                # As the services bind: connections of a previous run in TIME_WAIT do not
                # block the port, a listener does.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((bind_host, port))
                except OSError as exc:
                    hint = (
                        "--prometheus-port, or --no-prometheus" if name == "prometheus" else
                        "--base-port, --gateway-port, --metrics-port or --prometheus-port"
                    )
                    raise StackError(
                        f"port {port} ({name}) on {bind_host} is taken ({exc.strerror}); stop "
                        f"what uses it (another `foundry up`?) or move the stack with {hint}"
                    ) from None


def _parent_death_hook() -> Callable[[], None] | None:
    """On Linux, a function for the child between fork and exec that asks the kernel for
    SIGKILL when the parent dies. libc is loaded here, in the parent: the child only calls.

    SIGKILL, not SIGTERM: with `foundry up` gone nobody is left to escalate, and a service
    told to stop while its peers vanish too must not be able to linger (a worker can take
    its coordinator's exit for a restart and redial). Nothing is lost: checkpoints are atomic
    and the other services keep no state."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return hook


class Child:
    """A service process in its own session, its output in a log file."""

    def __init__(self, spec: ServiceSpec, log: Path, env: dict[str, str]) -> None:
        self.spec = spec
        self.log = log
        # Logs are appended to, run after run; this run's output starts here.
        self._start = log.stat().st_size if log.exists() else 0
        self._out = log.open("ab")
        self.proc = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=env,
            # Its own session: Ctrl+C reaches `foundry up` only, which stops the children in
            # order, and killpg reaches anything a child starts.
            start_new_session=True,
            preexec_fn=_parent_death_hook(),
        )
        self.reported = False  # its exit has been told once

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        """What this run of the service wrote."""
        try:
            with self.log.open("rb") as f:
                f.seek(self._start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def close(self) -> None:
        self._out.close()


class Stack:
    """The children of one `foundry up`, started and stopped together."""

    def __init__(self, run_dir: Path, out: TextIO) -> None:
        self.run_dir = run_dir
        self.out = out
        self.children: list[Child] = []
        # The native links of `foundry up` stay on loopback without TLS: FOUNDRY_TLS_* set in
        # the shell for one service must not give every child that one certificate.
        env = {k: v for k, v in os.environ.items() if not k.startswith("FOUNDRY_TLS_")}
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        # One BLAS thread per service: several numpy processes share the machine's cores.
        self.env.setdefault("OPENBLAS_NUM_THREADS", "1")
        self.stop_requested = False
        self.fast_stop = False

    # -------------------------------------------------------------- signals

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM set a flag that every wait checks (``check_stop``); a second one
        makes the stop immediate. The handler raises nothing, so a signal can never land
        between starting a child and recording it."""

        def handler(signum: int, frame: FrameType | None) -> None:
            if self.stop_requested:
                self.fast_stop = True
            self.stop_requested = True

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    # -------------------------------------------------------------- start

    def start(self, spec: ServiceSpec) -> Child:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        child = Child(spec, logs / f"{spec.name}.log", self.env)
        self.children.append(child)
        self._write_pids()
        return child

    def check_stop(self) -> None:
        if self.stop_requested:
            raise StopRequested

    def wait_ready(self, children: Sequence[Child], within_s: float = START_TIMEOUT_S) -> None:
        pending = list(children)
        deadline = time.monotonic() + within_s
        while pending:
            self.check_stop()
            for child in list(pending):
                if re.search(child.spec.ready, child.text()):
                    pending.remove(child)
                elif not child.alive():
                    raise StackError(
                        f"{child.spec.name} exited {child.proc.returncode} while starting "
                        f"(log {child.log}):\n{child.tail()}"
                    )
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.spec.name for c in pending)
                raise StackError(
                    f"{names} did not start within {within_s:g} s; see "
                    + ", ".join(str(c.log) for c in pending)
                )
            if pending:
                time.sleep(0.05)

    def check_children(self, *, fatal: bool = True) -> None:
        """Tell once about each child that exited; raise if a critical one did and ``fatal``
        (while serving, an exit is reported only: `foundry ctl shutdown` ends the coordinator
        on purpose, and the rest keeps serving)."""
        self.check_stop()
        for child in self.children:
            if child.alive() or child.reported:
                continue
            child.reported = True
            code = child.proc.returncode
            if not fatal:
                if code != 0 or child.spec.critical:
                    self.say(f"{child.spec.name} exited {code}; see {child.log}")
            elif child.spec.critical:
                raise StackError(
                    f"{child.spec.name} exited {code} (log {child.log}):\n{child.tail()}"
                )
            if code != 0:
                self.say(f"warning: {child.spec.name} exited {code}; see {child.log}")

    def _write_pids(self) -> None:
        state = {
            "pid": os.getpid(),
            "children": {c.spec.name: c.pid for c in self.children},
        }
        path = self.run_dir / "stack.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(path)

    # -------------------------------------------------------------- stop

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> list[str]:
        """SIGTERM every child's group, clients before the servers they use (``stop_stage``),
        SIGKILL what is left after ``grace_s`` in all (at once after a second Ctrl+C).
        Returns the names that had to be killed.

        Stages, because a worker told to stop while its coordinator is vanishing may take the
        lost connection for a coordinator restart and keep redialling instead of exiting."""
        deadline = time.monotonic() + grace_s
        for stage in sorted({c.spec.stop_stage for c in self.children}):
            group = [c for c in self.children if c.spec.stop_stage == stage]
            for child in reversed(group):
                child.signal_group(signal.SIGTERM)
            while time.monotonic() < deadline and not self.fast_stop:
                if not any(c.alive() for c in group):
                    break
                time.sleep(0.05)
        killed = []
        for child in self.children:
            if child.alive():
                killed.append(child.spec.name)
            # The whole group: a service's own helpers go with it.
            child.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=5)
            child.close()
        return killed

    # -------------------------------------------------------------- output

    def say(self, line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=self.out)
        self.out.flush()
