"""The numpy model's forward and hand-written backward against PyTorch autograd, in float32.

The reference below is written from the model's definition (docs/decisions.md, D1) with torch ops
only: repeat_interleave for grouped-query attention, a complex-number view for the adjacent-pair
rotary embedding, a dense per-expert loop for the mixture. Both sides get the same weights and
tokens; every logit, both losses and every gradient agree to 1e-4 relative error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundry.model.nn import transformer as T
from foundry.model.spec.config import ModelConfig

MAX_REL_ERR = 1e-4


def rel_err(ours: np.ndarray, ref: torch.Tensor) -> float:
    ref_np = ref.detach().numpy()
    return float(np.abs(ours - ref_np).max() / max(np.abs(ref_np).max(), 1e-30))


def torch_loss(
    P: dict[str, torch.Tensor],
    cfg: ModelConfig,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    coef: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, t = tokens.shape
    h, hkv, dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    turn = torch.polar(
        torch.ones(t, dh // 2, dtype=torch.float64),
        torch.outer(torch.arange(t, dtype=torch.float64), freqs),
    )
    turn = turn.to(torch.complex64)[:, None, :]  # (T, 1, Dh/2)

    def rope(x: torch.Tensor) -> torch.Tensor:  # (B, T, heads, Dh), pairs (x0, x1), (x2, x3)
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], dh // 2, 2).contiguous())
        return torch.view_as_real(z * turn).reshape(x.shape)

    x = P["token_embd.weight"][tokens]  # (B, T, D)
    aux = torch.zeros(())
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        a = norm(x, P[p + "attn_norm.weight"])
        q = rope((a @ P[p + "attn_q.weight"].T).view(b, t, h, dh)).transpose(1, 2)
        k = rope((a @ P[p + "attn_k.weight"].T).view(b, t, hkv, dh)).transpose(1, 2)
        v = (a @ P[p + "attn_v.weight"].T).view(b, t, hkv, dh).transpose(1, 2)
        k = k.repeat_interleave(h // hkv, dim=1)  # head h reads kv head h // (H / Hkv)
        v = v.repeat_interleave(h // hkv, dim=1)
        att = (q @ k.transpose(-1, -2)) / dh**0.5
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + o @ P[p + "attn_output.weight"].T
        m = norm(x, P[p + "ffn_norm.weight"])
        probs = (m @ P[p + "ffn_gate_inp.weight"].T).softmax(-1)  # (B, T, E)
        top_p, top = probs.topk(cfg.n_expert_used, dim=-1)
        gate = torch.zeros_like(probs).scatter(-1, top, top_p / top_p.sum(-1, keepdim=True))
        y = torch.zeros_like(m)
        for e in range(cfg.n_expert):
            act = torch.nn.functional.silu(m @ P[p + "ffn_gate_exps.weight"][e].T)
            out = (act * (m @ P[p + "ffn_up_exps.weight"][e].T)) @ P[p + "ffn_down_exps.weight"][
                e
            ].T
            y = y + gate[..., e : e + 1] * out
        if cfg.n_ff_shared:
            act = torch.nn.functional.silu(m @ P[p + "ffn_gate_shexp.weight"].T)
            y = y + (act * (m @ P[p + "ffn_up_shexp.weight"].T)) @ P[p + "ffn_down_shexp.weight"].T
        x = x + y
        # per sequence: f (B, E) share of the sequence's top-k picks (no gradient), P (B, E)
        share = torch.nn.functional.one_hot(top, cfg.n_expert).float().sum((1, 2))
        share = share / (top.shape[1] * top.shape[2])
        per_seq = (share * probs.mean(1)).sum(1)  # (B,)
        aux = aux + cfg.n_expert * per_seq.mean() / cfg.n_layer
    logits = norm(x, P["output_norm.weight"]) @ P["output.weight"].T
    ce = torch.nn.functional.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1))
    return ce + coef * aux, ce, aux, logits


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(n_layer=2),
        ModelConfig(
            n_vocab=101,
            n_embd=48,
            n_layer=3,
            n_head=6,
            n_head_kv=3,
            n_ff=40,
            n_expert=5,
            n_expert_used=3,
            n_ff_shared=24,
            rope_theta=500.0,
        ),
        ModelConfig(n_embd=32, n_head=4, n_head_kv=1, n_ff=64, n_expert=4, n_expert_used=1),
    ],
    ids=["tiny", "shared-expert", "multi-query-top1"],
)
def test_forward_and_backward_match_autograd(cfg: ModelConfig) -> None:
    rng = np.random.default_rng(0)
    params = T.init_params(cfg, seed=1)
    for name, p in params.items():  # larger weights than init: routing and attention not flat
        p += np.float32(0.2 if name.endswith("norm.weight") else 0.05) * rng.standard_normal(
            p.shape, dtype=np.float32
        )
    tokens = rng.integers(0, cfg.n_vocab, (3, 24))
    targets = rng.integers(0, cfg.n_vocab, (3, 24))
    coef = 0.1

    logits, _ = T.forward(params, cfg, tokens)
    loss, stats, grads = T.loss_and_grads(params, cfg, tokens, targets, aux_loss_coef=coef)

    P = {name: torch.tensor(p, requires_grad=True) for name, p in params.items()}
    ref_loss, ref_ce, ref_aux, ref_logits = torch_loss(
        P, cfg, torch.tensor(tokens), torch.tensor(targets), coef
    )
    ref_loss.backward()

    assert logits.dtype == np.float32
    assert rel_err(logits, ref_logits) <= MAX_REL_ERR
    assert stats["ce_loss"] == pytest.approx(ref_ce.item(), rel=MAX_REL_ERR)
    assert stats["aux_loss"] == pytest.approx(ref_aux.item(), rel=MAX_REL_ERR)
    assert loss == pytest.approx(ref_loss.item(), rel=MAX_REL_ERR)
    assert list(grads) == list(cfg.param_shapes())
    for name, g in grads.items():
        ref = P[name].grad
        assert ref is not None
        assert g.dtype == np.float32 and g.shape == params[name].shape, name
        assert rel_err(g, ref) <= MAX_REL_ERR, (name, rel_err(g, ref))
