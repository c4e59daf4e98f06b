"""Training on PyTorch (a CUDA GPU, or the CPU for tests): ``backend.Backend`` and the
single-process trainer of ``foundry train --device cuda``.

What crosses between host and device, per round of a worker:

- down: the held weights, once (the worker's numpy arrays, as the coordinator's UPDATE left
  them), and each step's token batch;
- up: the gradient (``--sync-every 1``) or pseudo-gradient (above 1), once, as one float32
  buffer copied in one transfer and cut into per-tensor views: exactly what
  ``training.compute_gradients`` returns, so the codecs and the wire see no difference.

Micro-batches: the numpy engine splits a slice into the coordinator's micro-batch to bound its
memory; a GPU's is large, so this backend runs the whole slice at once up to
``max_micro_batch`` sequences (the mean gradient is the same up to rounding). Inner AdamW
steps run on the device with ``torch.optim.AdamW`` (the same update as ``optim.AdamW``:
decoupled decay on matrices only, beta2 0.95, eps 1e-8) and global-norm clipping as
``optim.clip_grad_norm``; the optimizer's moments stay on the device across rounds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from foundry.model.nn import torch_model as TM
from foundry.model.spec.config import N_SPECIAL_TOKENS, ModelConfig
from foundry.model.text.data import Corpus
from foundry.model.train.optim import AdamWState, lr_schedule
from foundry.model.train.training import GradientResult, Params, Stopped, TrainSettings

F32 = npt.NDArray[np.float32]


def host_copy(tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor | None = None) -> Params:
    """Tensors to float32 numpy arrays through one flat buffer: one device-to-host transfer
    (and one synchronisation) instead of one per tensor; the arrays are views of it.
    ``buffer``, a flat float32 host tensor at least that long (page-locked: ``TorchBackend``'s),
    is that buffer instead of a new one."""
    names = list(tensors)
    on_device = torch.cat([tensors[n].detach().reshape(-1).float() for n in names])
    if buffer is None:
        flat = on_device.cpu().numpy()
    else:
        flat = buffer[: on_device.numel()].copy_(on_device).numpy()
    out: Params = {}
    at = 0
    for n in names:
        size = tensors[n].numel()
        out[n] = flat[at : at + size].reshape(tuple(tensors[n].shape))
        at += size
    return out


@dataclass
class TorchInner:
    """The inner optimizer of local rounds on the device: the parameters it steps (refilled
    from each round's start weights) and torch's AdamW over them."""

    params: dict[str, torch.Tensor]
    optimizer: torch.optim.AdamW
    steps: int = 0


class TorchBackend:
    """``backend.Backend`` on a torch device; ``bf16`` runs the products under autocast.

    With ``host_buffers`` (the default on CUDA) a round's weights go down and its result comes
    up through two host buffers of the model's size, used in turn and page-locked on CUDA: the
    DMA engine reads and writes them at the bus's speed, where pageable memory is staged by
    the driver, and no round allocates (and page-faults) a model-sized array.
    A result's arrays are views of one of them, so they hold until the call after next (a
    worker has encoded and sent a round's before its next one ends). ``last_phases`` is the
    seconds of the last call's ``down`` (weights to the device), ``steps`` and ``up``.
    """

    def __init__(
        self,
        device: str = "cuda",
        *,
        bf16: bool = False,
        max_micro_batch: int = 256,
        host_buffers: bool | None = None,
    ):
        self.device = torch.device(device)
        self.bf16 = bf16
        self.max_micro_batch = max_micro_batch
        cuda = self.device.type == "cuda"
        self.host_buffers = cuda if host_buffers is None else host_buffers
        self.name = f"torch:{self.device.type}" + ("+bf16" if bf16 else "")
        self.last_phases: dict[str, float] = {}
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    def _buffer(self, numel: int) -> torch.Tensor | None:
        """This call's host buffer (the other holds the previous call's result)."""
        if not self.host_buffers:
            return None
        self._turn ^= 1
        if len(self._buffers) < 2 or self._buffers[self._turn].numel() < numel:
            self._buffers = [
                torch.empty(numel, dtype=torch.float32, pin_memory=self.device.type == "cuda")
                for _ in range(2)
            ]
        return self._buffers[self._turn]

    def _load(
        self, dst: Mapping[str, torch.Tensor], src: Params, buffer: torch.Tensor | None
    ) -> None:
        """Each device tensor of ``dst`` set to ``src``'s array of its name; through
        ``buffer`` when there is one."""
        with torch.no_grad():
            if buffer is None:
                for name, t in dst.items():
                    t.copy_(TM.host_tensor(src[name]))
                return
            host = buffer.numpy()
            at = 0
            for name, t in dst.items():
                n = t.numel()
                np.copyto(host[at : at + n].reshape(tuple(t.shape)), src[name])
                t.copy_(buffer[at : at + n].view(t.shape), non_blocking=True)
                at += n
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # before the buffer is written again

    # --- helpers ---------------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def batches(
        self, corpus: Corpus, start: int, count: int, seq_len: int, data_seed: int
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(n, tokens, targets) of global samples [start, start + count) on the device."""
        step = max(1, self.max_micro_batch)
        for off in range(0, count, step):
            n = min(step, count - off)
            tok, tgt = corpus.sample_batch(start + off, n, seq_len, seed=data_seed)
            yield (
                n,
                torch.from_numpy(tok.astype(np.int64)).to(self.device, non_blocking=True),
                torch.from_numpy(tgt.astype(np.int64)).to(self.device, non_blocking=True),
            )

    def accumulate(
        self,
        params: Mapping[str, torch.Tensor],
        cfg: ModelConfig,
        corpus: Corpus,
        start: int,
        count: int,
        *,
        seq_len: int,
        aux_loss_coef: float,
        data_seed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Backward of the mean loss over the samples into ``params``' .grad (added to what
        is there); returns the summed (ce, aux) times samples, still on the device."""
        ce_sum = torch.zeros((), device=self.device)
        aux_sum = torch.zeros((), device=self.device)
        for n, tok, tgt in self.batches(corpus, start, count, seq_len, data_seed):
            with self.autocast():
                total, ce, aux = TM.loss(params, cfg, tok, tgt, aux_loss_coef)
            torch.autograd.backward(total * (n / count))
            ce_sum += ce.detach() * n
            aux_sum += aux.detach() * n
        return ce_sum, aux_sum

    # --- Backend ---------------------------------------------------------------------------

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
        """``training.compute_gradients`` on the device: the weights go down, the gradient
        comes back in one transfer."""
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        t0 = time.perf_counter()
        dev = TM.to_device(params, self.device, requires_grad=True)
        t1 = time.perf_counter()
        ce, aux = self.accumulate(
            dev,
            cfg,
            corpus,
            start,
            count,
            seq_len=seq_len,
            aux_loss_coef=aux_loss_coef,
            data_seed=data_seed,
        )
        loss, aux_loss = float(ce) / count, float(aux) / count  # waits for the device
        t2 = time.perf_counter()
        grads = host_copy(
            {k: _grad(t) for k, t in dev.items()},
            self._buffer(sum(t.numel() for t in dev.values())),
        )
        self.last_phases = {"down": t1 - t0, "steps": t2 - t1, "up": time.perf_counter() - t2}
        return GradientResult(grads, count, loss, aux_loss)

    def evaluate_loss(
        self,
        params: Params,
        cfg: ModelConfig,
        corpus: Corpus,
        seq_len: int,
        max_batches: int | None = None,
        batch_size: int = 8,
    ) -> float:
        """``training.evaluate_loss`` of host ``params`` on this device."""
        return _evaluate(
            self, TM.to_device(params, self.device), cfg, corpus, seq_len, max_batches, batch_size
        )

    def make_inner(self, params: Params, weight_decay: float) -> TorchInner:
        dev = TM.to_device(params, self.device, requires_grad=True)
        return TorchInner(dev, adamw(dev, weight_decay, self.device))

    def local_steps(
        self,
        start: Params,
        inner: TorchInner,
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
        """``NumpyBackend.local_steps`` on the device: the start weights go down once, the
        pseudo-gradient ``start - end`` comes back once."""
        p = inner.params
        t0 = time.perf_counter()
        buffer = self._buffer(sum(t.numel() for t in p.values()))
        self._load(p, start, buffer)
        with torch.no_grad():
            first = {k: t.clone() for k, t in p.items()}
        t1 = time.perf_counter()
        ce = torch.zeros((), device=self.device)
        aux = torch.zeros((), device=self.device)
        b = samples_per_step
        for k in range(steps):
            if stop is not None and stop():
                raise Stopped(f"stopped after {k} of {steps} inner steps")
            inner.optimizer.zero_grad(set_to_none=True)
            c, a = self.accumulate(
                p,
                cfg,
                corpus,
                sample_offset + k * b,
                b,
                seq_len=seq_len,
                aux_loss_coef=aux_loss_coef,
            )
            torch.nn.utils.clip_grad_norm_(list(p.values()), grad_clip)
            for group in inner.optimizer.param_groups:
                group["lr"] = lr_at(global_step + k)
            inner.optimizer.step()
            inner.steps += 1
            ce += c / b
            aux += a / b
        loss, aux_loss = float(ce) / steps, float(aux) / steps  # waits for the device
        t2 = time.perf_counter()
        with torch.no_grad():
            pseudo = host_copy({k: first[k] - t for k, t in p.items()}, buffer)
        self.last_phases = {"down": t1 - t0, "steps": t2 - t1, "up": time.perf_counter() - t2}
        return GradientResult(pseudo, steps * b, loss, aux_loss)


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def adamw(
    params: Mapping[str, torch.Tensor], weight_decay: float, device: torch.device, lr: float = 1e-3
) -> torch.optim.AdamW:
    """torch's AdamW as ``optim.AdamW`` is set: decay on matrices only, betas (0.9, 0.95),
    eps 1e-8; fused on CUDA."""
    decayed = [t for t in params.values() if t.ndim >= 2]  # as optim.decays
    plain = [t for t in params.values() if t.ndim < 2]
    groups = [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda"
    )


@dataclass
class TorchTrainer:
    """``training.Trainer`` with the weights and moments on the device: what ``foundry train
    --device cuda`` runs. ``host_params``/``optimizer_state`` give the numpy forms that
    checkpoints, validation on the CPU and GGUF export take."""

    cfg: ModelConfig
    settings: TrainSettings
    backend: TorchBackend
    params: dict[str, torch.Tensor]
    step: int = 0
    position: int = 0
    optimizer: torch.optim.AdamW = field(init=False)

    def __post_init__(self) -> None:
        self.optimizer = adamw(self.params, self.settings.weight_decay, self.backend.device)

    @classmethod
    def from_numpy(
        cls, cfg: ModelConfig, settings: TrainSettings, backend: TorchBackend, params: Params
    ) -> TorchTrainer:
        return cls(cfg, settings, backend, TM.to_device(params, backend.device, requires_grad=True))

    def learning_rate(self) -> float:
        s = self.settings
        return lr_schedule(self.step, s.lr, s.warmup_steps, s.total_steps, s.min_lr_ratio)

    def train_step(self, corpus: Corpus, micro_batch: int | None = None) -> GradientResult:
        """One global batch: gradient, clip, AdamW, on the device. The result's grads are
        empty (they never leave the device here); its loss is the batch's."""
        s = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        ce, aux = self.backend.accumulate(
            self.params,
            self.cfg,
            corpus,
            self.position,
            s.global_batch,
            seq_len=s.seq_len,
            aux_loss_coef=s.aux_loss_coef,
            data_seed=s.data_seed,
        )
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), s.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        self.optimizer.step()
        self.step += 1
        self.position += s.global_batch
        n = s.global_batch
        return GradientResult({}, n, float(ce) / n, float(aux) / n)

    def host_params(self) -> Params:
        return host_copy(self.params)

    def optimizer_state(self) -> AdamWState:
        return adamw_state(self.params, self.optimizer)

    def load(self, params: Params, state: AdamWState, step: int, position: int) -> None:
        """Take over a checkpoint's weights, moments and position."""
        load_adamw(self.params, self.optimizer, params, state)
        self.step, self.position = step, position

    def evaluate_loss(
        self, corpus: Corpus, seq_len: int, max_batches: int | None = None, batch_size: int = 8
    ) -> float:
        """``training.evaluate_loss`` on the device (nats per byte of the held-out text)."""
        return _evaluate(
            self.backend, self.params, self.cfg, corpus, seq_len, max_batches, batch_size
        )


