"""`foundry ctl`: operate a running system through the gateway's gRPC API.

Every action is one call (``watch`` and ``generate`` one stream). The connection flags
(``--gateway``, ``--token-file``, ``--tls-ca``, ...) go before or after the action. Exit codes:
0 done, 1 the call failed (the gRPC status and what to do are printed to stderr) or the run
it shows (``status``, ``watch``) is FAILED, 2 bad flags, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import grpc

from foundry.commands.common import (
    fraction,
    host_port,
    nonneg_float,
    nonneg_int,
    positive_int,
    positive_seconds,
)
from foundry.commands.ctl_format import (
    enum_name,
    format_pair,
    format_training,
    format_workers,
    number,
)
from foundry.model.formats.gguf_model import FILE_DTYPES

DEFAULT_GATEWAY = ("127.0.0.1", 50051)
# Deadline of a unary call when --timeout is not given; `watch` gets none (it runs until
# training ends), `generate` GENERATE_TIMEOUT_S: a long generation on a slow pair fits, and a
# pair that stopped answering ends the command instead of hanging it.
DEFAULT_TIMEOUT_S = 30.0
GENERATE_TIMEOUT_S = 300.0
# Clears the terminal and homes the cursor: `watch` redraws its table in place on a terminal.
_REDRAW = "\x1b[H\x1b[2J"


class CtlError(Exception):
    """A flag that cannot be used (unreadable token file or CA)."""


# ---------------------------------------------------------------------------- flags


def _connection_flags(parser: argparse.ArgumentParser, *, on_action: bool) -> None:
    # On the actions the defaults are SUPPRESS, so a flag given before the action is not
    # overwritten by the action's default.
    def default(value: object) -> object:
        return argparse.SUPPRESS if on_action else value

    group = parser.add_argument_group("connection")
    group.add_argument(
        "--gateway",
        type=host_port,
        default=default(DEFAULT_GATEWAY),
        metavar="HOST:PORT",
        help="the gateway (default 127.0.0.1:50051)",
    )
    group.add_argument(
        "--token-file",
        type=Path,
        default=default(None),
        metavar="FILE",
        help="send the bearer token in FILE (the gateway's --token-file)",
    )
    group.add_argument(
        "--tls-ca",
        type=Path,
        default=default(None),
        metavar="FILE",
        help="use TLS, trusting the PEM certificate(s) in FILE",
    )
    group.add_argument(
        "--tls-server-name",
        default=default(None),
        metavar="NAME",
        help="the name the gateway's certificate is for, if not the --gateway host",
    )
    group.add_argument(
        "--timeout",
        type=positive_seconds,
        default=default(None),
        metavar="S",
        help=f"deadline of the call (default {DEFAULT_TIMEOUT_S:g} s; "
        f"{GENERATE_TIMEOUT_S:g} s for generate, none for watch)",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ctl = sub.add_parser(
        "ctl",
        help="operate a running system through the gateway",
        description="Control training, watch it, export the model and generate text, all "
        "through `foundry gateway`.",
    )
    _connection_flags(ctl, on_action=False)
    actions = ctl.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, help_text: str, func: Callable[[argparse.Namespace], int]) -> Any:
        p = actions.add_parser(name, help=help_text, description=help_text)
        _connection_flags(p, on_action=True)
        p.set_defaults(func=_guarded(func))
        return p

    action("status", "the training run, its workers and the inference pair", cmd_status)
    w = action("watch", "training progress, redrawn as it changes (Ctrl+C ends)", cmd_watch)
    w.add_argument(
        "--interval",
        type=positive_seconds,
        default=1.0,
        metavar="S",
        help="seconds between updates (default 1)",
    )
    w.add_argument(
        "--count",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop after N updates (default: until training is done)",
    )
    action("workers", "the registered workers", cmd_workers)
    action("start", "start training (a coordinator run with --wait-for-start)", cmd_start)
    action("pause", "pause training after the current round", cmd_pause)
    action("resume", "resume paused training", cmd_resume)
    action("checkpoint", "write a checkpoint now", cmd_checkpoint)
    action(
        "shutdown", "end training: final checkpoint, workers stop, coordinator exits", cmd_shutdown
    )
    e = action("export", "write the current weights as a GGUF model file", cmd_export)
    e.add_argument(
        "--path",
        default="",
        metavar="P",
        help="file on the coordinator's machine (default CHECKPOINT_DIR/model.gguf)",
    )
    e.add_argument(
        "--type",
        "--dtype",
        dest="dtype",
        default="f32",
        choices=FILE_DTYPES,
        help="tensor type: f32, f16, or quantized q8_0 / q4_0 (default f32)",
    )
    g = action("generate", "generate text on the tensor-parallel pair, streamed", cmd_generate)
    text = g.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="the text to continue")
    text.add_argument(
        "--message",
        action="append",
        type=chat_message,
        metavar="ROLE:TEXT",
        help="a turn of a conversation (repeat it: --message 'system:Be brief.' "
        "--message 'user:Hello'); the pair replies as the assistant, through the "
        "model's chat template",
    )
    g.add_argument(
        "--max-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="tokens to generate at most (default 64)",
    )
    g.add_argument(
        "--temperature",
        type=nonneg_float,
        default=0.0,
        metavar="T",
        help="0 is greedy and deterministic (default 0)",
    )
    g.add_argument(
        "--top-p",
        type=fraction,
        default=None,
        metavar="P",
        help="nucleus sampling threshold in (0, 1] (default: off)",
    )
    g.add_argument(
        "--top-k",
        type=nonneg_int,
        default=0,
        metavar="K",
        help="sample among the K most probable tokens only (default 0: all)",
    )
    g.add_argument("--seed", type=nonneg_int, default=0, help="sampler seed (default 0)")
    g.add_argument(
        "--stop",
        nargs="+",
        default=[],
        metavar="S",
        help="stop once the text reaches any of these strings",
    )
    g.add_argument(
        "--stats", action="store_true", help="print tokens, time and why it ended to stderr"
    )


def chat_message(value: str) -> tuple[str, str]:
    """``ROLE:TEXT`` as (role, text)."""
    role, sep, content = value.partition(":")
    if not sep or not role:
        raise argparse.ArgumentTypeError(f"expected ROLE:TEXT (e.g. user:Hello), got {value!r}")
    return role, content


# ---------------------------------------------------------------------------- connection


class Connection:
    """The channel, the call metadata and the deadline every action uses."""

    def __init__(self, args: argparse.Namespace) -> None:
        host, port = args.gateway
        self.target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.metadata: tuple[tuple[str, str], ...] = ()
        if args.token_file is not None:
            from foundry.gateway.auth import TokenError, read_token

            try:
                self.metadata = (("authorization", f"Bearer {read_token(args.token_file)}"),)
            except TokenError as exc:
                raise CtlError(str(exc)) from None
        self.timeout: float | None = args.timeout
        if args.tls_ca is not None:
            try:
                ca = args.tls_ca.read_bytes()
            except OSError as exc:
                raise CtlError(f"cannot read --tls-ca {args.tls_ca}: {exc}") from None
            options = []
            if args.tls_server_name:
                options.append(("grpc.ssl_target_name_override", args.tls_server_name))
            self.channel = grpc.secure_channel(
                self.target, grpc.ssl_channel_credentials(root_certificates=ca), options
            )
        else:
            self.channel = grpc.insecure_channel(self.target)

    def stub(self, stub_class: Callable[[grpc.Channel], Any]) -> Any:
        """A generated client stub (``...Stub``) on this connection's channel."""
        return stub_class(self.channel)

    def unary_timeout(self) -> float:
        return DEFAULT_TIMEOUT_S if self.timeout is None else self.timeout

    def close(self) -> None:
        self.channel.close()


