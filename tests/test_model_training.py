"""A short, bounded training run: the model learns a periodic byte corpus.

The corpus repeats one sentence, so after a few dozen AdamW steps the next byte is nearly
determined by the previous ones. The loss starts near ln(259) = 5.56 (uniform over the byte
vocabulary) and must fall below 0.5, a tenth of that, within 50 steps of 8 sequences of 32
tokens (it reaches about 0.15; a broken gradient stalls above 2).
"""

from __future__ import annotations

import numpy as np

from foundry.model.nn import transformer as T
from foundry.model.spec.config import N_SPECIAL_TOKENS, ModelConfig
from foundry.model.train.optim import AdamW, clip_grad_norm, lr_schedule

STEPS = 50
TARGET_LOSS = 0.5


def test_loss_falls_on_a_periodic_corpus() -> None:
    cfg = ModelConfig(
        n_ctx=64, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_expert=4, n_expert_used=2
    )
    text = b"the quick brown fox jumps over the lazy dog; " * 40
    corpus = np.frombuffer(text, np.uint8).astype(np.int64) + N_SPECIAL_TOKENS
    params = T.init_params(cfg, seed=0)
    opt = AdamW(params, weight_decay=0.01)
    rng = np.random.default_rng(0)
    seq, batch = 32, 8
    losses = []
    for step in range(STEPS):
        starts = rng.integers(0, corpus.size - seq - 1, batch)
        window = np.stack([corpus[s : s + seq + 1] for s in starts])
        loss, stats, grads = T.loss_and_grads(params, cfg, window[:, :-1], window[:, 1:])
        clip_grad_norm(grads, 1.0)
        opt.step(params, grads, lr=lr_schedule(step, 1e-2, 10, STEPS))
        losses.append(stats["ce_loss"])
        assert np.isfinite(loss) and 0.5 < stats["aux_loss"] < 2.0
    assert losses[0] > 5.0
    assert min(losses[-5:]) < TARGET_LOSS, losses[::10]
