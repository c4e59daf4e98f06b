"""Real Foundry services as processes on 127.0.0.1, for the robustness harnesses.

``bench/robustness/fuzz.py`` and ``bench/robustness/churn.py`` start ``python -m foundry``
services with this module,
read the ports they announce, talk to them as their real peers do (the coordinator's admin
link, the leader's frontend link) and stop them by pid. Every service binds 127.0.0.1 only.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from foundry.model.formats.gguf_io import load_gguf, save_gguf
from foundry.model.infer.inference import Engine
from foundry.model.infer.sampling import sample
from foundry.model.nn import transformer as T
from foundry.model.spec.config import ModelConfig
from foundry.model.text.vocab.byte import encode
from foundry.wire import fdtc
from foundry.wire import frontend as fw

HOST = "127.0.0.1"
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STARTUP_S = 60.0
# The leader's default prefill chunk: the reference decodes a prompt in the same chunks.
PREFILL_CHUNK = 64
# What a service writes when it survived an exception nobody handled: a bug, even if the
# process lives on (a dead task or thread can stop a part of the service silently).
INTERNAL_ERROR = re.compile(
    r"Traceback \(most recent call last\)|internal task failed|Unhandled exception"
    r"|Exception in thread|Task exception was never retrieved|exception in callback"
)
COORDINATOR_LINE = r"workers 127\.0\.0\.1:(\d+), admin 127\.0\.0\.1:(\d+)"
# Where a harness writes its progress lines (print, or a test's collector).
Printer = Callable[[str], None]
LEADER_LINE = r"tp-leader listening: workers 127\.0\.0\.1:(\d+), frontend 127\.0\.0\.1:(\d+)"


class ServiceError(RuntimeError):
    """A service did not start, or exited when it should not have."""


class Service:
    """One ``foundry`` subcommand in its own process; stdout and stderr go to ``log``."""

    def __init__(
        self,
        name: str,
        args: list[str],
        log: Path,
        *,
        prefix: Sequence[str] = (),
        new_session: bool = False,
    ) -> None:
        """``prefix``: argv it runs under (``ip netns exec NS``); ``new_session``: out of the
        harness's process group, so a Ctrl+C reaches only the harness, which stops it."""
        self.name = name
        self.args = args
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "foundry", *args],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=ENV,
            start_new_session=new_session,
        )
        self.pid = self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, within_s: float = STARTUP_S) -> re.Match[str]:
        """The first match of ``pattern`` in the log; ServiceError on timeout or exit."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            m = rx.search(self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited {self.proc.returncode} before /{pattern}/; see {self.log}"
                )
            time.sleep(0.05)
        raise ServiceError(f"{self.name}: no /{pattern}/ within {within_s:g} s; see {self.log}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL, as a crash or a pulled power cord would."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._out.close()

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._out.close()
        return int(self.proc.returncode)

    def internal_errors(self) -> list[str]:
        """Log lines that show an exception nobody handled."""
        return [line for line in self.text().splitlines() if INTERNAL_ERROR.search(line)]


def has_flag(subcommand: str, flag: str) -> bool:
    """Whether ``foundry SUBCOMMAND`` takes ``flag`` (from its --help)."""
    done = subprocess.run(
        [sys.executable, "-m", "foundry", subcommand, "--help"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        check=False,
    )
    return flag in done.stdout


def start_coordinator(
    work: Path, *extra: str, name: str = "coordinator", port: int = 0, admin_port: int = 0
) -> tuple[Service, int, int]:
    """A coordinator checkpointing to ``work/ckpt``; returns (service, worker port, admin port)."""
    svc = Service(
        name,
        [
            "coordinator",
            "--listen",
            f"{HOST}:{port}",
            "--admin-listen",
            f"{HOST}:{admin_port}",
            "--checkpoint-dir",
            str(work / "ckpt"),
            *extra,
        ],
        work / f"{name}.log",
    )
    m = svc.wait_for(COORDINATOR_LINE)
    return svc, int(m.group(1)), int(m.group(2))


def start_worker(work: Path, port: int, worker_id: str, *extra: str, log: str = "") -> Service:
    return Service(
        worker_id,
        ["worker", "--coordinator", f"{HOST}:{port}", "--worker-id", worker_id, *extra],
        work / f"{log or worker_id}.log",
    )


def start_leader(
    work: Path,
    model: Path,
    *extra: str,
    name: str = "tp-leader",
) -> tuple[Service, int, int]:
    """A TP leader; returns (service, worker port, frontend port)."""
    svc = Service(
        name,
        [
            "tp-leader",
            "--model",
            str(model),
            "--listen",
            f"{HOST}:0",
            "--frontend-listen",
            f"{HOST}:0",
            *extra,
        ],
        work / f"{name}.log",
    )
    m = svc.wait_for(LEADER_LINE)
    return svc, int(m.group(1)), int(m.group(2))


def start_tp_worker(
    work: Path,
    model: Path,
    port: int,
    *extra: str,
    log: str = "tp-worker",
) -> Service:
    return Service(
        "tp-worker",
        [
            "tp-worker",
            "--model",
            str(model),
            "--leader",
            f"{HOST}:{port}",
            "--retry-max",
            "0.2",
            *extra,
        ],
        work / f"{log}.log",
    )


# -- the coordinator's admin link ------------------------------------------------------------


def admin_request(port: int, msg: fdtc.Message, timeout_s: float = 10.0) -> fdtc.Message:
    """One request on the admin link, answered by one message."""
    with socket.create_connection((HOST, port), timeout=timeout_s) as s:
        s.sendall(fdtc.encode(msg))
        dec = fdtc.FdtcDecoder()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            data = s.recv(65536)
            if not data:
                break
            dec.feed(data)
            got = dec.next_event()
            if got is not None:
                return got
    raise ServiceError(f"admin link {HOST}:{port} closed or went silent without an answer")


def swarm_status(port: int, timeout_s: float = 10.0) -> fdtc.SwarmStatus:
    got = admin_request(port, fdtc.StatusReq(), timeout_s)
    if not isinstance(got, fdtc.SwarmStatus):
        raise ServiceError(f"STATUS_REQ answered with {type(got).__name__}")
    return got


# -- the leader's frontend link --------------------------------------------------------------


@dataclass
class Generation:
    """One GENERATE as the client saw it; ``end`` None: no DONE or ERROR in time (a hang),
    or the link closed (``closed``)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    end: fw.Done | fw.Error | None = None
    closed: bool = False
    seconds: float = 0.0


