"""Tokenizers from GGUF metadata: llama.cpp's defaults for keys left out, special and end-of-
generation ids, and every malformed key refused in one line naming it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from vocabs import OWN, VOCAB_DIR, published_tokenizer, tiny_vocab, vocab_meta, vocab_path

from foundry.model.text.vocab import TokenizerError, load_tokenizer, load_tokenizer_file
from foundry.model.text.vocab.tokens import Attr


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
    meta = tiny_vocab(
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
    tok = load_tokenizer({**vocab_meta("llama-spm"), "tokenizer.ggml.add_eos_token": True})
    plain = published_tokenizer("llama-spm").encode("Hello")
    assert tok.encode("Hello") == [*plain, 2]
    assert tok.encode("Hello", add_special=False) == plain[1:]


def test_a_file_is_read_for_its_tokenizer_and_named_when_refused() -> None:
    path = vocab_path("gpt-2")
    assert load_tokenizer_file(path).encode("Hello world") == published_tokenizer("gpt-2").encode(
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
