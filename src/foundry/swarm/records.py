"""The coordinator's records: the checkpoint it resumes from, the checkpoints it writes, the
validation loss of the held-out split, and the GGUF it exports. Each copies the master state
only between optimizer steps (``SwarmCore.applied``)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from foundry.model.formats.checkpoint import CheckpointError, CheckpointState, load_checkpoint
from foundry.model.formats.checkpoint_dir import resume_checkpoint, save_checkpoint
from foundry.model.formats.gguf_io import load_gguf, save_gguf
from foundry.model.formats.gguf_model import FILE_DTYPES, GGUF_MAGIC_BYTES
from foundry.model.formats.tuning import TunedConfig
from foundry.model.nn.transformer import init_params
from foundry.model.text.data import compressor_bits_per_byte
from foundry.model.train.training import (
    Params,
    Trainer,
    against_compressors,
    bits_per_byte,
)
from foundry.obs.timeline import now_us
from foundry.swarm.core import CoordinatorOptions, SwarmCore
from foundry.swarm.downlink import Downlink
from foundry.wire import fdtc
from foundry.wire.fdtc import Compression, FileType

log = logging.getLogger("foundry.coordinator")


class ExportRefused(Exception):
    """An EXPORT path the coordinator will not write; the message says what to do."""


@dataclass
class Start:
    """Where training starts: the master weights and optimizer, and what a checkpoint adds
    (the shadow, the outer momentum, the outer steps so far)."""

    trainer: Trainer
    tensors: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    outer_steps: int = 0
    downlink_rng: str | None = None  # the downlink codec's random state (QSGD)


def load_or_init(opt: CoordinatorOptions) -> Start:
    """The newest checkpoint in ``opt.checkpoint_dir`` that verifies (damaged newer ones set
    aside), else ``opt.init_gguf``, else fresh weights from ``opt.seed``. Checkpoint files none
    of which verifies, or one whose metadata does not fit the schema, end the process with
    the reason (never a silent start from step 0)."""
    try:
        ckpt = resume_checkpoint(opt.checkpoint_dir)
        state = load_checkpoint(ckpt) if ckpt is not None else None
    except CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from None
    if ckpt is not None and state is not None:
        if state.config != opt.cfg:
            raise SystemExit(
                f"checkpoint {ckpt} holds a different model ({state.config}) than "
                f"--preset asks for ({opt.cfg}); use another --checkpoint-dir"
            )
        mode = int(state.extra.get("sync_every", 1))
        if mode != opt.sync_every:
            raise SystemExit(
                f"checkpoint {ckpt} was written with --sync-every {mode}, not "
                f"{opt.sync_every}; resume with --sync-every {mode} or use another "
                "--checkpoint-dir"
            )
        trainer = Trainer(opt.cfg, opt.settings, state.params)
        trainer.optimizer.load_state_dict(state.optimizer)
        trainer.step = state.step
        trainer.position = state.data_position
        log.info("resumed from %s at step %d", ckpt, trainer.step)
        return Start(
            trainer,
            state.tensors,
            int(state.extra.get("outer_steps", 0)),
            state.extra.get("downlink_rng"),
        )  # a string: the schema checked it
    if opt.start_params is not None:
        return Start(
            Trainer(opt.cfg, opt.settings, {k: v.copy() for k, v in opt.start_params.items()})
        )
    if opt.init_gguf is not None:
        loaded = load_gguf(opt.init_gguf)
        if loaded.cfg != opt.cfg:
            raise SystemExit(
                f"{opt.init_gguf} holds {loaded.cfg}, not the --preset model "
                f"{opt.cfg}; pass the matching --preset"
            )
        log.info("initialised weights from %s", opt.init_gguf)
        return Start(Trainer(opt.cfg, opt.settings, loaded.params))
    return Start(Trainer(opt.cfg, opt.settings, init_params(opt.cfg, opt.seed)))


class Records:
    def __init__(self, core: SwarmCore, downlink: Downlink) -> None:
        self.core = core
        self.downlink = downlink
        self.validation_step = -1  # the step of the last validation begun
        self._validation: asyncio.Task[None] | None = None  # the one under way
        self._yardstick: dict[str, float] | None = None  # compressors on the held-out bytes
        self.checkpoint_failed = False
        self.checkpoint_warning = ""  # why checkpoints fail, while they do (status)

    async def validate(self) -> None:
        """Validate the weights of this step in the background: rounds go on while it runs
        (on the whole held-out split it takes as long as several steps). One at a time: a
        validation due while the last still runs waits for it, so none is skipped and their
        log lines come in step order."""
        await self.validated()
        await self.core.applied.wait()
        params = {k: v.copy() for k, v in self.core.trainer.params.items()}
        self.validation_step = self.core.step
        self._validation = self.core.spawn(
            self._run_validation(self.core.step, params), "validation"
        )

    async def validated(self) -> None:
        """Until the validation under way (if any) is done."""
        task = self._validation
        if task is not None:
            await asyncio.shield(task)
            if self._validation is task:  # another waiter may have started the next one
                self._validation = None

    async def _run_validation(self, step: int, params: Params) -> None:
        c = self.core
        seq_len = c.opt.settings.seq_len
        loss = await asyncio.to_thread(
            c.opt.validation_backend.evaluate_loss, params, c.opt.cfg, c.corpus, seq_len
        )
        if math.isnan(c.first_val_loss):
            c.first_val_loss, c.first_val_step = loss, step
        if isinstance(c.opt.cfg, TunedConfig):  # tokens of the base's vocabulary, not bytes
            self.core.val_loss = loss
            self.core.metrics.validation_loss.set(loss)
            log.info("step %d: validation loss %.4f nats/token", step, loss)
            return
        if self._yardstick is None:
            self._yardstick = await asyncio.to_thread(
                compressor_bits_per_byte, self.core.corpus.held_out_bytes(seq_len)
            )
        self.core.val_loss = loss
        self.core.metrics.validation_loss.set(loss)
        log.info(
            "step %d: validation loss %.4f, %s",
            step,
            loss,
            against_compressors(bits_per_byte(loss), self._yardstick),
        )

    async def checkpoint_or_warn(self) -> None:
        """A periodic checkpoint that fails (full or read-only disk) does not stop training:
        it is told, counted, and tried again after every following step until one succeeds;
        the previous checkpoints stay intact."""
        try:
            await self.checkpoint()
        except CheckpointError as exc:
            self.core.metrics.checkpoint_failures.inc()
            if not self.checkpoint_failed:
                self.checkpoint_warning = f"checkpoints failing since step {self.core.step}: {exc}"
            self.checkpoint_failed = True
            log.warning(
                "step %d: %s; training goes on, retrying after the next step", self.core.step, exc
            )
        else:
            self.checkpoint_failed = False
            self.checkpoint_warning = ""

    async def checkpoint(self) -> Path:
        t0 = time.monotonic()
        start_us = now_us()
        await self.core.applied.wait()  # then copied with no await between: one step's state
        opt_state = self.core.trainer.optimizer.state_dict()
        state = CheckpointState(
            config=self.core.opt.cfg,
            step=self.core.step,
            params={k: v.copy() for k, v in self.core.trainer.params.items()},
            # Copies too: the next step changes the moments while the file is written.
            optimizer={
                "step": opt_state["step"],
                "m": {k: v.copy() for k, v in opt_state["m"].items()},
                "v": {k: v.copy() for k, v in opt_state["v"].items()},
            },
            data_position=self.core.trainer.position,
            extra={
                "compression": Compression(self.core.opt.compression).name.lower(),
                "down_compression": Compression(self.core.opt.downlink).name.lower(),
                "sync_every": self.core.opt.sync_every,
                "outer_steps": self.core.outer_steps,
                **self.downlink.random_state(),
            },
            tensors={
                "shadow": {k: v.copy() for k, v in self.downlink.shadow.params.items()},
                **(
                    {"outer_m": {k: v.copy() for k, v in self.core.outer.m.items()}}
                    if self.core.opt.sync_every > 1
                    else {}
                ),
            },
        )
        path = await asyncio.to_thread(
            save_checkpoint, self.core.opt.checkpoint_dir, state, self.core.opt.keep_checkpoints
        )
        self.core.metrics.checkpoints.inc()
        self.core.checkpoint_step = state.step
        self.core.metrics.checkpoint_duration.observe(time.monotonic() - t0)
        self.core.timeline.span("checkpoint", start_us, step=state.step)
        log.info("checkpoint %s written at step %d", path, self.core.step)
        await self.downlink.broadcast(fdtc.Checkpoint())
        return path

    def export_target(self, path: Path | None) -> Path:
        """Where EXPORT may write, or ExportRefused saying why not and what to do."""
        target = path or self.core.opt.export_path or (self.core.opt.checkpoint_dir / "model.gguf")
        allowed = (self.core.opt.export_dir or self.core.opt.checkpoint_dir.parent).resolve()
        resolved = target.resolve()
        if not self.core.opt.export_anywhere and not resolved.is_relative_to(allowed):
            raise ExportRefused(
                f"{target} is outside the export dir {allowed}; export there, or start the "
                "coordinator with --export-dir DIR or --export-anywhere"
            )
        if resolved.is_dir():
            raise ExportRefused(f"{target} is a folder; name a file in it (model.gguf)")
        if resolved.exists():
            with resolved.open("rb") as f:
                head = f.read(len(GGUF_MAGIC_BYTES))
            if head != GGUF_MAGIC_BYTES:
                raise ExportRefused(
                    f"{target} exists and is not a GGUF file; not overwriting it (remove it "
                    "or choose another --path)"
                )
        if not resolved.parent.is_dir():
            raise ExportRefused(f"folder {target.parent} does not exist; create it first")
        return target

    async def export(self, path: Path | None, file_type: FileType = FileType.F32) -> Path:
        """The master weights of this step as a GGUF file of ``file_type`` at ``path``."""
        target = self.export_target(path)
        dtype = FILE_DTYPES[int(file_type)]
        await self.core.applied.wait()
        step, params = self.core.step, {k: v.copy() for k, v in self.core.trainer.params.items()}
        cfg = self.core.opt.cfg
        if isinstance(cfg, TunedConfig):
            await asyncio.to_thread(export_tuned, target, cfg, self.core.opt.base_model, params)
        else:
            await asyncio.to_thread(save_gguf, target, cfg, params, dtype)
        log.info(
            "exported step %d to %s%s",
            step,
            target,
            "" if file_type is FileType.F32 else f" ({dtype})",
        )
        return target


def export_tuned(target: Path, cfg: TunedConfig, base: Path | None, params: Params) -> None:
    """A fine-tuning run's result: the LoRA adapter file, or (full fine-tuning) the base file
    with the trained tensors in place of its own."""
    from foundry.model.formats.gguf_rewrite import rewrite_gguf
    from foundry.model.formats.lora import save_adapter

    if cfg.spec is not None:
        save_adapter(target, cfg.architecture, cfg.spec.alpha, params)
        return
    if base is None:
        raise ExportRefused("the coordinator has no base file to write the model into")
    rewrite_gguf(base, target, params)
