"""`foundry timeline merge`: join the --timeline files of several processes into one trace."""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser(
        "timeline",
        help="work with per-round timelines (Chrome trace files)",
        description="Per-round timelines: `foundry coordinator --timeline FILE` and "
        "`foundry worker --timeline FILE` each write a Chrome trace of their own phases.",
    )
    tsub = t.add_subparsers(dest="timeline_command", metavar="ACTION", required=True)
    m = tsub.add_parser(
        "merge",
        help="join trace files into one",
        description="Join the trace files of the coordinator and the workers into one file "
        "for chrome://tracing or https://ui.perfetto.dev (timestamps are wall-clock, so files "
        "from one host line up exactly).",
    )
    m.add_argument("traces", nargs="+", type=Path, metavar="FILE.json", help="trace files")
    m.add_argument("--out", type=Path, required=True, help="the merged trace to write")
    m.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    from foundry.obs.timeline import TimelineError, dump, load_events, merge

    traces = []
    for path in args.traces:
        try:
            traces.append(load_events(path.read_text(encoding="utf-8"), str(path)))
        except (OSError, UnicodeDecodeError, TimelineError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    events = merge(traces)
    args.out.write_text(dump(events), encoding="utf-8")
    counts = collections.Counter(e["name"] for e in events if e.get("ph") == "X")
    summary = ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "no spans"
    print(f"merged {len(args.traces)} files into {args.out}: {summary}")
    return 0
