"""The gate of a world of N ranks: chunked (the services'), all-to-all, a star and a ring, measured
in one run; and the services' gates with their loop in C against the same loop in Python.

N processes on loopback (rank 0 this process), a TCP connection between every two. Each rank
holds a partial of ``rows`` x n_embd float32 and every rank must end with the N partials added
in rank order, ``((p0 + p1) + p2) + ...``, bit for bit the same (checked after every gate).
Four ways to get there, interleaved in blocks so that drift of the machine hits them alike:

- **chunked** (what the services run, ``transport.gates.MeshGateExchange``): reduce-scatter
  then allgather in rank order. The n_embd columns are cut into N chunks, rank r owning chunk
  r; each rank sends chunk c of its partial to rank c, adds the N pieces of its own chunk in
  rank order (the same bits as adding whole partials), and sends that sum to every other rank;
  one poll loop, two hops. Each rank sends and receives 2(N-1)/N partials a gate. On plain
  sockets that loop runs in C (``transport/gates/_gates.c``, the GIL released).
- **chunked in Python**: the same exchange with the loop in Python (``native = False``: what
  TLS sockets run, and what plain ones ran before the C loop); at N = 2 the pair's gate in
  Python. Its p50 over chunked's is what the C loop saves a gate.
- **all-to-all** (what the services ran before, ``AllToAll`` here: the same poll loop, one
  step): each rank sends its partial to every other and reads theirs; one hop. Each rank sends
  and receives (N-1) partials a gate.
- **star**: each worker sends its partial to rank 0, which adds the N in rank order and sends
  the sum back; two hops. A worker sends and receives one partial, rank 0 (N-1) each way.
- **ring** (allgather): N-1 steps, in each every rank passes one partial to the next rank
  and takes one from the one before, then every rank adds the N in rank order; N-1 hops. Each
  rank sends and receives (N-1) partials. (A reduce-scatter ring moves less but adds in an
  order that depends on the rank: not bit-identical.)

Baseline: the pair's gate (N = 2, ``TcpGateExchange``) in the same run, on the same cores;
the table gives each N's p50 per gate over it, and chunked, star and ring over all-to-all. With
``--tls``, a fifth kind, **chunked over TLS**: the services' exchange on a second set of
connections under mutual TLS (certificates from ``foundry certs``, made for the run; the
lower rank accepts, as a world's workers do), interleaved with the others, and its p50 over
plain chunked (the pair: ``TcpGateExchange`` over TLS against plain). On one host
the ranks share its cores (2 of them here, shared with others), so loopback shows the cost of
the extra hops and system calls, not a network's: a hop on a 1 Gb/s LAN adds ~60 us of wire
time for a 4 KiB decode partial.

``--rate 1gbit`` (as root, with ``ip`` and ``tc``; ``--ip``/``--tc`` or ``FOUNDRY_IP``/
``FOUNDRY_TC`` name them) puts each rank in a network namespace of its own behind one bridge,
every port shaped both ways by ``tc tbf`` to the rate (``lan_net.Network``, as the swarm's LAN
bench), so every gate crosses a shaped link as it would between machines: each rank is a
process that enters its namespace, listens on its address, dials the ranks below it and takes
the connections of the ranks above; the pair's baseline crosses the same link. Without it,
loopback in one namespace. tbf lets a burst pass at the veth's speed (``lan_net.Network``: 10 ms
at the rate, at least 96 KiB for the veth's 64 KiB segments), so a decode partial of a few KB
would cross unpaced; ``--burst-bytes`` (3028 in the device command: two frames) caps the
segments at one frame (``gso_max_size 1500``) and shapes every port with that burst, so each
partial takes its wire time at the rate (4 KiB: 33 us at 1 Gb/s), as on a LAN.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/performance/tp_world_gates.py [--worlds 3,4]
        [--rows 1] [--n-embd 1024] [--gates 400] [--block 50] [--tcp-spin-us US]
        [--rate 1gbit [--burst-bytes 3028] [--ip ip] [--tc tc] | --tls] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing as mp
import select
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
from lan_net import Network, add_shaped_flags
from tp import enter_netns

from foundry.cli import main as cli_main
from foundry.model.shard.table import Gate
from foundry.transport import gates
from foundry.transport.gates import GateExchange, MeshGateExchange, TcpGateExchange
from foundry.transport.gates.mesh import chunk_bounds
from foundry.transport.tls import TlsFiles, peer_contexts_for, wrap_blocking

KINDS = ("all-to-all", "chunked", "chunked-python", "star", "ring")
PY_KIND = "chunked-python"
TLS_KIND = "chunked tls"


def _pairs(world: int) -> list[dict[int, socket.socket]]:
    socks: list[dict[int, socket.socket]] = [{} for _ in range(world)]
    for i in range(world):
        for j in range(i + 1, world):
            with socket.create_server(("127.0.0.1", 0)) as server:
                a = socket.create_connection(server.getsockname())
                b, _ = server.accept()
            for s in (a, b):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks[i][j], socks[j][i] = a, b
    return socks


def _transfer(
    sends: list[tuple[socket.socket, memoryview]], recvs: list[tuple[socket.socket, memoryview]]
) -> None:
    """Send and receive all of these buffers at once, one poll loop (no deadlock on any size)."""
    out = [[s, v, 0] for s, v in sends]
    into = [[s, v, 0] for s, v in recvs]
    for s, _ in [*sends, *recvs]:
        s.setblocking(False)
    while any(o[2] < len(o[1]) for o in out) or any(i[2] < len(i[1]) for i in into):
        moved = False
        for o in out:
            if o[2] < len(o[1]):
                try:
                    n = o[0].send(o[1][o[2] :])
                except BlockingIOError:
                    n = 0
                o[2] += n
                moved = moved or n > 0
        for i in into:
            if i[2] < len(i[1]):
                try:
                    n = i[0].recv_into(i[1][i[2] :])
                except BlockingIOError:
                    n = -1
                if n == 0:
                    raise ConnectionError("peer closed")
                if n > 0:
                    i[2] += n
                    moved = True
        if not moved:
            rl = [i[0] for i in into if i[2] < len(i[1])]
            wl = [o[0] for o in out if o[2] < len(o[1])]
            select.select(rl, wl, [], 1.0)


def _tls_links(
    socks: dict[int, socket.socket], rank: int, world: int, certs: Path
) -> dict[int, socket.socket]:
    """Copies of ``socks`` under mutual TLS, the lower rank of each two accepting. Every rank
    takes its handshakes in one global order of the pairs, so none waits on another's."""
    ctx = peer_contexts_for(
        TlsFiles(certs / "tp-worker.pem", certs / "tp-worker-key.pem", certs / "ca.pem")
    )
    assert ctx is not None
    out: dict[int, socket.socket] = {}
    for i, j in itertools.combinations(range(world), 2):
        if rank in (i, j):
            peer = j if rank == i else i
            out[peer] = wrap_blocking(
                ctx.accept if rank == i else ctx.dial, socks[peer].dup(), server_side=rank == i
            )
    return out


