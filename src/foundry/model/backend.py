"""Where a process computes: the numpy engine (the reference, every CPU) or PyTorch (a GPU).

A ``Backend`` runs what a training worker runs between two messages: the mean gradient of a
slice of the global batch (``compute_gradients``, ``--sync-every 1``) and a round of inner
AdamW steps whose pseudo-gradient goes up (``local_steps``). Both take and return the wire's
currency, float32 numpy arrays by parameter name, so the worker, the codecs and the
coordinator are the same whichever backend ran. ``select`` turns ``--device`` into one:

- ``cpu``: the numpy engine (``training``, ``transformer``): the default;
- ``cuda``: ``torch_backend.TorchBackend`` on the first CUDA GPU; PyTorch is an optional
  extra (``pip install 'foundry[gpu]'``), and without it or without a GPU this says so;
- ``auto``: ``cuda`` where PyTorch sees a GPU, else ``cpu``; for training (``training=True``)
  without a GPU, PyTorch on the CPU where it is installed (on all the process's threads it
  trains faster than numpy: docs/gpu.md), numpy where it is not (armv7 has no torch wheel);
- ``torch-cpu``: the PyTorch backend on the CPU, which is how a machine without a GPU (CI)
  runs the GPU path end to end.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any, Protocol

from foundry.model.config import ModelConfig
from foundry.model.data import Corpus
from foundry.model.optim import AdamW, AdamWState, clip_grad_norm
from foundry.model.training import (
    GradientResult,
    Params,
    Stopped,
    Trainer,
    TrainSettings,
    compute_gradients,
    evaluate_loss,
)

__all__ = ["DEVICES", "INSTALL_HINT", "NUMPY", "Backend", "BackendError", "NumpyBackend",
           "StepTrainer", "Stopped", "make_trainer", "select", "torch_available"]

DEVICES = ("cpu", "cuda", "auto", "torch-cpu")
INSTALL_HINT = "pip install 'foundry[gpu]' (PyTorch with CUDA; see docs/gpu.md)"


class BackendError(ValueError):
    """The asked-for device cannot be had here; the message says what to do."""


class Backend(Protocol):
    name: str  # "numpy", or "torch:<device>"

    def compute_gradients(
        self, params: Params, cfg: ModelConfig, corpus: Corpus, start: int, count: int, *,
        seq_len: int, micro_batch: int, aux_loss_coef: float, data_seed: int = 0,
    ) -> GradientResult: ...

    def make_inner(self, params: Params, weight_decay: float) -> Any:
        """The inner optimizer of local rounds, kept by the caller across them."""

    def local_steps(
        self, start: Params, inner: Any, cfg: ModelConfig, corpus: Corpus, *,
        lr_at: Callable[[int], float], grad_clip: float, global_step: int, sample_offset: int,
        samples_per_step: int, steps: int, micro_batch: int, seq_len: int,
        aux_loss_coef: float, stop: Callable[[], bool] | None = None,
    ) -> GradientResult: ...

    def evaluate_loss(self, params: Params, cfg: ModelConfig, corpus: Corpus, seq_len: int,
                      max_batches: int | None = None, batch_size: int = 8) -> float:
        """``training.evaluate_loss`` of ``params`` computed here (the coordinator's
        ``--validate-device``)."""


class NumpyBackend:
    """The reference: the numpy engine on this process's CPU."""

    name = "numpy"

    def compute_gradients(
        self, params: Params, cfg: ModelConfig, corpus: Corpus, start: int, count: int, *,
        seq_len: int, micro_batch: int, aux_loss_coef: float, data_seed: int = 0,
    ) -> GradientResult:
        return compute_gradients(params, cfg, corpus, start, count, seq_len=seq_len,
                                 micro_batch=micro_batch, aux_loss_coef=aux_loss_coef,
                                 data_seed=data_seed)

    def make_inner(self, params: Params, weight_decay: float) -> AdamW:
        return AdamW(params, weight_decay=weight_decay)

    def evaluate_loss(self, params: Params, cfg: ModelConfig, corpus: Corpus, seq_len: int,
                      max_batches: int | None = None, batch_size: int = 8) -> float:
        return evaluate_loss(params, cfg, corpus, seq_len, max_batches, batch_size)

    def local_steps(
        self, start: Params, inner: AdamW, cfg: ModelConfig, corpus: Corpus, *,
        lr_at: Callable[[int], float], grad_clip: float, global_step: int, sample_offset: int,
        samples_per_step: int, steps: int, micro_batch: int, seq_len: int,
        aux_loss_coef: float, stop: Callable[[], bool] | None = None,
    ) -> GradientResult:
        """``steps`` inner AdamW steps from ``start`` (left unchanged) on consecutive global
        samples; the pseudo-gradient ``start - end``, weighted as ``steps * samples_per_step``.

        Inner step ``k`` trains samples ``[offset + k b, offset + (k + 1) b)`` at
        ``lr_at(global_step + k)``. ``inner`` keeps its moments across rounds.
        """
        local = {k: v.copy() for k, v in start.items()}
        loss = aux = 0.0
        b = samples_per_step
        for k in range(steps):
            if stop is not None and stop():
                raise Stopped(f"stopped after {k} of {steps} inner steps")
            res = compute_gradients(
                local, cfg, corpus, sample_offset + k * b, b,
                seq_len=seq_len, micro_batch=micro_batch, aux_loss_coef=aux_loss_coef,
            )
            clip_grad_norm(res.grads, grad_clip)
            inner.step(local, res.grads, lr_at(global_step + k))
            loss += res.loss
            aux += res.aux_loss
        pseudo = {k: start[k] - local[k] for k in start}
        return GradientResult(pseudo, steps * b, loss / steps, aux / steps)


