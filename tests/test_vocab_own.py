"""Foundry's byte vocabulary as a tokenizer, against foundry.model.text.data."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from vocabs import OWN, own_tokenizer

from foundry.model.text.vocab import byte, is_byte_vocabulary, load_tokenizer


@settings(max_examples=150, deadline=None)
@given(st.text(), st.booleans())
def test_own_vocabulary_is_data_encode(text: str, add_special: bool) -> None:
    tok = own_tokenizer()
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
    d = own_tokenizer().stream_decoder()
    pieces = [d.feed(t) for t in tokens]
    assert "".join(pieces) + d.flush() == byte.decode(tokens)


@settings(deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"])))
def test_own_stream_decoder_never_splits_a_character(text: str) -> None:
    d = own_tokenizer().stream_decoder()
    pieces = [d.feed(t) for t in own_tokenizer().encode(text)]
    assert d.flush() == ""
    assert "".join(pieces) == text
    for piece in pieces:  # every piece is whole characters: it survives its own round trip
        assert "\ufffd" not in piece or "\ufffd" in text
        assert own_tokenizer().decode(own_tokenizer().encode(piece)) == piece


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
