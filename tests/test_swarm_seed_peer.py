"""Workers written only from the seed header and docs/protocol.md, with raw sockets and ``struct``.

They speak the seed's messages and nothing else (no DATASET, so the coordinator sends them no
extension): REGISTER, WEIGHTS_REQ, GRADIENTS, HEARTBEAT, DEREGISTER, and they obey START, SYNC,
PAUSE, RESUME, CHECKPOINT and SHUTDOWN. Nothing from ``foundry`` is used on purpose: this is
what a C implementation of the header would do.
"""

from __future__ import annotations

import math
import re
import socket
import struct
import threading
import time
from pathlib import Path

from procs import coordinator, wait_for, worker

MAGIC = b"\x43\x54\x44\x46"  # u32 0x46445443 little-endian
REGISTER, REGISTER_ACK, DEREGISTER = 0x01, 0x02, 0x03
HEARTBEAT, HEARTBEAT_ACK, WEIGHTS_REQ, WEIGHTS, WEIGHTS_META = 0x10, 0x11, 0x20, 0x21, 0x22
GRADIENTS, GRADIENTS_ACK, ERROR = 0x30, 0x31, 0xFF
START, SYNC, CHECKPOINT, SHUTDOWN, PAUSE, RESUME = 0x40, 0x45, 0x46, 0x47, 0x48, 0x49
CONTROL_ACK = 0x64  # the admin link's answer (docs/protocol.md)


def frame(msg_type: int, payload: bytes = b"") -> bytes:
    return MAGIC + struct.pack("<BI", msg_type, len(payload)) + payload


class Peer:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""

    def recv(self) -> tuple[int, bytes]:
        while True:
            if len(self.buf) >= 9:
                assert self.buf[:4] == MAGIC
                msg_type, length = struct.unpack_from("<BI", self.buf, 4)
                if len(self.buf) >= 9 + length:
                    payload = self.buf[9 : 9 + length]
                    self.buf = self.buf[9 + length :]
                    return msg_type, payload
            data = self.sock.recv(1 << 20)
            assert data, "coordinator closed the connection"
            self.buf += data

    def recv_type(self, wanted: int) -> bytes:
        """The next message of a type, skipping the ones a seed worker may ignore."""
        while True:
            msg_type, payload = self.recv()
            if msg_type == wanted:
                return payload
            assert msg_type != ERROR, payload[4:].split(b"\0")[0]


def test_seed_only_worker_joins_pulls_weights_uploads_and_leaves(tmp_path: Path) -> None:
    coord, port, _ = coordinator(tmp_path, "--max-steps", "3", "--global-batch", "4")
    peer = Peer(port)
    try:
        worker_id = b"c-worker".ljust(64, b"\0")
        # REGISTER: char[64] id, u8 version 1, u32 profile (4 = LAPTOP_LIGHT), u32 cores,
        # u64 memory_mb, u32 suggested batch: 85 bytes.
        register = worker_id + struct.pack("<BIIQI", 1, 4, 2, 4096, 4)
        assert len(register) == 85
        peer.sock.sendall(frame(REGISTER, register))
        ack = peer.recv_type(REGISTER_ACK)
        assert len(ack) == 29
        accepted, _, _, batch, accum, compression, _, step = struct.unpack("<?IIIIIfI", ack)
        assert accepted and batch >= 1 and accum >= 1 and compression == 0 and step == 0

        peer.sock.sendall(frame(WEIGHTS_REQ))
        meta = peer.recv_type(WEIGHTS_META)
        num_tensors, meta_step, _lr = struct.unpack_from("<IIf", meta)
        assert len(meta) == 12 + 141 * num_tensors and meta_step == 0
        numels = []
        for i in range(num_tensors):
            off = 12 + 141 * i
            name = meta[off : off + 64].split(b"\0")[0].decode()
            ndim = struct.unpack_from("<I", meta, off + 64)[0]
            shape = struct.unpack_from("<8Q", meta, off + 68)[:ndim]
            numel, dtype = struct.unpack_from("<QB", meta, off + 132)
            assert dtype == 0 and numel == int(__import__("math").prod(shape)), name
            numels.append(numel)
        assert meta[12:76].split(b"\0")[0] == b"token_embd.weight"
        weights = peer.recv_type(WEIGHTS)
        assert len(weights) == 4 * sum(numels)

        # GRADIENTS: 80-byte header, then every tensor as raw f32 (compression NONE).
        data = b"".join(struct.pack(f"<{n}f", *([1e-3] * n)) for n in numels)
        header = worker_id + struct.pack("<IIII", meta_step, num_tensors, 0, len(data))
        assert len(header) == 80
        peer.sock.sendall(frame(GRADIENTS, header + data))
        acked = peer.recv_type(GRADIENTS_ACK)
        assert len(acked) in (0, 5)
        assert acked == b"" or acked[4] == 1, "the gradient of the current step is accepted"

        peer.sock.sendall(frame(DEREGISTER))
        coord.wait_for(r"worker c-worker left \(DEREGISTER\)", within_s=10)
        # Still serving after it: another peer registers.
        again = Peer(port)
        again.sock.sendall(frame(REGISTER, b"c-again".ljust(64, b"\0") + register[64:]))
        assert again.recv_type(REGISTER_ACK)[0] == 1
        again.sock.close()
        assert coord.alive()
    finally:
        peer.sock.close()
        coord.stop()


