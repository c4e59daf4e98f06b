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
import math
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: live, harness

import harness
from lan_net import Network, add_tool_flags, rates_arg
from lan_swarm import WARM_STEPS, Baseline, Result, mb, run_config

from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.text.data import load_corpus
from foundry.model.train.training import Trainer, TrainSettings, evaluate_loss
from foundry.runtime import retain_freed_memory

CEILING_STEPS = 6  # steps of each process in the compute ceiling
DEFAULT_CONFIGS = (
    "sync-none=--compression none",
    "sync-topk=--compression topk",
    "local-h16-fp16=--sync-every 16 --compression fp16",
)


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


def ratio(x: float | None, base: float, invert: bool = False) -> str:
    """``x`` against the baseline as a table cell (``invert``: a time, where less is better)."""
    if x is None or x != x or x <= 0:
        return "   -  "
    return f"{(harness.ratio(base, x) if invert else harness.ratio(x, base)):5.2f}x"


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
    add_tool_flags(ap)
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
