"""What the FDTC connection object costs per message, against the bare codec, in one run.

The services drive every FDTC link through ``FdtcConnection`` (decoder + lifecycle table):
each received message passes the table, each sent one is checked against it. This measures
that on the coordinator's busiest small messages, HEARTBEAT in and HEARTBEAT_ACK out, and on a
round's GRADIENTS (``--floats`` f32 values) in and GRADIENTS_ACK out, on a registered worker
link, against the bare ``FdtcDecoder`` and ``encode_parts`` on the same bytes, interleaved
(bare, connection, bare, ...) so that load on the machine affects both alike.

    .venv/bin/python bench/performance/connection.py [--messages 20000] [--repeats 7]

Prints microseconds per message (in + out) for both and the ratio (median of the repeats).
Target: the connection within 1.5x of the bare codec on small messages (its table lookups are
a few dictionary accesses per message); on GRADIENTS the payload copy dominates and the two
are alike.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness

from foundry.wire import fdtc
from foundry.wire.fdtc_connection import FdtcConnection
from foundry.wire.fdtc_lifecycle import Link, Role

REGISTER = fdtc.encode(
    fdtc.Register("w", fdtc.PROTOCOL_VERSION, fdtc.HardwareProfile.SERVER, 4, 1024, 8)
)


def bare(frames: bytes, reply: fdtc.Message, n: int) -> float:
    t = time.perf_counter()
    dec = fdtc.FdtcDecoder()
    dec.feed(REGISTER)
    dec.next_event()
    dec.feed(frames)
    while dec.next_event() is not None:
        pass
    for _ in range(n):
        fdtc.encode_parts(reply)
    return time.perf_counter() - t


def connection(frames: bytes, reply: fdtc.Message, n: int, *, weights: bool) -> float:
    t = time.perf_counter()
    conn = FdtcConnection(Role.COORDINATOR, link=Link.WORKER)
    conn.feed(REGISTER)
    conn.next_event()
    if weights:  # GRADIENTS pass only on a link that got weights
        conn.send(fdtc.WeightsMeta(0, 0.0, (fdtc.TensorMeta("t", (1,)),)), fdtc.Weights(bytes(4)))
    conn.feed(frames)
    while conn.next_event() is not None:
        pass
    for _ in range(n):
        conn.send(reply)
    return time.perf_counter() - t


def compare(
    name: str, frames: bytes, reply: fdtc.Message, n: int, repeats: int, weights: bool
) -> float:
    runs: dict[str, list[float]] = {"bare": [], "conn": []}
    timed: dict[str, Callable[[], float]] = {
        "bare": lambda: bare(frames, reply, n),
        "conn": lambda: connection(frames, reply, n, weights=weights),
    }
    for _ in range(repeats):
        for key, run in timed.items():
            runs[key].append(run())
    b, c = (harness.median(runs[k]) / n * 1e6 for k in ("bare", "conn"))
    print(
        f"{name:<28} bare codec {b:8.2f} us   FdtcConnection {c:8.2f} us   "
        f"{harness.ratio(c, b):5.2f}x"
    )
    return harness.ratio(c, b)


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--messages", type=int, default=20000, help="small messages per repeat")
    ap.add_argument("--floats", type=int, default=100_000, help="f32 values per GRADIENTS")
    ap.add_argument("--repeats", type=int, default=7)
    harness.add_json_flag(ap)
    args = ap.parse_args()
    n = args.messages
    small = compare(
        "HEARTBEAT in, ACK out",
        fdtc.encode(fdtc.Heartbeat("w", 1, 0.5, 10.0)) * n,
        fdtc.HeartbeatAck(1),
        n,
        args.repeats,
        weights=False,
    )
    grads = fdtc.Gradients(
        "w", 1, 1, fdtc.Compression.NONE, 4 * args.floats, bytes(4 * args.floats)
    )
    m = max(1, n // 100)
    big = compare(
        f"GRADIENTS ({args.floats} f32) in",
        fdtc.encode(grads) * m,
        fdtc.GradientsAck(1, True),
        m,
        args.repeats,
        weights=True,
    )
    ok = small <= 1.5
    print(f"small messages: {small:.2f}x the bare codec [{'PASS' if ok else 'FAIL'} <= 1.5x]")
    harness.emit("connection", {"small_ratio": small, "gradients_ratio": big}, ok, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