class AllToAll(MeshGateExchange):
    """The services' world gate before chunking: the same poll loop (``MeshGateExchange._move``)
    in one step, header + the whole partial to every peer, then the N partials added in rank
    order."""

    def _sum(self, tag: bytes, mine: np.ndarray) -> np.ndarray:
        peers = {p: np.empty_like(mine) for p in self._channels}
        outs = {p: [memoryview(tag), mine.data.cast("B")] for p in self._channels}
        ins = {p: [memoryview(self._tags[p]), peers[p].data.cast("B")] for p in self._channels}
        self._move(tag, outs, ins, lambda: None)
        return _rank_order_sum([mine if r == self.rank else peers[r] for r in range(self.world)])


def _gate(
    socks: dict[int, socket.socket], rank: int, world: int, n_embd: int, kind: str = "chunked"
) -> GateExchange:
    """An exchange over ``socks``: the pair's own gate at N = 2 (what the services run there),
    else ``kind`` (chunked: the services' ``MeshGateExchange``); PY_KIND with its loop in
    Python."""
    g: TcpGateExchange | MeshGateExchange
    if world == 2:
        g = TcpGateExchange(socks[1 - rank], rank=rank, n_embd=n_embd, timeout_s=30.0)
    else:
        cls = AllToAll if kind == "all-to-all" else MeshGateExchange
        g = cls(socks, rank=rank, world=world, n_embd=n_embd, timeout_s=30.0)
    if kind == PY_KIND:
        g.native = False
    return g


def _rank_order_sum(parts: list[np.ndarray]) -> np.ndarray:
    acc = parts[0] + parts[1]
    for p in parts[2:]:
        np.add(acc, p, out=acc)
    return acc


