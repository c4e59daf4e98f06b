"""Pre-tokenizers: text cut into the pieces a tokenizer model sees, one piece at a time.

Two stages, as llama.cpp's ``llama_vocab::tokenize`` runs them:

1. :class:`SpecialSplitter` cuts the text at the special tokens (``parse_special``): the result
   is a row of plain runs (``str``) and token ids (``int``). User-defined tokens are always cut
   out; control and unknown tokens only when ``parse_special`` is on. Longer token texts are
   matched first; a token marked ``lstrip`` / ``rstrip`` eats the ASCII whitespace on that side.
2. :class:`RegexSplitter` cuts a plain run with the regex set a ``gpt2`` vocabulary's
   ``tokenizer.ggml.pre`` names (:data:`PRE_TOKENIZERS`): each regex in turn splits every piece
   the previous one left; a stretch no match covers stays a piece of its own, and a regex sees
   only its piece (a look-ahead stops at the piece's end). :class:`ByteLevel` then writes each
   piece's UTF-8 bytes as GPT-2's printable characters (:func:`bytes_to_unicode`).

The regexes are llama.cpp's own (``llm_tokenizer_bpe``), written with ``\\p{L}``, ``\\p{N}``,
``\\p{P}``, ``\\s`` and ``\\S``; :func:`compile_pattern` turns those into the standard library's
``re`` with explicit classes built from :mod:`unicodedata` (general categories L*, N*, P*) and
llama.cpp's whitespace table (Unicode White_Space). Python's Unicode version may be older than
llama.cpp's table; a character assigned since then splits as "other".
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Unicode White_Space, the table llama.cpp's \s uses (unicode-data.cpp).
WHITESPACE = (
    *range(0x09, 0x0E),
    0x20,
    0x85,
    0xA0,
    0x1680,
    *range(0x2000, 0x200B),
    0x2028,
    0x2029,
    0x202F,
    0x205F,
    0x3000,
)


def _ranges(codepoints: Sequence[int]) -> str:
    """A character-class body (no brackets) for sorted code points, as \\U escapes."""
    out: list[str] = []
    i = 0
    n = len(codepoints)
    while i < n:  # bounded: i grows every turn
        j = i
        while j + 1 < n and codepoints[j + 1] == codepoints[j] + 1:
            j += 1
        lo, hi = codepoints[i], codepoints[j]
        out.append(f"\\U{lo:08X}" if lo == hi else f"\\U{lo:08X}-\\U{hi:08X}")
        i = j + 1
    return "".join(out)


@functools.cache
def _category_classes() -> dict[str, str]:
    """Class bodies for \\p{L}, \\p{N}, \\p{P} and \\s (built once, on first use: ~0.3 s)."""
    by_major: dict[str, list[int]] = {"L": [], "N": [], "P": []}
    category = unicodedata.category
    for cp in range(sys.maxunicode + 1):
        major = category(chr(cp))[0]
        if major in by_major:
            by_major[major].append(cp)
    classes = {f"\\p{{{k}}}": _ranges(v) for k, v in by_major.items()}
    classes["\\s"] = _ranges(sorted(WHITESPACE))
    return classes


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """llama.cpp's regex syntax (\\p{L}, \\p{N}, \\p{P}, \\s, \\S) as a standard ``re`` pattern."""
    classes = _category_classes()
    out: list[str] = []
    inside = False
    i = 0
    while i < len(pattern):  # bounded: i grows every turn
        c = pattern[i]
        if c == "\\" and pattern.startswith("\\p{", i):
            end = pattern.index("}", i) + 1
            body = classes[pattern[i:end]]
            out.append(body if inside else f"[{body}]")
            i = end
            continue
        if c == "\\" and i + 1 < len(pattern) and pattern[i + 1] in "sS":
            body = classes["\\s"]
            if pattern[i + 1] == "s":
                out.append(body if inside else f"[{body}]")
            else:
                if inside:
                    raise ValueError(f"\\S inside a character class is not supported: {pattern}")
                out.append(f"[^{body}]")
            i += 2
            continue
        if c == "\\":  # any other escape passes through whole
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        out.append(c)
        i += 1
    return re.compile("".join(out))


