"""``churn.py``'s TP pair soak: a leader and a worker serve concurrent greedy clients while the
worker is killed with SIGKILL and started again (every other time without shared memory);
every request completes with the single process's text or fails naming the lost worker, none
hangs, and the pair serves again after every restart (the checks: churn.py's docstring)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import live

from foundry.wire import frontend as fw

REQUEST_TIMEOUT_S = 30.0
PAIR_WITHIN_S = 30.0
TP_PROMPTS = (
    "The swarm trains while workers come and go.",
    "Every request completes or fails clearly.",
    "def churn(seconds):",
    "Lorem ipsum dolor sit amet",
)
TP_MAX_TOKENS = 48


@dataclass
class TpReport:
    seconds: float = 0.0
    clients: int = 0
    kills: int = 0
    restarts: int = 0
    served_again: int = 0
    longest_repair_s: float = 0.0
    requests: int = 0
    completed: int = 0
    failed_unavailable: int = 0
    hung: int = 0
    wrong_text: int = 0
    other_errors: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        return (
            f"tp churn: {self.seconds:.0f} s, {self.clients} clients, {self.kills} worker kills,"
            f" served again after {self.served_again}/{self.restarts} restarts (longest "
            f"{self.longest_repair_s:.2f} s to re-pair and generate); {self.requests} requests:"
            f" {self.completed} completed with the single-process text, "
            f"{self.failed_unavailable} failed with UNAVAILABLE, {self.hung} hung, "
            f"{self.wrong_text} wrong text, {len(self.other_errors)} other "
            f"[{'PASS' if self.ok else 'FAIL'}]"
        )


def serves_again(port: int, refs: dict[str, list[int]], deadline: float) -> bool:
    """A short greedy generation completes with the reference text before ``deadline``
    (UNAVAILABLE while the worker dials and re-handshakes is retried)."""
    prompt = TP_PROMPTS[0]
    while time.monotonic() < deadline:
        try:
            with live.FrontendClient(port) as c:
                got = c.generate(prompt, 8, max(1.0, deadline - time.monotonic()))
        except OSError:
            got = live.Generation()
        if isinstance(got.end, fw.Done):
            return got.tokens == refs[prompt][:8]
        time.sleep(0.05)
    return False


def tp_soak(
    work: Path,
    seconds: float,
    seed: int,
    clients: int = 3,
    kill_every: float = 3.0,
    out: live.Printer = print,
) -> TpReport:
    rep = TpReport(clients=clients)
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    model = live.make_model(work / "model.gguf")
    refs = {p: live.greedy_reference(model, p, TP_MAX_TOKENS) for p in TP_PROMPTS}
    leader, tport, fport = live.start_leader(work, model)
    worker = live.start_tp_worker(work, model, tport, log="tp-worker-0")
    stop = threading.Event()
    lock = threading.Lock()

    def record(got: live.Generation, prompt: str, n: int) -> None:
        with lock:
            rep.requests += 1
            if isinstance(got.end, fw.Done):
                ref = refs[prompt]
                full = got.end.reason is not fw.DoneReason.MAX_TOKENS or len(got.tokens) == n
                if got.tokens == ref[: len(got.tokens)] and full:
                    rep.completed += 1
                else:
                    rep.wrong_text += 1
                    rep.failures.append(f"{prompt!r}: {got.tokens} is not {ref[:n]}")
            elif isinstance(got.end, fw.Error):
                if (
                    got.end.code == fw.ErrorCode.UNAVAILABLE
                    and "tensor-parallel worker" in got.end.message
                ):
                    rep.failed_unavailable += 1
                else:
                    rep.other_errors.append(f"{got.end.code}: {got.end.message}")
                    rep.failures.append(f"error {got.end.code}: {got.end.message}")
            elif got.closed:
                rep.failures.append("the leader closed a frontend connection")
            else:
                rep.hung += 1
                rep.failures.append(f"{prompt!r}: no DONE or ERROR within {REQUEST_TIMEOUT_S:g} s")

    def client(i: int) -> None:
        crng = random.Random(f"{seed}-{i}")
        conn: live.FrontendClient | None = None
        try:
            while not stop.is_set():
                prompt, n = crng.choice(TP_PROMPTS), crng.randint(8, TP_MAX_TOKENS)
                try:
                    conn = conn or live.FrontendClient(fport)
                    got = conn.generate(prompt, n, REQUEST_TIMEOUT_S)
                except OSError as exc:
                    with lock:
                        rep.failures.append(f"client {i}: frontend link failed: {exc}")
                    if conn is not None:
                        conn.close()
                    conn = None
                    time.sleep(0.1)
                    continue
                record(got, prompt, n)
                if got.closed:
                    conn.close()
                    conn = None
                if isinstance(got.end, fw.Error):
                    time.sleep(0.25)  # the pair is down: ask again a little later
        finally:
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    try:
        live.wait_paired(fport)
        for t in threads:
            t.start()
        t0 = time.monotonic()
        end = t0 + seconds
        while time.monotonic() < end:
            time.sleep(min(kill_every * rng.uniform(0.5, 1.5), max(0.0, end - time.monotonic())))
            if time.monotonic() >= end:
                break
            if not leader.alive():
                rep.failures.append("the leader exited")
                break
            worker.kill9()
            rep.kills += 1
            time.sleep(rng.uniform(0.2, 1.5))
            t_restart = time.monotonic()
            worker = live.start_tp_worker(
                work, model, tport, *(("--no-shm",) * (rep.kills % 2)), log=f"tp-worker-{rep.kills}"
            )
            rep.restarts += 1
            if serves_again(fport, refs, t_restart + PAIR_WITHIN_S):
                rep.served_again += 1
                rep.longest_repair_s = max(rep.longest_repair_s, time.monotonic() - t_restart)
            else:
                rep.failures.append(
                    f"the pair did not serve within {PAIR_WITHIN_S:g} s of restart {rep.restarts}"
                )
        rep.seconds = time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 5)
        worker.stop()
        leader.stop()
    if any(t.is_alive() for t in threads):
        rep.failures.append("a client thread did not finish")
    for svc in (leader,):
        rep.failures += [f"{svc.name}: {line}" for line in svc.internal_errors()]
    if rep.served_again < rep.restarts:
        rep.failures.append(f"served again after {rep.served_again} of {rep.restarts} restarts")
    out(rep.summary())
    return rep
