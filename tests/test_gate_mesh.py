"""The gate exchange of a world of N ranks (``MeshGateExchange``: reduce-scatter, then
allgather, each chunk summed in rank order) over real sockets on 127.0.0.1 and real socket
pairs, every rank a thread of this process; one rank played by hand over raw sockets, byte for
byte as docs/protocol.md draws the frames.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from procs import missing
from test_gate_exchange import N_EMBD, gates_schedule, same_bits, tcp_pair
from tls_certs import make_certs

from foundry.transport.gates import GateError, MeshGateExchange, channel
from foundry.transport.gates.mesh import chunk_bounds
from foundry.transport.tls import PeerContexts, TlsFiles, peer_contexts_for, wrap_blocking
from foundry.wire.tp import GATE_HEADER, GATE_HEADER_SIZE, Gate

# -- N ranks over TCP --------------------------------------------------------------------------


# The clamp of a world's sockets under small_buffers: 64x below a 4 MiB prefill partial, so a
# "send all, then receive" loop would still deadlock. Not the pair's 4 KiB: with it, five ranks
# whose C loops (the GIL released) ran at once on two loaded cores crawled on loopback in about
# 1 run of 60 (a gate still moving bytes after 60 s; none in 100 runs at 64 KiB, nor of the
# Python loop at 4 KiB, which the GIL runs one rank at a time). A socket's default buffers are
# far larger.
MESH_BUFFER = 64 * 1024


def links(
    world: int,
    small_buffers: bool = False,
    peer_tls: PeerContexts | None = None,
    unix: bool = False,
) -> list[dict[int, socket.socket]]:
    """A connection between every two of ``world`` ranks, by rank: loopback TCP (under mutual
    TLS with ``peer_tls``, the lower rank accepting, as the workers do) or Unix socket pairs."""
    socks: list[dict[int, socket.socket]] = [{} for _ in range(world)]
    for i in range(world):
        for j in range(i + 1, world):
            a, b = socket.socketpair() if unix else tcp_pair(small_buffers, MESH_BUFFER)
            if peer_tls is not None:
                a, b = tls_pair(a, b, peer_tls)
            socks[i][j], socks[j][i] = a, b
    return socks


@pytest.fixture(params=["c", "python"], autouse=True)
def loop(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here runs twice: the plain sockets' loop in C (``_gates.c``; .ci/run builds
    it) and in Python, which TLS sockets always take."""
    if request.param == "c" and channel.native is None:
        missing("the C gate loop (foundry.transport.gates._gates) is not built")
    LOOP[0] = request.param
    yield request.param
    LOOP[0] = "c"


LOOP = ["c"]  # the running test's loop, which mesh() gives its exchanges


def mesh(
    world: int,
    small_buffers: bool = False,
    timeout_s: float = 2.0,
    peer_tls: PeerContexts | None = None,
    n_embd: int = N_EMBD,
    unix: bool = False,
) -> list[MeshGateExchange]:
    """A world of ``world`` ranks in this process over :func:`links`, moving bytes in the
    running test's loop."""
    socks = links(world, small_buffers, peer_tls, unix)
    gates = [
        MeshGateExchange(socks[r], rank=r, world=world, n_embd=n_embd, timeout_s=timeout_s)
        for r in range(world)
    ]
    assert all(g.native == (peer_tls is None) for g in gates)
    return in_loop(gates)


def in_loop(gates: list[MeshGateExchange]) -> list[MeshGateExchange]:
    """``gates`` set to move their bytes in the running test's loop."""
    for g in gates:
        g.native = LOOP[0] == "c" and g.native
    return gates


def tls_pair(
    accepted: socket.socket, dialed: socket.socket, peer_tls: PeerContexts
) -> tuple[socket.socket, socket.socket]:
    """Both ends of a connection after the TLS handshake, each side on its own thread."""
    server: list[socket.socket] = []
    t = threading.Thread(
        target=lambda: server.append(wrap_blocking(peer_tls.accept, accepted, server_side=True))
    )
    t.start()
    client = wrap_blocking(peer_tls.dial, dialed, server_side=False)
    t.join(10)
    assert server, "the accepting side's handshake failed"
    return server[0], client


@pytest.fixture(scope="module")
def peer_tls(tmp_path_factory: pytest.TempPathFactory) -> PeerContexts:
    d = tmp_path_factory.mktemp("certs")
    make_certs(d)
    contexts = peer_contexts_for(
        TlsFiles(d / "tp-worker.pem", d / "tp-worker-key.pem", d / "ca.pem")
    )
    assert contexts is not None
    return contexts


