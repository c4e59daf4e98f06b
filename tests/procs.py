"""Real service processes for integration tests: start, read their announced ports, stop by pid."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def wait_for(condition: Callable[[], T], within_s: float, what: str, poll_s: float = 0.02) -> T:
    """The first truthy value of ``condition()``, polled until ``within_s`` has passed; then
    fail naming ``what``. Tests wait on the event they need, never on a fixed sleep; the
    deadline is derived from the timeout configured for that event, with room for a loaded
    machine (it bounds a hang, it does not measure speed)."""
    deadline = time.monotonic() + within_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {within_s:g} s: {what}")
        time.sleep(poll_s)


class Service:
    """A ``foundry`` subcommand in its own process, its output in a log file."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        netns: str | None = None,
    ) -> None:
        """``netns``: run it in that network namespace (``ip netns exec``; needs root)."""
        self.args = args
        self.log = log
        self._out = log.open("ab")
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "foundry", *args],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env={**ENV, **(env or {})},
        )
        self.pid = self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, within_s: float = 60.0, after: int = 0) -> re.Match[str]:
        """The first match of ``pattern`` in the log past offset ``after``; fail on timeout/exit."""
        deadline = time.monotonic() + within_s
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            m = rx.search(self.text(), after)
            if m:
                return m
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.args[0]} exited {self.proc.returncode} before /{pattern}/:\n"
                    + self.text()[-3000:]
                )
            time.sleep(0.05)
        raise AssertionError(f"no /{pattern}/ within {within_s}s:\n" + self.text()[-3000:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash or a pulled power cord would."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._out.close()

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._out.close()
        return self.proc.returncode

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def coordinator(tmp: Path, *extra: str, name: str = "coordinator") -> tuple[Service, int, int]:
    """Start a coordinator on free ports; returns (service, worker port, admin port)."""
    svc = Service(
        [
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--checkpoint-dir",
            str(tmp / "ckpt"),
            *extra,
        ],
        tmp / f"{name}.log",
    )
    m = svc.wait_for(r"workers 127\.0\.0\.1:(\d+), admin 127\.0\.0\.1:(\d+)")
    return svc, int(m.group(1)), int(m.group(2))


def worker(tmp: Path, port: int, worker_id: str, *extra: str) -> Service:
    return Service(
        ["worker", "--coordinator", f"127.0.0.1:{port}", "--worker-id", worker_id, *extra],
        tmp / f"{worker_id}.log",
    )


# ---------------------------------------------------------------------------- what tests need

# CI sets CI=true; there a test that needs root, a network namespace or a tool that .ci/run
# installs fails when it is missing, so that a broken CI machine cannot pass by skipping.
CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def missing(reason: str) -> NoReturn:
    """Skip the running test for ``reason``; under CI, fail it."""
    if CI:
        pytest.fail(f"{reason} (CI=true: .ci/run provides it, so this is a failure)")
    pytest.skip(reason)


def needs(available: bool, reason: str) -> Callable[[F], F]:
    """Decorate a test that can run only where ``available``: elsewhere it is skipped with
    ``reason``, under CI it fails with it."""

    def decorate(test: F) -> F:
        if available:
            return test
        if not CI:
            return pytest.mark.skip(reason=reason)(test)

        @functools.wraps(test)
        def fail(*args: Any, **kwargs: Any) -> None:
            missing(reason)

        return fail  # type: ignore[return-value]

    return decorate


IS_ROOT = os.geteuid() == 0


# ---------------------------------------------------------------------------- disk faults

NEEDS_ROOT = "mounts a tmpfs or a read-only bind mount: needs root (CI runs as root)"


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """``path`` (created) bind-mounted onto itself read-only for the block: writes fail with
    EROFS, as on a read-only volume."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def full_dir(path: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path`` for the block: a checkpoint bigger than that fails
    with ENOSPC, as on a full disk."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def pinned_file(path: Path, content: bytes = b"pinned\n") -> Iterator[Path]:
    """``path`` (created, holding ``content``) with a file bind-mounted onto it for the block:
    it reads as a file, and removing or renaming it fails with EBUSY, as a file pinned by
    another mount or tool would."""
    path.write_bytes(content)
    source = path.with_name(f".{path.name}.pin")
    source.write_bytes(content)
    subprocess.run(["mount", "--bind", str(source), str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
        source.unlink()
