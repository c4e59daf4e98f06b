"""What the gateway costs, measured in one run against real backends.

It starts, as processes and through their CLI, a tensor-parallel pair (`foundry tp-leader`,
`foundry tp-worker`, default flags), a coordinator waiting for START (`foundry coordinator
--wait-for-start`) and `foundry gateway` in front of both, then:

1. generation throughput: greedy generations of ``--tokens`` tokens, over the frontend link
   directly (the gateway's own client, in this process), through the gateway's gRPC API (a
   stream) and through its OpenAI-compatible HTTP API (``/v1/completions`` streamed as
   server-sent events, read with the ``openai`` package's HTTP client), ``--rounds``
   rounds of one generation per path, the paths taking turns to go first. Tokens/s of a path
   is all its tokens over all its wall time; a ratio is the median over rounds of a path's rate
   over the direct rate of the same round, so that load from other processes, which drifts
   over seconds, weighs on both sides of each ratio alike. Time to first token (median over
   rounds) is from the request to the first token's text, per path.
   Target: both ratios at least 0.95. Every generation must run to ``--tokens`` (an early EOS
   would time the call's setup instead of the stream). Also reported: CPU milliseconds per
   token of each process (pair, gateway, this client), which the scheduling noise of a small
   machine moves far less than the wall-clock rates, and the mean tokens per gRPC message
   (the gateway sends the tokens ready at once as one message: 1.0 while it keeps up with the
   pair, more when it falls behind).
2. status latency under load: ``--callers`` concurrent callers (50) each make ``--calls`` calls
   back to back through the gateway, first GetTrainingStatus (the coordinator's admin link),
   then GetPairStatus (the leader's frontend link); p50 and p99 of the per-call latency are
   reported (no target: the numbers to watch across changes).

The default model is a preset (``--preset``, default tiny) with its initial weights perturbed
by a seeded normal (0.1): the bare initial weights end a greedy generation of the default prompt
after two tokens.

Prints a summary and one JSON line (``--json FILE`` also writes it); exit status 1 when the
throughput target is missed.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/performance/gateway.py [--preset small]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import harness
import numpy as np
import openai

from foundry.api.v1 import inference_pb2, inference_pb2_grpc, training_pb2, training_pb2_grpc
from foundry.gateway.errors import GatewayError
from foundry.gateway.frontend_client import FrontendClient
from foundry.model.formats.gguf_io import save_gguf
from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import PRESETS, preset
from foundry.wire import frontend

TARGET_RATIO = 0.95
PROMPT = "The gateway forwards every token"
LEADER_LINE = re.compile(r"tp-leader listening: workers (\S+):(\d+), frontend (\S+):(\d+)")
GATEWAY_LINE = re.compile(r"gateway listening: grpc (\S+):(\d+), http (\S+):(\d+)")
COORDINATOR_LINE = re.compile(r"coordinator listening: workers (\S+):(\d+), admin (\S+):(\d+)")
STARTUP_S = 120.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def write_model(path: Path, preset_name: str, seed: int = 0) -> None:
    """A preset, its initial weights perturbed so that greedy text varies per token."""
    cfg = preset(preset_name)
    rng = np.random.default_rng(seed + 100)
    params = init_params(cfg, seed=seed)
    for p in params.values():
        p += np.float32(0.1) * rng.standard_normal(p.shape, dtype=np.float32)
    save_gguf(path, cfg, params)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class Services:
    """The backend processes and the gateway, stopped together."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def spawn(self, name: str, *args: str, read_stdout: bool = False) -> subprocess.Popen[str]:
        """``foundry ARGS``; stderr (and stdout unless read here) go to WORKDIR/NAME.log."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1"}
        log = (self.workdir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "foundry", *args],
            stdout=subprocess.PIPE if read_stdout else log,
            stderr=log,
            text=True,
            env=env,
        )
        self.procs[name] = proc
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
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs.values()):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


class CpuMeter:
    """CPU seconds of the pair, the gateway and this process, summed over measured spans."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.spent = {name: 0.0 for name in [*pids, "client"]}

    def snapshot(self) -> dict[str, float]:
        now = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        now["client"] = time.process_time()
        return now

    def add(self, before: dict[str, float]) -> None:
        for name, value in self.snapshot().items():
            self.spent[name] += value - before[name]


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


def check_length(n: int, tokens: int) -> int:
    if n != tokens:
        raise SystemExit(
            f"a generation ended after {n} of {tokens} tokens (EOS or a full context), so it "
            "would time the call's setup; use a smaller --tokens or another --model"
        )
    return n


# (tokens, messages, seconds to the first token) of one generation.
Run = tuple[int, int, float]


async def direct_tokens(client: FrontendClient, tokens: int) -> Run:
    """One generation straight on the frontend link, which sends a frame per token."""
    n = 0
    t0 = time.perf_counter()
    first = 0.0
    async with client.generate(PROMPT, tokens) as generation:
        async for event in generation:
            if isinstance(event, frontend.Token):
                n += 1
                first = first or time.perf_counter() - t0
    return check_length(n, tokens), n, first


