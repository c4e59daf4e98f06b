"""Shared pieces of the tensor-parallel service tests: model files, processes, a client.

Services run as real processes (``python -m foundry tp-leader`` / ``tp-worker``) on 127.0.0.1,
each stopped by its pid at the end; or, where a test needs the leader's logits, the leader runs
in this process (``InProcessLeader``) against a worker process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from foundry.model.formats.gguf_io import load_gguf_stored, save_gguf
from foundry.model.formats.gguf_model import FileDType
from foundry.model.infer.inference import Engine
from foundry.model.infer.sampling import sample
from foundry.model.nn import transformer as T
from foundry.model.shard.table import ExpertSplit
from foundry.model.spec.config import ModelConfig
from foundry.model.text.vocab.byte import encode
from foundry.tp.handshake import DEFAULT_EXPERT_SPLIT
from foundry.tp.leader import Leader, LeaderOptions, LogitsHook
from foundry.wire import frontend as fw

F32 = npt.NDArray[np.float32]
STARTUP_S = 30.0
LEADER_LINE = re.compile(
    r"tp-leader listening: workers ([\d.]+):(\d+), frontend ([\d.]+):(\d+)(?:, metrics :(\d+))?"
)
CFG = ModelConfig(n_ctx=256)  # the tiny preset: 2 layers, n_embd 64, 4 experts


def make_model(path: Path, cfg: ModelConfig = CFG, seed: int = 0, dtype: FileDType = "f32") -> Path:
    """A random model, perturbed beyond its init so routing and attention vary per token,
    stored as ``dtype``."""
    rng = np.random.default_rng(seed + 100)
    params = T.init_params(cfg, seed=seed)
    for p in params.values():
        p += np.float32(0.1) * rng.standard_normal(p.shape, dtype=np.float32)
    save_gguf(path, cfg, params, dtype=dtype)
    return path


def tokens_of(prompt: str) -> list[int]:
    return [int(t) for t in encode(prompt, bos=True)]


@dataclass
class Reference:
    """Greedy decoding in one process (world 1), with the leader's prefill chunks."""

    tokens: list[int]
    logits: list[F32]  # the rows sampled from: the prefill's last row, then one per token


def reference_greedy(
    model: Path,
    prompt: str,
    n: int,
    chunk: int,
    expert_split: ExpertSplit = DEFAULT_EXPERT_SPLIT,
    shares: tuple[int, ...] | None = None,
) -> Reference:
    """``shares``: the world the one process stands for (default the pair), which fixes the
    order its partials are added in."""
    m = load_gguf_stored(model)
    engine = Engine(m.cfg, m.params, expert_split=expert_split, shares=shares)
    s = engine.new_session()
    ids = tokens_of(prompt)
    row: F32 | None = None
    for start in range(0, len(ids), chunk):
        row = engine.decode(s, ids[start : start + chunk])[-1:]
    assert row is not None
    out, rows = [], [row]
    for _ in range(n):
        out.append(sample(rows[-1][0], 0.0))
        if len(out) == n:
            break
        rows.append(engine.decode(s, [out[-1]]))
    return Reference(out, rows)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return int(self.popen.returncode)

    def exit_code(self, timeout: float = 10.0) -> int:
        """Wait for the process to end by itself (stopping it if it does not)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        return self.stop()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def spawn(args: Sequence[str], log: Path, stdout: bool = False) -> Proc:
    with log.open("ab") as err:
        popen = subprocess.Popen(
            [sys.executable, "-m", "foundry", *args],
            env=_env(),
            stderr=err,
            stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
        )
    return Proc(popen, log)


def read_line(proc: Proc, pattern: re.Pattern[str], timeout: float = STARTUP_S) -> re.Match[str]:
    assert proc.popen.stdout is not None
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.popen.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
            if (m := pattern.search(buf.decode(errors="replace"))) is not None:
                return m
        elif proc.popen.poll() is not None:
            break
    raise AssertionError(f"no line {pattern.pattern!r} from the process; log:\n{proc.text()}")


@dataclass
class LeaderProc:
    proc: Proc
    port: int
    frontend: int
    metrics: int | None


def start_leader(model: Path, log: Path, *extra: str) -> LeaderProc:
    proc = spawn(
        [
            "tp-leader",
            "--model",
            str(model),
            "--listen",
            "127.0.0.1:0",
            "--frontend-listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
            *extra,
        ],
        log,
        stdout=True,
    )
    m = read_line(proc, LEADER_LINE)
    return LeaderProc(
        proc, int(m.group(2)), int(m.group(4)), int(m.group(5)) if m.group(5) else None
    )


def start_worker(model: Path, port: int, log: Path, *extra: str) -> Proc:
    return spawn(
        [
            "tp-worker",
            "--model",
            str(model),
            "--leader",
            f"127.0.0.1:{port}",
            "--retry-max",
            "0.2",
            *extra,
        ],
        log,
    )


def metric(port: int, name: str) -> float:
    """The value of one sample (``name{labels}`` as exposed) from a /metrics endpoint."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    for line in data.decode().splitlines():
        # Each rank labels its series with its rank; the name asked for leaves it out.
        line = re.sub(r'\{rank="\d"\}|,rank="\d"|(?<=\{)rank="\d",', "", line)
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"metric {name} not exposed")