def _guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except CtlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except grpc.RpcError as exc:
            print(f"error: {describe_rpc_error(exc, args)}", file=sys.stderr)
            return 1

    return run


def describe_rpc_error(exc: grpc.RpcError, args: argparse.Namespace) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "UNKNOWN"
    text = f"{name}: {details}"
    host, port = args.gateway
    # grpc's own words when the channel cannot reach the gateway (not a backend).
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect to all addresses" in (
        details or ""
    ):
        text += f" (is `foundry gateway` running at {host}:{port}? use --gateway HOST:PORT)"
    elif code == grpc.StatusCode.UNAUTHENTICATED and args.token_file is None:
        text += " (pass --token-file FILE)"
    return text


# ---------------------------------------------------------------------------- formatting
# ---------------------------------------------------------------------------- actions


def cmd_status(args: argparse.Namespace) -> int:
    from foundry.api.v1 import inference_pb2, inference_pb2_grpc, training_pb2, training_pb2_grpc

    conn = Connection(args)
    failed = False
    training_on = False  # training runs (or waits for workers, or is paused) and is healthy
    try:
        training = conn.stub(training_pb2_grpc.TrainingServiceStub)
        try:
            got = training.GetTrainingStatus(
                training_pb2.GetTrainingStatusRequest(),
                metadata=conn.metadata,
                timeout=conn.unary_timeout(),
            )
            print(format_training(got.status))
            failed = got.status.state == training_pb2.TRAINING_STATE_FAILED
            training_on = got.status.state in (
                training_pb2.TRAINING_STATE_WAITING,
                training_pb2.TRAINING_STATE_TRAINING,
                training_pb2.TRAINING_STATE_PAUSED,
            )
        except grpc.RpcError as exc:
            failed = True
            print(f"training: unavailable ({describe_rpc_error(exc, args)})")
        print()
        inference = conn.stub(inference_pb2_grpc.InferenceServiceStub)
        try:
            pair = inference.GetPairStatus(
                inference_pb2.GetPairStatusRequest(),
                metadata=conn.metadata,
                timeout=conn.unary_timeout(),
            )
            print(format_pair(pair))
        except grpc.RpcError as exc:
            if training_on and pair_not_started(exc):
                # As designed: the pair serves the trained model, so it starts after training.
                print(
                    f"pair: not started yet; it starts after training "
                    f"({describe_rpc_error(exc, args)})"
                )
            else:
                failed = True
                print(f"pair: unavailable ({describe_rpc_error(exc, args)})")
    finally:
        conn.close()
    return 1 if failed else 0


