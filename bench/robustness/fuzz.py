"""Fuzzing the live services: bad frames on every native port, a good peer served throughout.

Starts a real coordinator with one real worker, and a real TP pair (leader + worker) on
127.0.0.1, then sends each native port mutated, truncated, oversized and random frames over
many short connections, several connections at once:

- the coordinator's worker port (FDTC; its real peer is ``foundry worker``): every FDTC type,
  after no prefix, a REGISTER, or DATASET + REGISTER;
- the coordinator's admin port (FDTC; the gateway, ``foundry ctl``): every FDTC type;
- the TP leader's worker port (TP hello, gate-link opener, control frames; ``foundry
  tp-worker``): hellos with the right identity, another one, or the leader's role, plain or
  with the world's extensions (the weight, the threads), gate-link openers, and every control
  frame type;
- the TP leader's frontend port (the gateway): every frontend frame type.

Each fuzz frame is a valid frame of a random type built by the codec (``foundry.wire``) with
random field values, then mutated (kinds in ``MUTATIONS``: unchanged, bit flips, bytes
inserted or deleted, the length field changed, the type changed, a wrong magic, the payload
replaced by noise, truncated, an oversized declared length, or plain random bytes). Where the
protocol keeps a connection open after a frame, several frames share it; the harness decodes
what it sends with the service's own sans-IO decoder and stops adding frames at the first one
that ends the connection, so every frame it counts reached the service's parser.

Every connection must end one of the ways the protocol allows, within ``--hang-after`` seconds:

- **bad bytes or a refused request**: the service closes the connection by itself (an ERROR
  first where the protocol has one);
- **a stream that ends inside a declared frame** (truncated, or a length past the bytes sent):
  the service may rightly wait for the rest, so the harness ends its side
  (``shutdown(SHUT_WR)``) and the service must close (counted as ``awaiting``). One more lane
  per port sends only such streams and leaves them open: the service must cut each one off by
  its frame deadline (started with ``--frame-deadline 2`` where the service takes it; the TP
  leader's worker port has its bring-up limit of 10 s), counted as ``held`` and
  ``cut off``;
- **only valid frames**: a probe closes the stream (a STATUS_REQ on the admin and frontend links,
  a HEARTBEAT on a registered worker link) and must be answered, then the harness ends its side
  and the service must close.

Anything else is a **hang**. A **crash** is a service process that exited. A connection the
service closed unread (its connection limit, or the leader's four bring-up slots) is counted
as ``refused unread`` and its frames do not count. After every batch
the well-behaved peers must still be served: the real worker keeps training (the global step
advances, read on the admin link), and a greedy generation through the frontend link returns
the text a single process computes. Service logs are scanned for exceptions nobody handled.

    .venv/bin/python bench/robustness/fuzz.py --frames-per-port 10000 --seed 1 --seconds 60

Its parts are modules beside it: the frames and their mutations (``fuzz_frames``), the four
ports' plans and answers (``fuzz_targets``), the connections driven and checked
(``fuzz_drive``); this script starts the services, runs the batches and checks health.

Prints one line per port and a summary; exit status 0 when every port reached its frame count
with no crash, no hang, no unhandled exception and every health check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: live, harness

import harness
import live
from fuzz_drive import PortStats, drive, held_lane
from fuzz_frames import FdtcFrames
from fuzz_targets import (
    GOOD_WORKER,
    AdminPortTarget,
    FrontendTarget,
    Target,
    TpWorkerPortTarget,
    WorkerPortTarget,
)

from foundry.model.formats.gguf_io import load_gguf
from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import load_corpus
from foundry.tp.handshake import identity_for
from foundry.wire import frontend as fw

PROMPT = "Fuzzing never stops the pair."
PROMPT_TOKENS = 12
# Concurrent connections per port. The leader takes at most 4 bring-ups at once and closes
# more unread, so its worker port gets fewer.
LANES = {
    "coordinator-workers": 8,
    "coordinator-admin": 8,
    "tp-leader-workers": 3,
    "tp-leader-frontend": 8,
}
# The frame deadline the services are started with, where they take --frame-deadline: a
# stream left open inside a frame must be cut off within it (plus --hang-after).
FRAME_DEADLINE_S = 2.0
# The leader's bring-up on its worker port: 5 s without a byte, 10 s in all (docs/tp.md).
TP_BRINGUP_DEADLINE_S = 10.0
# Log lines of a service closing a connection unread: the leader's bring-up slots are full,
# or a link is at its connection limit.
REFUSED_UNREAD = re.compile(
    r"too many connections in their handshake"
    r"|connections are in their bring-up already"
    r"|refused \S+: the link has its limit of"
)
# A well-behaved peer must see progress within this after each batch.
HEALTH_TIMEOUT_S = 60.0


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Stack:
    work: Path
    coordinator: live.Service
    good_worker: live.Service
    leader: live.Service
    tp_worker: live.Service
    worker_port: int
    admin_port: int
    tp_port: int
    frontend_port: int
    model: Path
    reference: list[int]
    coordinator_deadline_s: float | None
    leader_deadline_s: float | None
    last_step: int = 0

    def services(self) -> list[live.Service]:
        return [self.coordinator, self.good_worker, self.leader, self.tp_worker]

    def stop(self) -> None:
        for svc in (self.good_worker, self.tp_worker, self.coordinator, self.leader):
            svc.stop()


def start_stack(work: Path) -> Stack:
    model = live.make_model(work / "model.gguf")
    reference = live.greedy_reference(model, PROMPT, PROMPT_TOKENS)
    short = ["--frame-deadline", f"{FRAME_DEADLINE_S:g}"]
    coord_deadline = FRAME_DEADLINE_S if live.has_flag("coordinator", short[0]) else None
    leader_deadline = FRAME_DEADLINE_S if live.has_flag("tp-leader", short[0]) else None
    started: list[live.Service] = []
    try:
        coord, wport, aport = live.start_coordinator(
            work,
            "--max-steps",
            "100000000",
            "--global-batch",
            "8",
            "--checkpoint-every",
            "100000000",
            *(short if coord_deadline else []),
        )
        started.append(coord)
        good = live.start_worker(work, wport, GOOD_WORKER)
        started.append(good)
        leader, tport, fport = live.start_leader(work, model, *(short if leader_deadline else []))
        started.append(leader)
        tpw = live.start_tp_worker(work, model, tport)
        started.append(tpw)
        live.wait_paired(fport)
        stack = Stack(
            work,
            coord,
            good,
            leader,
            tpw,
            wport,
            aport,
            tport,
            fport,
            model,
            reference,
            coord_deadline,
            leader_deadline,
        )
        stack.last_step = wait_training(stack, 0)
        return stack
    except BaseException:
        for svc in reversed(started):
            svc.stop()
        raise


def wait_training(stack: Stack, after: int) -> int:
    """The global step once it passed ``after`` with the real worker registered."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        st = live.swarm_status(stack.admin_port)
        if st.global_step > after and any(r.worker_id == GOOD_WORKER for r in st.rows):
            return st.global_step
        if time.monotonic() > deadline:
            raise live.ServiceError(
                f"training did not pass step {after} within "
                f"{HEALTH_TIMEOUT_S:g} s (now {st.global_step}, workers "
                f"{[r.worker_id for r in st.rows]})"
            )
        time.sleep(0.05)


