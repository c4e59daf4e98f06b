"""FRAGMENT: messages larger than one FDTC frame, cut by ``encode_parts`` and reassembled by the
decoder, admitted by the connection only where the link's table takes the message, and timed
frame by frame by the stream.

Here a real coordinator whose worker links must fragment: weights out, gradients in, the
medium preset.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
from fragments import split_frames
from procs import coordinator, worker

from foundry.model.text.data import load_corpus
from foundry.wire import fdtc
from foundry.wire.fdtc import (
    FRAGMENT_SIZE,
    MAX_MESSAGE,
    MAX_PAYLOAD,
    Compression,
    Dataset,
    ErrorCode,
    FdtcDecoder,
    Gradients,
    HardwareProfile,
    Heartbeat,
    Register,
    RegisterAck,
    Weights,
    WeightsMeta,
    encode,
)
from foundry.wire.fdtc_connection import FdtcConnection
from foundry.wire.fdtc_lifecycle import Role


class FragmentingPeer:
    """A worker driven by the test over our own FdtcConnection, whose decoder takes no frame
    over 64 KiB: the coordinator's 1 MB weights reach it only as fragments."""

    def __init__(self, port: int, max_payload: int = 64 << 10, fragment_size: int = 4096) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.conn = FdtcConnection(Role.WORKER, max_payload=max_payload)
        self.conn.allow_fragments(MAX_MESSAGE, fragment_size)
        self.frames_out = 0

    def join(self, worker_id: str) -> tuple[WeightsMeta, Weights]:
        """DATASET, REGISTER, then WEIGHTS_REQ: the weights the coordinator sends."""
        fp = load_corpus(None).fingerprint
        self.send(
            Dataset(n_tokens=fp.n_tokens, sha256=bytes.fromhex(fp.sha256)),
            Register(worker_id, fdtc.PROTOCOL_VERSION, HardwareProfile.LAPTOP_LIGHT, 2, 4096, 4),
        )
        self.recv(fdtc.TrainPlan)
        self.send(fdtc.WeightsReq())
        meta = self.recv(WeightsMeta)
        weights = self.recv(Weights)
        assert isinstance(meta, WeightsMeta) and isinstance(weights, Weights)
        assert len(weights.data) == meta.nbytes
        return meta, weights

    def send(self, *msgs: fdtc.Message) -> None:
        pieces = self.conn.send(*msgs)
        self.frames_out += len(split_frames(pieces))
        self.sock.sendall(b"".join(bytes(p) for p in pieces))

    def recv(self, *types: type[fdtc.Message]) -> fdtc.Message:
        deadline = time.monotonic() + 30
        while True:
            event = self.conn.next_event()
            if isinstance(event, types):
                return event
            if event is not None:
                continue
            self.sock.settimeout(0.5)
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                assert time.monotonic() < deadline, "nothing from the coordinator in 30 s"
                self.send(Heartbeat("frag", 0, 0.0, 0.0))
                continue
            assert data, "the coordinator closed the connection"
            self.conn.receive_data(data)


def test_a_coordinator_sends_weights_and_takes_gradients_in_fragments(tmp_path: Path) -> None:
    coord, port, _ = coordinator(
        tmp_path, "--max-steps", "2", "--global-batch", "4", "--fragment-size", "4096"
    )
    peer = FragmentingPeer(port)
    try:
        meta, _ = peer.join("frag")
        assert meta.nbytes > 64 << 10  # more than the peer's decoder takes in one frame
        assign = peer.recv(fdtc.Assign)
        assert isinstance(assign, fdtc.Assign)
        numels = [t.numel for t in meta.tensors]
        data = np.full(sum(numels), 1e-3, "<f4").tobytes()
        before = peer.frames_out
        peer.send(
            Gradients("frag", assign.global_step, len(numels), Compression.NONE, len(data), data)
        )
        assert peer.frames_out - before == -(-len(data) // 4096)  # in fragments of 4096
        ack = peer.recv(fdtc.GradientsAck)
        assert isinstance(ack, fdtc.GradientsAck) and ack.accepted
        coord.wait_for(r"step 1: loss", within_s=30)
    finally:
        peer.sock.close()
        coord.stop()
    assert "worker link: closing" not in coord.text()


def test_workers_train_with_fragments_both_ways(tmp_path: Path) -> None:
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        "4",
        "--global-batch",
        "8",
        "--sync-every",
        "2",
        "--min-workers",
        "2",
        "--fragment-size",
        "4096",
    )
    workers = [worker(tmp_path, port, f"w{i}", "--fragment-size", "4096") for i in range(2)]
    try:
        coord.wait_for(r"training done at step 4", within_s=180)
        log = coord.text()
        assert log.count("samples from 2 workers") == 2, log[-3000:]
        for w in workers:
            w.wait_for(r"training done at step 4; exiting", within_s=30)
    finally:
        for w in workers:
            w.stop()
        coord.stop()
    assert "worker link: closing" not in log, log[-3000:]


def test_the_medium_preset_reaches_a_worker_and_a_seed_only_peer_is_told_why_not(
    tmp_path: Path,
) -> None:
    """482 MiB of float32 weights: more than one frame carries, so a seed-only peer is refused
    with the reason, and a peer of ours gets them in FRAGMENT frames of 64 MiB."""
    coord, port, _ = coordinator(tmp_path, "--preset", "medium", "--max-steps", "1")
    try:
        seed = socket.create_connection(("127.0.0.1", port), timeout=30)
        seed.sendall(encode(Register("seed", 1, HardwareProfile.LAPTOP_LIGHT, 2, 4096, 4)))
        dec = FdtcDecoder()
        got: list[fdtc.Message] = []
        while len(got) < 2:
            data = seed.recv(1 << 16)
            assert data, f"closed after {got}"
            dec.feed(data)
            got += list(dec.events())
        ack, error = got
        assert isinstance(ack, RegisterAck) and not ack.accepted
        assert isinstance(error, fdtc.Error) and error.error_code == ErrorCode.REJECTED
        assert "482 MiB of float32 weights" in error.message and "FRAGMENT" in error.message
        seed.close()

        # A peer of ours as shipped: frames up to 256 MiB, slices of 64 MiB.
        peer = FragmentingPeer(port, max_payload=MAX_PAYLOAD, fragment_size=FRAGMENT_SIZE)
        meta, weights = peer.join("ours")
        assert meta.nbytes > MAX_PAYLOAD
        tensors = fdtc.weights_tensors(meta, weights)
        assert all(np.isfinite(t).all() for t in tensors.values())
        peer.sock.close()
    finally:
        coord.stop()
