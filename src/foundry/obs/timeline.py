"""Per-round timelines as Chrome trace files (the Trace Event Format, JSON).

Each process writes its own file (``--timeline FILE``): the coordinator its rounds (``round``,
``assign``: the assignments and what brings workers up to date going out, ``wait``: from the
first report to the last, ``apply``, ``checkpoint``), each worker its phases (``wait``,
``update``: decoding and adding an UPDATE, ``compute``, ``compress``, ``send``).
``foundry timeline merge`` joins the files into one that chrome://tracing or
https://ui.perfetto.dev opens: one process per service, one thread per worker.

Events are complete events (``"ph": "X"``) with wall-clock timestamps in microseconds
(``time.time_ns() // 1000``), so the files of processes on one host line up exactly; across hosts
they line up as well as the clocks agree (NTP: a millisecond or so). The ``pid`` names the service
(``SERVICE_PIDS``), the ``tid`` the worker (its OS process id), and metadata events give both a
name. A file is written as the Trace Event Format's JSON Array Format, one event per line and
flushed as it happens, so a process that is killed leaves a valid trace: the format allows the
closing bracket to be missing, and ``load_events`` accepts that.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

# Trace ``pid`` of each service, so every worker's file lands in one "worker" process group.
SERVICE_PIDS = {"coordinator": 1, "worker": 2}
# The coordinator's own track (its rounds); workers use their OS pid as tid, never 0.
ROUNDS_TID = 0

Event = dict[str, Any]


def now_us() -> int:
    """Wall-clock microseconds: the timestamp of every event."""
    return time.time_ns() // 1000


class Timeline:
    """Writes the complete events of one process to a trace file; off when ``path`` is None."""

    def __init__(
        self, path: Path | None, service: str, tid: int | None = None, thread: str = ""
    ) -> None:
        self.pid = SERVICE_PIDS[service]
        self.tid = os.getpid() if tid is None else tid
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._first = True
        if path is not None:
            self._file = path.open("w", encoding="utf-8")
            self._file.write("[\n")
            self._write(_meta("process_name", self.pid, 0, service))
            self._write(_meta("thread_name", self.pid, self.tid, thread or service))

    def span(self, name: str, start_us: int, end_us: int | None = None, **args: Any) -> None:
        """A complete event from ``start_us`` to ``end_us`` (default: now) on this track."""
        if self._file is None:
            return
        end = now_us() if end_us is None else end_us
        self._write({
            "name": name, "ph": "X", "ts": start_us, "dur": max(0, end - start_us),
            "pid": self.pid, "tid": self.tid, "args": args,
        })  # fmt: skip

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None

    def _write(self, event: Event) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write(("" if self._first else ",\n") + json.dumps(event))
            self._file.flush()
            self._first = False


def _meta(name: str, pid: int, tid: int, value: str) -> Event:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {"name": value}}


# ---------------------------------------------------------------------------------- merging


class TimelineError(ValueError):
    """A file that is not a trace this module can read."""


def load_events(text: str, source: str = "trace") -> list[Event]:
    """The events of a trace in either JSON form, the array one possibly cut short."""
    body = text.strip()
    if body.startswith("[") and not body.endswith("]"):
        body = body.rstrip(",") + "]"  # a process killed mid-run leaves no closing bracket
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise TimelineError(f"{source} is not trace JSON: {exc}") from None
    if isinstance(data, dict):
        data = data.get("traceEvents")
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise TimelineError(
            f"{source} holds no list of trace events; pass files written with --timeline"
        )
    return data


def merge(traces: Iterable[list[Event]]) -> list[Event]:
    """All events of ``traces``, threads that collide across files renumbered, in time order.

    Two files can use the same (pid, tid) when workers on different hosts got the same OS pid;
    the later file's thread then gets a fresh tid so the two stay apart.
    """
    taken: set[tuple[int, int]] = set()
    merged: list[Event] = []
    for events in traces:
        threads = {(e.get("pid", 0), e.get("tid", 0)) for e in events} - _SHARED_TRACKS
        remap: dict[tuple[int, int], int] = {}
        for pid, tid in sorted(threads & taken):
            fresh = 1 + max(t for p, t in taken | threads if p == pid)
            remap[(pid, tid)] = fresh
            taken.add((pid, fresh))
        taken |= threads
        for e in events:
            key = (e.get("pid", 0), e.get("tid", 0))
            merged.append({**e, "tid": remap[key]} if key in remap else e)
    return sorted(merged, key=_order)


# Track 0 of each service (its process name, the coordinator's rounds) is one track in every file.
_SHARED_TRACKS = {(pid, ROUNDS_TID) for pid in SERVICE_PIDS.values()}


def _order(e: Event) -> tuple[int, int]:
    return (0, 0) if e.get("ph") == "M" else (1, int(e.get("ts", 0)))


def dump(events: list[Event]) -> str:
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=None) + "\n"
