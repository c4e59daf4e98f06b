"""``churn.py``'s swarm soak: a checkpointing coordinator and its workers train while workers
are killed with SIGKILL and started again, and the coordinator once; the global step, the
rounds' deadlines, the processes, the checkpoints and the final loss against a churn-free run
are checked (the invariants: churn.py's docstring)."""

from __future__ import annotations

import datetime
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import live

from foundry.model.formats.checkpoint import (
    CheckpointError,
    CheckpointState,
    load_checkpoint,
    verify_checkpoint,
)
from foundry.model.formats.checkpoint_dir import latest_checkpoint, list_checkpoints
from foundry.model.text.data import load_corpus
from foundry.model.train.training import evaluate_loss
from foundry.obs.timeline import load_events
from foundry.swarm import policy

GLOBAL_BATCH = 16
SEQ_LEN = 64
# Far beyond any run here: the schedule is warm-up, then a flat peak rate, in both runs.
MAX_STEPS = 1_000_000_000
# Held-out batches of 8 sequences for the final comparison (the coordinator uses 4).
EVAL_BATCHES = 16
LOSS_TOLERANCE = 0.02
# The peak learning rate of both runs: a third of the default, so that two runs whose batches
# differ by the samples lost with killed workers end within the tolerance of each other (at
# 3e-3 the loss of batch-16 steps swung by 1 % from one step to the next, and churned runs
# ended 2.2-2.8 % above or below the churn-free one, either way).
LR = 1e-3
# Checkpoints the baseline may write past its last step before the harness stops it.
BASELINE_OVERRUN_STEPS = 50
# Scheduling slack on top of the smallest possible round deadline.
ROUND_SLACK_S = 1.5
# A registered worker killed with SIGKILL must be dropped within this (its socket closes).
DROP_WITHIN_S = 1.0

STEP_LINE = re.compile(
    r"^(\S+ \S+) INFO foundry\.coordinator: step (\d+): loss \S+, (\d+) samples from (\d+) "
    r"workers in ([\d.]+)s",
    re.M,
)
DEADLINE_LINE = re.compile(
    r"^(\S+ \S+) WARNING foundry\.coordinator: step (\d+) "
    r"(closed at its deadline|abandoned)",
    re.M,
)
DROP_LINE = re.compile(r"^(\S+ \S+) WARNING foundry\.coordinator: dropped worker (\S+) ", re.M)
REGISTER_LINE = re.compile(
    r"^(\S+ \S+) INFO foundry\.coordinator: worker (\S+) registered from", re.M
)
RESUMED_LINE = re.compile(r"resumed from \S+ at step (\d+)")
EMPTIED_LINE = re.compile(
    r"^(\S+ \S+) INFO foundry\.coordinator: step \d+: every assigned "
    r"worker left before reporting",
    re.M,
)