def _evaluate(
    backend: TorchBackend,
    params: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    corpus: Corpus,
    seq_len: int,
    max_batches: int | None,
    batch_size: int,
) -> float:
    total = torch.zeros((), dtype=torch.float64, device=backend.device)
    n = 0
    with torch.no_grad():
        for tok, tgt in corpus.validation_batches(seq_len, batch_size, max_batches):
            t = torch.from_numpy(tok.astype(np.int64)).to(backend.device)
            y = torch.from_numpy(tgt.astype(np.int64)).to(backend.device)
            with backend.autocast():
                logits, _ = TM.forward(params, cfg, t)
            nll = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"
            )
            is_byte = y.reshape(-1) >= N_SPECIAL_TOKENS
            total += nll[is_byte].double().sum()
            n += int(is_byte.sum())
    return float(total) / n if n else float("nan")


def adamw_state(params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> AdamWState:
    """torch AdamW's moments of ``params`` as ``optim.AdamW.state_dict`` holds them (what a
    checkpoint stores; zeros before a step)."""
    m: dict[str, F32] = {}
    v: dict[str, F32] = {}
    step = 0
    for name, t in params.items():
        st = optimizer.state.get(t, {})
        m[name] = _host(st.get("exp_avg"), t)
        v[name] = _host(st.get("exp_avg_sq"), t)
        if "step" in st:
            step = int(st["step"])
    return {"step": step, "m": m, "v": v}


def load_adamw(
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    values: Params,
    state: AdamWState,
) -> None:
    """``params`` set to a checkpoint's ``values`` and torch AdamW's moments to its ``state``
    (``adamw_state``'s inverse)."""
    with torch.no_grad():
        for name, t in params.items():
            t.copy_(TM.host_tensor(values[name]))
            if state["step"] > 0:
                optimizer.state[t] = {
                    "step": torch.tensor(float(state["step"]), device=_step_device(t)),
                    "exp_avg": torch.from_numpy(np.array(state["m"][name])).to(t.device),
                    "exp_avg_sq": torch.from_numpy(np.array(state["v"][name])).to(t.device),
                }


def _step_device(t: torch.Tensor) -> torch.device:
    # fused AdamW keeps its step counter on the parameter's device; the others on the CPU
    return t.device if t.device.type == "cuda" else torch.device("cpu")


def _host(x: torch.Tensor | None, like: torch.Tensor) -> F32:
    if x is None:
        return np.zeros(tuple(like.shape), np.float32)
    return x.detach().to("cpu", torch.float32).numpy().copy()
