"""Swarm training throughput against single-process training, measured in one run.

Prints, on loopback:

1. samples/s of single-process training (the baseline), then of the swarm with 1 and with N
   workers (default 2), as ratios to the baseline, and the coordinator's share of a round
   (aggregate + AdamW + weights out) — targets: N=2 workers >= 1.6x one process on a 2-core
   machine, coordinator time <= 10% of a round; then, for context, N workers against one
   process at a larger global batch (``--large-batch``): the per-round costs are fixed, so
   the ratio shows how much of the gap is overhead rather than compute;
2. heterogeneity: one worker slowed 3x (``--slowdown``), the cluster's samples/s over the sum
   of each worker's standalone samples/s, with throughput re-balancing and with equal splits —
   target >= 0.85 with re-balancing;
3. gradient and weight bytes per round for each compression, from the coordinator's counters.

Every process gets one BLAS thread. ``--workers 8`` is the scale run for a many-core machine.
``--coordinator-args`` adds coordinator flags to every swarm run, e.g.
``--coordinator-args="--sync-every 16 --compression fp16"`` measures local-step training.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: live, harness

import harness
from live import Service, swarm_status

from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.text.data import load_corpus
from foundry.model.train.training import Trainer, TrainSettings
from foundry.runtime import retain_freed_memory
from foundry.wire import fdtc


def metric(port: int, name: str, label: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not label or label in line):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def run_swarm(
    work: Path,
    args: argparse.Namespace,
    slowdowns: list[float],
    *,
    rebalance: bool = True,
    compression: str = "none",
    steps: int | None = None,
) -> dict[str, float]:
    """Start a coordinator and len(slowdowns) workers; measure steady-state rounds."""
    work.mkdir(parents=True)
    n_steps = steps or args.steps
    total = args.warmup + n_steps
    coord = Service(
        "coordinator",
        [
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
            "--checkpoint-dir",
            str(work / "ckpt"),
            "--preset",
            args.preset,
            "--global-batch",
            str(args.global_batch),
            "--seq-len",
            str(args.seq_len),
            "--max-steps",
            str(total + 1000),
            "--checkpoint-every",
            "100000",
            "--min-workers",
            str(len(slowdowns)),
            "--compression",
            compression,
            *([] if rebalance else ["--no-rebalance"]),
            *shlex.split(args.coordinator_args),
        ],
        work / "coordinator.log",
    )
    m = coord.wait_for(r"workers 127\.0\.0\.1:(\d+), admin 127\.0\.0\.1:(\d+), metrics :(\d+)")
    port, admin, mport = int(m.group(1)), int(m.group(2)), int(m.group(3))
    workers = [
        Service(
            f"w{i}",
            [
                "worker",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--worker-id",
                f"w{i}",
                "--slowdown",
                str(s),
            ],
            work / f"w{i}.log",
        )
        for i, s in enumerate(slowdowns)
    ]
    try:

        def wait_step(step: int) -> tuple[float, fdtc.SwarmStatus]:
            end = time.monotonic() + 600
            while time.monotonic() < end:
                st = swarm_status(admin)
                if st.global_step >= step:
                    return time.monotonic(), st
                time.sleep(0.02)
            raise SystemExit(f"step {step} not reached; see {work}")

        t0, s0 = wait_step(args.warmup)
        apply0 = metric(mport, "foundry_swarm_apply_duration_seconds_sum")
        round0 = metric(mport, "foundry_swarm_round_duration_seconds_sum")
        grad0 = metric(mport, "foundry_swarm_gradient_bytes_total")
        weight0 = metric(mport, "foundry_swarm_weight_bytes_total")
        t1, s1 = wait_step(args.warmup + n_steps)
        rounds = s1.global_step - s0.global_step
        return {
            "samples_per_s": (s1.samples_total - s0.samples_total) / (t1 - t0),
            "coordinator_share": (
                metric(mport, "foundry_swarm_apply_duration_seconds_sum") - apply0
            )
            / max(1e-9, metric(mport, "foundry_swarm_round_duration_seconds_sum") - round0),
            "grad_bytes_per_round": (metric(mport, "foundry_swarm_gradient_bytes_total") - grad0)
            / rounds,
            "weight_bytes_per_round": (metric(mport, "foundry_swarm_weight_bytes_total") - weight0)
            / rounds,
        }
    finally:
        for w in workers:
            w.stop()
        coord.stop()


def single_process(args: argparse.Namespace) -> float:
    retain_freed_memory()
    cfg = preset(args.preset)
    settings = TrainSettings(
        global_batch=args.global_batch, seq_len=args.seq_len, total_steps=args.warmup + args.steps
    )
    trainer = Trainer(cfg, settings, init_params(cfg, 0))
    corpus = load_corpus(None)
    for _ in range(args.warmup):
        trainer.train_step(corpus, micro_batch=8)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(corpus, micro_batch=8)
    return args.steps * args.global_batch / (time.perf_counter() - t0)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--preset", default="small")
    ap.add_argument(
        "--global-batch",
        type=int,
        default=64,
        help="samples per round; per-round costs (weights out, gradients in,\n"
        "AdamW) are fixed, so small batches measure overhead, not training",
    )
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12, help="measured rounds per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="rounds before measuring")
    ap.add_argument("--workers", type=int, default=2, help="workers of the scale run")
    ap.add_argument(
        "--large-batch",
        type=int,
        default=128,
        help="global batch of the context run (N workers against one process at\n"
        "this batch, no target); 0 skips it",
    )
    ap.add_argument("--skip-bytes", action="store_true", help="skip the compression table")
    ap.add_argument(
        "--coordinator-args",
        default="",
        help="extra coordinator flags for every swarm run (after --compression)",
    )
    harness.add_json_flag(ap)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    results: dict[str, float] = {}
    ok = True
    print(
        f"# swarm bench: preset {args.preset}, global batch {args.global_batch}x{args.seq_len},"
        f" {args.steps} measured rounds, {cores} cores",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="foundry-bench-") as tmp:
        work = Path(tmp)
        base = single_process(args)
        print(f"single process           {base:8.1f} samples/s  (baseline)", flush=True)
        one = run_swarm(work / "one", args, [1.0])
        print(
            f"swarm, 1 worker          {one['samples_per_s']:8.1f} samples/s  "
            f"{one['samples_per_s'] / base:5.2f}x  coordinator "
            f"{100 * one['coordinator_share']:4.1f}% of a round",
            flush=True,
        )
        many = run_swarm(work / "many", args, [1.0] * args.workers)
        ratio = harness.ratio(many["samples_per_s"], base)
        target = 1.6 if args.workers == 2 else 0.8 * min(args.workers, cores - 1)
        ok = ratio >= target and many["coordinator_share"] <= 0.10
        results.update(
            one_process_samples_per_s=base,
            one_worker_ratio=harness.ratio(one["samples_per_s"], base),
            workers_ratio=ratio,
            coordinator_share=many["coordinator_share"],
        )
        print(
            f"swarm, {args.workers} workers         {many['samples_per_s']:8.1f} samples/s  "
            f"{ratio:5.2f}x  coordinator {100 * many['coordinator_share']:4.1f}% of a round"
            f"   [{verdict(ratio >= target)} >= {target:.1f}x; "
            f"{verdict(many['coordinator_share'] <= 0.10)} coordinator <= 10%]",
            flush=True,
        )
        if args.large_batch:
            large = argparse.Namespace(**{**vars(args), "global_batch": args.large_batch})
            large_base = single_process(large)
            large_many = run_swarm(work / "many-large", large, [1.0] * args.workers)
            print(
                f"{args.workers} workers, global batch {args.large_batch}"
                f"  {large_many['samples_per_s']:8.1f} samples/s  "
                f"{large_many['samples_per_s'] / large_base:5.2f}x of one process at that "
                f"batch ({large_base:.1f} samples/s)  coordinator "
                f"{100 * large_many['coordinator_share']:4.1f}% of a round",
                flush=True,
            )

        slow = run_swarm(work / "slow-alone", args, [3.0])
        fast = one["samples_per_s"]
        standalone = fast + slow["samples_per_s"]
        balanced = run_swarm(work / "hetero", args, [1.0, 3.0])
        equal = run_swarm(work / "hetero-equal", args, [1.0, 3.0], rebalance=False)
        eff = harness.ratio(balanced["samples_per_s"], standalone)
        ok = ok and eff >= 0.85
        results["heterogeneous_efficiency"] = eff
        print(
            f"heterogeneous (one worker 3x slower): standalone {fast:.1f} + "
            f"{slow['samples_per_s']:.1f} = {standalone:.1f} samples/s",
            flush=True,
        )
        print(
            f"  re-balanced by throughput {balanced['samples_per_s']:8.1f} samples/s  "
            f"{eff:5.2f} of the sum   [{verdict(eff >= 0.85)} >= 0.85]",
            flush=True,
        )
        print(
            f"  equal splits              {equal['samples_per_s']:8.1f} samples/s  "
            f"{equal['samples_per_s'] / standalone:5.2f} of the sum",
            flush=True,
        )

        if not args.skip_bytes:
            print("bytes per round, 2 workers (gradients up, weights down):", flush=True)
            for comp in ("none", "fp16", "topk", "qsgd"):
                r = run_swarm(work / f"bytes-{comp}", args, [1.0, 1.0], compression=comp, steps=4)
                print(
                    f"  {comp:5s} gradients {r['grad_bytes_per_round']:12,.0f}  "
                    f"weights {r['weight_bytes_per_round']:12,.0f}",
                    flush=True,
                )
                results[f"{comp}_grad_bytes_per_round"] = r["grad_bytes_per_round"]
    harness.emit("swarm", {"workers": args.workers, **results}, ok, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
