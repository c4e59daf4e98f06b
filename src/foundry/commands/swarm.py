"""`foundry coordinator`, `foundry worker` and `foundry export`: the swarm's commands."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

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
    resolve_schedule,
    start_metrics,
    tls_context,
    tls_note,
    use_threads,
    whole_in,
)
from foundry.model.formats.checkpoint_dir import DEFAULT_KEEP_LAST
from foundry.model.formats.gguf_model import FILE_DTYPES
from foundry.model.nn.device import DEVICES, DeviceError
from foundry.model.spec.config import PRESETS, ModelConfig, preset
from foundry.model.train import recipe
from foundry.model.train.training import TrainSettings
from foundry.obs.timeline import ROUNDS_TID, Timeline
from foundry.transport.stream import LINK_DEAD_AFTER_S
from foundry.wire.fdtc import MAX_MESSAGE, MAX_QSGD_LEVELS, Compression

log = logging.getLogger("foundry")


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
    add_threads_flag(w, training=True)
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


def run_coordinator(args: argparse.Namespace) -> int:
    from foundry.model.formats.checkpoint import CheckpointError
    from foundry.model.formats.checkpoint_dir import DirectoryLock, check_directory, start_fresh
    from foundry.model.text.data import DataError, load_corpus
    from foundry.model.train import backend as compute
    from foundry.runtime import retain_freed_memory
    from foundry.swarm.coordinator import Coordinator, CoordinatorOptions
    from foundry.transport.tls import TlsConfigError

    resolve_schedule(args)
    if args.max_steps is None:
        args.max_steps = recipe.STEPS if args.base_model is None else recipe.FT_STEPS
    if args.max_steps <= 0 or args.global_batch <= 0:
        print("error: --max-steps and --global-batch must be positive", file=sys.stderr)
        return 2
    cfg: ModelConfig = preset(args.preset)
    start_params = None
    validation_backend: compute.Backend
    if args.base_model is not None:
        from foundry.commands.finetune import SetupError, open_base
        from foundry.model.formats.tuning import tuned_config
        from foundry.model.train.finetune import FineTuneBackend, initial_trainable

        try:
            tuning = open_base(args)
        except SetupError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        cfg = tuned_config(tuning.base.cfg, tuning.base.identity, tuning.spec)
        start_params = initial_trainable(tuning.base, tuning.spec, args.seed)
        validation_backend = FineTuneBackend(tuning.base, tuning.spec)
        print(
            f"fine-tuning {args.base_model.name}: {cfg.describe()}, "
            f"{cfg.n_params():,} trainable parameters travel",
            flush=True,
        )
    weight_bytes = 4 * cfg.n_params()
    if weight_bytes > MAX_MESSAGE:
        # GRADIENTS' uncompressed_size is a u32: 4 GiB of float32 at most (docs/protocol.md).
        print(
            f"error: --preset {args.preset} has {weight_bytes / 2**30:.1f} GiB of float32 "
            f"weights, more than FDTC's messages carry ({MAX_MESSAGE // 2**30} GiB); train "
            f"it on one machine with `foundry train --preset {args.preset} --device cuda`",
            file=sys.stderr,
        )
        return 2
    try:
        tls = tls_context(args, server=True)
        if args.base_model is None:
            corpus = load_corpus(args.data)
            validation_backend = compute.select(args.validate_device)
        else:
            assert tuning.corpus is not None
            corpus = tuning.corpus
        # One writer per checkpoint dir, held until the process exits; a dir none of whose
        # checkpoints verifies is refused by load_or_init, unless --fresh moved them aside.
        check_directory(args.checkpoint_dir)
        DirectoryLock(args.checkpoint_dir, "foundry coordinator").acquire()
        if args.fresh:
            start_fresh(args.checkpoint_dir)
    except (DataError, TlsConfigError, CheckpointError, DeviceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Every round allocates and frees the same weight, gradient and optimizer buffers (13.7 MB
    # each on the small preset): keep them mapped instead of page-faulting them back each time.
    retain_freed_memory()
    settings = TrainSettings(
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=(
            recipe.warmup_steps(args.schedule_steps or args.max_steps)
            if args.warmup_steps is None
            else args.warmup_steps
        ),
        total_steps=args.schedule_steps or args.max_steps,
        # adapters and fine-tuned weights are not decayed (PEFT's and the HF Trainer's default)
        weight_decay=0.0 if args.base_model is not None else TrainSettings.weight_decay,
    )
    if validation_backend is not compute.NUMPY:
        print(f"validation computes on {validation_backend.name}", flush=True)
    note = recipe.short_run_note(args.max_steps, args.data is None and args.init is None)
    if note:
        print(note.replace("--steps", "--max-steps"), flush=True)
    options = CoordinatorOptions(
        host=args.listen[0],
        port=args.listen[1],
        admin_host=args.admin_listen[0],
        admin_port=args.admin_listen[1],
        checkpoint_dir=args.checkpoint_dir,
        cfg=cfg,
        settings=settings,
        compression=Compression[args.compression.upper()],
        topk_ratio=args.topk_ratio,
        max_steps=args.max_steps,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        validate_every=(
            recipe.validate_every(args.max_steps)
            if args.validate_every is None
            else args.validate_every
        ),
        min_workers=args.min_workers,
        seed_heartbeat_timeout_s=args.seed_heartbeat_timeout,
        autostart=not args.wait_for_start,
        init_gguf=args.init,
        export_dir=args.export_dir,
        export_anywhere=args.export_anywhere,
        seed=args.seed,
        rebalance=not args.no_rebalance,
        tls=tls,
        max_connections=args.max_connections,
        admin_max_connections=args.admin_max_connections,
        frame_deadline_s=args.frame_deadline,
        fragment_size=args.fragment_size,
        sync_every=args.sync_every,
        down_compression=(
            None if args.down_compression is None else Compression[args.down_compression.upper()]
        ),
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        digest_every=args.digest_every,
        sync_warmup=args.sync_warmup,
        overlap=args.overlap,
        qsgd_levels=args.qsgd_levels,
        down_qsgd_levels=args.down_qsgd_levels,
        validation_backend=validation_backend,
        start_params=start_params,
        base_model=args.base_model,
    )

    async def main() -> int:
        coordinator = Coordinator(options, corpus, timeline)
        await coordinator.start()
        metrics = start_metrics(args, coordinator.metrics.registry)
        print(
            f"coordinator listening: workers {options.host}:{coordinator.bound_port}, "
            f"admin {options.admin_host}:{coordinator.bound_admin_port}"
            + (f", metrics :{metrics.port}" if metrics else "")
            + (tls_note(tls) if tls else ""),
            flush=True,
        )
        _stop_on_signals(coordinator.request_stop)
        try:
            await coordinator.wait_stopped()
        finally:
            await coordinator.close()
            if metrics:
                metrics.close()
        if coordinator.failure is not None:
            print(f"error: coordinator {coordinator.failure}", file=sys.stderr)
            return 1
        return 0

    try:
        timeline = Timeline(args.timeline, "coordinator", tid=ROUNDS_TID, thread="rounds")
    except OSError as exc:
        print(f"error: cannot write --timeline: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(main())
    finally:
        timeline.close()


def run_worker(args: argparse.Namespace) -> int:
    from foundry.model.text.data import DataError, load_corpus
    from foundry.model.train import backend as compute
    from foundry.runtime import retain_freed_memory
    from foundry.swarm.worker import Worker
    from foundry.swarm.worker_core import WorkerOptions, default_worker_id, hardware_for

    base = None
    try:
        hardware = hardware_for(args.profile)
        if args.base_model is None:
            corpus = load_corpus(args.data)
        else:
            base, corpus = _worker_base(args)
        tls = tls_context(args, server=False)
        backend = compute.select(args.device, bf16=args.bf16, training=True)
    except (ValueError, DataError, DeviceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    threads = use_threads(
        args,
        blas=backend is compute.NUMPY,
        torch_cpu=backend.name.startswith("torch:cpu") and args.device == "auto",
    )
    print(f"worker computes on {backend.name}, {threads} threads", flush=True)
    retain_freed_memory()  # as `foundry train`: a step's activations are reused every round
    options = WorkerOptions(
        host=args.coordinator[0],
        port=args.coordinator[1],
        worker_id=args.worker_id or default_worker_id(),
        hardware=hardware,
        slowdown=args.slowdown,
        tls=tls,
        link_timeout_s=args.link_timeout,
        backend=backend,
        fragment_size=args.fragment_size,
        base=base,
    )

    async def main() -> int:
        worker = Worker(options, corpus, timeline)
        worker.metrics.threads.set(threads)
        metrics = start_metrics(args, worker.metrics.registry)
        if metrics:
            print(f"worker {options.worker_id}: metrics :{metrics.port}", flush=True)
        task = asyncio.ensure_future(worker.run())
        _stop_on_signals(task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            return 0
        finally:
            if metrics:
                metrics.close()

    try:
        timeline = Timeline(args.timeline, "worker", thread=options.worker_id)
    except OSError as exc:
        print(f"error: cannot write --timeline: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(main())
    finally:
        timeline.close()


def _worker_base(args: argparse.Namespace) -> tuple[Any, Any]:
    """A fine-tuning worker's base file (its identity; loaded for training where PyTorch is
    here) and --data in the file's tokens. ValueError says what is wrong."""
    from foundry.commands.finetune import SetupError, torch_device
    from foundry.model.formats.gguf_io import load_gguf
    from foundry.model.formats.tuning import architecture_of, file_identity
    from foundry.model.nn.device import torch_available
    from foundry.model.text.chat import template_for
    from foundry.model.text.finetune_data import load_tuning_corpus
    from foundry.model.text.vocab import TokenizerError, load_tokenizer
    from foundry.swarm.worker_core import BaseFile

    if args.data is None:
        raise ValueError("--base-model needs --data: the same text the coordinator fine-tunes on")
    try:
        header = load_gguf(args.base_model, select=lambda name, view: None)
        corpus = load_tuning_corpus(
            args.data, load_tokenizer(header.metadata), template_for(header.metadata)
        )
        identity = file_identity(args.base_model)
    except (TokenizerError, OSError) as exc:
        raise ValueError(f"{args.base_model}: {exc}") from None
    loaded = None
    if torch_available():
        from foundry.model.train.finetune import load_base

        try:
            loaded = load_base(
                args.base_model, torch_device(args.device), keep_quantized=args.keep_quantized
            )
        except SetupError as exc:
            raise ValueError(str(exc)) from None
        print(f"worker fine-tunes on torch:{loaded.device.type}", flush=True)
    else:
        print(
            "warning: PyTorch is not installed: the coordinator will refuse this worker "
            "(fine-tuning trains on PyTorch)",
            file=sys.stderr,
            flush=True,
        )
    return BaseFile(identity, architecture_of(header.cfg), header.cfg, loaded), corpus


