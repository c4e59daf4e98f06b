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

A worker's gradients and the one-process trainer over this graph are ``finetune_backend``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
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
from foundry.model.train.training import Params

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
