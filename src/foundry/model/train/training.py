"""One training step, split where the swarm splits it.

``compute_gradients`` is what a worker runs on its slice of the global batch; ``Trainer.apply``
is what the coordinator runs on the averaged gradient. Single-process ``foundry train`` runs
both back to back, so the swarm and one process share every line of the maths.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from foundry.model.nn.transformer import forward, loss_and_grads
from foundry.model.spec.config import N_SPECIAL_TOKENS, ModelConfig
from foundry.model.text.data import HOLDOUT_EVERY, Corpus
from foundry.model.train import recipe
from foundry.model.train.optim import AdamW, AdamWState, clip_grad_norm, lr_schedule

Params = dict[str, npt.NDArray[np.float32]]


@dataclass(frozen=True)
class TrainSettings:
    """Hyper-parameters of the optimisation; the coordinator owns them, workers get a copy."""

    global_batch: int = 16  # samples per step, whatever the number of workers
    seq_len: int = 64
    lr: float = recipe.LR  # the commands' default: one recipe (foundry.model.train.recipe)
    warmup_steps: int = 20
    total_steps: int = 1000  # the cosine schedule's length
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    data_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len", "total_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


class Stopped(Exception):
    """A round of local steps was asked to stop between two inner steps."""


@dataclass
class GradientResult:
    grads: Params  # mean over the samples, canonical order
    n_samples: int
    loss: float  # mean cross-entropy over the samples
    aux_loss: float


def compute_gradients(
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
    """Mean gradient over global samples ``[start, start + count)``, ``micro_batch`` at a time.

    Micro-batch gradients are averaged weighted by their sizes, so the result does not depend
    on ``micro_batch`` beyond float rounding (gradient accumulation).
    """
    if count <= 0:
        raise ValueError(f"count must be positive, got {count}")
    micro_batch = max(1, micro_batch)
    total: Params | None = None
    loss_sum = 0.0
    aux_sum = 0.0
    for off in range(0, count, micro_batch):
        n = min(micro_batch, count - off)
        tokens, targets = corpus.sample_batch(start + off, n, seq_len, seed=data_seed)
        _, stats, grads = loss_and_grads(params, cfg, tokens, targets, aux_loss_coef=aux_loss_coef)
        w = np.float32(n / count)
        if total is None:
            total = {k: w * g for k, g in grads.items()}
        else:
            for k, g in grads.items():
                total[k] += w * g
        loss_sum += float(stats["ce_loss"]) * n
        aux_sum += float(stats["aux_loss"]) * n
    assert total is not None
    return GradientResult(total, count, loss_sum / count, aux_sum / count)


@dataclass
class Trainer:
    """Weights, optimizer state, global step and data position: the state a checkpoint holds."""

    cfg: ModelConfig
    settings: TrainSettings
    params: Params
    optimizer: AdamW = field(init=False)
    step: int = 0
    position: int = 0  # next global sample index

    def __post_init__(self) -> None:
        self.optimizer = AdamW(self.params, weight_decay=self.settings.weight_decay)

    def learning_rate(self) -> float:
        s = self.settings
        return lr_schedule(self.step, s.lr, s.warmup_steps, s.total_steps, s.min_lr_ratio)

    def apply(self, grads: Params) -> float:
        """Clip, take one AdamW step at the schedule's rate, advance step and data position.

        Returns the gradient norm before clipping.
        """
        norm = clip_grad_norm(grads, self.settings.grad_clip)
        self.optimizer.step(self.params, grads, lr=self.learning_rate())
        self.step += 1
        self.position += self.settings.global_batch
        return norm

    def host_params(self) -> Params:
        """The weights (the trainer's own arrays)."""
        return self.params

    def optimizer_state(self) -> AdamWState:
        return self.optimizer.state_dict()

    def load(self, params: Params, state: AdamWState, step: int, position: int) -> None:
        """Take over a checkpoint's weights, moments, step and data position."""
        self.params = params
        self.optimizer.load_state_dict(state)
        self.step, self.position = step, position

    def evaluate_loss(
        self, corpus: Corpus, seq_len: int, max_batches: int | None = None, batch_size: int = 8
    ) -> float:
        return evaluate_loss(self.params, self.cfg, corpus, seq_len, max_batches, batch_size)

    def train_step(self, corpus: Corpus, micro_batch: int | None = None) -> GradientResult:
        """Single-process step over the same global batch the swarm would use."""
        s = self.settings
        result = compute_gradients(
            self.params,
            self.cfg,
            corpus,
            self.position,
            s.global_batch,
            seq_len=s.seq_len,
            micro_batch=micro_batch or s.global_batch,
            aux_loss_coef=s.aux_loss_coef,
            data_seed=s.data_seed,
        )
        self.apply(result.grads)
        return result


def evaluate_loss(
    params: Params,
    cfg: ModelConfig,
    corpus: Corpus,
    seq_len: int,
    max_batches: int | None = None,
    batch_size: int = 8,
) -> float:
    """Mean cross-entropy, in nats, of the byte targets of the held-out blocks (the same
    batches every call; all of ``Corpus.validation_blocks`` unless ``max_batches`` stops
    early). A byte token is one byte of text, so this is nats per byte: ``bits_per_byte``
    turns it into what a compressor's output is measured in."""
    total, n = 0.0, 0
    for tokens, targets in corpus.validation_batches(seq_len, batch_size, max_batches):
        logits, _ = forward(params, cfg, tokens)  # (B, T, V)
        z = logits - logits.max(axis=-1, keepdims=True)  # (B, T, V)
        log_total = np.log(np.exp(z).sum(axis=-1))  # (B, T)
        nll = log_total - np.take_along_axis(z, targets[..., None], axis=-1)[..., 0]  # (B, T)
        is_byte = targets >= N_SPECIAL_TOKENS  # (B, T): BOS targets are no byte of text
        total += float(nll[is_byte].sum(dtype=np.float64))
        n += int(is_byte.sum())
    return total / n if n else float("nan")


def bits_per_byte(nats_per_byte: float) -> float:
    """A validation loss (nats per byte) in bits per byte."""
    return nats_per_byte / math.log(2)


def against_compressors(bpb: float, yardstick: Mapping[str, float]) -> str:
    """``bpb`` next to what each compressor of ``yardstick`` (name -> bits per byte, from
    ``data.compressor_bits_per_byte`` and ``data.primed_bits_per_byte`` on the same held-out
    bytes) achieves: ``"1.912 bits/byte: 41% below gzip -9 (3.252), 33% above xz -9e primed
    (1.434)"``."""
    parts = [
        f"{abs(100 * (1 - bpb / ref)):.0f}% {'below' if bpb < ref else 'above'} {name} ({ref:.3f})"
        for name, ref in yardstick.items()
    ]
    return f"{bpb:.3f} bits/byte: " + ", ".join(parts)


def beaten_line(bpb: float, yardstick: Mapping[str, float]) -> str:
    """Which compressors of ``yardstick`` the model beats and which it does not, plainly."""
    beats = [name for name, ref in yardstick.items() if bpb < ref]
    not_beaten = [name for name, ref in yardstick.items() if bpb >= ref]
    if not not_beaten:
        return "the model beats every compressor here: " + ", ".join(beats)
    return (
        ("the model beats " + ", ".join(beats) if beats else "the model beats none of them")
        + "; it does not beat "
        + ", ".join(not_beaten)
        + " (on the default corpus `foundry up --long` narrows the gap; beyond its steps the "
        "model overfits)"
    )


def held_out_line(n_bytes: int, yardstick: Mapping[str, float]) -> str:
    """What validation scores and what the compressors make of the same bytes, in one line."""
    return (
        f"validation: {n_bytes:,} held-out bytes (every {HOLDOUT_EVERY}th block of the corpus); "
        + ", ".join(f"{name} {bpb:.3f}" for name, bpb in yardstick.items())
        + " bits/byte on them"
    )
