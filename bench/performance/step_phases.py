"""Where a served step's time goes, phase by phase on both ranks of the pair.

The pair behind the gateway under N clients (``serve_load.py``'s processes and load), each
rank's engine thread timed at its commands, its pass (and the gates inside it), its tops and
the draw's frames by a tracer this script loads into the ranks: a ``sitecustomize`` on their
PYTHONPATH that wraps those methods to note a timestamp (CLOCK_MONOTONIC, one clock for every
process of the host) before and after; nothing else changes. Then the medians of every
EVAL_BATCH step's phases, in ms:

- the leader, from its step's start: the command out, the pass (the gates' waits inside it
  apart), its own tops, the worker's ROW_TOPS in, ROW_DRAW out, its pass over its block of
  the vocabulary, ROW_MASS out, the worker's ROW_PICKS in, its finish, the step's end;
- the worker: the command in, its pass, its tops, ROW_TOPS out, ROW_DRAW in, its pass over its
  block, ROW_MASS in, its finish, ROW_PICKS out, and its wait for the next command.

A greedy load (``--temperature 0``) has no draw; its phases are left out then.

    OPENBLAS_NUM_THREADS=1 python bench/performance/step_phases.py --model FILE.gguf
        [--clients 16] [--tokens 64] [--rank-args "--threads 8 --ctx-size 2048"]
        [--temperature 0.8] [--json PATH]

The tracer costs each mark a few microseconds of Python: read the phases against each other,
and take throughput from ``serve_load.py``, which runs untraced.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRACE_ENV = "FOUNDRY_STEP_TRACE"  # the directory the ranks write their marks to
FLUSH_EVERY = 256

# -- the tracer, loaded into each rank by the sitecustomize below ----------------------------

_marks: list[tuple[str, int, Any]] = []
_gate_ns = [0]


def _flush() -> None:
    if _marks:
        with open(Path(os.environ[TRACE_ENV]) / f"marks-{os.getpid()}.jsonl", "a") as f:
            f.writelines(json.dumps(m) + "\n" for m in _marks)
        _marks.clear()


def mark(name: str, x: Any = None) -> None:
    _marks.append((name, time.monotonic_ns(), x))
    if len(_marks) >= FLUSH_EVERY:
        _flush()


def _around(cls: type, name: str, before: str, after: str) -> None:
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        mark(before)
        try:
            return fn(*args, **kwargs)
        finally:
            mark(after)

    setattr(cls, name, timed)


def _after(cls: type, name: str, label: Callable[[tuple[Any, ...], Any], tuple[str, Any]]) -> None:
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        mark(*label(args, out))
        return out

    setattr(cls, name, timed)


def install() -> None:
    """Wrap the methods whose times the phases are read from (every process that imports
    foundry's tensor-parallel package; only the ranks call them)."""
    import foundry.tp.commands as commands
    import foundry.tp.engine as engine
    import foundry.tp.link as link
    import foundry.tp.lockstep as lockstep
    import foundry.tp.worker_pair as worker_pair
    from foundry.model.infer import block_draw

    atexit.register(_flush)
    _around(engine.LeaderEngine, "_step", "step0", "step1")
    _around(block_draw.BlockRows, "leader_pass", "lp0", "lp1")
    _around(block_draw.BlockRows, "worker_pass", "wp0", "wp1")
    _around(block_draw.BlockRows, "worker_finish", "wf0", "wf1")
    _around(block_draw.BlockRows, "finish", "lf0", "lf1")
    forward = lockstep.RankState._forward

    def traced_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        _gate_ns[0] = 0
        mark("fwd0")
        try:
            return forward(self, *args, **kwargs)
        finally:
            mark("fwd1")
            mark("gates", _gate_ns[0])

    lockstep.RankState._forward = traced_forward  # type: ignore[method-assign]
    gate = lockstep.TracingExchange.__call__

    def traced_gate(self: Any, *args: Any) -> Any:
        t0 = time.monotonic_ns()
        try:
            return gate(self, *args)
        finally:
            _gate_ns[0] += time.monotonic_ns() - t0

    lockstep.TracingExchange.__call__ = traced_gate  # type: ignore[method-assign]
    tops = commands.greedy_tops

    def traced_tops(rows: Any) -> Any:
        mark("tops0")
        out = tops(rows)
        mark("tops1")
        return out

    commands.greedy_tops = traced_tops  # type: ignore[assignment]
    worker_pair.greedy_tops = traced_tops  # type: ignore[assignment]
    _after(link.ControlLink, "send", lambda a, _: ("sent", type(a[1]).__name__))
    _after(link.ControlLink, "recv", lambda _, out: ("got", type(out).__name__))


SITECUSTOMIZE = f"""import os, sys
if os.environ.get({TRACE_ENV!r}):
    sys.path.insert(0, {str(HERE)!r})
    import step_phases
    step_phases.install()
"""

# -- reading the marks -----------------------------------------------------------------------

# (label, mark, its x or None): a step's phases run from one point to the next.
LEADER = [
    ("step", "step0", None), ("command out", "sent", "EvalBatch"), ("pass", "fwd0", None),
    ("pass end", "fwd1", None), ("own tops", "tops0", None), ("own tops end", "tops1", None),
    ("worker's ROW_TOPS", "got", "RowTops"), ("ROW_DRAW out", "sent", "RowDraw"),
    ("its block's pass", "lp0", None), ("its block's pass end", "lp1", None),
    ("ROW_MASS out", "sent", "RowMass"), ("worker's ROW_PICKS", "got", "RowPicks"),
    ("finish", "lf0", None), ("finish end", "lf1", None), ("step end", "step1", None),
]  # fmt: skip
WORKER = [
    ("command in", "got", "EvalBatch"), ("pass", "fwd0", None), ("pass end", "fwd1", None),
    ("tops", "tops0", None), ("tops end", "tops1", None), ("ROW_TOPS out", "sent", "RowTops"),
    ("ROW_DRAW in", "got", "RowDraw"), ("its block's pass", "wp0", None),
    ("its block's pass end", "wp1", None), ("ROW_MASS in", "got", "RowMass"),
    ("finish", "wf0", None), ("finish end", "wf1", None), ("ROW_PICKS out", "sent", "RowPicks"),
]  # fmt: skip
Mark = tuple[str, int, Any]


def read_marks(directory: Path) -> dict[int, list[Mark]]:
    out = {}
    for path in directory.glob("marks-*.jsonl"):
        out[int(path.stem.split("-")[1])] = [tuple(json.loads(line)) for line in path.open()]
    return out  # type: ignore[return-value]


def steps(marks: list[Mark], first: tuple[str, Any], last: tuple[str, Any]) -> list[list[Mark]]:
    """The marks from each ``first`` to the next ``last``."""
    out: list[list[Mark]] = []
    current: list[Mark] | None = None
    for m in marks:
        if (m[0], m[2]) == first or (first[1] is None and m[0] == first[0]):
            current = [m]
        elif current is not None:
            current.append(m)
            if (m[0], m[2]) == last or (last[1] is None and m[0] == last[0]):
                out.append(current)
                current = None
    return out


def phases(seqs: list[list[Mark]], points: list[tuple[str, str, Any]]) -> dict[str, list[float]]:
    """Each phase's durations (ms) over the steps that hold every point, in order."""
    out: dict[str, list[float]] = {}
    for seq in seqs:
        at: list[int] = []
        start = 0
        for _, name, x in points:
            t = next(
                (m[1] for m in seq if m[0] == name and (x is None or m[2] == x) and m[1] >= start),
                None,
            )
            if t is None:
                break
            at.append(t)
            start = t
        if len(at) < len(points):
            continue
        for (a, _, _), (b, _, _), ta, tb in zip(points, points[1:], at, at[1:], strict=False):
            out.setdefault(f"{a} -> {b}", []).append((tb - ta) / 1e6)
    return out


def main() -> int:
    import argparse
    import asyncio
    import shlex
    import tempfile

    sys.path.insert(0, str(HERE.parent))
    import harness
    from serve_load import Stack, load

    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a GGUF file")
    ap.add_argument("--clients", type=int, default=16, help="concurrent streams (default 16)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a stream (default 64)")
    ap.add_argument("--rank-args", default="", help="extra flags for both ranks")
    ap.add_argument(
        "--temperature", type=float, default=0.8, help="the load's temperature (default 0.8)"
    )
    harness.add_json_flag(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="foundry-step-phases-") as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (work / "marks").mkdir()
        os.environ[TRACE_ENV] = str(work / "marks")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(work / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        stack = Stack(args.model, work, shlex.split(args.rank_args))
        try:
            stack.wait_ready()
            measured = asyncio.run(load(stack.grpc, args.clients, args.tokens, args.temperature))
        finally:
            stack.stop()
        by_pid = read_marks(work / "marks")
    leader = next((m for m in by_pid.values() if any(e[0] == "step0" for e in m)), [])
    worker = next((m for p, m in by_pid.items() if m is not leader and m), [])
    table = {
        "leader": phases(
            [s for s in steps(leader, ("step0", None), ("step1", None))
             if any(e[0] == "sent" and e[2] == "EvalBatch" for e in s)],
            LEADER,
        ),
        "worker": phases(steps(worker, ("got", "EvalBatch"), ("sent", "RowPicks")), WORKER),
    }  # fmt: skip
    gates = {
        "leader": [e[2] / 1e6 for e in leader if e[0] == "gates"],
        "worker": [e[2] / 1e6 for e in worker if e[0] == "gates"],
    }
    idle = [
        (b[1] - a[1]) / 1e6
        for a, b in itertools.pairwise(worker)
        if (a[0], a[2]) == ("sent", "RowPicks") and (b[0], b[2]) == ("got", "EvalBatch")
    ]
    print(
        f"{args.model.name}, {args.clients} clients of {args.tokens} tokens at temperature "
        f"{args.temperature:g}, ranks {args.rank_args or '(default flags)'}: generation "
        f"{measured['generation_tokens_per_s']:.1f} tokens/s (traced), ITL p50 "
        f"{measured['itl_p50_ms']:.1f} ms; medians over the steps, ms"
    )
    results: dict[str, Any] = {"load": measured}
    for rank, rows in table.items():
        print(f"{rank} ({len(next(iter(rows.values()), []))} steps):")
        for name, values in rows.items():
            print(f"  {name:46s} {harness.median(values):8.3f}")
        if gates[rank]:
            print(f"  {'the gates inside the pass':46s} {harness.median(gates[rank]):8.3f}")
        results[rank] = {name: harness.median(v) for name, v in rows.items()}
        results[rank]["gates"] = harness.median(gates[rank]) if gates[rank] else None
    if idle:
        print(f"worker: waiting for the next command {harness.median(idle):8.3f}")
        results["worker_idle_ms"] = harness.median(idle)
    harness.emit("step_phases", results, None, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
