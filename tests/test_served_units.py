"""Pieces of the served path checked in this process, each where a one-line mistake passed the
rest of the suite: the tokenizer's reading of ``add_bos_token`` against its vocabulary's
default, the order of a pre-tokenizer's patterns, templates rendered with ``lstrip_blocks``, a
fragmented FDTC message of exactly the link's limit. (The served path's processes are in
tests/test_served_matrix.py and tests/test_openai_semantics.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_bpe import vocab_path

from foundry.model.formats.gguf_meta import read_metadata
from foundry.model.text.chat import NO_TEMPLATE, ChatTemplate, Message, template_for
from foundry.model.text.vocab.tokenizer import load_tokenizer
from foundry.wire.fdtc import FdtcDecoder, Weights, encode_parts

ADD_BOS = "tokenizer.ggml.add_bos_token"


def _meta(name: str, **keys: Any) -> dict[str, Any]:
    """A vocabulary's metadata without its own ``add_bos_token``, then ``keys``."""
    meta = {
        k: v
        for k, v in read_metadata(vocab_path(f"ggml-vocab-{name}.gguf")).items()
        if k != ADD_BOS
    }
    meta.update({f"tokenizer.ggml.{k}": v for k, v in keys.items()})
    return meta


@pytest.mark.parametrize(
    ("vocab", "default"), [("llama-bpe", True), ("gpt-2", False), ("llama-spm", True)]
)
def test_the_files_add_bos_token_overrides_the_vocabularys_default(
    vocab: str, default: bool
) -> None:
    """llama.cpp reads ``tokenizer.ggml.add_bos_token`` over the default of the vocabulary's
    type and pre-tokenizer (Llama 3 adds BOS, GPT-2 does not)."""
    plain = load_tokenizer(_meta(vocab))
    assert plain.add_bos is default
    flipped = load_tokenizer(_meta(vocab, add_bos_token=not default))
    assert flipped.add_bos is not default
    ids, other = plain.encode("Hello"), flipped.encode("Hello")
    bos = plain.bos_id
    assert (ids[0] == bos) is default and (other[0] == bos) is not default
    assert (ids[1:] if default else ids) == (other if default else other[1:])


def test_smollm_splits_digits_before_the_gpt2_pattern() -> None:
    """llama.cpp's smollm / starcoder pre-tokenizer runs ``\\p{N}`` first, then GPT-2's
    pattern on what is left: "a  1" is "a", "  ", "1" (the other order gives "a", " ", " 1")."""
    meta = _meta("starcoder")
    assert meta["tokenizer.ggml.pre"] == "starcoder"
    ids = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    tok = load_tokenizer(meta)
    assert tok.encode("a  1") == [ids["a"], ids["ĠĠ"], ids["1"]]
    assert tok.encode("x 12") == [ids["x"], ids["Ġ"], ids["1"], ids["2"]]


def test_templates_render_with_lstrip_blocks() -> None:
    """transformers renders with ``trim_blocks`` and ``lstrip_blocks``: the spaces before a
    block tag on its line are not output (templates indent their tags), nor the newline
    after one; a template file's last newline is dropped (``keep_trailing_newline`` off)."""
    source = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "[{{ m.content }}]\n"
        "    {% endif %}\n"
        "{% endfor %}"
    )
    text = ChatTemplate(source, "indented").render([Message("user", "a"), Message("user", "b")])
    assert text == "[a]\n[b]\n"
    trimmed = ChatTemplate("{% if true %}\nx{% endif %}y\n", "trimmed")
    assert trimmed.render([]) == "xy"


def test_a_fragmented_message_of_exactly_the_links_limit_crosses() -> None:
    """The limit itself is allowed; one byte more is refused (test_fdtc_fragments_codec.py)."""
    limit = 1 << 16
    msg = Weights(bytes(range(256)) * (limit // 256))
    pieces = encode_parts(msg, fragment_size=4096, max_message=limit)
    assert len(pieces) > 1
    dec = FdtcDecoder(max_message=limit)
    for p in pieces:
        dec.feed(p)
    assert list(dec.events()) == [msg]


META = {
    "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "x"],
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}
SPECIALS = "{{ bos_token }}|{{ eos_token }}"


def test_every_way_to_choose_a_template_names_it_and_gives_it_the_files_bos_and_eos(
    tmp_path: Path,
) -> None:
    jinja = tmp_path / "mine.jinja"
    jinja.write_text(SPECIALS + "|é", encoding="utf-8")
    chosen = [
        (
            template_for({**META, "tokenizer.chat_template": SPECIALS}),
            "the file's tokenizer.chat_template",
            "<s>|</s>",
        ),
        (template_for(META, "plain"), "plain", None),
        (template_for(META, str(jinja)), str(jinja), "<s>|</s>|é"),
        (template_for(META), "plain" + NO_TEMPLATE, None),
        (template_for({**META, "tokenizer.chat_template": ""}), "plain" + NO_TEMPLATE, None),
    ]
    for t, name, rendered in chosen:
        assert (t.name, t.bos_token, t.eos_token) == (name, "<s>", "</s>")
        if rendered is not None:
            assert t.render([]) == rendered


@pytest.mark.parametrize(
    "meta",
    [
        {**META, "tokenizer.ggml.bos_token_id": 4, "tokenizer.ggml.eos_token_id": -1},
        {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2},
        {**META, "tokenizer.ggml.bos_token_id": "1", "tokenizer.ggml.eos_token_id": None},
    ],
)
def test_a_special_token_the_file_does_not_have_is_empty_text(meta: dict[str, Any]) -> None:
    t = template_for(meta)
    assert (t.bos_token, t.eos_token) == ("", "")
    assert ChatTemplate(SPECIALS, "bare").render([]) == "|"


def test_tojson_is_transformers_filter() -> None:
    """``tojson`` as transformers defines it: keys in their order, ``ensure_ascii`` off,
    ``indent``, ``separators`` and ``sort_keys`` as json.dumps takes them."""
    msgs = [Message("user", "é")]

    def render(call: str) -> str:
        return ChatTemplate("{{ messages[0] | " + call + " }}", "json").render(msgs)

    assert render("tojson") == '{"role": "user", "content": "é"}'
    assert render("tojson(separators=(',', ':'))") == '{"role":"user","content":"é"}'
    assert render("tojson(sort_keys=true)") == '{"content": "é", "role": "user"}'
    assert render("tojson(ensure_ascii=true)") == '{"role": "user", "content": "\\u00e9"}'
    assert render("tojson(indent=1)") == '{\n "role": "user",\n "content": "é"\n}'
