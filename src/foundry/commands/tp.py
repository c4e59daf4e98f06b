"""`foundry tp-leader` and `foundry tp-worker`: the ranks of a tensor-parallel pair, or of a
world of N ranks (``--world-size``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from foundry.commands.common import (
    add_device_flags,
    add_frame_deadline_flag,
    add_metrics_flag,
    add_threads_flag,
    add_tls_flags,
    host_port,
    integer_shares,
    nonneg_int,
    peer_tls_contexts,
    positive_int,
    positive_seconds,
    start_metrics,
    tls_context,
    tls_note,
    use_threads,
)
from foundry.model.shard.table import ExpertSplit
from foundry.runtime import retain_freed_memory
from foundry.tp.handshake import DEFAULT_EXPERT_SPLIT
from foundry.tp.speculative import MAX_DRAFT, SpecMode
from foundry.wire.tp import SharesFrom

log = logging.getLogger("foundry")

AUTO = "auto"  # --expert-split auto: the leader picks (handshake.expert_split_for), workers follow


def _add_rank_flags(p: argparse.ArgumentParser, *, leader: bool) -> None:
    p.add_argument(
        "--model",
        type=Path,
        required=True,
        metavar="FILE.gguf",
        help="the model; both ranks must load the same file",
    )
    p.add_argument(
        "--lora",
        type=Path,
        default=None,
        metavar="ADAPTER.gguf",
        help="merge this LoRA adapter into the model at load (`foundry train "
        "--base-model ... --lora-rank R --out ADAPTER.gguf`); both ranks must load "
        "the same one",
    )
    p.add_argument(
        "--ctx-size",
        type=positive_int,
        default=None,
        help="positions per session: KV cache and rope tables are sized by it (default: "
        "the model's context length, at most 4096); "
        "both ranks must agree",
    )
    p.add_argument(
        "--no-shm",
        action="store_true",
        help="never use the shared-memory gate slab, even on one host (gates go over TCP)",
    )
    p.add_argument(
        "--gate-timeout",
        type=positive_seconds,
        default=1.0,
        metavar="S",
        help="a peer silent this long in a gate or a command is lost (default 1)",
    )
    p.add_argument(
        "--blas-threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="BLAS threads of this rank (default 1: one core per rank, and the "
        "pair's logits stay bit-identical to one process)",
    )
    p.add_argument(
        "--expert-split",
        default=AUTO,
        choices=[AUTO, *(m.value for m in ExpertSplit)],
        help="how the routed experts are cut: 'experts' (each rank holds a block of "
        "the experts whole) or 'intermediate' (each rank holds a block of every "
        "expert's intermediate size); every rank runs the same (the hello checks it). "
        + (
            f"'auto' (default): '{DEFAULT_EXPERT_SPLIT.value}' where the file takes it for "
            "the world (every rank's cut on whole blocks of its stored tensors), else "
            "'experts'; the log says which and why"
            if leader
            else "'auto' (default): the leader's"
        ),
    )
    add_frame_deadline_flag(
        p, 30.0, "the control link" + (" and the frontend link" if leader else "")
    )
    p.add_argument(
        "--share",
        type=_share,
        default=None,
        metavar="W",
        help="this rank's share of the model, an integer weight, taken when the "
        "leader runs --shares ranks; otherwise the leader's shares win: a worker's "
        "--share that differs from its rank's is refused, and the leader's goes "
        "only with --shares ranks",
    )
    p.add_argument(
        "--speed",
        type=_share_speed,
        default=None,
        metavar="S",
        help="with the leader's --shares auto: state this speed (multiply-adds per "
        "microsecond) instead of measuring it, for a machine whose calibration "
        "misleads, and for tests",
    )
    add_metrics_flag(p)


def _share(text: str) -> int:
    from foundry.model.shard.shares import MAX_SHARE

    value = positive_int(text)
    if value > MAX_SHARE:
        raise argparse.ArgumentTypeError(f"a share is at most {MAX_SHARE}, got {value}")
    return value


def _share_speed(text: str) -> int:
    value = positive_int(text)
    if value > 0xFFFFFFFF:
        raise argparse.ArgumentTypeError(f"a speed is at most {0xFFFFFFFF}, got {value}")
    return value


def _shares(text: str) -> tuple[int, ...] | str | None:
    if text in ("auto", "ranks"):
        return text
    return integer_shares(text, ", or 'auto' or 'ranks'")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    lead = sub.add_parser(
        "tp-leader",
        help="serve a model as rank 0 of a tensor-parallel pair",
        description="Load rank 0's half of the model, wait for the worker rank on --listen, "
        "and serve generations on --frontend-listen (the gateway's TP frontend). Port 0 picks "
        "a free port; the bound ports are printed on one line.",
    )
    _add_rank_flags(lead, leader=True)
    lead.add_argument(
        "--listen",
        type=host_port,
        default=("0.0.0.0", 7090),
        metavar="HOST:PORT",
        help="where the worker connects (default 0.0.0.0:7090)",
    )
    lead.add_argument(
        "--frontend-listen",
        type=host_port,
        default=("127.0.0.1", 7091),
        metavar="HOST:PORT",
        help="the frontend link for the gateway (default 127.0.0.1:7091)",
    )
    lead.add_argument(
        "--world-size",
        type=positive_int,
        default=2,
        metavar="N",
        help="ranks in all, this one included (default 2: the pair); each of the "
        "N-1 workers dials --listen (docs/tp.md, N ranks)",
    )
    lead.add_argument(
        "--shares",
        type=_shares,
        default=None,
        metavar="W0,W1,...",
        help="each rank's share of the model, rank 0 first, as integer weights "
        "(2,1,1: rank 0 holds half, ranks 1 and 2 a quarter each); a slow "
        "machine takes the smaller one (default, or empty: equal); 'auto': "
        "chosen at pairing from each rank's measured speed; 'ranks': each "
        "rank's own --share (docs/tp.md, Shares by speed)",
    )
    lead.add_argument(
        "--max-sessions",
        type=positive_int,
        default=16,
        help="generations decoded at once (default 16)",
    )
    lead.add_argument(
        "--keep-sessions",
        type=nonneg_int,
        default=8,
        metavar="N",
        help="finished generations whose KV cache stays open for a prompt that "
        "continues them (the next turn of a conversation); also how many "
        "sessions are re-synced from their history when a worker pairs again "
        "(default 8; 0: none)",
    )
    lead.add_argument(
        "--queue",
        type=nonneg_int,
        default=64,
        help="generations waiting beyond those; more are OVERLOADED (default 64)",
    )
    lead.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=64,
        metavar="TOKENS",
        help="prompt tokens per prefill step; cancellation is checked between chunks (default 64)",
    )
    lead.add_argument(
        "--prefill-batch",
        type=positive_int,
        default=256,
        metavar="TOKENS",
        help="prompt tokens one pass evaluates at most: the next chunks of as many waiting "
        "prompts as fit, beside one token of every decoding session (default 256)",
    )
    lead.add_argument(
        "--spec-mode",
        default=SpecMode.FULL_PREFIX.value,
        choices=[m.value for m in SpecMode],
        help="speculative decoding of greedy requests: off, full-prefix (keep the "
        "accepted prefix) or rollback (rewind and replay it); default full-prefix",
    )
    lead.add_argument(
        "--max-draft",
        type=nonneg_int,
        default=MAX_DRAFT,
        help=f"draft tokens per verify block (default {MAX_DRAFT})",
    )
    lead.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|FILE",
        help="how chat messages become the prompt: a built-in (gemma, chatml, "
        "llama3, plain) or a Jinja file (default: the model file's "
        "tokenizer.chat_template, else plain: a file without one is taken for a "
        "base model)",
    )
    lead.add_argument(
        "--chat-content-specials",
        action="store_true",
        help="parse special-token texts (<start_of_turn>, <|im_start|>) in "
        "messages' content as the special tokens (llama.cpp's way); by default "
        "they stay text, so a user cannot forge a turn",
    )
    lead.add_argument(
        "--max-messages",
        type=positive_int,
        default=4096,
        metavar="N",
        help="a chat request's most messages (default 4096)",
    )
    lead.add_argument(
        "--hash-check",
        action="store_true",
        help="debug: after every step both ranks compare a hash of their state",
    )
    lead.add_argument(
        "--no-row-tops",
        dest="row_tops",
        action="store_false",
        help="every pass ships the workers' logits, instead of each greedy row's pick (ROW_TOPS) "
        "and each sampled row's draw in its blocks (ROW_DRAWS, docs/protocol.md); the same "
        "tokens, for comparison",
    )
    lead.add_argument(
        "--frontend-max-connections",
        type=positive_int,
        default=64,
        metavar="N",
        help="open connections on --frontend-listen at most; more are refused "
        "(default 64). --listen takes one pair (and 4 connections in bring-up)",
    )
    add_device_flags(lead, training=False)
    add_threads_flag(lead, training=False, colocated=True)
    add_tls_flags(lead, server=True, links="--listen and --frontend-listen")
    lead.set_defaults(func=run_leader)

    work = sub.add_parser(
        "tp-worker",
        help="run rank 1 of a tensor-parallel pair",
        description="Load rank 1's half of the model and dial the leader (with backoff, again "
        "after any failure). Exits 0 when the leader stops the pair, 2 when the two ranks "
        "disagree on the model.",
    )
    _add_rank_flags(work, leader=False)
    work.add_argument(
        "--leader",
        type=host_port,
        default=("127.0.0.1", 7090),
        metavar="HOST:PORT",
        help="the leader's --listen address",
    )
    work.add_argument(
        "--retry-max",
        type=positive_seconds,
        default=2.0,
        metavar="S",
        help="longest pause between dial attempts (default 2)",
    )
    work.add_argument(
        "--rank",
        type=positive_int,
        default=None,
        metavar="R",
        help="the rank to serve as, 1 .. N-1 of the leader's --world-size "
        "(default: the next free one; after a loss, the one held before)",
    )
    work.add_argument(
        "--gate-listen",
        type=host_port,
        default=("0.0.0.0", 0),
        metavar="HOST:PORT",
        help="in a world of more than 2 ranks: where the ranks above this one "
        "connect their gates (default 0.0.0.0 and any free port; the leader "
        "tells them the address it sees this worker at)",
    )
    add_device_flags(work, training=False)
    add_threads_flag(work, training=False, colocated=True)
    add_tls_flags(
        work,
        server=False,
        links="the connections to the leader and, in a world "
        "of more than 2 ranks, to the other workers",
    )
    work.set_defaults(func=run_worker)


def _limit_threads(n: int) -> int | None:
    from foundry.tp.blas import limit_blas_threads

    if n < 1:
        raise SystemExit("error: --blas-threads must be >= 1")
    return limit_blas_threads(n)


def _leader_split(args: argparse.Namespace) -> tuple[ExpertSplit, str]:
    """--expert-split, 'auto' resolved for the file and the world, and why ('' when given or
    the model has no routed experts)."""
    from foundry.tp.handshake import expert_split_for

    if args.expert_split != AUTO:
        return ExpertSplit(args.expert_split), ""
    shares = args.shares if isinstance(args.shares, tuple) else None
    return expert_split_for(args.model, args.world_size, shares)


def run_leader(args: argparse.Namespace) -> int:
    from foundry.model.formats.gguf_model import GGUFError
    from foundry.model.shard.table import SplitError
    from foundry.tp.leader import Leader, LeaderOptions
    from foundry.transport.tls import TlsConfigError

    _limit_threads(args.blas_threads)
    threads = use_threads(args)
    # Every step allocates and frees the same arrays (16 rows of Gemma's logits are 8 MiB from
    # each rank, 16 MiB joined): kept mapped, they are not faulted in again each step.
    retain_freed_memory()
    try:
        tls = tls_context(args, server=True)
    except TlsConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        split, why = _leader_split(args)
        options = LeaderOptions(
            model=args.model,
            lora=args.lora,
            host=args.listen[0],
            port=args.listen[1],
            frontend_host=args.frontend_listen[0],
            frontend_port=args.frontend_listen[1],
            ctx_size=args.ctx_size,
            max_sessions=args.max_sessions,
            queue_size=args.queue,
            keep_sessions=args.keep_sessions,
            prefill_chunk=args.prefill_chunk,
            prefill_batch=args.prefill_batch,
            spec_mode=SpecMode(args.spec_mode),
            max_draft=args.max_draft,
            hash_check=args.hash_check,
            row_tops=args.row_tops,
            shm=not args.no_shm,
            gate_timeout_s=args.gate_timeout,
            control_timeout_s=args.gate_timeout,
            expert_split=split,
            device=args.device,
            tls=tls,
            frontend_max_connections=args.frontend_max_connections,
            frame_deadline_s=args.frame_deadline,
            chat_template=args.chat_template,
            chat_content_specials=args.chat_content_specials,
            max_messages=args.max_messages,
            world_size=args.world_size,
            shares=args.shares if isinstance(args.shares, tuple) else None,
            shares_from={"auto": SharesFrom.SPEED, "ranks": SharesFrom.SHARE}.get(
                args.shares if isinstance(args.shares, str) else "", SharesFrom.LIST
            ),
            share=args.share,
            speed=args.speed,
        )
        leader = Leader(options)
    except (GGUFError, SplitError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if why:  # said once the leader stands, so that a refusal stays one line
        log.info("expert split: %s (%s)", split.value, why)

    async def main() -> int:
        await leader.start()
        leader.metrics.threads.set(threads)
        metrics = start_metrics(args, leader.metrics.registry)
        print(
            f"tp-leader listening: workers {options.host}:{leader.port}, "
            f"frontend {options.frontend_host}:{leader.frontend_port}"
            + (f", metrics :{metrics.port}" if metrics else "")
            + f", {threads} threads"
            + (tls_note(tls) if tls else ""),
            flush=True,
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, leader.request_stop)
        try:
            await leader.wait_stopped()
        finally:
            await leader.close()
            if metrics:
                metrics.close()
        return 1 if leader.crashed else 0

    return asyncio.run(main())


def run_worker(args: argparse.Namespace) -> int:
    from foundry.model.formats.gguf_model import GGUFError
    from foundry.model.shard.table import SplitError
    from foundry.tp.worker import Worker, WorkerOptions
    from foundry.transport.tls import TlsConfigError

    _limit_threads(args.blas_threads)
    threads = use_threads(args)
    retain_freed_memory()  # as the leader: a step's arrays reused by the next
    try:
        tls = tls_context(args, server=False)
        peer_tls = peer_tls_contexts(args)
    except TlsConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    options = WorkerOptions(
        model=args.model,
        lora=args.lora,
        leader_host=args.leader[0],
        leader_port=args.leader[1],
        ctx_size=args.ctx_size,
        shm=not args.no_shm,
        gate_timeout_s=args.gate_timeout,
        control_timeout_s=args.gate_timeout,
        retry_max_s=args.retry_max,
        expert_split=None if args.expert_split == AUTO else ExpertSplit(args.expert_split),
        device=args.device,
        tls=tls,
        peer_tls=peer_tls,
        frame_deadline_s=args.frame_deadline,
        rank=args.rank,
        gate_host=args.gate_listen[0],
        gate_port=args.gate_listen[1],
        share=args.share,
        speed=args.speed,
    )
    try:
        worker = Worker(options)
    except (GGUFError, SplitError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    worker.metrics.threads.set(threads)
    metrics = start_metrics(args, worker.metrics.registry)
    ready = (
        f"tp-worker ready: rank {options.rank} of {args.model}"
        if options.rank
        else f"tp-worker ready: the next free rank of {args.model}"
    )
    print(
        f"{ready}, leader {options.leader_host}:"
        f"{options.leader_port}"
        + (f", metrics :{metrics.port}" if metrics else "")
        + f", {threads} threads"
        + (" (tls)" if tls else ""),
        flush=True,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: worker.request_stop())
    try:
        return worker.run()
    finally:
        if metrics:
            metrics.close()
