"""Flag types and helpers shared by the subcommands."""

from __future__ import annotations

import argparse

from prometheus_client import CollectorRegistry

from foundry.obs.metrics import MetricsServer


def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT`` for all interfaces) as an argparse type."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:7070)")
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port {port!r} in {text!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port {number} in {text!r} is out of range 0-65535")
    return (host.strip("[]") or "0.0.0.0", number)


def add_metrics_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="P",
        help="serve Prometheus metrics on this port (0 picks a free one; default: off)",
    )
    parser.add_argument(
        "--metrics-host", default="0.0.0.0", help="interface for --metrics-port (default all)"
    )


def start_metrics(args: argparse.Namespace, registry: CollectorRegistry) -> MetricsServer | None:
    if args.metrics_port is None:
        return None
    return MetricsServer(registry, args.metrics_host, args.metrics_port)
