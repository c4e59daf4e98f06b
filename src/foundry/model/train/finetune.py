"""Fine-tuning a published GGUF model on PyTorch: the architectures of ``arch.ARCHS``, frozen,
with LoRA adapters beside them (``lora``) or every tensor trained (full fine-tuning).

The forward is the inference engine's (``inference.Engine``) as a training graph, row for row
of the architecture table, so that its logits equal the engine's on the same weights (a test
per architecture):

    x = token_embd[tokens] (* sqrt(n_embd): gemma3)
    per block:  h = rmsnorm(x) * attn_norm
                q, k, v = h Wq^T (+ bq), h Wk^T (+ bk), h Wv^T (+ bv)
                QK-norm (per head, or of the whole vector: olmoe), rope (normal or NEOX, the
                layer's base, Llama 3's rope_freqs), causal attention (a sliding window on
                gemma3's local layers), o Wo^T (post_attention_norm: gemma3)
                x += that;  h = rmsnorm(x) * ffn_norm
                x += down(act(gate h) * up h) (SwiGLU or GeGLU), or the routed experts
                (softmax, top-k, renormalised or not) plus Foundry's shared expert
                (post_ffw_norm: gemma3)
    logits = rmsnorm(x) * output_norm @ (output or token_embd)^T

GeGLU's GELU is the engine's (ggml's float16 table) in the forward, and the tanh GELU's
derivative in the backward. A LoRA target projection adds ``scale * dropout(h) A^T B^T``.

The base's tensors are dequantized once at load and held as float32 on the device, frozen
(``requires_grad`` off): a 270M file is about 1.1 GB so. Routed experts always stay frozen.

``FineTuneBackend`` is what a worker computes with: the mean gradient of the *trainable*
tensors (the adapters, or the whole model) over a slice of the global batch, as float32 numpy
arrays by name: the swarm's currency. ``FineTuner`` is the single-process trainer of
``foundry train --base-model``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from foundry.model.formats import lora as LR
from foundry.model.formats.tuning import FileIdentity, file_identity, trainable_shapes
from foundry.model.kernels.quant import QTensor, dequantize
from foundry.model.nn.layers import gelu_table
from foundry.model.spec.arch import Act, QKNorm, Rope, is_swa, is_tied, rope_base
from foundry.model.spec.arch import rope_tables as arch_rope_tables
from foundry.model.spec.arch import spec as arch_spec
from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import Corpus
from foundry.model.train.optim import AdamW, AdamWState, clip_grad_norm, lr_schedule
from foundry.model.train.torch_backend import adamw, adamw_state, load_adamw
from foundry.model.train.training import GradientResult, Params, Stopped

F32 = npt.NDArray[np.float32]
Tensors = dict[str, torch.Tensor]
IGNORE = -1
"""A target that carries no loss (chat data: every token that is not the assistant's)."""


class FineTuneError(ValueError):
    """A base model or setting that cannot be fine-tuned here; the message says why."""


# -- the base model ----------------------------------------------------------------------------


Weight = torch.Tensor | QTensor
"""A frozen base tensor: float32 on the device, or (``keep_quantized``) the file's own blocks
on the host, dequantized a slice at a time where it is used."""


@dataclass
class Base:
    """A published model loaded for fine-tuning: its config, frozen weights (on ``device``,
    or held in the file's types), metadata (tokenizer, chat template) and identity."""

    path: Path
    cfg: ModelConfig
    weights: dict[str, Weight]
    metadata: dict[str, Any]
    identity: FileIdentity
    device: torch.device

    def tensor(self, name: str) -> torch.Tensor:
        """A base tensor as float32 on the device (dequantized if it is held quantized)."""
        w = self.weights[name]
        return w if isinstance(w, torch.Tensor) else _dense(w, self.device)

    def nbytes(self) -> int:
        """The memory the base's weights take as held."""
        return sum(
            w.nbytes if isinstance(w, QTensor) else w.numel() * w.element_size()
            for w in self.weights.values()
        )


def load_base(
    path: str | Path, device: str | torch.device = "cpu", *, keep_quantized: bool = False
) -> Base:
    """The file's weights as frozen float32 tensors on ``device``, its metadata and identity.
    ``keep_quantized``: every matrix stored in another type than F32 stays in it (norms and
    vectors become float32 as before): about the file's size in memory instead of 4 bytes a
    parameter, for a dequantization of each matrix, a slice at a time, in every forward and
    backward (``matmul_t``)."""
    from foundry.model.formats.gguf_io import load_gguf_stored

    p = Path(path)
    loaded = load_gguf_stored(p)
    dev = torch.device(device)
    weights: dict[str, Weight] = {}
    for name in list(loaded.params):
        stored = loaded.params.pop(name)
        if keep_quantized and isinstance(stored, QTensor) and stored.ndim >= 2:
            weights[name] = stored
        else:
            weights[name] = torch.from_numpy(
                np.ascontiguousarray(dequantize(stored), np.float32)
            ).to(dev)
    return Base(p, loaded.cfg, weights, loaded.metadata, file_identity(p), dev)


def initial_trainable(base: Base, spec: LR.LoraSpec | None, seed: int = 0) -> Params:
    """The trainable tensors before the first step: fresh adapters, or the base's own."""
    if spec is not None:
        return LR.init_adapters(base.cfg, spec, seed)
    return {n: base.tensor(n).cpu().numpy().copy() for n in trainable_shapes(base.cfg, None)}


# -- a base held quantized -----------------------------------------------------------------------

# Values of a matrix dequantized at once (16 MB of float32): Gemma 3's 262,144 x 640 head is
# 168M values, which dequantized whole would take 671 MB for each product.
SLICE_VALUES = 1 << 22


def _dense(w: QTensor, device: torch.device, rows: slice | None = None) -> torch.Tensor:
    """Rows ``rows`` (all by default) of a held-quantized matrix as float32 on ``device``."""
    part = w if rows is None else w.take((rows, *(slice(None),) * (w.ndim - 1)))
    return torch.from_numpy(part.dequantize()).to(device)


def _row_slices(w: QTensor) -> list[slice]:
    step = max(1, SLICE_VALUES // max(1, math.prod(w.shape[1:])))
    return [slice(r, min(r + step, w.shape[0])) for r in range(0, w.shape[0], step)]


class _QuantMatmul(torch.autograd.Function):
    """y = x W^T for a frozen W held quantized, out (rows) x in: W is dequantized a slice of
    rows at a time, in the forward for y's columns and again in the backward for dx = dy W
    (the base is frozen: W has no gradient), so no step holds more of it than a slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: QTensor) -> torch.Tensor:
        ctx.w = w
        return torch.cat([x @ _dense(w, x.device, r).T for r in _row_slices(w)], dim=-1)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        w: QTensor = ctx.w
        dx = None
        for r in _row_slices(w):
            part = dy[..., r] @ _dense(w, dy.device, r)  # (..., in)
            dx = part if dx is None else dx + part
        assert dx is not None
        return dx, None


def matmul_t(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x @ w.T, for a float32 tensor or a matrix held quantized."""
    if isinstance(w, torch.Tensor):
        return x @ w.T
    out: torch.Tensor = _QuantMatmul.apply(x, w)  # type: ignore[no-untyped-call]
    return out


def embed(w: Weight, tokens: torch.Tensor) -> torch.Tensor:
    """Rows ``tokens`` (B, T) of the embedding table: (B, T, D)."""
    if isinstance(w, torch.Tensor):
        return w[tokens]
    rows = w.rows(tokens.reshape(-1).cpu().numpy())  # (B*T, D)
    return torch.from_numpy(rows).to(tokens.device).reshape(*tokens.shape, -1)


# -- the forward ---------------------------------------------------------------------------------


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * w over the last axis."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # (..., D)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x (B, T, heads, Dh) turned by cos, sin (T, Dh/2): adjacent pairs, or NEOX's halves."""
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, Dh/2)
    if neox:
        half = x.shape[-1] // 2
        x0, x1 = x[..., :half], x[..., half:]  # (B, T, heads, Dh/2) each
        return torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)  # (B, T, heads, Dh)
    x0, x1 = x[..., 0::2], x[..., 1::2]  # (B, T, heads, Dh/2) each
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal grouped-query attention, q (B, T, H, Dh), k, v (B, T, Hkv, Dh) -> (B, T, H, Dh);
    with ``window`` > 0 a query sees only the last ``window`` positions (itself included)."""
    t = q.shape[1]
    mask = None
    if window and window < t:
        i = torch.arange(t, device=q.device)
        d = i[:, None] - i[None, :]  # (T, T) query - key
        mask = (d >= 0) & (d < window)  # (T, T) True: attended
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),  # (B, heads, T, Dh)
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # (B, H, T, Dh)
    return o.transpose(1, 2)  # (B, T, H, Dh)


_GELU_TABLES: dict[torch.device, torch.Tensor] = {}


def gelu(g: torch.Tensor) -> torch.Tensor:
    """ggml's GELU (the tanh form looked up at the float16 nearest g, 0 below -10, g above 10)
    forward; the tanh form's derivative backward."""
    table = _GELU_TABLES.get(g.device)
    if table is None:
        table = _GELU_TABLES[g.device] = torch.from_numpy(gelu_table()).to(g.device)
    with torch.no_grad():
        bits = g.detach().to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
        looked = table[bits]
        looked = torch.where(
            g <= -10.0, torch.zeros_like(looked), torch.where(g >= 10.0, g.detach(), looked)
        )
    smooth = F.gelu(g, approximate="tanh")
    return smooth + (looked - smooth).detach()


