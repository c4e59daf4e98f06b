"""The OpenAI responses as bytes: server-sent events, the chunks of a stream and the whole
body, chat and legacy logprobs (``_Render``, one per response). No I/O.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from foundry.gateway.frontend_client import Event
from foundry.gateway.openai.protocol import (
    usage,
)
from foundry.wire.frontend import Done, DoneReason, Logprobs, Token

_FINISH = {
    DoneReason.MAX_TOKENS: "length",
    DoneReason.CONTEXT_FULL: "length",
    DoneReason.EOS: "stop",
    DoneReason.STOP_STRING: "stop",
    DoneReason.CANCELLED: "stop",
}


def sse(obj: dict[str, Any]) -> bytes:
    return (
        b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + (b"\n\n")
    )


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class _Output:
    """What a generation has produced so far, as the response needs it."""

    chat: bool
    text: list[str] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    done: Done | None = None
    _waiting: list[Logprobs] = field(default_factory=list)  # a token's logprobs, its text due

    def take(self, events: list[Event]) -> tuple[str, list[Logprobs]]:
        """Fold in a batch of events; the text and logprobs they added. A token's LOGPROBS
        comes before its TOKEN, so one that ends a batch waits for the next: a chunk's
        logprobs are then its text's tokens (their offsets count the text before them)."""
        events = [*self._waiting, *events]
        last = events[-1] if events else None
        self._waiting = [last] if isinstance(last, Logprobs) else []
        if self._waiting:
            events.pop()
        text: list[str] = []
        lps: list[Logprobs] = []
        for e in events:
            if isinstance(e, Token):
                text.append(e.text)
            elif isinstance(e, Logprobs):
                lps.append(e)
            else:
                self.done = e
        piece = "".join(text)
        self.text.append(piece)
        self.logprobs += lps
        return piece, lps


def _token_text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def chat_logprobs(lps: list[Logprobs]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": _token_text(lp.token_bytes),
                "logprob": lp.logprob,
                "bytes": list(lp.token_bytes),
                "top_logprobs": [
                    {"token": _token_text(raw), "logprob": v, "bytes": list(raw)}
                    for _, v, raw in lp.top
                ],
            }
            for lp in lps
        ],
        "refusal": None,
    }


def legacy_logprobs(lps: list[Logprobs], offset: int) -> dict[str, Any]:
    """The completions endpoint's logprobs: parallel lists (``offset``: the text before)."""
    tokens = [_token_text(lp.token_bytes) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_token_text(raw): v for _, v, raw in lp.top} for lp in lps],
        "text_offset": offsets,
    }


@dataclass
class _Render:
    """The JSON of one endpoint's responses (chat or completions), streamed or whole."""

    chat: bool
    id: str
    model: str
    include_usage: bool
    logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = 0  # text sent so far (legacy logprobs' text_offset)
    _around: tuple[bytes, bytes] | None = None  # a text chunk's bytes before and after the text

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = (
            ("chat.completion.chunk" if chunk else "chat.completion")
            if self.chat
            else ("text_completion")
        )
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, lps: list[Logprobs], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return chat_logprobs(lps) if self.chat else legacy_logprobs(lps, offset)

    def opening(self) -> bytes:
        if not self.chat:
            return b""
        return sse(
            self._envelope(
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                True,
            )
        )

    def _choice(self, piece: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        if self.chat:
            return {
                "index": 0,
                "delta": {"content": piece},
                "logprobs": logprobs,
                "finish_reason": None,
            }
        return {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": None}

    def chunk(self, piece: str, lps: list[Logprobs]) -> bytes:
        logprobs = self._logprobs(lps, self._offset)
        self._offset += len(piece)
        if logprobs is not None:
            return sse(self._envelope([self._choice(piece, logprobs)], True))
        # The hot path, once per batch of tokens: only the text varies, so the chunk is the
        # JSON around it (rendered once per stream) with the text's JSON string in between.
        if self._around is None:
            marker = "\u2063piece\u2063"
            head, _, tail = sse(self._envelope([self._choice(marker, None)], True)).rpartition(
                json.dumps(marker, ensure_ascii=False).encode()
            )
            self._around = (head, tail)
        head, tail = self._around
        return head + json.dumps(piece, ensure_ascii=False).encode() + tail

    def closing(self, out: _Output) -> bytes:
        assert out.done is not None
        finish = _FINISH[out.done.reason]
        if self.chat:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
        parts = [sse(self._envelope([choice], True))]
        if self.include_usage:
            tail = self._envelope([], True)
            tail["usage"] = usage(out.done.prompt_tokens, out.done.generated_tokens)
            parts.append(sse(tail))
        return b"".join(parts)

    def whole(self, out: _Output) -> dict[str, Any]:
        done = out.done
        assert done is not None
        text = "".join(out.text)
        logprobs = self._logprobs(out.logprobs, 0)
        finish = _FINISH[done.reason]
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        body = self._envelope([choice], False)
        body["usage"] = usage(done.prompt_tokens, done.generated_tokens)
        return body
