"""Hostile and stalled peers with real processes: a frozen leader, undecodable requests, garbage
hellos, a refused TLS worker, slow HTTP headers, fragments that would hold the coordinator's
memory. Each case is a row of the fault table in docs/guide/recovering.md ("Faults and bad
input").
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from hostile import GATEWAY_LINE, ctl_generate, foundry, free_port, http_call, http_serving, serving
from procs import Service, coordinator, worker
from tp_harness import LeaderProc, make_model, start_leader, start_worker, wait_paired

from foundry.api.v1 import inference_pb2
from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import load_corpus
from foundry.transport.fdtc_stream import FdtcStream, FrameTimeout
from foundry.wire import fdtc
from foundry.wire.errors import FdtcProtocolError
from foundry.wire.fdtc import (
    MAX_MESSAGE,
    PROTOCOL_VERSION,
    Compression,
    Dataset,
    FdtcDecoder,
    Fragment,
    Gradients,
    HardwareProfile,
    Heartbeat,
    MsgType,
    Register,
    Weights,
    WeightsMeta,
    WeightsReq,
    encode_parts,
)
from foundry.wire.fdtc_connection import FdtcConnection
from foundry.wire.fdtc_lifecycle import Role
from foundry.wire.framing import ReceiveBudget
from foundry.wire.tp import HELLO_PREFIX, HELLO_SIZE, TP_HELLO_MAGIC, TP_PROTOCOL_VERSION


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("long") / "model.gguf", ModelConfig(n_ctx=2048))


def test_a_frozen_leader_fails_generations_in_flight_and_new_ones_at_once(
    long_model: Path, tmp_path: Path
) -> None:
    """SIGSTOP of the leader mid-generation: the call in flight ends UNAVAILABLE once the
    leader has missed the health probes (not at its deadline, 120 s here); a new call while
    it is stopped ends UNAVAILABLE "not serving" at once; after SIGCONT it serves again."""
    with (
        serving(long_model, tmp_path, "--spec-mode", "off") as st,
        grpc.insecure_channel(st.target) as channel,
    ):
        generate = channel.unary_stream(
            "/foundry.v1.InferenceService/Generate",
            request_serializer=inference_pb2.GenerateRequest.SerializeToString,
            response_deserializer=inference_pb2.GenerateResponse.FromString,
        )
        call = generate(inference_pb2.GenerateRequest(prompt="a", max_tokens=2000), timeout=120)
        got, stopped = 0, False
        with pytest.raises(grpc.RpcError) as exc:
            for response in call:
                got += len(response.tokens)
                if got >= 3 and st.leader.proc.popen.poll() is None:
                    st.leader.proc.popen.send_signal(signal.SIGSTOP)
                    stopped = True
        assert stopped
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value
        assert "stopped making progress" in (exc.value.details() or ""), exc.value.details()
        run = foundry(
            "ctl", "--gateway", st.target, "generate", "--prompt", "a", "--max-tokens", "4"
        )
        assert run.returncode == 1, run
        assert "UNAVAILABLE" in run.stderr and "is not serving" in run.stderr, run.stderr
        seen = len(st.gateway.text())
        st.leader.proc.popen.send_signal(signal.SIGCONT)
        st.gateway.wait_for(r"tp_leader is reachable", after=seen)
        run = ctl_generate(st.target, "a", "--max-tokens", "4")
        assert run.returncode == 0, run.stderr
        assert "Traceback" not in st.gateway.text()


def test_undecodable_requests_are_invalid_arguments(tmp_path: Path) -> None:
    gateway = Service(
        [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--coordinator-admin",
            f"127.0.0.1:{free_port()}",
            "--tp-frontend",
            f"127.0.0.1:{free_port()}",
        ],
        tmp_path / "gateway.log",
    )
    try:
        target = "127.0.0.1:" + gateway.wait_for(GATEWAY_LINE).group(1)
        with grpc.insecure_channel(target) as channel:
            cases = [
                ("/foundry.v1.InferenceService/Generate", True, b"\x0a\x02\xff\xfe\x10\x04"),
                ("/foundry.v1.InferenceService/Generate", True, b"\x0a\x7f\x41"),  # cut short
                ("/foundry.v1.ModelService/ExportModel", False, b"\x0a\x03a\xc3("),
                ("/foundry.v1.TrainingService/GetTrainingStatus", False, b"\xff\xff\xff"),
            ]
            for method, streaming, raw in cases:
                # No serializers: the raw bytes go out as they are.
                rpc = (channel.unary_stream if streaming else channel.unary_unary)(method)
                with pytest.raises(grpc.RpcError) as exc:
                    result = rpc(raw, timeout=10)
                    if streaming:
                        list(result)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, exc.value)
                assert "is not a valid" in (exc.value.details() or ""), exc.value.details()
        assert "Traceback" not in gateway.text() and "DecodeError" not in gateway.text()
    finally:
        gateway.stop()


def test_ctl_generate_has_a_deadline(tmp_path: Path) -> None:
    """A gateway that accepts the connection and never answers (a frozen process): `ctl
    generate --timeout S` ends DEADLINE_EXCEEDED; without --timeout the default applies."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        run = ctl_generate(target, "a", "--timeout", "1.5")
        assert run.returncode == 1, run
        assert "DEADLINE_EXCEEDED" in run.stderr, run.stderr
    help_text = foundry("ctl", "generate", "--help").stdout
    assert "300 s for generate" in " ".join(help_text.split())


