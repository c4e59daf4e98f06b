"""`foundry probe`: is a service up? The health check of containers and scripts.

The image carries no curl or grpc_health_probe, and a service's own CLI is the one tool
that is surely there, so Compose healthchecks and scripts call this: a TCP connect for
the FDTC and TP ports and the metrics endpoints, the standard gRPC health check for the
gateway. Exit 0 when healthy, 1 when not (the reason on stderr), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import socket
import sys

from foundry.commands.common import host_port, positive_seconds


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "probe",
        help="check that a service answers (TCP connect, or gRPC health with --grpc)",
        description="Exit 0 if HOST:PORT accepts a TCP connection or, with --grpc, if the "
        "gRPC health service there reports SERVING for SERVICE (default: the server as a "
        "whole). Exit 1 otherwise, with the reason on stderr.",
    )
    p.add_argument("address", type=host_port, metavar="HOST:PORT")
    p.add_argument(
        "--grpc",
        nargs="?",
        const="",
        default=None,
        metavar="SERVICE",
        help="ask grpc.health.v1.Health/Check for SERVICE (e.g. "
        "foundry.v1.InferenceService; empty: the server as a whole)",
    )
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=3.0,
        metavar="S",
        help="give up after this many seconds (default 3)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    host, port = args.address
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if args.grpc is None:
        try:
            with socket.create_connection((host, port), timeout=args.timeout):
                return 0
        except OSError as exc:
            print(f"{target}: {exc}", file=sys.stderr)
            return 1
    return _grpc_health(target, args.grpc, args.timeout)


def _grpc_health(target: str, service: str, timeout_s: float) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            got = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = code.name if code is not None else "UNKNOWN"
            print(f"{target}: health check failed: {name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(got.status)
    if got.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{target}: {service or 'server'} is {status}", file=sys.stderr)
        return 1
    return 0
