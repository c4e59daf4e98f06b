"""What the gateway costs, measured in one run against real backends.

It starts, as processes and through their CLI, a tensor-parallel pair on a tiny model
(`foundry model init`, `foundry tp-leader`, `foundry tp-worker`), a coordinator waiting for
START (`foundry coordinator --wait-for-start`) and `foundry gateway` in front of both, then:

1. generation throughput: greedy generations of ``--tokens`` tokens, alternately over the
   frontend link directly (the gateway's own client, in this process) and through the gateway
   (a gRPC stream), ``--rounds`` of each; tokens/s is all tokens over all wall time of each
   path. Target: through the gateway at least 0.95x the direct rate.
2. status latency under load: ``--callers`` concurrent callers (50) each make ``--calls``
   GetTrainingStatus calls back to back through the gateway; p50 and p99 of the per-call
   latency are reported (no target: the number to watch across changes).

Prints a summary and one JSON line (``--json FILE`` also writes it); exit status 1 when the
throughput target is missed.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/gateway.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from foundry.api.v1 import inference_pb2, inference_pb2_grpc, training_pb2, training_pb2_grpc
from foundry.gateway.errors import GatewayError
from foundry.gateway.frontend_client import FrontendClient
from foundry.wire import frontend

TARGET_RATIO = 0.95
PROMPT = "The gateway forwards every token"
GATEWAY_LINE = re.compile(r"gateway listening: grpc (\S+):(\d+)")
COORDINATOR_LINE = re.compile(r"coordinator listening: workers (\S+):(\d+), admin (\S+):(\d+)")
STARTUP_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Services:
    """The backend processes and the gateway, stopped together."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, name: str, *args: str, read_stdout: bool = False) -> subprocess.Popen[str]:
        """``foundry ARGS``; stderr (and stdout unless read here) go to WORKDIR/NAME.log."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1"}
        log = (self.workdir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "foundry", *args],
            stdout=subprocess.PIPE if read_stdout else log, stderr=log, text=True, env=env,
        )
        self.procs.append(proc)
        return proc

    def wait_line(self, proc: subprocess.Popen[str], pattern: re.Pattern[str]) -> re.Match[str]:
        assert proc.stdout is not None
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise SystemExit(f"{proc.args} exited ({proc.poll()}); see {self.workdir}")
            if match := pattern.search(line):
                return match
        raise SystemExit(f"{proc.args} printed no {pattern.pattern!r} line in {STARTUP_S:g} s")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def wait_pair(client: FrontendClient) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        try:
            if (await client.status(2.0)).worker_connected:
                return
        except GatewayError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit(f"the TP pair at {client.address} did not come up in {STARTUP_S:g} s")


async def direct_tokens(client: FrontendClient, tokens: int) -> int:
    n = 0
    async with client.generate(PROMPT, tokens) as generation:
        async for event in generation:
            n += isinstance(event, frontend.Token)
    return n


async def gateway_tokens(stub: inference_pb2_grpc.InferenceServiceStub, tokens: int) -> int:
    n = 0
    request = inference_pb2.GenerateRequest(prompt=PROMPT, max_tokens=tokens, temperature=0.0)
    async for event in stub.Generate(request, timeout=600):
        n += event.HasField("token")
    return n


async def status_latencies(channel: grpc.aio.Channel, callers: int, calls: int) -> list[float]:
    stub = training_pb2_grpc.TrainingServiceStub(channel)
    request = training_pb2.GetTrainingStatusRequest()
    latencies: list[float] = []

    async def caller() -> None:
        for _ in range(calls):
            t0 = time.perf_counter()
            await stub.GetTrainingStatus(request, timeout=30)
            latencies.append(time.perf_counter() - t0)

    await stub.GetTrainingStatus(request, timeout=30)  # connection and pool warm
    await asyncio.gather(*(caller() for _ in range(callers)))
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(args: argparse.Namespace, frontend_port: int, gateway: str) -> dict[str, float]:
    client = FrontendClient("127.0.0.1", frontend_port)
    await wait_pair(client)
    channel = grpc.aio.insecure_channel(gateway)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    try:
        await direct_tokens(client, 8)  # warm both paths
        await gateway_tokens(stub, 8)
        direct_s = gateway_s = 0.0
        direct_n = gateway_n = 0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            direct_n += await direct_tokens(client, args.tokens)
            direct_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            gateway_n += await gateway_tokens(stub, args.tokens)
            gateway_s += time.perf_counter() - t0
        latencies = await status_latencies(channel, args.callers, args.calls)
    finally:
        await channel.close()
        await client.close()
    direct_rate, gateway_rate = direct_n / direct_s, gateway_n / gateway_s
    return {
        "direct_tokens_per_s": direct_rate,
        "gateway_tokens_per_s": gateway_rate,
        "ratio": gateway_rate / direct_rate,
        "status_p50_ms": 1e3 * statistics.median(latencies),
        "status_p99_ms": 1e3 * percentile(latencies, 0.99),
        "status_calls": float(len(latencies)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per generation")
    parser.add_argument("--rounds", type=int, default=5, help="generations per path")
    parser.add_argument("--callers", type=int, default=50, help="concurrent status callers")
    parser.add_argument("--calls", type=int, default=20, help="status calls per caller")
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF to serve (default: a fresh `foundry model init --preset tiny`)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="foundry-bench-gateway-") as tmp:
        workdir = Path(tmp)
        model = args.model or workdir / "model.gguf"
        if args.model is None:
            subprocess.run(
                [sys.executable, "-m", "foundry", "model", "init", "--preset", "tiny",
                 "--out", str(model)],
                check=True, timeout=STARTUP_S,
            )
        services = Services(workdir)
        try:
            tp_port, frontend_port = free_port(), free_port()
            services.spawn("tp-leader", "tp-leader", "--model", str(model),
                           "--listen", f"127.0.0.1:{tp_port}",
                           "--frontend-listen", f"127.0.0.1:{frontend_port}")
            services.spawn("tp-worker", "tp-worker", "--model", str(model),
                           "--leader", f"127.0.0.1:{tp_port}")
            coordinator = services.spawn(
                "coordinator", "coordinator", "--listen", "127.0.0.1:0",
                "--admin-listen", "127.0.0.1:0", "--checkpoint-dir", str(workdir / "ckpt"),
                "--preset", "tiny", "--wait-for-start", read_stdout=True,
            )
            admin = services.wait_line(coordinator, COORDINATOR_LINE)
            gateway = services.spawn(
                "gateway", "gateway", "--listen", "127.0.0.1:0",
                "--coordinator-admin", f"127.0.0.1:{admin.group(4)}",
                "--tp-frontend", f"127.0.0.1:{frontend_port}", read_stdout=True,
            )
            bound = services.wait_line(gateway, GATEWAY_LINE)
            results = asyncio.run(
                measure(args, frontend_port, f"127.0.0.1:{bound.group(2)}")
            )
        finally:
            services.stop()

    ok = results["ratio"] >= TARGET_RATIO
    print(f"generate, {args.rounds} x {args.tokens} tokens, greedy:")
    print(f"  direct frontend link  {results['direct_tokens_per_s']:8.1f} tokens/s")
    print(f"  through the gateway   {results['gateway_tokens_per_s']:8.1f} tokens/s")
    print(f"  ratio                 {results['ratio']:8.3f}  (target >= {TARGET_RATIO}) "
          f"{'PASS' if ok else 'FAIL'}")
    print(f"GetTrainingStatus, {args.callers} concurrent callers x {args.calls} calls:")
    print(f"  p50 {results['status_p50_ms']:.2f} ms   p99 {results['status_p99_ms']:.2f} ms")
    line = json.dumps({"bench": "gateway", **results, "pass": ok})
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
