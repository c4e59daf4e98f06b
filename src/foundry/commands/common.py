"""Flag types and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import math
import os
import ssl
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from foundry.model.formats import lora
from foundry.model.nn.device import DEVICES
from foundry.model.train import recipe
from foundry.obs.metrics import MetricsServer
from foundry.transport import tls
from foundry.wire.fdtc import FRAGMENT_SIZE, MAX_PAYLOAD, Fragment


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
        type=port_number,
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


def add_tls_flags(
    parser: argparse.ArgumentParser, *, server: bool, prefix: str = "tls", links: str
) -> None:
    """``--PREFIX-cert/-key/-ca``, each falling back to ``FOUNDRY_TLS_CERT/KEY/CA``.

    ``server``: the flags configure listeners (``links``); otherwise the dialer of ``links``.
    """
    group = parser.add_argument_group(
        f"TLS of {links}",
        "Off unless one of these is given (or its environment variable is set); "
        "see docs/guide/tls.md.",
    )
    flag = f"--{prefix}"
    if server:
        cert_help = f"serve TLS on {links} with this PEM certificate (chain)"
        key_help = f"the PEM private key of {flag}-cert"
        ca_help = (
            "require client certificates signed by this PEM CA: mutual TLS (without "
            "it clients are not authenticated)"
        )
    else:
        cert_help = f"present this PEM client certificate on {links} (mutual TLS)"
        key_help = f"the PEM private key of {flag}-cert"
        ca_help = (
            "verify the server's certificate, and its name against the dialed host, "
            "with this PEM CA (default: the system's trust store)"
        )
    group.add_argument(
        f"{flag}-cert",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"{cert_help} (env {tls.ENV_CERT})",
    )
    group.add_argument(
        f"{flag}-key",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"{key_help} (env {tls.ENV_KEY})",
    )
    group.add_argument(
        f"{flag}-ca", type=Path, default=None, metavar="FILE", help=f"{ca_help} (env {tls.ENV_CA})"
    )


def tls_context(
    args: argparse.Namespace, *, server: bool, prefix: str = "tls"
) -> ssl.SSLContext | None:
    """The context of the flags added by :func:`add_tls_flags` (None: TLS off).

    Raises :class:`foundry.transport.tls.TlsConfigError` naming what to fix.
    """
    files = _tls_files(args, prefix)
    return tls.server_context_for(files) if server else tls.client_context_for(files)


def peer_tls_contexts(args: argparse.Namespace, prefix: str = "tls") -> tls.PeerContexts | None:
    """The contexts of the same flags for links between equals (a world's worker-to-worker
    gates); None unless cert, key and CA are all given."""
    return tls.peer_contexts_for(_tls_files(args, prefix))


def _tls_files(args: argparse.Namespace, prefix: str) -> tls.TlsFiles:
    key = prefix.replace("-", "_")
    return tls.TlsFiles.resolve(
        getattr(args, f"{key}_cert"), getattr(args, f"{key}_key"), getattr(args, f"{key}_ca")
    )


def tls_note(ctx: ssl.SSLContext) -> str:
    """How a listener's startup line says that it serves TLS."""
    return " (mutual tls)" if ctx.verify_mode == ssl.CERT_REQUIRED else " (tls)"


def add_schedule_flags(parser: argparse.ArgumentParser) -> None:
    """The batch and learning-rate schedule, the same for `foundry train` and the coordinator
    (defaults filled by :func:`resolve_schedule`: from scratch, or fine-tuning)."""
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        default=None,
        help=f"samples per step (default {recipe.GLOBAL_BATCH}; fine-tuning "
        f"{recipe.FT_GLOBAL_BATCH})",
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help=f"tokens per sample (default {recipe.SEQ_LEN}; fine-tuning {recipe.FT_SEQ_LEN})",
    )
    parser.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help=f"peak learning rate (default {recipe.LR:g}; fine-tuning "
        f"{recipe.FT_LR_LORA:g} with LoRA, {recipe.FT_LR_FULL:g} without)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=nonneg_int,
        default=None,
        metavar="N",
        help="linear warm-up (default: a fiftieth of the run, 20 to 60)",
    )