def run_export(args: argparse.Namespace) -> int:
    from foundry.model.formats.checkpoint import CheckpointError, load_checkpoint
    from foundry.model.formats.checkpoint_dir import latest_checkpoint
    from foundry.model.formats.gguf_io import save_gguf
    from foundry.model.formats.gguf_model import GGUFError
    from foundry.model.formats.outfile import OutputRefused, check_output

    try:
        check_output(args.out, force=args.force)
    except OutputRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if (args.base_model is None) != (args.adapter is None) or (args.base_model is None) == (
        args.checkpoint is None
    ):
        print("error: pass --checkpoint, or --base-model with --adapter", file=sys.stderr)
        return 2
    if args.base_model is not None:
        return _export_merged(args)
    path: Path | None = args.checkpoint
    if path is not None and path.is_dir():
        path = latest_checkpoint(path)
        if path is None:
            print(f"error: no valid checkpoint in {args.checkpoint}", file=sys.stderr)
            return 2
    try:
        state = load_checkpoint(path)  # type: ignore[arg-type]
    except (CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        save_gguf(args.out, state.config, state.params, dtype=args.dtype or "f32")
    except GGUFError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"exported step {state.step} from {path} to {args.out}")
    return 0


def _export_merged(args: argparse.Namespace) -> int:
    """The base file with the adapter merged into its tensors (``gguf_rewrite.rewrite_gguf``)."""
    import gguf

    from foundry.model.formats.gguf_io import load_gguf_stored
    from foundry.model.formats.gguf_model import GGUFError
    from foundry.model.formats.gguf_rewrite import rewrite_gguf
    from foundry.model.formats.lora import LoraError, apply_adapter, base_of, load_adapter
    from foundry.model.kernels.quant import dequantize

    try:
        adapter = load_adapter(args.adapter)
        names = {base_of(n) for n in adapter.tensors}
        loaded = load_gguf_stored(args.base_model, select=lambda n, v: v if n in names else None)
        merged = apply_adapter(loaded.cfg, loaded.params, adapter, str(args.adapter))
        forced = None if args.dtype is None else gguf.GGMLQuantizationType[args.dtype.upper()]
        types = rewrite_gguf(
            args.base_model, args.out, {n: dequantize(merged[n]) for n in names}, forced
        )
    except (GGUFError, LoraError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    print(
        f"merged {args.adapter} into {args.base_model} -> {args.out} ("
        + ", ".join(f"{n} tensors {t}" for t, n in sorted(counts.items()))
        + ")"
    )
    return 0


def _stop_on_signals(stop: object) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)  # type: ignore[arg-type]
