"""Single-process text generation: the reference the tensor-parallel pair must reproduce."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import numpy.typing as npt

from foundry.model.infer.engines import InferenceEngine
from foundry.model.infer.inference import Engine
from foundry.model.infer.sampling import make_rng, sample
from foundry.model.spec.config import ModelConfig
from foundry.model.text.vocab import Tokenizer, own_tokenizer

F32 = npt.NDArray[np.float32]


def generate_tokens(
    engine: InferenceEngine,
    prompt: str,
    max_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> Iterator[int]:
    """Yield up to ``max_tokens`` new tokens after ``prompt`` (encoded by ``tokenizer``, the
    file's; Foundry's byte vocabulary by default); stops at an end-of-generation token.

    Temperature 0 is greedy. The prompt is evaluated as one block, then one token per step.
    Stops early, without error, when the context is full.
    """
    if engine.world != 1:
        raise ValueError("generate_tokens runs a whole model; use the TP leader for a pair")
    session = engine.new_session()
    rng = make_rng(seed)
    tokenizer = tokenizer or own_tokenizer()
    tokens = tokenizer.encode(prompt)
    if len(tokens) > session.ctx_size:
        raise ValueError(
            f"the prompt is {len(tokens)} tokens, the model's context is {session.ctx_size}"
        )
    logits = engine.decode(session, tokens, last_only=True)[-1]  # (V,): the last row's only
    for _ in range(max_tokens):
        token = sample(logits, temperature, top_p, rng)
        if token in tokenizer.eog_ids:
            return
        yield token
        if session.free == 0:
            return
        logits = engine.decode(session, [token])[-1]


def greedy_text(cfg: ModelConfig, params: Mapping[str, F32], prompt: str, max_tokens: int) -> str:
    """The greedy continuation of ``prompt`` as text: what a training run shows as it goes
    (``foundry train``, ``foundry up``), to watch the model learn."""
    return own_tokenizer().decode(list(generate_tokens(Engine(cfg, params), prompt, max_tokens)))


def printable(text: str) -> str:
    """Generated text for a terminal: control characters other than newline escaped, so a
    half-trained model's bytes cannot move the cursor or ring the bell."""
    return "".join(
        c if c == "\n" or c.isprintable() else c.encode("unicode_escape").decode("ascii")
        for c in text
    )
