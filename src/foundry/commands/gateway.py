"""`foundry gateway`: the gRPC front door to the coordinator and the tensor-parallel pair."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from foundry.commands.common import (
    add_metrics_flag,
    add_tls_flags,
    host_port,
    nonneg_float,
    nonneg_int,
    positive_int,
    positive_seconds,
    start_metrics,
    tls_context,
)
from foundry.gateway.openai.limits import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser(
        "gateway",
        help="run the gRPC gateway (training control, status, generation)",
        description="Serve the foundry.v1 gRPC API, standard health checking and reflection. "
        "Training calls go to the coordinator's admin link, inference calls to the TP "
        "leader's frontend link. Port 0 picks a free port; the bound port is printed.",
    )
    g.add_argument(
        "--listen",
        type=host_port,
        default=("0.0.0.0", 50051),
        metavar="HOST:PORT",
        help="where gRPC clients connect (default 0.0.0.0:50051)",
    )
    g.add_argument(
        "--http-listen",
        type=host_port,
        default=None,
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API here (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health; same token and TLS as gRPC); "
        "default: off",
    )
    g.add_argument(
        "--http-max-active",
        type=positive_int,
        default=16,
        metavar="N",
        help="HTTP generations sent to the pair at once (default 16, the leader's "
        "--max-sessions default)",
    )
    g.add_argument(
        "--http-queue",
        type=nonneg_int,
        default=64,
        metavar="N",
        help="HTTP generations waiting at most, beyond --http-max-active; past it "
        "429 with Retry-After (default 64)",
    )
    g.add_argument(
        "--http-header-timeout",
        type=positive_seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="S",
        help="close an HTTP connection whose request headers are not in within S "
        f"seconds (default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--http-max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="HTTP connections open at once; past it 503 and closed (default "
        f"{DEFAULT_MAX_CONNECTIONS})",
    )
    g.add_argument(
        "--model-name",
        default="foundry",
        metavar="NAME",
        help="the model's id in /v1/models and in responses (default foundry)",
    )
    g.add_argument(
        "--coordinator-admin",
        type=host_port,
        default=("127.0.0.1", 7071),
        metavar="HOST:PORT",
        help="the coordinator's --admin-listen address (default 127.0.0.1:7071)",
    )
    g.add_argument(
        "--tp-frontend",
        type=host_port,
        default=("127.0.0.1", 7091),
        metavar="HOST:PORT",
        help="the TP leader's --frontend-listen address (default 127.0.0.1:7091)",
    )
    g.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        metavar="FILE",
        help="serve gRPC over TLS with this PEM certificate (chain); needs --tls-key. "
        "(The links to the backends have their own --backend-tls-* flags.)",
    )
    g.add_argument(
        "--tls-key",
        type=Path,
        default=None,
        metavar="FILE",
        help="the PEM private key of --tls-cert",
    )
    g.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="require 'authorization: Bearer <token>' on every call but health and "
        "reflection; the token is this file's one line",
    )
    g.add_argument(
        "--grace",
        type=nonneg_float,
        default=5.0,
        metavar="S",
        help="seconds calls in flight get to finish on shutdown (default 5)",
    )
    add_tls_flags(
        g, server=False, prefix="backend-tls", links="the coordinator admin and TP frontend links"
    )
    add_metrics_flag(g)
    g.set_defaults(func=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    from foundry.gateway.auth import TokenError, read_token
    from foundry.gateway.server import Gateway, GatewayOptions
    from foundry.transport.tls import TlsConfigError

    if (args.tls_cert is None) != (args.tls_key is None):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    for path in (args.tls_cert, args.tls_key):
        if path is not None and not path.is_file():
            print(f"error: {path} is not a file", file=sys.stderr)
            return 2
    try:
        backend_tls = tls_context(args, server=False, prefix="backend-tls")
    except TlsConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    token = None
    if args.token_file is not None:
        try:
            token = read_token(args.token_file)
        except TokenError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    options = GatewayOptions(
        listen_host=args.listen[0],
        listen_port=args.listen[1],
        coordinator_host=args.coordinator_admin[0],
        coordinator_port=args.coordinator_admin[1],
        frontend_host=args.tp_frontend[0],
        frontend_port=args.tp_frontend[1],
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        backend_tls=backend_tls,
        token=token,
        grace_s=args.grace,
        http_host=args.http_listen[0] if args.http_listen else None,
        http_port=args.http_listen[1] if args.http_listen else 0,
        http_max_active=args.http_max_active,
        http_queue=args.http_queue,
        http_header_timeout_s=args.http_header_timeout,
        http_max_connections=args.http_max_connections,
        model_name=args.model_name,
    )

    async def main() -> int:
        gateway = Gateway(options)
        try:
            port = await gateway.start()
        except OSError as exc:
            print(f"error: {exc}", file=sys.stderr)
            await gateway.stop()
            return 1
        metrics = start_metrics(args, gateway.metrics.registry)
        print(
            f"gateway listening: grpc {options.listen_host}:{port}"
            + (" (tls)" if options.tls_cert else "")
            + (f", http {options.http_host}:{gateway.http_port}" if gateway.http else "")
            + (", token required" if token else "")
            + f", coordinator admin {gateway.admin.address}"
            + f", tp frontend {gateway.frontend.address}"
            + (" (backend tls)" if backend_tls else "")
            + (f", metrics :{metrics.port}" if metrics else ""),
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await gateway.stop()
            if metrics:
                metrics.close()
        return 0

    return asyncio.run(main())
