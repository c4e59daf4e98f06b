"""Metrics, dashboards and timelines, checked against the real thing.

The main test starts the whole system as local processes on loopback (a coordinator, two
workers, the tensor-parallel pair, the gateway) and a real Prometheus server (Debian's
`prometheus` package; `.ci/run` installs it) that scrapes them every second with a configuration
from ``foundry.obs.prometheus_config``. It trains a few dozen steps and runs generations through
the gateway, then evaluates every panel query of every dashboard in ``grafana/dashboards``
through Prometheus's HTTP API and requires data from each. ``promtool`` checks both Prometheus
configurations and every service's ``/metrics`` text.

Without the `prometheus` binary those tests fail under CI (the CI variable set) and are skipped
elsewhere, with the command that installs it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from procs import ENV, Service, coordinator, missing, worker

from foundry.api.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)
from foundry.obs.prometheus_config import JOBS, METRICS_PORTS, duration, render
from foundry.obs.timeline import Timeline, load_events, merge
from foundry.swarm.coordinator import LATE_FACTOR, LATE_MIN_WAIT_S, late_after

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "grafana" / "dashboards"
COMPOSE_PROMETHEUS = ROOT / "services" / "prometheus" / "prometheus.yml"
DATASOURCE_UID = "foundry-prometheus"
UIDS = {"swarm.json": "foundry-swarm", "tp.json": "foundry-tp", "gateway.json": "foundry-gateway"}
# Grafana's range variables; the live test gives each a window covering the whole run.
GRAFANA_RANGES = ("$__rate_interval", "$__range", "$__interval")
# Panels that must show more than zero after the run: the throughput the dashboards lead with.
POSITIVE = {"Samples/s (swarm)", "Tokens/s generated", "Calls/s", "Tokens/s streamed"}
STEPS = 40


def tool(name: str) -> str:
    """The path of a Prometheus binary: fail under CI when missing, skip otherwise."""
    path = shutil.which(name)
    if path is None:
        reason = (
            f"`{name}` is not installed (apt-get install prometheus; .ci/run does); the "
            "dashboards cannot be checked against a real Prometheus"
        )
        missing(reason)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        body: bytes = r.read()
        return body.decode()


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that is not a row, including panels nested in collapsed rows."""
    for p in board["panels"]:
        if p["type"] == "row":
            yield from p.get("panels", [])
        else:
            yield p


def load_boards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


# ------------------------------------------------------------------ files, no servers


