"""Mutual TLS under the native links, with certificates made by `foundry certs`.

The swarm (coordinator + a worker training a few steps, status over the admin link), the TP
pair (leader + worker with gates over TLS-wrapped TCP, a greedy generation through the
frontend equal to one process), and the gateway with backend TLS in front of both. On every
native port (worker link, admin link, TP worker port, frontend link) a plaintext peer, a peer
with a certificate of another CA and a peer without a client certificate are refused in the
TLS handshake: the server logs the refusal with the peer's address and its reason, and no
line of the protocol above (the peer's bytes never reach it); good peers are served after.

The gateway's own gRPC side (TLS and the token) is tested in tests/test_gateway_auth.py, e.g.
``test_every_call_but_health_and_reflection_needs_the_token``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from procs import Service, coordinator, wait_for
from tls_certs import Certs, two_cas
from tp_harness import Client, LeaderProc, Proc, make_model, reference_greedy, start_leader
from tp_harness import start_worker as start_tp_worker

from foundry.cli import main as cli_main
from foundry.gateway.admin_client import AdminClient
from foundry.transport import tls
from foundry.transport.gates import TcpGateExchange
from foundry.transport.listener import Listener
from foundry.wire import fdtc
from foundry.wire import frontend as fw

STEPS = 3
PROMPT = "Security is a layer under the protocol. "
TOKENS = 16


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return two_cas(tmp_path_factory.mktemp("certs"))


# -- the three peers every port refuses ------------------------------------------------------


def bad_peers(certs: Certs) -> dict[str, ssl.SSLContext | None]:
    """name -> client context (None: plaintext). Each trusts the right CA, so that the server,
    not the client, is the side that refuses."""
    o, ca = certs.other, certs.dir / "ca.pem"
    return {
        "plaintext": None,
        "other CA": tls.client_context(o / "worker.pem", o / "worker-key.pem", ca),
        "no client certificate": tls.client_context(ca=ca),
    }


REASONS = {
    "plaintext": "WRONG_VERSION_NUMBER",
    "other CA": "CERTIFICATE_VERIFY_FAILED",
    "no client certificate": "PEER_DID_NOT_RETURN_A_CERTIFICATE",
}


def poke(port: int, ctx: ssl.SSLContext | None, first_bytes: bytes) -> int:
    """Connect (over TLS with ``ctx``), send the protocol's first bytes, read until the server
    hangs up; returns our local port, which the server's log names."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    local = int(raw.getsockname()[1])
    sock: socket.socket = raw
    try:
        if ctx is not None:
            # TLS 1.3: the client's side of the handshake ends before the server checked the
            # client certificate; the refusal arrives on the next read.
            try:
                sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            except (ssl.SSLError, OSError):
                return local
        try:
            sock.sendall(first_bytes)
            while sock.recv(4096):
                pass
        except (ssl.SSLError, OSError):
            pass
    finally:
        sock.close()
    return local


def assert_refused(
    log: Service | Proc, link: str, certs: Certs, port: int, first_bytes: bytes
) -> None:
    for name, ctx in bad_peers(certs).items():
        local = poke(port, ctx, first_bytes)
        peer = f"127.0.0.1:{local}"
        wait_for_line(
            log,
            rf"{link}: refused {re.escape(peer)} in the TLS handshake: "
            rf"{REASONS[name]}",
        )
        mentions = [line for line in log.text().splitlines() if peer in line]
        assert len(mentions) == 1, f"{name}: the protocol saw the peer's bytes: {mentions}"


def wait_for_line(proc: Service | Proc, pattern: str, within_s: float = 15.0) -> None:
    wait_for(
        lambda: re.search(pattern, proc.text()), within_s, f"/{pattern}/ in:\n{proc.text()[-3000:]}"
    )


def swarm_status(admin: int, certs: Certs) -> fdtc.SwarmStatus:
    """The coordinator's status, read over its admin link with the gateway's certificate."""

    async def status() -> fdtc.SwarmStatus:
        client = AdminClient("127.0.0.1", admin, ssl=certs.client("gateway"))
        try:
            return (await client.status(10.0))[0]
        finally:
            await client.close()

    return asyncio.run(status())


