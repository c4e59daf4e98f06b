"""The gate exchange over real sockets on 127.0.0.1 and over a real shared-memory slab.

Both ranks run as two threads of this process (and, once per transport, as two processes),
so every byte crosses a kernel socket or a mapped file exactly as in production.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from procs import missing, wait_for

from foundry.transport.gates import (
    GateError,
    GateExchange,
    ShmGateExchange,
    TcpGateExchange,
    local_host_id,
)
from foundry.wire.tp import (
    Gate,
    GateHeader,
    GateTransport,
    Hello,
    Identity,
    Role,
    negotiate_gate_transport,
)

N_EMBD = 1024
SMALL_BUFFER = 4096  # the kernel doubles it and clamps it at its minimum: a few KiB


def tcp_pair(
    small_buffers: bool = False, size: int = SMALL_BUFFER
) -> tuple[socket.socket, socket.socket]:
    """A connected loopback pair; with ``small_buffers`` each side's buffers clamped to
    ``size``."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if small_buffers:
            for s in (server, client):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
        client.connect(server.getsockname())
        accepted, _ = server.accept()
    if small_buffers:
        for s in (accepted, client):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    return accepted, client


@contextlib.contextmanager
def exchanges(
    kind: str, *, timeout_s: float = 1.0, first_seq: tuple[int, int] = (1, 1), small: bool = False
) -> Iterator[tuple[GateExchange, GateExchange]]:
    if kind.startswith("tcp"):
        a, b = tcp_pair(small)
        tcp = (
            TcpGateExchange(a, rank=0, n_embd=N_EMBD, timeout_s=timeout_s, first_seq=first_seq[0]),
            TcpGateExchange(b, rank=1, n_embd=N_EMBD, timeout_s=timeout_s, first_seq=first_seq[1]),
        )
        for g in tcp:
            loop_in(g, kind)
        pair: tuple[GateExchange, GateExchange] = tcp
    else:
        leader = ShmGateExchange.create(
            n_embd=N_EMBD, timeout_s=timeout_s, first_seq=first_seq[0], checksum=kind == "shm-crc"
        )
        worker = ShmGateExchange.attach(
            leader.name, n_embd=N_EMBD, timeout_s=timeout_s, first_seq=first_seq[1]
        )
        pair = (leader, worker)
    try:
        yield pair
    finally:
        for g in pair:
            g.close()


def run_pair(f0: Callable[[], Any], f1: Callable[[], Any]) -> tuple[list[Any], list[Any]]:
    """Run rank 0 here and rank 1 in a thread; (results, exceptions) per rank."""
    results: list[Any] = [None, None]
    errors: list[Any] = [None, None]

    def wrap(i: int, f: Callable[[], Any]) -> None:
        try:
            results[i] = f()
        except Exception as exc:
            errors[i] = exc

    thread = threading.Thread(target=wrap, args=(1, f1))
    thread.start()
    wrap(0, f0)
    thread.join(10)
    assert not thread.is_alive()
    return results, errors