def test_dashboards_have_fixed_uids_and_every_panel_a_query() -> None:
    boards = load_boards()
    assert {name: b["uid"] for name, b in boards.items()} == UIDS
    for name, board in boards.items():
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for p in panels(board):
            where = f"{name} / {p['title']}"
            assert p["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, where
            assert p["targets"] and p.get("description"), where
            for t in p["targets"]:
                assert t["expr"].strip() and t["datasource"]["uid"] == DATASOURCE_UID, where
            grid = p["gridPos"]
            assert grid["x"] + grid["w"] <= 24, where


def test_swarm_dashboard_leads_with_throughput() -> None:
    first = next(panels(load_boards()["swarm.json"]))
    assert first["title"] == "Samples/s (swarm)"
    assert "rate(foundry_swarm_samples_total" in first["targets"][0]["expr"]


def test_provisioning_names_the_datasource_the_dashboards_use() -> None:
    datasource = (ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text()
    assert f"uid: {DATASOURCE_UID}" in datasource
    assert "url: http://prometheus:9090" in datasource
    provider = (ROOT / "grafana/provisioning/dashboards/foundry.yml").read_text()
    assert "path: /var/lib/grafana/dashboards" in provider


def test_compose_prometheus_follows_the_port_plan() -> None:
    text = COMPOSE_PROMETHEUS.read_text()
    jobs = re.findall(r'job_name: "([^"]+)"', text)
    assert [j for j in jobs if j != "prometheus"] == list(JOBS)
    for job, port in METRICS_PORTS.items():
        static = f'"{job}:{port}"' in text
        dns = re.search(rf'names: \["{job}"\]\s+type: A\s+port: {port}', text)
        assert static or dns, f"{job} is not scraped on port {port}"


def test_render_rejects_unknown_jobs_and_bad_targets() -> None:
    assert duration(1) == "1s" and duration(0.25) == "250ms"
    with pytest.raises(ValueError, match="unknown scrape jobs"):
        render({"trainer": ["127.0.0.1:1"]})
    with pytest.raises(ValueError, match="not HOST:PORT"):
        render({"worker": ["127.0.0.1"]})
    with pytest.raises(ValueError, match="positive"):
        duration(0)


def test_prometheus_configs_pass_promtool(tmp_path: Path) -> None:
    promtool = tool("promtool")
    rendered = tmp_path / "prometheus.yml"
    rendered.write_text(render({job: [f"127.0.0.1:{9100 + i}"] for i, job in enumerate(JOBS)}, 1))
    for config in (COMPOSE_PROMETHEUS, rendered):
        done = subprocess.run(
            [promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout + done.stderr


# ------------------------------------------------------------------ timelines


def track(event: dict[str, Any]) -> tuple[int, int]:
    return (event["pid"], event["tid"])


def test_late_after_is_the_slower_of_the_factor_and_the_minimum_wait() -> None:
    assert late_after(10.0, []) is None
    # One report 2 s in: late at 1.5x the median, 3 s into the round.
    assert late_after(10.0, [12.0]) == pytest.approx(10.0 + LATE_FACTOR * 2.0)
    # Fast rounds: never sooner than the minimum wait after the first report.
    assert late_after(10.0, [10.01]) == pytest.approx(10.01 + LATE_MIN_WAIT_S)
    assert late_after(0.0, [1.0, 2.0, 9.0]) == pytest.approx(LATE_FACTOR * 2.0)


def test_an_ordinary_short_wait_is_info_and_only_a_long_one_a_warning() -> None:
    from foundry.swarm.round_loop import LATE_WARNING_S, late_stages

    assert late_stages(10.0, []) == []
    # A 20 ms round waiting 50 ms on its last report: INFO; WARNING only a second on.
    (info, info_at), (warning, warning_at) = late_stages(10.0, [10.02])
    assert (info, warning) == (logging.INFO, logging.WARNING)
    assert info_at == pytest.approx(10.02 + LATE_MIN_WAIT_S)
    assert warning_at == pytest.approx(10.02 + LATE_WARNING_S) and LATE_WARNING_S >= 1.0
    # A slow round (reports 5 s in): both when it is late by the factor, never before.
    assert [at for _, at in late_stages(0.0, [5.0])] == pytest.approx([7.5, 7.5])


def test_a_trace_cut_short_still_loads_and_merging_keeps_threads_apart(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    first = Timeline(a, "worker", tid=7, thread="w0")
    first.span("compute", 1_000, 1_500, step=0)
    first.close()
    second = Timeline(b, "worker", tid=7, thread="w1")  # same OS pid on another host
    second.span("compute", 1_100, 1_400, step=0)  # never closed: as if killed
    events_a = load_events(a.read_text())
    events_b = load_events(b.read_text())
    assert not b.read_text().rstrip().endswith("]")
    merged = merge([events_a, events_b])
    names = {e["args"]["name"]: e["tid"] for e in merged if e["name"] == "thread_name"}
    assert names["w0"] == 7 and names["w1"] != 7
    spans = [e for e in merged if e["ph"] == "X"]
    assert [(e["ts"], e["dur"], e["tid"]) for e in spans] == [
        (1_000, 500, 7),
        (1_100, 300, names["w1"]),
    ]
    second.close()


def test_timeline_files_merge_and_the_late_worker_is_named(tmp_path: Path) -> None:
    """An 8x slower worker with rebalancing off: every round waits on it, the log says so.

    (8x, not less: the slowdown is a sleep after the compute, so on a loaded 2-core machine
    the other worker's compute must not be able to take longer than the slow one's total.)
    """
    coord, port, _ = coordinator(
        tmp_path,
        "--max-steps",
        "6",
        "--min-workers",
        "2",
        "--no-rebalance",
        "--timeline",
        str(tmp_path / "coordinator.json"),
    )
    workers = [
        worker(tmp_path, port, "w0", "--timeline", str(tmp_path / "w0.json")),
        worker(tmp_path, port, "w1", "--slowdown", "8", "--timeline", str(tmp_path / "w1.json")),
    ]
    try:
        for w in workers:
            assert w.proc.wait(timeout=60) == 0, w.text()[-2000:]
        coord.wait_for(r"training done at step 6")
    finally:
        for w in workers:
            w.stop()
        coord.stop()
    assert re.search(
        r"(?:INFO|WARNING) foundry\.coordinator: step \d+ is waiting for w1: ", coord.text()
    )
    out = tmp_path / "all.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "timeline",
            "merge",
            *(str(tmp_path / f) for f in ("coordinator.json", "w0.json", "w1.json")),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "6 apply" in done.stdout and "12 compute" in done.stdout, done.stdout
    events = json.loads(out.read_text())["traceEvents"]
    threads = {e["args"]["name"]: track(e) for e in events if e["name"] == "thread_name"}
    assert threads["rounds"][0] != threads["w0"][0] == threads["w1"][0]
    for name in ("w0", "w1"):
        phases = {e["name"] for e in events if e["ph"] == "X" and track(e) == threads[name]}
        assert phases == {"update", "compute", "compress", "send", "wait"}, (name, phases)
    waits = [e for e in events if e["name"] == "wait" and track(e) == threads["rounds"]]
    assert len(waits) == 6 and all(e["args"]["last"] == "w1" for e in waits)
    # On one wall clock, the coordinator applies each step after the slow worker began sending.
    w1_sends = [e for e in events if e["name"] == "send" and e["tid"] == threads["w1"][1]]
    applies = [e for e in events if e["name"] == "apply"]
    assert all(a["ts"] > s["ts"] for s, a in zip(w1_sends, applies, strict=True))


# ------------------------------------------------------------------ the live stack


class Prometheus:
    """A Prometheus server on a free loopback port (never 9090), its data in ``tmp``."""

    def __init__(self, binary: str, config: Path, tmp: Path) -> None:
        self.log = (tmp / "prometheus.log").open("ab")
        for _ in range(3):  # the free port can be taken between the probe and the bind
            self.port = free_port()
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=self.log,
                stderr=subprocess.STDOUT,
            )
            if self._ready(within_s=30):
                return
            self._terminate()
        self.log.close()
        raise AssertionError("prometheus did not start:\n" + (tmp / "prometheus.log").read_text())

    def _ready(self, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                http_get(f"http://127.0.0.1:{self.port}/-/ready", 1)
                return True
            except urllib.error.HTTPError as exc:  # 503 while it loads
                exc.close()
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        try:
            answer = json.loads(http_get(url))
        except urllib.error.HTTPError as exc:
            with exc:
                raise AssertionError(f"{expr}: {exc.read().decode()}") from None
        assert answer["status"] == "success", answer
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_until(self, expr: str, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.query(expr):
                return
            time.sleep(0.5)
        raise AssertionError(f"no result for {expr} within {within_s}s")

    def stop(self) -> None:
        self._terminate()
        self.log.close()

    def _terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def metrics_port(svc: Service, pattern: str) -> tuple[re.Match[str], int]:
    m = svc.wait_for(pattern + r".*metrics :(\d+)")
    return m, int(m.group(m.lastindex or 0))


def test_every_dashboard_panel_has_data_on_a_live_stack(tmp_path: Path) -> None:
    prometheus_bin, promtool = tool("prometheus"), tool("promtool")
    model = tmp_path / "tiny.gguf"
    subprocess.run(
        [sys.executable, "-m", "foundry", "model", "init", "--preset", "tiny", "--out", str(model)],
        check=True,
        env=ENV,
        timeout=60,
        capture_output=True,
    )
    metrics = ("--metrics-port", "0", "--metrics-host", "127.0.0.1")
    services: list[Service] = []
    prometheus: Prometheus | None = None
    channel: grpc.Channel | None = None
    try:
        coord, port, admin = coordinator(
            tmp_path,
            "--max-steps",
            "1000",
            "--min-workers",
            "2",
            "--wait-for-start",
            "--checkpoint-every",
            "20",
            *metrics,
        )
        services.append(coord)
        leader = Service(
            [
                "tp-leader",
                "--model",
                str(model),
                "--listen",
                "127.0.0.1:0",
                "--frontend-listen",
                "127.0.0.1:0",
                *metrics,
            ],
            tmp_path / "leader.log",
        )
        services.append(leader)
        workers = [
            worker(tmp_path, port, "w0", *metrics),
            worker(tmp_path, port, "w1", "--slowdown", "2", *metrics),
        ]
        services += workers
        lm, leader_metrics = metrics_port(
            leader, r"tp-leader listening: workers 127\.0\.0\.1:(\d+), frontend 127\.0\.0\.1:(\d+)"
        )
        tp_worker = Service(
            ["tp-worker", "--model", str(model), "--leader", f"127.0.0.1:{lm.group(1)}", *metrics],
            tmp_path / "tp-worker.log",
        )
        gateway = Service(
            [
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--coordinator-admin",
                f"127.0.0.1:{admin}",
                "--tp-frontend",
                f"127.0.0.1:{lm.group(2)}",
                *metrics,
            ],
            tmp_path / "gateway.log",
        )
        services += [tp_worker, gateway]
        gm, gateway_metrics = metrics_port(gateway, r"gateway listening: grpc 127\.0\.0\.1:(\d+)")
        targets = {
            "coordinator": [metrics_port(coord, "coordinator listening")[1]],
            "worker": [metrics_port(w, r"worker w\d:")[1] for w in workers],
            "tp-leader": [leader_metrics],
            "tp-worker": [metrics_port(tp_worker, "tp-worker ready")[1]],
            "gateway": [gateway_metrics],
        }
        config = tmp_path / "prometheus.yml"
        config.write_text(
            render({job: [f"127.0.0.1:{p}" for p in ports] for job, ports in targets.items()}, 1.0)
        )
        prometheus = Prometheus(prometheus_bin, config, tmp_path)
        prometheus.wait_until("count(up == 1) == 6", within_s=30)
        leader.wait_for("paired")

        channel = grpc.insecure_channel(f"127.0.0.1:{gm.group(1)}")
        training = training_pb2_grpc.TrainingServiceStub(channel)
        inference = inference_pb2_grpc.InferenceServiceStub(channel)
        started = time.monotonic()
        training.StartTraining(training_pb2.StartTrainingRequest(), timeout=10)
        for i in range(4):  # while the swarm trains: greedy ones draft speculatively
            request = inference_pb2.GenerateRequest(
                prompt="The quick brown fox",
                max_tokens=24,
                temperature=0.8 if i == 3 else 0.0,
                seed=i,
            )
            events = list(inference.Generate(request, timeout=60))
            assert events[-1].HasField("done"), events[-1]
            assert sum(len(e.tokens) for e in events) == events[-1].done.generated_tokens
        # An inter-token gap needs a generation that reaches the gateway in two batches or
        # more; on a loaded machine a short one can arrive whole. A few longer ones, bounded.
        gaps = 'foundry_gateway_inter_token_latency_seconds_count{endpoint="generate"}'
        for i in range(8):
            text = http_get(f"http://127.0.0.1:{gateway_metrics}/metrics")
            if any(
                line.startswith(gaps) and float(line.split()[-1]) > 0 for line in text.splitlines()
            ):
                break
            request = inference_pb2.GenerateRequest(
                prompt="Once upon a time", max_tokens=96, temperature=0.8, seed=10 + i
            )
            assert list(inference.Generate(request, timeout=60))[-1].HasField("done")
        else:
            pytest.fail("eight generations of 96 tokens reached the gateway in one batch each")
        deadline = time.monotonic() + 60
        step = 0
        while step < STEPS and time.monotonic() < deadline:
            status = training.GetTrainingStatus(training_pb2.GetTrainingStatusRequest(), timeout=10)
            step = status.status.global_step
            time.sleep(0.25)
        assert step >= STEPS, f"training reached step {step} of {STEPS} in 60 s"
        training.CreateCheckpoint(training_pb2.CreateCheckpointRequest(), timeout=60)
        training.PauseTraining(training_pb2.PauseTrainingRequest(), timeout=10)
        # Two more scrapes of every target see the end of the run.
        prometheus.wait_until(f"max(foundry_swarm_global_step) >= {STEPS}", within_s=10)
        time.sleep(2.5)

        window = f"{math.ceil(time.monotonic() - started) + 5}s"
        empty = []
        for name, board in load_boards().items():
            for p in panels(board):
                for t in p["targets"]:
                    expr = t["expr"]
                    for var in GRAFANA_RANGES:
                        expr = expr.replace(var, window)
                    values = [float(s["value"][1]) for s in prometheus.query(expr)]
                    finite = [v for v in values if math.isfinite(v)]
                    where = f"{name} / {p['title']} / {t['legendFormat']}: {expr} -> {values}"
                    if not finite:
                        empty.append(where)
                    elif p["title"] in POSITIVE and max(finite) <= 0:
                        empty.append(where + " (should be above 0)")
        assert not empty, "panels without data:\n" + "\n".join(empty)

        for job, ports in targets.items():
            for p in ports:
                text = http_get(f"http://127.0.0.1:{p}/metrics")
                lint = subprocess.run(
                    [promtool, "check", "metrics"],
                    input=text,
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                assert lint.returncode == 0, f"{job}: {lint.stdout}{lint.stderr}"
                series = [line for line in text.splitlines() if not line.startswith("#")]
                assert not [s for s in series if "_created" in s.partition(" ")[0]], job
                # Label values are words: no spaces (a query or a legend splits on them).
                spaced = [s for s in series if re.search(r'="[^"]* [^"]*"', s)]
                assert not spaced, f"{job}: {spaced[:3]}"
                if job.startswith("tp-"):
                    rank = "0" if job == "tp-leader" else "1"
                    tp = [s for s in series if s.startswith("foundry_tp_")]
                    assert tp and all(f'rank="{rank}"' in s for s in tp), f"{job}: {tp[:3]}"
        # The first connection of each worker is not a reconnect.
        assert prometheus.query("sum(foundry_worker_reconnects_total)")[0]["value"][1] == "0"
    finally:
        if channel is not None:
            channel.close()
        for svc in reversed(services):
            svc.stop()
        if prometheus is not None:
            prometheus.stop()
