"""The checkpoints of `foundry train` in one process, from scratch or fine-tuning a published
file (``--checkpoint-dir``, ``--checkpoint-every``, ``--fresh``): the same files the
coordinator writes (``model.formats.checkpoint``), resumed by running the same command again.

A trainer here is anything with ``step``, ``position``, ``host_params()``,
``optimizer_state()`` and ``load(params, optimizer, step, position)``: ``training.Trainer``,
``torch_backend.TorchTrainer`` and, fine-tuning, ``finetune_backend.FineTuner``, whose tensors
are the trainable ones (the adapters, or every tensor) and whose config names the base file's
identity, so a checkpoint of another base file or other LoRA settings is refused.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Protocol

from foundry.model.formats.checkpoint import CheckpointState, load_checkpoint
from foundry.model.formats.checkpoint_dir import (
    DirectoryLock,
    check_directory,
    resume_checkpoint,
    save_checkpoint,
    start_fresh,
)
from foundry.model.spec.config import ModelConfig
from foundry.model.train.optim import AdamWState
from foundry.model.train.training import Params

log = logging.getLogger("foundry.train")


class Resumable(Protocol):
    step: int
    position: int

    def host_params(self) -> Params: ...

    def optimizer_state(self) -> AdamWState: ...

    def load(self, params: Params, state: AdamWState, step: int, position: int) -> None: ...


class Checkpoints:
    """``--checkpoint-dir`` of one training process (nothing when it is not given)."""

    def __init__(self, args: argparse.Namespace, cfg: ModelConfig) -> None:
        self.directory: Path | None = args.checkpoint_dir
        self.every: int = args.checkpoint_every
        self.fresh: bool = args.fresh
        self.cfg = cfg
        self._saved = -1  # the step of the last checkpoint written or resumed

    def resume(self, trainer: Resumable) -> str | None:
        """Lock the folder and load its newest checkpoint that verifies into ``trainer``;
        the error to print when that checkpoint holds another model. CheckpointError for a
        folder that cannot be used."""
        if self.directory is None:
            return None
        check_directory(self.directory)
        # Held until the process exits (the kernel drops it then, however it exits).
        DirectoryLock(self.directory, "foundry train").acquire()
        if self.fresh:
            start_fresh(self.directory)
        found = resume_checkpoint(self.directory)
        if found is None:
            return None
        state = load_checkpoint(found)
        if state.config != self.cfg:
            return f"{found} holds another model; use another --checkpoint-dir"
        trainer.load(state.params, state.optimizer, state.step, state.data_position)
        self._saved = state.step
        print(f"resuming from {found} at step {trainer.step}", flush=True)
        return None

    def save(self, trainer: Resumable) -> None:
        """A checkpoint of this step, unless it has one already."""
        if self.directory is None or trainer.step == self._saved:
            return
        path = save_checkpoint(
            self.directory,
            CheckpointState(
                config=self.cfg,
                step=trainer.step,
                params=trainer.host_params(),
                optimizer=trainer.optimizer_state(),
                data_position=trainer.position,
            ),
        )
        self._saved = trainer.step
        log.info("checkpoint %s", path)

    def due(self, trainer: Resumable) -> None:
        """A checkpoint every ``--checkpoint-every`` steps."""
        if trainer.step % self.every == 0:
            self.save(trainer)

    def resume_hint(self) -> str:
        """What `foundry train` says after Ctrl+C: how to go on from where it stopped."""
        if self.directory is None:
            return (
                "nothing was saved (no --checkpoint-dir); add --checkpoint-dir DIR to be "
                "able to resume after a stop"
            )
        return (
            f"checkpoint written to {self.directory}: run the same command again to "
            "resume from this step (--fresh starts at step 0)"
        )


class StepInterrupt:
    """Ctrl+C (SIGINT) in a training loop, taken at a step's end: the first asks the loop to
    stop there (``check`` then raises KeyboardInterrupt, which the loop's handler turns into a
    checkpoint and the resume hint), a second raises KeyboardInterrupt at once, as Python's
    default does. Python's default alone raised it wherever the main thread was, and where that
    was a finalizer (``__del__``, a weakref callback) Python prints it as ignored and goes on:
    the run kept training. Outside the main thread it changes nothing."""

    def __init__(self) -> None:
        self.requested = False
        self._old: object = None
        self._installed = False

    def __enter__(self) -> StepInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._old)  # type: ignore[arg-type]
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("stopping after this step (Ctrl+C again stops now)", file=sys.stderr, flush=True)

    def check(self) -> None:
        """KeyboardInterrupt when a Ctrl+C came during the step that just ended."""
        if self.requested:
            raise KeyboardInterrupt
