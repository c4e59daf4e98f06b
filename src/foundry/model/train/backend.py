"""Where a process computes: the numpy engine (the reference, every CPU) or PyTorch (a GPU).

A ``Backend`` runs what a training worker runs between two messages: the mean gradient of a
slice of the global batch (``compute_gradients``, ``--sync-every 1``) and a round of inner
AdamW steps whose pseudo-gradient goes up (``local_steps``). Both take and return the wire's
currency, float32 numpy arrays by parameter name, so the worker, the codecs and the
coordinator are the same whichever backend ran. ``select`` turns ``--device`` into one
(``nn.device.resolve``): the numpy engine (``training``, ``transformer``) or
``torch_backend.TorchBackend`` on the device it names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from foundry.model.nn.device import resolve
from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import Corpus
from foundry.model.train.optim import AdamW, AdamWState, clip_grad_norm
from foundry.model.train.training import (
    GradientResult,
    Params,
    Stopped,
    Trainer,
    TrainSettings,
    compute_gradients,
    evaluate_loss,
)

__all__ = ["NUMPY", "Backend", "NumpyBackend", "StepTrainer", "Stopped", "make_trainer", "select"]


class Backend(Protocol):
    name: str  # "numpy", or "torch:<device>"

    def compute_gradients(
        self,
        params: Params,
        cfg: ModelConfig,
        corpus: Corpus,
        start: int,
        count: int,
        *,
        seq_len: int,
        micro_batch: int,
        aux_loss_coef: float,
        data_seed: int = 0,
    ) -> GradientResult: ...

    def make_inner(self, params: Params, weight_decay: float) -> Any:
        """The inner optimizer of local rounds, kept by the caller across them."""

    def local_steps(
        self,
        start: Params,
        inner: Any,
        cfg: ModelConfig,
        corpus: Corpus,
        *,
        lr_at: Callable[[int], float],
        grad_clip: float,
        global_step: int,
        sample_offset: int,
        samples_per_step: int,
        steps: int,
        micro_batch: int,
        seq_len: int,
        aux_loss_coef: float,
        stop: Callable[[], bool] | None = None,
    ) -> GradientResult: ...

    def evaluate_loss(
        self,
        params: Params,
        cfg: ModelConfig,
        corpus: Corpus,
        seq_len: int,
        max_batches: int | None = None,
        batch_size: int = 8,
    ) -> float:
        """``training.evaluate_loss`` of ``params`` computed here (the coordinator's
        ``--validate-device``)."""


class NumpyBackend:
    """The reference: the numpy engine on this process's CPU."""

    name = "numpy"

    def compute_gradients(
        self,
        params: Params,
        cfg: ModelConfig,
        corpus: Corpus,
        start: int,
        count: int,
        *,
        seq_len: int,
        micro_batch: int,
        aux_loss_coef: float,
        data_seed: int = 0,
    ) -> GradientResult:
        return compute_gradients(
            params,
            cfg,
            corpus,
            start,
            count,
            seq_len=seq_len,
            micro_batch=micro_batch,
            aux_loss_coef=aux_loss_coef,
            data_seed=data_seed,
        )

    def make_inner(self, params: Params, weight_decay: float) -> AdamW:
        return AdamW(params, weight_decay=weight_decay)

    def evaluate_loss(
        self,
        params: Params,
        cfg: ModelConfig,
        corpus: Corpus,
        seq_len: int,
        max_batches: int | None = None,
        batch_size: int = 8,
    ) -> float:
        return evaluate_loss(params, cfg, corpus, seq_len, max_batches, batch_size)

    def local_steps(
        self,
        start: Params,
        inner: AdamW,
        cfg: ModelConfig,
        corpus: Corpus,
        *,
        lr_at: Callable[[int], float],
        grad_clip: float,
        global_step: int,
        sample_offset: int,
        samples_per_step: int,
        steps: int,
        micro_batch: int,
        seq_len: int,
        aux_loss_coef: float,
        stop: Callable[[], bool] | None = None,
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
                local,
                cfg,
                corpus,
                sample_offset + k * b,
                b,
                seq_len=seq_len,
                micro_batch=micro_batch,
                aux_loss_coef=aux_loss_coef,
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

    def evaluate_loss(
        self, corpus: Corpus, seq_len: int, max_batches: int | None = None, batch_size: int = 8
    ) -> float: ...


def make_trainer(
    backend: Backend, cfg: ModelConfig, settings: TrainSettings, params: Params
) -> StepTrainer:
    """The single-process trainer of ``backend``: weights and moments where it computes."""
    if isinstance(backend, NumpyBackend):
        return Trainer(cfg, settings, params)
    from foundry.model.train.torch_backend import TorchBackend, TorchTrainer

    assert isinstance(backend, TorchBackend)
    return TorchTrainer.from_numpy(cfg, settings, backend, params)


def select(device: str, *, bf16: bool = False, training: bool = False) -> Backend:
    """The backend ``--device`` names (``nn.device.DEVICES``); ``nn.device.DeviceError`` says
    how to get a missing one. ``bf16``: the torch backend's products under bf16 autocast
    (weights, moments and the wire stay float32). ``training``: ``auto`` without a GPU takes
    PyTorch on the CPU where it is installed (``nn.device.resolve``)."""
    target = resolve(device, training=training)
    if target is None:
        return NUMPY
    from foundry.model.train.torch_backend import TorchBackend

    return TorchBackend(target, bf16=bf16)