def resolve_schedule(args: argparse.Namespace) -> None:
    """Fill the schedule flags left unset: the from-scratch recipe, or the fine-tuning one
    where ``--base-model`` is given (``--lora-rank`` picks its learning rate)."""
    tune = getattr(args, "base_model", None) is not None
    if args.global_batch is None:
        args.global_batch = recipe.FT_GLOBAL_BATCH if tune else recipe.GLOBAL_BATCH
    if args.seq_len is None:
        args.seq_len = recipe.FT_SEQ_LEN if tune else recipe.SEQ_LEN
    if args.lr is None:
        lora = getattr(args, "lora_rank", None) is not None
        args.lr = (recipe.FT_LR_LORA if lora else recipe.FT_LR_FULL) if tune else recipe.LR


def add_finetune_flags(parser: argparse.ArgumentParser) -> None:
    """``--base-model`` and LoRA's flags (PEFT's names and defaults; docs/guide/finetune.md)."""
    parser.add_argument(
        "--base-model",
        type=Path,
        default=None,
        metavar="FILE.gguf",
        help="fine-tune this published GGUF model (llama, qwen2, qwen3, "
        "qwen3moe, gemma3, olmoe) instead of training Foundry's own from "
        "scratch; --data is the text to learn",
    )
    parser.add_argument(
        "--lora-rank",
        type=positive_int,
        default=None,
        metavar="R",
        help="train LoRA adapters of rank R beside the frozen base (PEFT's r; "
        "8 is usual); without it every tensor trains (full fine-tuning)",
    )
    parser.add_argument(
        "--lora-alpha",
        type=positive_float,
        default=lora.DEFAULT_ALPHA,
        help="LoRA's alpha: the adapters are scaled by alpha / rank (PEFT's "
        f"lora_alpha, default {lora.DEFAULT_ALPHA:g})",
    )
    parser.add_argument(
        "--lora-dropout",
        type=float,
        default=0.0,
        help="dropout on the adapters' input while training (PEFT's lora_dropout, default 0)",
    )
    parser.add_argument(
        "--lora-targets",
        default=",".join(lora.DEFAULT_TARGETS),
        metavar="NAMES",
        help="the projections that get adapters, comma-separated from "
        f"{', '.join(lora.TARGETS)}, or 'all' (PEFT's target_modules; default "
        f"{','.join(lora.DEFAULT_TARGETS)})",
    )
    add_keep_quantized_flag(parser)


def add_keep_quantized_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keep-quantized",
        action="store_true",
        help="with --base-model: hold the frozen base's matrices in the file's "
        "types (about the file's size of memory instead of 4 bytes a "
        "parameter), dequantized a slice at a time in every forward and "
        "backward (slower steps; docs/guide/finetune.md)",
    )


def lora_spec(args: argparse.Namespace) -> lora.LoraSpec | None:
    """The LoRA settings of the flags, or None for full fine-tuning (LoraError if bad)."""
    if args.lora_rank is None:
        return None
    return lora.LoraSpec(
        rank=args.lora_rank,
        alpha=args.lora_alpha,
        targets=lora.parse_targets(args.lora_targets),
        dropout=args.lora_dropout,
    )


def add_frame_deadline_flag(parser: argparse.ArgumentParser, default: float, links: str) -> None:
    parser.add_argument(
        "--frame-deadline",
        type=positive_seconds,
        default=default,
        metavar="S",
        help=f"a peer on {links} that began a frame must finish it within S seconds, and take "
        f"one we send within S seconds, or it is cut off (default {default:g})",
    )


def add_fragment_size_flag(parser: argparse.ArgumentParser, messages: str) -> None:
    parser.add_argument(
        "--fragment-size",
        type=fragment_size,
        default=FRAGMENT_SIZE,
        metavar="BYTES",
        help=f"send {messages} larger than BYTES as FRAGMENT frames of BYTES each (a model "
        "over 256 MiB in float32 needs them; each frame then has the frame deadline to "
        f"itself; {MIN_FRAGMENT}-{MAX_FRAGMENT}, default {FRAGMENT_SIZE} = 64 MiB)",
    )


# The smallest fragment worth its 26 bytes of headers; the largest one frame carries.
MIN_FRAGMENT = 4096
MAX_FRAGMENT = MAX_PAYLOAD - Fragment.LAYOUT.size


def fragment_size(text: str) -> int:
    return whole_in(text, MIN_FRAGMENT, MAX_FRAGMENT)


# Counts, steps, seeds and token budgets travel as u32 on our wires (FDTC, protobuf): a value
# above this could not be sent, so it is refused where it is typed.
MAX_U32 = 2**32 - 1


