"""The local stack behind `foundry up`: every service as a local process, one command.

Theory of operation. ``run_stack`` walks one pipeline:

1. check that every port of the layout (``StackPorts``) is free, so a clash is one clear
   error before anything starts;
2. start the coordinator, the gateway, N workers and, when installed, Prometheus, each in its
   own session (process group) with its output in ``RUN_DIR/logs/NAME.log``; a child is
   started once its startup line is in its log;
3. poll the coordinator's admin link (FDTC STATUS_REQ -> SWARM_STATUS) and draw the live view
   until the run is DONE;
4. export the weights as GGUF (admin EXPORT), start the tensor-parallel pair on that file, and
   generate a greedy sample through the gateway, exactly as `foundry ctl generate` would;
5. serve until SIGINT or SIGTERM, then stop every child: SIGTERM to its process group, SIGKILL
   to whatever is left after the grace period.

Stopping runs in a ``finally``, so it happens whatever ends the pipeline (a signal, a failed
child, a bug). Each child also gets the kernel's parent-death signal (SIGKILL) on Linux, so
even a ``foundry up`` killed with SIGKILL leaves no service behind. The pids are written to
``RUN_DIR/stack.json`` as they start, for tools and tests that want to check on them.

The pure parts (port layout, command lines, Prometheus config, status lines) are plain
functions of the options, tested without starting anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from foundry.wire import fdtc

# The services' own ``foundry`` entry point, run with this interpreter so a venv is honoured.
FOUNDRY = (sys.executable, "-m", "foundry")
# A child must print its startup line within this time (the TP ranks load a model first).
START_TIMEOUT_S = 60.0
# Children get this long after SIGTERM before SIGKILL: the gateway's own grace is 5 s.
STOP_GRACE_S = 10.0
# How often the live view asks the coordinator for its status.
POLL_S = 0.5
# The exported model and the TP pair must answer a generation within this time.
SERVE_TIMEOUT_S = 60.0
# Linux prctl option: signal the child when its parent dies (<linux/prctl.h>).
_PR_SET_PDEATHSIG = 1


class StackError(Exception):
    """The stack cannot start or keep running; the message says what to do."""


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived (not an error: the operator asked to stop)."""