def pair_not_started(exc: grpc.RpcError) -> bool:
    """The gateway has not reached a pair since it started (as under `foundry up` while it
    trains), as opposed to one that went away."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    return code == grpc.StatusCode.UNAVAILABLE and "not reached since" in details


def cmd_watch(args: argparse.Namespace) -> int:
    from foundry.api.v1 import training_pb2, training_pb2_grpc

    if args.count is not None and args.count < 1:
        raise CtlError("--count must be at least 1")
    conn = Connection(args)
    out: TextIO = sys.stdout
    redraw = out.isatty()
    call = conn.stub(training_pb2_grpc.TrainingServiceStub).WatchTrainingStatus(
        training_pb2.WatchTrainingStatusRequest(interval_seconds=args.interval),
        metadata=conn.metadata,
        timeout=conn.timeout,
    )
    failed = False
    try:
        for n, update in enumerate(call, start=1):
            text = format_training(update.status)
            out.write(f"{_REDRAW}{text}\n" if redraw else f"{text}\n\n")
            out.flush()
            failed = update.status.state == training_pb2.TRAINING_STATE_FAILED
            if args.count is not None and n >= args.count:
                break
    finally:
        call.cancel()
        conn.close()
    return 1 if failed else 0


def _control(args: argparse.Namespace, rpc: str, request_type: str) -> Any:
    from foundry.api.v1 import training_pb2, training_pb2_grpc

    conn = Connection(args)
    try:
        stub = conn.stub(training_pb2_grpc.TrainingServiceStub)
        request = getattr(training_pb2, request_type)()
        return getattr(stub, rpc)(request, metadata=conn.metadata, timeout=conn.unary_timeout())
    finally:
        conn.close()


def cmd_workers(args: argparse.Namespace) -> int:
    got = _control(args, "ListWorkers", "ListWorkersRequest")
    print(format_workers(got.workers))
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    got = _control(args, "StartTraining", "StartTrainingRequest")
    print(f"step {got.global_step}: {got.message}")
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    got = _control(args, "PauseTraining", "PauseTrainingRequest")
    print(f"step {got.global_step}: {got.message}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    got = _control(args, "ResumeTraining", "ResumeTrainingRequest")
    print(f"step {got.global_step}: {got.message}")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    got = _control(args, "CreateCheckpoint", "CreateCheckpointRequest")
    print(f"checkpoint at step {got.global_step}: {got.path}")
    return 0


def cmd_shutdown(args: argparse.Namespace) -> int:
    got = _control(args, "ShutdownTraining", "ShutdownTrainingRequest")
    print(f"step {got.global_step}: {got.message}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from foundry.api.v1 import model_pb2, model_pb2_grpc

    conn = Connection(args)
    try:
        got = conn.stub(model_pb2_grpc.ModelServiceStub).ExportModel(
            model_pb2.ExportModelRequest(path=args.path, type=args.dtype),
            metadata=conn.metadata,
            timeout=conn.unary_timeout(),
        )
    finally:
        conn.close()
    print(f"exported step {got.global_step} to {got.path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Only the generated text goes to stdout, then one newline: the same bytes as a
    single-process `foundry generate` for the same model, prompt and settings."""
    from foundry.api.v1 import inference_pb2, inference_pb2_grpc

    request = inference_pb2.GenerateRequest(
        prompt=args.prompt or "",
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        stop=args.stop,
        top_k=args.top_k,
        messages=[inference_pb2.ChatMessage(role=r, content=c) for r, c in args.message or ()],
    )
    if args.top_p is not None:
        request.top_p = args.top_p
    conn = Connection(args)
    out: TextIO = sys.stdout
    timeout = GENERATE_TIMEOUT_S if conn.timeout is None else conn.timeout
    call = conn.stub(inference_pb2_grpc.InferenceServiceStub).Generate(
        request, metadata=conn.metadata, timeout=timeout
    )
    done = None
    try:
        for event in call:
            text = "".join(token.text for token in event.tokens)
            if text:
                out.write(text)
                out.flush()
            if event.HasField("done"):
                done = event.done
    finally:
        # Cancelling the call (Ctrl+C, or an error) makes the gateway stop the pair's decoding.
        call.cancel()
        conn.close()
        out.write("\n")
        out.flush()
    if args.stats and done is not None:
        rate = done.generated_tokens / done.seconds if done.seconds > 0 else float("nan")
        reason = enum_name(done.reason, inference_pb2.FinishReason, "FINISH_REASON_").lower()
        print(
            f"{done.generated_tokens} tokens after a {done.prompt_tokens}-token prompt in "
            f"{done.seconds:.3f} s ({number(rate, '.1f')} tokens/s), finished: {reason}",
            file=sys.stderr,
        )
    return 0
