"""Prometheus metrics of every service, defined in one place.

Names follow ``foundry_<subsystem>_<name>_<unit>``; counters end in ``_total``; units are base
units (seconds, bytes). Labels range over small bounded sets only (states, directions,
compressions, phases; worker ids are bounded by the size of the swarm). Each service builds its
own ``CollectorRegistry`` so several services can share a process in tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# No ``_created`` twin for every counter and histogram: nothing here reads them, and they
# double the series a scrape stores (the text format's ``_created`` is a start timestamp).
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus-client

# Round and step times from a fast desktop (tens of ms) to a Pi 3 (a minute).
ROUND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Gate exchanges and per-token times: tens of microseconds to a second.
FAST_BUCKETS = (
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class MetricsServer:
    """The ``/metrics`` HTTP endpoint of one registry (a daemon thread)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        server, thread = start_http_server(port, addr=host, registry=registry)
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.port: int = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


# Why the coordinator drops a worker (``Coordinator._drop``).
SWARM_DROP_REASONS = ("disconnected", "heartbeat_timeout", "replaced", "deregistered", "error")


class SwarmMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.workers = Gauge("foundry_swarm_workers", "Workers by state.", ["state"], registry=r)
        self.global_step = Gauge("foundry_swarm_global_step", "Global training step.", registry=r)
        self.train_loss = Gauge(
            "foundry_swarm_train_loss", "Mean cross-entropy of the last round.", registry=r
        )
        self.validation_loss = Gauge(
            "foundry_swarm_validation_loss", "Cross-entropy on the held-out split.", registry=r
        )
        self.learning_rate = Gauge(
            "foundry_swarm_learning_rate", "Learning rate of the last step.", registry=r
        )
        self.samples = Counter(
            "foundry_swarm_samples_total", "Training samples aggregated.", registry=r
        )
        self.worker_samples_per_second = Gauge(
            "foundry_swarm_worker_samples_per_second",
            "Measured compute throughput per worker.",
            ["worker"],
            registry=r,
        )
        self.gradient_bytes = Counter(
            "foundry_swarm_gradient_bytes_total",
            "Gradient bytes on the wire.",
            ["direction", "compression"],
            registry=r,
        )
        self.weight_bytes = Counter(
            "foundry_swarm_weight_bytes_total",
            "Weight bytes on the wire.",
            ["direction"],
            registry=r,
        )
        self.update_bytes = Counter(
            "foundry_swarm_update_bytes_total",
            "Weight-update bytes sent to workers (UPDATE: the downlink after a join).",
            ["compression"],
            registry=r,
        )
        self.step_bytes = Gauge(
            "foundry_swarm_step_bytes",
            "Bytes through the coordinator's link in the last step, by direction (up: from "
            "workers; down: to them), over all workers.",
            ["direction"],
            registry=r,
        )
        self.outer_step = Gauge(
            "foundry_swarm_outer_step",
            "Outer optimizer steps taken (rounds closed; --sync-every above 1).",
            registry=r,
        )
        self.inner_steps = Histogram(
            "foundry_swarm_inner_steps",
            "Inner steps a worker was given per round (--sync-every above 1).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.digest_mismatches = Counter(
            "foundry_swarm_digest_mismatches_total",
            "Workers whose weights digest differed from the coordinator's (sent full weights).",
            registry=r,
        )
        self.round_duration = Histogram(
            "foundry_swarm_round_duration_seconds",
            "From assignment to step applied.",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.straggler_wait = Histogram(
            "foundry_swarm_straggler_wait_seconds",
            "Time a round waited after its first report for the last one.",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.apply_duration = Histogram(
            "foundry_swarm_apply_duration_seconds",
            "Coordinator time to aggregate and apply one step.",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.rounds = Counter(
            "foundry_swarm_rounds_total", "Rounds by outcome.", ["outcome"], registry=r
        )
        self.workers_dropped = Counter(
            "foundry_swarm_workers_dropped_total",
            "Workers dropped, by reason.",
            ["reason"],
            registry=r,
        )
        self.checkpoints = Counter(
            "foundry_swarm_checkpoints_total", "Checkpoints written.", registry=r
        )
        self.checkpoint_failures = Counter(
            "foundry_swarm_checkpoint_failures_total",
            "Checkpoints that could not be written (full or read-only disk); training goes on.",
            registry=r,
        )
        self.checkpoint_duration = Histogram(
            "foundry_swarm_checkpoint_duration_seconds",
            "Time to write one checkpoint.",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.protocol_errors = Counter(
            "foundry_swarm_protocol_errors_total",
            "Connections closed for bad input, by link.",
            ["link"],
            registry=r,
        )
        # Every label value exists from the start, so "none yet" reads 0 on a dashboard, not
        # "no data".
        for reason in SWARM_DROP_REASONS:
            self.workers_dropped.labels(reason)
        for outcome in ("closed", "abandoned"):
            self.rounds.labels(outcome)
        for link in ("worker", "admin"):
            self.protocol_errors.labels(link)
        for direction in ("up", "down"):
            self.step_bytes.labels(direction)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.phase_duration = Histogram(
            "foundry_worker_phase_duration_seconds",
            "Time per round in each phase.",
            ["phase"],
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.samples = Counter(
            "foundry_worker_samples_total", "Samples this worker processed.", registry=r
        )
        self.samples_per_second = Gauge(
            "foundry_worker_samples_per_second",
            "Compute throughput of the last round.",
            registry=r,
        )
        self.loss = Gauge(
            "foundry_worker_loss", "Mean cross-entropy of the last round.", registry=r
        )
        self.reconnects = Counter(
            "foundry_worker_reconnects_total",
            "Connections to the coordinator opened again after a first one.",
            registry=r,
        )
        self.gradient_bytes = Counter(
            "foundry_worker_gradient_bytes_total", "Gradient bytes sent.", registry=r
        )
        self.weight_bytes = Counter(
            "foundry_worker_weight_bytes_total",
            "Weight bytes received: full weights (joins, failed digests) or updates.",
            ["kind"],
            registry=r,
        )
        self.threads = Gauge(
            "foundry_worker_threads",
            "CPU threads this worker computes on (--threads).",
            registry=r,
        )
        self.inner_steps = Counter(
            "foundry_worker_inner_steps_total",
            "Inner optimizer steps run in local-step rounds (--sync-every above 1).",
            registry=r,
        )
        self.info = Gauge(
            "foundry_worker_info",
            "Always 1; its labels name the worker, so dashboards can join its other series "
            "(which carry only the scrape target) to the worker id.",
            ["worker", "profile"],
            registry=r,
        )
        for phase in ("compute", "compress", "send"):
            self.phase_duration.labels(phase)
        for kind in ("full", "update"):
            self.weight_bytes.labels(kind)


# A gateway call: a status read (a millisecond) to a long generation or export (minutes).
CALL_BUCKETS = (
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


# The gap between two tokens of a stream: a fraction of a millisecond (tokens that arrive
# together) to seconds (a stream behind a long prompt's prefill).
ITL_BUCKETS = (
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.5,
    5.0,
)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "foundry_gateway_requests_total",
            "gRPC calls by method and status code.",
            ["method", "code"],
            registry=r,
        )
        self.request_duration = Histogram(
            "foundry_gateway_request_duration_seconds",
            "From a call's start to its end (a stream's whole life).",
            ["method"],
            buckets=CALL_BUCKETS,
            registry=r,
        )
        self.backend_up = Gauge(
            "foundry_gateway_backend_up",
            "1 while the health probe reaches the backend, else 0.",
            ["backend"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "foundry_gateway_generated_tokens_total",
            "Tokens streamed to Generate callers.",
            registry=r,
        )
        self.generate_responses = Counter(
            "foundry_gateway_generate_responses_total",
            "Generate response messages sent; tokens over messages is the mean batch.",
            registry=r,
        )
        # The OpenAI-compatible HTTP API (gateway/openai/), by endpoint (chat, completions,
        # models, health) and HTTP status (499: the client went away first).
        self.http_requests = Counter(
            "foundry_gateway_http_requests_total",
            "HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.http_ttft = Histogram(
            "foundry_gateway_http_time_to_first_token_seconds",
            "From a generation request's arrival (queueing included) to its first token.",
            ["endpoint"],
            buckets=CALL_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "foundry_gateway_inter_token_latency_seconds",
            "The gap between a generation's consecutive tokens as the gateway takes them from "
            "the pair (a batch of k tokens: k gaps of its gap / k), by endpoint: generate (the "
            "gRPC Generate), chat, completions.",
            ["endpoint"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        # Each endpoint's series from the start, at 0: Prometheus's rate() counts no increase
        # into a series' first sample, so gaps observed before the first scrape that saw the
        # series would never show on the dashboard.
        for endpoint in ("generate", "chat", "completions"):
            self.inter_token.labels(endpoint)
        self.http_rate = Histogram(
            "foundry_gateway_http_decode_rate_tokens_per_second",
            "Tokens per second after the first, per completed generation.",
            ["endpoint"],
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000),
            registry=r,
        )
        self.http_tokens = Counter(
            "foundry_gateway_http_generated_tokens_total",
            "Tokens generated for HTTP requests.",
            ["endpoint"],
            registry=r,
        )
        self.http_queue_depth = Gauge(
            "foundry_gateway_http_queue_depth_requests",
            "HTTP generation requests waiting for a place on the pair.",
            registry=r,
        )
        self.http_active = Gauge(
            "foundry_gateway_http_active_requests",
            "HTTP generation requests holding a place on the pair (admitted, not yet ended).",
            registry=r,
        )

    def observe_gaps(self, endpoint: str, gaps: list[float]) -> None:
        """A batch's inter-token gaps (``Generation.gaps``)."""
        if gaps:
            child = self.inter_token.labels(endpoint)
            for gap in gaps:
                child.observe(gap)


# Request outcomes of the TP leader: the frontend's DONE reasons and ERROR codes, lower case.
TP_OUTCOMES = (
    "max_tokens", "eos", "stop_string", "cancelled", "context_full",
    "bad_request", "unavailable", "overloaded", "internal",
)  # fmt: skip


# Pair failures (``foundry.tp``): a refused bring-up (handshake, identity, busy) or a pair lost
# (hangup, hash, gate, protocol, lockstep, control).
TP_FAILURE_KINDS = (
    "handshake", "identity", "busy", "hangup", "hash", "gate", "protocol", "lockstep", "control",
)  # fmt: skip


class RankLabel(Collector):
    """Another registry's metrics, each sample with a ``rank`` label added: the two ranks of
    a pair export the same names, and a query must tell the leader's from the worker's (a
    leader-only series is 0 on the worker, not a second reading of the same thing)."""

    def __init__(self, source: CollectorRegistry, rank: int) -> None:
        self.source = source
        self.rank = str(rank)

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(
                    s.name, {**s.labels, "rank": self.rank}, s.value, s.timestamp, s.exemplar
                )
            yield out


class TpMetrics:
    """Every rank of a tensor-parallel pair or world (each process has its own registry);
    every series carries ``rank`` (0 the leader, 1 .. N-1 the workers)."""

    def __init__(self, registry: CollectorRegistry | None = None, rank: int = 0) -> None:
        self.registry = registry or CollectorRegistry()
        r = self._own = CollectorRegistry()
        self._label = RankLabel(r, rank)
        self.registry.register(self._label)
        self.tokens = Counter(
            "foundry_tp_tokens_total",
            "Tokens evaluated by the pair, by phase (prefill: prompt tokens; decode: generated).",
            ["phase"],
            registry=r,
        )
        self.token_duration = Histogram(
            "foundry_tp_token_duration_seconds",
            "Time per generated token: the decode step's time over the tokens it produced.",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.gate_duration = Histogram(
            "foundry_tp_gate_exchange_duration_seconds",
            "One gate exchange: send this rank's partial, receive the peer's, sum.",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.gate_bytes = Counter(
            "foundry_tp_gate_bytes_total",
            "Bytes on the gate link (tags and partials), by direction.",
            ["direction"],
            registry=r,
        )
        self.control_bytes = Counter(
            "foundry_tp_control_bytes_total",
            "Bytes on the control link (frames, logits halves), by direction.",
            ["direction"],
            registry=r,
        )
        self.row_replies = Counter(
            "foundry_tp_row_replies_total",
            "Commands answered with logits rows, by what the workers sent: logits (their "
            "blocks of the rows), row_tops (each row's greedy pick) or row_draws (their part "
            "of each sampled row's draw too; leader).",
            ["kind"],
            registry=r,
        )
        self.passes = Counter(
            "foundry_tp_passes_total",
            "Model passes, by command: sync (a prompt alone), mixed_batch (a prompt's chunk and "
            "the decoding sessions), mixed_prefills (chunks of several prompts and the decoding "
            "sessions), eval, eval_batch, verify (leader).",
            ["kind"],
            registry=r,
        )
        self.active_sessions = Gauge(
            "foundry_tp_active_sessions", "Sessions open on this rank.", registry=r
        )
        self.threads = Gauge(
            "foundry_tp_threads", "CPU threads this rank computes on (--threads).", registry=r
        )
        self.kept_sessions = Gauge(
            "foundry_tp_kept_sessions",
            "Sessions of finished generations kept open for prompts that continue them (leader).",
            registry=r,
        )
        self.prompt_tokens_reused = Counter(
            "foundry_tp_prompt_tokens_reused_total",
            "Prompt tokens not evaluated again because a kept session held them (leader).",
            registry=r,
        )
        self.sessions_resynced = Counter(
            "foundry_tp_sessions_resynced_total",
            "Sessions opened again on a new pair from their token history (leader).",
            registry=r,
        )
        self.spec_drafted = Counter(
            "foundry_tp_spec_drafted_tokens_total",
            "Draft tokens proposed for verification.",
            registry=r,
        )
        self.spec_accepted = Counter(
            "foundry_tp_spec_accepted_tokens_total",
            "Draft tokens the model agreed with.",
            registry=r,
        )
        self.spec_commits = Counter(
            "foundry_tp_spec_commits_total",
            "Verified blocks, by how they ended (commit_full, commit_prefix, rollback_replay).",
            ["mode"],
            registry=r,
        )
        self.failures = Counter(
            "foundry_tp_failures_total",
            "Pair failures and refused bring-ups, by kind.",
            ["kind"],
            registry=r,
        )
        self.requests = Counter(
            "foundry_tp_requests_total",
            "Generations finished, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.worker_connected = Gauge(
            "foundry_tp_worker_connected",
            "1 while the pair is formed (the worker rank connected and agreed), else 0.",
            registry=r,
        )
        self.hash_checks = Counter(
            "foundry_tp_hash_checks_total",
            "Debug lockstep hash comparisons, by result (match, mismatch).",
            ["result"],
            registry=r,
        )
        for direction in ("sent", "received"):
            self.gate_bytes.labels(direction)
            self.control_bytes.labels(direction)
        for kind in ("logits", "row_tops", "row_draws"):
            self.row_replies.labels(kind)
        for phase in ("prefill", "decode"):
            self.tokens.labels(phase)
        for outcome in TP_OUTCOMES:
            self.requests.labels(outcome)
        for result in ("match", "mismatch"):
            self.hash_checks.labels(result)
        for mode in ("commit_full", "commit_prefix", "rollback_replay"):
            self.spec_commits.labels(mode)
        for kind in TP_FAILURE_KINDS:
            self.failures.labels(kind)
        # Resolved once: a rank records a gate 2 x n_layer times a token.
        self._gate_sent = self.gate_bytes.labels("sent")
        self._gate_received = self.gate_bytes.labels("received")

    def set_rank(self, rank: int) -> None:
        """The rank this process was given (a worker learns it when the world forms)."""
        self._label.rank = str(rank)

    def record_gate(self, seconds: float, nbytes: int) -> None:
        """One gate exchange: its time and the bytes that went each way."""
        self.gate_duration.observe(seconds)
        self._gate_sent.inc(nbytes)
        self._gate_received.inc(nbytes)
