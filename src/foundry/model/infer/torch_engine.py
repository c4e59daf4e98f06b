"""KV-cache inference on PyTorch (a CUDA GPU): what ``generate`` and the TP ranks need of
``inference.Engine``, from the same GGUF files.

The surface is the numpy engine's: ``new_session``, ``decode``, ``forward_rows(rows,
exchange)`` returning float32 numpy logits (n, n_vocab_out), ``world``, ``rank``, ``cfg``; the
sessions have ``pos``, ``tokens``, ``free``, ``ctx_size`` and ``rewind``. A rank of a pair holds
its ``shard.slices.RankWeights`` and hands each gate's (n, n_embd) partial to the ``GateExchange``
as float32 numpy, so the pair's gates go through host memory or TCP as they do between numpy
ranks; a GPU rank pairs with a GPU rank or a CPU rank alike.

Weights: every tensor is dequantized at load (``quant.dequantize``: F16, Q8_0, Q4_0 and the
K-quants as the file stores them) and kept on the device in ``dtype`` (bf16 by default on
CUDA, float32 on the CPU); norms and routers stay float32. So a quantized file decodes at bf16
speed and precision, not at its own bytes: simple, and on a GPU the products are bound by
launches and bandwidth of bf16 weights, not by the dequantization a quantized kernel would do.

Experts: each layer runs every expert the part holds on every row as one batched product
(gate, up, down: (E, n, D) x (E, D, F)), then mixes them with the router's weights (zero for
the experts a row did not choose). At decode that reads each expert's weights once, as any
MoE kernel must for a batch that touches them all, and it keeps every shape static, so a
whole token's forward is one CUDA graph; at prefill it spends E/K times the routed
arithmetic, which a GPU has to spare at these sizes.

CUDA graphs: at batch 1 a token is ~15 kernel launches per layer, which on a small model take
longer than the arithmetic. A world-1 engine on CUDA (``graphs=True``) captures one token's
forward per session on its first one-token step (the session's caches are the graph's) and
replays it for every later one; blocks (the prompt) and TP ranks (whose gates leave the
device mid-layer) run eagerly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from foundry.model.infer.sessions import SessionPositions, check_rows, default_ctx
from foundry.model.kernels.quant import Param, dequantize
from foundry.model.nn import torch_model as TM
from foundry.model.shard.slices import RankWeights, rank_weights
from foundry.model.shard.table import ExpertSplit, Gate
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]
GateExchange = Callable[[int, Gate, F32], F32]

_ids = itertools.count(1)

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


class TorchSession(SessionPositions):
    """One sequence: K/V caches (n_layer, ctx, kv heads of the part, Dh) on the device."""

    def __init__(self, engine: TorchEngine, ctx_size: int) -> None:
        self.id = next(_ids)
        self.engine_id = engine.id
        self.ctx_size = ctx_size
        self.pos = 0
        self.tokens: list[int] = []
        cfg = engine.cfg
        shape = (cfg.n_layer, ctx_size, engine.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        self.v = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        self.graph: _Graph | None = None


@dataclass
class _Graph:
    """One token's forward captured for a session: write ids/pos, replay, read logits."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # (1,) int64
    pos: torch.Tensor  # (1,) int64
    logits: torch.Tensor  # (1, V_out) float32


