"""The ``mixed`` section of ``gpu.py``: a swarm of one GPU worker and ``--cpu-workers`` numpy
workers (real processes on loopback) against the sum of each worker's standalone samples/s, with
each process's phases from its timeline (``--mixed-timelines``)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import harness
import numpy as np
from gpu_shared import say


def swarm_rate(work: Path, workers: list[tuple[list[str], str]], args: argparse.Namespace) -> float:
    """samples/s of a coordinator with these workers (their extra flags, and the cores
    ``--mixed-pin`` keeps them on), steady state; with ``--mixed-timelines`` every process
    writes its timeline and the phases are printed."""
    from live import Service, swarm_status

    work.mkdir(parents=True)
    total = args.mixed_warmup + args.mixed_rounds
    h = args.mixed_sync_every
    trace = (
        (lambda name: ["--timeline", str(work / f"{name}.trace.json")])
        if args.mixed_timelines
        else (lambda name: [])
    )
    pin = (lambda cores: ["taskset", "-c", cores]) if args.mixed_pin else (lambda cores: [])
    coord = Service(
        "coordinator",
        [
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--checkpoint-dir",
            str(work / "ckpt"),
            "--preset",
            "small",
            "--global-batch",
            str(args.mixed_batch),
            "--seq-len",
            "64",
            "--sync-every",
            str(h),
            "--max-steps",
            str(h * (total + 50)),
            "--checkpoint-every",
            "100000",
            "--validate-every",
            "100000",
            "--min-workers",
            str(len(workers)),
            *args.mixed_coordinator_args.split(),
            *trace("coordinator"),
        ],
        work / "coordinator.log",
        prefix=pin("0-1"),
    )
    m = coord.wait_for(r"workers 127\.0\.0\.1:(\d+), admin 127\.0\.0\.1:(\d+)")
    port, admin = int(m.group(1)), int(m.group(2))
    procs = [
        Service(
            f"w{i}",
            [
                "worker",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--worker-id",
                f"w{i}",
                *extra,
                *trace(f"w{i}"),
            ],
            work / f"w{i}.log",
            prefix=pin(cores),
        )
        for i, (extra, cores) in enumerate(workers)
    ]
    try:

        def wait_step(step: int) -> tuple[float, int]:
            end = time.monotonic() + 300
            while time.monotonic() < end:
                st = swarm_status(admin)
                if st.global_step >= step:
                    return time.monotonic(), st.samples_total
                time.sleep(0.02)
            raise SystemExit(f"step {step} not reached; see {work}")

        t0, n0 = wait_step(h * args.mixed_warmup)
        t1, n1 = wait_step(h * total)
        return (n1 - n0) / (t1 - t0)
    finally:
        for p in procs:
            p.stop()
        coord.stop()
        if args.mixed_timelines:
            say_phases(work, h * args.mixed_warmup)


def say_phases(work: Path, from_step: int) -> None:
    """Median milliseconds of each timeline phase per process over the steps measured, and
    the coordinator's rounds one by one (milliseconds, samples applied)."""
    from foundry.obs.timeline import load_events

    for path in sorted(work.glob("*.trace.json")):
        spans: dict[str, list[tuple[int, float, dict[str, object]]]] = {}
        for e in load_events(path.read_text(encoding="utf-8"), str(path)):
            step = int(e.get("args", {}).get("step", -1))
            if e.get("ph") == "X" and step >= from_step:
                spans.setdefault(e["name"], []).append((step, e["dur"] / 1000, e["args"]))
        name = path.name.removesuffix(".trace.json")
        say(
            f"  {name}: "
            + ", ".join(
                f"{n} {float(np.median([d for _, d, _ in v])):.0f} ms x{len(v)}"
                for n, v in sorted(spans.items())
            )
        )
        if name == "coordinator":
            samples = {step: a.get("samples") for step, _, a in spans.get("apply", [])}
            say(
                "    rounds (step: ms, samples, outcome): "
                + ", ".join(
                    f"{step}: {d:.0f}, {samples.get(step)}, {a.get('outcome')}"
                    for step, d, a in spans.get("round", [])
                )
            )


def section_mixed(args: argparse.Namespace, work: Path) -> None:
    gpu, cpu = args.mixed_fast_args.split(), args.mixed_slow_args.split()
    say(
        f"## mixed swarm: small preset, --sync-every {args.mixed_sync_every}, global batch "
        f"{args.mixed_batch}x64, 1 GPU + {args.cpu_workers} CPU workers (one core each); "
        f"coordinator {args.mixed_coordinator_args or '(defaults)'}"
    )
    # --mixed-pin: the coordinator on cores 0-1, the GPU worker on 2-5, CPU worker i on 8 + i,
    # in the standalone runs as in the mix (one host standing in for separate machines).
    fast = (gpu, "2-5")
    slow = [(cpu, str(8 + i)) for i in range(args.cpu_workers)]
    if args.mixed_pin and (os.cpu_count() or 1) < 8 + args.cpu_workers:
        raise SystemExit(
            f"--mixed-pin needs {8 + args.cpu_workers} cores (cores 8.. for the "
            f"CPU workers); this machine has {os.cpu_count()}"
        )
    ratios = []
    for r in range(args.mixed_repeats):
        # Each repeat measures its own standalone rates next to its mix: the GPU's rate moves
        # between runs by more than the target's margin.
        g = swarm_rate(work / f"gpu{r}", [fast], args)
        if r == 0:  # the CPU worker's rate holds steady (86-105 in four runs): measured once
            c = swarm_rate(work / "cpu", slow[:1], args)
        mixed = swarm_rate(work / f"mixed{r}", [fast, *slow], args)
        total = g + args.cpu_workers * c
        ratios.append(mixed / total)
        verdict = "PASS" if mixed >= 0.9 * total else "FAIL"
        say(
            f"standalone: GPU {g:.1f}, CPU {c:.1f} samples/s; sum {total:.1f}; mixed "
            f"{mixed:.1f} ->  {mixed / total:.2f} of the sum [{verdict} >= 0.9]"
        )
    if len(ratios) > 1:
        med = harness.median(ratios)
        say(
            f"mixed of the sum over {len(ratios)} repeats: {' '.join(f'{x:.2f}' for x in ratios)}"
            f"; median {med:.2f} [{'PASS' if med >= 0.9 else 'FAIL'} >= 0.9]"
        )
