"""The OpenAI layer's pure parts, in this process: the request models' reading of the fields
and the responses rendered from the pair's events, against OpenAI's documented shapes.

tests/test_openai_semantics.py checks the same through the pair and the gateway's process;
these run where bench/mutation/mutate.py's mutants are (the gateway target), and pin each
field alone.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from foundry.gateway.errors import (
    BackendFailed,
    BackendTimeout,
    BackendUnavailable,
    InvalidRequest,
)
from foundry.gateway.http import (
    SSE_DONE,
    _Output,
    _Render,
    chat_logprobs,
    http_error,
    legacy_logprobs,
    sse,
)
from foundry.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from foundry.wire.frontend import Done, DoneReason, Logprobs, Token

CHAT = '{"messages": [{"role": "user", "content": "hi"}]'


def chat(extra: str = "") -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(CHAT + extra + "}")


def completion(extra: str = "") -> CompletionRequest:
    return CompletionRequest.model_validate_json('{"prompt": "hi"' + extra + "}")


def test_the_token_limit_of_each_endpoint() -> None:
    """Chat: ``max_completion_tokens`` over the deprecated ``max_tokens``, none by default;
    completions: ``max_tokens``, 16 by default (OpenAI's)."""
    assert chat().token_limit() is None
    assert chat(', "max_tokens": 7').token_limit() == 7
    assert chat(', "max_completion_tokens": 5').token_limit() == 5
    assert chat(', "max_tokens": 7, "max_completion_tokens": 5').token_limit() == 5
    assert chat(', "max_tokens": 5, "max_completion_tokens": 7').token_limit() == 7
    assert completion().token_limit() == 16
    assert completion(', "max_tokens": 3').token_limit() == 3


def test_stop_and_usage_fields() -> None:
    assert completion().stop_strings() == ()
    assert completion(', "stop": "a"').stop_strings() == ("a",)
    assert completion(', "stop": ["a", "b"]').stop_strings() == ("a", "b")
    assert not completion().include_usage()
    assert not completion(', "stream_options": {}').include_usage()
    assert completion(', "stream_options": {"include_usage": true}').include_usage()
    assert completion(', "prompt": ["x"]').prompt_text() == "x"
    assert completion().prompt_text() == "hi"
    parts = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
        '{"type": "text", "text": "b"}]}, {"role": "assistant"}]}')
    assert [m.text() for m in parts.messages] == ["ab", ""]


def _events(*tokens: tuple[str, bytes], reason: DoneReason = DoneReason.MAX_TOKENS,
            logprobs: bool = False) -> list[Any]:
    out: list[Any] = []
    for i, (text, raw) in enumerate(tokens):
        if logprobs:
            out.append(Logprobs(1, i, -0.5 * (i + 1), raw, ((i, -0.5 * (i + 1), raw),
                                                            (99, -3.0, b"z"))))
        out.append(Token(1, i, 10 + i, text))
    out.append(Done(1, reason, 4, len(tokens), 0.1))
    return out


def _decode(chunk: bytes) -> dict[str, Any]:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    parsed: dict[str, Any] = json.loads(chunk[len(b"data: "):])
    return parsed


@pytest.mark.parametrize(("reason", "finish"), [
    (DoneReason.MAX_TOKENS, "length"), (DoneReason.CONTEXT_FULL, "length"),
    (DoneReason.EOS, "stop"), (DoneReason.STOP_STRING, "stop"), (DoneReason.CANCELLED, "stop"),
])
def test_whole_responses(reason: DoneReason, finish: str) -> None:
    for is_chat in (True, False):
        out = _Output(chat=is_chat)
        out.take(_events(("He", b"He"), ("llo", b"llo"), reason=reason))
        body = _Render(is_chat, "id-1", "m", include_usage=False, logprobs=False).whole(out)
        choice = {"index": 0, "logprobs": None, "finish_reason": finish}
        if is_chat:
            choice["message"] = {"role": "assistant", "content": "Hello"}
        else:
            choice["text"] = "Hello"
        assert body["choices"] == [choice]
        assert body["object"] == ("chat.completion" if is_chat else "text_completion")
        assert (body["id"], body["model"]) == ("id-1", "m")
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