# ---------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class StackOptions:
    steps: int = 200
    workers: int = 2
    base_port: int = 7070
    gateway_port: int = 50051
    metrics_port: int = 9100
    prometheus_port: int = 9090
    host: str = "127.0.0.1"
    run_dir: Path = Path("runs/up")
    prometheus: bool = True
    prompt: str = "The "
    sample_tokens: int = 64
    preset: str = "tiny"
    global_batch: int = 16
    fresh: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise StackError(f"--steps must be at least 1, got {self.steps}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise StackError(f"--workers must be 1 to {MAX_WORKERS}, got {self.workers}")
        if self.sample_tokens < 1:
            raise StackError(f"--sample-tokens must be at least 1, got {self.sample_tokens}")
        for name, port in (
            ("--base-port", self.base_port), ("--gateway-port", self.gateway_port),
            ("--metrics-port", self.metrics_port), ("--prometheus-port", self.prometheus_port),
        ):
            if not 1 <= port <= 65535 - PORT_SPAN:
                raise StackError(f"{name} {port} is out of range 1-{65535 - PORT_SPAN}")

    @property
    def loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")


# Workers get metrics ports metrics_port + 10 + i: room for this many.
MAX_WORKERS = 64
# Ports above a base that the layout may use (the workers' metrics ports reach furthest).
PORT_SPAN = 10 + MAX_WORKERS


@dataclass(frozen=True)
class StackPorts:
    """Where everything listens. Fixed offsets from three bases, so the defaults of
    `foundry ctl` (gateway 50051), `foundry worker` (coordinator 7070) and the TP commands
    (7090/7091) reach the default stack, and the default metrics ports are the ones every
    deployment uses (``foundry.obs.prometheus_config.METRICS_PORTS``); only the workers,
    many on one machine here, get one port each from M+10 on."""

    coordinator: int
    admin: int
    tp_leader: int
    tp_frontend: int
    gateway: int
    coordinator_metrics: int
    tp_leader_metrics: int
    tp_worker_metrics: int
    gateway_metrics: int
    worker_metrics: tuple[int, ...]
    prometheus: int | None

    @classmethod
    def of(cls, opt: StackOptions) -> StackPorts:
        b, m = opt.base_port, opt.metrics_port
        return cls(
            coordinator=b, admin=b + 1, tp_leader=b + 20, tp_frontend=b + 21,
            gateway=opt.gateway_port,
            coordinator_metrics=m, tp_leader_metrics=m + 2, gateway_metrics=m + 3,
            tp_worker_metrics=m + 4,
            worker_metrics=tuple(m + 10 + i for i in range(opt.workers)),
            prometheus=opt.prometheus_port if opt.prometheus else None,
        )

    def named(self) -> list[tuple[str, int]]:
        """Every port with what it is for, in the order they are checked."""
        out = [
            ("coordinator workers", self.coordinator), ("coordinator admin", self.admin),
            ("tp-leader", self.tp_leader), ("tp-leader frontend", self.tp_frontend),
            ("gateway", self.gateway), ("coordinator metrics", self.coordinator_metrics),
            ("tp-leader metrics", self.tp_leader_metrics),
            ("gateway metrics", self.gateway_metrics),
            ("tp-worker metrics", self.tp_worker_metrics),
        ]
        out += [(f"worker-{i} metrics", p) for i, p in enumerate(self.worker_metrics)]
        if self.prometheus is not None:
            out.append(("prometheus", self.prometheus))
        return out


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


@dataclass(frozen=True)
class ServiceSpec:
    """One child: its name, its command line and the line that says it is up."""

    name: str
    argv: tuple[str, ...]
    ready: str  # a regex its log shows once it serves
    critical: bool = True  # its exit ends the stack (a worker's does not)
    stop_stage: int = 0  # stopped after every child of a lower stage exited


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def training_services(
    opt: StackOptions, ports: StackPorts, token_file: Path | None
) -> list[ServiceSpec]:
    """Coordinator, gateway and workers, in start order."""
    run = opt.run_dir
    h = opt.host
    metrics = ("--metrics-host", h)
    coordinator = ServiceSpec(
        "coordinator",
        (*FOUNDRY, "coordinator", "--listen", _addr(h, ports.coordinator),
         "--admin-listen", _addr("127.0.0.1", ports.admin),
         "--checkpoint-dir", str(run / "checkpoints"), "--preset", opt.preset,
         "--max-steps", str(opt.steps), "--min-workers", str(opt.workers),
         "--global-batch", str(opt.global_batch),
         "--checkpoint-every", str(max(10, opt.steps // 4)),
         "--metrics-port", str(ports.coordinator_metrics), *metrics),
        r"coordinator listening:",
        stop_stage=1,
    )
    gateway = ServiceSpec(
        "gateway",
        (*FOUNDRY, "gateway", "--listen", _addr(h, ports.gateway),
         "--coordinator-admin", _addr("127.0.0.1", ports.admin),
         "--tp-frontend", _addr("127.0.0.1", ports.tp_frontend),
         *(("--token-file", str(token_file)) if token_file else ()),
         "--metrics-port", str(ports.gateway_metrics), *metrics),
        r"gateway listening:",
    )
    workers = [
        ServiceSpec(
            f"worker-{i}",
            (*FOUNDRY, "worker", "--coordinator", _addr("127.0.0.1", ports.coordinator),
             "--worker-id", f"worker-{i}", "--metrics-port", str(port), *metrics),
            r"metrics :\d+",
            critical=False,
        )
        for i, port in enumerate(ports.worker_metrics)
    ]
    return [coordinator, gateway, *workers]


def serving_services(opt: StackOptions, ports: StackPorts, model: Path) -> list[ServiceSpec]:
    """The tensor-parallel pair on the exported model."""
    metrics = ("--metrics-host", opt.host)
    return [
        ServiceSpec(
            "tp-leader",
            (*FOUNDRY, "tp-leader", "--model", str(model),
             "--listen", _addr("127.0.0.1", ports.tp_leader),
             "--frontend-listen", _addr("127.0.0.1", ports.tp_frontend),
             "--metrics-port", str(ports.tp_leader_metrics), *metrics),
            r"tp-leader listening:",
        ),
        ServiceSpec(
            "tp-worker",
            (*FOUNDRY, "tp-worker", "--model", str(model),
             "--leader", _addr("127.0.0.1", ports.tp_leader),
             "--metrics-port", str(ports.tp_worker_metrics), *metrics),
            r"tp-worker ready:",
        ),
    ]


def prometheus_config(ports: StackPorts, host: str) -> str:
    """Prometheus scrape config for the local stack: the jobs of Compose's
    services/prometheus/prometheus.yml (so the dashboards in grafana/ work on it too), with
    static targets on this machine."""
    from foundry.obs.prometheus_config import render

    target_host = _local(host)

    def at(*targets: int) -> list[str]:
        return [_addr(target_host, p) for p in targets]

    return render({
        "coordinator": at(ports.coordinator_metrics),
        "worker": at(*ports.worker_metrics),
        "tp-leader": at(ports.tp_leader_metrics),
        "tp-worker": at(ports.tp_worker_metrics),
        "gateway": at(ports.gateway_metrics),
    })


def prometheus_service(opt: StackOptions, ports: StackPorts, binary: str) -> ServiceSpec:
    assert ports.prometheus is not None
    run = opt.run_dir
    return ServiceSpec(
        "prometheus",
        (binary, f"--config.file={run / 'prometheus.yml'}",
         f"--storage.tsdb.path={run / 'prometheus'}",
         f"--web.listen-address={_addr(opt.host, ports.prometheus)}"),
        r"Server is ready to receive web requests",
        critical=False,
    )


# ---------------------------------------------------------------------------- status lines


def _num(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def status_line(st: fdtc.SwarmStatus) -> str:
    return (
        f"{st.state.name.lower()} step {st.global_step}/{st.max_steps}  "
        f"loss {_num(st.train_loss, '.4f')}  val {_num(st.val_loss, '.4f')}  "
        f"{_num(st.samples_per_sec, '.1f')} samples/s"
    )


def worker_line(row: fdtc.SwarmStatusRow) -> str:
    return (
        f"  {row.worker_id:<12} {row.profile.name.lower():<14} {row.state.name.lower():<10} "
        f"batch {row.batch_size}x{row.accumulation_steps}  "
        f"{_num(row.samples_per_sec, '.1f')} samples/s  loss {_num(row.loss, '.4f')}"
    )


def printable(text: str) -> str:
    """Generated text for a terminal: control characters other than newline escaped, so a
    half-trained model's bytes cannot move the cursor or ring the bell."""
    return "".join(
        c if c == "\n" or c.isprintable() else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


# ---------------------------------------------------------------------------- children


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


# ---------------------------------------------------------------------------- admin link


class AdminLink:
    """Blocking FDTC requests on the coordinator's admin link, one answer per request."""

    def __init__(self, host: str, port: int, timeout_s: float = 10.0) -> None:
        self.address = (host, port)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._decoder = fdtc.FdtcDecoder()

    def request(self, msg: fdtc.Message, timeout_s: float | None = None) -> fdtc.Message:
        try:
            return self._exchange(msg, timeout_s or self.timeout_s)
        except (OSError, fdtc.FdtcProtocolError) as exc:
            self.close()
            raise StackError(f"coordinator admin link {_addr(*self.address)}: {exc}") from None

    def _exchange(self, msg: fdtc.Message, timeout_s: float) -> fdtc.Message:
        if self._sock is None:
            self._sock = socket.create_connection(self.address, timeout=timeout_s)
            self._decoder = fdtc.FdtcDecoder()
        self._sock.settimeout(timeout_s)
        self._sock.sendall(fdtc.encode(msg))
        while True:
            got = self._decoder.next_message()
            if got is not None:
                return got
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("the coordinator closed the admin link")
            self._decoder.feed(data)

    def status(self) -> fdtc.SwarmStatus:
        got = self.request(fdtc.StatusReq())
        if not isinstance(got, fdtc.SwarmStatus):
            raise StackError(f"the coordinator answered STATUS_REQ with {got!r}")
        return got

    def export(self, path: Path) -> Path:
        got = self.request(fdtc.Export(path=str(path)), timeout_s=300.0)
        if not isinstance(got, fdtc.ControlAck) or not got.ok:
            raise StackError(f"export failed: {getattr(got, 'message', got)!r}")
        return Path(got.message)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# ---------------------------------------------------------------------------- live view


@dataclass
class TrainingSummary:
    steps: int = 0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    val_loss: float = float("nan")
    seconds: float = 0.0
    polls: int = 0


@dataclass
class LiveView:
    """A tqdm bar (step, loss, samples/s) with one line per worker on a terminal; on a pipe
    a plain line every tenth of the run."""

    out: TextIO
    total: int
    tty: bool
    bars: list[Any] = field(default_factory=list)
    _printed_at: int = -1

    def update(self, st: fdtc.SwarmStatus) -> None:
        if not self.tty:
            every = max(1, st.max_steps // 10)
            mark = st.global_step // every
            if mark != self._printed_at and not math.isnan(st.train_loss):
                self._printed_at = mark
                print(f"  {status_line(st)}", file=self.out, flush=True)
            return
        from tqdm import tqdm

        if not self.bars:
            self.bars.append(tqdm(total=st.max_steps, unit="step", desc="training",
                                  file=self.out, dynamic_ncols=True, leave=True))
        bar = self.bars[0]
        bar.n = st.global_step
        bar.set_postfix_str(
            f"loss {_num(st.train_loss, '.4f')} val {_num(st.val_loss, '.4f')} "
            f"{_num(st.samples_per_sec, '.1f')} samples/s",
            refresh=False,
        )
        while len(self.bars) < 1 + len(st.rows):
            self.bars.append(tqdm(total=0, position=len(self.bars), bar_format="{desc}",
                                  file=self.out, leave=False))
        for i, row_bar in enumerate(self.bars[1:]):
            text = worker_line(st.rows[i]) if i < len(st.rows) else "  (worker gone)"
            row_bar.set_description_str(text, refresh=True)
        bar.refresh()

    def close(self) -> None:
        for bar in reversed(self.bars):
            bar.close()
        self.bars.clear()


def watch_training(
    stack: Stack, admin: AdminLink, view: LiveView, summary: TrainingSummary
) -> fdtc.SwarmStatus:
    t0 = time.monotonic()
    while True:
        stack.check_children()
        st = admin.status()
        summary.polls += 1
        if not math.isnan(st.train_loss):
            if math.isnan(summary.first_loss):
                summary.first_loss = st.train_loss
            summary.last_loss = st.train_loss
        summary.val_loss = st.val_loss
        summary.steps = st.global_step
        view.update(st)
        if st.state is fdtc.SwarmState.DONE:
            summary.seconds = time.monotonic() - t0
            return st
        time.sleep(POLL_S)


# ---------------------------------------------------------------------------- generation


def generate(
    target: str,
    prompt: str,
    max_tokens: int,
    token: str | None,
    check_stop: Callable[[], None],
    within_s: float = SERVE_TIMEOUT_S,
) -> str:
    """A greedy generation through the gateway; retried while the pair is still coming up."""
    import grpc

    from foundry.api.v1 import inference_pb2, inference_pb2_grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    deadline = time.monotonic() + within_s
    with grpc.insecure_channel(target) as channel:
        stub_class: Callable[[grpc.Channel], Any] = inference_pb2_grpc.InferenceServiceStub
        stub = stub_class(channel)
        while True:
            request = inference_pb2.GenerateRequest(
                prompt=prompt, max_tokens=max_tokens, temperature=0.0
            )
            try:
                pieces = [
                    token.text
                    for event in stub.Generate(request, metadata=metadata, timeout=30.0)
                    for token in event.tokens
                ]
                return "".join(pieces)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    details = exc.details() if hasattr(exc, "details") else str(exc)
                    raise StackError(f"generation through the gateway failed: {details}") from None
            check_stop()
            time.sleep(0.3)


# ---------------------------------------------------------------------------- the pipeline


def run_stack(opt: StackOptions, out: TextIO = sys.stdout) -> int:
    """`foundry up`: 0 after a clean stop, 1 when the stack could not start or failed."""
    ports = StackPorts.of(opt)
    prometheus = shutil.which("prometheus") if opt.prometheus else None
    if prometheus is None:
        ports = StackPorts.of(dataclasses.replace(opt, prometheus=False))
    check_ports_free(ports, opt.host)
    run = opt.run_dir
    run.mkdir(parents=True, exist_ok=True)
    if opt.fresh:
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
    token_file = None
    token = None
    if not opt.loopback:
        # Off loopback the gateway is reachable from the network: require a token.
        token_file = run / "token"
        token = secrets.token_urlsafe(32)
        token_file.unlink(missing_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")

    stack = Stack(run, out)
    tty = out.isatty()
    view = LiveView(out, opt.steps, tty)
    admin = AdminLink("127.0.0.1", ports.admin)
    t_start = time.monotonic()
    code = 0
    with stack.signals():
        try:
            stack.say(f"foundry up: run dir {run}, logs in {run / 'logs'}")
            first = [stack.start(s) for s in training_services(opt, ports, token_file)]
            if prometheus is not None:
                (run / "prometheus.yml").write_text(prometheus_config(ports, opt.host))
                first.append(stack.start(prometheus_service(opt, ports, prometheus)))
            stack.wait_ready(first)
            stack.say(
                f"started coordinator {_addr(opt.host, ports.coordinator)}, gateway "
                f"{_addr(opt.host, ports.gateway)}, {opt.workers} worker(s)"
                + (f", prometheus http://{_addr(_local(opt.host), ports.prometheus or 0)}"
                   if prometheus else ", no prometheus (not installed or --no-prometheus)")
            )
            stack.say(f"training {opt.preset} for {opt.steps} steps on the bundled corpus")
            summary = TrainingSummary()
            try:
                watch_training(stack, admin, view, summary)
            finally:
                view.close()
            if summary.polls == 1:
                stack.say(
                    f"training was already done at step {summary.steps} (checkpoints in "
                    f"{run / 'checkpoints'}; --fresh trains again)"
                )
            else:
                stack.say(
                    f"training done at step {summary.steps}: loss "
                    f"{_num(summary.first_loss, '.4f')} -> {_num(summary.last_loss, '.4f')}, "
                    f"validation {_num(summary.val_loss, '.4f')} ({summary.seconds:.0f} s)"
                )
            model = admin.export(_short_path(run / "model.gguf"))
            admin.close()
            stack.say(f"exported {model}")
            pair = [stack.start(s) for s in serving_services(opt, ports, model)]
            stack.wait_ready(pair)
            target = _addr("127.0.0.1", ports.gateway)
            text = generate(target, opt.prompt, opt.sample_tokens, token, stack.check_stop)
            stack.say(f"sample (greedy, {opt.sample_tokens} tokens): "
                      f"{printable(opt.prompt + text)!r}")
            ctl = f"foundry ctl --gateway {_addr(_local(opt.host), ports.gateway)}" + (
                f" --token-file {token_file}" if token_file else ""
            )
            stack.say(
                f"ready in {time.monotonic() - t_start:.0f} s: `{ctl} status`, "
                f"`{ctl} generate --prompt TEXT`; Ctrl+C stops everything"
            )
            while True:
                stack.check_children(fatal=False)
                time.sleep(POLL_S)
        except StopRequested:
            stack.say("stopping (Ctrl+C again to kill at once)")
        except StackError as exc:
            stack.say(f"error: {exc}")
            code = 1
        finally:
            admin.close()
            killed = stack.stop_all()
            stack.say(
                f"stopped {len(stack.children)} processes"
                + (f" ({', '.join(killed)} had to be killed)" if killed else "")
            )
    return code


def _local(host: str) -> str:
    """The address a client on this machine uses for a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _short_path(path: Path) -> Path:
    """The relative or absolute spelling of ``path``, whichever fits the 255-byte FDTC field
    (the coordinator runs in our working directory, so both name the same file)."""
    absolute = path.resolve()
    with contextlib.suppress(ValueError):
        relative = absolute.relative_to(Path.cwd())
        if len(str(relative).encode()) < len(str(absolute).encode()):
            return relative
    return absolute