def log_time(stamp: str) -> float:
    """A log line's local timestamp (``2026-01-02 03:04:05,678``) as seconds since the epoch."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass
class SwarmReport:
    seconds: float = 0.0
    workers: int = 0
    checkpoint_every: int = 0
    worker_kills: int = 0
    worker_restarts: int = 0
    coordinator_restarts: int = 0
    registrations: int = 0  # membership changes: workers joining ...
    drops: int = 0  # ... and leaving, as the coordinator logged them
    final_step: int = 0
    rounds: int = 0
    longest_round_s: float = 0.0
    rounds_at_deadline: int = 0
    rounds_abandoned: int = 0
    rounds_emptied: int = 0  # abandoned at once: every worker of the round had been killed
    longest_drop_s: float = 0.0
    status_polls: int = 0
    never_killed: list[str] = field(default_factory=list)  # alive, same pid, from start to end
    step_regressions: list[str] = field(default_factory=list)
    last_step_before_restart: int = 0
    resumed_step: int = 0
    newest_checkpoint_at_kill: int = 0
    steps_lost: int = 0
    samples_lost: int = 0
    checkpoint_bytes: int = 0
    checkpoints_verified: int = 0
    corrupt_checkpoints: list[str] = field(default_factory=list)
    samples: int = 0  # samples in the final checkpoint's lineage
    samples_full: int = 0  # what full rounds would have had (steps x global batch)
    baseline_steps: int = 0  # the churned lineage's samples in full rounds
    baseline_seconds: float = 0.0
    val_loss: float = float("nan")
    baseline_val_loss: float = float("nan")  # at baseline_steps
    baseline_val_loss_final: float = float("nan")  # at final_step
    loss_gap: float = float("nan")
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        return (
            f"swarm churn: {self.seconds:.0f} s, {self.workers} workers, {self.worker_kills} "
            f"worker kills, {self.coordinator_restarts} coordinator restart; membership changes "
            f"{self.registrations} joins + {self.drops} drops; step {self.final_step}, "
            f"{self.rounds} rounds (longest {self.longest_round_s:.2f} s, "
            f"{self.rounds_at_deadline} closed at the deadline, {self.rounds_abandoned} "
            f"abandoned, {self.rounds_emptied} of them at once as all their workers had "
            f"died), "
            f"killed workers dropped within {self.longest_drop_s:.2f} s; restart resumed at "
            f"step {self.resumed_step} (newest checkpoint {self.newest_checkpoint_at_kill}, last "
            f"step {self.last_step_before_restart}): {self.steps_lost} steps / "
            f"{self.samples_lost} samples of progress lost, 0 bytes of the "
            f"{self.checkpoint_bytes:,}-byte checkpointed state; {self.checkpoints_verified} "
            f"checkpoints verified, {len(self.corrupt_checkpoints)} corrupt; validation loss "
            f"{self.val_loss:.4f} after {self.samples} samples ({self.samples_full - self.samples}"
            f" lost with killed workers) vs {self.baseline_val_loss:.4f} without churn at as "
            f"many samples ({self.baseline_steps} steps) and "
            f"{self.baseline_val_loss_final:.4f} at as many steps ({self.final_step}): gap "
            f"{100 * self.loss_gap:+.2f}% "
            f"[{'PASS' if self.ok else 'FAIL'}]"
        )


class CheckpointWatch:
    """Verifies every checkpoint file of a folder once, as it appears."""

    def __init__(self, folder: Path, report: SwarmReport) -> None:
        self.folder = folder
        self.report = report
        self.seen: set[str] = set()

    def scan(self) -> None:
        for _, path in list_checkpoints(self.folder):
            if path.name in self.seen:
                continue
            try:
                verify_checkpoint(path)
            except FileNotFoundError:
                continue  # rotated away (keep-last) between the listing and the check
            except CheckpointError as exc:
                if path.exists():
                    self.report.corrupt_checkpoints.append(f"{path.name}: {exc}")
                continue
            self.seen.add(path.name)
            self.report.checkpoints_verified += 1


def coordinator_args(checkpoint_every: int) -> list[str]:
    return [
        "--max-steps",
        str(MAX_STEPS),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--lr",
        str(LR),
        "--seq-len",
        str(SEQ_LEN),
        "--checkpoint-every",
        str(checkpoint_every),
    ]


def timeline_of(work: Path, name: str) -> Path:
    return work / f"{name}.timeline.json"


def round_waits(path: Path, until: float) -> list[tuple[int, str, float]]:
    """(step, outcome, seconds from the round's start to its decision) of every round that
    began before ``until`` (wall clock) in a coordinator's timeline (kill-safe: one event
    per line, flushed)."""
    events = load_events(path.read_text(), str(path))
    applies = sorted(e["ts"] for e in events if e.get("name") == "apply")
    out = []
    for e in events:
        if e.get("name") != "round" or e["ts"] > until * 1e6:
            continue
        start, end = e["ts"], e["ts"] + e["dur"]
        decided = end  # an abandoned round ends at its decision
        if e["args"].get("outcome") == "close":
            # a closed round's span also covers the update (and validation, checkpoint):
            # it decided when its "apply" began
            decided = next((t for t in applies if start <= t <= end), end)
        out.append((int(e["args"]["step"]), str(e["args"].get("outcome")), (decided - start) / 1e6))
    return out


def rounds_of(log: str) -> dict[int, tuple[int, float, float]]:
    """step -> (samples, seconds, end time) of every closed round in a coordinator log."""
    return {int(m[2]): (int(m[3]), float(m[5]), log_time(m[1])) for m in STEP_LINE.finditer(log)}


def swarm_soak(
    work: Path,
    seconds: float,
    seed: int,
    workers: int = 3,
    checkpoint_every: int = 10,
    kill_every: float = 3.0,
    out: live.Printer = print,
) -> SwarmReport:
    rep = SwarmReport(workers=workers, checkpoint_every=checkpoint_every)
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    args = [*coordinator_args(checkpoint_every), "--min-workers", "1"]
    watch = CheckpointWatch(work / "ckpt", rep)
    coord, wport, aport = live.start_coordinator(
        work, *args, "--timeline", str(timeline_of(work, "coordinator-1")), name="coordinator-1"
    )
    logs = [coord]
    procs: dict[str, live.Service] = {}
    generation = dict.fromkeys((f"w{i}" for i in range(workers)), 0)
    down: dict[str, float] = {}  # worker id -> when to start it again
    kills: list[tuple[str, float, bool]] = []  # (worker id, wall time, registered then)
    churn_end = time.time()
    try:
        for wid in generation:
            procs[wid] = live.start_worker(work, wport, wid, log=f"{wid}-0")
        first = live.swarm_status(aport)
        t0 = time.monotonic()
        end = t0 + seconds
        restart_at = t0 + 0.4 * seconds
        next_kill = t0 + min(kill_every, 0.2 * seconds)
        next_scan = t0
        last_step, restarted, rows = first.global_step, False, set()
        while time.monotonic() < end:
            now = time.monotonic()
            for wid, at in list(down.items()):
                if now >= at:
                    generation[wid] += 1
                    procs[wid] = live.start_worker(work, wport, wid, log=f"{wid}-{generation[wid]}")
                    rep.worker_restarts += 1
                    del down[wid]
            if not restarted and now >= restart_at:
                restarted = True
                watch.scan()
                newest = list_checkpoints(work / "ckpt")
                rep.newest_checkpoint_at_kill = newest[-1][0] if newest else 0
                coord.kill9()
                logged = rounds_of(coord.text())
                rep.last_step_before_restart = max(logged, default=0)
                time.sleep(rng.uniform(0.2, 1.0))
                coord, _, _ = live.start_coordinator(
                    work,
                    *args,
                    "--timeline",
                    str(timeline_of(work, "coordinator-2")),
                    name="coordinator-2",
                    port=wport,
                    admin_port=aport,
                )
                logs.append(coord)
                rep.coordinator_restarts += 1
                m = RESUMED_LINE.search(coord.text())
                rep.resumed_step = int(m[1]) if m else 0
                rep.steps_lost = rep.last_step_before_restart - rep.resumed_step
                rep.samples_lost = sum(n for s, (n, _, _) in logged.items() if s > rep.resumed_step)
                if rep.resumed_step != rep.newest_checkpoint_at_kill:
                    rep.failures.append(
                        f"resumed at step {rep.resumed_step}, the newest "
                        f"checkpoint was {rep.newest_checkpoint_at_kill}"
                    )
                if rep.steps_lost > checkpoint_every:
                    rep.failures.append(
                        f"{rep.steps_lost} steps lost at the restart, more "
                        f"than the checkpoint interval {checkpoint_every}"
                    )
                if last_step - rep.resumed_step > checkpoint_every:
                    rep.failures.append(f"step went back from {last_step} to {rep.resumed_step}")
                last_step, rows = rep.resumed_step, set()
                continue
            if now >= next_kill:
                up = sorted(w for w in procs if w not in down)
                if up:
                    wid = rng.choice(up)
                    kills.append((wid, time.time(), wid in rows))
                    procs[wid].kill9()
                    rep.worker_kills += 1
                    down[wid] = now + rng.uniform(0.3, 2.0)
                next_kill = now + kill_every * rng.uniform(0.5, 1.5)
            for wid, svc in procs.items():
                if wid not in down and not svc.alive():
                    rep.failures.append(f"worker {wid} (pid {svc.pid}) exited by itself")
                    down[wid] = now  # report once, start it again
            if not coord.alive():
                rep.failures.append(f"the coordinator (pid {coord.pid}) exited by itself")
                break
            try:
                st = live.swarm_status(aport, timeout_s=5.0)
            except (OSError, live.ServiceError) as exc:
                rep.failures.append(f"admin status failed: {exc}")
            else:
                rep.status_polls += 1
                if st.global_step < last_step:
                    rep.step_regressions.append(f"{last_step} -> {st.global_step}")
                last_step = st.global_step
                rows = {r.worker_id for r in st.rows}
            if now >= next_scan:
                watch.scan()
                next_scan = now + 0.5
            time.sleep(0.1)
        rep.seconds = time.monotonic() - t0
        churn_end = time.time()
        rep.never_killed = [
            f"{w} (pid {procs[w].pid})" for w in procs if generation[w] == 0 and w not in down
        ]
    finally:
        for svc in procs.values():
            svc.stop()
        coord.stop()
    watch.scan()
    rep.failures += [f"step went back: {r}" for r in rep.step_regressions]
    rep.failures += [f"corrupt checkpoint {c}" for c in rep.corrupt_checkpoints]
    check_rounds(rep, work, logs, kills, churn_end)

    final = latest_checkpoint(work / "ckpt")
    if final is None:
        rep.failures.append("no checkpoint at the end")
        return rep
    state = load_checkpoint(final)
    rep.final_step = state.step
    rep.checkpoint_bytes = final.stat().st_size
    rep.samples, missing = lineage_samples(logs, rep.resumed_step, state.step)
    rep.samples_full = state.step * GLOBAL_BATCH
    if missing:
        rep.failures.append(f"no log line for steps {missing[:10]} of the final lineage")
    corpus = load_corpus(None)
    rep.val_loss = evaluate_loss(state.params, state.config, corpus, SEQ_LEN, EVAL_BATCHES)
    rep.baseline_steps = max(1, round(rep.samples / GLOBAL_BATCH))
    out(
        f"churn done at step {state.step} ({rep.samples} samples); baseline without churn: "
        f"{rep.baseline_steps} steps"
    )
    t1 = time.monotonic()
    steps = sorted({rep.baseline_steps, state.step})
    base = baseline(work / "baseline", steps, workers)
    rep.baseline_seconds = time.monotonic() - t1
    rep.baseline_val_loss, rep.baseline_val_loss_final = (
        evaluate_loss(base[s].params, base[s].config, corpus, SEQ_LEN, EVAL_BATCHES)
        for s in (rep.baseline_steps, state.step)
    )
    rep.loss_gap = loss_gap(rep.val_loss, rep.baseline_val_loss, rep.baseline_val_loss_final)
    if not rep.loss_gap <= LOSS_TOLERANCE:  # below the range is no progress lost
        rep.failures.append(
            f"final validation loss {rep.val_loss:.4f} is "
            f"{100 * rep.loss_gap:+.2f}% above the range without churn "
            f"[{rep.baseline_val_loss:.4f}, {rep.baseline_val_loss_final:.4f}] "
            f"(tolerance {100 * LOSS_TOLERANCE:g}%)"
        )
    return rep


def check_rounds(
    rep: SwarmReport,
    work: Path,
    logs: list[live.Service],
    kills: list[tuple[str, float, bool]],
    until: float,
) -> None:
    """Rounds decided within the smallest deadline; killed workers were dropped at once.
    Rounds and membership changes are counted up to ``until`` (wall clock: the end of the
    churn, before the harness stops the workers)."""
    limit = policy.DEADLINE_FLOOR_S + ROUND_SLACK_S
    drops: list[tuple[float, str]] = []
    for svc in logs:
        for step, outcome, secs in round_waits(timeline_of(work, svc.name), until):
            rep.rounds += 1
            rep.longest_round_s = max(rep.longest_round_s, secs)
            if secs > limit:
                rep.failures.append(
                    f"{svc.name}: a round of step {step} ({outcome}) waited "
                    f"{secs:.2f} s, more than the {policy.DEADLINE_FLOOR_S:g} s "
                    f"floor of any deadline plus {ROUND_SLACK_S:g} s"
                )
        text = svc.text()
        for m in DEADLINE_LINE.finditer(text):
            if log_time(m[1]) > until:
                continue
            if m[3] == "abandoned":
                rep.rounds_abandoned += 1
            else:
                rep.rounds_at_deadline += 1
        # A round whose workers all left is abandoned at once, logged as that (INFO), not as an
        # abandon at the deadline (WARNING): it counts as both.
        emptied = sum(log_time(m[1]) <= until for m in EMPTIED_LINE.finditer(text))
        rep.rounds_emptied += emptied
        rep.rounds_abandoned += emptied
        rep.registrations += sum(log_time(m[1]) <= until for m in REGISTER_LINE.finditer(text))
        found = [(log_time(m[1]), m[2]) for m in DROP_LINE.finditer(text)]
        rep.drops += sum(t <= until for t, _ in found)
        drops += found
    if rep.rounds_at_deadline or rep.rounds_abandoned > rep.rounds_emptied:
        rep.failures.append(
            f"{rep.rounds_at_deadline} rounds closed at their deadline and "
            f"{rep.rounds_abandoned - rep.rounds_emptied} were abandoned there"
        )
    for wid, at, registered in kills:
        if not registered:
            continue  # killed before it registered, or while the coordinator was down
        after = [t - at for t, w in drops if w == wid and t >= at - 0.01]
        if not after or min(after) > DROP_WITHIN_S:
            rep.failures.append(
                f"worker {wid} killed at {at:.3f} was not dropped within {DROP_WITHIN_S:g} s"
            )
        else:
            rep.longest_drop_s = max(rep.longest_drop_s, min(after))


def lineage_samples(logs: list[live.Service], resumed: int, final: int) -> tuple[int, list[int]]:
    """Samples of steps 1..final as the final checkpoint saw them: the first coordinator's
    rounds up to the step the second resumed from, the second's after it."""
    by_step: dict[int, int] = {}
    for i, svc in enumerate(logs):
        for step, (n, _, _) in rounds_of(svc.text()).items():
            if i == 0 and len(logs) > 1 and step > resumed:
                continue
            by_step[step] = n
    missing = [s for s in range(1, final + 1) if s not in by_step]
    return sum(by_step.get(s, 0) for s in range(1, final + 1)), missing


