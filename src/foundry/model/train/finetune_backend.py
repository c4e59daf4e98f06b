"""A fine-tuning run's computing on PyTorch, over ``finetune``'s base and training graph.

``FineTuneBackend`` is what a worker computes with: the mean gradient of the *trainable*
tensors (the adapters, or the whole model) over a slice of the global batch, as float32 numpy
arrays by name: the swarm's currency. ``FineTuner`` is the single-process trainer of
``foundry train --base-model``."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from foundry.model.formats import lora as LR
from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import Corpus
from foundry.model.train.finetune import Base, Model
from foundry.model.train.optim import AdamW, AdamWState, clip_grad_norm, lr_schedule
from foundry.model.train.torch_backend import adamw, adamw_state, load_adamw
from foundry.model.train.training import GradientResult, Params, Stopped

Tensors = dict[str, torch.Tensor]


def _device_params(params: Params, device: torch.device, grad: bool) -> Tensors:
    return {
        n: torch.from_numpy(np.array(a, np.float32)).to(device).requires_grad_(grad)
        for n, a in params.items()
    }


def _batch(
    corpus: Corpus, start: int, count: int, seq_len: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    tok, tgt = corpus.sample_batch(start, count, seq_len, seed=seed)
    return (
        torch.from_numpy(tok.astype(np.int64)).to(device),
        torch.from_numpy(tgt.astype(np.int64)).to(device),
    )


class FineTuneBackend:
    """What a worker computes with for a fine-tuning run: ``backend.Backend``'s
    ``compute_gradients`` over the trainable tensors, the base held here.

    The loss of a slice is the summed cross-entropy of its counted targets over
    ``count * seq_len`` (a token that carries no loss counts as zero), so the mean over the
    global batch is the sample-weighted mean of the workers' slices, whatever the mask."""

    def __init__(
        self, base: Base, spec: LR.LoraSpec | None, *, micro_batch: int = 8, dropout_seed: int = 0
    ) -> None:
        self.base = base
        self.spec = spec
        self.model = Model(base, spec)
        self.micro_batch = micro_batch
        self.dropout_seed = dropout_seed
        self.name = f"torch:{base.device.type}"
        self.last_phases: dict[str, float] = {}

    def accumulate(
        self,
        trainable: Tensors,
        corpus: Corpus,
        start: int,
        count: int,
        *,
        seq_len: int,
        data_seed: int = 0,
    ) -> float:
        """Backward of the slice's loss into ``trainable``'s .grad; the loss."""
        total = 0.0
        step = max(1, self.micro_batch)
        for off in range(0, count, step):
            n = min(step, count - off)
            if self.spec is not None and self.spec.dropout:
                torch.manual_seed(self.dropout_seed * 1_000_003 + start + off)
            tok, tgt = _batch(corpus, start + off, n, seq_len, data_seed, self.base.device)
            nll, _ = self.model.loss_sum(trainable, tok, tgt, train=True)
            scaled = nll / (count * seq_len)
            torch.autograd.backward(scaled)
            total += float(scaled.detach())
        return total

    def compute_gradients(
        self,
        params: Params,
        cfg: ModelConfig,
        corpus: Corpus,
        start: int,
        count: int,
        *,
        seq_len: int,
        micro_batch: int = 0,
        aux_loss_coef: float = 0.0,
        data_seed: int = 0,
    ) -> GradientResult:
        """The mean gradient of the trainable ``params`` over global samples
        [start, start + count), float32 numpy by name."""
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        t0 = time.perf_counter()
        dev = _device_params(params, self.base.device, True)
        loss = self.accumulate(dev, corpus, start, count, seq_len=seq_len, data_seed=data_seed)
        grads = {
            n: (t.grad if t.grad is not None else torch.zeros_like(t)).cpu().numpy()
            for n, t in dev.items()
        }
        self.last_phases = {"steps": time.perf_counter() - t0}
        return GradientResult(grads, count, loss, 0.0)

    def make_inner(self, params: Params, weight_decay: float) -> AdamW:
        return AdamW(params, weight_decay=weight_decay)

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
        """``backend.NumpyBackend.local_steps`` over the trainable tensors: inner AdamW steps
        from ``start``, the pseudo-gradient ``start - end`` back."""
        local = {k: v.copy() for k, v in start.items()}
        loss = 0.0
        b = samples_per_step
        for k in range(steps):
            if stop is not None and stop():
                raise Stopped(f"stopped after {k} of {steps} inner steps")
            res = self.compute_gradients(
                local, cfg, corpus, sample_offset + k * b, b, seq_len=seq_len
            )
            clip_grad_norm(res.grads, grad_clip)
            inner.step(local, res.grads, lr_at(global_step + k))
            loss += res.loss
        return GradientResult({k: start[k] - local[k] for k in start}, steps * b, loss / steps, 0.0)

    def evaluate_loss(
        self,
        params: Params,
        cfg: ModelConfig,
        corpus: Corpus,
        seq_len: int,
        max_batches: int | None = None,
        batch_size: int = 8,
    ) -> float:
        return evaluate(
            self.model,
            _device_params(params, self.base.device, False),
            corpus,
            seq_len,
            max_batches,
            batch_size,
        )


