"""The numpy engine's sessions (``inference.Engine.new_session``): one sequence's K/V caches
(``Session``) and the type their rows are stored in (``KVCache``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt

from foundry.model.infer.sessions import SessionPositions
from foundry.model.spec.config import ModelConfig


class KVCache(Enum):
    """The type a session's K and V cache rows are stored in (``Engine(kv_cache=...)``)."""

    F16 = "f16"  # llama.cpp's default (-ctk f16 -ctv f16): half the memory, its rounding
    F32 = "f32"  # exact: what the training forward computes (tests, our own references)

    @property
    def dtype(self) -> type[np.floating[Any]]:
        return np.float16 if self is KVCache.F16 else np.float32


_session_ids = itertools.count(1)


class Session(SessionPositions):
    """One sequence being decoded: the K/V caches of the engine's kv heads, position, history.

    Create it with ``Engine.new_session``; ``k[layer][part]`` and ``v[layer][part]`` are
    (ctx_size, kv heads of the part, head_dim), position p in row p. Parts that cache the same
    kv heads (a single kv head, replicated: both halves of a world-1 engine compute it from the
    same rows, to the same bits) share one array, so the cache is held once. The arrays are of
    the engine's ``KVCache`` type (rows written as float32 are rounded to it, to nearest).
    Rows at and after ``pos`` hold whatever the memory held (never read before written).
    """

    def __init__(
        self,
        engine_id: int,
        ctx_size: int,
        kv_heads: Sequence[tuple[int, int]],
        cfg: ModelConfig,
        kv_cache: KVCache = KVCache.F16,
    ):
        self.id = next(_session_ids)
        self.engine_id = engine_id
        self.ctx_size = ctx_size
        self.pos = 0
        self.tokens: list[int] = []

        def caches() -> list[npt.NDArray[Any]]:
            held: dict[tuple[int, int], npt.NDArray[Any]] = {}
            for r in kv_heads:
                if r not in held:
                    # Not zeroed: a position is written before any read of it (attention
                    # reads [0, pos]), and zeroing Gemma 3's 36 arrays took 3.5 ms a session.
                    held[r] = np.empty((ctx_size, r[1] - r[0], cfg.head_dim), kv_cache.dtype)
            return [held[r] for r in kv_heads]

        self.k: list[list[npt.NDArray[Any]]] = [caches() for _ in range(cfg.n_layer)]
        self.v: list[list[npt.NDArray[Any]]] = [caches() for _ in range(cfg.n_layer)]
