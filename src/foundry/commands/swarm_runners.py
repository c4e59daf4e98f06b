"""What `foundry coordinator`, `foundry worker` and `foundry export` run once their flags are parsed
(the parsers are `foundry.commands.swarm`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from foundry.commands.common import (
    resolve_schedule,
    start_metrics,
    tls_context,
    tls_note,
    use_threads,
)
from foundry.model.nn.device import DeviceError
from foundry.model.spec.config import ModelConfig, preset
from foundry.model.train import recipe
from foundry.model.train.training import TrainSettings
from foundry.obs.timeline import ROUNDS_TID, Timeline
from foundry.wire.fdtc import MAX_MESSAGE, Compression

log = logging.getLogger("foundry")


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
        from foundry.model.train.finetune import initial_trainable
        from foundry.model.train.finetune_backend import FineTuneBackend

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
