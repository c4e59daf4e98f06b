"""Swarm training on a shaped LAN against one process, measured in one run.

The coordinator and N workers each run in a network namespace this script makes, behind one
bridge (in a namespace of its own, so the host's network is never touched). Every port is
shaped by ``tc tbf`` in both directions to ``--rate`` (``1gbit``, ``100mbit``, ...): the host
side of each veth shapes what the machine sends, the bridge side what it receives, as an
ordinary switch with 1 Gb/s ports would. ``--rate loopback`` runs the same configurations on
127.0.0.1 with no namespaces and no shaping; several rates (``--rate 1gbit,100mbit``) run one
after the other against the same baseline. Everything is removed at the end, on an error and
on Ctrl+C (namespaces are named ``fl<pid>-...``, so runs never collide).

First one process trains ``--steps`` steps (``Trainer.train_step``, as ``foundry train`` does)
and its validation loss at the last step becomes the target (both sides validate on the whole
held-out split, and neither clock counts validation: the coordinator runs it beside its
rounds, one process's clock stops for it); then each configuration
(``--config [RATE:]NAME=COORDINATOR ARGS``) trains the same model on the same global batch and
learning-rate schedule (whose floor holds after ``--steps``) until it has reached the target
and trained ``--steps`` steps (the validation loss at equal tokens), or ``--max-steps``. For
each one it prints:

- samples/s after the first rounds, as a ratio to one process;
- wall-clock time to the target validation loss (from the moment every worker registered to
  the log line of the step that reached it), as a ratio ("sooner": one process's time over
  the configuration's);
- bytes per step through the coordinator's port in each direction, read from the switch's
  port counters (TCP/IP headers included), with the dense f32 size of the weights next to it.

Before the configurations it prints the machine's own ceiling: N processes training at once,
each on its share of the global batch (worker 1 slowed as ``--slowdown`` slows it), with no
network and no coordinator, their summed samples/s against one process. Where the machines
are cores of one computer they share its memory and caches, so no swarm on it can pass that.

It needs root, ``ip`` and ``tc``: found on PATH, or given by ``--ip`` / ``--tc`` (or the
``FOUNDRY_IP`` / ``FOUNDRY_TC`` variables), e.g. Debian's iproute2 unpacked with ``dpkg -x``
and its libraries on ``LD_LIBRARY_PATH``. Every process gets one BLAS thread.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import multiprocessing as mp
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: live, harness

import harness
from live import Service
from round_phases import critical_path, phases

from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.text.data import load_corpus
from foundry.model.train.training import Trainer, TrainSettings, evaluate_loss
from foundry.runtime import retain_freed_memory

SUBNET = "10.77.0"
PORT = 7070
# Rounds before samples/s is measured: registration, first weights, first allocations.
WARM_STEPS = 3
CEILING_STEPS = 6  # steps of each process in the compute ceiling
DEFAULT_CONFIGS = (
    "sync-none=--compression none",
    "sync-topk=--compression topk",
    "local-h16-fp16=--sync-every 16 --compression fp16",
)
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_STEP = re.compile(r"coordinator: step (\d+): loss [-\d.naif]+, (\d+) samples")
_VAL = re.compile(r"coordinator: step (\d+): validation loss ([-\d.naif]+)")
_REGISTERED = re.compile(r"coordinator: worker (\S+) registered")


def log_time(line: str) -> float | None:
    m = _LOG_TIME.match(line)
    if m is None:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


class Network:
    """A star of namespaces behind one bridge, each port shaped both ways; or loopback."""

    def __init__(self, hosts: int, rate: str, ip: str, tc: str) -> None:
        self.hosts = hosts
        self.rate = rate
        self.ip = ip
        self.tc = tc
        self.prefix = f"fl{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.made: list[str] = []

    @property
    def shaped(self) -> bool:
        return self.rate != "loopback"

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}" if self.shaped else "127.0.0.1"

    def _run(self, *argv: str) -> str:
        res = subprocess.run(argv, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed: {res.stderr.strip()}")
        return res.stdout

    def _add_ns(self, name: str) -> None:
        self._run(self.ip, "netns", "add", name)
        self.made.append(name)
        self._run(self.ip, "-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        # Burst: 10 ms at the rate, and never below a 64 KiB GSO segment (veth sends those).
        bits = parse_rate(self.rate)
        burst = max(bits // 8 // 100, 96 * 1024)
        self._run(
            self.tc,
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            self.rate,
            "burst",
            str(burst),
            "latency",
            "20ms",
        )

    def up(self) -> None:
        if not self.shaped:
            return
        self._add_ns(self.switch)
        self._run(self.ip, "-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._run(self.ip, "-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.hosts):
            host = self.ns(i)
            self._add_ns(host)
            port = f"p{i}"
            self._run(
                self.ip,
                "-n",
                host,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch,
            )
            self._run(self.ip, "-n", self.switch, "link", "set", port, "master", "br0")
            self._run(self.ip, "-n", self.switch, "link", "set", port, "up")
            self._run(self.ip, "-n", host, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            self._run(self.ip, "-n", host, "link", "set", "eth0", "up")
            self._shape(host, "eth0")  # what host i sends
            self._shape(self.switch, port)  # what host i receives

    def down(self) -> None:
        for name in reversed(self.made):
            with contextlib.suppress(RuntimeError):
                self._run(self.ip, "netns", "del", name)
        self.made.clear()

    def prefix_argv(self, i: int) -> list[str]:
        return [self.ip, "netns", "exec", self.ns(i)] if self.shaped else []

    def port_bytes(self, i: int) -> tuple[int, int]:
        """(bytes host i sent, bytes host i received), from its switch port's counters."""
        if not self.shaped:
            return 0, 0
        out = json.loads(self._run(self.ip, "-n", self.switch, "-s", "-j", "link", "show", f"p{i}"))
        stats = out[0]["stats64"]
        # The switch port receives what the host sends, and sends what the host receives.
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def parse_rate(rate: str) -> int:
    """Bits per second of a tc rate such as ``1gbit`` or ``100mbit``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"rate {rate!r}: use e.g. 1gbit, 100mbit or loopback")
    scale = {None: 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)]
    return int(float(m.group(1)) * scale)


def rates_arg(text: str) -> list[str]:
    rates = [r.strip() for r in text.split(",") if r.strip()]
    for r in rates:
        if r != "loopback":
            parse_rate(r)
    return rates


@dataclass
class Baseline:
    samples_per_s: float
    target: float
    seconds_to_target: float
    curve: list[tuple[int, float, float]]  # (step, seconds, validation loss)


def one_process(args: argparse.Namespace) -> Baseline:
    """``--steps`` single-process steps, validated every ``--validate-every`` on the whole
    held-out split, as the coordinator validates. The clock counts training only: the
    coordinator validates beside its rounds, so neither side's time includes validation."""
    retain_freed_memory()
    cfg = preset(args.preset)
    settings = TrainSettings(
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        total_steps=args.steps,
        warmup_steps=args.warmup_steps,
        lr=args.lr,
    )
    trainer = Trainer(cfg, settings, init_params(cfg, 0))
    corpus = load_corpus(None)
    curve = []
    trained = 0.0  # seconds of training, validation left out
    warm_t = 0.0
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        trainer.train_step(corpus, micro_batch=8)
        trained += time.perf_counter() - t
        if step == WARM_STEPS:
            warm_t = trained
        if step % args.validate_every == 0 or step == args.steps:
            curve.append((step, trained, evaluate_loss(trainer.params, cfg, corpus, args.seq_len)))
    target = curve[-1][2]
    first = next(t for _, t, loss in curve if loss <= target)
    rate = (args.steps - WARM_STEPS) * args.global_batch / (trained - warm_t)
    return Baseline(rate, target, first, curve)


