"""`foundry up`: the whole system as local processes, from one command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from foundry.commands.common import (
    add_keep_quantized_flag,
    port_number,
    positive_float,
    positive_int,
)
from foundry.model.spec.config import PRESETS
from foundry.model.train import recipe
from foundry.up.pipeline import run_stack
from foundry.up.plan import MAX_CHECKPOINT_EVERY, MIN_CHECKPOINT_EVERY, StackError, StackOptions


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = StackOptions()
    u = sub.add_parser(
        "up",
        help="run everything locally: train, export, serve (Ctrl+C stops it all)",
        description="Start a coordinator, workers, the gateway (and Prometheus when installed) "
        "as local processes, train on the bundled corpus with a live view, export the model, "
        "serve it on a tensor-parallel pair, print a sample, then keep serving for "
        "`foundry ctl` until Ctrl+C or SIGTERM, which stops every process. Services' logs go "
        "to RUN_DIR/logs; checkpoints in RUN_DIR/checkpoints are resumed from.",
    )
    u.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"training steps (default {d.steps}; {recipe.LONG_STEPS} with --long)",
    )
    u.add_argument(
        "--long",
        action="store_true",
        help=f"train {recipe.LONG_STEPS} steps instead of {d.steps}: held-out 1.62 "
        "bits per byte instead of 1.68, closer to (not below) xz -9e primed with "
        "the training text; more steps overfit the default corpus "
        "(docs/benchmarks.md)",
    )
    u.add_argument(
        "--workers",
        type=positive_int,
        default=d.workers,
        metavar="N",
        help=f"training workers (default {d.workers})",
    )
    u.add_argument(
        "--preset",
        default=d.preset,
        choices=sorted(PRESETS),
        help=f"model size (default {d.preset})",
    )
    u.add_argument(
        "--global-batch",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"samples per step (default {d.global_batch}; fine-tuning {recipe.FT_GLOBAL_BATCH})",
    )
    u.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"tokens (bytes) per sample (default {d.seq_len})",
    )
    u.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help=f"peak learning rate (default {d.lr:g}; fine-tuning {recipe.FT_LR_LORA:g})",
    )
    u.add_argument(
        "--sample-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="steps between the greedy samples shown while training (default: a tenth of --steps)",
    )
    u.add_argument(
        "--base-port",
        type=port_number,
        default=d.base_port,
        metavar="P",
        help=f"coordinator P, its admin link P+1, TP leader P+20, its frontend P+21 "
        f"(default {d.base_port})",
    )
    u.add_argument(
        "--gateway-port",
        type=port_number,
        default=d.gateway_port,
        metavar="P",
        help=f"the gRPC gateway (default {d.gateway_port}, `foundry ctl`'s default)",
    )
    u.add_argument(
        "--http-port",
        type=port_number,
        default=d.http_port,
        metavar="P",
        help=f"the gateway's OpenAI-compatible HTTP API (default {d.http_port})",
    )
    u.add_argument(
        "--metrics-port",
        type=port_number,
        default=d.metrics_port,
        metavar="M",
        help=f"metrics: coordinator M, TP leader M+2, gateway M+3, TP worker M+4, "
        f"worker i M+10+i (default {d.metrics_port})",
    )
    u.add_argument(
        "--prometheus-port",
        type=port_number,
        default=d.prometheus_port,
        metavar="P",
        help=f"Prometheus web UI (default {d.prometheus_port})",
    )
    u.add_argument(
        "--no-prometheus",
        action="store_true",
        help="do not start Prometheus even if it is installed",
    )
    u.add_argument(
        "--host",
        default=d.host,
        help="interface for the coordinator's worker port, the gateway and metrics "
        f"(default {d.host}; any other value makes the gateway require a token, "
        "written to RUN_DIR/token)",
    )
    u.add_argument(
        "--run-dir",
        type=Path,
        default=d.run_dir,
        help=f"logs, checkpoints, model, pids (default {d.run_dir})",
    )
    u.add_argument(
        "--fresh",
        action="store_true",
        help="delete RUN_DIR/checkpoints first instead of resuming from them (refused "
        "while another `foundry up` holds RUN_DIR)",
    )
    u.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="steps between checkpoints (default: a quarter of --steps, between "
        f"{MIN_CHECKPOINT_EVERY} and {MAX_CHECKPOINT_EVERY}, and at most "
        "--sample-every, whose samples come from checkpoints); Ctrl+C writes one more",
    )
    u.add_argument(
        "--prompt",
        default=d.prompt,
        help=f"prompt of the sample printed once serving (default {d.prompt!r})",
    )
    u.add_argument(
        "--sample-tokens",
        type=positive_int,
        default=d.sample_tokens,
        metavar="N",
        help=f"tokens of that sample (default {d.sample_tokens})",
    )
    u.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="FILE.gguf",
        help="serve this GGUF file (a published model, docs/models.md) on the "
        "tensor-parallel pair behind the gateway, without training",
    )
    u.add_argument(
        "--ctx-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="the pair's context with --model (default: the file's, at most 4096)",
    )
    u.add_argument(
        "--base-model",
        type=Path,
        default=None,
        metavar="FILE.gguf",
        help="fine-tune this published GGUF model on --data with LoRA across the "
        "local workers, then serve it (the base with the adapter) on the pair "
        "(docs/guide/finetune.md)",
    )
    u.add_argument(
        "--data",
        type=Path,
        default=None,
        help="with --base-model: the text (a file or folder) or chat data (.jsonl) to fine-tune on",
    )
    u.add_argument(
        "--lora-rank",
        type=positive_int,
        default=d.lora_rank,
        metavar="R",
        help=f"with --base-model: LoRA's rank (default {d.lora_rank})",
    )
    u.add_argument(
        "--lora-alpha",
        type=positive_float,
        default=d.lora_alpha,
        help=f"with --base-model: LoRA's alpha (default {d.lora_alpha:g})",
    )
    u.add_argument(
        "--lora-targets",
        default=d.lora_targets,
        metavar="NAMES",
        help=f"with --base-model: the projections with adapters (default {d.lora_targets})",
    )
    add_keep_quantized_flag(u)
    u.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU threads of the whole stack, divided between the processes that "
        "compute: the workers while it trains, the pair's two ranks while it serves "
        "(default: the cores it may use, or the physical cores among them where "
        "fewer)",
    )
    u.set_defaults(func=run_up)


def run_up(args: argparse.Namespace) -> int:
    from foundry.hardware import default_threads

    d = StackOptions()
    tune = args.base_model is not None
    try:
        options = StackOptions(
            steps=args.steps
            or (recipe.FT_STEPS if tune else recipe.LONG_STEPS if args.long else d.steps),
            workers=args.workers,
            preset=args.preset,
            global_batch=args.global_batch or (recipe.FT_GLOBAL_BATCH if tune else d.global_batch),
            seq_len=args.seq_len or (recipe.FT_SEQ_LEN if tune else d.seq_len),
            lr=args.lr or (recipe.FT_LR_LORA if tune else d.lr),
            sample_every=args.sample_every,
            base_port=args.base_port,
            gateway_port=args.gateway_port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            prometheus_port=args.prometheus_port,
            prometheus=not args.no_prometheus,
            host=args.host,
            run_dir=args.run_dir,
            fresh=args.fresh,
            checkpoint_every=args.checkpoint_every,
            prompt=args.prompt,
            sample_tokens=args.sample_tokens,
            model=args.model,
            ctx_size=args.ctx_size,
            base_model=args.base_model,
            data=args.data,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_targets=args.lora_targets,
            keep_quantized=args.keep_quantized,
            threads=args.threads or default_threads(),
        )
        return run_stack(options)
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
