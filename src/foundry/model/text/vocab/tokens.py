"""The vocabulary a GGUF file declares: token texts, scores, types, special ids and flags.

Read as llama.cpp's ``llama_vocab::impl::load`` reads it, so that the same file gives the same
special tokens, end-of-generation set and flags:

- ``tokenizer.ggml.model``: ``llama`` (SentencePiece, ``spm``) or ``gpt2`` (byte-level BPE);
  anything else is refused. A ``gpt2`` vocabulary's ``tokenizer.ggml.pre`` must be one of
  :data:`~foundry.model.text.vocab.pretokenizers.PRE_TOKENIZERS`.
- Defaults by model, then the file's keys: ``spm`` has BOS 1, EOS 2, UNK 0, ``add_bos`` on and
  ``add_space_prefix`` on; ``gpt2`` has BOS = EOS = 11 and ``add_bos`` as its pre-tokenizer says.
  A special id outside the vocabulary is ignored (the default stays), as llama.cpp does.
- Token types (``tokenizer.ggml.token_type``) become attribute bits; tokens whose text names an
  end of turn, FIM or end of generation (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``, ...)
  are marked control, and the end-of-generation set is those texts plus EOS, EOT and EOM.
- The special tokens :class:`~foundry.model.text.vocab.pretokenizers.SpecialSplitter` matches are
  the control, user-defined and unknown tokens, longest text first; in a Phi-3 file
  (``general.name``) they strip the whitespace to their right, as llama.cpp sets it.
"""

from __future__ import annotations

import array
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from foundry.model.formats.gguf_meta import expect_bool, expect_int, expect_list, expect_str
from foundry.model.text.vocab.models import TokenizerError
from foundry.model.text.vocab.pretokenizers import PRE_TOKENIZERS