def check_pair(stack: Stack) -> None:
    with live.FrontendClient(stack.frontend_port) as c:
        got = c.generate(PROMPT, PROMPT_TOKENS, HEALTH_TIMEOUT_S)
    if not isinstance(got.end, fw.Done) or got.tokens != stack.reference:
        raise live.ServiceError(
            f"generation after fuzzing: {got.end}, tokens {got.tokens}, expected {stack.reference}"
        )


def health(stack: Stack, target: Target) -> None:
    """The well-behaved peers are served; raises ServiceError if not."""
    dead = [s.name for s in stack.services() if not s.alive()]
    if dead:
        raise live.ServiceError(f"exited: {dead}")
    stack.last_step = wait_training(stack, stack.last_step)
    if target.name.startswith("tp-"):
        check_pair(stack)


async def fuzz_port(
    stack: Stack,
    target: Target,
    frames: int,
    seconds: float,
    seed: int,
    hang_s: float,
    batches: int,
    refused: Callable[[], int],
) -> PortStats:
    """Fuzz one port until ``frames`` fuzz frames reached its parser (``refused``: how many
    connections the service closed unread so far) or ``seconds`` passed."""
    lanes = LANES[target.name]
    stats = PortStats(target.name, lanes=lanes, frame_deadline_s=target.frame_deadline_s)
    t0 = time.monotonic()
    stop_at = t0 + seconds
    batch = max(1, -(-frames // batches))
    rngs = [random.Random(f"{seed}-{target.name}-{lane}") for lane in range(lanes)]

    async def lane(rng: random.Random, until: int) -> None:
        while stats.fuzz_frames < until and time.monotonic() < stop_at:
            await drive(target, target.plan(rng), stats, hang_s)
            if stats.connect_failures > 10:
                return

    done = asyncio.Event()
    held = None
    if target.frame_deadline_s is not None:
        held = asyncio.create_task(
            held_lane(
                target,
                random.Random(f"{seed}-{target.name}-held"),
                stats,
                target.frame_deadline_s,
                hang_s,
                done,
            )
        )
    while stats.fuzz_frames - stats.refused_unread < frames and time.monotonic() < stop_at:
        until = stats.fuzz_frames + min(batch, frames - stats.fuzz_frames + stats.refused_unread)
        await asyncio.gather(*(lane(r, until) for r in rngs))
        stats.refused_unread = refused()
        stats.health_checks += 1
        try:
            await asyncio.to_thread(health, stack, target)
        except live.ServiceError as exc:
            stats.health_failures.append(str(exc))
            break
        if stats.connect_failures > 10:
            break
    done.set()
    if held is not None:
        await held  # at most one connection in flight: bounded by its deadline
    stats.seconds = time.monotonic() - t0
    stats.crashes = sum(not s.alive() for s in stack.services())
    return stats


@dataclass
class Report:
    ports: list[PortStats]
    frames_per_port: int
    seed: int
    seconds: float
    unhandled: list[str]

    @property
    def ok(self) -> bool:
        return not self.unhandled and all(
            p.ok and p.fuzz_frames - p.refused_unread >= self.frames_per_port for p in self.ports
        )

    def summary(self) -> str:
        frames = sum(p.fuzz_frames for p in self.ports)
        return (
            f"fuzz: {frames:,} frames on {len(self.ports)} ports in {self.seconds:.0f} s, "
            f"hangs {sum(p.hangs for p in self.ports)}, crashes "
            f"{max((p.crashes for p in self.ports), default=0)}, unhandled exceptions "
            f"{len(self.unhandled)}: {'PASS' if self.ok else 'FAIL'}"
        )


def run(
    work: Path,
    frames_per_port: int,
    seed: int,
    seconds: float,
    hang_s: float = 5.0,
    batches: int = 10,
    ports: list[str] | None = None,
    out: live.Printer = print,
) -> Report:
    """Start the services in ``work``, fuzz each port, stop everything; the results."""
    t0 = time.monotonic()
    stack = start_stack(work)
    try:
        corpus = load_corpus(None)
        fp = corpus.fingerprint
        frames = FdtcFrames(ModelConfig(), fp.n_tokens, bytes.fromhex(fp.sha256))
        header = load_gguf(stack.model, select=lambda name, view: None)
        identity = identity_for(stack.model, header.cfg, header.cfg.n_ctx)
        targets: list[Target] = [
            WorkerPortTarget(stack.worker_port, frames),
            AdminPortTarget(stack.admin_port, frames),
            TpWorkerPortTarget(stack.tp_port, identity),
            FrontendTarget(stack.frontend_port),
        ]
        deadlines = [
            stack.coordinator_deadline_s,
            stack.coordinator_deadline_s,
            TP_BRINGUP_DEADLINE_S,
            stack.leader_deadline_s,
        ]
        for target, deadline in zip(targets, deadlines, strict=True):
            target.frame_deadline_s = deadline
        results = []
        unhandled: list[str] = []
        for target in targets:
            if ports and target.name not in ports:
                continue
            service = stack.leader if target.name.startswith("tp-") else stack.coordinator
            before = len(REFUSED_UNREAD.findall(service.text()))

            def refused(service: live.Service = service, before: int = before) -> int:
                return len(REFUSED_UNREAD.findall(service.text())) - before

            stats = asyncio.run(
                fuzz_port(stack, target, frames_per_port, seconds, seed, hang_s, batches, refused)
            )
            now = [f"{s.name}: {line}" for s in stack.services() for line in s.internal_errors()]
            stats.internal_errors = len(now) - len(unhandled)
            unhandled = now
            results.append(stats)
            out(stats.line())
            if stats.crashes:
                break
    finally:
        stack.stop()
    report = Report(results, frames_per_port, seed, time.monotonic() - t0, unhandled)
    for p in results:
        for sample in p.hang_samples:
            out(f"  hang on {p.port}: {sample}")
        for failure in p.health_failures:
            out(f"  health check failed on {p.port}: {failure}")
    for line in unhandled[:20]:
        out(f"  unhandled: {line}")
    out(report.summary())
    return report


def main() -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--frames-per-port", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--seconds", type=float, default=120.0, help="time limit per port (default 120)"
    )
    ap.add_argument(
        "--hang-after",
        type=float,
        default=5.0,
        help="seconds a connection may stay open past what it is owed (default 5)",
    )
    ap.add_argument(
        "--batches",
        type=int,
        default=10,
        help="health checks per port, one after each batch (default 10)",
    )
    ap.add_argument(
        "--ports",
        nargs="*",
        default=None,
        help="only these ports (coordinator-workers, coordinator-admin, "
        "tp-leader-workers, tp-leader-frontend)",
    )
    ap.add_argument("--work", type=Path, default=None, help="keep logs here (default: temp)")
    harness.add_json_flag(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="foundry-fuzz-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        report = run(
            work,
            args.frames_per_port,
            args.seed,
            args.seconds,
            args.hang_after,
            args.batches,
            args.ports,
        )
    harness.emit("fuzz", asdict(report), report.ok, args.json)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
