"""Normalizers: a plain run of text as the tokenizer model expects it.

SentencePiece vocabularies (:class:`SpaceEscape`) write spaces as "▁" (U+2581) and, when
``tokenizer.ggml.add_space_prefix`` is on, put one space before a run that starts the text or
follows a special token (llama.cpp's ``llama_escape_whitespace`` and ``is_prev_special``).
Byte-level BPE and Foundry's byte vocabulary take the text as it is (:class:`Identity`).
"""

from __future__ import annotations

SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space


class SpaceEscape:
    def __init__(self, add_space_prefix: bool) -> None:
        self.add_space_prefix = add_space_prefix

    def normalize(self, text: str, after_special: bool) -> str:
        if self.add_space_prefix and after_special:
            text = " " + text
        return text.replace(" ", SPM_SPACE)


class Identity:
    def normalize(self, text: str, after_special: bool) -> str:
        return text