def test_a_tp_worker_that_meets_garbage_hellos_keeps_waiting_for_a_good_leader(
    long_model: Path, tmp_path: Path
) -> None:
    """A stray process on the leader's port answers two hellos with garbage (a version that
    does not exist; a body of random bytes), then goes; the real leader starts there and the
    worker pairs with it."""
    rng = np.random.default_rng(5)
    hellos = [
        HELLO_PREFIX.pack(TP_HELLO_MAGIC, 0xBEEF, HELLO_SIZE) + rng.bytes(HELLO_SIZE - 8),
        HELLO_PREFIX.pack(TP_HELLO_MAGIC, TP_PROTOCOL_VERSION, HELLO_SIZE)
        + rng.bytes(HELLO_SIZE - 8),
    ]
    stray = socket.create_server(("127.0.0.1", 0))
    port = stray.getsockname()[1]
    worker = start_worker(long_model, port, tmp_path / "worker.log")
    leader: LeaderProc | None = None
    try:
        for hello in hellos:
            conn, _ = stray.accept()
            with conn:
                conn.sendall(hello)
                conn.settimeout(10)
                with contextlib.suppress(OSError):
                    while conn.recv(4096):  # until the worker hangs up on it
                        pass
        stray.close()
        leader = start_leader(long_model, tmp_path / "leader.log", "--listen", f"127.0.0.1:{port}")
        wait_paired(leader.frontend)
        assert worker.popen.poll() is None
        text = worker.text()
        assert "does not match this worker" in text and "dialing again" in text, text
    finally:
        stray.close()
        if leader is not None:
            leader.proc.stop()
        worker.stop()


def test_a_worker_refused_by_tls_backs_off_and_says_why(tmp_path: Path) -> None:
    for name in ("ca", "other"):
        run = foundry("certs", "--out", str(tmp_path / name))
        assert run.returncode == 0, run.stderr
    ca, other = tmp_path / "ca", tmp_path / "other"
    coord, port, _ = coordinator(
        tmp_path,
        "--tls-cert",
        str(ca / "coordinator.pem"),
        "--tls-key",
        str(ca / "coordinator-key.pem"),
        "--tls-ca",
        str(ca / "ca.pem"),
    )
    # The worker trusts the right CA, but its own certificate is from another one.
    w = worker(
        tmp_path,
        port,
        "w0",
        "--tls-cert",
        str(other / "worker.pem"),
        "--tls-key",
        str(other / "worker-key.pem"),
        "--tls-ca",
        str(ca / "ca.pem"),
    )
    try:
        line = r"ended the link before accepting this worker: .*; retrying in ([\d.]+)s"
        m = w.wait_for(line)
        delays = [float(m.group(1))]
        for _ in range(3):
            m = w.wait_for(line, after=m.end())
            delays.append(float(m.group(1)))
        # Capped exponential backoff with jitter: attempt k waits within [c/2, c],
        # c = 0.25 * 2**k (the worker's default --backoff-cap is far above these).
        for k, delay in enumerate(delays, start=1):
            assert 0.125 * 2**k <= delay <= 0.25 * 2**k, delays
        assert "--tls-ca did not sign" in w.text()
        refusals = coord.text().count("refused 127.0.0.1")
        assert "CERTIFICATE_VERIFY_FAILED" in coord.text()
        assert refusals <= len(delays) + 2, refusals  # one per attempt, not dozens
    finally:
        w.stop()
        coord.stop()


