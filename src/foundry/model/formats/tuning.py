"""What a fine-tuning swarm trains, as the swarm sees a model: ``TunedConfig``.

The coordinator and its workers know a model by its config's parameter table
(``param_shapes``): WEIGHTS_META lists it, the optimizer steps it, GRADIENTS carry it. For a
fine-tuning run that table is the *trainable* tensors of a published base (the LoRA adapters,
or every tensor but the routed experts), so a ``TunedConfig`` is a ``ModelConfig`` whose table
is those, with the base file's identity (size, SHA-256, architecture) and the LoRA settings
that BASE_MODEL carries (``wire.fdtc.BaseModel``). The base itself never enters the swarm's
state: each machine loads it from its own copy of the file (``train.finetune.load_base``).

No torch here: the wire side (coordinator, worker handshake) imports this.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from foundry.model.formats import lora as LR
from foundry.model.spec.arch import ArchConfig
from foundry.model.spec.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class FileIdentity:
    """What two machines compare to know they hold the same base file."""

    size: int
    sha256: str  # hex

    @property
    def digest(self) -> bytes:
        return bytes.fromhex(self.sha256)


def file_identity(path: str | Path) -> FileIdentity:
    h = hashlib.sha256()
    p = Path(path)
    with p.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return FileIdentity(p.stat().st_size, h.hexdigest())


def architecture_of(cfg: ModelConfig) -> str:
    return cfg.architecture if isinstance(cfg, ArchConfig) else "llama"


def trainable_shapes(cfg: ModelConfig, spec: LR.LoraSpec | None) -> dict[str, tuple[int, ...]]:
    """The tensors that train and travel: the adapters, or (full fine-tuning) every tensor of
    the model but the routed experts, in the file's order."""
    if spec is not None:
        return dict(LR.adapter_shapes(cfg, spec))
    return {n: s for n, s in cfg.param_shapes().items() if "_exps." not in n}


def targets_mask(targets: tuple[str, ...]) -> int:
    """BASE_MODEL's lora_targets: bit i for ``lora.TARGETS[i]``."""
    return sum(1 << LR.TARGETS.index(t) for t in targets)


def targets_of(mask: int) -> tuple[str, ...]:
    return tuple(t for i, t in enumerate(LR.TARGETS) if mask >> i & 1)


@dataclass(frozen=True)
class TunedConfig(ModelConfig):
    """A fine-tuning run's model as the swarm trains it: the base's identity, the LoRA settings
    (``lora_rank`` 0: full fine-tuning) and the trainable tensors' table. The inherited fields
    hold the base's sizes, for what prints them; the base's own config was checked when its
    file was read."""

    architecture: str = ""
    base_bytes: int = 0
    base_sha256: str = ""
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()
    trainable: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        if not self.trainable:
            raise ConfigError("a fine-tuning run needs trainable tensors")

    @property
    def spec(self) -> LR.LoraSpec | None:
        if not self.lora_rank:
            return None
        return LR.LoraSpec(self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_dropout)

    @property
    def identity(self) -> FileIdentity:
        return FileIdentity(self.base_bytes, self.base_sha256)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.trainable)

    def describe(self) -> str:
        how = (
            "full fine-tuning"
            if self.spec is None
            else (
                f"LoRA r={self.lora_rank} alpha={self.lora_alpha:g} on "
                f"{','.join(self.lora_targets)}"
            )
        )
        return f"{self.architecture} base ({self.base_sha256[:12]}), {how}"


def tuned_config(
    base_cfg: ModelConfig, identity: FileIdentity, spec: LR.LoraSpec | None
) -> TunedConfig:
    shapes = trainable_shapes(base_cfg, spec)
    return TunedConfig(
        n_vocab=base_cfg.n_vocab,
        n_ctx=base_cfg.n_ctx,
        n_embd=base_cfg.n_embd,
        n_layer=base_cfg.n_layer,
        n_head=base_cfg.n_head,
        n_head_kv=base_cfg.n_head_kv,
        n_ff=base_cfg.n_ff,
        n_expert=base_cfg.n_expert,
        n_expert_used=base_cfg.n_expert_used,
        architecture=architecture_of(base_cfg),
        base_bytes=identity.size,
        base_sha256=identity.sha256,
        lora_rank=0 if spec is None else spec.rank,
        lora_alpha=0.0 if spec is None else spec.alpha,
        lora_dropout=0.0 if spec is None else spec.dropout,
        lora_targets=() if spec is None else spec.targets,
        trainable=tuple(shapes.items()),
    )
