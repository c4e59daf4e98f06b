"""The one-token step plan that crosses into C (``quant.step_plan``), built from what each
part of an ``inference.Engine`` holds of a layer.

- :func:`fuse` stacks the rows of the products that read the same input (Q, K and V; gate and
  up) where they are stored in one type; :func:`part_layer` looks up once what a part holds
  of a layer (:class:`PartLayer`), :class:`DenseLayer` its replicated float32 tensors.
- :func:`layer_plan` is a layer's step for C (``StepLayer`` of ``StepPart``), or None where a
  matrix is float32 (numpy's products, which C cannot repeat bit for bit) or the C module is
  missing; :func:`routed_in_c` says whether the routed experts run in it, :func:`same_kv`
  whether a part's K and V rows are the part before's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from foundry.model.kernels.quant import (
    Param,
    QTensor,
    StepExpert,
    StepLayer,
    StepMat,
    StepPart,
    StepPlan,
    address,
    dequantize,
    has_step,
    step_mat,
    step_plan,
)
from foundry.model.nn.layers import gelu_table
from foundry.model.shard.slices import RankWeights
from foundry.model.spec.arch import Act, Arch, QKNorm, Rope
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class PartLayer:
    """What one part holds of one layer, looked up once (a token reads it 2 x n_layer times):
    its Q, K and V rows (stacked as ``qkv`` where ``fuse`` could), output projection, and
    each of its experts' matrices (gate and up stacked as ``gate_up`` where it could)."""

    qkv: Param | None
    q: Param
    k: Param
    v: Param
    n_q: int  # rows of q, then of k
    n_k: int
    bias: tuple[F32, F32, F32] | None  # of q, k, v (qwen2)
    q_keep: tuple[int, int]  # the heads of the computed Q rows this part attends for
    k_keep: tuple[int, int]  # the kv heads of the computed K rows it caches
    attn_output: Param
    first_expert: int
    gate: list[Param]
    up: list[Param]
    down: list[Param]
    gate_up: list[Param] | None
    shared: tuple[Param | None, Param, Param, Param] | None  # gate_up, gate, up, down
    dense: tuple[Param | None, Param, Param, Param] | None  # a dense FFN, as ``shared``


@dataclass(frozen=True)
class DenseLayer:
    """A layer's replicated float32 tensors: the norms and the router (None where the
    architecture has none)."""

    attn_norm: F32
    ffn_norm: F32
    router: F32 | None
    q_norm: F32 | None
    k_norm: F32 | None
    post_attn: F32 | None
    post_ffn: F32 | None


def part_layer(
    cfg: ModelConfig,
    arch: Arch,
    part: RankWeights,
    fused: Mapping[str, Param],
    experts: Mapping[str, list[Param]],
    layer: int,
) -> PartLayer:
    """What ``part`` holds of layer ``layer`` (``fused``: its stacked tensors, ``fuse``;
    ``experts``: each expert's matrices as views)."""
    w = part.params
    p = f"blk.{layer}."
    q, k, v = (w[p + f"attn_{t}.weight"] for t in "qkv")
    layout = part.layout
    shared = dense = None
    if cfg.n_ff_shared:
        shared = (
            fused.get(p + "gate_up_shexp"),
            w[p + "ffn_gate_shexp.weight"],
            w[p + "ffn_up_shexp.weight"],
            w[p + "ffn_down_shexp.weight"],
        )
    if cfg.n_expert == 0:
        dense = (
            fused.get(p + "ffn_gate_up"),
            w[p + "ffn_gate.weight"],
            w[p + "ffn_up.weight"],
            w[p + "ffn_down.weight"],
        )
    bias = None
    if arch.qkv_bias:
        bias = tuple(dequantize(w[p + f"attn_{t}.bias"]) for t in "qkv")
    q0, k0 = layout.q_rows[0], layout.k_rows[0]
    return PartLayer(
        qkv=fused.get(p + "qkv"),
        q=q,
        k=k,
        v=v,
        n_q=q.shape[0],
        n_k=k.shape[0],
        bias=bias,  # type: ignore[arg-type]
        q_keep=(layout.heads[0] - q0, layout.heads[1] - q0),
        k_keep=(layout.kv_heads[0] - k0, layout.kv_heads[1] - k0),
        attn_output=w[p + "attn_output.weight"],
        first_expert=layout.experts[0],
        gate=experts.get(p + "ffn_gate_exps.weight", []),
        up=experts.get(p + "ffn_up_exps.weight", []),
        down=experts.get(p + "ffn_down_exps.weight", []),
        gate_up=experts.get(p + "gate_up"),
        shared=shared,
        dense=dense,
    )