def test_slow_headers_are_cut_and_connections_are_capped(plain_model: Path, tmp_path: Path) -> None:
    """Finding 7: 1,200 connections sending their headers a byte at a time were all kept
    open. With --http-header-timeout 2 and --http-max-connections 200, connections past 200
    are answered 503 and closed at once, the rest are closed after 2 s, and /health answers
    200 throughout (its own connections come and go)."""
    with http_serving(
        plain_model, tmp_path, "--http-header-timeout", "2", "--http-max-connections", "200"
    ) as (stack, port):
        socks = []
        try:
            t0 = time.monotonic()
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                socks.append(s)
            assert http_call(port, "GET", "/health", timeout=10)[0] in (200, 503)
            refused = 0
            for s in socks[200:]:
                data = s.recv(4096)
                refused += data.startswith(b"HTTP/1.1 503")
            assert refused >= 90, refused
            for s in socks[:200]:
                s.settimeout(15)
                assert s.recv(4096) == b""  # closed by the gateway, no response
            assert time.monotonic() - t0 < 15
            statuses = [http_call(port, "GET", "/health", timeout=10)[0] for _ in range(3)]
            assert statuses == [200, 200, 200]
        finally:
            for s in socks:
                s.close()
    assert "Traceback" not in stack.gateway.text()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class RawPeer:
    """A peer of ours in name only: it registers with the extensions (so it may send
    FRAGMENT frames) and takes the weights; then a thread reads (and drops) whatever the
    coordinator sends, and heartbeats until the test makes it ``stall``, until the
    coordinator ends the link (``closed_at``)."""

    def __init__(self, port: int, worker_id: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.settimeout(None)  # sends block as long as they must; reads wait in select
        self.conn = FdtcConnection(Role.WORKER)
        self.conn.allow_fragments(MAX_MESSAGE)
        self.worker_id = worker_id
        self.lock = threading.Lock()
        self.stalling = threading.Event()
        self.closed_at: float | None = None
        self.error: fdtc.Error | None = None
        self.meta: WeightsMeta | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def join(self) -> RawPeer:
        fp = load_corpus(None).fingerprint
        self.send(
            Dataset(n_tokens=fp.n_tokens, sha256=bytes.fromhex(fp.sha256)),
            Register(self.worker_id, PROTOCOL_VERSION, HardwareProfile.LAPTOP_LIGHT, 2, 4096, 4),
        )
        self._thread.start()
        # A WEIGHTS_REQ that lands while the coordinator applies a step is answered with the
        # peer's next assignment; the rounds here wait on peers that never answer theirs, so
        # ask again now and then, as a peer may, rather than wait those rounds out.
        deadline = time.monotonic() + 60
        asked = 0.0
        while self.meta is None and self.closed_at is None:
            assert time.monotonic() < deadline, f"{self.worker_id}: no weights in 60 s"
            if time.monotonic() - asked > 2.0:
                self.send(WeightsReq())
                asked = time.monotonic()
            time.sleep(0.05)
        return self

    def send(self, *msgs: fdtc.Message) -> None:
        with self.lock:
            pieces = self.conn.send(*msgs)
            self.sock.sendall(b"".join(bytes(p) for p in pieces))

    def send_raw(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)

    def _run(self) -> None:
        beat = time.monotonic()
        while True:
            if not self.stalling.is_set() and time.monotonic() - beat > 0.5:
                with contextlib.suppress(OSError):
                    self.send(Heartbeat(self.worker_id, 0, 0.0, 0.0))
                beat = time.monotonic()
            try:
                if not select.select([self.sock], [], [], 0.2)[0]:
                    continue
                data = self.sock.recv(1 << 20)
            except (OSError, ValueError):  # ValueError: closed by the test
                data = b""
            if not data:
                self.closed_at = time.monotonic()
                return
            with self.lock:
                self.conn.receive_data(data)
                while (event := self.conn.next_event()) is not None:
                    if isinstance(event, WeightsMeta) and self.meta is None:
                        self.meta = event
                    elif isinstance(event, fdtc.Error):
                        self.error = event

    def gradients_frames(self, fragment: int) -> list[bytes]:
        """A whole GRADIENTS for the model, as FRAGMENT frames of ``fragment`` bytes."""
        assert self.meta is not None
        numels = [t.numel for t in self.meta.tensors]
        data = np.zeros(sum(numels), "<f4").tobytes()
        msg = Gradients(self.worker_id, 0, len(numels), Compression.NONE, len(data), data)
        return self.frames_of(encode_parts(msg, fragment_size=fragment, max_message=MAX_MESSAGE))

    @staticmethod
    def frames_of(pieces: list[bytes | memoryview]) -> list[bytes]:
        """Frame pieces as whole frames."""
        joined = b"".join(bytes(p) for p in pieces)
        frames, pos = [], 0
        while pos < len(joined):
            end = pos + 9 + struct.unpack_from("<I", joined, pos + 5)[0]
            frames.append(joined[pos:end])
            pos = end
        return frames

    def close(self) -> None:
        self.sock.close()
        self._thread.join(5)


def test_fragments_cannot_hold_the_coordinators_memory(tmp_path: Path) -> None:
    """Finding 4: ten registered peers each began a fragmented GRADIENTS of 256 MiB and
    stopped; the coordinator went from 1.3 to 4.0 GB, kept it after they were dropped, and
    the real worker lost rounds. Now: a fragmented message over the model's largest is
    refused at its first fragment; ten peers that stop between fragments of a real-sized one
    are dropped within the frame deadline, the memory they made the coordinator hold is
    given back, and the real worker's rounds go on; a peer not registered cannot make it
    hold a large frame at all."""
    coord, port, _ = coordinator(
        tmp_path,
        "--preset",
        "small",
        "--global-batch",
        "4",
        "--frame-deadline",
        "3",
        "--max-steps",
        "100000",
    )
    real = worker(tmp_path, port, "real")
    peers: list[RawPeer] = []
    try:
        coord.wait_for(r"step 2: loss", within_s=120)
        # Before REGISTER, no large buffer: a 200 MiB GRADIENTS is refused at its header.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as stranger:
            stranger.sendall(struct.pack("<IBI", fdtc.MAGIC, MsgType.GRADIENTS, 200 << 20))
            answer = FdtcDecoder()
            while (event := answer.next_event()) is None:
                data = stranger.recv(4096)
                assert data, "closed without an ERROR"
                answer.feed(data)
            assert isinstance(event, fdtc.Error), event
            assert event.error_code == fdtc.ErrorCode.NOT_REGISTERED, event
            assert "refused at its header" in event.message, event
        big = RawPeer(port, "big")
        peers.append(big.join())
        assert big.meta is not None
        limit = 64 + sum(10 * t.numel + 64 for t in big.meta.tensors)  # the model's largest
        big.stalling.set()
        big.send_raw(fdtc.encode(Fragment(MsgType.GRADIENTS, limit + (1 << 20), 0, bytes(4096))))
        t0 = time.monotonic()
        while big.closed_at is None and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert big.closed_at is not None and big.error is not None, big.error
        assert "exceeds this link's largest message" in big.error.message, big.error
        stalls = [RawPeer(port, f"stall{i}") for i in range(10)]
        peers += stalls
        joiners = [threading.Thread(target=p.join) for p in stalls]
        for t in joiners:
            t.start()
        for t in joiners:
            t.join(90)
        assert all(p.meta is not None and p.closed_at is None for p in stalls)
        frames = stalls[0].gradients_frames(1 << 20)
        assert len(frames) >= 10  # 13 MiB of gradients in 1 MiB fragments
        held = sum(len(f) for f in frames[:-1]) * len(stalls)
        rss_before = rss_bytes(coord.pid)
        steps_before = coord.text().count(": loss")
        for p in stalls:
            p.stalling.set()
            p.send_raw(b"".join(frames[:-1]))  # every fragment but the last, then nothing
        time.sleep(0.5)
        rss_holding = rss_bytes(coord.pid)
        assert rss_holding - rss_before > held // 2, (rss_before, rss_holding, held)
        t0 = time.monotonic()
        while any(p.closed_at is None for p in stalls) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        assert all(p.closed_at is not None for p in stalls)
        time.sleep(1.0)
        rss_after = rss_bytes(coord.pid)
        # The rounds going on move the coordinator's memory by some 10 MB either way.
        assert rss_after - rss_before < held // 4, (rss_before, rss_holding, rss_after, held)
        coord.wait_for(rf"step {steps_before + 3}: loss", within_s=60)
        assert "dropped worker real" not in coord.text()
    finally:
        for p in peers:
            p.close()
        real.stop()
        coord.stop()
    assert "Traceback" not in coord.text()


def test_the_receive_budget_is_shared_and_given_back() -> None:
    """Finding 4's global bound, on the codec: decoders sharing one ReceiveBudget cannot
    together hold more than it; a decoder released (its peer gone) gives its share back."""
    budget = ReceiveBudget(6 << 20)
    first, second = (FdtcDecoder(max_message=MAX_MESSAGE, budget=budget) for _ in range(2))
    head = fdtc.encode(Fragment(MsgType.GRADIENTS, 4 << 20, 0, bytes(2 << 20)))
    first.feed(head)
    assert first.next_event() is None and first.reassembling == 2 << 20
    assert budget.held == 4 << 20
    second.feed(head)
    with pytest.raises(FdtcProtocolError, match="other peers") as refused:
        second.next_event()
    assert refused.value.error_code == fdtc.ErrorCode.BUSY and budget.held == 4 << 20
    first.release()
    assert budget.held == 0 and first.reassembling == 0
    third = FdtcDecoder(max_message=MAX_MESSAGE, budget=budget)
    third.feed(head)
    assert third.next_event() is None and budget.held == 4 << 20


def test_a_peer_that_stops_between_fragments_is_cut_by_the_frame_deadline() -> None:
    """Finding 4: between two fragments of one message no frame is begun, so a peer could
    hold a half-joined message (and its buffer) for as long as its link lived. A message held
    half-way is a frame begun: the next fragment is due within the deadline; the stream's
    close gives the buffer back to the budget."""
    data = np.arange(3 << 18, dtype="<f4").tobytes()  # 3 MiB: three fragments of 1 MiB
    frames = RawPeer.frames_of(
        encode_parts(Weights(data), fragment_size=1 << 20, max_message=MAX_MESSAGE)
    )
    assert len(frames) == 3
    budget = ReceiveBudget(1 << 30)

    async def main() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        listener.close()
        reader, writer = await asyncio.open_connection(sock=server)
        stream = FdtcStream(reader, writer, frame_deadline_s=0.5, budget=budget)
        stream.decoder.max_message = MAX_MESSAGE  # type: ignore[attr-defined]
        client.sendall(frames[0] + frames[1])  # then nothing: the last fragment never comes
        t0 = time.monotonic()
        with pytest.raises(FrameTimeout, match=r"within 0\.5 s"):
            await stream.recv()
        assert 0.4 < time.monotonic() - t0 < 3
        assert budget.held == len(data)  # the joined message's buffer, until the link ends
        await stream.close()
        assert budget.held == 0
        client.close()

    asyncio.run(asyncio.wait_for(main(), 20))