def run_world(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run one function per rank on its own thread; each one's result or exception."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except Exception as exc:  # handed back to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.parametrize(
    ("world", "tls"), [(3, False), (4, False), (3, True)], ids=["3", "4", "3-tls"]
)
def test_mesh_sums_in_rank_order_on_every_rank(
    world: int, tls: bool, request: pytest.FixtureRequest
) -> None:
    """Every rank gets ((p0 + p1) + p2) + ... bit for bit, the rows of a decode gate and of a
    4 MiB prefill partial through small socket buffers alike, over TCP and over TLS."""
    rng = np.random.default_rng(world)
    contexts = request.getfixturevalue("peer_tls") if tls else None
    gates = mesh(world, small_buffers=True, peer_tls=contexts)
    if tls:
        assert all(isinstance(ch.sock, ssl.SSLSocket) for g in gates for ch in g._channels.values())
    shapes = [(1, N_EMBD), (1024, N_EMBD), (3, N_EMBD)]
    parts = [
        [rng.standard_normal(shape).astype(np.float32) for shape in shapes] for _ in range(world)
    ]
    got = schedule_world(gates, parts)
    for k in range(len(shapes)):
        expected = parts[0][k] + parts[1][k]
        for r in range(2, world):
            expected = expected + parts[r][k]
        for r in range(world):
            assert same_bits(got[r][k], expected), (r, k)
    # Another order gives other bits somewhere (so the check above can fail).
    k = 1
    other = parts[world - 1][k] + parts[world - 2][k]
    for r in range(world - 3, -1, -1):
        other = other + parts[r][k]
    assert not same_bits(other, got[0][k])


def test_mesh_desync_and_a_dead_rank_are_named() -> None:
    gates = mesh(3, timeout_s=0.5)
    one = np.ones((1, N_EMBD), np.float32)
    results = run_world(
        [
            lambda: gates[0].exchange(0, Gate.ATTN, one),
            lambda: gates[1].exchange(0, Gate.ATTN, one),
            lambda: gates[2].exchange(0, Gate.FFN, one),
        ]
    )
    assert isinstance(results[0], GateError)
    assert "rank 2: gate desync: expected layer 0 gate ATTN" in str(results[0])
    for g in gates:
        g.close()
    gates = mesh(3, timeout_s=0.5)
    gates[2].close()  # rank 2 dies: both others fail at once, naming it
    t0 = time.monotonic()
    results = run_world([lambda g=g: g.exchange(0, Gate.ATTN, one) for g in gates[:2]])
    assert time.monotonic() - t0 < 0.45
    for res in results:
        assert isinstance(res, GateError) and "rank 2" in str(res)
    gates = mesh(3, timeout_s=0.3)
    results = run_world([lambda g=g: g.exchange(0, Gate.ATTN, one) for g in gates[:2]])
    for res in results:  # rank 2 alive and silent: a stall naming it
        assert isinstance(res, GateError) and "waiting for rank 2" in str(res), res
    for g in gates:
        g.close()


def test_mesh_needs_a_socket_to_every_other_rank() -> None:
    a, b = tcp_pair()
    with a, b, pytest.raises(ValueError, match=r"to every other rank, got ranks \[1\]"):
        MeshGateExchange({1: a}, rank=0, world=3, n_embd=N_EMBD)


def schedule_world(gates: list[MeshGateExchange], parts: list[list[np.ndarray]]) -> list[Any]:
    """Each rank's gates_schedule over its parts, the ranks on threads; the gates closed after."""
    try:
        return run_world(
            [lambda g=g, p=p: gates_schedule(g, p) for g, p in zip(gates, parts, strict=True)]
        )
    finally:
        for g in gates:
            g.close()


def rank_order_sum(parts: list[np.ndarray]) -> np.ndarray:
    acc = parts[0] + parts[1]
    for p in parts[2:]:
        acc = acc + p
    return acc


def test_chunks_cover_the_columns_in_order() -> None:
    assert chunk_bounds(1001, 4) == [(0, 250), (250, 500), (500, 750), (750, 1001)]
    assert chunk_bounds(3, 5) == [(0, 0), (0, 1), (1, 1), (1, 2), (2, 3)]
    for n_embd, world in [(1, 3), (7, 3), (1024, 4), (3072, 5), (4099, 8)]:
        bounds = chunk_bounds(n_embd, world)
        assert bounds[0][0] == 0 and bounds[-1][1] == n_embd
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        widths = [b - a for a, b in bounds]
        assert max(widths) - min(widths) <= 1


