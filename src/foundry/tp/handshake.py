"""What both ranks do before any inference: load their half, state their identity, agree.

Bring-up of a pair (``docs/tp.md`` has the sequence with every frame):

1. The worker dials the leader's ``--listen`` port: the **control connection**. Each rank sends
   its hello (version, role, :class:`~foundry.wire.tp.Identity`, execution mode, shared-memory
   offer) and reads the peer's; both run :func:`~foundry.wire.tp.check_hello` on the same two
   hellos, so both log the same mismatch (field and both values) and close. A worker stops
   dialing then: a restart with the same files (and flags) cannot fix it.
2. The leader answers COMMAND_ACK: status :data:`ACK_ACCEPTED` with a random 64-bit pairing
   token in ``seq``, or :data:`ACK_BUSY` when another worker holds the pair.
3. The data plane both ranks negotiated from the hellos: shared memory (the worker attaches to
   the slab the leader named) or TCP: the worker opens a **second connection** to the same
   port whose first bytes are a COMMAND_ACK carrying the token; the token pairs it with its
   control connection and nothing else can take its place.
4. The worker sends COMMAND_ACK :data:`ACK_ACCEPTED` on the control connection when its data
   plane is up (:data:`ACK_SHM_FAILED` if the slab could not be mapped; it then dials again
   without offering shared memory). The pair is formed.

A world of N ranks (docs/protocol.md, "N ranks") follows the same steps with the hello's
world extension (:func:`world_info`) on both sides. A worker's first hello is the plain one (it
does not know the world yet); the leader's hello tells it, both sides see the worlds differ
(``WorldMismatch``) and close, and the worker dials again at once with the extension. The ACK
of step 2 gives it its rank (``session_id``), it loads its slices (:func:`load_rank`) before
step 3, and for N > 2 a WORLD frame and the gate connections between the workers come after
step 4. While the leader's shares are still to be chosen (``--shares auto`` or ``ranks``), step
2 answers a worker's weight with :data:`ACK_NOTED` instead, and it dials again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from foundry.model.formats.gguf_io import (
    block_sizes,
    load_gguf,
    load_gguf_stored,
    model_id,
    values_by_type,
)
from foundry.model.formats.lora import Adapter, base_of, check_architecture, load_adapter, merge
from foundry.model.infer.sessions import default_ctx
from foundry.model.kernels.quant import Param, QType
from foundry.model.kernels.types import TYPES
from foundry.model.shard.shares import Shares, check_splittable, norm_shares, share_blocks
from foundry.model.shard.slices import (
    RankWeights,
    check_cuts,
    kv_group_of,
    pick_expert_split,
    rank_layout,
    shard_part,
)
from foundry.model.shard.table import ExpertSplit, SplitKind, rule_for
from foundry.model.spec.arch import spec as arch_spec
from foundry.model.spec.config import ModelConfig
from foundry.tp.link import ControlLink, LinkError
from foundry.wire.tp import (
    DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT,
    Hello,
    Identity,
    WorldInfo,
    check_hello,
    max_payload_for,
)

# COMMAND_ACK status values of the bring-up (session 0).
ACK_ACCEPTED = 0
ACK_BUSY = 1  # leader -> worker: another worker holds the pair; dial again later
ACK_SHM_FAILED = 2  # worker -> leader: the slab could not be mapped; it dials again over TCP
# leader -> worker: its weight is kept under the rank in session_id; the shares are chosen
# once every worker has stated its own, and it dials again asking for that rank
ACK_NOTED = 3
WORLD = 2  # the plain pair
# A worker given its rank loads its slices before it opens its gate link: the leader waits this
# long for its data plane (a big file from a slow disk) instead of handshake_timeout_s.
LOAD_TIMEOUT_S = 600.0
# How the services cut the routed experts unless told otherwise: every expert by its intermediate
# size, so both ranks do the same work for every token (docs/tp.md, "Expert split", has the
# figures); ``--expert-split experts`` gives the contiguous halves of the experts
# (docs/decisions.md, D3).
DEFAULT_EXPERT_SPLIT = ExpertSplit.INTERMEDIATE


@dataclass(frozen=True)
class RankModel:
    """One rank's half of a model file, with the identity its hello states."""

    cfg: ModelConfig
    weights: RankWeights
    identity: Identity

    @property
    def architecture(self) -> str:
        """The file's architecture, which the hello states."""
        return arch_spec(self.cfg).name

    @property
    def execution_mode(self) -> int:
        """The hello's execution mode bits for these weights."""
        return execution_mode(self.weights.expert_split)


