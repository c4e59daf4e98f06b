"""The OpenAI-compatible API's requests and responses, declared once as pydantic models.

Requests are validated at the door (``model_validate_json``): a wrong type or a value out of
range is a 400 naming the field (``errors.invalid_field``), before anything reaches the pair.
Fields a client sends that are not declared here are ignored, as OpenAI's own server does
(``extra="ignore"``); fields declared here but not served (``n`` above 1) are refused with a
400. Types are strict: ``"5"`` is not a number, as in OpenAI's API.

Nothing here does I/O; ``openai.routes`` maps these onto the frontend client.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from foundry.model.infer.sampling import MAX_TOP_LOGPROBS
from foundry.wire.frontend import MAX_STOP_STRINGS

# OpenAI's ranges for the sampling settings.
MAX_TEMPERATURE = 2.0
# The legacy completions endpoint allows 0..5 alternatives (its `logprobs` is a count).
MAX_LEGACY_LOGPROBS = 5


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or a list of parts of which only text is served; None for an assistant turn
    # that only called tools.
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """What both endpoints share."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    # 0 (and vLLM's -1) keep every token.
    top_k: Annotated[int, Field(ge=-1)] = 0
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v == "" or (isinstance(v, list) and any(not s for s in v)):
            raise ValueError("stop strings must not be empty")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def token_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_Sampling):
    # One prompt: a string, or a list holding one string.
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for this endpoint
    logprobs: Annotated[int, Field(ge=0, le=MAX_LEGACY_LOGPROBS)] | None = None

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def token_limit(self) -> int | None:
        return self.max_tokens


# -- responses (plain dicts: built once per token on the hot path, so no model objects) -----


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
