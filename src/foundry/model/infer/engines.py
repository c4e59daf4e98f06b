"""The inference engine a process decodes with: ``inference.Engine`` (numpy, the reference)
or ``torch_engine.TorchEngine`` (PyTorch on a GPU), chosen by ``--device``.

Both answer ``InferenceEngine``: ``generate`` and the TP ranks' lockstep use nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from foundry.model.infer.inference import Engine
from foundry.model.kernels.quant import Param
from foundry.model.nn.device import DeviceError, resolve
from foundry.model.shard.slices import RankWeights
from foundry.model.shard.table import ExpertSplit, Gate
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]


class InferenceEngine(Protocol):
    """What decoding needs of an engine. Sessions are the engine's own (numpy arrays or
    device tensors for the caches), with ``pos``, ``tokens``, ``free``, ``ctx_size`` and
    ``rewind(pos)``."""

    cfg: ModelConfig
    rank: int
    world: int

    @property
    def n_vocab_out(self) -> int: ...

    def new_session(self, ctx_size: int | None = None) -> Any: ...

    def decode(
        self,
        session: Any,
        tokens: Sequence[int],
        exchange: Callable[[int, Gate, F32], F32] | None = None,
        *,
        last_only: bool = False,
    ) -> F32: ...

    def forward_rows(
        self,
        rows: Sequence[tuple[Any, Sequence[int]]],
        exchange: Callable[[int, Gate, F32], F32] | None = None,
        *,
        last_only: bool = False,
    ) -> F32: ...


def make_engine(
    cfg: ModelConfig,
    weights: Mapping[str, Param] | RankWeights,
    rank: int = 0,
    world: int = 1,
    expert_split: ExpertSplit | None = None,
    *,
    device: str = "cpu",
    ctx_size: int | None = None,
    compile_step: bool = False,
    threads: int | None = None,
    shares: Sequence[int] | None = None,
) -> InferenceEngine:
    """The engine ``--device`` names (``nn.device.DEVICES``): numpy for ``cpu``, PyTorch for
    ``cuda`` and ``torch-cpu``; ``auto`` takes the GPU when PyTorch sees one. A missing PyTorch
    or GPU raises ``nn.device.DeviceError`` saying how to get it, and so does a file of another
    architecture than Foundry's own (the PyTorch engine runs that one; ``arch``'s others run
    on numpy). ``ctx_size``: the KV cache and rope tables (default: the file's, capped).
    ``compile_step``: the PyTorch engine compiles its one-token step (ignored by numpy).
    ``threads``: the CPU threads the engine computes on (the kernels' pool, or PyTorch's
    intra-op threads; None leaves each as it is). ``shares``: the world a single numpy process
    stands for (``Engine``; None: the pair's halves); PyTorch's engine stands for none."""
    target = resolve(device)
    if target is None:
        return Engine(
            cfg,
            weights,
            rank,
            world,
            expert_split,
            ctx_size=ctx_size,
            threads=threads,
            shares=shares,
        )
    if shares is not None:
        raise DeviceError(
            f"--shares: the PyTorch engine (--device {device}) evaluates the "
            "whole model; use --device cpu"
        )
    if type(cfg) is not ModelConfig:
        raise DeviceError(
            f"--device {device}: the PyTorch engine runs Foundry's own model "
            f"files; this one is {getattr(cfg, 'architecture', type(cfg).__name__)}"
            f" (use --device cpu)"
        )
    from foundry.model.infer.torch_engine import TorchEngine

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return TorchEngine(
        cfg,
        weights,
        rank,
        world,
        expert_split,
        device=target,
        ctx_size=ctx_size,
        compile_step=compile_step,
    )