class FrontendClient:
    """A blocking client of the frontend link: one connection, one request at a time."""

    def __init__(self, port: int, timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=timeout_s)
        self.decoder = fw.FrontendDecoder()
        self.next_id = 1

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> FrontendClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _frames(self, deadline: float) -> list[fw.Frame] | None:
        """What arrives before ``deadline`` ([] on timeout); None when the link closed."""
        self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return []
        except ConnectionError:
            return None
        if not data:
            return None
        self.decoder.feed(data)
        out = []
        while (frame := self.decoder.next_event()) is not None:
            out.append(frame)
        return out

    def generate(self, prompt: str, max_tokens: int, timeout_s: float, **kw: object) -> Generation:
        rid = self.next_id
        self.next_id += 1
        t0 = time.monotonic()
        self.sock.sendall(fw.encode(fw.Generate(rid, prompt, max_tokens, **kw)))  # type: ignore[arg-type]
        got = Generation()
        deadline = t0 + timeout_s
        while got.end is None and time.monotonic() < deadline:
            frames = self._frames(deadline)
            if frames is None:
                got.closed = True
                break
            for frame in frames:
                if frame.request_id != rid:
                    continue
                if isinstance(frame, fw.Token):
                    got.tokens.append(frame.token)
                    got.text += frame.text
                elif isinstance(frame, fw.Done | fw.Error):
                    got.end = frame
        got.seconds = time.monotonic() - t0
        return got

    def status(self, timeout_s: float = 10.0) -> fw.Status:
        self.sock.sendall(fw.encode(fw.StatusReq(0)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            frames = self._frames(deadline)
            if frames is None:
                break
            for frame in frames:
                if isinstance(frame, fw.Status):
                    return frame
        raise ServiceError("the leader did not answer STATUS_REQ")


def wait_paired(port: int, within_s: float = STARTUP_S) -> None:
    deadline = time.monotonic() + within_s
    with FrontendClient(port) as c:
        while not c.status().worker_connected:
            if time.monotonic() > deadline:
                raise ServiceError(f"the TP pair did not form within {within_s:g} s")
            time.sleep(0.05)


# -- a model for the pair and its single-process reference -----------------------------------


def make_model(path: Path, seed: int = 0) -> Path:
    """The tiny preset with a 256-token context, perturbed beyond its init so that routing and
    attention vary per token (greedy text is then not one repeated byte)."""
    cfg = ModelConfig(n_ctx=256)
    rng = np.random.default_rng(seed + 100)
    params = T.init_params(cfg, seed=seed)
    for p in params.values():
        p += np.float32(0.1) * rng.standard_normal(p.shape, dtype=np.float32)
    save_gguf(path, cfg, params)
    return path


def greedy_reference(model: Path, prompt: str, n: int) -> list[int]:
    """Greedy decoding of ``prompt`` in one process, prefilled in the leader's chunks."""
    m = load_gguf(model)
    engine = Engine(m.cfg, m.params)
    s = engine.new_session()
    ids = [int(t) for t in encode(prompt, bos=True)]
    row = None
    for start in range(0, len(ids), PREFILL_CHUNK):
        row = engine.decode(s, ids[start : start + PREFILL_CHUNK])[-1]
    assert row is not None
    out: list[int] = []
    while True:
        out.append(sample(row, 0.0))
        if len(out) == n:
            return out
        row = engine.decode(s, [out[-1]])[-1]