def execution_mode(expert_split: ExpertSplit) -> int:
    """``DS4_TP_MODE_*`` bits of an expert split (the seed's numbers)."""
    if expert_split is ExpertSplit.INTERMEDIATE:
        return DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT
    return 0


def split_of_mode(mode: int) -> ExpertSplit:
    """The expert split a hello's execution mode bits state (:func:`execution_mode`'s inverse)."""
    if mode & DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT:
        return ExpertSplit.INTERMEDIATE
    return ExpertSplit.EXPERTS


def quant_bits(values_by_type: Mapping[QType, int]) -> int:
    """The hello's weight bits: those of the type that stores most of the model's values (a
    Q4_K_M file is mostly Q4_K: 4; Q8_0: 8; f16: 16)."""
    if not values_by_type:
        raise ValueError("a model without tensors has no weight type")
    most = max(values_by_type, key=lambda t: (values_by_type[t], -int(t)))
    return TYPES[most].nominal_bits


def world_info(
    world: int, shares: Sequence[int] | None, rank: int = 0, gate_port: int = 0
) -> WorldInfo | None:
    """The hello's world extension of a world of ``world`` ranks holding ``shares``: None for
    the plain pair (two equal ranks), which sends none."""
    norm = norm_shares(world, shares)
    if world == WORLD and norm == (1, 1):
        return None
    return WorldInfo(world_size=world, shares=norm, rank=rank, gate_port=gate_port)


def world_shares(world: WorldInfo | None) -> Shares:
    """The shares a hello's world extension states (the plain pair's when it has none)."""
    return (1, 1) if world is None else world.shares


def largest_worker_block(cfg: ModelConfig, shares: Shares) -> int:
    """The most vocabulary rows one worker returns in a LOGITS row (the leader's bound)."""
    return max(share_blocks(cfg.n_vocab, shares)[1:])


def header_model(
    path: Path, ctx_size: int | None, lora: Path | None = None
) -> tuple[ModelConfig, Identity]:
    """A model file's config and hello identity (with ``lora``, the adapter's too), from its
    header alone (no weights read)."""
    cfg = load_gguf(path, select=lambda name, view: None).cfg
    ctx = default_ctx(cfg) if ctx_size is None else ctx_size
    if ctx <= 0:
        raise ValueError(f"ctx_size must be positive, got {ctx}")
    return cfg, identity_for(path, cfg, ctx, lora)


def identity_for(path: Path, cfg: ModelConfig, ctx_size: int, lora: Path | None = None) -> Identity:
    """The hello identity of a model file: its size and hash, shape, weight bits (see
    :func:`quant_bits`), context, and the gate schedule (every layer fires ATTN then FFN: 2
    gates per layer and token). With a LoRA adapter the model id is the file's XOR the
    adapter's (so both ranks must load the same adapter) and the size counts both files."""
    return Identity(
        gguf_bytes=os.path.getsize(path) + (0 if lora is None else os.path.getsize(lora)),
        model_id=model_id(path) ^ (0 if lora is None else model_id(lora)),
        n_layer=cfg.n_layer,
        n_embd=cfg.n_embd,
        n_vocab=cfg.n_vocab,
        quant_bits=quant_bits(values_by_type(path)),
        ctx_size=ctx_size,
        gate_slot_start=0,
        gate_slot_step=1,
        gates_per_token=2 * cfg.n_layer,
    )