class Star:
    def __init__(self, socks: dict[int, socket.socket], rank: int, world: int, size: int):
        self.socks, self.rank, self.world = socks, rank, world
        self.bufs = {r: np.empty(size, np.float32) for r in range(world)}

    def exchange(self, mine: np.ndarray) -> np.ndarray:
        flat = mine.reshape(-1)
        if self.rank:
            total = self.bufs[0]
            _transfer([(self.socks[0], memoryview(flat).cast("B"))], [])
            _transfer([], [(self.socks[0], memoryview(total).cast("B"))])
            return total
        _transfer(
            [], [(self.socks[r], memoryview(self.bufs[r]).cast("B")) for r in range(1, self.world)]
        )
        total = _rank_order_sum([flat, *(self.bufs[r] for r in range(1, self.world))])
        _transfer([(self.socks[r], memoryview(total).cast("B")) for r in range(1, self.world)], [])
        return total


class Ring:
    def __init__(self, socks: dict[int, socket.socket], rank: int, world: int, size: int):
        self.rank, self.world = rank, world
        self.next, self.prev = socks[(rank + 1) % world], socks[(rank - 1) % world]
        self.bufs = [np.empty(size, np.float32) for _ in range(world)]

    def exchange(self, mine: np.ndarray) -> np.ndarray:
        r, n = self.rank, self.world
        self.bufs[r][:] = mine.reshape(-1)
        for k in range(n - 1):
            send, take = (r - k) % n, (r - k - 1) % n
            _transfer(
                [(self.next, memoryview(self.bufs[send]).cast("B"))],
                [(self.prev, memoryview(self.bufs[take]).cast("B"))],
            )
        return _rank_order_sum(self.bufs)


def _schedule(gates: int, block: int, kinds: tuple[str, ...]) -> list[str]:
    """Each kind ``gates`` times, in blocks of ``block`` (at most ``gates``, so every kind
    gets its share however few the gates)."""
    block = max(1, min(block, gates))
    out: list[str] = []
    while len(out) < len(kinds) * gates:
        for kind in kinds:
            out += [kind] * block
    return out[: len(kinds) * gates]


def _parts(rank: int, rows: int, n_embd: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [np.ascontiguousarray(rng.standard_normal((rows, n_embd)), np.float32) for _ in range(8)]


def _run_rank(
    conn: Connection | None,
    rank: int,
    world: int,
    socks: dict[int, socket.socket],
    rows: int,
    n_embd: int,
    gates: int,
    block: int,
    tls_socks: dict[int, socket.socket] | None,
    certs: Path | None,
) -> dict[str, list[float]]:
    size = rows * n_embd
    mesh = {
        k: _gate({r: s.dup() for r, s in socks.items()}, rank, world, n_embd, k)
        for k in ("all-to-all", "chunked", PY_KIND)
    }
    secure = None
    if tls_socks is not None and certs is not None:
        tls_links = _tls_links(tls_socks, rank, world, certs)
        secure = _gate(tls_links, rank, world, n_embd)
    kinds = KINDS if secure is None else (*KINDS, TLS_KIND)
    star, ring = Star(socks, rank, world, size), Ring(socks, rank, world, size)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    parts = _parts(rank, rows, n_embd)
    # Every rank's partials are known from their seeds: the rank-order sums to check against.
    everyone = [_parts(r, rows, n_embd) for r in range(world)]
    expected = [
        _rank_order_sum([everyone[r][j].reshape(-1) for r in range(world)])
        for j in range(len(parts))
    ]
    for i, kind in enumerate(_schedule(gates, block, kinds)):
        mine = parts[i % len(parts)]
        t0 = time.perf_counter()
        if kind in mesh:
            total = mesh[kind].exchange(i % 65536, Gate.ATTN, mine)
        elif kind == TLS_KIND:
            assert secure is not None
            total = secure.exchange(i % 65536, Gate.ATTN, mine)
        elif kind == "star":
            total = star.exchange(mine)
        else:
            total = ring.exchange(mine)
        times[kind].append(time.perf_counter() - t0)
        if not np.array_equal(np.asarray(total).reshape(-1), expected[i % len(parts)]):
            raise AssertionError(
                f"rank {rank}: the {kind} sum of gate {i} is not the rank-order sum"
            )
    if conn is not None:
        conn.send(times)
    return times


def _child(
    conn: Connection,
    rank: int,
    world: int,
    socks: dict[int, socket.socket],
    rows: int,
    n_embd: int,
    gates: int,
    block: int,
    tls_socks: dict[int, socket.socket] | None,
    certs: Path | None,
) -> None:
    _run_rank(conn, rank, world, socks, rows, n_embd, gates, block, tls_socks, certs)


GATE_PORT = 7190


def _netns_rank(
    conn: Connection,
    net: Network,
    rank: int,
    world: int,
    rows: int,
    n_embd: int,
    gates: int,
    block: int,
) -> None:
    """A rank in its own namespace: listen, say so, dial the ranks below once told to, take
    the ranks above (each connection's first byte is its rank), then run the gates."""
    enter_netns(f"/var/run/netns/{net.ns(rank)}")
    socks: dict[int, socket.socket] = {}
    with socket.create_server((net.addr(rank), GATE_PORT), backlog=world) as server:
        conn.send("listening")
        conn.recv()  # every rank listens
        for low in range(rank):
            s = socket.create_connection((net.addr(low), GATE_PORT), timeout=30)
            s.sendall(bytes([rank]))
            socks[low] = s
        server.settimeout(30)
        while len(socks) < world - 1:
            s, _ = server.accept()
            socks[s.recv(1)[0]] = s
    for s in socks.values():
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _run_rank(conn, rank, world, socks, rows, n_embd, gates, block, None, None)


def measure_netns(
    net: Network, world: int, rows: int, n_embd: int, gates: int, block: int
) -> dict[str, float]:
    """:func:`measure` with every rank in its namespace across the shaped link."""
    ctx = mp.get_context("fork")
    ranks = []
    for r in range(world):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_netns_rank, args=(b, net, r, world, rows, n_embd, gates, block))
        p.start()
        ranks.append((p, a))
    for p, a in ranks:
        if not a.poll(60):
            raise SystemExit(f"a rank did not listen within 60 s (exit {p.exitcode})")
        a.recv()
    for _, a in ranks:
        a.send("dial")
    times: dict[str, list[float]] = ranks[0][1].recv()
    for _, a in ranks[1:]:
        a.recv()
    for p, _ in ranks:
        p.join(30)
    return {k: harness.median(v) * 1e6 for k, v in times.items() if v}