def gates_schedule(g: GateExchange, parts: list[np.ndarray]) -> list[np.ndarray]:
    n_layer = len(parts) // 2
    return [g.exchange(i // 2 % n_layer, Gate(i % 2), p) for i, p in enumerate(parts)]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# "shm-crc": the checksummed slab that weakly ordered machines (arm64, armv7) use.
# "tcp": the loop in C where plain sockets let it (``_gates.c``), "tcp-python": the Python loop
# it stands for, which TLS sockets take.
KINDS = ["tcp", "tcp-python", "shm", "shm-crc"]


def loop_in(g: TcpGateExchange, kind: str) -> None:
    """Make ``g`` move its bytes as ``kind`` says; "tcp" needs the C module (built by .ci/run)."""
    if kind == "tcp-python":
        g.native = False
    elif not g.native:
        missing("the C gate loop (foundry.transport.gates._gates) is not built")


@pytest.mark.parametrize("kind", KINDS)
def test_decode_gates_bit_identical_on_both_ranks(kind: str) -> None:
    rng = np.random.default_rng(0)
    shapes = [(N_EMBD,), (1, N_EMBD), (8, N_EMBD)] * 6
    p0 = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    p1 = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    with exchanges(kind) as (g0, g1):
        (r0, r1), errors = run_pair(lambda: gates_schedule(g0, p0), lambda: gates_schedule(g1, p1))
        assert errors == [None, None]
        assert g0.seq == g1.seq == 1 + len(shapes)
    for a, b, x, y in zip(r0, r1, p0, p1, strict=True):
        assert same_bits(a, b)
        assert same_bits(a, x + y) and same_bits(b, y + x)


@pytest.mark.parametrize("kind", KINDS)
def test_4mib_prefill_partial_with_small_socket_buffers(kind: str) -> None:
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal((1024, N_EMBD), dtype=np.float32)  # 4 MiB
    p1 = rng.standard_normal((1024, N_EMBD), dtype=np.float32)
    with exchanges(kind, small=True) as (g0, g1):
        # A deadlock would show as a GateError ("peer stalled": no byte moved for timeout_s).
        (r0, r1), errors = run_pair(
            lambda: g0.exchange(5, Gate.FFN, p0), lambda: g1.exchange(5, Gate.FFN, p1)
        )
        assert errors == [None, None]
        # the buffers really were small: far below one partial
        if kind.startswith("tcp"):
            assert isinstance(g0, TcpGateExchange)
            assert g0._channel.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < 64 * 1024
        # and the link keeps working after a big gate (a decode gate follows a prefill)
        (s0, s1), errors = run_pair(
            lambda: g0.exchange(0, Gate.ATTN, p0[0]), lambda: g1.exchange(0, Gate.ATTN, p1[0])
        )
        assert errors == [None, None]
    assert same_bits(r0, r1) and same_bits(r0, p0 + p1)
    assert same_bits(s0, s1) and same_bits(s0, p0[0] + p1[0])


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_gate_is_a_desync_naming_both_tags(kind: str) -> None:
    x = np.ones(N_EMBD, dtype=np.float32)
    with exchanges(kind) as (g0, g1):
        _, errors = run_pair(
            lambda: g0.exchange(3, Gate.FFN, x), lambda: g1.exchange(3, Gate.ATTN, x)
        )
    assert isinstance(errors[0], GateError)
    assert "expected layer 3 gate FFN seq 1 (1 x 1024), peer sent layer 3 gate ATTN seq 1" in str(
        errors[0]
    )
    # rank 1 either saw the same desync or, when rank 0 closed first, a closed peer
    assert isinstance(errors[1], GateError)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_layer_and_wrong_seq_are_desyncs(kind: str) -> None:
    x = np.ones((2, N_EMBD), dtype=np.float32)
    with exchanges(kind) as (g0, g1):
        _, errors = run_pair(
            lambda: g0.exchange(2, Gate.ATTN, x), lambda: g1.exchange(4, Gate.ATTN, x)
        )
    assert "expected layer 2 gate ATTN seq 1 (2 x 1024), peer sent layer 4" in str(errors[0])
    with exchanges(kind, first_seq=(17, 18)) as (g0, g1):
        _, errors = run_pair(
            lambda: g0.exchange(2, Gate.ATTN, x), lambda: g1.exchange(2, Gate.ATTN, x)
        )
    assert "expected layer 2 gate ATTN seq 17 (2 x 1024), peer sent layer 2 gate ATTN seq 18" in (
        str(errors[0])
    )


@pytest.mark.parametrize("kind", KINDS)
def test_stalled_peer_raises_within_the_deadline_then_stays_failed(kind: str) -> None:
    x = np.ones(N_EMBD, dtype=np.float32)
    timeout_s = 0.5
    with exchanges(kind, timeout_s=timeout_s) as (g0, _g1):
        outcome: list[BaseException] = []

        def stall() -> None:
            try:
                g0.exchange(0, Gate.ATTN, x)
            except BaseException as exc:
                outcome.append(exc)

        start = time.monotonic()
        thread = threading.Thread(target=stall, daemon=True)
        thread.start()
        # It fails by itself (no hang), and not before its deadline.
        wait_for(lambda: not thread.is_alive(), 20 * timeout_s, "the stalled gate to fail")
        assert time.monotonic() - start >= timeout_s
        assert isinstance(outcome[0], GateError) and "peer stalled" in str(outcome[0])
        with pytest.raises(GateError, match="failed earlier"):
            g0.exchange(0, Gate.ATTN, x)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_rank_makes_its_peer_fail_fast(kind: str) -> None:
    x = np.ones(N_EMBD, dtype=np.float32)
    # The deadline is far away: failing at all, with "closed", is failing on the close.
    with exchanges(kind, timeout_s=30.0) as (g0, g1):
        g1.close()
        with pytest.raises(GateError, match="closed"):
            g0.exchange(0, Gate.ATTN, x)


@pytest.mark.parametrize("kind", ["tcp", "tcp-python"])
def test_tcp_peer_closing_mid_gate_raises_at_once(kind: str) -> None:
    a, b = tcp_pair()
    x = np.ones((4, N_EMBD), dtype=np.float32)
    with TcpGateExchange(a, rank=0, n_embd=N_EMBD, timeout_s=30.0) as g0, b:
        loop_in(g0, kind)
        b.sendall(GateHeader(0, Gate.ATTN, 1, 4, N_EMBD).encode() + bytes(1000))
        b.close()
        with pytest.raises(GateError, match=r"peer closed .* \(received 1020 of 16404 bytes\)"):
            g0.exchange(0, Gate.ATTN, x)


@pytest.mark.parametrize("kind", ["tcp", "tcp-python"])
def test_tcp_garbage_tag_is_reported(kind: str) -> None:
    a, b = tcp_pair()
    x = np.ones(N_EMBD, dtype=np.float32)
    with TcpGateExchange(a, rank=0, n_embd=N_EMBD) as g0, b:
        loop_in(g0, kind)
        b.sendall(b"\xff" * 20)
        with pytest.raises(GateError, match="peer sent garbage"):
            g0.exchange(0, Gate.ATTN, x)


def test_partials_are_checked() -> None:
    a, b = tcp_pair()
    with TcpGateExchange(a, rank=0, n_embd=N_EMBD) as g0, b:
        with pytest.raises(ValueError, match="float32"):
            g0.exchange(0, Gate.ATTN, np.ones(N_EMBD))
        with pytest.raises(ValueError, match=r"shape \(rows, 1024\)"):
            g0.exchange(0, Gate.ATTN, np.ones(8, dtype=np.float32))
        with pytest.raises(ValueError, match="out of range"):
            g0.exchange(1 << 16, Gate.ATTN, np.ones(N_EMBD, dtype=np.float32))
    with pytest.raises(GateError, match="closed"):
        g0.exchange(0, Gate.ATTN, np.ones(N_EMBD, dtype=np.float32))


def test_slab_file_lifecycle() -> None:
    x = np.ones(N_EMBD, dtype=np.float32)
    leader = ShmGateExchange.create(n_embd=N_EMBD)
    path = leader.path
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        with pytest.raises(GateError, match="expected"):
            ShmGateExchange.attach(leader.name, n_embd=512)
        worker = ShmGateExchange.attach(leader.name, n_embd=N_EMBD)
        with pytest.raises(GateError, match="already has a rank 1"):
            ShmGateExchange.attach(leader.name, n_embd=N_EMBD)
        run_pair(lambda: leader.exchange(0, Gate.ATTN, x), lambda: worker.exchange(0, Gate.ATTN, x))
        assert not os.path.exists(path)  # unlinked once the peer was seen
        worker.close()
    finally:
        leader.close()
    assert not os.path.exists(path)
    unused = ShmGateExchange.create(n_embd=N_EMBD)
    unused.close()  # a slab nobody attached to is removed on close
    assert not os.path.exists(unused.path)
    forgotten = ShmGateExchange.create(n_embd=N_EMBD)
    path = forgotten.path
    del forgotten  # never closed: removed when collected (or at interpreter exit)
    gc.collect()
    assert not os.path.exists(path)
    with pytest.raises(GateError, match="cannot open"):
        ShmGateExchange.attach("foundry-tp-no-such-slab", n_embd=N_EMBD)
    with pytest.raises(ValueError, match="bare file name"):
        ShmGateExchange.attach("../etc/passwd", n_embd=N_EMBD)


def test_negotiation_on_this_host_picks_the_slab() -> None:
    host = local_host_id()
    assert len(host) == 16 and any(host)
    assert local_host_id() == host
    identity = Identity(
        gguf_bytes=1, model_id=1, n_layer=2, n_embd=N_EMBD, n_vocab=259, quant_bits=32,
        ctx_size=64,
    )  # fmt: skip
    with ShmGateExchange.create(n_embd=N_EMBD) as slab:
        leader = Hello(
            role=Role.LEADER, identity=identity, host_id=host, shm_offered=True, shm_name=slab.name
        )
        worker = Hello(role=Role.WORKER, identity=identity, host_id=host, shm_offered=True)
        assert negotiate_gate_transport(leader, worker) is GateTransport.SHM


# -- two processes ---------------------------------------------------------------------------


def _rank1_process(conn: Connection, kind: str, where: str | int, parts: list[np.ndarray]) -> None:
    if kind.startswith("tcp"):
        assert isinstance(where, int)
        sock = socket.create_connection(("127.0.0.1", where))
        g: GateExchange = TcpGateExchange(sock, rank=1, n_embd=N_EMBD)
        loop_in(g, kind)
    else:
        assert isinstance(where, str)
        g = ShmGateExchange.attach(where, n_embd=N_EMBD)
    with g:
        conn.send(gates_schedule(g, parts))
    conn.close()


@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_bit_identical(kind: str) -> None:
    rng = np.random.default_rng(2)
    shapes = [(N_EMBD,), (8, N_EMBD), (600, N_EMBD)] * 2
    p0 = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    p1 = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    with contextlib.ExitStack() as stack:
        stack.enter_context(parent)
        if kind.startswith("tcp"):
            server = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            where: str | int = server.getsockname()[1]
        else:
            slab = stack.enter_context(
                ShmGateExchange.create(n_embd=N_EMBD, timeout_s=20.0, checksum=kind == "shm-crc")
            )
            where = slab.name
        proc = ctx.Process(target=_rank1_process, args=(child, kind, where, p1))
        proc.start()
        child.close()
        try:
            if kind.startswith("tcp"):
                server.settimeout(20)
                sock, _ = server.accept()
                tcp = stack.enter_context(
                    TcpGateExchange(sock, rank=0, n_embd=N_EMBD, timeout_s=20.0)
                )
                loop_in(tcp, kind)
                g: GateExchange = tcp
            else:
                g = slab
            mine = gates_schedule(g, p0)
            assert parent.poll(20)
            theirs = parent.recv()
        finally:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join()
        assert proc.exitcode == 0
    for a, b, x, y in zip(mine, theirs, p0, p1, strict=True):
        assert same_bits(a, b) and same_bits(a, x + y)
