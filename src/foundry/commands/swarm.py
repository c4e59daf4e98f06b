"""`foundry coordinator`, `foundry worker` and `foundry export`: the swarm's commands, their flags
(what each runs is `foundry.commands.swarm_runners`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from foundry.commands.common import (
    add_device_flags,
    add_finetune_flags,
    add_fragment_size_flag,
    add_frame_deadline_flag,
    add_keep_quantized_flag,
    add_metrics_flag,
    add_schedule_flags,
    add_threads_flag,
    add_tls_flags,
    fraction,
    host_port,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    positive_seconds,
    whole_in,
)
from foundry.commands.swarm_runners import run_coordinator, run_export, run_worker
from foundry.model.formats.checkpoint_dir import DEFAULT_KEEP_LAST
from foundry.model.formats.gguf_model import FILE_DTYPES
from foundry.model.nn.device import DEVICES
from foundry.model.spec.config import PRESETS
from foundry.model.train import recipe
from foundry.transport.stream import LINK_DEAD_AFTER_S
from foundry.wire.fdtc import MAX_QSGD_LEVELS, Compression


def momentum(text: str) -> float:
    """A momentum coefficient in [0, 1)."""
    value = nonneg_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} must be < 1")
    return value


def qsgd_levels(text: str) -> int:
    """QSGD's levels s: codes of 1 + bit_length(s) bits, at most 8."""
    return whole_in(text, 1, MAX_QSGD_LEVELS)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser(
        "coordinator",
        help="run the training coordinator (parameter server)",
        description="Run the swarm's parameter server: workers connect to --listen, the "
        "gateway to --admin-listen. Port 0 picks a free port; the bound ports are printed.",
    )
    c.add_argument(
        "--listen",
        type=host_port,
        default=("0.0.0.0", 7070),
        metavar="HOST:PORT",
        help="where workers connect (default 0.0.0.0:7070)",
    )
    c.add_argument(
        "--admin-listen",
        type=host_port,
        default=("127.0.0.1", 7071),
        metavar="HOST:PORT",
        help="admin link for the gateway (default 127.0.0.1:7071)",
    )
    c.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path("runs/checkpoints"),
        help="checkpoints are written and resumed from here (default runs/checkpoints)",
    )
    c.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size")
    c.add_argument(
        "--compression",
        default="none",
        choices=[c.name.lower() for c in Compression],
        help="gradient compression on the wire (default none)",
    )
    c.add_argument(
        "--topk-ratio",
        type=fraction,
        default=0.01,
        help="share of gradient entries top-k sends (default 0.01)",
    )
    c.add_argument(
        "--qsgd-levels",
        type=qsgd_levels,
        default=127,
        metavar="S",
        help="QSGD's levels both ways, 1-127: 127 sends 8-bit codes (default), "
        "7 4-bit, 3 3-bit, 1 2-bit (fewer bytes, more noise; error feedback keeps "
        "what each drops)",
    )
    c.add_argument(
        "--down-qsgd-levels",
        type=qsgd_levels,
        default=None,
        metavar="S",
        help="QSGD's levels of the weight updates sent to workers, when they differ "
        "from the uploads' (default: as --qsgd-levels); each UPDATE names its own",
    )
    c.add_argument(
        "--down-compression",
        default=None,
        choices=[c.name.lower() for c in Compression],
        help="compression of the weight updates sent to workers, with the error "
        "feedback held here (default: as --compression)",
    )
    c.add_argument(
        "--sync-every",
        type=positive_int,
        default=1,
        metavar="H",
        help="inner steps per round: 1 trains synchronously (exact, the default); "
        "above 1 each worker runs H local AdamW steps and the coordinator applies "
        "an outer Nesterov step to the averaged pseudo-gradient (DiLoCo)",
    )
    c.add_argument(
        "--sync-warmup",
        type=nonneg_int,
        default=0,
        metavar="N",
        help="with --sync-every above 1, train the first N steps synchronously (default 0)",
    )
    c.add_argument(
        "--overlap",
        action="store_true",
        help="with --sync-every above 1, send each round's assignments before the "
        "previous round's outer step, so workers train on from their own weights "
        "while it is computed and sent (one outer step of delay; default off)",
    )
    c.add_argument(
        "--outer-lr",
        type=positive_float,
        default=0.7,
        help="outer Nesterov learning rate with --sync-every above 1 (default 0.7)",
    )
    c.add_argument(
        "--outer-momentum",
        type=momentum,
        default=0.9,
        help="outer Nesterov momentum with --sync-every above 1 (default 0.9)",
    )
    c.add_argument(
        "--digest-every",
        type=nonneg_int,
        default=10,
        metavar="K",
        help="workers report a digest of their weights every K steps; a mismatch "
        "gets full weights (default 10; 0: never)",
    )
    c.add_argument(
        "--data",
        type=Path,
        default=None,
        help="text file or folder to train on (default: Python's bundled docs)",
    )
    c.add_argument(
        "--export-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="EXPORT (`foundry ctl export --path`) writes only inside DIR (default: "
        "the folder that holds --checkpoint-dir), and never over a file that is "
        "not a GGUF",
    )
    c.add_argument(
        "--export-anywhere",
        action="store_true",
        help="let EXPORT write anywhere this process may write",
    )
    c.add_argument(
        "--init",
        type=Path,
        default=None,
        metavar="FILE.gguf",
        help="start from these weights instead of a random init",
    )
    c.add_argument(
        "--max-steps",
        type=positive_int,
        default=None,
        help=f"steps to train (default {recipe.STEPS}: words on the default corpus; "
        f"fine-tuning {recipe.FT_STEPS})",
    )
    c.add_argument(
        "--schedule-steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="length of the learning-rate schedule (warm-up then cosine to its "
        "floor, which holds after it; default: --max-steps)",
    )
    add_schedule_flags(c)
    add_finetune_flags(c)
    c.add_argument(
        "--fresh",
        action="store_true",
        help="start at step 0: move the checkpoints of --checkpoint-dir into a "
        "previous-N folder in it (nothing is deleted)",
    )
    c.add_argument(
        "--checkpoint-every", type=positive_int, default=50, help="steps between checkpoints"
    )
    c.add_argument(
        "--keep-checkpoints",
        type=positive_int,
        default=DEFAULT_KEEP_LAST,
        metavar="N",
        help="checkpoints kept in --checkpoint-dir, the newest N "
        f"that verify (default {DEFAULT_KEEP_LAST}); older ones are deleted as new "
        "ones are written, damaged ones renamed *.damaged and kept",
    )
    c.add_argument(
        "--validate-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="steps between validation runs on the held-out text (default: a "
        "twentieth of --max-steps, 25 to 150; always after the last step)",
    )
    c.add_argument(
        "--validate-device",
        default="cpu",
        choices=DEVICES,
        help="where validation computes: cpu (numpy, default) or a PyTorch device "
        "as a worker's --device (cuda: a 126M-parameter model validates in seconds "
        "instead of minutes); the optimizer stays in numpy",
    )
    c.add_argument(
        "--min-workers",
        type=positive_int,
        default=1,
        help="rounds start once this many workers registered (default 1)",
    )
    c.add_argument(
        "--wait-for-start",
        action="store_true",
        help="wait for START on the admin link instead of training at once",
    )
    c.add_argument(
        "--seed-heartbeat-timeout",
        type=positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long a seed-only worker (one that speaks the C header alone) may "
        "stay silent before two heartbeats showed its own cadence; after that it is "
        "dropped when silent for 4x its longest recent interval (default 30)",
    )
    c.add_argument(
        "--no-rebalance",
        action="store_true",
        help="split every round equally instead of by measured throughput",
    )
    c.add_argument("--seed", type=nonneg_int, default=0, help="weight init seed (default 0)")
    c.add_argument(
        "--timeline",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="write a Chrome trace of every round (wait, apply, checkpoint); join "
        "it with the workers' ones with `foundry timeline merge`",
    )
    c.add_argument(
        "--max-connections",
        type=positive_int,
        default=256,
        metavar="N",
        help="open connections on --listen at most; more are refused (default 256)",
    )
    c.add_argument(
        "--admin-max-connections",
        type=positive_int,
        default=16,
        metavar="N",
        help="open connections on --admin-listen at most (default 16)",
    )
    add_frame_deadline_flag(c, 120.0, "both links")
    add_fragment_size_flag(c, "WEIGHTS and UPDATE")
    add_tls_flags(c, server=True, links="the worker and admin links")
    add_metrics_flag(c)
    c.set_defaults(func=run_coordinator)

    w = sub.add_parser(
        "worker",
        help="run a training worker",
        description="Join a swarm: register with the coordinator, train on its assignments, "
        "reconnect by itself when the coordinator goes away.",
    )
    w.add_argument(
        "--coordinator",
        type=host_port,
        default=("127.0.0.1", 7070),
        metavar="HOST:PORT",
        help="the coordinator's worker port",
    )
    w.add_argument("--worker-id", default=None, help="stable name (default HOSTNAME-PID)")
    w.add_argument(
        "--profile",
        default=None,
        help="force a hardware profile (default: detected; see `foundry profile`)",
    )
    w.add_argument(
        "--data",
        type=Path,
        default=None,
        help="this machine's copy of the training data (default: bundled docs)",
    )
    w.add_argument(
        "--base-model",
        type=Path,
        default=None,
        metavar="FILE.gguf",
        help="this machine's copy of the published model the swarm fine-tunes (the "
        "coordinator's --base-model; its size and hash are checked at registration; "
        "the coordinator says what trains)",
    )
    add_keep_quantized_flag(w)
    w.add_argument("--slowdown", type=positive_float, default=1.0, help=argparse.SUPPRESS)
    w.add_argument(
        "--link-timeout",
        type=positive_seconds,
        default=LINK_DEAD_AFTER_S,
        metavar="S",
        help="reconnect when the coordinator's host has answered "
        "nothing, not even the kernel's keepalive probes, for S seconds (a host that "
        "lost power or network sends no FIN; default %(default)g)",
    )
    w.add_argument(
        "--timeline",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="write a Chrome trace of this worker's rounds (compute, compress, send, wait)",
    )
    add_device_flags(w, training=True)
    add_threads_flag(w, training=True, colocated=True)
    add_fragment_size_flag(w, "GRADIENTS")
    add_tls_flags(w, server=False, links="the link to the coordinator")
    add_metrics_flag(w)
    w.set_defaults(func=run_worker)

    e = sub.add_parser(
        "export",
        help="write a checkpoint's weights as a GGUF model file",
        description="Export a training checkpoint (a file, or the newest valid one in a "
        "folder) to GGUF, which `foundry tp-leader` and llama.cpp load.",
    )
    e.add_argument("--checkpoint", type=Path, default=None, help="checkpoint file or folder")
    e.add_argument(
        "--base-model",
        type=Path,
        default=None,
        metavar="FILE.gguf",
        help="with --adapter: write the base merged with the adapter (W + alpha/r "
        "B A) in the base's architecture, instead of a checkpoint's model",
    )
    e.add_argument(
        "--adapter",
        type=Path,
        default=None,
        metavar="ADAPTER.gguf",
        help="the LoRA adapter to merge into --base-model",
    )
    e.add_argument(
        "--out",
        type=Path,
        required=True,
        help="GGUF file to write (a new file; an existing GGUF only with --force, "
        "never any other file)",
    )
    e.add_argument(
        "--force", action="store_true", help="replace --out if it is a GGUF file already"
    )
    e.add_argument(
        "--type",
        "--dtype",
        dest="dtype",
        default=None,
        choices=FILE_DTYPES,
        help="tensor type: f32, f16, or quantized q8_0 / q4_0 (default f32; a merged "
        "file keeps each adapted tensor's type where Foundry writes it, else Q8_0)",
    )
    e.set_defaults(func=run_export)
