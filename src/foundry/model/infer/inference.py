"""KV-cache inference over independent sessions, one code path for one process and TP ranks.

An ``Engine`` evaluates a list of *parts*, each a ``shard.slices.RankWeights``:

- a tensor-parallel rank (world N) holds one part, its own slice (by the world's shares);
- a single process (world 1) holds every part of the split it stands for (``shares``: the two
  equal halves of a pair by default, or the N slices of a world of N ranks with those shares;
  one part with everything when the model cannot be cut so) and evaluates them one after the
  other.

Per layer each part yields an (n_rows, n_embd) partial for the ATTN gate (its heads' output
projection) and for the FFN gate (its routed experts plus its slice of the shared expert). Which
part of the routed experts a part holds is the engine's ``expert_split`` (``shard``): whole
experts (``EXPERTS``: a part evaluates only the assignments to its experts) or a block of every
expert's intermediate dimension (``INTERMEDIATE``: a part evaluates every assignment on its
block). A world-1 engine runs its parts in the same mode as the world it stands for. The
parts' partials are added in rank order (``((p0 + p1) + p2) + ...``); a rank hands its partial
to the ``GateExchange`` instead, which returns the sum over ranks added in the same order (for
two ranks either order: float addition of two numbers is commutative bit for bit). Each part
runs the same operations on the same data whichever process holds it, so the ranks' logits are
bit-identical to the single process standing for the same split (with the BLAS thread count
fixed, as BLAS sums depend on how the work is split). The grouping matters: a world-1 engine
standing for 2 ranks and one standing for 3 differ in the last bits.

Weights are float32 numpy arrays or, read by ``gguf_io.load_gguf_stored``, ``quant.QTensor`` blocks
in the file's storage type (F16, Q8_0, Q4_0, the K-quants): every product goes through
``quant.linear``, which reads the blocks in place. The kernels' dot products are deterministic
and independent of the batch, so the pair equals the single process bit for bit on quantized
files too. The rest of a step (RMSNorm, the rotation, the router, SiLU, expert grouping and
combination, attention against the cache) goes through ``quant``'s C operations under the same
rule, or the training layers' numpy where the C module is missing.

Architectures: the engine reads the config's row of ``arch.ARCHS`` (a plain ``ModelConfig`` is
Foundry's llama) and applies what it says, the same on every part: QKV biases, QK-norm (per
head, or of the whole Q and K vectors before a part keeps its heads), normal or NEOX rope with
each layer's base, a sliding window per layer, the embedding scale, post-norms (applied to the
summed gate outputs, so both ranks apply them to the same values), a dense SwiGLU/GeGLU FFN or
routed experts (top-k weights renormalized or not), and a tied output head (each part's rows of
``token_embd``, a view). Rope tables are sized by the engine's context (``ctx_size``, default
the file's, at most ``arch.DEFAULT_CTX_CAP``), never by the file's number alone.

``forward_rows`` runs a block of tokens for each of several sessions in one pass: every
projection, norm and expert works on all rows stacked; the router's product and attention run
row by row (each row against its session's cache up to its own position; a layer's cache writes
and attention of all sessions in one C call, ``quant.store_attend``), so that a row of a
block gets the bits one-row decoding gives it, whatever the block (with the block kernels, which
are batch-invariant too: speculative decoding's output is then plain greedy decoding's).
Caches are written during the pass, but positions advance only when the whole pass succeeded,
so a failed exchange leaves every session as it was (the rows written past its position are
overwritten by its next block).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from foundry.model.infer.kv_cache import KVCache, Session
from foundry.model.infer.parts import (
    cut_parts,
    experts_swiglu,
    glu,
    row_block,
    sum_partials,
    swiglu_ffn,
)
from foundry.model.infer.sessions import check_rows, default_ctx
from foundry.model.infer.step_plan import (
    DenseLayer,
    fuse,
    layer_plan,
    part_layer,
    routed_in_c,
)
from foundry.model.kernels.quant import (
    Param,
    QTensor,
    StepPlan,
    add,
    assign_experts,
    combine_experts,
    dequantize,
    embed,
    linear,
    rmsnorm,
    rope,
    route,
    set_threads,
    step_attn,
    step_ffn,
    step_layer,
    step_layers,
    store_attend,
    take_rows,
)
from foundry.model.shard.shares import norm_shares
from foundry.model.shard.slices import RankWeights
from foundry.model.shard.table import ExpertSplit, Gate
from foundry.model.spec.arch import (
    QKNorm,
    Rope,
    is_swa,
    is_tied,
    rope_base,
    rope_tables,
)
from foundry.model.spec.arch import spec as arch_spec
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]


GateExchange = Callable[[int, Gate, F32], F32]
"""(layer, gate, partial (n_rows, n_embd) contiguous float32) -> the sum over all ranks."""


@runtime_checkable
class CGates(Protocol):
    """A :data:`GateExchange` whose gates the C one-token step can run itself: ``in_c(n)``
    yields a capsule for ``step_layers`` (a step of up to n gates), or None where the gates go
    through the call; on leaving, a gate that failed raises its own error."""

    def in_c(self, max_gates: int) -> AbstractContextManager[object | None]: ...


_engine_ids = itertools.count(1)


class Engine:
    """Inference for rank ``rank`` of ``world`` (world 1: the whole model in one process).

    ``weights`` is the full parameter dict (the engine cuts its part; views where possible) or
    an already cut ``RankWeights`` of the same rank and world, held, not copied (its stored
    Q/K/V and gate/up tensors become views of stacked buffers, see ``step_plan.fuse``).
    ``expert_split`` is how the routed experts are cut (default: the ``RankWeights``' own,
    else ``EXPERTS``). ``kv_cache`` is its sessions' cache type; by default float16 where the
    matrices are stored blocks (F16, quantized: llama.cpp's default cache for the files it
    serves, half the memory), float32 where they are float32 arrays (our own checkpoints: exact
    as the training forward, and numpy's float products are not batch-invariant, an ulp apart
    between a block and one row, which a float16 rounding would widen). Both ranks of a pair
    load the same file, so they choose the same. ``threads``: the kernels run on that many
    threads (``quant.set_threads``, process-wide; None leaves the count as it is). The logits
    are the same bits at any count.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, Param] | RankWeights,
        rank: int = 0,
        world: int = 1,
        expert_split: ExpertSplit | None = None,
        ctx_size: int | None = None,
        kv_cache: KVCache | None = None,
        threads: int | None = None,
        shares: Sequence[int] | None = None,
    ):
        if threads is not None:
            set_threads(threads)  # the kernels' pool is the process's: sized by its engine
        self.id = next(_engine_ids)
        self.cfg = cfg
        self.arch = arch_spec(cfg)
        self.ctx_size = default_ctx(cfg) if ctx_size is None else ctx_size
        if self.ctx_size <= 0:
            raise ValueError(f"ctx_size must be positive, got {self.ctx_size}")
        self.rank = rank
        self.world = world
        stand_for = len(shares) if shares is not None else 2 if world == 1 else world
        self.shares = norm_shares(stand_for, shares)
        if world > 1 and len(self.shares) != world:
            raise ValueError(f"rank {rank} of {world} was given {len(self.shares)} shares")
        if isinstance(weights, RankWeights):
            if (weights.cfg, weights.rank, weights.world) != (cfg, rank, world):
                raise ValueError(
                    f"weights are for rank {weights.rank} of {weights.world} of "
                    f"{weights.cfg}, engine is rank {rank} of {world} of {cfg}"
                )
            if world > 1 and shares is not None and weights.shares != self.shares:
                raise ValueError(
                    f"weights are cut by shares {weights.shares}, the engine was given "
                    f"{self.shares}"
                )
            self.shares = weights.shares if world > 1 else self.shares
            if expert_split not in (None, weights.expert_split):
                raise ValueError(
                    f"weights are cut with expert split {weights.expert_split.value}, the "
                    f"engine was asked for {expert_split.value}"
                )
            self.expert_split = weights.expert_split
            self.parts: tuple[RankWeights, ...] = (weights,)
        else:
            mode = self.expert_split = expert_split or ExpertSplit.EXPERTS
            self.parts = cut_parts(cfg, weights, rank, world, mode, self.shares)
        self.fused: list[dict[str, Param]] = [fuse(cfg, part) for part in self.parts]
        # Each expert's matrices as views, made once (indexing a QTensor builds one).
        self._experts: list[dict[str, list[Param]]] = [
            {
                name: [t[e] for e in range(t.shape[0])]
                for name, t in [*part.params.items(), *fused.items()]
                if t.ndim == 3
            }
            for part, fused in zip(self.parts, self.fused, strict=True)
        ]
        self.replicated = self.parts[0].params  # embeddings, norms and routers
        stored = any(isinstance(p, QTensor) for p in self.parts[0].params.values())
        self.kv_cache = kv_cache or (KVCache.F16 if stored else KVCache.F32)
        # Norms and routers as float32 whatever the file stored (small; routing is sensitive).
        self.dense: dict[str, F32] = {
            name: dequantize(p) for name, p in self.replicated.items() if _is_dense(name)
        }
        self.vocab = (self.parts[0].layout.vocab[0], self.parts[-1].layout.vocab[1])
        self._bases = [rope_base(cfg, i) for i in range(cfg.n_layer)]
        self._rope: dict[float, tuple[F32, F32]] = {}
        self._rope_tables(self.ctx_size)
        self._layers = [
            [part_layer(cfg, self.arch, part, fused, experts, i) for i in range(cfg.n_layer)]
            for part, fused, experts in zip(self.parts, self.fused, self._experts, strict=True)
        ]
        self._dense = [
            DenseLayer(
                *(  # type: ignore[arg-type]
                    self.dense.get(f"blk.{i}.{n}.weight")
                    for n in (
                        "attn_norm",
                        "ffn_norm",
                        "ffn_gate_inp",
                        "attn_q_norm",
                        "attn_k_norm",
                        "post_attention_norm",
                        "post_ffw_norm",
                    )
                )
            )
            for i in range(cfg.n_layer)
        ]
        self._window = [
            cfg.sliding_window if is_swa(cfg, i) else 0  # type: ignore[attr-defined]
            for i in range(cfg.n_layer)
        ]
        # The output head of each part: its block of output.weight, or of token_embd's rows
        # when the output is tied (a view: the table is held once).
        self._head: list[Param] = [
            row_block(self.replicated["token_embd.weight"], part.layout.vocab)
            if is_tied(cfg)
            else part.params["output.weight"]
            for part in self.parts
        ]
        # A world-1 engine's parts' heads are consecutive row blocks of one stored matrix
        # (views of it: holding it costs nothing): one product over all of them gives each
        # row's bits (the kernels' rows are their own dot products) without joining the
        # blocks' logits (1 MB a token for Gemma).
        whole = (
            None
            if isinstance(weights, RankWeights) or len(self.parts) < 2
            else (
                self.replicated["token_embd.weight"] if is_tied(cfg) else weights["output.weight"]
            )
        )
        self._head_all = (
            whole
            if isinstance(whole, QTensor)
            and whole.ndim == 2
            and all(
                isinstance(h, QTensor) and np.may_share_memory(h.data, whole.data)
                for h in self._head
            )
            else None
        )
        # One token's layer in one C call where the layer's matrices are stored blocks
        # (``step_plan.layer_plan``); ``step_in_c`` False runs every step through the single
        # operations.
        routed = [
            routed_in_c(cfg, self.arch, self.dense, self._layers, i) for i in range(cfg.n_layer)
        ]
        self._plans: list[StepPlan | None] = [
            layer_plan(
                cfg,
                self.arch,
                self.kv_cache is KVCache.F16,
                self._window[i],
                self._dense[i],
                self.parts,
                self._layers,
                i,
                routed[i],
            )
            for i in range(cfg.n_layer)
        ]
        self._whole = [
            plan is not None and (routed[i] or all(p[i].dense is not None for p in self._layers))
            for i, plan in enumerate(self._plans)
        ]
        self.step_in_c = any(plan is not None for plan in self._plans)
        self._all_whole: tuple[StepPlan, ...] | None = (
            tuple(self._plans) if all(self._whole) else None
        )
        self._gate_buf = np.zeros((1, cfg.n_embd), dtype=np.float32)  # a step's gate (_gate_hook)

    def _rope_tables(self, n_pos: int) -> None:
        for base in set(self._bases):
            if base not in self._rope or self._rope[base][0].shape[0] < n_pos:
                self._rope[base] = rope_tables(
                    n_pos, self.cfg.head_dim, base, self.dense.get("rope_freqs.weight")
                )

    @property
    def layers_in_c(self) -> int:
        """How many layers have a one-token step in C (``step_plan.layer_plan``)."""
        return sum(plan is not None for plan in self._plans)

    @property
    def n_vocab_out(self) -> int:
        """Width of the logits forward_rows returns (the engine's vocabulary block)."""
        return self.vocab[1] - self.vocab[0]

    def new_session(self, ctx_size: int | None = None) -> Session:
        ctx = self.ctx_size if ctx_size is None else ctx_size
        if ctx <= 0:
            raise ValueError(f"ctx_size must be positive, got {ctx}")
        self._rope_tables(ctx)
        return Session(
            self.id, ctx, [p.layout.kv_heads for p in self.parts], self.cfg, self.kv_cache
        )

    def decode(
        self,
        session: Session,
        tokens: Sequence[int],
        exchange: GateExchange | None = None,
        *,
        last_only: bool = False,
    ) -> F32:
        """Run tokens (a block, or one) for one session: logits (len(tokens), n_vocab_out), or
        with ``last_only`` the last token's (1, n_vocab_out)."""
        return self.forward_rows([(session, tokens)], exchange, last_only=last_only)

    def forward_rows(
        self,
        rows: Sequence[tuple[Session, Sequence[int]]],
        exchange: GateExchange | None = None,
        *,
        last_only: bool = False,
    ) -> F32:
        """One pass over a block of tokens for each listed session (each at most once).

        Returns logits (total tokens, n_vocab_out), the sessions' blocks in the listed order;
        with ``last_only``, each session's last row only (len(rows), n_vocab_out): what a
        prompt needs, without the head's product (262,144 rows for Gemma) and a logits row for
        every token of it. Stored-block heads then multiply the last rows alone (the kernels
        give each row the same bits whatever the block); a float32 head still multiplies
        every row and keeps the last ones, as BLAS may sum a block differently from one row.
        ``exchange`` is required for world > 1; a world-1 engine needs none (if given, it is
        called with the complete sums and its result used in their place).
        """
        cfg, rp = self.cfg, self.dense
        if self.world > 1 and exchange is None:
            raise ValueError(f"rank {self.rank} of {self.world} needs a GateExchange")
        ids, pos, spans = check_rows(self.id, self.cfg.n_vocab, rows)
        x = embed(self.replicated["token_embd.weight"], ids)  # (n, D)
        if self.arch.embed_scale:
            x = x * np.float32(np.sqrt(np.float32(cfg.n_embd)))
        parts = range(len(self.parts))
        step = len(ids) == 1 and self.step_in_c  # one token: each layer's step in C
        session = rows[0][0]
        layers = self._dense
        if step and self._all_whole is not None:  # all in one call, a rank's gates too
            with self._step_gates(exchange, 2 * len(self._all_whole)) as gates:
                step_layers(
                    self._all_whole,
                    x,
                    session.pos,
                    session.k,
                    session.v,
                    tuple(self._rope[base] for base in self._bases),
                    gates,
                )
            layers = []
        tables = (
            {base: (c[pos], s_[pos]) for base, (c, s_) in self._rope.items()} if layers else {}
        )  # (n, Dh/2)
        for i, dense in enumerate(layers):
            cos, sin = tables[self._bases[i]]
            plan = self._plans[i] if step else None
            if plan is not None:
                full = self._rope[self._bases[i]]
                kc, vc = session.k[i], session.v[i]
                if exchange is None and self._whole[i]:
                    step_layer(plan, x, session.pos, tuple(kc), tuple(vc), *full)
                    continue
            h = rmsnorm(x, dense.attn_norm, cfg.norm_eps)  # (n, D)
            if plan is not None:
                partial = sum_partials(
                    [step_attn(plan, j, h, session.pos, kc[j], vc[j], *full) for j in parts]
                )
            else:
                partial = sum_partials(
                    [self._attention(i, j, h, rows, spans, cos, sin) for j in parts]
                )
            a = self._exchange(exchange, i, Gate.ATTN, partial)
            add(x, a if dense.post_attn is None else rmsnorm(a, dense.post_attn, cfg.norm_eps), x)
            h = rmsnorm(x, dense.ffn_norm, cfg.norm_eps)  # (n, D)
            if plan is not None and self._whole[i]:  # routed or dense, in C
                partial = sum_partials([step_ffn(plan, j, h) for j in parts])
            else:
                weights, top = _NO_ROUTE
                if dense.router is not None:
                    weights, top = self._route(h, dense.router)  # (n, K) each
                partial = sum_partials([self._ffn(i, j, h, weights, top) for j in parts])
            f = self._exchange(exchange, i, Gate.FFN, partial)
            add(x, f if dense.post_ffn is None else rmsnorm(f, dense.post_ffn, cfg.norm_eps), x)
        hf = rmsnorm(x, rp["output_norm.weight"], cfg.norm_eps)  # (n, D)
        last = [b - 1 for _, b in spans] if last_only else None
        if self._head_all is not None:
            logits = linear(hf if last is None else hf[last], self._head_all)  # (n, V_out)
        else:
            head = [
                linear(hf, w)[last]
                if isinstance(w, np.ndarray) and last is not None
                else linear(hf if last is None else hf[last], w)
                for w in self._head
            ]  # (n or sessions, V_part)
            logits = head[0] if len(head) == 1 else np.concatenate(head, axis=1)  # (n, V_out)
        for session, tokens in rows:
            session.tokens.extend(int(t) for t in tokens)
            session.pos += len(tokens)
        return logits

    def _attention(
        self,
        layer: int,
        j: int,
        h: F32,
        rows: Sequence[tuple[Session, Sequence[int]]],
        spans: list[tuple[int, int]],
        cos: F32,
        sin: F32,
    ) -> F32:
        """Part j's ATTN partial (n, D): its heads' attention through its attn_output columns
        (zero for a part without heads: ``shard.slices.kv_group_for``)."""
        lw = self._layers[j][layer]
        n, dh = h.shape[0], self.cfg.head_dim
        if lw.q_keep[0] == lw.q_keep[1]:
            return np.zeros((n, self.cfg.n_embd), np.float32)
        nq, nk = lw.n_q, lw.n_k
        if lw.qkv is not None:  # one product for Q, K and V (rows stacked; each row's result
            # is the same as alone)
            y = linear(h, lw.qkv)  # (n, Q + K + V rows)
            qr, kr, vr = y[:, :nq], y[:, nq : nq + nk], y[:, nq + nk :]
        else:
            qr, kr, vr = linear(h, lw.q), linear(h, lw.k), linear(h, lw.v)
        if lw.bias is not None:
            qr, kr, vr = qr + lw.bias[0], kr + lw.bias[1], vr + lw.bias[2]
        # V goes to the cache as the product gave it: its columns of the stacked rows
        v_rows, v_col = (y, nq + nk) if lw.qkv is not None and lw.bias is None else (vr, 0)
        q = self._qk(qr, self._dense[layer].q_norm, lw.q_keep, n, dh)  # (n, H_part, Dh)
        k = self._qk(kr, self._dense[layer].k_norm, lw.k_keep, n, dh)  # (n, Hkv_part, Dh)
        neox = self.arch.rope is Rope.NEOX
        q, k = rope(q, cos, sin, neox), rope(k, cos, sin, neox)
        o = np.empty_like(q)  # (n, H_part, Dh)
        # Every session's K and V rows into its caches (ctx, Hkv_part, Dh), then each row's
        # attention over its window as one-row decoding computes it (batch invariance): one
        # call, the sessions' rows and kv heads the tasks of one pool call.
        caches = [
            (s.k[layer][j], s.v[layer][j], s.pos, b - a)
            for (s, _), (a, b) in zip(rows, spans, strict=True)
        ]
        store_attend(q, k.reshape(n, -1), v_rows, v_col, caches, self._window[layer], o)
        return linear(o.reshape(n, -1), lw.attn_output)  # (n, D)

    def _qk(self, y: F32, norm: F32 | None, keep: tuple[int, int], n: int, dh: int) -> F32:
        """Q or K rows (n, heads * Dh) -> the kept heads (n, kept, Dh), after the QK-norm of
        the architecture (per head, or of the whole vector before the heads are picked)."""
        if norm is not None and self.arch.qk_norm is QKNorm.FULL:
            y = rmsnorm(np.ascontiguousarray(y), norm, self.cfg.norm_eps)
        y = np.ascontiguousarray(y).reshape(n, -1, dh)
        if y.shape[1] != keep[1] - keep[0]:
            y = np.ascontiguousarray(y[:, keep[0] : keep[1]])
        if norm is not None and self.arch.qk_norm is QKNorm.HEAD:
            y = rmsnorm(y.reshape(-1, dh), norm, self.cfg.norm_eps).reshape(n, -1, dh)
        return y

    def _route(self, h: F32, router: F32) -> tuple[F32, npt.NDArray[np.int64]]:
        """Each row's expert weights and ids: softmax over the experts, top-k; the weights
        renormalized over the k (``route``) or, where the architecture does not, the top-k
        probabilities as they are (olmoe)."""
        k = self.cfg.n_expert_used
        if self.arch.renorm_experts:
            return route(h, router, k)
        z = np.matmul(h[:, None, :], router.T)[:, 0]  # (n, E), each row its own product
        z = np.exp(z - z.max(axis=1, keepdims=True))
        probs = (z / z.sum(axis=1, keepdims=True)).astype(np.float32)  # (n, E)
        top = np.argsort(-probs, axis=1, kind="stable")[:, :k]  # (n, K)
        return np.ascontiguousarray(np.take_along_axis(probs, top, axis=1)), top

    def _ffn(self, layer: int, j: int, h: F32, weights: F32, top: npt.NDArray[np.int64]) -> F32:
        """Part j's FFN partial (n, D): its routed experts plus its slice of the shared expert.

        With ``EXPERTS`` the part holds experts ``layout.experts`` whole; with ``INTERMEDIATE``
        it holds every expert (``experts`` is (0, E)), each cut to its intermediate block, and
        evaluates every assignment on that block."""
        lw = self._layers[j][layer]
        if lw.dense is not None:
            return glu(h, *lw.dense, self.arch.act)
        order, bounds = assign_experts(top, lw.first_expert, len(lw.gate))  # (M,), (E_part + 1,)
        xs = take_rows(h, order // top.shape[1])  # (M, D)
        ys = np.empty_like(xs)  # (M, D) unweighted expert outputs
        groups = [(lo, hi, e) for e, (lo, hi) in enumerate(itertools.pairwise(bounds.tolist()))]
        groups = [g for g in groups if g[0] < g[1]]  # the experts with assignments
        if groups:
            experts_swiglu(xs, groups, lw.gate_up, lw.gate, lw.up, lw.down, ys)  # (M, D)
        y = combine_experts(ys, weights, order)  # (n, D)
        if lw.shared is not None:
            add(y, swiglu_ffn(h, *lw.shared), y)  # (n, D)
        return y

    @contextlib.contextmanager
    def _step_gates(
        self, exchange: GateExchange | None, gates: int
    ) -> Iterator[tuple[Callable[[int, int], None], F32] | tuple[object] | None]:
        """``step_layers``' gate argument for a step of ``gates`` gates: none without an
        exchange; the capsule of an exchange that runs them in C (:class:`CGates`); else the
        Python hook (:meth:`_gate_hook`)."""
        if exchange is None:
            yield None
            return
        offered: object = exchange  # a callable that may also be CGates
        if isinstance(offered, CGates):
            with offered.in_c(gates) as capsule:
                if capsule is not None:
                    yield (capsule,)
                    return
        yield self._gate_hook(exchange)

    def _gate_hook(self, exchange: GateExchange) -> tuple[Callable[[int, int], None], F32]:
        """What ``step_layers`` calls at each gate of a one-token step: the partial in a buffer,
        exchanged for the world's total in place (``_exchange``, as the layer loop does)."""
        buf = self._gate_buf

        def hook(layer: int, gate: int) -> None:
            np.copyto(buf, self._exchange(exchange, layer, _GATES[gate], buf))

        return hook, buf

    def _exchange(self, exchange: GateExchange | None, layer: int, gate: Gate, partial: F32) -> F32:
        if exchange is None:
            return partial
        total = np.asarray(exchange(layer, gate, np.ascontiguousarray(partial)))
        if total.shape != partial.shape or total.dtype != np.float32:
            raise ValueError(
                f"gate exchange of layer {layer} {gate.name} returned {total.dtype}{total.shape}, "
                f"expected float32{partial.shape}"
            )
        return total


_GATES = (Gate.ATTN, Gate.FFN)  # by the index step_layers' hook is called with


def _is_dense(name: str) -> bool:
    return name.endswith(("norm.weight", "ffn_gate_inp.weight", "rope_freqs.weight"))


_NO_ROUTE = (np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int64))
