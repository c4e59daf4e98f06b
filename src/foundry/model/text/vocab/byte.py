"""Foundry's own vocabulary, the one byte tokenizer: token ``b + 3`` is the byte ``b`` of the
UTF-8 text; 0, 1, 2 are ``<unk>``, ``<s>`` (BOS) and ``</s>`` (EOS), the vocabulary every
Foundry file declares (:data:`BYTE_VOCABULARY`: ``<0x00>`` ... ``<0xFF>``).

:func:`encode` gives the ids as an int32 array (the corpus encodes whole documents with it),
:class:`ByteModel` is the same as the tokenizer pipeline's model of a byte vocabulary, and
:func:`decode` drops the specials and decodes the bytes with ``errors="replace"``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from foundry.model.spec.config import BOS_ID, EOS_ID, N_BYTE_TOKENS, N_SPECIAL_TOKENS, VOCAB_SIZE
from foundry.model.text.vocab.models import TokenizerError

__all__ = ["BYTE_VOCABULARY", "ByteModel", "TokenArray", "decode", "encode", "token_bytes"]

BYTE_VOCABULARY = ("<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(N_BYTE_TOKENS)))
"""Foundry's own vocabulary, as gguf_io writes it."""

TokenArray = npt.NDArray[np.int32]


def encode(text: str, bos: bool = True, eos: bool = False) -> TokenArray:
    """UTF-8 bytes of ``text`` as tokens ``byte + 3``, optionally framed by BOS / EOS."""
    raw = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
    first = int(bos)
    out = np.empty(first + len(raw) + int(eos), dtype=np.int32)
    out[first : first + len(raw)] = raw.astype(np.int32) + N_SPECIAL_TOKENS
    if bos:
        out[0] = BOS_ID
    if eos:
        out[-1] = EOS_ID
    return out


def token_bytes(tokens: npt.ArrayLike) -> bytes:
    """The bytes of a token sequence, specials dropped; TokenizerError names an id outside the
    vocabulary."""
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    bad = (arr < 0) | (arr >= VOCAB_SIZE)
    if bad.any():
        raise TokenizerError(
            f"token {int(arr[bad][0])} is outside the byte vocabulary [0, {VOCAB_SIZE})"
        )
    return (arr[arr >= N_SPECIAL_TOKENS] - N_SPECIAL_TOKENS).astype(np.uint8).tobytes()


def decode(tokens: npt.ArrayLike) -> str:
    """Text of a token sequence: specials dropped, bytes decoded with ``errors="replace"``."""
    return token_bytes(tokens).decode("utf-8", errors="replace")


class ByteModel:
    """The tokenizer pipeline's model for the byte vocabulary: :func:`encode`'s ids."""

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in encode(text, bos=False)]