@pytest.mark.parametrize(
    ("world", "n_embd", "unix"),
    [(3, 1001, False), (4, 1001, False), (5, 1001, False), (5, 3, False), (4, 1001, True)],
    ids=["3", "4", "5", "5-n_embd-3", "4-socketpair"],
)
def test_chunked_sum_is_the_rank_order_sum(world: int, n_embd: int, unix: bool) -> None:
    """n_embd not divisible by N (and below N: empty chunks), a decode row, a few rows and a
    4 MiB prefill partial through clamped socket buffers: every rank holds the rank-order sum
    of the whole partials, bit for bit."""
    rng = np.random.default_rng(world * n_embd)
    gates = mesh(world, small_buffers=True, n_embd=n_embd, unix=unix)
    shapes = [(1, n_embd), (4 * 2**20 // (4 * n_embd) + 1, n_embd), (3, n_embd), (n_embd,)]
    parts = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(world)]
    got = schedule_world(gates, parts)
    assert parts[0][1].nbytes >= 4 * 2**20
    for k in range(len(shapes)):
        expected = rank_order_sum([parts[r][k] for r in range(world)])
        for r in range(world):
            assert not isinstance(got[r], BaseException), got[r]
            assert same_bits(got[r][k], expected), (r, k)


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "the rank closed"
        buf += chunk
    return bytes(buf)


def test_a_rank_played_by_hand_sees_the_documented_frames() -> None:
    """Rank 2 of 3 on raw blocking sockets, n_embd 4 (chunks [0, 1), [1, 2), [2, 4)): from
    rank q it reads the header, columns 2..3 of q's partial and q's sum of its own chunk; it
    sends q the header, its piece of chunk q and then its sum of chunk 2; all three hold the
    rank-order sum. At the next gate it closes its connection to rank 0 after the pieces:
    rank 0's error names rank 2 and the gate, and rank 1, which has everything, goes on."""
    socks = links(3)
    gates = in_loop(
        [MeshGateExchange(socks[r], rank=r, world=3, n_embd=4, timeout_s=2.0) for r in (0, 1)]
    )
    p = [np.array([[1, 2, 3, 4]], np.float32) * 10**r for r in range(3)]
    expected = rank_order_sum(p)
    heard: dict[int, bytes] = {}

    def rank2(gate: Gate, seq: int, hang_up: bool) -> np.ndarray:
        tag = GATE_HEADER.pack(0, gate, 0, seq, 1, 4)
        for q, (a, b) in [(0, (0, 1)), (1, (1, 2))]:
            socks[2][q].sendall(tag + p[2][:, a:b].tobytes())
        for q in (0, 1):
            heard[q] = _recv_exactly(socks[2][q], GATE_HEADER_SIZE + 4 * 2 + 4 * 1)
        if hang_up:
            socks[2][0].close()
        total = rank_order_sum([x[:, 2:4] for x in p])
        for q in (0, 1) if not hang_up else (1,):
            socks[2][q].sendall(total.tobytes())
        return total

    try:
        got = run_world(
            [
                lambda: gates[0].exchange(0, Gate.ATTN, p[0]),
                lambda: gates[1].exchange(0, Gate.ATTN, p[1]),
                lambda: rank2(Gate.ATTN, 1, hang_up=False),
            ]
        )
        tag = bytes.fromhex("0000000001000000000000000100000004000000")  # layer 0 ATTN seq 1
        assert heard[0] == tag + bytes.fromhex("00004040 00008040 0000de42")  # 3, 4; 111
        assert heard[1] == tag + bytes.fromhex("0000f041 00002042 00005e43")  # 30, 40; 222
        assert same_bits(got[0], expected) and same_bits(got[1], expected)
        assert same_bits(got[2], expected[:, 2:4])
        got = run_world(
            [
                lambda: gates[0].exchange(0, Gate.FFN, p[0]),
                lambda: gates[1].exchange(0, Gate.FFN, p[1]),
                lambda: rank2(Gate.FFN, 2, hang_up=True),
            ]
        )
    finally:
        for g in gates:
            g.close()
        for s in socks[2].values():
            s.close()
    assert isinstance(got[0], GateError), got[0]
    assert "rank 2" in str(got[0]) and "layer 0 gate FFN seq 2" in str(got[0]), got[0]
    assert same_bits(got[1], expected)