NUMPY = NumpyBackend()


class StepTrainer(Protocol):
    """What ``foundry train`` drives: ``training.Trainer`` or ``torch_backend.TorchTrainer``."""

    step: int
    position: int

    def train_step(self, corpus: Corpus, micro_batch: int | None = None) -> GradientResult: ...

    def host_params(self) -> Params: ...

    def optimizer_state(self) -> AdamWState: ...

    def load(self, params: Params, state: AdamWState, step: int, position: int) -> None: ...

    def evaluate_loss(self, corpus: Corpus, seq_len: int, max_batches: int | None = None,
                      batch_size: int = 8) -> float: ...


def make_trainer(backend: Backend, cfg: ModelConfig, settings: TrainSettings, params: Params
                 ) -> StepTrainer:
    """The single-process trainer of ``backend``: weights and moments where it computes."""
    if isinstance(backend, NumpyBackend):
        return Trainer(cfg, settings, params)
    from foundry.model.torch_backend import TorchBackend, TorchTrainer

    assert isinstance(backend, TorchBackend)
    return TorchTrainer.from_numpy(cfg, settings, backend, params)


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def select(device: str, *, bf16: bool = False, training: bool = False) -> Backend:
    """The backend ``--device`` names (``DEVICES``); BackendError says how to get a missing
    one. ``bf16``: the torch backend's products under bf16 autocast (weights, moments and
    the wire stay float32). ``training``: ``auto`` without a GPU takes PyTorch on the CPU
    where it is installed (inference keeps the numpy engine, whose kernels read quantized
    files in place)."""
    if device not in DEVICES:
        raise BackendError(f"unknown device {device!r}; choose one of: {', '.join(DEVICES)}")
    if device == "cpu":
        return NUMPY
    if not torch_available():
        if device == "auto":
            return NUMPY
        raise BackendError(f"--device {device} needs PyTorch, which is not installed: "
                           f"{INSTALL_HINT}")
    import torch

    if device == "torch-cpu":
        target = "cpu"
        if "OMP_NUM_THREADS" not in os.environ:
            # torch's CPU threads spin while they wait: on a shared or loaded host two of them
            # ran `foundry train` 25x slower than one. The CPU path is for checks, not speed.
            torch.set_num_threads(1)
    elif torch.cuda.is_available():
        target = "cuda"
    elif device == "auto" and training:
        target = "cpu"
    elif device == "auto":
        return NUMPY
    else:
        raise BackendError(
            f"--device cuda: PyTorch {torch.__version__} sees no CUDA GPU (a CPU-only build, "
            f"or no driver); install a CUDA build ({INSTALL_HINT}) or use --device cpu")
    from foundry.model.torch_backend import TorchBackend

    return TorchBackend(target, bf16=bf16)
