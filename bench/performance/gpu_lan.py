"""Two GPU workers on a shaped link against one GPU worker alone, measured in one run.

Three swarms of one coordinator train the same model on the same global batch and schedule
with ``--sync-every H`` (``bench/performance/lan.py``'s machinery: real processes, each in a network
namespace of its own behind one bridge, every port shaped both ways by ``tc tbf``):

1. ``alone``: one worker, on loopback (no link: one GPU host alone), ``--steps`` steps; its
   validation loss at the last step is the target, and its time to it the baseline.
2. ``pair RATE``: two workers, each in its namespace, the coordinator in a third, every port
   at ``--rate`` (1 Gb/s by default), until the target (or ``--max-steps``): time to the
   target against ``alone``, and the bytes per round through the coordinator's port each way
   (read from the switch's counters, TCP/IP headers included; both workers together, so one
   worker's is half).
3. ``pair loopback``: the same two workers on loopback, no shaping: with (2) it separates what
   the link costs from what sharing one GPU costs. Both workers of a pair run on the one
   device GPU, so a pair cannot train faster than one worker there; the line
   ``GPU shared`` gives the pair's samples/s on loopback against ``alone``'s (two GPU hosts
   would give up to 2x).

Workers get ``--worker-args`` (``--device cuda`` by default; ``--device torch-cpu`` with a tiny
preset is the CPU smoke check). It needs root, ``ip`` and ``tc`` (or ``--ip``/``--tc``,
``FOUNDRY_IP``/``FOUNDRY_TC``, as ``bench/performance/lan.py``); ``--rate loopback`` runs without
them.

    # the device: medium preset, H 16
    python bench/performance/gpu_lan.py --preset medium --seq-len 128 --global-batch 32 \\
        --sync-every 16 --steps 64
    # CPU smoke check (root, ip and tc here)
    python bench/performance/gpu_lan.py --preset tiny --seq-len 32 --global-batch 8 \\
        --sync-every 4 --steps 12 --validate-every 4 --worker-args "--device torch-cpu"
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: live

from lan_net import Network, add_tool_flags
from lan_swarm import Baseline, Result, mb, run_config

from foundry.model.spec.config import preset


def run(
    args: argparse.Namespace,
    work: Path,
    name: str,
    workers: int,
    rate: str,
    target: float,
    max_steps: int,
) -> Result:
    a = copy.copy(args)
    a.workers, a.max_steps, a.stop_at_target = workers, max_steps, True
    base = Baseline(
        samples_per_s=float("nan"), target=target, seconds_to_target=float("nan"), curve=[]
    )
    net = Network(workers + 1, rate, args.ip, args.tc)
    folder = work / name.replace(" ", "-")
    try:
        net.up()
        return run_config(
            net,
            folder,
            a,
            base,
            name,
            [
                "--sync-every",
                str(args.sync_every),
                "--validate-device",
                args.validate_device,
                *args.coordinator_args,
            ],
        )
    finally:
        net.down()
        if args.keep_logs and (folder / "coordinator.log").exists():
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            shutil.copy(
                folder / "coordinator.log", args.keep_logs / f"{folder.name}-coordinator.log"
            )


def show(r: Result, alone: Result, args: argparse.Namespace) -> None:
    tt = "-" if r.seconds_to_target is None else f"{r.seconds_to_target:.1f} s"
    ratio = (
        ""
        if r.seconds_to_target is None or not alone.seconds_to_target
        else f" ({alone.seconds_to_target / r.seconds_to_target:.2f}x sooner than alone)"
    )
    h = args.sync_every
    traffic = (
        ""
        if math.isnan(r.up_per_step)
        else f"; per round (H={h}) up {mb(r.up_per_step * h)} MB, down "
        f"{mb(r.down_per_step * h)} MB through the coordinator's port"
    )
    curve = " ".join(f"{s}:{loss:.3f}" for s, _, loss in r.curve)
    print(
        f"{r.name}: {r.samples_per_s:.1f} samples/s, to target {tt}{ratio}{traffic}"
        f"{'; ' + r.note if r.note else ''}",
        flush=True,
    )
    print(f"  validation by step: {curve}", flush=True)


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so that every namespace made is removed (``run``'s finally)


def main() -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rate", default="1gbit", help="the pair's ports (tc syntax)")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument(
        "--steps",
        type=int,
        default=64,
        help="alone's steps; its validation loss there is the target",
    )
    ap.add_argument("--max-steps", type=int, default=0, help="a pair's cap (default 2x)")
    ap.add_argument("--validate-every", type=int, default=16)
    ap.add_argument("--worker-args", type=shlex.split, default=["--device", "cuda"])
    ap.add_argument(
        "--validate-device",
        default=None,
        help="the coordinator's --validate-device (default: the workers' --device; "
        "numpy validates a 126M model in minutes, a GPU in seconds)",
    )
    ap.add_argument(
        "--config-timeout", type=float, default=150.0, help="seconds each swarm may run"
    )
    ap.add_argument("--no-loopback-pair", action="store_true")
    ap.add_argument(
        "--coordinator-args",
        type=shlex.split,
        default=[],
        help="more coordinator flags for every swarm, e.g. '--compression qsgd'",
    )
    ap.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        help="copy each swarm's coordinator log into this folder",
    )
    add_tool_flags(ap)
    args = ap.parse_args()
    if args.validate_device is None:
        w = args.worker_args
        args.validate_device = w[w.index("--device") + 1] if "--device" in w[:-1] else "cpu"
    signal.signal(signal.SIGTERM, interrupted)
    args.slowdown, args.timeline = 1.0, False
    args.schedule_steps = args.steps
    cap = max(args.max_steps or 2 * args.steps, args.steps)
    cfg = preset(args.preset)
    dense = 4 * sum(math.prod(s) for s in cfg.param_shapes().values())
    print(
        f"# gpu lan: preset {args.preset} (dense f32 weights {dense / 1e6:.1f} MB), global "
        f"batch {args.global_batch}x{args.seq_len}, --sync-every {args.sync_every}, workers "
        f"{shlex.join(args.worker_args)}, coordinator "
        f"{shlex.join(args.coordinator_args) or '(defaults)'}, validation on "
        f"{args.validate_device}, {os.cpu_count()} cores",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="foundry-gpulan-") as tmp:
        work = Path(tmp)
        alone = run(args, work, "alone", 1, "loopback", -math.inf, args.steps)
        if not alone.curve:
            print(f"alone: no validation ({alone.note})", flush=True)
            return 1
        target = alone.curve[-1][2]
        alone.seconds_to_target = alone.curve[-1][1]
        print(
            f"target: alone's validation loss {target:.4f} at step {alone.curve[-1][0]}", flush=True
        )
        show(alone, alone, args)
        pair: Result | None = None
        try:
            pair = run(args, work, f"pair {args.rate}", 2, args.rate, target, cap)
            show(pair, alone, args)
        except RuntimeError as exc:  # no namespaces here (not root, no ip/tc): say so, go on
            print(f"pair {args.rate} failed: {exc}"[:600], flush=True)
        if not args.no_loopback_pair and args.rate != "loopback":  # else that was the pair above
            loop = run(args, work, "pair loopback", 2, "loopback", target, cap)
            show(loop, alone, args)
            print(
                f"GPU shared: the pair on loopback trains {loop.samples_per_s:.1f} samples/s "
                f"= {loop.samples_per_s / alone.samples_per_s:.2f}x alone (two hosts: up to "
                "2x)"
                + (
                    ""
                    if pair is None
                    else f"; the link leaves {pair.samples_per_s / loop.samples_per_s:.2f}x of that"
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
