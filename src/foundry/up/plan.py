"""The plan of `foundry up`, pure: options, the port layout, every service's command line and
the Prometheus config, all plain functions of the options, tested without starting anything."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from foundry.model.train import recipe

# The services' own ``foundry`` entry point, run with this interpreter so a venv is honoured.
FOUNDRY = (sys.executable, "-m", "foundry")


class StackError(Exception):
    """The stack cannot start or keep running; the message says what to do."""


@dataclass(frozen=True)
class StackOptions:
    # The demo's training is the recipe every command that trains defaults to
    # (foundry.model.train.recipe): about a minute and a half on two quiet cores.
    steps: int = recipe.STEPS
    workers: int = 2
    base_port: int = 7070
    gateway_port: int = 50051
    http_port: int = 8080  # the gateway's OpenAI-compatible HTTP API
    metrics_port: int = 9100
    prometheus_port: int = 9090
    host: str = "127.0.0.1"
    run_dir: Path = Path("runs/up")
    prometheus: bool = True
    prompt: str = "The "
    sample_tokens: int = 64
    preset: str = "tiny"
    global_batch: int = recipe.GLOBAL_BATCH
    seq_len: int = recipe.SEQ_LEN
    lr: float = recipe.LR
    sample_every: int | None = None  # steps between samples while training; None: a tenth
    fresh: bool = False
    checkpoint_every: int | None = None  # None: ``default_checkpoint_every(steps)``
    model: Path | None = None  # a GGUF file to serve on the pair, without training
    ctx_size: int | None = None  # the pair's context (None: the file's, capped)
    threads: int | None = None  # the stack's CPU threads, shared (None: each child's default)
    # Fine-tuning a published model on --data with LoRA, then serving it with the adapter.
    base_model: Path | None = None
    data: Path | None = None
    lora_rank: int = 8
    lora_alpha: float = 8.0
    lora_targets: str = "attn_q,attn_v"
    keep_quantized: bool = False  # the workers hold the base in the file's types

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise StackError(f"--steps must be at least 1, got {self.steps}")
        if self.global_batch < 1:
            raise StackError(f"--global-batch must be at least 1, got {self.global_batch}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise StackError(f"--checkpoint-every must be at least 1, got {self.checkpoint_every}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise StackError(f"--workers must be 1 to {MAX_WORKERS}, got {self.workers}")
        if self.sample_tokens < 1:
            raise StackError(f"--sample-tokens must be at least 1, got {self.sample_tokens}")
        if self.sample_every is not None and self.sample_every < 1:
            raise StackError(f"--sample-every must be at least 1, got {self.sample_every}")
        if self.base_model is not None and (self.data is None or self.model is not None):
            raise StackError(
                "--base-model needs --data (the text to fine-tune on) and excludes --model"
            )
        if self.keep_quantized and self.base_model is None:
            raise StackError("--keep-quantized holds a fine-tuned base: it needs --base-model")
        if self.threads is not None and self.threads < 1:
            raise StackError(f"--threads must be at least 1, got {self.threads}")
        if self.ctx_size is not None and self.ctx_size < 1:
            raise StackError(f"--ctx-size must be at least 1, got {self.ctx_size}")
        if self.seq_len < 1 or self.lr <= 0:
            raise StackError(f"--seq-len and --lr must be positive, got {self.seq_len}, {self.lr}")
        for name, port in (
            ("--base-port", self.base_port),
            ("--gateway-port", self.gateway_port),
            ("--http-port", self.http_port),
            ("--metrics-port", self.metrics_port),
            ("--prometheus-port", self.prometheus_port),
        ):
            if not 1 <= port <= 65535 - PORT_SPAN:
                raise StackError(f"{name} {port} is out of range 1-{65535 - PORT_SPAN}")

    @property
    def loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")

    @property
    def warmup_steps(self) -> int:
        return recipe.warmup_steps(self.steps)

    @property
    def sample_interval(self) -> int:
        """Steps between the samples shown while training, each drawn from the first checkpoint
        at or after its step."""
        return self.sample_every or max(1, self.steps // 10)

    @property
    def validate_every(self) -> int:
        # A fine-tuning run validates before its first step and after its last: the held-out
        # loss before and after.
        return self.steps if self.base_model is not None else recipe.validate_every(self.steps)

    @property
    def checkpoint_interval(self) -> int:
        """``--checkpoint-every``, or the bounded default, never longer than the sample
        interval (the samples shown while training are drawn from the checkpoints)."""
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        return min(default_checkpoint_every(self.steps), self.sample_interval)


# Checkpoints of a default run: a quarter of the run, at least this often (a stop writes one
# more, so at most this many steps are ever lost to a crash, not to a stop) ...
MAX_CHECKPOINT_EVERY = 100
# ... and not more often than this: a tiny run need not write one every few steps.
MIN_CHECKPOINT_EVERY = 10


def default_checkpoint_every(steps: int) -> int:
    return max(MIN_CHECKPOINT_EVERY, min(MAX_CHECKPOINT_EVERY, steps // 4))


# Supervision: a service that exits non-zero (or is killed) after it started is started again
# after RESTART_FIRST_S, doubling each time up to RESTART_MAX_S; once it has stayed up for
# RESTART_RESET_S the next failure counts as its first again.
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
RESTART_RESET_S = 60.0
# ... but a service that failed RESTART_LIMIT times within RESTART_WINDOW_S is left down: it
# fails for a reason a restart does not cure (its log says which), and restarting it forever
# only hides that. The first five failures in a row come 1 + 2 + 4 + 8 s of backoff apart.
RESTART_LIMIT = 5
RESTART_WINDOW_S = 60.0


def restart_delay(failures: int) -> float:
    """Seconds to wait before the restart that follows failure number ``failures`` (1, 2...)."""
    return min(RESTART_MAX_S, RESTART_FIRST_S * 2.0 ** max(0, failures - 1))


def gives_up(failed_at: Sequence[float], now: float) -> bool:
    """Whether a service that failed at the (monotonic) times ``failed_at`` is left down:
    RESTART_LIMIT failures within the last RESTART_WINDOW_S."""
    return sum(1 for t in failed_at if now - t <= RESTART_WINDOW_S) >= RESTART_LIMIT


# Workers get metrics ports metrics_port + 10 + i: room for this many.
MAX_WORKERS = 64
# Ports above a base that the layout may use (the workers' metrics ports reach furthest).
PORT_SPAN = 10 + MAX_WORKERS


@dataclass(frozen=True)
class StackPorts:
    """Where everything listens. Fixed offsets from three bases, so the defaults of
    `foundry ctl` (gateway 50051), `foundry worker` (coordinator 7070) and the TP commands
    (7090/7091) reach the default stack, and the default metrics ports are the ones every
    deployment uses (``foundry.obs.prometheus_config.METRICS_PORTS``); only the workers,
    many on one machine here, get one port each from M+10 on."""

    coordinator: int
    admin: int
    tp_leader: int
    tp_frontend: int
    gateway: int
    http: int
    coordinator_metrics: int
    tp_leader_metrics: int
    tp_worker_metrics: int
    gateway_metrics: int
    worker_metrics: tuple[int, ...]
    prometheus: int | None

    @classmethod
    def of(cls, opt: StackOptions) -> StackPorts:
        b, m = opt.base_port, opt.metrics_port
        return cls(
            coordinator=b,
            admin=b + 1,
            tp_leader=b + 20,
            tp_frontend=b + 21,
            gateway=opt.gateway_port,
            http=opt.http_port,
            coordinator_metrics=m,
            tp_leader_metrics=m + 2,
            gateway_metrics=m + 3,
            tp_worker_metrics=m + 4,
            worker_metrics=tuple(m + 10 + i for i in range(opt.workers)),
            prometheus=opt.prometheus_port if opt.prometheus else None,
        )

    def named(self) -> list[tuple[str, int]]:
        """Every port with what it is for, in the order they are checked."""
        out = [
            ("coordinator workers", self.coordinator),
            ("coordinator admin", self.admin),
            ("tp-leader", self.tp_leader),
            ("tp-leader frontend", self.tp_frontend),
            ("gateway", self.gateway),
            ("gateway http", self.http),
            ("coordinator metrics", self.coordinator_metrics),
            ("tp-leader metrics", self.tp_leader_metrics),
            ("gateway metrics", self.gateway_metrics),
            ("tp-worker metrics", self.tp_worker_metrics),
        ]
        out += [(f"worker-{i} metrics", p) for i, p in enumerate(self.worker_metrics)]
        if self.prometheus is not None:
            out.append(("prometheus", self.prometheus))
        return out


@dataclass(frozen=True)
class ServiceSpec:
    """One child: its name, its command line and the line that says it is up."""

    name: str
    argv: tuple[str, ...]
    ready: str  # a regex its log shows once it serves
    critical: bool = True  # its exit ends the stack (a worker's does not)
    stop_stage: int = 0  # stopped after every child of a lower stage exited


def thread_share(total: int | None, processes: int) -> tuple[str, ...]:
    """``--threads`` for each of ``processes`` children that compute at the same time on a
    machine of ``total`` threads (at least one each; nothing where the total is not set)."""
    if total is None:
        return ()
    return ("--threads", str(max(1, total // processes)))


def addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def gateway_service(opt: StackOptions, ports: StackPorts, token_file: Path | None) -> ServiceSpec:
    """The gateway (gRPC, and the OpenAI-compatible HTTP API) in front of the coordinator's
    admin port and the pair's frontend."""
    return ServiceSpec(
        "gateway",
        (
            *FOUNDRY,
            "gateway",
            "--listen",
            addr(opt.host, ports.gateway),
            "--http-listen",
            addr(opt.host, ports.http),
            "--coordinator-admin",
            addr("127.0.0.1", ports.admin),
            "--tp-frontend",
            addr("127.0.0.1", ports.tp_frontend),
            *(("--token-file", str(token_file)) if token_file else ()),
            "--metrics-port",
            str(ports.gateway_metrics),
            "--metrics-host",
            opt.host,
        ),
        r"gateway listening:",
    )


