"""The coordinator's and worker's links answer a message out of order, or tensor sizes that
do not add up, with the ERROR the connection or the check gives it, then close; real
processes and sockets on loopback."""

from __future__ import annotations

import socket
from pathlib import Path

from procs import coordinator

from foundry.model.data import load_corpus
from foundry.wire import fdtc
from foundry.wire.fdtc import ErrorCode


class Peer:
    """Raw FDTC frames over a plain socket, driven by the test."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.dec = fdtc.FdtcDecoder()

    def send(self, *msgs: fdtc.Message) -> None:
        self.sock.sendall(b"".join(fdtc.encode(m) for m in msgs))

    def recv(self) -> fdtc.Message | None:
        """The next message; None once the coordinator closed the connection."""
        while (msg := self.dec.next_event()) is None:
            data = self.sock.recv(1 << 20)
            if not data:
                return None
            self.dec.feed(data)
        return msg

    def answer_then_close(self) -> fdtc.Error:
        """The ERROR the coordinator ends the link with (anything before it skipped)."""
        last: fdtc.Message | None = None
        while (msg := self.recv()) is not None:
            last = msg
        assert isinstance(last, fdtc.Error), last
        return last

    def close(self) -> None:
        self.sock.close()


def _register(peer: Peer, worker_id: str) -> None:
    fp = load_corpus(None).fingerprint
    peer.send(
        fdtc.Dataset(n_tokens=fp.n_tokens, sha256=bytes.fromhex(fp.sha256)),
        fdtc.Register(worker_id=worker_id, protocol_version=fdtc.PROTOCOL_VERSION,
                      profile=fdtc.HardwareProfile.LAPTOP_LIGHT, num_cores=2, memory_mb=4096,
                      suggested_batch_size=4),
    )
    for expected in (fdtc.RegisterAck, fdtc.ModelConfigMsg, fdtc.TrainPlan):
        assert isinstance(peer.recv(), expected)


def test_messages_out_of_order_get_the_connections_error_code(tmp_path: Path) -> None:
    # No rounds: weights go only to a link that asks for them.
    coord, port, admin_port = coordinator(tmp_path, "--max-steps", "1000", "--wait-for-start")
    try:
        cases: list[tuple[int, list[fdtc.Message], ErrorCode, str]] = [
            (port, [fdtc.Heartbeat("w", 0, 0.0, 0.0)], ErrorCode.NOT_REGISTERED,
             "HEARTBEAT is not allowed on a connected link"),
            (port, [fdtc.StatusReq()], ErrorCode.NOT_REGISTERED, "STATUS_REQ is not allowed"),
            (admin_port, [fdtc.Register("w", 1, fdtc.HardwareProfile.SERVER, 1, 1, 1)],
             ErrorCode.UNEXPECTED, "REGISTER is not allowed"),
        ]
        for target, msgs, code, text in cases:
            peer = Peer(target)
            peer.send(*msgs)
            err = peer.answer_then_close()
            assert err.error_code == code and text in err.message, (msgs, err)
            peer.close()
        # Registered, but no weights went over this link: a gradient is out of order.
        peer = Peer(port)
        _register(peer, "early")
        peer.send(fdtc.Gradients("early", 0, 1, fdtc.Compression.NONE, 4, bytes(4)))
        err = peer.answer_then_close()
        assert err.error_code == ErrorCode.UNEXPECTED
        assert "GRADIENTS is not allowed on a registered link" in err.message
        peer.close()
        assert coord.alive()
    finally:
        coord.stop()
