"""Tokenizer models: one piece of text in, token ids out.

- :class:`SpmModel`: SentencePiece BPE as llama.cpp's ``llm_tokenizer_spm`` runs it. The piece
  is cut into UTF-8 characters; the adjacent pair whose joined text is a token with the highest
  score is merged first (ties: leftmost), until no pair forms a token. A symbol that is not a
  token falls back to its bytes' ``<0xNN>`` tokens.
- :class:`BpeModel`: BPE as ``llm_tokenizer_bpe``: the pair with the lowest rank in
  ``tokenizer.ggml.merges`` merges first (ties: leftmost). With ``ignore_merges`` (Llama 3) a
  piece that is itself a token is taken whole. A symbol left that is no token becomes one-byte
  tokens: byte-level BPE looks its ASCII bytes up as characters; SentencePiece-style BPE
  (Gemma 4, ``byte_ids``) uses ``<0xNN>``, and takes a run of newlines that is a token whole.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence


class TokenizerError(ValueError):
    """A vocabulary or token id we cannot use; the message names the key, value or id."""


class SpmModel:
    def __init__(
        self, ids: Mapping[str, int], scores: Sequence[float], byte_ids: Sequence[int | None]
    ) -> None:
        self._ids = ids
        self._scores = scores
        self._byte_ids = byte_ids

    def tokenize(self, text: str) -> list[int]:
        ids = self._ids
        scores = self._scores
        n_chars = len(text)
        length = [1] * n_chars  # symbol starting at i spans text[i : i + length[i]]; 0 = merged
        nxt = list(range(1, n_chars + 1))
        nxt[-1:] = [-1] if n_chars else []
        prv = list(range(-1, n_chars - 1))
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, length)

        def add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            size = length[left] + length[right]
            token = ids.get(text[left : left + size])
            if token is not None:
                heapq.heappush(heap, (-scores[token], left, right, size))

        for i in range(1, n_chars):
            add(i - 1, i)
        while heap:  # bounded: every merge removes a symbol, stale entries are dropped
            _, left, right, size = heapq.heappop(heap)
            if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
                continue
            length[left] = size
            length[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add(prv[left], left)
            add(left, nxt[left])

        out: list[int] = []
        i = 0 if n_chars else -1
        while i >= 0:  # bounded: follows the chain of symbols left to right
            piece = text[i : i + length[i]]
            token = ids.get(piece)
            if token is not None:
                out.append(token)
            else:
                out.extend(self._bytes(piece))
            i = nxt[i]
        return out

    def _bytes(self, piece: str) -> list[int]:
        out = []
        for b in piece.encode("utf-8"):
            token = self._byte_ids[b]
            if token is None:
                raise TokenizerError(f"the vocabulary has no token for byte 0x{b:02X} of {piece!r}")
            out.append(token)
        return out


class BpeModel:
    # Words remembered (text repeats words); the cache is emptied when it grows past this.
    CACHE_WORDS = 65536

    def __init__(
        self,
        ids: Mapping[str, int],
        ranks: Mapping[str, int],
        ignore_merges: bool,
        byte_ids: Sequence[int | None] | None = None,
    ) -> None:
        """``ranks``: ``"left right"`` -> merge rank (tokenizer.ggml.merges' order);
        ``byte_ids``: byte -> ``<0xNN>`` token for SentencePiece-style BPE."""
        self._ids = ids
        self._ranks = ranks
        self._ignore_merges = ignore_merges
        self._byte_ids = byte_ids
        self._cache: dict[str, list[int]] = {}

    def tokenize(self, word: str) -> list[int]:
        hit = self._cache.get(word)
        if hit is not None:
            return list(hit)
        out = self._tokenize(word)
        if len(self._cache) >= self.CACHE_WORDS:
            self._cache.clear()
        self._cache[word] = out
        return list(out)

    def _tokenize(self, word: str) -> list[int]:
        ids = self._ids
        if self._ignore_merges and word in ids:
            return [ids[word]]
        if self._byte_ids is not None and word.strip("\n") == "" and word in ids:
            return [ids[word]]
        ranks = self._ranks
        symbols = list(word)  # "" once merged into its left neighbour
        n = len(symbols)
        nxt = [*range(1, n), -1] if n else []
        prv = list(range(-1, n - 1))
        heap: list[tuple[int, int, int, str]] = []  # (rank, left, right, joined text)

        def add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            rank = ranks.get(f"{symbols[left]} {symbols[right]}")
            if rank is not None:
                heapq.heappush(heap, (rank, left, right, symbols[left] + symbols[right]))

        for i in range(1, n):
            add(i - 1, i)
        while heap:  # bounded: every merge removes a symbol, stale entries are dropped
            _, left, right, joined = heapq.heappop(heap)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != joined:
                continue
            symbols[left] = joined
            symbols[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add(prv[left], left)
            add(left, nxt[left])

        out: list[int] = []
        for sym in symbols:
            if not sym:
                continue
            token = ids.get(sym)
            if token is not None:
                out.append(token)
                continue
            # llama.cpp looks each byte of the symbol up as a one-byte token and drops misses.
            for b in sym.encode("utf-8"):
                if self._byte_ids is not None:
                    token = self._byte_ids[b]
                else:
                    token = ids.get(chr(b)) if b < 0x80 else None
                if token is not None:
                    out.append(token)
        return out
