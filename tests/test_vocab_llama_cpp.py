"""Published vocabularies against llama.cpp, whose ids come from two places, neither computed here:
- tests/refs/tokenizer_ids.json, recorded from llama.cpp by tests/refs/record_tokenizer_ids.py
  (our corpus, add_special and parse_special on and off, and each token's piece);
- the .inp/.out pairs that ship next to llama.cpp's models/ggml-vocab-*.gguf.
Also round trips and the stream decoder on them, and a file's end-of-generation ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from vocabs import GEMMA, OWN, own_tokenizer, published_tokenizer, vocab_path

from foundry.model.text.vocab import byte, load_tokenizer
from foundry.model.text.vocab.tokens import Attr

REFS = json.loads((Path(__file__).parent / "refs" / "tokenizer_ids.json").read_text())

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


@pytest.mark.parametrize("name", sorted(REFS["vocabs"]))
def test_ids_and_pieces_match_llama_cpp_on_our_corpus(name: str) -> None:
    ref = REFS["vocabs"][name]
    tok = published_tokenizer(name)
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
    path = vocab_path(name)
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = Path(f"{path}.out").read_text().split("\n")[: len(texts)]
    tok = published_tokenizer(name)
    got = [" ".join(str(t) for t in tok.encode(s, add_special=False)) for s in texts]
    assert got == [line.strip() for line in expected]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_byte_level_bpe_round_trips(text: str) -> None:
    # byte-level BPE reaches every byte: decode(encode(s)) == s unless s spells a control token
    for name in ("gpt-2", "qwen2", "llama-bpe"):
        tok = published_tokenizer(name)
        ids = tok.encode(text, add_special=False)
        assume(all(tok.token_bytes(t) or not tok.vocab.attrs[t] & Attr.CONTROL for t in ids))
        assert tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_sentencepiece_round_trips_with_its_space_prefix(text: str) -> None:
    for name, prefix in (("llama-spm", " "), (GEMMA, "")):
        tok = published_tokenizer(name)
        ids = tok.encode(text, add_special=False)
        # no control token spelled out, and no "▁" (SentencePiece writes a space so)
        assume(all(tok.token_bytes(t) for t in ids) and "\u2581" not in text)
        assert tok.decode(ids) == (prefix + text if text else "")


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_stream_decoder_equals_decode_and_never_splits_a_character(data_: st.DataObject) -> None:
    for name in ("llama-spm", "gpt-2"):
        tok = published_tokenizer(name)
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
    tok = published_tokenizer("command-r")
    token = tok.vocab.ids["\u203c"]
    assert tok.vocab.attrs[token] & Attr.NORMAL
    assert tok.decode([token]) == "\u203c"


def test_lone_surrogates_are_encoded_as_data_encode_does() -> None:
    text = "a\ud800b"
    assert own_tokenizer().encode(text) == [int(t) for t in byte.encode(text)]
    assert published_tokenizer("gpt-2").encode(text, add_special=False) == published_tokenizer(
        "gpt-2"
    ).encode("a?b", add_special=False)


def test_the_leaders_text_stream_decodes_with_the_files_tokenizer() -> None:
    from foundry.tp.policy import TextStream

    tok = published_tokenizer("qwen2")
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