def check_replicated(path: Path) -> None:
    """Read the tensors every rank holds whatever its rank (embeddings, norms, routers) and
    check them (a damaged file is refused with the tensor's name, ``GGUFError``), keeping
    nothing: what a worker can check before the leader tells it its rank."""
    load_gguf_stored(
        path,
        select=lambda name, view: view if rule_for(name).kind is SplitKind.REPLICATED else None,
    )


def load_rank(
    path: Path,
    rank: int,
    ctx_size: int | None = None,
    expert_split: ExpertSplit = DEFAULT_EXPERT_SPLIT,
    world: int = WORLD,
    shares: Sequence[int] | None = None,
    lora: Path | None = None,
) -> RankModel:
    """Read rank ``rank``'s slices of the GGUF file for a world of ``world`` ranks holding
    ``shares`` (default: the pair's half; its experts cut by ``expert_split``): only its
    slices are read from disk. ``lora``: a LoRA adapter file merged into the tensors it
    adapts before they are cut (those become float32)."""
    header = load_gguf(path, select=lambda name, view: None)
    cfg = header.cfg
    norm = check_splittable(cfg, world, expert_split, shares)
    adapter = None
    if lora is not None:
        adapter = load_adapter(lora)
        check_architecture(cfg, adapter, str(lora))
    adapted = set() if adapter is None else {base_of(n) for n in adapter.tensors}
    # Every rank's cuts, not only this one's: a world the file cannot take is refused before
    # any rank loads (adapted tensors are merged into float32 first, so they have no blocks).
    blocks = {n: b for n, b in block_sizes(path).items() if n not in adapted}
    check_cuts(cfg, expert_split, norm, blocks)
    layout = rank_layout(cfg, rank, world, expert_split, norm, kv_group_of(cfg, norm, blocks))

    def select(name: str, view: Param) -> Param:
        if adapter is not None and name in adapted:
            merged = merge({name: view}, adapter_pair(adapter, name), adapter.scale)[name]
            return shard_part(name, merged, layout)
        return shard_part(name, view, layout)

    loaded = load_gguf_stored(path, select=select)
    ctx = default_ctx(cfg) if ctx_size is None else ctx_size
    if ctx <= 0:
        raise ValueError(f"ctx_size must be positive, got {ctx}")
    return RankModel(
        cfg=cfg,
        weights=RankWeights(cfg, layout, loaded.params),
        identity=identity_for(path, cfg, ctx, lora),
    )


def expert_split_for(
    path: Path, world: int = WORLD, shares: Sequence[int] | None = None
) -> tuple[ExpertSplit, str]:
    """``--expert-split auto`` for this file and world (``shard.slices.pick_expert_split``):
    the split and why, for the log."""
    cfg = load_gguf(path, select=lambda name, view: None).cfg
    return pick_expert_split(cfg, norm_shares(world, shares), block_sizes(path))


def exchange_hellos(
    link: ControlLink,
    mine: Hello,
    max_rows: int,
    vocab_block: int | None = None,
    on_peer: Callable[[Hello], None] | None = None,
) -> Hello:
    """Send our hello, read the peer's, check both (IdentityMismatch / VersionMismatch name the
    field and both values; ``on_peer`` sees the peer's hello first, as it came). Afterwards
    the link's decoder accepts this model's largest frames, LOGITS of up to ``max_rows`` rows
    of ``vocab_block`` (default the larger half) among them (``wire.tp.logits_rows``)."""
    link.send(mine)
    peer = link.recv("the peer's hello")
    if not isinstance(peer, Hello):
        raise LinkError(f"expected the peer's hello, got {type(peer).__name__}")
    if on_peer is not None:
        on_peer(peer)
    check_hello(mine, peer)
    link.decoder.max_payload = max_payload_for(mine.identity, max_rows, vocab_block)
    return peer


def adapter_pair(adapter: Adapter, base: str) -> dict[str, npt.NDArray[np.float32]]:
    """The lora_a and lora_b of one base tensor."""
    return {n: adapter.tensors[n] for n in (base + ".lora_a", base + ".lora_b")}