def test_a_streams_chunks() -> None:
    render = _Render(True, "id-2", "m", include_usage=True, logprobs=False)
    opening = _decode(render.opening())
    assert opening["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]
    assert opening["object"] == "chat.completion.chunk"
    chunk = _decode(render.chunk("Hi", []))
    assert chunk["choices"] == [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None,
                                 "finish_reason": None}]
    out = _Output(chat=True)
    out.take(_events(("Hi", b"Hi"), reason=DoneReason.EOS))
    closing, usage_chunk = render.closing(out).split(b"\n\n")[:2]
    assert _decode(closing + b"\n\n")["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    tail = _decode(usage_chunk + b"\n\n")
    assert tail["choices"] == [] and tail["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    plain = _Render(False, "id-3", "m", include_usage=False, logprobs=False)
    assert plain.opening() == b""
    (closing,) = [c for c in plain.closing(out).split(b"\n\n") if c]
    assert _decode(closing + b"\n\n")["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()


def test_legacy_logprobs_offsets_continue_across_chunks() -> None:
    render = _Render(False, "id-4", "m", include_usage=False, logprobs=True)
    out = _Output(chat=False)
    first, lps = out.take(_events(("ab", b"ab"), ("é", "é".encode()), logprobs=True)[:4])
    one = _decode(render.chunk(first, lps))["choices"][0]["logprobs"]
    assert one == {"tokens": ["ab", "é"], "token_logprobs": [-0.5, -1.0],
                   "top_logprobs": [{"ab": -0.5, "z": -3.0}, {"é": -1.0, "z": -3.0}],
                   "text_offset": [0, 2]}
    piece, lps = out.take([Logprobs(1, 7, -2.0, b"cd", ()), Token(1, 7, 12, "cd")])
    two = _decode(render.chunk(piece, lps))["choices"][0]["logprobs"]
    assert two["text_offset"] == [3] and two["top_logprobs"] == [{}]
    assert legacy_logprobs([], 5) == {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                      "text_offset": []}


def test_chat_logprobs_carry_bytes() -> None:
    lp = Logprobs(1, 3, -0.25, b"\xc3", ((3, -0.25, b"\xc3"), (4, -2.0, b"a")))
    assert chat_logprobs([lp]) == {"content": [{
        "token": "\ufffd", "logprob": -0.25, "bytes": [0xC3],
        "top_logprobs": [{"token": "\ufffd", "logprob": -0.25, "bytes": [0xC3]},
                         {"token": "a", "logprob": -2.0, "bytes": [0x61]}]}],
        "refusal": None}


def test_the_pairs_errors_as_http_statuses() -> None:
    import grpc

    cases = [
        (InvalidRequest("bad"), 400, "invalid_request_error"),
        (BackendTimeout("slow"), 504, "timeout_error"),
        (BackendUnavailable("gone"), 503, "service_unavailable"),
        (BackendFailed("full", grpc.StatusCode.RESOURCE_EXHAUSTED), 429, "rate_limit_error"),
        # The leader's ERROR UNAVAILABLE (its worker lost): a 503 as the gRPC side's status.
        (BackendFailed("lost", grpc.StatusCode.UNAVAILABLE), 503, "service_unavailable"),
        (BackendFailed("odd", grpc.StatusCode.INTERNAL), 500, "server_error"),
    ]
    for exc, status, kind in cases:
        err = http_error(exc)
        assert (err.status, err.body["error"]["type"]) == (status, kind)
        assert err.body["error"]["message"] == exc.message
    assert http_error(BackendUnavailable("x")).headers == {"Retry-After": "1"}
    assert http_error(InvalidRequest("x")).headers is None