class SeedWorker:
    """A seed-only worker as a C program would be: a heartbeat thread at its own fixed
    interval, and a main loop that trains only between START (or RESUME) and PAUSE, pulls new
    weights after each SYNC, and stops at SHUTDOWN."""

    def __init__(self, port: int, name: str, heartbeat_every_s: float) -> None:
        self.peer = Peer(port)
        self.worker_id = name.encode().ljust(64, b"\0")
        self.heartbeat_every_s = heartbeat_every_s
        self.send_lock = threading.Lock()
        self.stop_heartbeats = threading.Event()
        self.seen: list[int] = []  # every control message received, in order
        self.accepted = 0  # gradients the coordinator aggregated
        self.numels: list[int] = []
        self.step = -1  # global step of the weights held
        self.heartbeats = threading.Thread(target=self._heartbeat_loop, daemon=True)
        self.heartbeats_sent = 0

    def send(self, msg_type: int, payload: bytes = b"") -> None:
        with self.send_lock:
            self.peer.sock.sendall(frame(msg_type, payload))

    def _heartbeat_loop(self) -> None:
        # HEARTBEAT: char[64] id, u32 local_step, f32 loss, f32 samples/s: 76 bytes.
        while not self.stop_heartbeats.wait(self.heartbeat_every_s):
            payload = self.worker_id + struct.pack("<Iff", max(self.step, 0), 2.5, 0.0)
            assert len(payload) == 76
            try:
                self.send(HEARTBEAT, payload)
            except OSError:
                return
            self.heartbeats_sent += 1

    def register(self) -> None:
        # REGISTER: char[64] id, u8 version 1, u32 profile (4 = LAPTOP_LIGHT), u32 cores,
        # u64 memory_mb, u32 suggested batch: 85 bytes.
        self.send(REGISTER, self.worker_id + struct.pack("<BIIQI", 1, 4, 2, 4096, 2))
        msg_type, ack = self.peer.recv()
        assert msg_type == REGISTER_ACK and ack[0] == 1, ack
        self.heartbeats.start()
        self.send(WEIGHTS_REQ)

    def _take_weights(self, meta: bytes) -> None:
        num_tensors, self.step, _lr = struct.unpack_from("<IIf", meta)
        self.numels = [
            struct.unpack_from("<Q", meta, 12 + 141 * i + 132)[0] for i in range(num_tensors)
        ]

    def _send_gradient(self) -> None:
        data = b"".join(struct.pack(f"<{n}f", *([1e-4] * n)) for n in self.numels)
        header = self.worker_id + struct.pack("<IIII", self.step, len(self.numels), 0, len(data))
        self.send(GRADIENTS, header + data)

    def run(self, on_accepted: object = None, within_s: float = 90.0) -> None:
        """Train until SHUTDOWN; ``on_accepted(n)`` is called after each aggregated gradient."""
        deadline = time.monotonic() + within_s
        training = False  # between START/RESUME and PAUSE
        fresh = False  # holds weights of a step it has not sent a gradient for
        waiting_weights = True
        while time.monotonic() < deadline:
            msg_type, payload = self.peer.recv()
            if msg_type == WEIGHTS_META:
                self._take_weights(payload)
            elif msg_type == WEIGHTS:
                assert len(payload) == 4 * sum(self.numels)
                waiting_weights, fresh = False, True
            elif msg_type == GRADIENTS_ACK:
                if payload == b"" or payload[4] == 1:
                    self.accepted += 1
                    if callable(on_accepted):
                        on_accepted(self.accepted)
            elif msg_type in (START, RESUME, PAUSE, SYNC, CHECKPOINT, SHUTDOWN):
                self.seen.append(msg_type)
                if msg_type == SHUTDOWN:
                    self.send(DEREGISTER)
                    return
                if msg_type in (START, RESUME):
                    training = True
                elif msg_type == PAUSE:
                    training = False
                elif msg_type == SYNC and not waiting_weights:
                    waiting_weights, fresh = True, False
                    self.send(WEIGHTS_REQ)
            else:
                assert msg_type == HEARTBEAT_ACK, (hex(msg_type), payload[4:80])
            if training and fresh and not waiting_weights:
                fresh = False
                self._send_gradient()
        raise AssertionError(f"no SHUTDOWN within {within_s}s; seen {self.seen}")

    def close(self) -> None:
        self.stop_heartbeats.set()
        self.peer.sock.close()


