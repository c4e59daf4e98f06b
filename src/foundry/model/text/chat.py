"""Chat templates: a conversation (a list of messages) as the one prompt text a model was
trained to continue.

A GGUF file may carry its template as ``tokenizer.chat_template``, a Jinja2 program written
for Hugging Face transformers. It is rendered as transformers and llama.cpp render it, in the
sandbox of ``chat_sandbox`` (the variables and functions a template gets, and the limits it
renders under: :class:`Limits`; whatever goes wrong comes out as one
:class:`ChatTemplateError` of one line).

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

:func:`chat_prompt` renders and tokenizes a conversation. The template's own text is parsed for
special tokens (its turn markers are control tokens); the messages' content is not, by default:
a user who types ``<start_of_turn>`` gets those characters as text, not a forged turn.
``content_specials=True`` (``--chat-content-specials``) parses them too, as llama.cpp does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foundry.model.formats.gguf_meta import shown
from foundry.model.text.chat_sandbox import (
    DEFAULT_LIMITS,
    ChatTemplateError,
    Limits,
    compile_template,
    rendering,
)

if TYPE_CHECKING:
    from foundry.model.text.vocab import Tokenizer

# A conversation's roles, as OpenAI's API names them ("developer" is its newer "system").
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


class ChatTemplate:
    """One compiled template and the special-token texts it may print."""

    def __init__(
        self,
        source: str,
        name: str,
        bos_token: str = "",
        eos_token: str = "",
        stop: tuple[str, ...] = (),
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.source = source
        self.name = name
        # Text that ends a reply in this format, for templates whose turns end without a token.
        self.stop = stop
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.limits = limits
        self._template = compile_template(source, name)

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the template prints it (exactly: BOS text included), within
        the template's :class:`Limits`."""
        with rendering(self.limits, self.name) as budget:
            out: list[str] = []
            total = 0
            for piece in self._template.generate(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            ):
                total += len(piece)
                budget.chars(total, "a rendered conversation")
                out.append(piece)
            return "".join(out)

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r})"


def prompt_text(template: ChatTemplate, messages: Sequence[Message]) -> str:
    """The text to encode (with the tokenizer's own BOS) for a reply to ``messages``."""
    text = template.render(messages, add_generation_prompt=True)
    if template.bos_token and text.startswith(template.bos_token):
        text = text[len(template.bos_token) :]
    return text


# Characters no text uses: the stand-ins for the first character of a special token's text
# found in a message (the Unicode private use areas: the BMP's, then planes 15 and 16).
_PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))


def chat_prompt(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    *,
    content_specials: bool = False,
    max_chars: int | None = None,
) -> list[int]:
    """The token ids of the prompt for a reply to ``messages``: rendered by ``template``,
    the template's own special-token texts parsed as the special tokens they are, the
    messages' content as text (unless ``content_specials``).

    Each special-token text a message holds is defused before rendering: its first character
    is swapped for a private-use character found in no message and not in the template, so
    the template sees text of the same length and the special-token split passes it by; the
    plain runs get the original character back before they are tokenized. ``max_chars``
    refuses a rendered text longer than that before tokenizing it."""
    if content_specials:
        text = prompt_text(template, messages)
        _check_rendered(template, text, max_chars)
        return tokenizer.encode(text, parse_special=True)
    used: set[str] = set(template.source)
    for m in messages:
        used.update(m.content)
    spares = (chr(c) for r in _PRIVATE_USE for c in r if chr(c) not in used)
    stand_in: dict[str, str] = {}  # original first character -> its stand-in
    defused: list[Message] = []
    for m in messages:
        spans = [
            (start, tid)
            for start, _, tid, always in tokenizer.specials.matches(m.content, True)
            if not always
        ]
        if not spans:
            defused.append(m)
            continue
        chars = list(m.content)
        for start, _ in spans:
            first = chars[start]
            if first not in stand_in:
                spare = next(spares, None)
                if spare is None:
                    raise ChatTemplateError(
                        "the conversation uses every private-use character; "
                        "its special-token texts cannot be kept as text"
                    )
                stand_in[first] = spare
            chars[start] = stand_in[first]
        defused.append(Message(m.role, "".join(chars)))
    text = prompt_text(template, defused)
    _check_rendered(template, text, max_chars)
    back = {ord(spare): first for first, spare in stand_in.items()}
    return tokenizer.encode(text, parse_special=True, plain_map=back or None)


def _check_rendered(template: ChatTemplate, text: str, max_chars: int | None) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise ChatTemplateError(
            f"the conversation renders to {len(text)} characters with "
            f"{template.name}, more than the {max_chars} a prompt may have"
        )


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
# A message whose text begins with white space follows its "Role:" directly: a reply the model
# wrote after the generation prompt's "Assistant:" (" The ...") then renders to the very text,
# and tokens, it was generated as, so the next turn reuses the kept session past the reply.
PLAIN = (
    "{% for m in messages %}{{ m.role | capitalize + ':' }}"
    "{% if not m.content[:1].isspace() %}{{ ' ' }}{% endif %}{{ m.content + '\\n' }}"
    "{% endfor %}"
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
    return ChatTemplate(BUILTINS[name], name + why, bos, eos, PLAIN_STOP if name == "plain" else ())


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
    if source is not None and not isinstance(source, str):
        raise ChatTemplateError(
            f"metadata key 'tokenizer.chat_template' is {shown(source)}, expected a string"
        )
    if source:
        return ChatTemplate(source, "the file's tokenizer.chat_template", bos, eos)
    return _builtin("plain", bos, eos, NO_TEMPLATE)
