"""Chat templates: a conversation (a list of messages) as the one prompt text a model was
trained to continue.

A GGUF file may carry its template as ``tokenizer.chat_template``, a Jinja2 program written
for Hugging Face transformers. It is rendered here as transformers and llama.cpp render it:

- a sandboxed environment (``ImmutableSandboxedEnvironment``: a template is data from a file,
  it must not reach Python objects), ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension (``{% break %}``) and transformers' ``{% generation %}`` block;
- the variables ``messages`` (dicts with ``role`` and ``content``), ``add_generation_prompt``,
  ``bos_token`` and ``eos_token`` (the text of the file's BOS and EOS tokens);
- the functions ``raise_exception(message)`` (a template refusing a conversation, e.g. roles
  that do not alternate) and ``strftime_now(format)`` (today's date, which Llama 3.1 prints),
  and transformers' ``tojson`` filter (``ensure_ascii=False``, optional ``indent``).

A file without a template gets the plain ``User:`` / ``Assistant:`` transcript, whose reply
ends where the model begins the user's next line (:attr:`ChatTemplate.stop`): never another
model's turn markers guessed from the vocabulary. Such a file is in practice a base model (the
Gemma 3 270M file on PyPI): turn tokens in its vocabulary are no sign that it was tuned on
them, and given them it answers noise. ``override`` (``--chat-template``) names a built-in
(``gemma``, ``chatml``, ``llama3``, ``plain``) or a Jinja file instead. docs/models.md compares
this with llama.cpp (ChatML) and vLLM (chat refused).

Templates that print ``bos_token`` first expect the tokenizer not to add another;
:func:`prompt_text` drops that leading BOS text, since the encoder adds the BOS token itself
(llama.cpp's server does the same).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

# A conversation's roles, as OpenAI's API names them ("developer" is its newer "system").
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refuses to render a conversation."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens
    with it (for training masks); rendering a prompt, it is just its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        body: list[jinja2.nodes.Node] = parser.parse_statements(
            ("name:endgeneration",), drop_needle=True)
        return body


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
        keep_trailing_newline=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


class ChatTemplate:
    """One compiled template and the special-token texts it may print."""

    def __init__(self, source: str, name: str, bos_token: str = "", eos_token: str = "",
                 stop: tuple[str, ...] = ()) -> None:
        self.source = source
        self.name = name
        # Text that ends a reply in this format, for templates whose turns end without a token.
        self.stop = stop
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template {name!r} does not compile: {exc}") from None

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the template prints it (exactly: BOS text included)."""
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template {self.name!r} failed: {exc}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r})"


def prompt_text(template: ChatTemplate, messages: Sequence[Message]) -> str:
    """The text to encode (with the tokenizer's own BOS) for a reply to ``messages``."""
    text = template.render(messages, add_generation_prompt=True)
    if template.bos_token and text.startswith(template.bos_token):
        text = text[len(template.bos_token):]
    return text


# -- built-in templates ------------------------------------------------------------------
#
# Written for files that carry none. Each states its format in its own terms; the turn markers
# are the special tokens of the family's vocabulary.

# Gemma (2 and 3): user and model turns; a system message opens the first user turn.
GEMMA = (
    "{% if messages and messages[0].role in ('system', 'developer') %}"
    "{% set prefix = messages[0].content + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n' }}"
    "{{ (prefix if loop.first else '') + m.content | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# ChatML: <|im_start|>role, the content, <|im_end|>.
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama 3: a header per turn, <|eot_id|> after each.
LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim }}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Plain text, for files without a template (base models, our byte-level models): a transcript.
PLAIN = (
    "{% for m in messages %}{{ m.role | capitalize + ': ' + m.content + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

BUILTINS: dict[str, str] = {"gemma": GEMMA, "chatml": CHATML, "llama3": LLAMA3, "plain": PLAIN}

# The plain transcript has no token to end a turn on: a reply ends where the model begins
# the user's next line.
PLAIN_STOP = ("\nUser:",)
# How a template's name says that the file had none (logged by the leader and `foundry chat`).
NO_TEMPLATE = " (the file has no chat template; --chat-template chooses another)"


def _special_text(metadata: Mapping[str, Any], key: str) -> str:
    tokens = metadata.get("tokenizer.ggml.tokens")
    token_id = metadata.get(key)
    if not isinstance(tokens, Sequence) or not isinstance(token_id, int):
        return ""
    if not 0 <= token_id < len(tokens):
        return ""
    return str(tokens[token_id])


def _builtin(name: str, bos: str, eos: str, why: str = "") -> ChatTemplate:
    return ChatTemplate(BUILTINS[name], name + why, bos, eos,
                        PLAIN_STOP if name == "plain" else ())


def template_for(metadata: Mapping[str, Any], override: str | None = None) -> ChatTemplate:
    """The template to render conversations for the model of ``metadata`` (GGUF key/values):
    ``override`` (a built-in's name or a Jinja file's path) if given, else the file's
    ``tokenizer.chat_template``, else the plain transcript. Its ``name`` says which, and
    why."""
    bos = _special_text(metadata, "tokenizer.ggml.bos_token_id")
    eos = _special_text(metadata, "tokenizer.ggml.eos_token_id")
    if override is not None:
        if override in BUILTINS:
            return _builtin(override, bos, eos)
        path = Path(override)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(
                f"--chat-template {override!r} is neither a built-in "
                f"({', '.join(BUILTINS)}) nor a readable UTF-8 Jinja file: {exc}"
            ) from None
        return ChatTemplate(text, str(path), bos, eos)
    source = metadata.get("tokenizer.chat_template")
    if isinstance(source, str) and source:
        return ChatTemplate(source, "the file's tokenizer.chat_template", bos, eos)
    return _builtin("plain", bos, eos, NO_TEMPLATE)

