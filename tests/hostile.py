"""What the hostile-input tests share: the CLI run as a process, a served pair and gateway,
tiny models, GGUF bytes.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from procs import ENV, Service
from tp_harness import CFG, LeaderProc, Proc, start_leader, start_worker, wait_paired

from foundry.model.formats.checkpoint import CheckpointState
from foundry.model.formats.checkpoint_dir import save_checkpoint
from foundry.model.nn import transformer as T
from foundry.model.spec.config import ModelConfig

GATEWAY_LINE = r"gateway listening: grpc 127\.0\.0\.1:(\d+)"
F32 = np.float32


def foundry(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """One ``foundry`` command run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "foundry", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )


def base_params(cfg: ModelConfig = CFG) -> dict[str, np.ndarray]:
    """Random weights, perturbed beyond init so routing varies per token (tp_harness's)."""
    rng = np.random.default_rng(100)
    params = T.init_params(cfg, seed=0)
    for p in params.values():
        p += F32(0.1) * rng.standard_normal(p.shape, dtype=F32)
    return params


@dataclass
class Stack:
    leader: LeaderProc
    worker: Proc
    gateway: Service
    target: str


@contextlib.contextmanager
def serving(model: Path, logs: Path, *leader_flags: str) -> Iterator[Stack]:
    """tp-leader + tp-worker + gateway processes on 127.0.0.1 serving ``model``."""
    leader = start_leader(model, logs / "leader.log", *leader_flags)
    worker = start_worker(model, leader.port, logs / "worker.log")
    gateway = Service(
        [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--coordinator-admin",
            f"127.0.0.1:{free_port()}",
            "--tp-frontend",
            f"127.0.0.1:{leader.frontend}",
        ],
        logs / "gateway.log",
    )
    try:
        wait_paired(leader.frontend)
        target = "127.0.0.1:" + gateway.wait_for(GATEWAY_LINE).group(1)
        yield Stack(leader, worker, gateway, target)
    finally:
        gateway.stop()
        leader.proc.stop(signal.SIGCONT)  # a test that stopped it
        leader.proc.stop()
        worker.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ctl_generate(target: str, prompt: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return foundry("ctl", "--gateway", target, "generate", "--prompt", prompt, *extra)


def write_checkpoint(
    directory: Path, step: int, params: dict[str, np.ndarray] | None = None, keep_last: int = 100
) -> Path:
    state = CheckpointState(
        config=CFG,
        step=step,
        params=params or base_params(),
        optimizer={"step": 0, "m": {}, "v": {}},
        data_position=0,
    )
    return save_checkpoint(directory, state, keep_last=keep_last)


HTTP_LINE = r"http 127\.0\.0\.1:(\d+)"


def gguf_with(
    src: Path,
    dst: Path,
    set_keys: dict[str, bytes] | None = None,
    drop: tuple[str, ...] = (),
    repeat_tensor: bool = False,
) -> Path:
    """``src`` (a GGUF file) rewritten as ``dst`` with metadata values replaced or added
    (``set_keys``: key -> the GGUF value type and value, as the bytes the file holds) and
    keys dropped; ``repeat_tensor`` lists the first tensor twice in the tensor table."""
    raw = src.read_bytes()
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", raw, 4)
    pos = 24
    entries: dict[str, bytes] = {}
    for _ in range(n_kv):
        key, pos = _gguf_string(raw, pos)
        start = pos
        pos = _gguf_skip(raw, pos + 4, struct.unpack_from("<I", raw, pos)[0])
        entries[key] = raw[start:pos]
    table_start = pos
    infos = []
    for _ in range(n_tensors):
        begin = pos
        _, pos = _gguf_string(raw, pos)
        n_dims = struct.unpack_from("<I", raw, pos)[0]
        pos += 4 + 8 * n_dims + 12
        infos.append(raw[begin:pos])
    assert table_start < pos
    align = 32
    data = raw[-(-pos // align) * align :]
    for key in drop:
        del entries[key]
    entries.update(set_keys or {})
    if repeat_tensor:
        infos.append(infos[0])
    out = b"GGUF" + struct.pack("<IQQ", version, len(infos), len(entries))
    out += b"".join(_gguf_str(k) + v for k, v in entries.items()) + b"".join(infos)
    dst.write_bytes(out + bytes(-len(out) % align) + data)
    return dst


_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_string(raw: bytes, pos: int) -> tuple[str, int]:
    n = struct.unpack_from("<Q", raw, pos)[0]
    return raw[pos + 8 : pos + 8 + n].decode(), pos + 8 + n


def _gguf_skip(raw: bytes, pos: int, vtype: int) -> int:
    if vtype == 8:
        return _gguf_string(raw, pos)[1]
    if vtype == 9:
        etype, n = struct.unpack_from("<IQ", raw, pos)
        pos += 12
        if etype in _GGUF_SCALAR:
            return pos + n * _GGUF_SCALAR[etype]
        for _ in range(n):
            pos = _gguf_skip(raw, pos, etype)
        return pos
    return pos + _GGUF_SCALAR[vtype]


def _gguf_str(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_value(vtype: str, value: Any) -> bytes:
    """A metadata value as a GGUF file holds it: its u32 type, then the value."""
    if vtype == "str":
        return struct.pack("<I", 8) + _gguf_str(value)
    if vtype == "str[]":
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(map(_gguf_str, value))
    code, fmt = {"u32": (4, "<I"), "i32": (5, "<i"), "f32": (6, "<f"), "bool": (7, "<?")}[vtype]
    return struct.pack("<I", code) + struct.pack(fmt, value)


@contextlib.contextmanager
def http_serving(model: Path, logs: Path, *gateway_flags: str) -> Iterator[tuple[Stack, int]]:
    """tp-leader + tp-worker + a gateway with its HTTP door, serving ``model``."""
    leader = start_leader(model, logs / "leader.log")
    worker_proc = start_worker(model, leader.port, logs / "worker.log")
    gateway = Service(
        [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--coordinator-admin",
            f"127.0.0.1:{free_port()}",
            "--tp-frontend",
            f"127.0.0.1:{leader.frontend}",
            *gateway_flags,
        ],
        logs / "gateway.log",
    )
    try:
        wait_paired(leader.frontend)
        port = int(gateway.wait_for(HTTP_LINE).group(1))
        target = "127.0.0.1:" + gateway.wait_for(GATEWAY_LINE).group(1)
        yield Stack(leader, worker_proc, gateway, target), port
    finally:
        gateway.stop()
        leader.proc.stop()
        worker_proc.stop()


def http_call(
    port: int, method: str, path: str, body: Any = None, timeout: float = 60.0
) -> tuple[int, dict[str, Any], float]:
    """One request: status, the JSON body (or {"raw": text}), seconds taken."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            method,
            path,
            None if body is None else json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        r = conn.getresponse()
        raw = r.read().decode()
    finally:
        conn.close()
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        parsed = {"raw": raw}
    return r.status, parsed, time.monotonic() - t0