# llama.cpp's regex sets (llm_tokenizer_bpe), by pre-tokenizer family.
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = (
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN2 = (
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
    "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_DEFAULT = ("[\\p{P}\\$\\+<=>\\^~\\|]+", _GPT2, "\\p{N}+", "[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizerSpec:
    """What a ``tokenizer.ggml.pre`` name means: regexes, and llama.cpp's flags for it."""

    patterns: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token is taken as it is
    add_bos: bool = False  # the default of tokenizer.ggml.add_bos_token
    # SentencePiece-style BPE (Gemma 4): spaces written "▁", pieces kept as UTF-8 (no GPT-2
    # byte table), bytes falling back to <0xNN>, a run of newlines that is a token taken whole.
    spm_style: bool = False


_SPECS = {
    "default": PreTokenizerSpec(_DEFAULT),
    "llama3": PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True),
    "qwen2": PreTokenizerSpec((_QWEN2,)),
    "smollm": PreTokenizerSpec(("\\p{N}", _GPT2)),
    "gpt-2": PreTokenizerSpec((_GPT2,)),
    "gemma4": PreTokenizerSpec(("[^\\n]+|[\\n]+",), spm_style=True),
}
_FAMILIES = {
    "default": ("default",),
    "llama3": (
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
    ),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"),
    "smollm": ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
    "gpt-2": ("gpt-2", "phi-2", "mpt", "olmo", "exaone4", "trillion", "granite-docling"),
    "gemma4": ("gemma4",),
}
# tokenizer.ggml.pre -> its spec; the names are llama.cpp's (llama_vocab::impl::load).
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    name: _SPECS[family] for family, names in _FAMILIES.items() for name in names
}


class RegexSplitter:
    """Splits a piece of text with a row of regexes, each one over every piece left before."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self._regexes = [compile_pattern(p) for p in patterns]

    def split(self, text: str) -> list[str]:
        pieces = [text] if text else []
        for regex in self._regexes:
            out: list[str] = []
            for piece in pieces:
                last = 0
                for m in regex.finditer(piece):
                    start, end = m.span()
                    if start == end:
                        continue
                    if start > last:
                        out.append(piece[last:start])
                    out.append(piece[start:end])
                    last = end
                if last < len(piece):
                    out.append(piece[last:])
            pieces = out
        return pieces


@functools.cache
def bytes_to_unicode() -> tuple[str, ...]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves,
    the others to U+0100 upwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return tuple(table)


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in enumerate(bytes_to_unicode())}


class ByteLevel:
    """A byte-level BPE's pre-tokenizer: regex split, then each piece's UTF-8 bytes written
    as GPT-2's printable characters."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self._splitter = RegexSplitter(patterns)

    def split(self, text: str) -> list[str]:
        table = bytes_to_unicode()
        return [
            "".join([table[b] for b in piece.encode("utf-8")])
            for piece in self._splitter.split(text)
        ]


class WholeText:
    """SentencePiece's pre-tokenizer: none, the model sees the whole run."""

    def split(self, text: str) -> list[str]:
        return [text] if text else []


Fragment = str | int  # a plain run of text, or a special token's id


class SpecialSplitter:
    """Cuts text at special tokens, longest first, as llama.cpp's ``tokenizer_st_partition``,
    in time linear in the text.

    llama.cpp takes the tokens one by one in priority order, each splitting every plain run
    the earlier ones left: its cost is the number of special tokens (thousands) times the
    number of runs. Here one pass of a trie over the text finds every occurrence of every
    token (at most the longest token's length of work per character), and the same priority
    rule is then applied to those occurrences: a token's occurrence is taken when it lies in
    what the earlier tokens left (a free run) and after this token's previous match in that
    run; ``lstrip`` / ``rstrip`` mark the whitespace beside it as dropped.
    """

    def __init__(
        self,
        specials: Sequence[tuple[int, str, bool, bool, bool]],
    ) -> None:
        """``specials``: (id, text, always, lstrip, rstrip) in matching order; ``always``
        tokens (user-defined) are cut out even when ``parse_special`` is off."""
        self._specials = [s for s in specials if s[1]]
        self._trie: dict[str, Any] = {}
        for rank, (_, text, *_rest) in enumerate(self._specials):
            node = self._trie
            for ch in text:
                node = node.setdefault(ch, {})
            node.setdefault("", []).append(rank)  # "" is no character: the ranks ending here
        self._first = (
            re.compile("[" + "".join(sorted(re.escape(c) for c in self._trie)) + "]")
            if self._trie
            else None
        )

    def _occurrences(self, text: str) -> dict[int, list[int]]:
        """Rank -> the start of every occurrence of that token in ``text``, ascending."""
        found: dict[int, list[int]] = {}
        if self._first is None:
            return found
        trie, n = self._trie, len(text)
        for m in self._first.finditer(text):
            i = m.start()
            node = trie
            j = i
            while j < n and (child := node.get(text[j])) is not None:
                node = child
                j += 1
                for rank in node.get("", ()):
                    found.setdefault(rank, []).append(i)
        return found

    def matches(self, text: str, parse_special: bool) -> list[tuple[int, int, int, bool]]:
        """The tokens cut out of ``text``: (start, end, id, always), by start; the whitespace a
        token strips is outside its span."""
        return [
            (p, p + len(self._specials[r][1]), self._specials[r][0], self._specials[r][2])
            for p, r in self._take(text, parse_special)[0]
        ]

    def _take(self, text: str, parse_special: bool) -> tuple[list[tuple[int, int]], bytearray]:
        """The occurrences taken, (start, rank) by start, and the characters they occupy
        (the tokens' own and the whitespace they strip)."""
        n = len(text)
        busy = bytearray(n)
        taken: list[tuple[int, int]] = []
        found = self._occurrences(text)
        for rank in sorted(found):
            _, token_text, always, lstrip, rstrip = self._specials[rank]
            if not (always or parse_special):
                continue
            size = len(token_text)
            resume = 0  # this token's scan resumes here in its run (after its last match)
            for p in found[rank]:
                if p < resume or busy.find(1, p, p + size) >= 0:
                    continue
                left = p
                if lstrip:
                    while left > resume and not busy[left - 1] and text[left - 1] in _ASCII_SPACE:
                        left -= 1
                end = p + size
                if rstrip:
                    while end < n and not busy[end] and text[end] in _ASCII_SPACE:
                        end += 1
                busy[left:end] = b"\x01" * (end - left)
                taken.append((p, rank))
                resume = end
        taken.sort()
        return taken, busy

    def split(self, text: str, parse_special: bool) -> list[Fragment]:
        taken, busy = self._take(text, parse_special)
        out: list[Fragment] = []
        pos = 0
        for p, rank in taken:
            self._plain(text, busy, pos, p, out)
            out.append(self._specials[rank][0])
            pos = p + len(self._specials[rank][1])
        self._plain(text, busy, pos, len(text), out)
        return out

    @staticmethod
    def _plain(text: str, busy: bytearray, start: int, end: int, out: list[Fragment]) -> None:
        """The run between two tokens, less the whitespace they strip (at its two ends)."""
        lo = busy.find(0, start, end)
        if lo < 0:
            return
        hi = busy.rfind(0, lo, end) + 1
        out.append(text[lo:hi])


# C's isspace in the "C" locale: what lstrip / rstrip remove.
_ASCII_SPACE = frozenset(" \t\n\v\f\r")
