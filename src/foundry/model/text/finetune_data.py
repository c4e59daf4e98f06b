"""The user's data for fine-tuning a published model, as a ``data.Corpus`` in the file's tokens.

- Plain text (a file, or a folder of ``.txt``/``.md``/``.rst``/``.py`` files, as
  ``data.read_documents`` reads them): each document encoded with the file's own tokenizer
  (its BOS as the file says) and closed by its EOS; every token is a target.
- Chat (a ``.jsonl`` file, one conversation a line: ``{"messages": [{"role": "user", "content":
  "..."}, {"role": "assistant", "content": "..."}]}``): each conversation rendered with the
  file's chat template (``chat.template_for``: its ``tokenizer.chat_template``, else the built-in
  its vocabulary calls for) and encoded with the template's special tokens parsed. Only the
  assistant's tokens carry loss (``Corpus.counted``): the text an assistant turn adds to the
  conversation, which is what the template prints after its generation prompt up to the end
  of the turn (the end-of-turn marker included, so the model learns to stop).

The held-out split and the global sample order are the corpus's own (``data``): the same on
every machine for the same file and data.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from foundry.model.text.chat import ChatTemplate, Message
from foundry.model.text.chat_sandbox import ChatTemplateError
from foundry.model.text.data import Corpus, DataError, read_documents
from foundry.model.text.vocab import Tokenizer

ROLES = ("system", "user", "assistant")


def load_tuning_corpus(
    path: str | Path, tokenizer: Tokenizer, template: ChatTemplate | None = None
) -> Corpus:
    """The corpus of ``path``: chat when it is a ``.jsonl`` file (``template`` required),
    plain text otherwise."""
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".jsonl":
        if template is None:
            raise DataError(f"{p} is chat data (JSONL) and needs the model's chat template")
        return chat_corpus(p, tokenizer, template)
    return text_corpus(read_documents(p), tokenizer, str(p))


def text_corpus(documents: Sequence[str], tokenizer: Tokenizer, source: str) -> Corpus:
    parts = [
        np.asarray([*tokenizer.encode(doc, add_special=True), tokenizer.eos_id], np.int32)
        for doc in documents
        if doc
    ]
    if not parts:
        raise DataError(f"{source} holds no text")
    return Corpus(np.concatenate(parts), source=source, n_documents=len(parts))


def _messages(line: str, where: str) -> list[Message]:
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not JSON ({exc.msg})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
    out = []
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"{where}: message {i} needs a role ({', '.join(ROLES)}) and a string content"
            )
        out.append(Message(m["role"], m["content"]))
    if not any(m.role == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant message to learn")
    return out


def conversation_segments(
    template: ChatTemplate, messages: Sequence[Message]
) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, counted) pieces, in order: the assistant
    turns' own text counted, the rest not.

    A turn's text is what the template adds after its generation prompt (the reply and its
    end-of-turn marker). A template that renders earlier turns differently once the
    conversation goes on (one that drops an old turn's reasoning, say) has no such prefix;
    there each assistant message's content is found in the whole rendering, in order, and that
    alone is counted."""
    whole = template.render(messages, add_generation_prompt=False)
    segments: list[tuple[str, bool]] = []
    done = 0
    for k, m in enumerate(messages):
        if m.role != "assistant":
            continue
        prompt = template.render(messages[:k], add_generation_prompt=True)
        upto = template.render(messages[: k + 1], add_generation_prompt=False)
        if not (
            upto.startswith(prompt) and prompt.startswith(upto[:done]) and whole.startswith(upto)
        ):
            return _found_segments(template, whole, messages)
        segments += [(prompt[done:], False), (upto[len(prompt) :], True)]
        done = len(upto)
    segments.append((whole[done:], False))
    return _without_bos(template, segments)


def _found_segments(
    template: ChatTemplate, whole: str, messages: Sequence[Message]
) -> list[tuple[str, bool]]:
    segments: list[tuple[str, bool]] = []
    done = 0
    for m in messages:
        content = m.content.strip()
        if m.role != "assistant" or not content:
            continue
        at = whole.find(content, done)
        if at < 0:
            raise ChatTemplateError(
                f"chat template {template.name!r} does not print an "
                "assistant message's content as it is"
            )
        segments += [(whole[done:at], False), (content, True)]
        done = at + len(content)
    segments.append((whole[done:], False))
    return _without_bos(template, segments)


def _without_bos(
    template: ChatTemplate, segments: list[tuple[str, bool]]
) -> list[tuple[str, bool]]:
    """The segments without empty ones, and without the BOS text a template prints (the
    tokenizer adds its own BOS)."""
    if template.bos_token and segments and segments[0][0].startswith(template.bos_token):
        segments[0] = (segments[0][0][len(template.bos_token) :], segments[0][1])
    return [(text, counted) for text, counted in segments if text]


def chat_corpus(path: Path, tokenizer: Tokenizer, template: ChatTemplate) -> Corpus:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read chat data {path}: {exc}") from None
    tokens: list[int] = []
    counted: list[bool] = []
    n = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            segments = conversation_segments(template, _messages(line, where))
        except ChatTemplateError as exc:
            raise DataError(f"{where}: {exc}") from None
        for i, (text, is_reply) in enumerate(segments):
            ids = tokenizer.encode(text, add_special=i == 0, parse_special=True)
            tokens += ids
            counted += [is_reply] * len(ids)
        n += 1
    if not n:
        raise DataError(f"{path} holds no conversations")
    if not any(counted):
        raise DataError(f"{path}: no assistant tokens to learn")
    return Corpus(
        np.asarray(tokens, np.int32),
        source=str(path),
        n_documents=n,
        counted=np.asarray(counted, bool),
    )