def fuse(cfg: ModelConfig, part: RankWeights) -> dict[str, Param]:
    """Stack the rows of the products that read the same input, where they are stored in one
    type: Q, K and V (``blk.N.qkv``), each expert's gate and up (``blk.N.gate_up``, (E, 2F,
    D)) and the shared expert's (``blk.N.gate_up_shexp``). Fewer calls, the same bits (every
    output row is its own dot product). The part's own tensors are replaced, in its params, by
    views of the stacked ones (the same values), so whoever else holds the part (a TP rank's
    loaded model) does not keep a second copy."""
    params: dict[str, Param] = part.params
    fused: dict[str, Param] = {}
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        groups = [("qkv", [p + f"attn_{t}.weight" for t in "qkv"])]
        if cfg.n_expert:
            groups.append(("gate_up", [p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"]))
        else:
            groups.append(("ffn_gate_up", [p + "ffn_gate.weight", p + "ffn_up.weight"]))
        if cfg.n_ff_shared:
            groups.append(
                ("gate_up_shexp", [p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"])
            )
        for key, names in groups:
            ts = [params[n] for n in names]
            if not _one_type(*ts):
                continue
            axis = ts[0].ndim - 2  # the rows: of the matrix, or of each expert's
            stacked = np.concatenate([_raw(t) for t in ts], axis=axis)
            fused[p + key] = _typed(ts[0], stacked)
            at = 0
            for n, t in zip(names, ts, strict=True):
                rows = t.shape[axis]
                params[n] = _typed(t, stacked[(slice(None),) * axis + (slice(at, at + rows),)])
                at += rows
    return fused


def _raw(t: Param) -> npt.NDArray[Any]:
    """A tensor's rows as stored: float32 values, or a QTensor's bytes."""
    return t if isinstance(t, np.ndarray) else t.data


def _typed(like: Param, raw: npt.NDArray[Any]) -> Param:
    """Rows as stored (``_raw``) as a tensor of ``like``'s type."""
    if isinstance(like, np.ndarray):
        return raw
    return QTensor(like.qtype, (*raw.shape[:-1], like.shape[-1]), raw)


def _one_type(*ps: Param) -> bool:
    first = ps[0]
    if isinstance(first, np.ndarray):
        return all(isinstance(p, np.ndarray) and p.dtype == np.float32 for p in ps)
    return all(isinstance(p, QTensor) and p.qtype == first.qtype for p in ps)


def routed_in_c(
    cfg: ModelConfig,
    arch: Arch,
    dense: Mapping[str, F32],
    layers: list[list[PartLayer]],
    layer: int,
) -> bool:
    """Whether layer ``layer``'s routed experts run in the one-token step: every expert
    matrix of every part stored blocks (C-contiguous), the top-k weights renormalised
    (``route``), no shared expert."""
    if (
        dense.get(f"blk.{layer}.ffn_gate_inp.weight") is None
        or cfg.n_ff_shared
        or not arch.renorm_experts
        or arch.act is not Act.SILU
    ):
        return False
    mats = [
        t
        for held in layers
        for t in (*(held[layer].gate_up or [*held[layer].gate, *held[layer].up]), *held[layer].down)
    ]
    return all(isinstance(t, QTensor) and t.ndim == 2 and t.data.flags.c_contiguous for t in mats)


def same_kv(
    parts: Sequence[RankWeights], layers: list[list[PartLayer]], layer: int, j: int
) -> bool:
    """Whether part j computes the K and V rows of part j - 1 from the same bytes, into
    the cache row they share (``Session``: parts of the same kv heads share one array)."""
    a, b = parts[j - 1].layout, parts[j].layout
    la, lb = layers[j - 1][layer], layers[j][layer]
    if (a.kv_heads, a.k_rows, la.k_keep) != (b.kv_heads, b.k_rows, lb.k_keep):
        return False
    pairs = [(la.k, lb.k), (la.v, lb.v)]
    if la.bias is not None and lb.bias is not None:
        pairs += [(la.bias[1], lb.bias[1]), (la.bias[2], lb.bias[2])]
    return all(
        isinstance(x, QTensor) == isinstance(y, QTensor)
        and x.shape == y.shape
        and np.array_equal(
            x.data if isinstance(x, QTensor) else x, y.data if isinstance(y, QTensor) else y
        )
        and (not isinstance(x, QTensor) or x.qtype == y.qtype)  # type: ignore[union-attr]
        for x, y in pairs
    )


def layer_plan(
    cfg: ModelConfig,
    arch: Arch,
    half: bool,
    window: int,
    dense: DenseLayer,
    parts: Sequence[RankWeights],
    layers: list[list[PartLayer]],
    layer: int,
    routed: bool,
) -> StepPlan | None:
    """Layer ``layer``'s one-token step for ``quant.step_plan``: each part's attention
    (and its dense FFN, where every FFN matrix is stored blocks, or its routed experts
    where ``routed`` (``routed_in_c``)), or None where the layer
    has a float32 matrix (numpy's products, which C cannot repeat bit for bit) or the C
    module is missing.

    A part whose K and V rows are the part before's (a replicated kv head: the same rows
    of the same bytes, cached in the one shared array) computes only its Q rows: the
    part before has written the same values to the same cache row."""
    if not has_step():
        return None
    steps: list[StepPart] = []
    for j, held in enumerate(layers):
        lw = held[layer]
        attn: list[Param] = [lw.q, lw.k, lw.v, lw.attn_output]
        ffn = [] if lw.dense is None else [t for t in lw.dense if t is not None]
        if not all(isinstance(t, QTensor) for t in attn) or (
            ffn and not all(isinstance(t, QTensor) for t in ffn)
        ):
            return None
        experts: tuple[StepExpert, ...] = ()
        if routed:
            experts = tuple(
                (
                    tuple(
                        step_mat(t)  # type: ignore[arg-type]
                        for t in (
                            [lw.gate_up[e]] if lw.gate_up is not None else [lw.gate[e], lw.up[e]]
                        )
                    ),
                    step_mat(lw.down[e]),  # type: ignore[arg-type]
                )
                for e in range(len(lw.gate))
            )
        heads = lw.q_keep[1] > lw.q_keep[0]  # a part without heads gives a zero partial
        skip = heads and j > 0 and same_kv(parts, layers, layer, j)
        qkv: list[Param] = []  # none for a part without heads
        if skip:
            qkv = [lw.q]
        elif heads:
            qkv = [lw.qkv] if lw.qkv is not None else [lw.q, lw.k, lw.v]
        gate_up: list[Param] = []
        down: StepMat | None = None
        if lw.dense is not None:
            fused, gate, up, down_w = lw.dense
            gate_up = [fused] if fused is not None else [gate, up]
            down = step_mat(down_w)  # type: ignore[arg-type]
        n_kv = parts[j].layout.kv_heads[1] - parts[j].layout.kv_heads[0]
        bias_q, bias_k, bias_v = lw.bias or (None, None, None)
        steps.append(
            StepPart(
                qkv=tuple(step_mat(t) for t in qkv),  # type: ignore[arg-type]
                out=step_mat(lw.attn_output) if heads else None,  # type: ignore[arg-type]
                gate_up=tuple(step_mat(t) for t in gate_up),  # type: ignore[arg-type]
                down=down,
                n_q=lw.n_q if heads else 0,
                n_k=lw.n_k if heads else 0,
                n_v=lw.v.shape[0] if heads else 0,
                n_kv=n_kv,
                n_ff=down.k if down else 0,
                q_keep_first=lw.q_keep[0],
                q_keep_end=lw.q_keep[1],
                k_keep_first=lw.k_keep[0],
                k_keep_end=lw.k_keep[1],
                skip_kv=int(skip),
                bias_q=address(bias_q),
                bias_k=address(bias_k),
                bias_v=address(bias_v),
                q_norm=address(dense.q_norm),
                k_norm=address(dense.k_norm),
                first_exp=lw.first_expert,
                experts=experts,
            )
        )
    qk = {QKNorm.NONE: 0, QKNorm.HEAD: 1, QKNorm.FULL: 2}[arch.qk_norm]
    return step_plan(
        StepLayer(
            d=cfg.n_embd,
            dh=cfg.head_dim,
            half=int(half),
            neox=int(arch.rope is Rope.NEOX),
            qk_norm=qk,
            window=window,
            gelu=int(arch.act is Act.GELU),
            eps=cfg.norm_eps,
            attn_norm=address(dense.attn_norm),
            ffn_norm=address(dense.ffn_norm),
            post_attn=address(dense.post_attn),
            post_ffn=address(dense.post_ffn),
            gelu_table=address(gelu_table()),
            router=address(dense.router if routed else None),
            n_expert=cfg.n_expert if routed else 0,
            n_used=cfg.n_expert_used if routed else 0,
            parts=tuple(steps),
        )
    )