def training_services(
    opt: StackOptions, ports: StackPorts, token_file: Path | None
) -> list[ServiceSpec]:
    """Coordinator, gateway and workers, in start order."""
    run = opt.run_dir
    h = opt.host
    metrics = ("--metrics-host", h)
    model: tuple[str, ...] = ("--preset", opt.preset)
    data: tuple[str, ...] = ()
    if opt.base_model is not None:
        data = ("--base-model", str(opt.base_model), "--data", str(opt.data))
        model = (
            *data,
            "--lora-rank",
            str(opt.lora_rank),
            "--lora-alpha",
            str(opt.lora_alpha),
            "--lora-targets",
            opt.lora_targets,
            *(("--keep-quantized",) if opt.keep_quantized else ()),
        )
    coordinator = ServiceSpec(
        "coordinator",
        (
            *FOUNDRY,
            "coordinator",
            "--listen",
            addr(h, ports.coordinator),
            "--admin-listen",
            addr("127.0.0.1", ports.admin),
            "--checkpoint-dir",
            str(run / "checkpoints"),
            "--export-dir",
            str(run),
            *model,
            "--max-steps",
            str(opt.steps),
            "--min-workers",
            str(opt.workers),
            "--global-batch",
            str(opt.global_batch),
            "--seq-len",
            str(opt.seq_len),
            "--lr",
            str(opt.lr),
            "--warmup-steps",
            str(opt.warmup_steps),
            "--validate-every",
            str(opt.validate_every),
            "--checkpoint-every",
            str(opt.checkpoint_interval),
            "--metrics-port",
            str(ports.coordinator_metrics),
            *metrics,
        ),
        r"coordinator listening:",
        stop_stage=1,
    )
    gateway = gateway_service(opt, ports, token_file)
    workers = [
        ServiceSpec(
            f"worker-{i}",
            (
                *FOUNDRY,
                "worker",
                "--coordinator",
                addr("127.0.0.1", ports.coordinator),
                "--worker-id",
                f"worker-{i}",
                *data,
                *(("--keep-quantized",) if opt.keep_quantized else ()),
                "--metrics-port",
                str(port),
                *metrics,
                *thread_share(opt.threads, opt.workers),
            ),
            r"metrics :\d+",
            critical=False,
        )
        for i, port in enumerate(ports.worker_metrics)
    ]
    return [coordinator, gateway, *workers]