@dataclass
class Model:
    """The forward of one base with its trainable tensors: ``spec`` None is full fine-tuning
    (``trainable`` holds base tensor names, used in place of the base's)."""

    base: Base
    spec: LR.LoraSpec | None
    _rope: dict[float, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tables(self, n_pos: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
        have = self._rope.get(base)
        if have is None or have[0].shape[0] < n_pos:
            factors = (
                self.base.tensor("rope_freqs.weight")
                if "rope_freqs.weight" in self.base.weights
                else None
            )
            cos, sin = arch_rope_tables(
                n_pos,
                self.base.cfg.head_dim,
                base,
                None if factors is None else factors.cpu().numpy(),
            )
            have = self._rope[base] = (
                torch.from_numpy(cos).to(self.base.device),
                torch.from_numpy(sin).to(self.base.device),
            )
        return have[0][:n_pos], have[1][:n_pos]

    def forward(
        self, trainable: Mapping[str, torch.Tensor], tokens: torch.Tensor, *, train: bool = False
    ) -> torch.Tensor:
        """Logits (B, T, V) of tokens (B, T)."""
        cfg, spec, base = self.base.cfg, self.spec, self.base.weights
        a = arch_spec(cfg)
        b, t = tokens.shape
        dh, h_, hkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
        eps = cfg.norm_eps
        dropout = spec.dropout if (spec is not None and train) else 0.0

        def w(name: str) -> Weight:
            return trainable[name] if spec is None and name in trainable else base[name]

        def vec(name: str) -> torch.Tensor:  # a vector: always float32
            t = w(name)
            assert isinstance(t, torch.Tensor), name
            return t

        def proj(x: torch.Tensor, name: str) -> torch.Tensor:
            y = matmul_t(x, w(name))  # (..., out)
            if spec is not None:
                la = trainable.get(name + LR.SUFFIX_A)
                if la is not None:
                    lb = trainable[name + LR.SUFFIX_B]
                    xd = F.dropout(x, dropout) if dropout else x
                    y = y + spec.scale * ((xd @ la.T) @ lb.T)  # (..., out)
            return y

        x = embed(w("token_embd.weight"), tokens)  # (B, T, D)
        if a.embed_scale:
            x = x * float(np.float32(np.sqrt(np.float32(cfg.n_embd))))
        neox = a.rope is Rope.NEOX
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            hn = rmsnorm(x, vec(p + "attn_norm.weight"), eps)  # (B, T, D)
            q, k, v = (proj(hn, p + f"attn_{c}.weight") for c in "qkv")  # (B, T, rows)
            if a.qkv_bias:
                q = q + vec(p + "attn_q.bias")
                k = k + vec(p + "attn_k.bias")
                v = v + vec(p + "attn_v.bias")
            if a.qk_norm is QKNorm.FULL:
                q = rmsnorm(q, vec(p + "attn_q_norm.weight"), eps)
                k = rmsnorm(k, vec(p + "attn_k_norm.weight"), eps)
            q = q.reshape(b, t, h_, dh)  # (B, T, H, Dh)
            k = k.reshape(b, t, hkv, dh)  # (B, T, Hkv, Dh)
            v = v.reshape(b, t, hkv, dh)  # (B, T, Hkv, Dh)
            if a.qk_norm is QKNorm.HEAD:
                q = rmsnorm(q, vec(p + "attn_q_norm.weight"), eps)
                k = rmsnorm(k, vec(p + "attn_k_norm.weight"), eps)
            cos, sin = self.tables(t, rope_base(cfg, i))  # (T, Dh/2) each
            window = cfg.sliding_window if is_swa(cfg, i) else 0  # type: ignore[attr-defined]
            o = attention(rope(q, cos, sin, neox), rope(k, cos, sin, neox), v, window)
            att = proj(o.reshape(b, t, h_ * dh), p + "attn_output.weight")  # (B, T, D)
            if a.post_norms:
                att = rmsnorm(att, vec(p + "post_attention_norm.weight"), eps)
            x = x + att
            hn = rmsnorm(x, vec(p + "ffn_norm.weight"), eps)  # (B, T, D)
            if cfg.n_expert:
                f = self._experts(hn.reshape(b * t, -1), p, w).reshape(b, t, -1)
            else:
                g, u = proj(hn, p + "ffn_gate.weight"), proj(hn, p + "ffn_up.weight")
                act = F.silu(g) if a.act is Act.SILU else gelu(g)  # (B, T, F)
                f = proj(act * u, p + "ffn_down.weight")  # (B, T, D)
            if a.post_norms:
                f = rmsnorm(f, vec(p + "post_ffw_norm.weight"), eps)
            x = x + f
        hf = rmsnorm(x, vec("output_norm.weight"), eps)  # (B, T, D)
        head = w("token_embd.weight") if is_tied(cfg) else w("output.weight")
        return matmul_t(hf, head)  # (B, T, V)

    def _experts(self, h: torch.Tensor, p: str, w: Any) -> torch.Tensor:
        """The routed experts (frozen) and Foundry's shared expert: h (N, D) -> (N, D)."""
        cfg = self.base.cfg
        a = arch_spec(cfg)
        probs = torch.softmax(matmul_t(h, w(p + "ffn_gate_inp.weight")), dim=-1)  # (N, E)
        top_p, top = torch.topk(probs, cfg.n_expert_used, dim=-1)  # (N, K)
        if a.renorm_experts:
            top_p = top_p / top_p.sum(-1, keepdim=True)
        gate, up, down = (w(p + f"ffn_{m}_exps.weight") for m in ("gate", "up", "down"))
        y = torch.zeros_like(h)  # (N, D)
        for e in range(cfg.n_expert):
            rows, slot = torch.nonzero(top == e, as_tuple=True)  # (M_e,) each
            if rows.numel() == 0:
                continue
            xe = h[rows]  # (M_e, D)
            g = matmul_t(xe, gate[e])  # (M_e, F)
            act = F.silu(g) if a.act is Act.SILU else gelu(g)
            ye = matmul_t(act * matmul_t(xe, up[e]), down[e])  # (M_e, D)
            y = y.index_add(0, rows, ye * top_p[rows, slot][:, None])
        if cfg.n_ff_shared:
            g = matmul_t(h, w(p + "ffn_gate_shexp.weight"))
            y = y + matmul_t(
                F.silu(g) * matmul_t(h, w(p + "ffn_up_shexp.weight")),
                w(p + "ffn_down_shexp.weight"),
            )
        return y

    def loss_sum(
        self,
        trainable: Mapping[str, torch.Tensor],
        tokens: torch.Tensor,
        targets: torch.Tensor,
        *,
        train: bool = False,
    ) -> tuple[torch.Tensor, int]:
        """(summed cross-entropy over the targets that count, how many count)."""
        logits = self.forward(trainable, tokens, train=train)  # (B, T, V)
        flat = targets.reshape(-1)
        nll = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=IGNORE, reduction="sum"
        )
        return nll, int((flat != IGNORE).sum())


# -- gradients and the trainer ---------------------------------------------------------------------


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
