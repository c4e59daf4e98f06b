"""Model architectures as data: what one engine needs to know to run a GGUF file's graph.

An :class:`Arch` is a row of a table, not a copy of the decode loop: the engine
(``foundry.model.infer.inference``) reads its fields (norm placement, activation, QK-norm, rope
variant, sliding window, embedding scale, tied output, experts) and the loader
(``foundry.model.formats.gguf_model``) reads its metadata keys. Each row follows llama.cpp's
graph for the architecture (``src/models/<name>.cpp`` and ``src/llama-model.cpp`` in its source):

- ``llama``: pre-norm, SwiGLU, normal rope; dense FFN, or routed experts as Mixtral (softmax
  over the experts, top-k, weights renormalized), with Foundry's optional shared expert.
- ``qwen2``: as dense llama with biases on Q, K and V; NEOX rope.
- ``qwen3``: QK-norm (RMSNorm of every head of Q and K before the rotation); NEOX rope.
- ``qwen3moe``: qwen3's attention with routed experts (``expert_feed_forward_length``).
- ``gemma3``: embeddings scaled by sqrt(n_embd), QK-norm, norms before and after attention and
  FFN, GeGLU (tanh GELU, looked up as ggml does through float16), NEOX rope, sliding-window
  layers (five of every six, window ``attention.sliding_window``) with their own rope base
  (``rope.freq_base_swa``, 10,000 by default).
- ``olmoe``: routed experts whose top-k weights are not renormalized, QK-norm over the whole
  Q and K vectors (not per head); NEOX rope.

:class:`ArchConfig` extends :class:`~foundry.model.spec.config.ModelConfig` with the
hyper-parameters these need (architecture, head size, dense FFN, tied output, sliding window);
the training side keeps using plain ``ModelConfig`` (our own files load as one, unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import numpy.typing as npt

from foundry.model.spec.config import ConfigError, ModelConfig

F32 = npt.NDArray[np.float32]


class Rope(Enum):
    NORMAL = "normal"  # pairs (x[2i], x[2i+1]) turn together
    NEOX = "neox"  # pairs (x[i], x[i + Dh/2])


class QKNorm(Enum):
    NONE = "none"
    HEAD = "head"  # RMSNorm of each head's Dh values, weight (Dh,)
    FULL = "full"  # RMSNorm of the whole Q (H*Dh) and K (Hkv*Dh) vectors


class Act(Enum):
    SILU = "silu"  # SwiGLU: silu(gate) * up
    GELU = "gelu"  # GeGLU: gelu_tanh(gate) * up


class Ffn(Enum):
    DENSE = "dense"
    MOE = "moe"
    EITHER = "either"  # dense when the file has no expert_count (llama)


@dataclass(frozen=True)
class Arch:
    name: str
    ffn: Ffn
    act: Act = Act.SILU
    rope: Rope = Rope.NORMAL
    qk_norm: QKNorm = QKNorm.NONE
    qkv_bias: bool = False
    post_norms: bool = False  # gemma3: post_attention_norm and post_ffw_norm
    embed_scale: bool = False  # gemma3: x * sqrt(n_embd) after the lookup
    sliding_window: bool = False  # gemma3's local layers
    swa_pattern: int = 0  # every swa_pattern-th layer is global (llama.cpp's default for it)
    renorm_experts: bool = True  # top-k weights divided by their sum (llama.cpp's norm_w)
    shared_expert: bool = False  # ffn_*_shexp (Foundry's llama files)
    tied_ok: bool = True  # output.weight may be absent: token_embd is the head


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("llama", Ffn.EITHER, shared_expert=True),
        Arch("qwen2", Ffn.DENSE, rope=Rope.NEOX, qkv_bias=True),
        Arch("qwen3", Ffn.DENSE, rope=Rope.NEOX, qk_norm=QKNorm.HEAD),
        Arch("qwen3moe", Ffn.MOE, rope=Rope.NEOX, qk_norm=QKNorm.HEAD),
        Arch(
            "gemma3",
            Ffn.DENSE,
            act=Act.GELU,
            rope=Rope.NEOX,
            qk_norm=QKNorm.HEAD,
            post_norms=True,
            embed_scale=True,
            sliding_window=True,
            swa_pattern=6,
        ),
        Arch(
            "olmoe",
            Ffn.MOE,
            rope=Rope.NEOX,
            qk_norm=QKNorm.FULL,
            renorm_experts=False,
            tied_ok=False,
        ),
    )
}
"""Every architecture Foundry runs, by ``general.architecture``."""

# Largest values a file may state before anything is sized by them (issue 30: metadata is not
# taken on trust). Generous for any model a CPU can hold; the tensors' own shapes are checked
# against the config afterwards.
LIMITS: dict[str, int] = {
    "n_vocab": 1 << 22,
    "n_embd": 1 << 16,
    "n_layer": 1 << 10,
    "n_head": 1 << 10,
    "n_head_kv": 1 << 10,
    "n_ff": 1 << 18,
    "n_expert": 1 << 12,
    "n_expert_used": 1 << 12,
    "n_ff_shared": 1 << 18,
    "key_length": 1 << 12,
    "sliding_window": 1 << 24,
    "swa_pattern": 1 << 10,
    "n_ctx": 1 << 31,
}
DEFAULT_CTX_CAP = 4096
"""The context a run gets when --ctx-size is not given: the file's, at most this (as llama.cpp's
``-c`` default caps a 32k-context model to what a desktop holds)."""


@dataclass(frozen=True)
class ArchConfig(ModelConfig):
    """A published model's shape: ``ModelConfig`` plus what its architecture adds.

    ``n_expert`` 0 (with ``n_expert_used`` 0) is a dense FFN of ``n_ff``. ``key_length`` is
    the head size (0: ``n_embd / n_head``)."""

    architecture: str = "llama"
    key_length: int = 0
    tied_output: bool = False
    sliding_window: int = 0  # 0: every layer attends to the whole context
    swa_pattern: int = 0
    rope_theta_swa: float = 10000.0
    rope_freqs: bool = False  # a rope_freqs.weight tensor divides each pair's angle (Llama 3)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHS:
            raise ConfigError(f"architecture {self.architecture!r} is not supported")
        for name, top in LIMITS.items():
            value = getattr(self, name)
            if not 0 <= value <= top:
                raise ConfigError(f"{name} {value} is outside [0, {top}]")
        for name in ("n_vocab", "n_ctx", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.norm_eps > 0 or not self.rope_theta > 0 or not self.rope_theta_swa > 0:
            raise ConfigError("norm_eps and the rope bases must be positive")
        if self.key_length == 0 and self.n_embd % self.n_head:
            raise ConfigError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for rotary embedding")
        if self.n_head % self.n_head_kv:
            raise ConfigError(
                f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}"
            )
        if (self.n_expert == 0) != (self.n_expert_used == 0):
            raise ConfigError("expert_count and expert_used_count must both be 0 or both set")
        if self.n_expert_used > self.n_expert:
            raise ConfigError(
                f"n_expert_used {self.n_expert_used} exceeds n_expert {self.n_expert}"
            )
        spec = ARCHS[self.architecture]
        if spec.ffn is Ffn.DENSE and self.n_expert:
            raise ConfigError(
                f"{self.architecture} has no experts, the file states {self.n_expert}"
            )
        if spec.ffn is Ffn.MOE and not self.n_expert:
            raise ConfigError(f"{self.architecture} needs expert_count")
        if self.n_ff_shared and not spec.shared_expert:
            raise ConfigError(f"{self.architecture} has no shared expert")

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    @property
    def n_embd_q(self) -> int:
        return self.head_dim * self.n_head

    def is_swa(self, layer: int) -> bool:
        """Whether ``layer`` attends to a sliding window (llama.cpp's set_swa_pattern)."""
        if not self.sliding_window:
            return False
        return self.swa_pattern == 0 or layer % self.swa_pattern < self.swa_pattern - 1

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        spec = ARCHS[self.architecture]
        d, q, kv, ff, e = self.n_embd, self.n_embd_q, self.n_embd_kv, self.n_ff, self.n_expert
        dh = self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.n_vocab, d)}
        if self.rope_freqs:
            shapes["rope_freqs.weight"] = (dh // 2,)
        for i in range(self.n_layer):
            b = f"blk.{i}."
            shapes[b + "attn_norm.weight"] = (d,)
            shapes[b + "attn_q.weight"] = (q, d)
            shapes[b + "attn_k.weight"] = (kv, d)
            shapes[b + "attn_v.weight"] = (kv, d)
            if spec.qkv_bias:
                shapes[b + "attn_q.bias"] = (q,)
                shapes[b + "attn_k.bias"] = (kv,)
                shapes[b + "attn_v.bias"] = (kv,)
            if spec.qk_norm is QKNorm.HEAD:
                shapes[b + "attn_q_norm.weight"] = (dh,)
                shapes[b + "attn_k_norm.weight"] = (dh,)
            elif spec.qk_norm is QKNorm.FULL:
                shapes[b + "attn_q_norm.weight"] = (q,)
                shapes[b + "attn_k_norm.weight"] = (kv,)
            shapes[b + "attn_output.weight"] = (d, q)
            if spec.post_norms:
                shapes[b + "post_attention_norm.weight"] = (d,)
            shapes[b + "ffn_norm.weight"] = (d,)
            if e:
                shapes[b + "ffn_gate_inp.weight"] = (e, d)
                shapes[b + "ffn_gate_exps.weight"] = (e, ff, d)
                shapes[b + "ffn_up_exps.weight"] = (e, ff, d)
                shapes[b + "ffn_down_exps.weight"] = (e, d, ff)
            else:
                shapes[b + "ffn_gate.weight"] = (ff, d)
                shapes[b + "ffn_up.weight"] = (ff, d)
                shapes[b + "ffn_down.weight"] = (d, ff)
            if self.n_ff_shared:
                shapes[b + "ffn_gate_shexp.weight"] = (self.n_ff_shared, d)
                shapes[b + "ffn_up_shexp.weight"] = (self.n_ff_shared, d)
                shapes[b + "ffn_down_shexp.weight"] = (d, self.n_ff_shared)
            if spec.post_norms:
                shapes[b + "post_ffw_norm.weight"] = (d,)
        shapes["output_norm.weight"] = (d,)
        if not self.tied_output:
            shapes["output.weight"] = (self.n_vocab, d)
        return shapes


def spec(cfg: ModelConfig) -> Arch:
    """The architecture row of a config (a plain ModelConfig is Foundry's llama)."""
    return ARCHS[cfg.architecture] if isinstance(cfg, ArchConfig) else ARCHS["llama"]


def is_tied(cfg: ModelConfig) -> bool:
    return isinstance(cfg, ArchConfig) and cfg.tied_output


def is_swa(cfg: ModelConfig, layer: int) -> bool:
    return isinstance(cfg, ArchConfig) and cfg.is_swa(layer)


def rope_base(cfg: ModelConfig, layer: int) -> float:
    if isinstance(cfg, ArchConfig) and cfg.is_swa(layer):
        return cfg.rope_theta_swa
    return cfg.rope_theta


def rope_tables(
    n_pos: int, head_dim: int, base: float, factors: F32 | None = None
) -> tuple[F32, F32]:
    """cos and sin (n_pos, Dh/2) as ggml computes them (``ggml_rope_cache_init``): the angle
    of pair i starts at the position and is multiplied by base^(-2/Dh) once per pair, in
    float32, so the rounding is ggml's; ``factors`` (a file's ``rope_freqs``) divide pair i's
    angle."""
    scale = np.float32(np.power(np.float32(base), np.float32(-2.0 / head_dim), dtype=np.float32))
    theta = np.arange(n_pos, dtype=np.float32)  # (n_pos,)
    cos = np.empty((n_pos, head_dim // 2), np.float32)
    sin = np.empty((n_pos, head_dim // 2), np.float32)
    for i in range(head_dim // 2):
        angle = theta if factors is None else theta / factors[i]
        cos[:, i] = np.cos(angle)
        sin[:, i] = np.sin(angle)
        theta = theta * scale
    return cos, sin
