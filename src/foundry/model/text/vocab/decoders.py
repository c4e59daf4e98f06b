"""Decoders: token ids back to bytes and text, as llama.cpp's ``token_to_piece`` (special off).

A token's piece is:

- control and unknown tokens: nothing (``<s>``, ``<end_of_turn>``, ... do not show);
- user-defined tokens: their text;
- byte tokens ``<0xNN>``: the byte;
- normal tokens: the text with SentencePiece's "▁" turned back into a space
  (:func:`spm_piece`), or a byte-level BPE's printable characters turned back into their bytes
  (:func:`byte_level_piece`);
- anything else (unused, undefined): nothing.

Text is the pieces' bytes decoded as UTF-8 with ``errors="replace"``. :class:`StreamDecoder`
gives the same text piece by piece and never splits a character: the bytes of an incomplete
character wait for the next token.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from foundry.model.text.vocab.models import TokenizerError
from foundry.model.text.vocab.normalizers import SPM_SPACE
from foundry.model.text.vocab.pretokenizers import unicode_to_bytes
from foundry.model.text.vocab.tokens import Attr, Vocabulary

_HIDDEN = int(Attr.CONTROL | Attr.UNKNOWN)
_USER_DEFINED, _NORMAL, _BYTE = int(Attr.USER_DEFINED), int(Attr.NORMAL), int(Attr.BYTE)


def spm_piece(text: str) -> bytes:
    return text.replace(SPM_SPACE, " ").encode("utf-8")


def byte_level_piece(text: str) -> bytes:
    table = unicode_to_bytes()
    # A character outside GPT-2's table (a malformed vocabulary) is kept as its UTF-8.
    return b"".join(bytes((table[c],)) if c in table else c.encode("utf-8") for c in text)


class PieceDecoder:
    """Token id -> piece bytes, computed on first use (a 262k vocabulary loads quickly)."""

    def __init__(self, vocab: Vocabulary, normal: Callable[[str], bytes]) -> None:
        self._texts = vocab.texts
        self._attrs = vocab.attrs
        self._normal = normal
        self._cache: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._texts)

    def piece(self, token: int) -> bytes:
        hit = self._cache.get(token)
        if hit is not None:
            return hit
        if not 0 <= token < len(self._texts):
            raise TokenizerError(f"token {token} is outside the vocabulary [0, {len(self._texts)})")
        attr = self._attrs[token]
        text = self._texts[token]
        if attr & _HIDDEN:
            out = b""
        elif attr & _USER_DEFINED:
            out = text.encode("utf-8")
        elif attr & _NORMAL:
            out = self._normal(text)
        elif attr & _BYTE:
            out = bytes((int(text[3:5], 16),))
        else:
            out = b""
        self._cache[token] = out
        return out

    def join(self, tokens: Sequence[int]) -> bytes:
        piece = self.piece
        return b"".join([piece(int(t)) for t in tokens])


class StreamDecoder:
    """Turns tokens into text pieces without ever splitting a multi-byte UTF-8 character.

    ``"".join(d.feed(t) for t in tokens) + d.flush() == tokenizer.decode(tokens)``.
    """

    def __init__(self, pieces: PieceDecoder) -> None:
        self._pieces = pieces
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Text completed by this token ("" while a character is still incomplete)."""
        return self._decoder.decode(self._pieces.piece(int(token_id)), final=False)

    def flush(self) -> str:
        """End of stream: an incomplete character left over becomes U+FFFD."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