def serving_services(
    opt: StackOptions, ports: StackPorts, model: Path, lora: Path | None = None
) -> list[ServiceSpec]:
    """The tensor-parallel pair on the exported model (or the file --model names; or the
    base with the fine-tuned adapter)."""
    metrics = ("--metrics-host", opt.host)
    ctx: tuple[str, ...] = ("--ctx-size", str(opt.ctx_size)) if opt.ctx_size else ()
    if lora is not None:
        ctx = (*ctx, "--lora", str(lora))
    return [
        ServiceSpec(
            "tp-leader",
            (
                *FOUNDRY,
                "tp-leader",
                "--model",
                str(model),
                *ctx,
                *thread_share(opt.threads, 2),
                "--listen",
                addr("127.0.0.1", ports.tp_leader),
                "--frontend-listen",
                addr("127.0.0.1", ports.tp_frontend),
                "--metrics-port",
                str(ports.tp_leader_metrics),
                *metrics,
            ),
            r"tp-leader listening:",
        ),
        ServiceSpec(
            "tp-worker",
            (
                *FOUNDRY,
                "tp-worker",
                "--model",
                str(model),
                *ctx,
                *thread_share(opt.threads, 2),
                "--leader",
                addr("127.0.0.1", ports.tp_leader),
                "--metrics-port",
                str(ports.tp_worker_metrics),
                *metrics,
            ),
            r"tp-worker ready:",
        ),
    ]


def prometheus_config(ports: StackPorts, host: str) -> str:
    """Prometheus scrape config for the local stack: the jobs of Compose's
    services/prometheus/prometheus.yml (so the dashboards in grafana/ work on it too), with
    static targets on this machine."""
    from foundry.obs.prometheus_config import render

    target_host = local_host(host)

    def at(*targets: int) -> list[str]:
        return [addr(target_host, p) for p in targets]

    return render(
        {
            "coordinator": at(ports.coordinator_metrics),
            "worker": at(*ports.worker_metrics),
            "tp-leader": at(ports.tp_leader_metrics),
            "tp-worker": at(ports.tp_worker_metrics),
            "gateway": at(ports.gateway_metrics),
        }
    )


def prometheus_service(opt: StackOptions, ports: StackPorts, binary: str) -> ServiceSpec:
    assert ports.prometheus is not None
    run = opt.run_dir
    return ServiceSpec(
        "prometheus",
        (
            binary,
            f"--config.file={run / 'prometheus.yml'}",
            f"--storage.tsdb.path={run / 'prometheus'}",
            f"--web.listen-address={addr(opt.host, ports.prometheus)}",
        ),
        r"Server is ready to receive web requests",
        critical=False,
    )


def local_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