class TorchEngine:
    """Inference for rank ``rank`` of ``world`` on ``device``; see the module docstring."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, Param] | RankWeights,
        rank: int = 0,
        world: int = 1,
        expert_split: ExpertSplit | None = None,
        *,
        device: str = "cuda",
        dtype: str | None = None,
        graphs: bool = True,
        ctx_size: int | None = None,
        compile_step: bool = False,
    ) -> None:
        self.id = next(_ids)
        self.cfg = cfg
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype or ("bf16" if self.device.type == "cuda" else "f32")]
        if isinstance(weights, RankWeights):
            if (weights.cfg, weights.rank, weights.world) != (cfg, rank, world):
                raise ValueError(
                    f"weights are for rank {weights.rank} of {weights.world}, "
                    f"engine is rank {rank} of {world}"
                )
            part = weights
        else:
            part = rank_weights(cfg, weights, rank, world, expert_split or ExpertSplit.EXPERTS)
        self.expert_split = part.expert_split
        lay = part.layout
        self.n_kv_heads = lay.kv_heads[1] - lay.kv_heads[0]
        self.n_heads = lay.heads[1] - lay.heads[0]
        self.first_expert, self.n_local = lay.experts[0], lay.experts[1] - lay.experts[0]
        self.vocab = lay.vocab
        self.w: dict[str, torch.Tensor] = {}
        for name, p in part.params.items():  # one tensor at a time: host memory stays small
            dense = name.endswith(("norm.weight", "ffn_gate_inp.weight", "token_embd.weight"))
            t = TM.host_tensor(dequantize(p)).to(
                self.device, torch.float32 if dense else self.dtype
            )
            self.w[name] = t
        for i in range(cfg.n_layer):  # Q, K, V rows stacked: one product
            b = f"blk.{i}."
            self.w[b + "qkv"] = torch.cat([self.w.pop(b + f"attn_{t}.weight") for t in "qkv"])
        self.graphs = graphs and self.device.type == "cuda" and world == 1
        self.ctx_size = default_ctx(cfg) if ctx_size is None else ctx_size
        if self.ctx_size <= 0:
            raise ValueError(f"ctx_size must be positive, got {self.ctx_size}")
        self._cos, self._sin = TM.rope_tables(self.ctx_size, cfg, self.device)
        # torch.compile the captured one-token step: fuses the elementwise kernels between
        # the products (fewer kernels in the graph); costs a compilation per engine.
        self.compile_step = compile_step
        self._step: Callable[..., torch.Tensor] | None = None

    @property
    def n_vocab_out(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def new_session(self, ctx_size: int | None = None) -> TorchSession:
        ctx = self.ctx_size if ctx_size is None else ctx_size
        if ctx <= 0:
            raise ValueError(f"ctx_size must be positive, got {ctx}")
        if ctx > self._cos.shape[0]:
            self._cos, self._sin = TM.rope_tables(ctx, self.cfg, self.device)
        return TorchSession(self, ctx)

    def decode(
        self,
        session: TorchSession,
        tokens: Sequence[int],
        exchange: GateExchange | None = None,
        *,
        last_only: bool = False,
    ) -> F32:
        return self.forward_rows([(session, tokens)], exchange, last_only=last_only)

    def forward_rows(
        self,
        rows: Sequence[tuple[TorchSession, Sequence[int]]],
        exchange: GateExchange | None = None,
        *,
        last_only: bool = False,
    ) -> F32:
        """One pass over a block of tokens for each listed session: logits (n, n_vocab_out),
        or with ``last_only`` each session's last row (the numpy engine's ``last_only``;
        here the rows are picked after the whole block's head)."""
        if self.world > 1 and exchange is None:
            raise ValueError(f"rank {self.rank} of {self.world} needs a GateExchange")
        ids, pos, spans = check_rows(self.id, self.cfg.n_vocab, rows)
        if self.graphs and exchange is None and len(rows) == 1 and len(ids) == 1:
            session = rows[0][0]
            logits = self._replay(session, int(ids[0]), int(pos[0]))
        else:
            with torch.no_grad():
                logits = (
                    self._forward(
                        torch.from_numpy(ids).to(self.device),
                        torch.from_numpy(pos).to(self.device),
                        [s for s, _ in rows],
                        spans,
                        exchange,
                    )
                    .cpu()
                    .numpy()
                )
        if last_only:
            logits = logits[[b - 1 for _, b in spans]]
        for session, tokens in rows:
            session.tokens.extend(int(t) for t in tokens)
            session.pos += len(tokens)
        return logits

    # --- the forward ----------------------------------------------------------------------

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        sessions: list[TorchSession],
        spans: list[tuple[int, int]],
        exchange: GateExchange | None,
        whole_cache: bool = False,
    ) -> torch.Tensor:
        """Logits (n, V_out) float32 of rows ids/pos (n,); writes the sessions' caches.
        ``whole_cache``: one row attends to the whole cache through a mask (graph capture:
        shapes may not depend on the position)."""
        cfg, w = self.cfg, self.w
        n, dh = ids.shape[0], cfg.head_dim
        cos, sin = self._cos[pos], self._sin[pos]  # (n, Dh/2) each
        x = w["token_embd.weight"][ids]  # (n, D) float32
        nq, nk = self.n_heads, self.n_kv_heads
        for i in range(cfg.n_layer):
            b = f"blk.{i}."
            h = TM.rmsnorm(x, w[b + "attn_norm.weight"], cfg.norm_eps).to(self.dtype)  # (n, D)
            y = (h @ w[b + "qkv"].T).reshape(n, nq + 2 * nk, dh)  # (n, Hq + 2 Hkv, Dh)
            qk = TM.rope(y[:, : nq + nk].float(), cos, sin).to(self.dtype)  # (n, Hq+Hkv, Dh)
            q, k, v = qk[:, :nq], qk[:, nq:], y[:, nq + nk :]  # (n, heads, Dh)
            o = torch.empty_like(q)  # (n, Hq, Dh)
            for s, (a, e) in zip(sessions, spans, strict=True):
                s.k[i].index_copy_(0, pos[a:e], k[a:e])
                s.v[i].index_copy_(0, pos[a:e], v[a:e])
                o[a:e] = self._attend(q[a:e], s, i, pos[a:e], whole_cache)
            part = (o.reshape(n, -1) @ w[b + "attn_output.weight"].T).float()  # (n, D)
            x = x + self._exchange(exchange, i, Gate.ATTN, part)
            h2 = TM.rmsnorm(x, w[b + "ffn_norm.weight"], cfg.norm_eps)  # (n, D) float32
            x = x + self._exchange(exchange, i, Gate.FFN, self._ffn(i, h2))
        hf = TM.rmsnorm(x, w["output_norm.weight"], cfg.norm_eps).to(self.dtype)  # (n, D)
        return (hf @ w["output.weight"].T).float()  # (n, V_out)

    def _attend(
        self, q: torch.Tensor, s: TorchSession, layer: int, pos: torch.Tensor, whole_cache: bool
    ) -> torch.Tensor:
        """Rows q (t, Hq, Dh) at positions pos (t,) against the session's cache."""
        if whole_cache:
            keys = torch.arange(s.ctx_size, device=q.device)
            mask = keys[None, :] <= pos[:, None]  # (t, ctx)
            kc, vc = s.k[layer], s.v[layer]
        else:
            end = s.pos + q.shape[0]
            kc, vc = s.k[layer, :end], s.v[layer, :end]  # (S, Hkv, Dh)
            mask = None
            if q.shape[0] > 1:
                keys = torch.arange(end, device=q.device)
                mask = keys[None, :] <= pos[:, None]  # (t, S)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            kc.transpose(0, 1),
            vc.transpose(0, 1),
            attn_mask=mask,
            enable_gqa=q.shape[1] != kc.shape[1],
        )  # (Hq, t, Dh)
        return o.transpose(0, 1)

    def _ffn(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The part's FFN partial (n, D) float32: its experts on every row, mixed by the
        router's weights; plus its slice of the shared expert."""
        cfg, w, b = self.cfg, self.w, f"blk.{layer}."
        weights, top, _ = TM.router(h, w[b + "ffn_gate_inp.weight"], cfg.n_expert_used)
        mix = torch.zeros(h.shape[0], cfg.n_expert, device=h.device)  # (n, E)
        mix.scatter_(1, top, weights)
        mix = mix[:, self.first_expert : self.first_expert + self.n_local]  # (n, E_part)
        hx = h.to(self.dtype)
        g = torch.matmul(hx, w[b + "ffn_gate_exps.weight"].transpose(1, 2))  # (E_part, n, F)
        u = torch.matmul(hx, w[b + "ffn_up_exps.weight"].transpose(1, 2))  # (E_part, n, F)
        ys = torch.bmm(F.silu(g) * u, w[b + "ffn_down_exps.weight"].transpose(1, 2))
        y = torch.einsum("ne,end->nd", mix, ys.float())  # (n, D)
        if cfg.n_ff_shared:
            y = (
                y
                + TM.swiglu(
                    hx,
                    w[b + "ffn_gate_shexp.weight"],
                    w[b + "ffn_up_shexp.weight"],
                    w[b + "ffn_down_shexp.weight"],
                ).float()
            )
        return y

    def _exchange(
        self, exchange: GateExchange | None, layer: int, gate: Gate, partial: torch.Tensor
    ) -> torch.Tensor:
        if exchange is None:
            return partial
        total = np.asarray(exchange(layer, gate, np.ascontiguousarray(partial.cpu().numpy())))
        if total.shape != tuple(partial.shape) or total.dtype != np.float32:
            raise ValueError(
                f"gate exchange of layer {layer} {gate.name} returned "
                f"{total.dtype}{total.shape}, expected float32{tuple(partial.shape)}"
            )
        return torch.from_numpy(total).to(self.device)

    # --- CUDA graphs ----------------------------------------------------------------------

    def _replay(self, session: TorchSession, token: int, pos: int) -> F32:
        g = session.graph
        if g is None:
            g = session.graph = self._capture(session)
        g.ids.fill_(token)
        g.pos.fill_(pos)
        g.graph.replay()
        return g.logits.cpu().numpy()

    def _capture(self, session: TorchSession) -> _Graph:
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        pos = torch.full((1,), session.pos, dtype=torch.int64, device=self.device)
        if self._step is None:
            self._step = self._one_token
            if self.compile_step:
                self._step = torch.compile(self._one_token, dynamic=False)
        step = self._step
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(stream):  # warm-up (compiles) outside the graph
            for _ in range(3):
                step(ids, pos, session)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            logits = step(ids, pos, session)
        return _Graph(graph, ids, pos, logits)

    def _one_token(
        self, ids: torch.Tensor, pos: torch.Tensor, session: TorchSession
    ) -> torch.Tensor:
        return self._forward(ids, pos, [session], [(0, 1)], None, whole_cache=True)
