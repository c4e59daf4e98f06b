"""The pair's ranks as ``tp.py`` runs them: the leader in this process, the worker a spawned
process pinned to its core (its gate times saved when it stops), the frontend client that
generates, and what they measured: tokens/s, counters, each gate's times on both ranks aligned,
and where a token's time goes on the leader."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from tp_gates import pin
from tp_link import enter_netns

from foundry.model.shard.table import ExpertSplit, Gate
from foundry.tp.blas import limit_blas_threads
from foundry.tp.leader import Leader, LeaderOptions
from foundry.tp.worker import Worker, WorkerOptions
from foundry.wire import frontend as fw

STARTUP_S = 120.0
WORKER_STOP_S = 30.0
# The gate and control timeouts of both ranks (--timeout; the ranks' defaults unless given):
# on a machine busy with other work, a rank descheduled for a second would end the pair.
TIMEOUTS: dict[str, Any] = {}


def with_timeouts(options: LeaderOptions) -> LeaderOptions:
    return dataclasses.replace(options, **TIMEOUTS)


class InProcessLeader:
    def __init__(self, options: LeaderOptions) -> None:
        self.leader = Leader(options)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(STARTUP_S):
            raise SystemExit("the leader did not start")

    def _run(self) -> None:
        async def main() -> None:
            await self.leader.start()
            self._ready.set()
            try:
                await self.leader.wait_stopped()
            finally:
                await self.leader.close()

        asyncio.run(main())

    def stop(self) -> None:
        self.leader.request_stop()
        self._thread.join(30)


class JoinTimer:
    """The seconds the leader waits, once its own rows are done, for the worker's half of the
    logits (``PairCommands.join``, wrapped): the worker being later than the leader, plus the
    LOGITS frame's transfer."""

    def __init__(self, leader: Leader) -> None:
        self.times: list[float] = []
        commands = leader.engine.commands
        join = commands.join

        def timed(mine: Any) -> Any:
            t0 = time.perf_counter()
            out = join(mine)
            self.times.append(time.perf_counter() - t0)
            return out

        commands.join = timed  # type: ignore[method-assign]


def where(
    tag: str,
    label: str,
    pair_rate: float,
    gates: list[tuple[Gate, float]],
    joins: list[float],
    steps: int,
    n_layer: int,
) -> dict[str, float]:
    """Where a decoded token's time goes on the leader, ms per token: in the 2 x n_layer gates
    (the exchange and the wait for the slower rank), waiting for the worker's logits half, and
    the rest (the leader's own half of the layers and of the head, sampling, the frontend)."""
    step = 1e3 / pair_rate
    decode_gates = gates[-2 * n_layer * steps :] if steps else []
    gate_ms = sum(t for _, t in decode_gates) * 1e3 / max(steps, 1)
    logits_ms = sum(joins[-steps:]) * 1e3 / max(steps, 1) if steps else 0.0
    rest = step - gate_ms - logits_ms
    print(
        f"{tag} {label}: per token {step:.2f} ms = gates {gate_ms:.2f} + waiting for the "
        f"worker's logits half {logits_ms:.2f} + the leader's own work {rest:.2f}"
    )
    return {
        f"{label}_step_ms": step,
        f"{label}_gates_ms": gate_ms,
        f"{label}_logits_wait_ms": logits_ms,
    }


def exchange_ms(tag: str, label: str, pairs: GatePairs, steps: int, n_layer: int) -> float:
    """Of the gates' time per token, the exchange itself, ms: each gate's shorter time of the
    two ranks (the rank that arrives last waits for nobody), summed over a token's gates."""
    decode = pairs[-2 * n_layer * steps :] if steps else []
    if len(decode) < 2 * n_layer * steps:
        print(f"{tag} {label}: the worker's gate times were lost, no exchange figure")
        return float("nan")
    ms = sum(min(lt, wt) for (_, lt), (_, wt) in decode) * 1e3 / steps
    print(
        f"{tag} {label}: of the gates, the exchange itself {ms:.2f} ms per token "
        f"({2 * n_layer} gates; the rest is waiting for the slower rank)"
    )
    return ms


