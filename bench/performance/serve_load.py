"""The pair behind the gateway under load: aggregate tokens/s, time to first token and
inter-token latency for 1, 4, 8 and 16 concurrent clients, and prompt reuse across a chat's
turns; llama.cpp's ``llama-batched-bench`` on the same file in the same run as the baseline.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/performance/serve_load.py --model FILE.gguf
        [--clients 1,4,8,16] [--tokens 64] [--rank-args "--threads 8"]
        [--llama-batched-bench PATH [--llama-threads 16] [--llama-args ARGS]] [--turns 10]
        [--json PATH]

1. **Load.** It starts `foundry tp-leader`, `foundry tp-worker` and `foundry gateway` as
   processes (``--rank-args`` goes to both ranks, e.g. their thread counts), then for each
   client count N: N gRPC streams at once (``InferenceService.Generate``), each a different
   prompt of about 32 tokens and ``--tokens`` tokens, sampled at temperature 0.8 with a seed per
   client (so no stream ends at the first end-of-text; ``--temperature 0`` makes it greedy).
   Aggregate tokens/s is every stream's tokens over the wall time from the first request to
   the last token (the prompts' prefill included); its generation rate is the tokens that
   arrive after every stream has its first one, over the time from then to the last token
   (the prompts done, as llama-batched-bench's S_TG); time to first token (TTFT) is per
   stream from its request; inter-token latency (ITL) is the gap between a stream's
   consecutive tokens (a message of k tokens counts k gaps of its
   gap / k). p50 and p99 of each.
2. **Baseline.** With ``--llama-batched-bench``, llama.cpp runs the same file with
   ``-t --llama-threads -npp 32 -ntg TOKENS -npl N`` for the same client counts. Each of the two
   rates above has its like for like: the whole run against N x TOKENS over llama.cpp's whole
   time T (its prompts' T_PP and generation's T_TG), the generation rate against its S_TG
   (aggregate generation tokens/s). Target (issue: many clients): the pair at 16 clients at
   least 0.8x, on the generation rates.
3. **Prompt reuse.** One conversation of ``--turns`` turns through ``/v1/chat/completions``,
   each turn the conversation so far plus a new user message of the same length, greedy, 16
   tokens an answer: TTFT of every turn, once with the leader's kept sessions (default) and
   once against a second pair started with ``--keep-sessions 0``. Target: the last turn's TTFT
   at most 1.2x the first's with reuse. Each turn also prints its prompt tokens and those the
   leader evaluated (the rest came from a kept session: ``foundry_tp_prompt_tokens_reused_total``
   from the leader's /metrics), which is the new message and the end of the last reply when
   the reply comes back as the tokens it was generated as; a random model's replies (bytes that
   are not UTF-8, sent as U+FFFD) do not, which the table notes.

Prints a table and one JSON row (bench/harness.py's; also written to ``--json PATH``); exit
status 1 when a target is missed. Every process is stopped by its pid at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import harness

from foundry.api.v1 import inference_pb2, inference_pb2_grpc

LEADER_LINE = re.compile(
    r"tp-leader listening: workers (\S+):(\d+), frontend (\S+):(\d+), "
    r"metrics :(\d+)"
)
REUSED = "foundry_tp_prompt_tokens_reused_total"
GATEWAY_LINE = re.compile(r"gateway listening: grpc (\S+):(\d+), http (\S+):(\d+)")
STARTUP_S = 300.0
LOAD_TARGET = 0.8
REUSE_TARGET = 1.2
TOPICS = [
    "rivers",
    "engines",
    "gardens",
    "bridges",
    "stars",
    "markets",
    "forests",
    "bells",
    "ships",
    "mountains",
    "clocks",
    "libraries",
    "storms",
    "harbours",
    "kitchens",
    "roads",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    """A pair and a gateway as processes, stopped by pid."""

    def __init__(self, model: Path, workdir: Path, rank_args: list[str], *extra: str) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[str]] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        leader = self._spawn(
            "leader",
            env,
            "tp-leader",
            "--model",
            str(model),
            "--listen",
            "127.0.0.1:0",
            "--frontend-listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            *rank_args,
            *extra,
            stdout=True,
        )
        m = self._line(leader, LEADER_LINE)
        self.leader_metrics = f"http://127.0.0.1:{m.group(5)}/metrics"
        self._spawn(
            "worker",
            env,
            "tp-worker",
            "--model",
            str(model),
            "--leader",
            f"127.0.0.1:{m.group(2)}",
            "--metrics-port",
            "0",
            *rank_args,
        )
        gateway = self._spawn(
            "gateway",
            env,
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            f"127.0.0.1:{free_port()}",
            "--tp-frontend",
            f"127.0.0.1:{m.group(4)}",
            "--metrics-port",
            "0",
            stdout=True,
        )
        g = self._line(gateway, GATEWAY_LINE)
        self.grpc = f"127.0.0.1:{g.group(2)}"
        self.http = f"http://127.0.0.1:{g.group(4)}"

    def _spawn(
        self, name: str, env: dict[str, str], *args: str, stdout: bool = False
    ) -> subprocess.Popen[str]:
        log = (self.workdir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "foundry", *args],
            env=env,
            text=True,
            stdout=subprocess.PIPE if stdout else log,
            stderr=log,
        )
        self.procs.append(proc)
        return proc

    def _line(self, proc: subprocess.Popen[str], pattern: re.Pattern[str]) -> re.Match[str]:
        assert proc.stdout is not None
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise SystemExit(f"{proc.args[3]} exited ({proc.poll()}); logs in {self.workdir}")
            if m := pattern.search(line):
                return m
        raise SystemExit(f"no {pattern.pattern!r} line in {STARTUP_S:g} s; logs: {self.workdir}")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.http}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the gateway never reported healthy; logs: {self.workdir}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_stream(
    stub: inference_pb2_grpc.InferenceServiceStub,
    prompt: str,
    tokens: int,
    seed: int,
    temperature: float = 0.8,
) -> tuple[int, float, list[float], float, list[tuple[float, int]]]:
    """(tokens, TTFT, inter-token gaps, finish time, (arrival, tokens) of each message) of one
    streamed generation."""
    request = inference_pb2.GenerateRequest(
        prompt=prompt, max_tokens=tokens, temperature=temperature, seed=seed
    )
    t0 = time.perf_counter()
    last = first = 0.0
    gaps: list[float] = []
    arrivals: list[tuple[float, int]] = []
    n = 0
    async for event in stub.Generate(request, timeout=1800):
        now = time.perf_counter()
        k = len(event.tokens)
        if k == 0:
            continue
        arrivals.append((now, k))
        if n == 0:
            first = now - t0
            gaps += [0.0] * (k - 1)  # tokens that arrived with the first: no gap measured
        else:
            gaps += [(now - last) / k] * k
        n += k
        last = now
    return n, first, gaps, last, arrivals


async def load(
    grpc_address: str, clients: int, tokens: int, temperature: float = 0.8
) -> dict[str, float]:
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        await one_stream(stub, "Warm up: ", 4, 0)
        prompts = [
            f"Write a long story about {TOPICS[i % len(TOPICS)]} and the people who "
            f"lived beside them, told by visitor number {i}."
            for i in range(clients)
        ]
        t0 = time.perf_counter()
        runs = await asyncio.gather(
            *(one_stream(stub, p, tokens, 1 + i, temperature) for i, p in enumerate(prompts))
        )
    n = sum(r[0] for r in runs)
    end = max(r[3] for r in runs)
    ttft = [r[1] for r in runs]
    gaps = [g for r in runs for g in r[2]]
    # the generation phase: from the moment every stream has its first token (every prompt
    # done) to the last token, and the tokens that arrived in it
    started = max(r[4][0][0] for r in runs)
    generated = sum(k for r in runs for when, k in r[4] if when > started)
    return {
        "clients": clients,
        "tokens": n,
        "tokens_per_s": n / (end - t0),
        "generation_tokens_per_s": generated / (end - started) if end > started else 0.0,
        "ttft_p50_ms": 1e3 * harness.median(ttft),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * harness.median(gaps),
        "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
    }


def leader_counter(url: str, name: str) -> float:
    """A counter of the leader's /metrics (summed over its labels)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(name) and line[len(name)] in " {"
    )


