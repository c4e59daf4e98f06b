"""The supervisor of `foundry up`: the children as processes in their own sessions, started,
watched and stopped together, and the check that the port layout is free before any start."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TextIO

from foundry.up.plan import (
    RESTART_LIMIT,
    RESTART_RESET_S,
    RESTART_WINDOW_S,
    ServiceSpec,
    StackError,
    StackPorts,
    gives_up,
    restart_delay,
)

# A child must print its startup line within this time (the TP ranks load a model first).
START_TIMEOUT_S = 60.0
# Children get this long after SIGTERM before SIGKILL: the gateway's own grace is 5 s.
STOP_GRACE_S = 10.0
# Linux prctl option: signal the child when its parent dies (<linux/prctl.h>).
_PR_SET_PDEATHSIG = 1


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived (not an error: the operator asked to stop)."""


class RunDirLock:
    """One `foundry up` per run dir: an exclusive ``flock`` on ``RUN_DIR/up.lock``, which
    holds the holder's pid. The kernel drops the lock when the holder exits, however it
    exits, so a stale file never blocks; the children do not inherit it (``close_fds``)."""

    NAME = "up.lock"

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / self.NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StackError(
                f"run dir {self.path.parent} is in use by another `foundry up` (pid {holder}); "
                f"stop that one first (Ctrl+C there, or kill {holder}), or give this one its "
                "own folder with --run-dir DIR"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
                    raise StackError(
                        f"port {port} ({name}) on {bind_host} is taken ({exc.strerror}); stop "
                        f"what uses it (another `foundry up`?) or move it with "
                        f"{port_flag(name)} (the stack's port flags: {', '.join(PORT_FLAGS)})"
                    ) from None


# Every flag of `foundry up` that moves a port, in its --help order.
PORT_FLAGS = ("--base-port", "--gateway-port", "--http-port", "--metrics-port", "--prometheus-port")


def port_flag(name: str) -> str:
    """The flag of `foundry up` that moves the port ``StackPorts.named`` calls ``name``."""
    if name == "prometheus":
        return "--prometheus-port (or --no-prometheus)"
    if name == "gateway http":
        return "--http-port"
    if name == "gateway":
        return "--gateway-port"
    if name.endswith("metrics"):
        return "--metrics-port"
    return "--base-port"


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
    """A service process in its own session, its output in a log file; started again by
    ``restart`` with the same command line and log."""

    def __init__(self, spec: ServiceSpec, log: Path, env: dict[str, str]) -> None:
        self.spec = spec
        self.log = log
        self.env = env
        self._out = log.open("ab")
        self.reported = False  # its exit has been told once
        self.restarts = 0
        self.failures = 0  # exits in a row, each within RESTART_RESET_S of its start
        self.restart_at: float | None = None  # a restart is due then
        self.last_exit: int | None = None
        self.failed_at: deque[float] = deque(maxlen=RESTART_LIMIT)  # its last failures
        self.given_up = False  # failed too often: left down
        self._spawn()

    def _spawn(self) -> None:
        # Logs are appended to, run after run; this run's output starts here.
        self._out.flush()
        self._start = self.log.stat().st_size if self.log.exists() else 0
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=self.env,
            # Its own session: Ctrl+C reaches `foundry up` only, which stops the children in
            # order, and killpg reaches anything a child starts.
            start_new_session=True,
            preexec_fn=_parent_death_hook(),
        )

    def note(self, text: str) -> None:
        """A line of `foundry up` in the service's log."""
        self._out.write(f"--- foundry up: {text} ---\n".encode())
        self._out.flush()

    def restart(self, note: str) -> None:
        """Start the service again, after a line in its log saying why."""
        self.note(note)
        self.restarts += 1
        self.restart_at = None
        self.reported = False
        self._spawn()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def settling(self) -> bool:
        """Down, due for a restart, or restarted so lately that it may not serve yet."""
        if self.restart_at is not None or not self.alive():
            return True
        return self.restarts > 0 and time.monotonic() - self.started_at < START_TIMEOUT_S

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

    def child(self, name: str) -> Child | None:
        return next((c for c in self.children if c.spec.name == name), None)

    def supervise(self, *, training: bool = True) -> None:
        """Restart each child that exited non-zero (or was killed), after a capped backoff
        (``restart_delay``), and tell the live view and the child's log; one that failed
        RESTART_LIMIT times within RESTART_WINDOW_S (``gives_up``) is left down, and both
        say so with the command that starts it by hand (``by_hand``). A clean exit (0) is
        the service's own decision and is not undone: told once, and while ``training`` a
        critical one ends the stack (the run can no longer finish); once serving it is
        reported only (`foundry ctl shutdown` ends the coordinator on purpose)."""
        self.check_stop()
        now = time.monotonic()
        for child in self.children:
            name = child.spec.name
            if child.restart_at is not None:
                if now >= child.restart_at:
                    delay = restart_delay(child.failures)
                    note = f"restarted {name} (exit {child.last_exit}) after {delay:.1f} s"
                    child.restart(note)
                    self._write_pids()
                    self.say(note)
                continue
            if child.alive() or child.reported:
                continue
            code = child.proc.returncode
            if code == 0:
                child.reported = True
                if training and child.spec.critical:
                    raise StackError(
                        f"{name} exited 0 before training was done (log {child.log}):\n"
                        f"{child.tail()}"
                    )
                if child.spec.critical:
                    self.say(f"{name} exited 0; see {child.log}")
                continue
            quick = now - child.started_at < RESTART_RESET_S
            child.failures = child.failures + 1 if quick else 1
            child.last_exit = code
            child.failed_at.append(now)
            if gives_up(child.failed_at, now):
                child.reported = True
                child.given_up = True
                note = (
                    f"{name} failed {RESTART_LIMIT} times within {RESTART_WINDOW_S:g} s (last "
                    f"exit {code}); not restarting it (log {child.log}). To start it by hand: "
                    f"{self.by_hand(child)}"
                )
                child.note(note)
                self.say(note)
                continue
            delay = restart_delay(child.failures)
            child.restart_at = now + delay
            self.say(f"{name} exited {code} (log {child.log}); restarting it in {delay:.1f} s")

    def by_hand(self, child: Child) -> str:
        """The shell command that starts ``child`` as this stack did: in the same folder, with
        the same environment changes, command line and log."""
        changes = [f"-u {k}" for k in sorted(os.environ) if k not in self.env]
        changes += [
            f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()) if os.environ.get(k) != v
        ]
        env = f"env {' '.join(changes)} " if changes else ""
        return (
            f"cd {shlex.quote(os.getcwd())} && {env}{shlex.join(child.spec.argv)} "
            f">> {shlex.quote(str(child.log))} 2>&1"
        )

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
