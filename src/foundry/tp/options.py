"""The leader's options: one frozen dataclass that the leader and each of its jobs (bring-up,
engine, frontend server) read, in a module of its own so that none of them imports the leader."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from foundry.model.shard.shares import MAX_WORLD
from foundry.model.shard.table import ExpertSplit
from foundry.tp.handshake import DEFAULT_EXPERT_SPLIT
from foundry.tp.link import DEFAULT_FRAME_DEADLINE_S
from foundry.tp.speculative import MAX_DRAFT, SpecMode
from foundry.transport.gates import DEFAULT_GATE_TIMEOUT_S
from foundry.wire.tp import TP_MAX_BATCH_ITEMS, SharesFrom

__all__ = ["MAX_FRONTEND_CONNECTIONS", "LeaderOptions"]

# Open frontend connections by default: the gateway needs one; room for a few replicas and
# tools.
MAX_FRONTEND_CONNECTIONS = 64


@dataclass(frozen=True)
class LeaderOptions:
    model: Path
    host: str = "0.0.0.0"
    port: int = 7090
    frontend_host: str = "127.0.0.1"
    frontend_port: int = 7091
    ctx_size: int | None = None
    max_sessions: int = 16
    queue_size: int = 64
    # Finished generations whose sessions stay open for prompts that continue them, and the
    # most token histories re-synced after a worker loss (see "Kept sessions"); 0: none.
    keep_sessions: int = 8
    prefill_chunk: int = 64
    # The most prompt tokens one pass evaluates: the next chunks of as many waiting prompts as
    # fit (MIXED_PREFILLS), beside one token of every decoding session.
    prefill_batch: int = 256
    spec_mode: SpecMode = SpecMode.FULL_PREFIX
    max_draft: int = MAX_DRAFT
    hash_check: bool = False
    # Passes ask the workers for their rows' greedy picks (ROW_TOPS) and sampled draws
    # (ROW_DRAWS), not their logits; off (--no-row-tops): every pass ships the logits (for
    # comparison).
    row_tops: bool = True
    shm: bool = True
    gate_timeout_s: float = DEFAULT_GATE_TIMEOUT_S
    control_timeout_s: float = 1.0
    handshake_timeout_s: float = 5.0
    # How the routed experts are cut (the worker must run the same: the hello checks it).
    expert_split: ExpertSplit = DEFAULT_EXPERT_SPLIT
    device: str = "cpu"  # --device: numpy here, or PyTorch on a GPU (model.infer.engines)
    lora: Path | None = None  # a LoRA adapter merged at load (every rank loads the same)
    # Security and limits (docs/guide/tls.md, TLS and limits): TLS on both listeners,
    # the frontend's connection limit, and the deadline of a frame begun on either link.
    tls: ssl.SSLContext | None = None
    frontend_max_connections: int = MAX_FRONTEND_CONNECTIONS
    frame_deadline_s: float = DEFAULT_FRAME_DEADLINE_S
    # --chat-template: a built-in's name or a Jinja file (foundry.model.text.chat.template_for).
    chat_template: str | None = None
    # --chat-content-specials: parse special-token texts in messages' content (llama.cpp's
    # way); off, a user's "<start_of_turn>" stays text (foundry.model.text.chat.chat_prompt).
    chat_content_specials: bool = False
    # A chat request's most messages (more is refused at once, before rendering).
    max_messages: int = 4096
    # --world-size and --shares: the ranks this leader serves with (2: the pair) and each
    # one's share of the model (None: equal; docs/tp.md, "N ranks").
    world_size: int = 2
    shares: tuple[int, ...] | None = None
    # --shares auto / ranks: the shares are chosen when every worker has stated its weight,
    # from every rank's measured speed or every rank's own --share (docs/tp.md, "Shares by
    # speed"); ``share`` is this rank's --share (ranks), ``speed`` its --speed (auto: stated
    # instead of measured).
    shares_from: SharesFrom = SharesFrom.LIST
    share: int | None = None
    speed: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_sessions", "prefill_chunk", "prefill_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("queue_size", "keep_sessions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_sessions > TP_MAX_BATCH_ITEMS:  # one EVAL_BATCH carries every session
            raise ValueError(
                f"max_sessions must be <= {TP_MAX_BATCH_ITEMS}, got {self.max_sessions}"
            )
        if not 0 <= self.max_draft <= MAX_DRAFT:
            raise ValueError(f"max_draft must be in [0, {MAX_DRAFT}], got {self.max_draft}")
        if not 2 <= self.world_size <= MAX_WORLD:
            raise ValueError(f"world_size must be in [2, {MAX_WORLD}], got {self.world_size}")
        if self.shares_from is not SharesFrom.LIST and self.shares is not None:
            raise ValueError("give --shares a list or 'auto' or 'ranks', not both")
        if self.share is not None and self.shares_from is not SharesFrom.SHARE:
            raise ValueError(
                "the leader's --share goes with --shares ranks (each rank states "
                "its own); with a list, rank 0's share is its first entry"
            )
        if self.speed is not None and self.shares_from is not SharesFrom.SPEED:
            raise ValueError(
                "--speed goes with --shares auto (it states the speed that would be measured)"
            )
