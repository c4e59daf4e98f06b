"""Prometheus configurations that scrape Foundry's services.

One scrape job per service, named as in ``services/prometheus/prometheus.yml`` (the compose
configuration), so the dashboards in ``grafana/`` work on both: they tell the two TP ranks apart
by ``job``. ``render`` writes the configuration for services at known addresses (local processes,
the integration test); the compose file finds the scaled-out workers by DNS instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

# Scrape jobs, in the order of the system's data flow.
JOBS = ("coordinator", "worker", "tp-leader", "tp-worker", "gateway")

# The port plan: each service's --metrics-port in compose and Kubernetes (docs/observability.md).
METRICS_PORTS = {
    "coordinator": 9100,
    "worker": 9101,
    "tp-leader": 9102,
    "gateway": 9103,
    "tp-worker": 9104,
}


def duration(seconds: float) -> str:
    """``seconds`` as a Prometheus duration: ``1s``, ``250ms``."""
    ms = round(seconds * 1000)
    if ms <= 0:
        raise ValueError(f"a scrape interval must be positive, got {seconds} s")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def render(targets: Mapping[str, Sequence[str]], scrape_interval_s: float = 5.0) -> str:
    """A Prometheus configuration (YAML) scraping ``targets``: job -> ``HOST:PORT`` addresses.

    Jobs must be among ``JOBS``; a job with no targets is left out.
    """
    unknown = sorted(set(targets) - set(JOBS))
    if unknown:
        raise ValueError(f"unknown scrape jobs {unknown}; the jobs are {', '.join(JOBS)}")
    interval = duration(scrape_interval_s)
    lines = [
        "# Written by foundry.obs.prometheus_config.render: one scrape job per Foundry service.",
        "global:",
        f"  scrape_interval: {interval}",
        f"  scrape_timeout: {interval}",
        f"  evaluation_interval: {interval}",
        "scrape_configs:",
    ]
    for job in JOBS:
        addresses = list(targets.get(job, ()))
        for address in addresses:
            host, sep, port = address.rpartition(":")
            if not (sep and host and port.isdigit()):
                raise ValueError(f"target {address!r} of job {job} is not HOST:PORT")
        if addresses:
            lines += [
                f"  - job_name: {json.dumps(job)}",
                "    static_configs:",
                f"      - targets: {json.dumps(addresses)}",
            ]
    return "\n".join(lines) + "\n"