async def gateway_tokens(stub: inference_pb2_grpc.InferenceServiceStub, tokens: int) -> Run:
    """One generation through the gateway's gRPC API."""
    n = messages = 0
    t0 = time.perf_counter()
    first = 0.0
    request = inference_pb2.GenerateRequest(prompt=PROMPT, max_tokens=tokens, temperature=0.0)
    async for event in stub.Generate(request, timeout=600):
        n += len(event.tokens)
        messages += 1
        first = first or time.perf_counter() - t0
    return check_length(n, tokens), messages, first


async def http_tokens(http: openai.DefaultAsyncHttpxClient, base: str, tokens: int) -> Run:
    """One generation through the gateway's OpenAI-compatible API, streamed: the server-sent
    events read line by line with the ``openai`` package's own HTTP client, each chunk parsed
    as JSON (the package's typed chunk objects would time the client's pydantic, not the
    gateway); the token count is the stream's usage."""
    n = messages = 0
    t0 = time.perf_counter()
    first = 0.0
    body = {
        "model": "foundry",
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.stream("POST", f"{base}/completions", json=body, timeout=600) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                messages += 1
                first = first or time.perf_counter() - t0
    return check_length(n, tokens), messages, first


async def latencies(call: Callable[[], Awaitable[object]], callers: int, calls: int) -> list[float]:
    measured: list[float] = []

    async def caller() -> None:
        for _ in range(calls):
            t0 = time.perf_counter()
            await call()
            measured.append(time.perf_counter() - t0)

    await call()  # connection and pool warm
    await asyncio.gather(*(caller() for _ in range(callers)))
    return measured


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(
    args: argparse.Namespace,
    frontend_port: int,
    gateway: str,
    http: str,
    pids: dict[str, int],
) -> dict[str, float]:
    client = FrontendClient("127.0.0.1", frontend_port)
    await wait_pair(client)
    channel = grpc.aio.insecure_channel(gateway)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    web = openai.DefaultAsyncHttpxClient()
    paths: dict[str, Callable[[], Awaitable[Run]]] = {
        "direct": lambda: direct_tokens(client, args.tokens),
        "gateway": lambda: gateway_tokens(stub, args.tokens),
        "http": lambda: http_tokens(web, f"http://{http}/v1", args.tokens),
    }
    seconds = {name: 0.0 for name in paths}
    tokens = {name: 0 for name in paths}
    messages = {name: 0 for name in paths}
    firsts: dict[str, list[float]] = {name: [] for name in paths}
    meters = {name: CpuMeter(pids) for name in paths}
    ratios: dict[str, list[float]] = {"gateway": [], "http": []}
    try:
        for run in paths.values():  # warm every path
            await run()
        for i in range(args.rounds):
            rate = {}
            order = sorted(paths)
            for name in order[i % len(order) :] + order[: i % len(order)]:
                before = meters[name].snapshot()
                t0 = time.perf_counter()
                n, sent, first = await paths[name]()
                spent = time.perf_counter() - t0
                meters[name].add(before)
                tokens[name] += n
                messages[name] += sent
                seconds[name] += spent
                firsts[name].append(first)
                rate[name] = n / spent
            for name in ratios:
                ratios[name].append(rate[name] / rate["direct"])
        training = training_pb2_grpc.TrainingServiceStub(channel)
        training_status = await latencies(
            lambda: training.GetTrainingStatus(training_pb2.GetTrainingStatusRequest(), timeout=30),
            args.callers,
            args.calls,
        )
        pair_status = await latencies(
            lambda: stub.GetPairStatus(inference_pb2.GetPairStatusRequest(), timeout=30),
            args.callers,
            args.calls,
        )
    finally:
        await web.aclose()
        await channel.close()
        await client.close()
    results = {
        "direct_tokens_per_s": tokens["direct"] / seconds["direct"],
        "gateway_tokens_per_s": tokens["gateway"] / seconds["gateway"],
        "http_tokens_per_s": tokens["http"] / seconds["http"],
        "ratio": harness.median(ratios["gateway"]),
        "ratio_min": min(ratios["gateway"]),
        "ratio_max": max(ratios["gateway"]),
        "http_ratio": harness.median(ratios["http"]),
        "http_ratio_min": min(ratios["http"]),
        "http_ratio_max": max(ratios["http"]),
        "gateway_tokens_per_message": tokens["gateway"] / messages["gateway"],
        "http_tokens_per_chunk": tokens["http"] / messages["http"],
    }
    for name, values in firsts.items():
        results[f"{name}_ttft_ms"] = 1e3 * harness.median(values)
    for name, meter in meters.items():
        for process, spent in meter.spent.items():
            results[f"{name}_cpu_ms_per_token_{process}"] = 1e3 * spent / tokens[name]
    for name, values in (("training_status", training_status), ("pair_status", pair_status)):
        results[f"{name}_p50_ms"] = 1e3 * harness.median(values)
        results[f"{name}_p99_ms"] = 1e3 * percentile(values, 0.99)
        results[f"{name}_calls"] = float(len(values))
    return results


def model_label(args: argparse.Namespace) -> str:
    return str(args.model) if args.model else f"perturbed {args.preset} preset"


def report(args: argparse.Namespace, results: dict[str, float]) -> None:
    print(f"generate, {args.rounds} x {args.tokens} tokens per path, greedy, {model_label(args)}:")
    print(f"  direct frontend link  {results['direct_tokens_per_s']:8.1f} tokens/s")
    print(f"  through the gateway   {results['gateway_tokens_per_s']:8.1f} tokens/s")
    print(f"  through HTTP          {results['http_tokens_per_s']:8.1f} tokens/s")
    for key, label in (("ratio", "gRPC"), ("http_ratio", "HTTP")):
        good = results[key] >= TARGET_RATIO
        print(
            f"  {label} ratio, median of {args.rounds} rounds {results[key]:6.3f}  "
            f"(target >= {TARGET_RATIO}) {'PASS' if good else 'FAIL'}; rounds "
            f"{results[key + '_min']:.2f} to {results[key + '_max']:.2f}"
        )
    print(
        f"  time to first token, median: direct {results['direct_ttft_ms']:.2f} ms, gRPC "
        f"{results['gateway_ttft_ms']:.2f} ms, HTTP {results['http_ttft_ms']:.2f} ms"
    )
    print(
        f"  tokens per gRPC message through the gateway, mean "
        f"{results['gateway_tokens_per_message']:.2f}; per HTTP chunk "
        f"{results['http_tokens_per_chunk']:.2f}"
    )
    print("  CPU ms per token       leader  worker  gateway  client")
    for name in ("direct", "gateway", "http"):
        cells = "".join(
            f"{results[f'{name}_cpu_ms_per_token_{p}']:8.3f}"
            for p in ("tp-leader", "tp-worker", "gateway", "client")
        )
        print(f"    {name:<20}{cells}")
    print(f"{args.callers} concurrent callers x {args.calls} calls each:")
    for name, label in (("training_status", "GetTrainingStatus"), ("pair_status", "GetPairStatus")):
        print(
            f"  {label:<18} p50 {results[f'{name}_p50_ms']:7.2f} ms   "
            f"p99 {results[f'{name}_p99_ms']:7.2f} ms"
        )


def main() -> int:
    parser = harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per generation")
    parser.add_argument("--rounds", type=int, default=10, help="generations per path")
    parser.add_argument("--callers", type=int, default=50, help="concurrent status callers")
    parser.add_argument("--calls", type=int, default=20, help="status calls per caller")
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="model preset to perturb and serve, and the coordinator's (default tiny; see above)",
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="GGUF to serve instead of the perturbed preset"
    )
    harness.add_json_flag(parser)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="foundry-bench-gateway-") as tmp:
        workdir = Path(tmp)
        model = args.model or workdir / "model.gguf"
        if args.model is None:
            write_model(model, args.preset)
        services = Services(workdir)
        try:
            leader = services.spawn(
                "tp-leader",
                "tp-leader",
                "--model",
                str(model),
                "--listen",
                "127.0.0.1:0",
                "--frontend-listen",
                "127.0.0.1:0",
                read_stdout=True,
            )
            bound = services.wait_line(leader, LEADER_LINE)
            frontend_port = int(bound.group(4))
            services.spawn(
                "tp-worker",
                "tp-worker",
                "--model",
                str(model),
                "--leader",
                f"127.0.0.1:{bound.group(2)}",
            )
            coordinator = services.spawn(
                "coordinator",
                "coordinator",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--checkpoint-dir",
                str(workdir / "ckpt"),
                "--preset",
                args.preset,
                "--wait-for-start",
                read_stdout=True,
            )
            admin = services.wait_line(coordinator, COORDINATOR_LINE)
            gateway = services.spawn(
                "gateway",
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
                "--coordinator-admin",
                f"127.0.0.1:{admin.group(4)}",
                "--tp-frontend",
                f"127.0.0.1:{frontend_port}",
                read_stdout=True,
            )
            listening = services.wait_line(gateway, GATEWAY_LINE)
            pids = {
                name: services.procs[name].pid for name in ("tp-leader", "tp-worker", "gateway")
            }
            results = asyncio.run(
                measure(
                    args,
                    frontend_port,
                    f"127.0.0.1:{listening.group(2)}",
                    f"127.0.0.1:{listening.group(4)}",
                    pids,
                )
            )
        finally:
            services.stop()

    ok = results["ratio"] >= TARGET_RATIO and results["http_ratio"] >= TARGET_RATIO
    report(args, results)
    harness.emit("gateway", {"model": model_label(args), **results}, ok, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