def _number(text: str, kind: type[int] | type[float], what: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def positive_seconds(text: str) -> float:
    value = _number(text, float, "a number of seconds")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def nonneg_float(text: str) -> float:
    value = _number(text, float, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def fraction(text: str) -> float:
    """A share in (0, 1]."""
    value = _number(text, float, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1]")
    return value


def whole_in(text: str, low: int, high: int) -> int:
    value = int(_number(text, int, "a whole number"))
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{text} is out of range {low}-{high}")
    return value


def positive_int(text: str) -> int:
    return whole_in(text, 1, MAX_U32)


def nonneg_int(text: str) -> int:
    return whole_in(text, 0, MAX_U32)


def port_number(text: str) -> int:
    return whole_in(text, 0, 65535)


def integer_shares(text: str, also: str = "") -> tuple[int, ...] | None:
    """``--shares W0,W1,...``: positive integer weights, rank 0 first; empty: None (equal).
    ``also``: what else the flag takes, for the message."""
    if not text:
        return None  # equal shares (an empty value, as a deployment's unset variable gives)
    try:
        shares = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shares takes positive integers, one per rank, rank 0 first (2,1,1){also}, got "
            f"{text!r}"
        ) from None
    if any(s < 1 for s in shares):
        raise argparse.ArgumentTypeError(f"every share must be >= 1, got {text!r}")
    return shares


def add_threads_flag(
    parser: argparse.ArgumentParser, *, training: bool, colocated: bool = False
) -> None:
    """``--threads N``: the CPU threads this process computes on (docs/quantization.md); with
    ``colocated``, ``--colocated K`` too (a service that may share its machine with K - 1 of
    its kind)."""
    also = (
        ", BLAS's (numpy) and PyTorch's CPU threads"
        if training
        else " and PyTorch's CPU threads (--device torch-cpu)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"CPU threads to compute on: the C kernels' products and attention{also} "
        "(default: the cores this process may use, or the physical cores among them where "
        "fewer; the results do not depend on it)",
    )
    if colocated:
        parser.add_argument(
            "--colocated",
            type=positive_int,
            default=1,
            metavar="K",
            help="processes computing on this machine's cores, this one included (the "
            "ranks or workers of a Compose project on one machine): without --threads, "
            "each takes the default divided by K, at least 1 (default 1)",
        )


def use_threads(args: argparse.Namespace, *, blas: bool = False, torch_cpu: bool = False) -> int:
    """Apply ``--threads`` (or the machine's default, ``hardware.default_threads``) to this
    process: the kernels' pool; PyTorch's intra-op threads where PyTorch is loaded and the
    count was asked for or ``torch_cpu`` (a process that trains with PyTorch on the CPU:
    ``--device auto`` without a GPU); else PyTorch keeps its own (``--device torch-cpu``,
    the tests' path, runs one thread: spinning torch threads on a loaded host cost far more
    than they give); with ``blas``, BLAS's threads, unless the environment fixed them and
    ``--threads`` did not. Without ``--threads``, ``--colocated K`` divides the default by K.
    Returns the count."""
    from foundry.hardware import default_threads
    from foundry.model.kernels.quant import set_threads

    asked = getattr(args, "threads", None)
    n = asked if asked is not None else max(1, default_threads() // getattr(args, "colocated", 1))
    set_threads(n)
    torch = sys.modules.get("torch")
    if torch is not None and (asked is not None or torch_cpu):
        torch.set_num_threads(n)
    if blas and (asked is not None or "OPENBLAS_NUM_THREADS" not in os.environ):
        from foundry.tp.blas import limit_blas_threads

        limit_blas_threads(n)
    return n


def add_device_flags(parser: argparse.ArgumentParser, *, training: bool) -> None:
    """``--device`` (and ``--bf16`` where the process trains): see docs/gpu.md."""
    auto = (
        "cuda when PyTorch sees a GPU, else PyTorch on all the CPU's threads where it is "
        "installed, else cpu"
        if training
        else "cuda when PyTorch sees a GPU, else cpu"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=DEVICES,
        help="where to compute: cpu (the numpy engine, default), cuda (PyTorch on the GPU; "
        f"pip install 'foundry[gpu]'), auto ({auto}), "
        "torch-cpu (the PyTorch path on the CPU, for tests)",
    )
    if training:
        parser.add_argument(
            "--bf16",
            action="store_true",
            help="with a PyTorch device, run the products under bf16 autocast (weights, "
            "optimizer and the wire stay float32; default off)",
        )
