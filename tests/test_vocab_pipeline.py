"""Tokenizers from GGUF metadata (foundry.model.text.vocab): each pipeline object alone (the
space escape, pre-tokenizer splits, byte level, special tokens, SPM and BPE merges, pieces,
the stream decoder).
"""

from __future__ import annotations

import pytest
from vocabs import OWN, tiny_vocab

from foundry.model.text.vocab import TokenizerError, load_tokenizer
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
from foundry.model.text.vocab.tokens import read_vocabulary


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
    meta = tiny_vocab(
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
