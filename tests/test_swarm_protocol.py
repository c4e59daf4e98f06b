"""The coordinator's and worker's links answer a message out of order, or tensor sizes that
do not add up, with the ERROR the connection or the check gives it, then close; real
processes and sockets on loopback."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import numpy as np
from procs import coordinator, worker

from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import load_corpus
from foundry.swarm.model_config import model_config_msg
from foundry.wire import fdtc
from foundry.wire.fdtc import ErrorCode


class Peer:
    """Raw FDTC frames over a plain socket, driven by the test."""

    def __init__(self, port: int, sock: socket.socket | None = None) -> None:
        self.sock = sock or socket.create_connection(("127.0.0.1", port), timeout=20)
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
        fdtc.Register(
            worker_id=worker_id,
            protocol_version=fdtc.PROTOCOL_VERSION,
            profile=fdtc.HardwareProfile.LAPTOP_LIGHT,
            num_cores=2,
            memory_mb=4096,
            suggested_batch_size=4,
        ),
    )
    for expected in (fdtc.RegisterAck, fdtc.ModelConfigMsg, fdtc.TrainPlan):
        assert isinstance(peer.recv(), expected)


def test_messages_out_of_order_get_the_connections_error_code(tmp_path: Path) -> None:
    # No rounds: weights go only to a link that asks for them.
    coord, port, admin_port = coordinator(tmp_path, "--max-steps", "1000", "--wait-for-start")
    try:
        cases: list[tuple[int, list[fdtc.Message], ErrorCode, str]] = [
            (
                port,
                [fdtc.Heartbeat("w", 0, 0.0, 0.0)],
                ErrorCode.NOT_REGISTERED,
                "HEARTBEAT is not allowed on a connected link",
            ),
            (port, [fdtc.StatusReq()], ErrorCode.NOT_REGISTERED, "STATUS_REQ is not allowed"),
            (
                admin_port,
                [fdtc.Register("w", 1, fdtc.HardwareProfile.SERVER, 1, 1, 1)],
                ErrorCode.UNEXPECTED,
                "REGISTER is not allowed",
            ),
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


def test_gradients_whose_uncompressed_size_does_not_fit_the_model_are_refused(
    tmp_path: Path,
) -> None:
    coord, port, _ = coordinator(tmp_path, "--max-steps", "1000", "--wait-for-start")
    try:
        peer = Peer(port)
        _register(peer, "sizes")
        peer.send(fdtc.WeightsReq())
        meta = peer.recv()
        assert isinstance(meta, fdtc.WeightsMeta) and isinstance(peer.recv(), fdtc.Weights)
        numels = [t.numel for t in meta.tensors]
        data = b"".join(np.zeros(n, "<f4").tobytes() for n in numels)

        def gradients(uncompressed_size: int) -> fdtc.Gradients:
            return fdtc.Gradients(
                "sizes", 7, len(numels), fdtc.Compression.NONE, uncompressed_size, data
            )

        # The right size for a step no round runs: taken, acknowledged as stale.
        peer.send(gradients(4 * sum(numels)))
        ack = peer.recv()
        assert isinstance(ack, fdtc.GradientsAck) and not ack.accepted
        peer.send(gradients(4 * sum(numels) - 4))
        err = peer.answer_then_close()
        assert err.error_code == ErrorCode.MODEL_MISMATCH
        assert f"GRADIENTS says uncompressed_size {4 * sum(numels) - 4}" in err.message
        assert f"= {4 * sum(numels)} bytes" in err.message
        peer.close()
        assert coord.alive()
    finally:
        coord.stop()


def test_an_update_whose_uncompressed_size_does_not_fit_is_answered_by_the_worker(
    tmp_path: Path,
) -> None:
    """A real worker against a coordinator played by the test: registration, full weights,
    then an UPDATE claiming one f32 value too few."""
    cfg = ModelConfig()
    shapes = cfg.param_shapes()
    numels = [math.prod(s) for s in shapes.values()]
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    w = worker(tmp_path, listener.getsockname()[1], "w-sizes")
    try:
        conn, _ = listener.accept()
        conn.settimeout(30)
        peer = Peer(0, conn)
        assert isinstance(peer.recv(), fdtc.Dataset)
        assert isinstance(peer.recv(), fdtc.Register)
        peer.send(
            fdtc.RegisterAck(True, 0, 1, 4, 1, fdtc.Compression.NONE, 0.0, 0),
            model_config_msg(cfg),
            fdtc.TrainPlan(
                sync_every=1,
                digest_every=0,
                down_compression=fdtc.Compression.NONE,
                lr=1e-3,
                warmup_steps=0,
                total_steps=10,
                min_lr_ratio=0.1,
                weight_decay=0.0,
                grad_clip=1.0,
            ),
        )
        while not isinstance(msg := peer.recv(), fdtc.WeightsReq):
            assert msg is not None
        peer.send(
            *fdtc.weights_messages(
                {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}, 0, 1e-3
            )
        )
        data = b"".join(np.zeros(n, "<f4").tobytes() for n in numels)
        peer.send(
            fdtc.Update(
                global_step=1,
                base_step=0,
                compression=fdtc.Compression.NONE,
                num_tensors=len(numels),
                uncompressed_size=4 * sum(numels) - 4,
                data=data,
            )
        )
        err = peer.answer_then_close()  # heartbeats before it are skipped
        assert err.error_code == ErrorCode.MODEL_MISMATCH
        assert f"UPDATE says uncompressed_size {4 * sum(numels) - 4}" in err.message
        peer.close()
        w.wait_for(r"bad bytes from the coordinator: UPDATE says uncompressed_size", 30)
    finally:
        w.stop()
        listener.close()