class Attr(enum.IntFlag):
    """llama.cpp's ``llama_token_attr`` bits."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# tokenizer.ggml.token_type value (llama_token_type) -> attribute bits.
TYPE_ATTR = {
    0: Attr.UNDEFINED,
    1: Attr.NORMAL,
    2: Attr.UNKNOWN,
    3: Attr.CONTROL,
    4: Attr.USER_DEFINED,
    5: Attr.UNUSED,
    6: Attr.BYTE,
}

# Texts llama.cpp recognises (llama-vocab.cpp); the first match sets the id when the file has none.
EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
EOM_TEXTS = ("<|eom_id|>",)
FIM_TEXTS = {
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)
# gpt-oss: always rendered, never control.
ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

_KEY = "tokenizer.ggml."
# Special id name -> its key(s); later keys of a name override earlier ones, as in llama.cpp.
_SPECIAL_KEYS = (
    ("bos", "bos_token_id"),
    ("eos", "eos_token_id"),
    ("eot", "eot_token_id"),
    ("eom", "eom_token_id"),
    ("unk", "unknown_token_id"),
    ("sep", "seperator_token_id"),
    ("pad", "padding_token_id"),
    ("mask", "mask_token_id"),
    ("fim_pre", "fim_pre_token_id"),
    ("fim_suf", "fim_suf_token_id"),
    ("fim_mid", "fim_mid_token_id"),
    ("fim_pad", "fim_pad_token_id"),
    ("fim_rep", "fim_rep_token_id"),
    ("fim_sep", "fim_sep_token_id"),
    ("fim_pre", "prefix_token_id"),
    ("fim_suf", "suffix_token_id"),
    ("fim_mid", "middle_token_id"),
)
MODELS = {"llama": "spm", "gpt2": "bpe", "gemma4": "bpe"}


@dataclass
class Vocabulary:
    """A file's vocabulary, read once; the tokenizer's pipeline objects share it."""

    kind: str  # "spm" or "bpe"
    pre: str  # tokenizer.ggml.pre ("" for spm)
    texts: Sequence[str]
    scores: Sequence[float]
    attrs: list[int]
    ids: dict[str, int]
    special: dict[str, int | None]  # bos, eos, eot, eom, unk, ... -> id or None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    ranks: dict[str, int]  # "left right" -> merge rank
    eog_ids: frozenset[int]

    def byte_ids(self) -> list[int | None]:
        """Byte b -> its token: ``<0xNN>``, else the one-character token (llama.cpp's order)."""
        out: list[int | None] = []
        for b in range(256):
            token = self.ids.get(f"<0x{b:02X}>")
            out.append(token if token is not None else self.ids.get(chr(b)) if b < 0x80 else None)
        return out

    def special_order(self) -> list[int]:
        """Control, user-defined and unknown tokens, longest text first (then by id)."""
        mask = int(Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)  # ints: IntFlag's & is slow
        found = [i for i, a in enumerate(self.attrs) if a & mask]
        return sorted(found, key=lambda i: (-len(self.texts[i].encode("utf-8")), i))


def _array(meta: Mapping[str, Any], key: str, n: int | None, element: type) -> Sequence[Any] | None:
    value = meta.get(_KEY + key)
    if value is None:
        return None
    value = expect_list(_KEY + key, value, element, TokenizerError)
    if n is not None and len(value) < n:
        raise TokenizerError(
            f"metadata key {_KEY + key!r} has {len(value)} entries, the vocabulary {n}"
        )
    return value


def _flag(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    value = meta.get(_KEY + key)
    return default if value is None else expect_bool(_KEY + key, value, TokenizerError)


def _merge_ranks(merges: Sequence[str]) -> dict[str, int]:
    """``"left right"`` -> rank; a pair listed twice keeps its first rank (llama.cpp's
    ``bpe_ranks.emplace``). llama.cpp cuts a merge at its first space after the first character;
    the joined key is the same string, and BPE symbols never hold a space (byte-level BPE writes
    it as "Ġ"), so looking up ``left + " " + right`` finds exactly llama.cpp's pairs."""
    n = len(merges)
    return dict(zip(reversed(merges), range(n - 1, -1, -1), strict=True))


def read_vocabulary(meta: Mapping[str, Any]) -> Vocabulary:
    """The vocabulary of a GGUF file's metadata; :class:`TokenizerError` names what is wrong."""
    model = meta.get(_KEY + "model")
    if not isinstance(model, str) or model not in MODELS:
        raise TokenizerError(
            f"tokenizer.ggml.model {model!r} is not supported (supported: llama, gpt2, gemma4)"
        )
    kind = MODELS[str(model)]
    texts = _array(meta, "tokens", None, str)
    if not texts:
        raise TokenizerError("metadata key 'tokenizer.ggml.tokens' is missing or empty")
    n = len(texts)
    texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(texts)] if "" in texts else texts
    scores = array.array("f", _array(meta, "scores", n, float) or bytes(4 * n))  # f32 as stored
    types = _array(meta, "token_type", n, int)
    if types is None:
        attrs = [int(Attr.NORMAL)] * n
    else:
        table = {k: int(v) for k, v in TYPE_ATTR.items()}
        attrs = [table.get(int(t), 0) for t in types[:n]]
    ids = dict(zip(texts, range(n), strict=True))  # a repeated text keeps its last id

    pre = ""
    ranks: dict[str, int] = {}
    if kind == "spm":
        special: dict[str, int | None] = {"bos": 1, "eos": 2, "unk": 0}
        add_bos, add_space_prefix = True, True
    else:
        # a gemma4 vocabulary is SentencePiece-style BPE whatever its pre says (llama.cpp)
        pre_key = meta.get(_KEY + "pre")
        pre = expect_str(_KEY + "pre", pre_key, TokenizerError) if pre_key is not None else ""
        pre = "gemma4" if model == "gemma4" else pre or "default"
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"tokenizer.ggml.pre {pre!r} is not supported (supported: "
                f"{', '.join(sorted(PRE_TOKENIZERS))})"
            )
        merges = _array(meta, "merges", None, str)
        if merges is None:
            raise TokenizerError("metadata key 'tokenizer.ggml.merges' is missing")
        ranks = _merge_ranks(merges)
        special = {} if model == "gemma4" else {"bos": 11, "eos": 11}
        add_bos, add_space_prefix = PRE_TOKENIZERS[pre].add_bos, False
    add_eos = False
    for name, _ in _SPECIAL_KEYS:
        special.setdefault(name, None)
    for name, default in list(special.items()):
        if default is not None and default >= n:
            special[name] = None
    for name, key in _SPECIAL_KEYS:
        value = meta.get(_KEY + key)
        # An id outside the vocabulary is ignored (llama.cpp); one that is no integer is an error.
        if (
            value is not None
            and 0 <= expect_int(_KEY + key, value, -(2**63), 2**64, TokenizerError) < n
        ):
            special[name] = value
    add_bos = _flag(meta, "add_bos_token", add_bos)
    add_eos = _flag(meta, "add_eos_token", add_eos)
    add_space_prefix = _flag(meta, "add_space_prefix", add_space_prefix)
    add_bos = add_bos or pre == "gemma4"  # llama.cpp's override for Gemma 4

    def mark_control(token: int) -> None:
        attrs[token] |= int(Attr.CONTROL)

    # Ids found by text, as llama.cpp's "auto-detect special tokens by text".
    for name, candidates in (("eot", EOT_TEXTS), ("eom", EOM_TEXTS), *FIM_TEXTS.items()):
        if special[name] is not None:
            continue
        found = sorted(ids[t] for t in candidates if t in ids)
        if found:
            special[name] = found[0]
            mark_control(found[0])
    eog: set[int] = set()
    for name in ("fim_pad", "fim_rep", "fim_sep"):
        token = special[name]
        if token is not None:
            eog.add(token)
    for text in EOG_TEXTS:
        if text in ids:
            eog.add(ids[text])
            mark_control(ids[text])
    for text in ALWAYS_USER_DEFINED:
        if text in ids:
            attrs[ids[text]] = int(Attr.USER_DEFINED)
    for name in ("eos", "eot", "eom"):
        token = special[name]
        if token is not None:
            eog.add(token)
    eog_texts = {texts[i] for i in eog}
    has_call = bool(eog_texts & {"<|call|>", "<|calls|>"})
    if "<|end|>" in eog_texts and has_call and eog_texts & {"<|return|>", "<|flush|>"}:
        end = ids["<|end|>"]
        eog.discard(end)
        attrs[end] = int(Attr.USER_DEFINED)
    if "</s>" in ids and eog_texts & {"<|tool_response>", "<|plamo:eos|>"}:
        eog.discard(ids["</s>"])
        attrs[ids["</s>"]] = int(Attr.NORMAL)

    vocab = Vocabulary(
        kind=kind,
        pre=pre,
        texts=texts,
        scores=scores,
        attrs=attrs,
        ids=ids,
        special=special,
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        ranks=ranks,
        eog_ids=frozenset(eog),
    )
    name = meta.get("general.name", "")
    name = expect_str("general.name", name, TokenizerError).lower()
    if "phi-3" in name or "phi3" in name:
        for token in vocab.special_order():
            attrs[token] |= int(Attr.RSTRIP)
        for text, on in (
            ("</s>", True),
            ("<unk>", False),
            ("<s>", False),
            ("<|endoftext|>", False),
        ):
            if text in ids:
                attrs[ids[text]] = (
                    attrs[ids[text]] | int(Attr.RSTRIP)
                    if on
                    else attrs[ids[text]] & ~int(Attr.RSTRIP)
                )
    return vocab
