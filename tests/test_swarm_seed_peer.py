"""A worker written only from docs/protocol.md, with raw sockets and ``struct``.

It speaks the seed's messages and nothing else (no DATASET, so the coordinator sends it no
extension): REGISTER, WEIGHTS_REQ, GRADIENTS, DEREGISTER. Nothing from ``foundry.wire`` is used
on purpose: this is what a C implementation of the header would send.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

from procs import coordinator

MAGIC = b"\x43\x54\x44\x46"  # u32 0x46445443 little-endian
REGISTER, REGISTER_ACK, DEREGISTER = 0x01, 0x02, 0x03
HEARTBEAT_ACK, WEIGHTS_REQ, WEIGHTS, WEIGHTS_META = 0x11, 0x20, 0x21, 0x22
GRADIENTS, GRADIENTS_ACK, ERROR = 0x30, 0x31, 0xFF


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
        time.sleep(0.2)
        assert coord.alive()
    finally:
        peer.sock.close()
        coord.stop()
