"""The tokenizer: five small objects in a row, chosen by the file's vocabulary.

``encode``: special tokens cut out (:class:`~.pretokenizers.SpecialSplitter`), then for each
plain run the normalizer (:mod:`.normalizers`), the pre-tokenizer (:mod:`.pretokenizers`) and
the model (:mod:`.models`); the post-processor (:class:`Framing`) adds BOS / EOS. ``decode``
and :meth:`Tokenizer.stream_decoder` run the decoder (:mod:`.decoders`).

=============  ======================  ===================  ====================  =========
vocabulary     normalizer              pre-tokenizer        model                 decoder
=============  ======================  ===================  ====================  =========
``llama``      "▁" escape, prefix      whole run            SPM (scores, bytes)   "▁" -> " "
``gpt2``       none                    regex set + bytes    BPE (merge ranks)     byte table
``gemma4``     "▁" escape              newline runs apart   BPE, ``<0xNN>``       "▁" -> " "
Foundry bytes  none                    whole run            one token a byte      bytes
=============  ======================  ===================  ====================  =========

Foundry's own files (``<unk>``, ``<s>``, ``</s>``, ``<0x00>`` ... ``<0xFF>``) give exactly
:func:`foundry.model.text.vocab.byte.encode`'s ids (:mod:`.byte`, the one byte tokenizer):
every UTF-8 byte is a token, no space escaping.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from foundry.model.formats.gguf_meta import read_metadata
from foundry.model.spec.config import N_BYTE_TOKENS
from foundry.model.text.vocab.byte import BYTE_VOCABULARY, ByteModel
from foundry.model.text.vocab.decoders import (
    PieceDecoder,
    StreamDecoder,
    byte_level_piece,
    spm_piece,
)
from foundry.model.text.vocab.models import BpeModel, SpmModel, TokenizerError
from foundry.model.text.vocab.normalizers import Identity, SpaceEscape
from foundry.model.text.vocab.pretokenizers import (
    PRE_TOKENIZERS,
    ByteLevel,
    RegexSplitter,
    SpecialSplitter,
    WholeText,
)
from foundry.model.text.vocab.tokens import Attr, Vocabulary, read_vocabulary


class Normalizer(Protocol):
    def normalize(self, text: str, after_special: bool) -> str: ...


class PreTokenizer(Protocol):
    def split(self, text: str) -> list[str]: ...


class Model(Protocol):
    def tokenize(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Framing:
    """The post-processor: BOS before and EOS after, when the file asks for them."""

    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool

    def __post_init__(self) -> None:
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is set but there is no BOS token")
        if self.add_eos and self.eos_id is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is set but there is no EOS token")

    def frame(self, ids: list[int]) -> list[int]:
        head = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        tail = [self.eos_id] if self.add_eos and self.eos_id is not None else []
        return [*head, *ids, *tail]


class Tokenizer:
    """Text to token ids and back, for one file's vocabulary (see the module docstring)."""

    def __init__(
        self,
        vocab: Vocabulary,
        normalizer: Normalizer,
        pre_tokenizer: PreTokenizer,
        model: Model,
        decoder: PieceDecoder,
    ) -> None:
        self.vocab = vocab
        self.n_vocab = len(vocab.texts)
        self.bos_id = vocab.special["bos"]
        self.eos_id = vocab.special["eos"]
        self.eog_ids = vocab.eog_ids
        self.add_bos = vocab.add_bos
        self.framing = Framing(self.bos_id, self.eos_id, vocab.add_bos, vocab.add_eos)
        self.specials = SpecialSplitter([_special(vocab, i) for i in vocab.special_order()])
        self.normalizer = normalizer
        self.pre_tokenizer = pre_tokenizer
        self.model = model
        self.decoder = decoder

    def encode(
        self,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        plain_map: Mapping[int, str] | None = None,
    ) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize(text, add_special,
        parse_special)``. Characters UTF-8 cannot carry (lone surrogates) become "?".
        ``plain_map`` (a ``str.translate`` table) is applied to the plain runs the special
        tokens leave, before they are tokenized (chat.chat_prompt's stand-ins)."""
        text = _valid(text)
        ids: list[int] = []
        after_special = True
        for fragment in self.specials.split(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
                continue
            if plain_map is not None:
                fragment = fragment.translate(plain_map)
            normalized = self.normalizer.normalize(fragment, after_special)
            for piece in self.pre_tokenizer.split(normalized):
                ids.extend(self.model.tokenize(piece))
            after_special = False
        return self.framing.frame(ids) if add_special else ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (empty for control tokens)."""
        return self.decoder.piece(int(token_id))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``: the pieces' bytes as UTF-8, an invalid sequence as U+FFFD."""
        return self.decoder.join(ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.decoder)


def _special(vocab: Vocabulary, token: int) -> tuple[int, str, bool, bool, bool]:
    """A special token as the splitter takes it: a user-defined token that is not also control
    or unknown (llama.cpp marks end-of-turn texts control) is cut out even with
    ``parse_special`` off."""
    attr = vocab.attrs[token]
    always = bool(attr & Attr.USER_DEFINED) and not attr & (Attr.CONTROL | Attr.UNKNOWN)
    return (token, vocab.texts[token], always, bool(attr & Attr.LSTRIP), bool(attr & Attr.RSTRIP))


def _valid(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="replace").decode("utf-8")
    return text


def is_byte_vocabulary(meta: Mapping[str, Any]) -> bool:
    """Foundry's own vocabulary (docs/decisions.md, D2): ``llama`` with exactly its 259 tokens."""
    tokens = meta.get("tokenizer.ggml.tokens")
    return (
        meta.get("tokenizer.ggml.model") == "llama"
        and tokens is not None
        and len(tokens) == len(BYTE_VOCABULARY)
        and tuple(tokens) == BYTE_VOCABULARY
    )


def load_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file's metadata (its key/value dict) describes.

    Raises :class:`TokenizerError` with one line naming the key and value it cannot use
    (an unknown ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre``, a missing array).
    """
    vocab = read_vocabulary(metadata)
    if is_byte_vocabulary(metadata):
        return Tokenizer(
            vocab, Identity(), WholeText(), ByteModel(), PieceDecoder(vocab, spm_piece)
        )
    if vocab.kind == "spm":
        return Tokenizer(
            vocab,
            SpaceEscape(vocab.add_space_prefix),
            WholeText(),
            SpmModel(vocab.ids, vocab.scores, vocab.byte_ids()),
            PieceDecoder(vocab, spm_piece),
        )
    spec = PRE_TOKENIZERS[vocab.pre]
    if spec.spm_style:
        return Tokenizer(
            vocab,
            SpaceEscape(False),
            RegexSplitter(spec.patterns),
            BpeModel(vocab.ids, vocab.ranks, spec.ignore_merges, vocab.byte_ids()),
            PieceDecoder(vocab, spm_piece),
        )
    return Tokenizer(
        vocab,
        Identity(),
        ByteLevel(spec.patterns),
        BpeModel(vocab.ids, vocab.ranks, spec.ignore_merges),
        PieceDecoder(vocab, byte_level_piece),
    )


@functools.cache
def own_tokenizer() -> Tokenizer:
    """The byte vocabulary every Foundry-trained file carries (what gguf_io writes)."""
    return load_tokenizer(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": list(BYTE_VOCABULARY),
            "tokenizer.ggml.token_type": [2, 3, 3, *[6] * N_BYTE_TOKENS],
            "tokenizer.ggml.add_space_prefix": False,
        }
    )


def load_tokenizer_file(path: str | Path) -> Tokenizer:
    """The tokenizer of the GGUF file at ``path`` (only its header is read); a
    :class:`TokenizerError` names the file."""
    try:
        return load_tokenizer(read_metadata(path))
    except TokenizerError as exc:
        raise TokenizerError(f"{path}: {exc}") from exc