def train_alone(
    preset_name: str, samples: int, seq_len: int, steps: int, slowdown: float, start: float
) -> float:
    """Samples/s of ``steps`` training steps of ``samples`` sequences (``Trainer.train_step``,
    as one process trains), after one warm step; ``slowdown`` sleeps as a slowed worker does.
    The steps begin at ``start`` (time.time()), so processes started one after the other run
    together."""
    retain_freed_memory()  # as a worker and one process do: not a page fault per 4 KiB a step
    cfg = preset(preset_name)
    trainer = Trainer(
        cfg, TrainSettings(global_batch=samples, seq_len=seq_len), init_params(cfg, 0)
    )
    corpus = load_corpus(None)
    time.sleep(max(0.0, start - time.time()))
    t0, fastest = 0.0, float("inf")
    for step in range(steps + 1):
        if step == 1:
            t0 = time.perf_counter()
        t = time.perf_counter()
        trainer.train_step(corpus, micro_batch=8)
        if slowdown > 1.0:  # (N - 1) x the fastest step so far, as the worker's --slowdown
            fastest = min(fastest, time.perf_counter() - t)
            time.sleep(fastest * (slowdown - 1.0))
    return steps * samples / (time.perf_counter() - t0)


def compute_ceiling(args: argparse.Namespace) -> tuple[float, list[float]]:
    """What ``--workers`` processes at once train in all, each its share of the batch."""
    n = args.workers
    shares = [args.global_batch // n + (1 if i < args.global_batch % n else 0) for i in range(n)]
    start = time.time() + 8.0  # after every process has imported and built its model
    with mp.get_context("spawn").Pool(n) as pool:
        jobs = [
            pool.apply_async(
                train_alone,
                (
                    args.preset,
                    b,
                    args.seq_len,
                    CEILING_STEPS,
                    args.slowdown if i == 1 else 1.0,
                    start,
                ),
            )
            for i, b in enumerate(shares)
        ]
        rates = [j.get(timeout=600) for j in jobs]
    return sum(rates), rates


@dataclass
class Result:
    name: str
    samples_per_s: float = float("nan")
    seconds_to_target: float | None = None
    steps: int = 0
    last_val: float = float("nan")
    val_at_steps: float = float("nan")  # validation at --steps (equal tokens), or the last before
    up_per_step: float = float("nan")  # bytes into the coordinator per step
    down_per_step: float = float("nan")
    curve: list[tuple[int, float, float]] = field(default_factory=list)
    note: str = ""
    phases: str = ""  # where a round goes (--timeline)


@dataclass(frozen=True)
class Config:
    name: str
    args: list[str]
    rate: str | None = None  # only at this rate; None: at every rate


def parse_config(text: str) -> Config:
    head, sep, rest = text.partition("=")
    rate, _, name = head.rpartition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--config {text!r}: use [RATE:]NAME=COORDINATOR ARGS")
    return Config(name, shlex.split(rest), rate or None)


def follow(log: Path) -> Iterator[str]:
    """Lines of ``log`` as they are written (an empty string when there is nothing new)."""
    with log.open("r", errors="replace") as f:
        buf = ""
        while True:
            chunk = f.readline()
            if not chunk:
                yield ""
                continue
            buf += chunk
            if buf.endswith("\n"):
                yield buf
                buf = ""


def run_config(
    net: Network,
    work: Path,
    args: argparse.Namespace,
    base: Baseline,
    name: str,
    extra: list[str],
) -> Result:
    work.mkdir(parents=True)
    res = Result(name)
    listen = f"{net.addr(0)}:{PORT if net.shaped else 0}"
    coord = Service(
        "coordinator",
        [
            "coordinator",
            "--listen",
            listen,
            "--admin-listen",
            "127.0.0.1:0",
            "--checkpoint-dir",
            str(work / "ckpt"),
            "--preset",
            args.preset,
            "--global-batch",
            str(args.global_batch),
            "--seq-len",
            str(args.seq_len),
            "--max-steps",
            str(args.max_steps),
            "--schedule-steps",
            str(args.steps),
            "--warmup-steps",
            str(args.warmup_steps),
            "--lr",
            str(args.lr),
            "--checkpoint-every",
            "100000",
            "--min-workers",
            str(args.workers),
            "--validate-every",
            str(args.validate_every),
            *trace(work, "coordinator", args),
            *extra,
        ],
        work / "coordinator.log",
        prefix=net.prefix_argv(0),
        new_session=True,
    )
    procs = [coord]
    try:
        lines = follow(coord.log)
        port = None
        end = time.monotonic() + 60
        while port is None:
            line = next(lines)
            m = re.search(r"workers \S+:(\d+),", line)
            if m:
                port = int(m.group(1))
            elif not coord.alive() or time.monotonic() > end:
                raise RuntimeError(f"coordinator did not start: {coord.log.read_text()[-2000:]}")
            elif not line:
                time.sleep(0.05)
        for i in range(1, args.workers + 1):
            slowdown = args.slowdown if i == 1 else 1.0
            procs.append(
                Service(
                    f"w{i}",
                    [
                        "worker",
                        "--coordinator",
                        f"{net.addr(0)}:{port}",
                        "--worker-id",
                        f"w{i}",
                        "--slowdown",
                        str(slowdown),
                        *trace(work, f"w{i}", args),
                        *getattr(args, "worker_args", []),
                    ],
                    work / f"w{i}.log",
                    prefix=net.prefix_argv(i),
                    new_session=True,
                )
            )
        registered: set[str] = set()
        t_start: float | None = None
        warm: tuple[int, float, int, tuple[int, int]] | None = None  # step, time, samples, bytes
        last: tuple[int, float, int, tuple[int, int]] | None = None
        samples = 0
        step_at: dict[int, float] = {}  # step -> log time of its line
        deadline = time.monotonic() + args.config_timeout
        while time.monotonic() < deadline:
            line = next(lines)
            if not line:
                if not coord.alive():
                    res.note = "coordinator exited: " + coord.log.read_text()[-600:].strip()
                    break
                time.sleep(0.02)
                continue
            t = log_time(line)
            if (m := _REGISTERED.search(line)) and t is not None:
                registered.add(m.group(1))
                if len(registered) >= args.workers and t_start is None:
                    t_start = t
            elif (m := _STEP.search(line)) and t is not None:
                step = int(m.group(1))
                step_at[step] = t
                samples += int(m.group(2))
                point = (step, t, samples, net.port_bytes(0))
                if warm is None and step >= WARM_STEPS:
                    warm = point
                last = point
                res.steps = step
            elif (m := _VAL.search(line)) and t is not None and t_start is not None:
                loss = float(m.group(2))
                # The time of the step it validates: validation runs beside the rounds.
                at = step_at.get(int(m.group(1)), t) - t_start
                res.curve.append((int(m.group(1)), at, loss))
                res.last_val = loss
                if int(m.group(1)) <= args.steps:
                    res.val_at_steps = loss  # the last validation within equal tokens
                if loss <= base.target and res.seconds_to_target is None:
                    res.seconds_to_target = at
                measured = warm is not None and last is not None and last[0] > warm[0]
                if (
                    res.seconds_to_target is not None
                    and measured
                    and (args.stop_at_target or int(m.group(1)) >= args.steps)
                ):
                    break
            if "training done" in line:
                break
        else:
            res.note = f"stopped after {args.config_timeout:.0f} s"
        if warm is not None and last is not None and last[0] > warm[0]:
            dt_s = last[1] - warm[1]
            res.samples_per_s = (last[2] - warm[2]) / dt_s if dt_s > 0 else float("nan")
            steps = last[0] - warm[0]
            if net.shaped:  # loopback has no port of its own to count
                # Up: what the coordinator received (gradients); down: what it sent.
                res.up_per_step = (last[3][1] - warm[3][1]) / steps
                res.down_per_step = (last[3][0] - warm[3][0]) / steps
            if args.timeline:
                res.phases = (
                    phases(work, warm[0], last[0])
                    + "\n"
                    + " " * 25
                    + critical_path(work, warm[0], last[0])
                )
        return res
    finally:
        for p in reversed(procs):
            p.stop()


def trace(work: Path, name: str, args: argparse.Namespace) -> list[str]:
    return ["--timeline", str(work / f"{name}.trace.json")] if args.timeline else []


def ratio(x: float | None, base: float, invert: bool = False) -> str:
    """``x`` against the baseline as a table cell (``invert``: a time, where less is better)."""
    if x is None or x != x or x <= 0:
        return "   -  "
    return f"{(harness.ratio(base, x) if invert else harness.ratio(x, base)):5.2f}x"


def mb(x: float) -> str:
    return "-" if x != x else f"{x / 1e6:9.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument(
        "--rate",
        type=rates_arg,
        default=["1gbit"],
        help="every port's rate both ways (tc syntax: 1gbit, 100mbit), or loopback;\n"
        "comma-separated rates run one after the other",
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument(
        "--steps",
        type=int,
        default=60,
        help="one process's steps; its validation loss there is the target",
    )
    ap.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="a configuration that has not reached the target stops here\n(default 2 x --steps)",
    )
    ap.add_argument("--validate-every", type=int, default=10)
    ap.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="make worker 1 this many times slower (heterogeneity: after each\n"
        "assignment it sleeps N - 1 times its fastest compute per sample); the\n"
        "notes then give samples/s as a share of the summed standalone rates",
    )
    ap.add_argument(
        "--config",
        dest="configs",
        type=parse_config,
        action="append",
        metavar="NAME=ARGS",
        help="a configuration: extra coordinator arguments (repeatable), at every\n"
        "rate or, with a RATE: prefix, at that one only; default:\n" + "\n".join(DEFAULT_CONFIGS),
    )
    ap.add_argument(
        "--config-timeout", type=float, default=300.0, help="seconds a configuration may run"
    )
    ap.add_argument("--ip", default=os.environ.get("FOUNDRY_IP") or shutil.which("ip") or "ip")
    ap.add_argument("--tc", default=os.environ.get("FOUNDRY_TC") or shutil.which("tc") or "tc")
    ap.add_argument(
        "--stop-at-target",
        action="store_true",
        help="stop a configuration once it reaches the target (saves time; its\n"
        "validation loss at equal tokens is then not measured)",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="every process writes a --timeline trace; each configuration then\n"
        "prints the milliseconds per step of every phase of its rounds",
    )
    ap.add_argument(
        "--keep-logs", type=Path, default=None, help="copy every process's log into this folder"
    )
    args = ap.parse_args()
    args.max_steps = max(args.max_steps or 2 * args.steps, args.steps)
    configs = args.configs or [parse_config(c) for c in DEFAULT_CONFIGS]

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    cores = os.cpu_count() or 1
    cfg = preset(args.preset)
    dense = 4 * sum(math.prod(s) for s in cfg.param_shapes().values())
    print(
        f"# lan bench: {args.workers} workers, ports {','.join(args.rate)}, preset "
        f"{args.preset}, global batch {args.global_batch}x{args.seq_len}, {cores} cores, "
        f"dense f32 weights {dense / 1e6:.2f} MB",
        flush=True,
    )
    base = one_process(args)
    print(
        f"one process: {base.samples_per_s:.1f} samples/s; validation loss {base.target:.4f} "
        f"after {args.steps} steps = the target, reached in {base.seconds_to_target:.1f} s",
        flush=True,
    )
    print(
        "  validation by step: " + " ".join(f"{st}:{loss:.3f}" for st, _, loss in base.curve),
        flush=True,
    )
    ceiling, each = compute_ceiling(args)
    note = ""
    if args.slowdown > 1.0:
        note = (
            f", {ceiling / standalone_rate(base, args):.2f} of the summed standalone rates "
            "(worker 1 slowed)"
        )
    print(
        f"compute ceiling: {args.workers} processes at once, no network, each its share of "
        f"the batch: {ceiling:.1f} samples/s ({' + '.join(f'{r:.1f}' for r in each)}) = "
        f"{ceiling / base.samples_per_s:.2f}x one process{note}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="foundry-lan-") as tmp:
        for rate in args.rate:
            net = Network(args.workers + 1, rate, args.ip, args.tc)
            print(f"## ports {rate}", flush=True)
            print(
                f"{'configuration':24s} {'samples/s':>9s} {'ratio':>6s} {'to target':>9s} "
                f"{'sooner':>6s} {'MB/step up':>10s} {'down':>9s}  notes",
                flush=True,
            )
            try:
                net.up()
                for c in configs:
                    if c.rate not in (None, rate):
                        continue
                    work = Path(tmp) / rate / c.name
                    r = run_config(net, work, args, base, c.name, c.args)
                    print_result(r, base, args)
                    if args.keep_logs:
                        shutil.copytree(
                            work,
                            args.keep_logs / f"{rate}-{c.name}",
                            ignore=shutil.ignore_patterns("ckpt"),
                            dirs_exist_ok=True,
                        )
            except KeyboardInterrupt:
                print("interrupted; cleaning up", file=sys.stderr)
                return 130
            finally:
                net.down()
    return 0


def standalone_rate(base: Baseline, args: argparse.Namespace) -> float:
    """What the machines would train each on its own, one process's rate apiece, worker 1 at
    1/slowdown of it: the most a perfectly balanced swarm could reach."""
    return base.samples_per_s * (int(args.workers) - 1 + 1.0 / float(args.slowdown))


def print_result(r: Result, base: Baseline, args: argparse.Namespace) -> None:
    tt = "-" if r.seconds_to_target is None else f"{r.seconds_to_target:.1f}s"
    note = r.note or (
        "" if r.seconds_to_target is not None else f"target not reached by step {r.steps}"
    )
    note += (
        f"; at equal tokens (step <= {base.curve[-1][0]}) validation {r.val_at_steps:.4f}"
        f" = {r.val_at_steps / base.target:.3f}x the target"
    )
    speed = ratio(r.samples_per_s, base.samples_per_s)
    sooner = ratio(r.seconds_to_target, base.seconds_to_target, True)
    if args.slowdown > 1.0:
        standalone = standalone_rate(base, args)
        note += (
            f"; {r.samples_per_s / standalone:.2f} of the summed standalone rates "
            f"({standalone:.1f} samples/s, worker 1 {args.slowdown:g}x slower)"
        )
    curve = " ".join(f"{step}:{loss:.3f}" for step, _, loss in r.curve)
    print(
        f"{r.name:24s} {r.samples_per_s:9.1f} {speed} {tt:>9s} {sooner}"
        f" {mb(r.up_per_step):>10s} {mb(r.down_per_step):>9s}  {note}",
        flush=True,
    )
    print(f"{'':24s} validation by step: {curve}", flush=True)
    if r.phases:
        print(f"{'':24s} {r.phases}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