def measure(
    world: int, rows: int, n_embd: int, gates: int, block: int, certs: Path | None = None
) -> dict[str, float]:
    socks = _pairs(world)
    tls_socks = _pairs(world) if certs is not None else [None] * world
    ctx = mp.get_context("fork")
    children = []
    for r in range(1, world):
        a, b = ctx.Pipe()
        p = ctx.Process(
            target=_child,
            args=(b, r, world, socks[r], rows, n_embd, gates, block, tls_socks[r], certs),
        )
        p.start()
        children.append((p, a))
    times = _run_rank(None, 0, world, socks[0], rows, n_embd, gates, block, tls_socks[0], certs)
    for p, a in children:
        a.recv()
        p.join(30)
    for d in [*socks, *tls_socks]:
        for s in (d or {}).values():
            s.close()
    return {k: harness.median(v) * 1e6 for k, v in times.items() if v}


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--worlds", default="3,4", help="world sizes besides the pair (default 3,4)")
    ap.add_argument("--rows", type=int, default=1, help="rows a gate (1: decode; default 1)")
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--gates", type=int, default=400, help="gates per kind (default 400)")
    ap.add_argument("--block", type=int, default=50, help="gates per block of one kind")
    ap.add_argument(
        "--tcp-spin-us",
        type=float,
        default=None,
        help="the TCP gates' spin before they sleep in poll (default: the "
        "services' own, transport.gates.TCP_SPIN_S)",
    )
    add_shaped_flags(ap)
    ap.add_argument(
        "--tls",
        action="store_true",
        help="also all-to-all (the pair: its gate) over mutual TLS, interleaved",
    )
    harness.add_json_flag(ap)
    a = ap.parse_args()
    if a.tls and a.rate != "loopback":
        ap.error("--tls measures on loopback; leave out --rate")
    if a.tcp_spin_us is not None:
        gates.tcp.TCP_SPIN_S = gates.mesh.TCP_SPIN_S = a.tcp_spin_us * 1e-6
    with contextlib.ExitStack() as stack:
        certs = None
        if a.tls:
            certs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            with contextlib.redirect_stdout(sys.stderr):
                assert cli_main(["certs", "--out", str(certs)]) == 0
        return _run(a, certs)