def worker_main(
    model: str,
    port: int,
    core: int | None,
    shm: bool,
    trace: str,
    mode: str,
    netns: str | None = None,
    host: str = "127.0.0.1",
    timeouts: dict[str, Any] | None = None,
) -> None:
    """The worker rank (a spawned process): pinned, one BLAS thread, in network namespace
    ``netns`` if given; on SIGTERM it stops and saves its gate times (gate, seconds) to
    ``trace``, in the pair's gate order."""
    pin(core)
    if netns is not None:
        enter_netns(f"/var/run/netns/{netns}")
    limit_blas_threads(1)
    times: list[tuple[int, float]] = []
    options = WorkerOptions(
        model=Path(model),
        leader_host=host,
        leader_port=port,
        shm=shm,
        retry_max_s=0.2,
        expert_split=ExpertSplit(mode),
    )
    worker = Worker(dataclasses.replace(options, **(timeouts or {})))
    record = worker._on_gate

    def on_gate(gate: Gate, seconds: float, nbytes: int) -> None:
        times.append((int(gate), seconds))
        record(gate, seconds, nbytes)

    worker._on_gate = on_gate  # type: ignore[method-assign]
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    worker.run()
    np.save(trace, np.asarray(times, dtype=np.float64).reshape(-1, 2))


class WorkerProc:
    def __init__(
        self,
        model: Path,
        port: int,
        core: int | None,
        shm: bool,
        trace: Path,
        mode: ExpertSplit,
        netns: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.trace = trace
        self.proc = mp.get_context("spawn").Process(
            target=worker_main,
            args=(str(model), port, core, shm, str(trace), mode.value, netns, host, TIMEOUTS),
        )
        self.proc.start()

    def stop(self) -> list[tuple[Gate, float]]:
        """Stop the worker; its gate times."""
        self.proc.terminate()
        self.proc.join(WORKER_STOP_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
            return []
        return [(Gate(int(g)), float(t)) for g, t in np.load(self.trace)]


def generate(port: int, prompt: str, n: int) -> tuple[list[int], list[float]]:
    """Greedy generation over the frontend link: tokens and their arrival times."""
    with socket.create_connection(("127.0.0.1", port), timeout=STARTUP_S) as s:
        s.sendall(fw.encode(fw.Generate(1, prompt, n)))
        decoder = fw.FrontendDecoder()
        tokens: list[int] = []
        times: list[float] = []
        while True:
            data = s.recv(65536)
            if not data:
                raise SystemExit("the leader closed the frontend link")
            now = time.perf_counter()
            decoder.feed(data)
            while (frame := decoder.next_event()) is not None:
                if isinstance(frame, fw.Token):
                    tokens.append(frame.token)
                    times.append(now)
                elif isinstance(frame, fw.Error):
                    raise SystemExit(f"generation failed: {frame.message}")
                elif isinstance(frame, fw.Done):
                    return tokens, times


def aligned(
    leader: list[tuple[Gate, float]], worker: list[tuple[Gate, float]], first: int, count: int
) -> GatePairs:
    """Both ranks' times of the leader's gates ``first`` .. ``first + count - 1``. The worker's
    trace covers its whole pair and ends with the leader's (the last gate of the run), so it
    is the tail of the leader's (whose length at pairing time would race with a re-synced
    session's prefill on the engine thread). No pairs when the worker's trace was lost."""
    if not worker:
        return []
    at = first - (len(leader) - len(worker))  # the leader's gate ``first`` in the worker's trace
    if at < 0:
        return []
    return list(zip(leader[first : first + count], worker[at : at + count], strict=False))


def wait_paired(leader: Leader, shm: bool) -> None:
    deadline = time.monotonic() + STARTUP_S
    while not (leader.worker_connected and (leader.status().shared_memory == shm)):
        if time.monotonic() > deadline:
            raise SystemExit("the worker did not pair")
        time.sleep(0.05)


def rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def counters(leader: Leader) -> dict[str, float]:
    m = leader.metrics
    return {
        "gate_sent": m.gate_bytes.labels("sent")._value.get(),
        "gate_received": m.gate_bytes.labels("received")._value.get(),
        "control_sent": m.control_bytes.labels("sent")._value.get(),
        "control_received": m.control_bytes.labels("received")._value.get(),
        "prompt_reused": m.prompt_tokens_reused._value.get(),
    }


GatePairs = list[tuple[tuple[Gate, float], tuple[Gate, float]]]