# -- the frontend link, synchronously ------------------------------------------------------


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    text: str = ""
    end: fw.Done | fw.Error | None = None
    token_times: list[float] = field(default_factory=list)
    end_time: float = 0.0


class Client:
    """A blocking client of the leader's frontend link (many requests on one connection)."""

    def __init__(self, port: int, timeout: float = 30.0, tls: ssl.SSLContext | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        if tls is not None:  # a leader started with --tls-cert
            self.sock = tls.wrap_socket(self.sock, server_hostname="127.0.0.1")
        self.decoder = fw.FrontendDecoder()
        self.results: dict[int, Result] = {}
        self.statuses: list[fw.Status] = []
        self.timeout = timeout

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, frame: fw.Frame) -> None:
        if isinstance(frame, fw.Generate):
            self.results[frame.request_id] = Result()
        self.sock.sendall(fw.encode(frame))

    def pump(self, until: float) -> bool:
        """Read what is there (waiting until ``until``); False when the link closed."""
        self.sock.settimeout(max(0.001, until - time.monotonic()))
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return True
        if not data:
            return False
        self.decoder.feed(data)
        now = time.monotonic()
        while (frame := self.decoder.next_event()) is not None:
            if isinstance(frame, fw.Status):
                self.statuses.append(frame)
                continue
            r = self.results.setdefault(frame.request_id, Result())
            if isinstance(frame, fw.Token):
                r.tokens.append(frame.token)
                r.positions.append(frame.position)
                r.text += frame.text
                r.token_times.append(now)
            elif isinstance(frame, fw.Done | fw.Error):
                r.end, r.end_time = frame, now
        return True

    def wait(self, ids: Sequence[int], timeout: float | None = None) -> list[Result]:
        deadline = time.monotonic() + (timeout or self.timeout)
        while any(self.results[i].end is None for i in ids):
            if time.monotonic() > deadline:
                raise AssertionError(f"requests {list(ids)} did not finish in time")
            if not self.pump(deadline):
                raise AssertionError("the leader closed the frontend connection")
        return [self.results[i] for i in ids]

    def generate(self, prompt: str, max_tokens: int, request_id: int = 1, **kw: object) -> Result:
        self.send(fw.Generate(request_id, prompt, max_tokens, **kw))  # type: ignore[arg-type]
        return self.wait([request_id])[0]

    def status(self) -> fw.Status:
        n = len(self.statuses)
        self.sock.sendall(fw.encode(fw.StatusReq(0)))
        deadline = time.monotonic() + self.timeout
        while len(self.statuses) == n:
            assert time.monotonic() < deadline, "no STATUS"
            assert self.pump(deadline), "the leader closed the frontend connection"
        return self.statuses[-1]


def wait_paired(
    frontend: int,
    connected: bool = True,
    timeout: float = STARTUP_S,
    tls: ssl.SSLContext | None = None,
) -> fw.Status:
    deadline = time.monotonic() + timeout
    with Client(frontend, tls=tls) as c:
        while True:
            st = c.status()
            if st.worker_connected == connected:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"worker_connected never became {connected}")
            time.sleep(0.05)


# -- a leader in this process --------------------------------------------------------------


def loopback_options(model: Path, **options: Any) -> LeaderOptions:
    """A leader's options on 127.0.0.1, both ports chosen by the kernel."""
    return LeaderOptions(model=model, host="127.0.0.1", port=0, frontend_port=0, **options)


class InProcessLeader:
    """The leader on a thread of this process (its own event loop), for its logits hook."""

    def __init__(self, options: LeaderOptions, hook: LogitsHook | None = None) -> None:
        self.leader = Leader(options, logits_hook=hook)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None
        self._thread.start()
        if not self._ready.wait(STARTUP_S):
            raise AssertionError("the in-process leader did not start")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        async def main() -> None:
            await self.leader.start()
            self._ready.set()
            try:
                await self.leader.wait_stopped()
            finally:
                await self.leader.close()

        try:
            asyncio.run(main())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def stop(self) -> None:
        self.leader.request_stop()
        self._thread.join(20)
        assert not self._thread.is_alive(), "the in-process leader did not stop"