def _run(a: argparse.Namespace, certs: Path | None) -> int:
    worlds = [int(w) for w in a.worlds.split(",")]
    partial = a.rows * a.n_embd * 4
    net = Network(max([2, *worlds]), a.rate, a.ip, a.tc)
    where = (
        "loopback"
        if not net.shaped
        else f"each rank in a namespace, every port tbf-shaped to {a.rate}"
        + (f", burst {a.burst_bytes} bytes, 1500-byte segments" if a.burst_bytes else "")
    )
    print(
        f"gate of {a.rows} x {a.n_embd} float32 ({partial} bytes a partial), "
        f"{a.gates} gates a kind, rank 0's p50 in us; {where}, 1 thread a rank, "
        f"{len(worlds) + 1} world sizes"
    )

    def run(world: int) -> dict[str, float]:
        if net.shaped:
            return measure_netns(net, world, a.rows, a.n_embd, a.gates, a.block)
        return measure(world, a.rows, a.n_embd, a.gates, a.block, certs)

    net.up()
    try:
        if net.shaped and a.burst_bytes:
            net.pace(a.burst_bytes)
        return report(a, worlds, partial, run, certs)
    finally:
        net.down()


def chunked_bytes_out(world: int, rows: int, n_embd: int) -> int:
    """Rank 0's bytes a chunked gate: to each peer p a header, chunk p of its partial and the
    sum of chunk 0."""
    bounds = chunk_bounds(n_embd, world)
    own = bounds[0][1] - bounds[0][0]
    return sum(20 + 4 * rows * (b - a + own) for a, b in bounds[1:])


def report(
    a: argparse.Namespace,
    worlds: list[int],
    partial: int,
    run: Callable[[int], dict[str, float]],
    certs: Path | None,
) -> int:
    pair = run(2)
    base = pair["all-to-all"]
    results: dict[str, object] = {
        "threads_per_rank": 1,
        "clients": 0,
        "partial_bytes": partial,
        "pair_p50_us": base,
        "rate": a.rate,
        "burst_bytes": a.burst_bytes,
    }
    results["pair_python_p50_us"] = pair[PY_KIND]
    tls_head = f" {'tls':>9} {'tls/plain':>9}" if certs else ""
    print(
        f"{'N':>3} {'all-to-all':>11} {'chunked':>9} {'star':>9} {'ring':>9} {'a2a/pair':>9} "
        f"{'chunk/a2a':>9} {'star/a2a':>9} {'ring/a2a':>9} {'a2a bytes':>10} "
        f"{'chunk bytes':>11} {'in Python':>9} {'C/Python':>8}{tls_head}"
    )

    def tls_cells(m: dict[str, float], plain: str) -> str:
        if not certs:
            return ""
        return f" {m[TLS_KIND]:>9.1f} {m[TLS_KIND] / m[plain]:>9.2f}"

    if certs:
        results["pair_tls_p50_us"] = pair[TLS_KIND]
    print(
        f"{2:>3} {base:>11.1f} {'':>9} {'':>9} {'':>9} {1.0:>9.2f} {'':>9} {'':>9} {'':>9} "
        f"{partial + 20:>10} {partial + 20:>11} {pair[PY_KIND]:>9.1f} "
        f"{base / pair[PY_KIND]:>8.2f}{tls_cells(pair, 'all-to-all')}"
    )
    for w in worlds:
        m = run(w)
        a2a = m["all-to-all"]
        results[f"world_{w}_p50_us"] = m
        results[f"world_{w}_bytes_out_rank0"] = {
            "all-to-all": (w - 1) * (partial + 20),
            "chunked": chunked_bytes_out(w, a.rows, a.n_embd),
        }
        print(
            f"{w:>3} {a2a:>11.1f} {m['chunked']:>9.1f} {m['star']:>9.1f} {m['ring']:>9.1f} "
            f"{a2a / base:>9.2f} {m['chunked'] / a2a:>9.2f} {m['star'] / a2a:>9.2f} "
            f"{m['ring'] / a2a:>9.2f} {(w - 1) * (partial + 20):>10} "
            f"{chunked_bytes_out(w, a.rows, a.n_embd):>11} {m[PY_KIND]:>9.1f} "
            f"{m['chunked'] / m[PY_KIND]:>8.2f}{tls_cells(m, 'chunked')}"
        )
    harness.emit("tp_world_gates", results, None, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
