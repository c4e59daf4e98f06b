"""Gate exchange latency against the minimal symmetric socket exchange, measured in one run.

Two processes on loopback, each pinned to its own core where the machine has two: rank 0 (this
process) and rank 1 (a spawned child) run the same loop in lockstep. For a 4 KiB gate (one row
of n_embd 1024 float32) and a 16 KiB gate (four rows, the bytes of one n_embd 4096 row), rank 0
times, per iteration:

- raw: plain blocking sockets, both ranks ``sendall`` the bytes then ``recv_into`` the peer's:
  the least a symmetric full-duplex exchange can cost from Python (the baseline);
- tcp: ``TcpGateExchange.exchange`` (header, tag check, poll loop, the sum);
- shm: ``ShmGateExchange.exchange`` over the slab.

The three are interleaved in blocks so that drift of the machine hits them alike. Target: the
TCP gate's p50 at most 2x the raw exchange's p50 (PASS/FAIL; exit status 1 on FAIL).

``--arrive-last-us N``: rank 0 works (spins) N us before each exchange, so that rank 1 is always
waiting when rank 0 arrives, as the rank that finishes its half of a layer last finds its peer
inside a pair. Rank 0's times are then the cost of an exchange to the rank that arrives last:
no waiting, only the exchange's own code and system calls.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/performance/tp_gates.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np

from foundry.model.shard.table import Gate
from foundry.transport.gates import GateExchange, ShmGateExchange, TcpGateExchange

N_EMBD = 1024
SIZES = {"4 KiB": 1, "16 KiB": 4}  # rows of N_EMBD float32
TARGET_RATIO = 2.0
TIMEOUT_S = 10.0


def cores() -> list[int]:
    """Two distinct cores for the two ranks, or none where they cannot be pinned apart."""
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        return []
    return sorted(os.sched_getaffinity(0))[:2]


def pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})


def raw_exchange(sock: socket.socket, out: memoryview, into: memoryview) -> None:
    sock.sendall(out)
    got = 0
    while got < len(into):
        n = sock.recv_into(into[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def run_rank(
    rank: int,
    raw: socket.socket,
    gates: dict[str, GateExchange],
    iters: int,
    warmup: int,
    blocks: int,
    work_us: float = 0.0,
) -> dict[tuple[str, str], list[int]]:
    """The shared loop of both ranks; returns rank-local timings in ns per (size, transport).
    ``work_us``: busy time before each exchange."""
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rng = np.random.default_rng(rank)
    times: dict[tuple[str, str], list[int]] = {}
    for _ in range(blocks):
        for size, rows in SIZES.items():
            partial = rng.standard_normal((rows, N_EMBD), dtype=np.float32)
            out = memoryview(partial.tobytes())
            into = memoryview(bytearray(partial.nbytes))
            samples = times.setdefault((size, "raw"), [])
            for i in range(warmup + iters):
                spin(work_us)
                t0 = time.perf_counter_ns()
                raw_exchange(raw, out, into)
                if i >= warmup:
                    samples.append(time.perf_counter_ns() - t0)
            for name, g in gates.items():
                samples = times.setdefault((size, name), [])
                for i in range(warmup + iters):
                    spin(work_us)
                    t0 = time.perf_counter_ns()
                    g.exchange(i % 32, Gate(i % 2), partial)
                    if i >= warmup:
                        samples.append(time.perf_counter_ns() - t0)
    return times


def spin(us: float) -> None:
    """Stay busy for ``us`` microseconds (work, not sleep: the core stays awake)."""
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def rank1(port: int, shm_name: str, core: int | None, iters: int, warmup: int, blocks: int) -> None:
    pin(core)
    raw = socket.create_connection(("127.0.0.1", port))
    gate_sock = socket.create_connection(("127.0.0.1", port))
    gates: dict[str, GateExchange] = {
        "tcp": TcpGateExchange(gate_sock, rank=1, n_embd=N_EMBD, timeout_s=TIMEOUT_S),
        "shm": ShmGateExchange.attach(shm_name, n_embd=N_EMBD, timeout_s=TIMEOUT_S),
    }
    try:
        run_rank(1, raw, gates, iters, warmup, blocks)
    finally:
        raw.close()
        for g in gates.values():
            g.close()


def main() -> int:
    parser = harness.parser(__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=3000, help="timed exchanges per block")
    parser.add_argument("--warmup", type=int, default=300, help="untimed exchanges per block")
    parser.add_argument("--blocks", type=int, default=3, help="interleaved blocks")
    parser.add_argument(
        "--arrive-last-us",
        type=float,
        default=0.0,
        metavar="N",
        help="rank 0 works N us before each exchange, so it always arrives "
        "last (default 0: lockstep)",
    )
    harness.add_json_flag(parser)
    args = parser.parse_args()

    pair = cores()
    pin(pair[0] if pair else None)
    where = f"cores {pair[0]} and {pair[1]}" if pair else "not pinned"
    ctx = mp.get_context("spawn")
    started = time.monotonic()
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(TIMEOUT_S)
        slab = ShmGateExchange.create(n_embd=N_EMBD, timeout_s=TIMEOUT_S)
        child = ctx.Process(
            target=rank1,
            args=(
                server.getsockname()[1],
                slab.name,
                pair[1] if pair else None,
                args.iters,
                args.warmup,
                args.blocks,
            ),
        )
        child.start()
        raw, _ = server.accept()
        gate_sock, _ = server.accept()
    gates: dict[str, GateExchange] = {
        "tcp": TcpGateExchange(gate_sock, rank=0, n_embd=N_EMBD, timeout_s=TIMEOUT_S),
        "shm": slab,
    }
    try:
        times = run_rank(0, raw, gates, args.iters, args.warmup, args.blocks, args.arrive_last_us)
    finally:
        raw.close()
        for g in gates.values():
            g.close()
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
            child.join()

    print(f"tp gate exchange, 2 processes on loopback ({where}), "
          f"{args.blocks} x {args.iters} timed exchanges per row, times in us")  # fmt: skip
    if args.arrive_last_us:
        print(
            f"rank 0 arrives last ({args.arrive_last_us:g} us of work before each exchange): "
            "its times are an exchange's own cost, nothing waited for"
        )
    print(f"{'gate':>7} {'transport':>9} {'p50':>8} {'p99':>8} {'p50/raw':>8}")
    ok = True
    results: dict[str, dict[str, float]] = {}
    for size in SIZES:
        base = float(np.percentile(times[(size, "raw")], 50))
        for name in ("raw", "tcp", "shm"):
            t = np.asarray(times[(size, name)]) / 1000
            p50, p99 = np.percentile(t, 50), np.percentile(t, 99)
            ratio = harness.ratio(p50 * 1000, base)
            verdict = ""
            if name == "tcp":
                passed = bool(ratio <= TARGET_RATIO)
                ok = ok and passed
                verdict = f"  {'PASS' if passed else 'FAIL'} (target <= {TARGET_RATIO:g}x)"
            print(f"{size:>7} {name:>9} {p50:8.1f} {p99:8.1f} {ratio:7.2f}x{verdict}")
            results[f"{size}_{name}"] = {
                "p50_us": float(p50),
                "p99_us": float(p99),
                "ratio": float(ratio),
            }
    print(f"child exit code {child.exitcode}; took {time.monotonic() - started:.1f} s")
    ok = ok and child.exitcode == 0
    harness.emit(
        "tp_gates",
        {"cores": pair[:2], "arrive_last_us": args.arrive_last_us, **results},
        ok,
        args.json,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
