"""Where a synchronous round goes, from the ``--timeline`` traces of a swarm's processes
(``foundry.obs.timeline``): the mean milliseconds of each span, and the round's critical path.

The critical path of a round follows the worker that reported last (the coordinator's ``wait``
span names it) through one wall clock (every process on one host), so its segments add up to
the round exactly, from the round's start to the next one's:

- ``down``: the round opens until the last worker starts decoding its UPDATE (the UPDATEs and
  assignments of the workers sent before it, then its own UPDATE's bytes);
- ``update``: it decodes and adds the UPDATE;
- ``assign``: its assignment arrives and its compute starts;
- ``compute``, ``encode``: its gradient, and the gradient's encoding;
- ``upload``: from the end of its encoding until the coordinator starts decoding it (the bytes
  on the wire, and the coordinator reading them);
- ``decode``: the coordinator decodes it;
- ``close``: the round closes and its step begins;
- ``optimizer``, ``encode-update``: the coordinator's optimizer step, and the UPDATE that
  moves every worker after it;
- ``next``: until the next round opens (SYNC to every worker, the log, validation and
  checkpoints when due, the next plan).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: harness

import harness

from foundry.obs.timeline import load_events

# Spans of each service's trace, in the order a synchronous round runs them.
COORDINATOR_PHASES = ("round", "assign", "wait", "apply", "decode", "optimizer", "encode")
WORKER_PHASES = ("wait", "update", "compute", "compress", "send")
PATH = (
    "down",
    "update",
    "assign",
    "compute",
    "encode",
    "upload",
    "decode",
    "close",
    "optimizer",
    "encode-update",
    "next",
)

Span = dict[str, Any]


def _spans(path: Path) -> list[Span]:
    return [e for e in load_events(path.read_text(), str(path)) if e.get("ph") == "X"]


def _end(e: Span) -> int:
    return int(e["ts"]) + int(e["dur"])


def _worker_name(path: Path) -> str:
    """The worker id of a worker's trace: its thread's name."""
    for e in load_events(path.read_text(), str(path)):
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            return str(e["args"]["name"])
    return path.name.split(".")[0]


def load(work: Path) -> tuple[list[Span], dict[str, list[Span]]]:
    """(the coordinator's spans, each worker's by its id) of the ``*.trace.json`` in ``work``."""
    coordinator: list[Span] = []
    workers: dict[str, list[Span]] = {}
    for path in sorted(work.glob("*.trace.json")):
        if path.name.startswith("coordinator"):
            coordinator = _spans(path)
        else:
            workers[_worker_name(path)] = _spans(path)
    return coordinator, workers


def phases(work: Path, first: int, last: int) -> str:
    """Mean milliseconds per step of each span of the rounds of steps ``first`` to ``last``:
    the coordinator's (``decode`` summed over the workers), and the workers' averaged."""
    coordinator, workers = load(work)
    sums: dict[tuple[str, str], float] = {}
    for service, spans in [
        ("coordinator", coordinator),
        *(("worker", s) for s in workers.values()),
    ]:
        for e in spans:
            step = e.get("args", {}).get("step")
            if isinstance(step, int) and first <= step < last:
                key = (service, e["name"])
                sums[key] = sums.get(key, 0.0) + e["dur"] / 1000
    span = max(1, last - first)

    def row(service: str, names: tuple[str, ...], div: int) -> str:
        return " ".join(
            f"{n} {sums.get((service, n), 0.0) / span / max(1, div):.1f}" for n in names
        )

    return (
        f"ms per step: coordinator {row('coordinator', COORDINATOR_PHASES, 1)}; "
        f"each worker {row('worker', WORKER_PHASES, len(workers))}"
    )


def critical_paths(work: Path, first: int, last: int) -> list[dict[str, float]]:
    """The critical path (``PATH``, milliseconds) of each closed synchronous round of steps
    ``first`` to ``last`` whose pieces are all in the traces, and its ``round`` (the sum)."""
    coordinator, workers = load(work)

    def by_step(spans: list[Span], name: str, **match: str) -> dict[int, Span]:
        return {
            e["args"]["step"]: e
            for e in spans
            if e["name"] == name and all(e["args"].get(k) == v for k, v in match.items())
        }

    rounds = sorted(
        (e for e in coordinator if e["name"] == "round" and e["args"].get("outcome") == "close"),
        key=lambda e: e["ts"],
    )
    waits = by_step(coordinator, "wait")
    optimizer, encode = by_step(coordinator, "optimizer"), by_step(coordinator, "encode")
    out = []
    for rnd, nxt in itertools.pairwise(rounds):
        step = rnd["args"]["step"]
        if not first <= step < last or step not in waits or step not in optimizer:
            continue
        who = waits[step]["args"]["last"]
        mine = workers.get(who, [])
        pieces = [by_step(mine, n).get(step) for n in ("update", "compute", "compress")]
        decode = by_step(coordinator, "decode", worker=who).get(step)
        if any(p is None for p in pieces) or decode is None:
            continue
        update, compute, compress = pieces
        assert update is not None and compute is not None and compress is not None
        marks = [
            rnd["ts"],
            update["ts"],
            _end(update),
            compute["ts"],
            _end(compute),
            _end(compress),
            decode["ts"],
            _end(decode),
            optimizer[step]["ts"],
            _end(optimizer[step]),
            _end(encode[step]),
            nxt["ts"],
        ]
        path = {n: (b - a) / 1000 for n, a, b in zip(PATH, marks[:-1], marks[1:], strict=True)}
        path["round"] = (nxt["ts"] - rnd["ts"]) / 1000
        out.append(path)
    return out


def critical_path(work: Path, first: int, last: int) -> str:
    """The median of each segment of ``critical_paths`` over its rounds, as one line."""
    paths = critical_paths(work, first, last)
    if not paths:
        return "critical path: no complete round in the traces"
    med = {k: harness.median(p[k] for p in paths) for k in (*PATH, "round")}
    return (
        f"critical path, median ms of {len(paths)} rounds: "
        + " ".join(f"{k} {med[k]:.1f}" for k in PATH)
        + f" = round {med['round']:.1f}"
    )
