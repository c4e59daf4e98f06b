"""The model's shape: one frozen config, named presets, and the ordered parameter table.

Parameter names are llama.cpp's GGUF tensor names (``blk.N.attn_q.weight`` ...), so the same
name travels in FDTC tensor metadata, in checkpoints and in GGUF files. Every weight matrix is
stored numpy-style as (out, in); merged experts are (E, n_ff, n_embd) for gate/up and
(E, n_embd, n_ff) for down, as docs/decisions.md, D1 fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Byte-level tokenizer: <unk>, <s>, </s>, then one token per byte value.
N_SPECIAL_TOKENS = 3
N_BYTE_TOKENS = 256
VOCAB_SIZE = N_SPECIAL_TOKENS + N_BYTE_TOKENS
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


class ConfigError(ValueError):
    """A config whose numbers cannot describe a model (names the field and the value)."""


@dataclass(frozen=True)
class ModelConfig:
    n_vocab: int = VOCAB_SIZE
    n_ctx: int = 256  # longest sequence the KV cache and RoPE serve
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2  # grouped-query: query head h reads kv head h // (n_head / n_head_kv)
    n_ff: int = 128  # routed expert intermediate size
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_shared: int = 0  # shared expert intermediate size; 0 = no shared expert
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "n_ff_shared":
                if value < 0:
                    raise ConfigError(f"n_ff_shared must be >= 0, got {value}")
            elif value <= 0:
                raise ConfigError(f"{f.name} must be positive, got {value}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for rotary embedding")
        if self.n_head % self.n_head_kv:
            raise ConfigError(
                f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}"
            )
        if self.n_expert_used > self.n_expert:
            raise ConfigError(
                f"n_expert_used {self.n_expert_used} exceeds n_expert {self.n_expert}"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter, in the one canonical order (FDTC, checkpoints and GGUF use it)."""
        d, kv, ff, e = self.n_embd, self.n_embd_kv, self.n_ff, self.n_expert
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.n_vocab, d)}
        for i in range(self.n_layer):
            b = f"blk.{i}."
            shapes[b + "attn_norm.weight"] = (d,)
            shapes[b + "attn_q.weight"] = (d, d)
            shapes[b + "attn_k.weight"] = (kv, d)
            shapes[b + "attn_v.weight"] = (kv, d)
            shapes[b + "attn_output.weight"] = (d, d)
            shapes[b + "ffn_norm.weight"] = (d,)
            shapes[b + "ffn_gate_inp.weight"] = (e, d)
            shapes[b + "ffn_gate_exps.weight"] = (e, ff, d)
            shapes[b + "ffn_up_exps.weight"] = (e, ff, d)
            shapes[b + "ffn_down_exps.weight"] = (e, d, ff)
            if self.n_ff_shared:
                shapes[b + "ffn_gate_shexp.weight"] = (self.n_ff_shared, d)
                shapes[b + "ffn_up_shexp.weight"] = (self.n_ff_shared, d)
                shapes[b + "ffn_down_shexp.weight"] = (d, self.n_ff_shared)
        shapes["output_norm.weight"] = (d,)
        shapes["output.weight"] = (self.n_vocab, d)
        return shapes

    def n_params(self) -> int:
        total = 0
        for shape in self.param_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total


PRESETS: dict[str, ModelConfig] = {
    # Tests and the CI demo: trains in seconds on one core.
    "tiny": ModelConfig(),
    # The local demo: small enough for a laptop, big enough to learn some text.
    "small": ModelConfig(
        n_ctx=256,
        n_embd=128,
        n_layer=4,
        n_head=8,
        n_head_kv=4,
        n_ff=256,
        n_expert=8,
        n_expert_used=2,
    ),
    # A model worth a GPU (docs/gpu.md): 126M parameters, 23M of them active per token;
    # 0.5 GB of f32 weights. A GPU worker trains it; a CPU worker can join but is slow.
    "medium": ModelConfig(
        n_ctx=512,
        n_embd=768,
        n_layer=8,
        n_head=12,
        n_head_kv=4,
        n_ff=768,
        n_expert=8,
        n_expert_used=2,
    ),
    # Benchmarks: ~1.7 GB of f32 weights, so decode is bound by memory bandwidth.
    "bench": ModelConfig(
        n_ctx=512,
        n_embd=1024,
        n_layer=8,
        n_head=16,
        n_head_kv=8,
        n_ff=2048,
        n_expert=8,
        n_expert_used=2,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}"
        ) from None
