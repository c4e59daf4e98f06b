"""MODEL_CONFIG <-> ``ModelConfig``: the model the coordinator tells its workers to build.

The wire message (``foundry.wire.fdtc.ModelConfigMsg``) knows nothing of the model package;
this is where the two meet.
"""

from __future__ import annotations

from dataclasses import fields

from foundry.model.spec.config import ConfigError, ModelConfig
from foundry.wire.fdtc import ErrorCode, FdtcProtocolError, ModelConfigMsg

# The message's fields that are ModelConfig fields (all but aux_loss_coef, a training setting).
_SHARED = tuple(
    f.name for f in fields(ModelConfigMsg) if f.name in {g.name for g in fields(ModelConfig)}
)


def model_config_msg(cfg: ModelConfig, aux_loss_coef: float = 0.0) -> ModelConfigMsg:
    return ModelConfigMsg(
        **{name: getattr(cfg, name) for name in _SHARED}, aux_loss_coef=aux_loss_coef
    )


def config_of(msg: ModelConfigMsg) -> ModelConfig:
    """The ``ModelConfig`` ``msg`` describes; a peer's impossible model is a protocol error
    (MODEL_MISMATCH), not a crash."""
    try:
        return ModelConfig(**{name: getattr(msg, name) for name in _SHARED})
    except ConfigError as exc:
        raise FdtcProtocolError(
            f"MODEL_CONFIG describes no valid model: {exc}", ErrorCode.MODEL_MISMATCH
        ) from None
