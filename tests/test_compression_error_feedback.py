"""Error feedback: the sender's ``Compressor`` loses nothing over rounds, and TOPK learns better
with it than without.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from foundry.compression import (
    Codec,
    Compressor,
    ErrorFeedback,
    Fp16Codec,
    NoneCodec,
    QsgdCodec,
    TopKCodec,
    deserialize_tensors,
)
from foundry.model.nn import transformer as T
from foundry.model.spec.config import N_SPECIAL_TOKENS, ModelConfig
from foundry.model.train.optim import AdamW, clip_grad_norm, lr_schedule
from foundry.wire.errors import LocalProtocolError


@pytest.mark.parametrize(
    "codec",
    [NoneCodec(), Fp16Codec(), TopKCodec(0.05), QsgdCodec(3, 16, seed=2)],
    ids=repr,
)
def test_error_feedback_loses_nothing(codec: Codec) -> None:
    """sum over steps of what was sent (decoded) + the residual == sum of the gradients."""
    rng = np.random.default_rng(4)
    shapes = {"blk.0.attn_q.weight": (16, 16), "output_norm.weight": (40,)}
    feedback = ErrorFeedback(codec)
    inputs = {k: np.zeros(s, np.float64).reshape(-1) for k, s in shapes.items()}
    sent = {k: np.zeros(s, np.float64).reshape(-1) for k, s in shapes.items()}
    for _ in range(12):
        for name, shape in shapes.items():
            g = rng.standard_normal(shape).astype(np.float32)
            data = feedback.compress(name, g)
            inputs[name] += g.reshape(-1)
            sent[name] += codec.decode(data, g.size)[0]
    for name in shapes:
        residual = feedback.residual(name)
        assert residual is not None
        np.testing.assert_allclose(sent[name] + residual, inputs[name], rtol=0, atol=1e-4)
        if not codec.lossy:
            assert not residual.any()
    with pytest.raises(LocalProtocolError, match="call reset"):
        feedback.compress("output_norm.weight", np.zeros(41, np.float32))
    feedback.reset("output_norm.weight")
    assert feedback.residual("output_norm.weight") is None
    feedback.compress("output_norm.weight", np.zeros(41, np.float32))
    feedback.reset()
    assert feedback.residual("blk.0.attn_q.weight") is None


@pytest.mark.parametrize(
    "codec",
    [NoneCodec(), Fp16Codec(), TopKCodec(0.05), QsgdCodec(3, 16, seed=2)],
    ids=repr,
)
def test_compressor_sends_what_it_says_and_loses_nothing(codec: Codec) -> None:
    """The sender's wrapper (the worker's upload, the coordinator's UPDATE): over several
    calls, what the receiver decodes from each section plus the residual kept for the next call
    equals the sum of the inputs, tensor by tensor; the section is the codec's own encoding."""
    rng = np.random.default_rng(5)
    shapes = {"blk.0.attn_q.weight": (16, 16), "output_norm.weight": (40,)}
    compressor = Compressor(codec)
    assert (compressor.feedback is not None) == codec.lossy
    inputs = {k: np.zeros(math.prod(s), np.float64) for k, s in shapes.items()}
    received = {k: np.zeros(math.prod(s), np.float64) for k, s in shapes.items()}
    for _ in range(10):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        section, sent = compressor.encode(grads)
        assert len(section) == sum(codec.encoded_size(g.size) for g in grads.values())
        decoded = deserialize_tensors(section, [g.size for g in grads.values()], codec.compression)
        for (name, g), got in zip(grads.items(), decoded, strict=True):
            np.testing.assert_array_equal(sent[name], got)  # the sender's view is exact
            inputs[name] += g.reshape(-1)
            received[name] += got
    for name in shapes:
        if codec.lossy:
            assert compressor.feedback is not None
            residual = compressor.feedback.residual(name)
            assert residual is not None and np.abs(residual).max() > 0
        else:
            residual = np.zeros(1, np.float32)
        np.testing.assert_allclose(received[name] + residual, inputs[name], rtol=0, atol=1e-4)
    compressor.reset()
    if compressor.feedback is not None:
        assert compressor.feedback.residual("output_norm.weight") is None


def test_topk_learns_better_with_error_feedback_than_without() -> None:
    """The same AdamW run on a periodic corpus, its gradients through TOPK at 0.5%: once
    through the sender's Compressor (error feedback), once through the bare codec (what was
    dropped is lost). Feedback on ends about 0.25 nats lower (1.45 against 1.70 over the last
    ten steps, three data seeds); with feedback off, or broken, the two runs are alike."""
    cfg = ModelConfig(
        n_ctx=64, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_expert=4, n_expert_used=2
    )
    text = b"the quick brown fox jumps over the lazy dog; " * 40
    corpus = np.frombuffer(text, np.uint8).astype(np.int64) + N_SPECIAL_TOKENS
    steps, seq, batch = 60, 32, 8

    def final_loss(feedback: bool) -> float:
        codec = TopKCodec(0.005)
        compressor = Compressor(codec)
        params = T.init_params(cfg, seed=0)
        opt = AdamW(params, weight_decay=0.01)
        rng = np.random.default_rng(0)
        losses = []
        for step in range(steps):
            starts = rng.integers(0, corpus.size - seq - 1, batch)
            window = np.stack([corpus[s : s + seq + 1] for s in starts])
            _, stats, grads = T.loss_and_grads(params, cfg, window[:, :-1], window[:, 1:])
            if feedback:
                sent = compressor.encode(grads)[1]
            else:
                sent = {k: codec.encode_decoded(g)[1] for k, g in grads.items()}
            update = {k: np.array(v).reshape(grads[k].shape) for k, v in sent.items()}
            clip_grad_norm(update, 1.0)
            opt.step(params, update, lr=lr_schedule(step, 1e-2, 10, steps))
            losses.append(stats["ce_loss"])
        assert losses[0] > 5.0
        return float(np.mean(losses[-10:]))

    on, off = final_loss(True), final_loss(False)
    assert on < 2.0, f"TOPK with feedback stalled at {on:.3f}"
    assert on <= off - 0.1, f"feedback on {on:.3f} is not clearly below feedback off {off:.3f}"


def test_error_feedback_reset_of_an_unknown_name() -> None:
    fb = ErrorFeedback(TopKCodec(0.5))
    fb.reset("never-sent")
    fb.reset()