def loss_gap(loss: float, *bounds: float) -> float:
    """How far ``loss`` lies outside the range of ``bounds``, relative to the bound it passed
    (0 inside it; negative below it)."""
    lo, hi = min(bounds), max(bounds)
    return (loss - lo) / lo if loss < lo else (loss - hi) / hi if loss > hi else 0.0


def baseline(work: Path, steps: list[int], workers: int) -> dict[int, CheckpointState]:
    """The same swarm without churn: its checkpoints at ``steps`` (ascending), stopped at the
    last one."""
    work.mkdir(parents=True, exist_ok=True)
    every = math.gcd(*steps)
    # the checkpoints from steps[0] on, and those written before the harness stops it
    keep = (steps[-1] - steps[0]) // every + 1 + BASELINE_OVERRUN_STEPS
    args = [
        *coordinator_args(every),
        "--min-workers",
        str(workers),
        "--keep-checkpoints",
        str(keep),
    ]
    coord, wport, _ = live.start_coordinator(work, *args)
    procs = [live.start_worker(work, wport, f"w{i}") for i in range(workers)]
    try:
        deadline = time.monotonic() + 60 + steps[-1]
        while not any(s == steps[-1] for s, _ in list_checkpoints(work / "ckpt")):
            if time.monotonic() > deadline or not coord.alive():
                raise live.ServiceError(f"the baseline did not reach step {steps[-1]}; see {work}")
            time.sleep(0.1)
    finally:
        for p in procs:
            p.stop()
        coord.stop()
    paths = dict(list_checkpoints(work / "ckpt"))
    return {s: load_checkpoint(paths[s]) for s in steps}