def admin_request(port: int, msg_type: int) -> bytes:
    """One request on the admin link; returns CONTROL_ACK's message text."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(frame(msg_type))
        buf = b""
        while len(buf) < 9 or len(buf) < 9 + struct.unpack_from("<I", buf, 5)[0]:
            chunk = sock.recv(4096)
            assert chunk, "admin link closed"
            buf += chunk
        assert buf[4] == CONTROL_ACK, buf[:9]
        acked, ok = buf[9], buf[10]
        assert acked == msg_type and ok == 1, buf[15:].split(b"\0")[0]
        return buf[15:].split(b"\0")[0]


def test_seed_worker_waits_for_start_and_gets_the_whole_lifecycle(tmp_path: Path) -> None:
    coord, port, admin_port = coordinator(tmp_path, "--max-steps", "6", "--global-batch", "4")
    w = SeedWorker(port, "c-worker", heartbeat_every_s=5.0)
    quiet_heartbeats = 0

    def pause_after_three(accepted: int) -> None:
        nonlocal quiet_heartbeats
        if accepted == 3:
            admin_request(admin_port, PAUSE)
            # Idle long past our workers' 2.5 s timeout: nothing on the link but two more
            # heartbeats, 5 s apart (the peer's own cadence), then RESUME.
            before = w.heartbeats_sent
            wait_for(
                lambda: w.heartbeats_sent >= before + 2,
                6 * w.heartbeat_every_s,
                "two heartbeats while paused",
            )
            quiet_heartbeats = w.heartbeats_sent - before
            admin_request(admin_port, RESUME)

    try:
        w.register()
        w.run(on_accepted=pause_after_three)
        assert w.seen[0] == START, w.seen
        assert w.accepted == 6, w.accepted  # every step of the run took its gradient
        pause_at = w.seen.index(PAUSE)
        assert RESUME in w.seen[pause_at:], w.seen
        assert quiet_heartbeats >= 2  # the pause happened, and it was not dropped for it
        assert w.seen.count(SYNC) >= 3 and CHECKPOINT in w.seen and w.seen[-1] == SHUTDOWN
        coord.wait_for(r"training done at step 6", within_s=10)
        text = coord.text()
        assert "dropped worker" not in text, text
        assert "abandoned" not in text, text
        steps = [int(s) for s in re.findall(r"step (\d+): loss", text)]
        assert steps == [1, 2, 3, 4, 5, 6], steps
    finally:
        w.close()
        coord.stop()


def test_silent_seed_worker_is_dropped_after_its_timeout(tmp_path: Path) -> None:
    coord, port, _ = coordinator(tmp_path, "--seed-heartbeat-timeout", "1.5")
    w = SeedWorker(port, "mute", heartbeat_every_s=3600.0)
    try:
        t0 = time.monotonic()
        w.register()
        coord.wait_for(r"dropped worker mute \(heartbeat timeout\)", within_s=10)
        assert time.monotonic() - t0 >= 1.5
    finally:
        w.close()
        coord.stop()


def test_seed_worker_trains_beside_two_of_ours(tmp_path: Path) -> None:
    coord, port, _ = coordinator(
        tmp_path, "--max-steps", "5", "--global-batch", "8", "--min-workers", "3"
    )
    ours = [worker(tmp_path, port, f"w{i}") for i in range(2)]
    w = SeedWorker(port, "c-worker", heartbeat_every_s=2.0)
    try:
        w.register()
        w.run()
        assert w.seen[0] == START and w.seen[-1] == SHUTDOWN, w.seen
        assert w.accepted == 5, w.accepted
        coord.wait_for(r"training done at step 5", within_s=10)
        rounds = re.findall(r"step (\d+): loss \S+, (\d+) samples from (\d+) workers", coord.text())
        # Ours share the global batch of 8; the seed worker adds its own 2 x accumulation.
        assert [int(r[0]) for r in rounds] == [1, 2, 3, 4, 5], rounds
        assert all(int(r[2]) == 3 for r in rounds), rounds
        for svc in ours:
            svc.wait_for(r"training done at step 5; exiting", within_s=20)
            assert svc.proc.wait(timeout=20) == 0
        assert math.isfinite(float(re.findall(r"validation loss ([-+.\deE]+)", coord.text())[-1]))
    finally:
        w.close()
        for svc in ours:
            svc.stop()
        coord.stop()