# -- the swarm -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swarm(
    certs: Certs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, int, int]]:
    tmp = tmp_path_factory.mktemp("swarm")
    svc, port, admin = coordinator(
        tmp,
        "--max-steps",
        str(STEPS),
        "--global-batch",
        "8",
        "--seq-len",
        "32",
        *certs.flags("coordinator"),
    )
    try:
        yield svc, port, admin
    finally:
        svc.stop()


def test_swarm_trains_over_mutual_tls_and_refuses_bad_peers(
    swarm: tuple[Service, int, int], certs: Certs, tmp_path: Path
) -> None:
    coord, port, admin = swarm
    assert "(mutual tls)" in coord.text()
    register = fdtc.encode(
        fdtc.Register(
            worker_id="intruder",
            protocol_version=1,
            profile=fdtc.HardwareProfile.SERVER,
            num_cores=2,
            memory_mb=1024,
            suggested_batch_size=4,
        )
    )
    assert_refused(coord, "worker link", certs, port, register)
    assert_refused(coord, "admin link", certs, admin, fdtc.encode(fdtc.StatusReq()))
    # A health probe (connect, close) is not a refusal worth a warning.
    # A plaintext peer sent after it is the marker: once its refusal is logged, the probe's
    # connection (done before it) has been handled too, and must have added nothing.
    warnings = coord.text().count("WARNING")
    assert cli_main(["probe", f"127.0.0.1:{admin}"]) == 0
    marker = f"127.0.0.1:{poke(admin, None, fdtc.encode(fdtc.StatusReq()))}"
    wait_for_line(coord, rf"admin link: refused {re.escape(marker)} in the TLS handshake")
    assert coord.text().count("WARNING") == warnings + 1, coord.text()[-500:]

    # A worker configured by the environment alone (FOUNDRY_TLS_*) trains to the end.
    d = certs.dir
    env = {
        "FOUNDRY_TLS_CERT": str(d / "worker.pem"),
        "FOUNDRY_TLS_KEY": str(d / "worker-key.pem"),
        "FOUNDRY_TLS_CA": str(d / "ca.pem"),
    }
    worker = Service(
        ["worker", "--coordinator", f"127.0.0.1:{port}", "--worker-id", "w-tls"],
        tmp_path / "worker.log",
        env=env,
    )
    try:
        assert worker.proc.wait(timeout=60) == 0, worker.text()
    finally:
        worker.stop()
    assert re.search(r"worker w-tls registered from 127\.0\.0\.1:\d+", coord.text())

    st = swarm_status(admin, certs)
    assert (st.global_step, st.state) == (STEPS, fdtc.SwarmState.DONE)


def test_a_plaintext_worker_of_a_tls_coordinator_is_told_to_use_tls(
    swarm: tuple[Service, int, int], tmp_path: Path
) -> None:
    _, port, _ = swarm
    worker = Service(
        ["worker", "--coordinator", f"127.0.0.1:{port}", "--worker-id", "plain"],
        tmp_path / "worker.log",
    )
    try:
        wait_for_line(
            worker,
            r"ended the link before accepting this worker: .*a coordinator "
            r"started with --tls-cert closes a plaintext worker's link at once: if it "
            r"runs TLS, give this worker --tls-cert, --tls-key and --tls-ca",
        )
    finally:
        worker.stop()


# -- the tensor-parallel pair --------------------------------------------------------------


@dataclass
class Pair:
    leader: LeaderProc
    model: Path
    logs: Path
    worker: Proc | None = None

    def start_worker(self, certs: Certs) -> None:
        if self.worker is None:
            self.worker = start_tp_worker(
                self.model,
                self.leader.port,
                self.logs / "worker.log",
                "--no-shm",
                *certs.flags("tp-worker"),
            )

    def wait_paired(self, certs: Certs) -> None:
        with Client(self.leader.frontend, tls=certs.client()) as c:
            wait_for(lambda: c.status().worker_connected, 30, "the TP pair to pair over TLS")