@dataclass
class Turn:
    ttft: float  # seconds
    prompt_tokens: int
    evaluated: int  # the prompt's tokens not reused from a kept session
    replaced: bool  # the reply held U+FFFD: bytes that were not UTF-8 cannot come back


def chat_turns(stack: Stack, turns: int) -> list[Turn]:
    """Each turn of one conversation, streamed, greedy: its TTFT and the prompt tokens the
    leader evaluated (its prompt less what a kept session held, from the leader's metrics)."""
    messages: list[dict[str, str]] = []
    out = []
    http = stack.http
    for turn in range(turns):
        messages.append(
            {
                "role": "user",
                "content": f"Turn {turn:02d}: tell me one more fact "
                f"about {TOPICS[turn % len(TOPICS)]}.",
            }
        )
        body = json.dumps(
            {
                "model": "foundry",
                "messages": messages,
                "max_tokens": 16,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        req = urllib.request.Request(
            f"{http}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        reused = leader_counter(stack.leader_metrics, REUSED)
        t0 = time.perf_counter()
        first = 0.0
        text = []
        prompt_tokens = 0
        try:
            r = urllib.request.urlopen(req, timeout=600)
        except urllib.error.HTTPError as exc:
            raise SystemExit(
                f"turn {turn + 1}: HTTP {exc.code}: {exc.read()[:300]!r} (a "
                "conversation past the context? give the ranks --ctx-size)"
            ) from None
        with r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    prompt_tokens = chunk["usage"]["prompt_tokens"]
                delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if delta:
                    first = first or time.perf_counter() - t0
                    text.append(delta)
        reply = "".join(text)
        reused = leader_counter(stack.leader_metrics, REUSED) - reused
        out.append(Turn(first, prompt_tokens, prompt_tokens - round(reused), "\ufffd" in reply))
        messages.append({"role": "assistant", "content": reply})
    return out


def llama_batched(
    binary: str, model: Path, threads: int, tokens: int, clients: list[int], more: list[str]
) -> dict[int, tuple[float, float]]:
    """Of llama-batched-bench for each client count: the generated tokens over its whole time
    T (prompts and generation) and its S_TG (aggregate generation tokens/s)."""
    cmd = [
        binary,
        "-m",
        str(model),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-npp",
        "32",
        "-ntg",
        str(tokens),
        "-npl",
        ",".join(map(str, clients)),
        "-c",
        str(max(clients) * (32 + tokens) + 64),
        *more,
    ]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800).stdout
    rates: dict[int, tuple[float, float]] = {}
    for line in text.splitlines():
        # PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 9 and cells[2].isdigit():
            b = int(cells[2])
            rates[b] = (int(cells[1]) * b / float(cells[8]), float(cells[7]))
    return rates


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a GGUF file")
    ap.add_argument("--clients", default="1,4,8,16", help="client counts (default 1,4,8,16)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a stream (default 64)")
    ap.add_argument("--rank-args", default="", help="extra flags for both ranks")
    ap.add_argument("--llama-batched-bench", help="llama.cpp's llama-batched-bench binary")
    ap.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--llama-args",
        type=shlex.split,
        default=[],
        help="more arguments for llama-batched-bench, e.g. '-nr' (a VM whose CPU flags promise "
        "more than it runs: llama.cpp's repacked kernels die there)",
    )
    ap.add_argument(
        "--turns", type=int, default=10, help="chat turns of the reuse check (0: skip it)"
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="the load's sampling temperature (default 0.8; 0: greedy, the workers then send "
        "their rows' greedy picks instead of their logits, and one client decodes "
        "speculatively)",
    )
    harness.add_json_flag(ap)
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    rank_args = shlex.split(args.rank_args)
    results: dict[str, object] = {
        "model": str(args.model),
        "rank_args": args.rank_args,
        "temperature": args.temperature,
    }
    ok = True
    with tempfile.TemporaryDirectory(prefix="foundry-serve-load-") as tmp:
        work = Path(tmp)
        stack = Stack(args.model, work, rank_args)
        try:
            stack.wait_ready()
            rows = []
            for n in clients:
                rows.append(asyncio.run(load(stack.grpc, n, args.tokens, args.temperature)))
                print(
                    f"  measured {n} clients: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True
                )
            reuse = chat_turns(stack, args.turns) if args.turns else []
        finally:
            stack.stop()
        cold: list[Turn] = []
        if args.turns:
            (work / "cold").mkdir()
            stack = Stack(args.model, work / "cold", rank_args, "--keep-sessions", "0")
            try:
                stack.wait_ready()
                cold = chat_turns(stack, args.turns)
            finally:
                stack.stop()
    base = (
        llama_batched(
            args.llama_batched_bench,
            args.model,
            args.llama_threads,
            args.tokens,
            clients,
            args.llama_args,
        )
        if args.llama_batched_bench
        else {}
    )
    print(
        f"{args.model.name}, ranks {args.rank_args or '(default flags)'}, {args.tokens} tokens "
        f"a stream at temperature {args.temperature:g}, gRPC through the gateway:"
    )
    print(
        "          whole run (prompts included)   generation (S_TG)\n"
        " clients  tokens/s  llama.cpp  ratio  tokens/s  llama.cpp  ratio  TTFT p50/p99 ms  "
        "ITL p50/p99 ms"
    )
    nan = (float("nan"), float("nan"))
    for row in rows:
        n = int(row["clients"])
        whole, gen = base.get(n, nan)
        row["llama_tokens_per_s"], row["llama_s_tg"] = whole, gen
        row["ratio"] = harness.ratio(row["tokens_per_s"], whole) if n in base else float("nan")
        row["generation_ratio"] = (
            harness.ratio(row["generation_tokens_per_s"], gen) if n in base else float("nan")
        )
        print(
            f" {n:7d} {row['tokens_per_s']:9.1f} {whole:10.1f} {row['ratio']:6.2f} "
            f"{row['generation_tokens_per_s']:9.1f} {gen:10.1f} {row['generation_ratio']:6.2f}  "
            f"{row['ttft_p50_ms']:7.0f}/{row['ttft_p99_ms']:<7.0f} "
            f"{row['itl_p50_ms']:7.1f}/{row['itl_p99_ms']:.1f}"
        )
        if n == 16 and n in base and row["generation_ratio"] < LOAD_TARGET:
            ok = False
            print(
                f"   FAIL: 16 clients generate at {row['generation_ratio']:.2f}x "
                f"llama-batched-bench's S_TG (target {LOAD_TARGET})"
            )
    results["load"] = rows
    if reuse:
        growth, cold_growth = reuse[-1].ttft / reuse[0].ttft, cold[-1].ttft / cold[0].ttft
        print(
            f"prompt reuse, {args.turns} turns: TTFT turn 1 {1e3 * reuse[0].ttft:.0f} ms, turn "
            f"{args.turns} {1e3 * reuse[-1].ttft:.0f} ms ({growth:.2f}x); without kept sessions "
            f"{1e3 * cold[0].ttft:.0f} -> {1e3 * cold[-1].ttft:.0f} ms ({cold_growth:.2f}x)"
        )
        print(
            " turn  prompt tokens  evaluated  TTFT ms  | without kept sessions: evaluated  TTFT ms"
        )
        for i, (t, c) in enumerate(zip(reuse, cold, strict=True), start=1):
            print(
                f" {i:4d} {t.prompt_tokens:14d} {t.evaluated:10d} {1e3 * t.ttft:8.0f}  | "
                f"{c.evaluated:35d} {1e3 * c.ttft:8.0f}"
            )
        if any(t.replaced for t in reuse):
            print(
                "   note: replies held U+FFFD (bytes that are not UTF-8, as a random model "
                "writes): sent back, they are other tokens, and are evaluated again"
            )
        results["reuse_ttft_ms"] = [1e3 * t.ttft for t in reuse]
        results["reuse_evaluated_tokens"] = [t.evaluated for t in reuse]
        results["cold_ttft_ms"] = [1e3 * t.ttft for t in cold]
        results["cold_evaluated_tokens"] = [t.evaluated for t in cold]
        if growth > REUSE_TARGET:
            ok = False
            print(
                f"   FAIL: the last turn's TTFT is {growth:.2f}x the first's (target "
                f"{REUSE_TARGET})"
            )
    harness.emit("serve_load", results, ok, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
