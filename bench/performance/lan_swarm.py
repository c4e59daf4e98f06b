"""One swarm configuration of ``lan.py`` run to its target: the coordinator and the workers as
processes on a ``lan_net.Network``, read from the coordinator's log as it is written (samples/s
after the first rounds, the time to the target, the bytes through the coordinator's port, where
a round goes)."""

from __future__ import annotations

import argparse
import datetime as dt
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lan_net import Network
from live import Service
from round_phases import critical_path, phases

PORT = 7070
# Rounds before samples/s is measured: registration, first weights, first allocations.
WARM_STEPS = 3
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_STEP = re.compile(r"coordinator: step (\d+): loss [-\d.naif]+, (\d+) samples")
_VAL = re.compile(r"coordinator: step (\d+): validation loss ([-\d.naif]+)")
_REGISTERED = re.compile(r"coordinator: worker (\S+) registered")


def log_time(line: str) -> float | None:
    m = _LOG_TIME.match(line)
    if m is None:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass
class Baseline:
    samples_per_s: float
    target: float
    seconds_to_target: float
    curve: list[tuple[int, float, float]]  # (step, seconds, validation loss)


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


def mb(x: float) -> str:
    return "-" if x != x else f"{x / 1e6:9.3f}"