@pytest.fixture(scope="module")
def pair(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("tp")
    model = make_model(logs / "model.gguf")
    leader = start_leader(model, logs / "leader.log", "--no-shm", *certs.flags("tp-leader"))
    p = Pair(leader, model, logs)
    try:
        yield p
    finally:
        leader.proc.stop()
        if p.worker is not None:
            p.worker.stop()


def test_tp_pair_over_mutual_tls_and_refuses_bad_peers(pair: Pair, certs: Certs) -> None:
    leader = pair.leader.proc
    assert_refused(leader, "worker port", certs, pair.leader.port, b"DTPH" + bytes(164))
    assert_refused(leader, "frontend link", certs, pair.leader.frontend, fw.encode(fw.StatusReq(0)))

    pair.start_worker(certs)
    pair.wait_paired(certs)
    assert "gates over tcp" in leader.text()  # TLS-wrapped TCP gates, not the slab
    ref = reference_greedy(pair.model, PROMPT, TOKENS, chunk=64)
    with Client(pair.leader.frontend, tls=certs.client()) as c:
        got = c.generate(PROMPT, TOKENS)
    assert isinstance(got.end, fw.Done), got.end
    assert got.tokens == ref.tokens


def test_gateway_reaches_both_backends_over_mutual_tls(
    swarm: tuple[Service, int, int], pair: Pair, certs: Certs, tmp_path: Path
) -> None:
    _, _, admin = swarm
    pair.start_worker(certs)
    pair.wait_paired(certs)
    gateway = Service(
        [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--coordinator-admin",
            f"127.0.0.1:{admin}",
            "--tp-frontend",
            f"127.0.0.1:{pair.leader.frontend}",
            *certs.flags("gateway", prefix="backend-tls"),
        ],
        tmp_path / "gateway.log",
    )
    try:
        m = gateway.wait_for(r"gateway listening: grpc 127\.0\.0\.1:(\d+).*\(backend tls\)")
        target = f"127.0.0.1:{m.group(1)}"
        # The swarm's state is whatever the module's earlier tests left (DONE after they
        # trained it, WAITING when this test runs alone); the gateway must report that one.
        st = swarm_status(admin, certs)
        status = f"training: {st.state.name}", f"step {st.global_step}/{STEPS}", "pair: worker"
        for action, expects in (
            (["status"], status),
            (["generate", "--prompt", PROMPT, "--max-tokens", "8", "--stats"], ("8 tokens",)),
        ):
            run = subprocess.run(
                [sys.executable, "-m", "foundry", "ctl", "--gateway", target, *action],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert run.returncode == 0, run.stdout + run.stderr + gateway.text()
            for expect in expects:
                assert expect in run.stdout + run.stderr, run.stdout + run.stderr
    finally:
        gateway.stop()


# -- in-process pieces ---------------------------------------------------------------------


def test_tcp_gates_over_tls_sum_like_plain_tcp(certs: Certs) -> None:
    """Small decode gates and a 4 MiB prefill gate (far beyond the socket buffers, so both
    directions must interleave) over TLS sockets, on two threads."""
    d = certs.dir
    server_ctx = tls.server_context(d / "tp-leader.pem", d / "tp-leader-key.pem", d / "ca.pem")
    client_ctx = tls.client_context(d / "tp-worker.pem", d / "tp-worker-key.pem", d / "ca.pem")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    n_embd = 256
    rng = np.random.default_rng(0)
    shapes = [(1, n_embd)] * 5 + [(4096, n_embd), (3, n_embd)]
    parts = [[rng.standard_normal(s, dtype=np.float32) for s in shapes] for _ in range(2)]
    sums: list[list[np.ndarray]] = [[], []]
    errors: list[BaseException] = []

    def rank(r: int, sock: socket.socket) -> None:
        try:
            with TcpGateExchange(sock, rank=r, n_embd=n_embd, timeout_s=10.0) as gate:
                for i, part in enumerate(parts[r]):
                    sums[r].append(gate.exchange(i, i % 2, part))
        except BaseException as exc:
            errors.append(exc)

    def leader() -> None:
        conn, _ = listener.accept()
        rank(0, tls.wrap_blocking(server_ctx, conn, server_side=True))

    t = threading.Thread(target=leader)
    t.start()
    raw = socket.create_connection(("127.0.0.1", port))
    rank(1, tls.wrap_blocking(client_ctx, raw, server_side=False, server_hostname="127.0.0.1"))
    t.join(30)
    listener.close()
    assert not errors, errors
    for i in range(len(shapes)):
        want = parts[0][i] + parts[1][i]
        assert np.array_equal(sums[0][i], want) and np.array_equal(sums[1][i], want)


async def echo_round_trip(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_name: str
) -> bytes:
    """One echo through a TLS Listener; raises what the client's handshake raises."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.read(10))
        await writer.drain()
        writer.close()

    listener = Listener(
        "test link", echo, log=logging.getLogger("test"), tls=server_ctx, max_connections=4
    )
    srv = await listener.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", listener.port, ssl=client_ctx, server_hostname=server_name
        )
        writer.write(b"ping")
        got = await reader.read(10)
        writer.close()
        await writer.wait_closed()
        return got
    finally:
        srv.close()
        for _ in range(100):  # the server's side of a failed handshake ends too
            if not listener.open_connections:
                break
            await asyncio.sleep(0.02)
        await srv.wait_closed()


def test_clients_check_the_server_name(certs: Certs) -> None:
    """The coordinator's certificate passes for its own names only: hostname checking is on."""
    d = certs.dir
    server_ctx = tls.server_context(d / "coordinator.pem", d / "coordinator-key.pem", d / "ca.pem")
    for name in ("coordinator", "localhost", "127.0.0.1", "coordinator.foundry.svc"):
        assert asyncio.run(echo_round_trip(server_ctx, certs.client("worker"), name)) == b"ping"
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        asyncio.run(echo_round_trip(server_ctx, certs.client("worker"), "tp-leader"))


def test_certs_writes_a_ca_and_one_pair_per_role(certs: Certs) -> None:
    d = certs.dir
    for role in ("coordinator", "tp-leader", "gateway", "worker", "tp-worker"):
        assert (d / f"{role}.pem").stat().st_mode & 0o777 == 0o644
        assert (d / f"{role}-key.pem").stat().st_mode & 0o777 == 0o600
    assert (d / "ca-key.pem").stat().st_mode & 0o777 == 0o600
    # A client certificate cannot serve: its purpose (clientAuth) is checked by the client.
    as_server = tls.server_context(d / "worker.pem", d / "worker-key.pem", d / "ca.pem")
    with pytest.raises(
        ssl.SSLCertVerificationError, match="unsuitable certificate purpose"
    ) as refused:
        asyncio.run(echo_round_trip(as_server, certs.client("tp-worker"), "127.0.0.1"))
    assert "is not made for this end of the link" in tls.refusal_reason(refused.value)
    with pytest.raises(tls.TlsConfigError, match="--tls-cert and --tls-key"):
        tls.client_context(d / "worker.pem", None, d / "ca.pem")


def test_tls_flags_fall_back_to_the_environment(
    certs: Certs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A listener given only a CA (here through FOUNDRY_TLS_CA) cannot serve TLS: exit 2,
    naming the flags, before anything starts."""
    monkeypatch.setenv("FOUNDRY_TLS_CA", str(certs.dir / "ca.pem"))
    assert cli_main(["coordinator", "--listen", "127.0.0.1:0"]) == 2
    assert "--tls-cert and --tls-key" in capsys.readouterr().err
    monkeypatch.setenv("FOUNDRY_TLS_CERT", str(certs.dir / "missing.pem"))
    monkeypatch.setenv("FOUNDRY_TLS_KEY", str(certs.dir / "coordinator-key.pem"))
    assert cli_main(["tp-worker", "--model", "x.gguf"]) == 2
    assert "missing.pem" in capsys.readouterr().err