def evaluate(
    model: Model,
    trainable: Mapping[str, torch.Tensor],
    corpus: Corpus,
    seq_len: int,
    max_batches: int | None = None,
    batch_size: int = 8,
) -> float:
    """Mean cross-entropy in nats per counted token of the held-out blocks."""
    total, n = 0.0, 0
    with torch.no_grad():
        for tok, tgt in corpus.validation_batches(seq_len, batch_size, max_batches):
            t = torch.from_numpy(tok.astype(np.int64)).to(model.base.device)
            y = torch.from_numpy(tgt.astype(np.int64)).to(model.base.device)
            nll, count = model.loss_sum(trainable, t, y)
            total += float(nll)
            n += count
    return total / n if n else math.nan


@dataclass
class TuneSettings:
    """A fine-tuning run's schedule (the same meaning as ``training.TrainSettings``)."""

    global_batch: int
    seq_len: int
    lr: float
    total_steps: int
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    min_lr_ratio: float = 0.1
    data_seed: int = 0


class FineTuner:
    """One process fine-tuning: trainable tensors and AdamW's moments on the base's device."""

    def __init__(self, backend: FineTuneBackend, settings: TuneSettings, trainable: Params):
        self.backend = backend
        self.settings = settings
        self.params = _device_params(trainable, backend.base.device, True)
        self.optimizer = adamw(self.params, settings.weight_decay, backend.base.device, settings.lr)
        self.step = 0
        self.position = 0

    def learning_rate(self) -> float:
        s = self.settings
        return lr_schedule(self.step, s.lr, s.warmup_steps, s.total_steps, s.min_lr_ratio)

    def train_step(self, corpus: Corpus) -> GradientResult:
        s = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.backend.accumulate(
            self.params,
            corpus,
            self.position,
            s.global_batch,
            seq_len=s.seq_len,
            data_seed=s.data_seed,
        )
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), s.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        self.optimizer.step()
        self.step += 1
        self.position += s.global_batch
        return GradientResult({}, s.global_batch, loss, 0.0)

    def evaluate_loss(
        self, corpus: Corpus, seq_len: int, max_batches: int | None = None, batch_size: int = 8
    ) -> float:
        return evaluate(self.backend.model, self.params, corpus, seq_len, max_batches, batch_size)

    def host_params(self) -> Params:
        return {n: t.detach().cpu().numpy().copy() for n, t in self.params.items()}

    def optimizer_state(self) -> AdamWState:
        return adamw_state(self.params, self.optimizer)

    def load(self, params: Params, state: AdamWState, step: int, position: int) -> None:
        """Take over a checkpoint's trainable tensors, moments and position."""
        load_adamw(self.params, self.optimizer, params, state)
        self.step, self.position = step, position
