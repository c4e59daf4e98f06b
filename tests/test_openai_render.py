"""The OpenAI layer's pure parts, in this process: the request models' reading of the fields
and the responses rendered from the pair's events, against OpenAI's documented shapes.

tests/test_openai_semantics.py checks the same through the pair and the gateway's process;
these run where bench/mutation/mutate.py's mutants are (the gateway target), and pin each
field alone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from foundry.gateway.admission import FairQueue, QueueFull
from foundry.gateway.errors import (
    BackendFailed,
    BackendTimeout,
    BackendUnavailable,
    InvalidRequest,
)
from foundry.gateway.openai import (
    SSE_DONE,
    EventStream,
    HttpError,
    chat_logprobs,
    http_error,
    legacy_logprobs,
    sse,
)
from foundry.gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from foundry.gateway.openai.render import _Output, _Render
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
    assert completion(', "stop": "ab"').stop_strings() == ("ab",)
    assert completion(', "stop": ["a", "b"]').stop_strings() == ("a", "b")
    assert not completion().include_usage()
    assert not completion(', "stream_options": {}').include_usage()
    assert completion(', "stream_options": {"include_usage": true}').include_usage()
    assert completion(', "prompt": ["x"]').prompt_text() == "x"
    assert completion().prompt_text() == "hi"
    parts = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
        '{"type": "text", "text": "b"}]}, {"role": "assistant"}]}'
    )
    assert [m.text() for m in parts.messages] == ["ab", ""]


def _events(
    *tokens: tuple[str, bytes], reason: DoneReason = DoneReason.MAX_TOKENS, logprobs: bool = False
) -> list[Any]:
    out: list[Any] = []
    for i, (text, raw) in enumerate(tokens):
        if logprobs:
            out.append(
                Logprobs(1, i, -0.5 * (i + 1), raw, ((i, -0.5 * (i + 1), raw), (99, -3.0, b"z")))
            )
        out.append(Token(1, i, 10 + i, text))
    out.append(Done(1, reason, 4, len(tokens), 0.1))
    return out


def _decode(chunk: bytes) -> dict[str, Any]:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    parsed: dict[str, Any] = json.loads(chunk[len(b"data: ") :])
    return parsed


@pytest.mark.parametrize(
    ("reason", "finish"),
    [
        (DoneReason.MAX_TOKENS, "length"),
        (DoneReason.CONTEXT_FULL, "length"),
        (DoneReason.EOS, "stop"),
        (DoneReason.STOP_STRING, "stop"),
        (DoneReason.CANCELLED, "stop"),
    ],
)
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
    assert opening["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert opening["object"] == "chat.completion.chunk"
    chunk = _decode(render.chunk("Hi", []))
    assert chunk["choices"] == [
        {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}
    ]
    out = _Output(chat=True)
    out.take(_events(("Hi", b"Hi"), reason=DoneReason.EOS))
    closing, usage_chunk = render.closing(out).split(b"\n\n")[:2]
    assert _decode(closing + b"\n\n")["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    ]
    tail = _decode(usage_chunk + b"\n\n")
    assert tail["choices"] == [] and tail["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 1,
        "total_tokens": 5,
    }
    plain = _Render(False, "id-3", "m", include_usage=False, logprobs=False)
    assert plain.opening() == b""
    (closing,) = [c for c in plain.closing(out).split(b"\n\n") if c]
    assert _decode(closing + b"\n\n")["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    ]
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()


def test_legacy_logprobs_offsets_continue_across_chunks() -> None:
    render = _Render(False, "id-4", "m", include_usage=False, logprobs=True)
    out = _Output(chat=False)
    first, lps = out.take(_events(("ab", b"ab"), ("é", "é".encode()), logprobs=True)[:4])
    one = _decode(render.chunk(first, lps))["choices"][0]["logprobs"]
    assert one == {
        "tokens": ["ab", "é"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"ab": -0.5, "z": -3.0}, {"é": -1.0, "z": -3.0}],
        "text_offset": [0, 2],
    }
    piece, lps = out.take([Logprobs(1, 7, -2.0, b"cd", ()), Token(1, 7, 12, "cd")])
    two = _decode(render.chunk(piece, lps))["choices"][0]["logprobs"]
    assert two["text_offset"] == [3] and two["top_logprobs"] == [{}]
    assert legacy_logprobs([], 5) == {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }


def test_chat_logprobs_carry_bytes() -> None:
    lp = Logprobs(1, 3, -0.25, b"\xc3", ((3, -0.25, b"\xc3"), (4, -2.0, b"a")))
    assert chat_logprobs([lp]) == {
        "content": [
            {
                "token": "\ufffd",
                "logprob": -0.25,
                "bytes": [0xC3],
                "top_logprobs": [
                    {"token": "\ufffd", "logprob": -0.25, "bytes": [0xC3]},
                    {"token": "a", "logprob": -2.0, "bytes": [0x61]},
                ],
            }
        ],
        "refusal": None,
    }


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
    assert http_error(BackendFailed("x", grpc.StatusCode.RESOURCE_EXHAUSTED)).headers == {
        "Retry-After": "1"
    }
    assert http_error(InvalidRequest("x")).headers is None


def test_a_chunk_of_each_endpoint_and_its_logprobs() -> None:
    plain = _Render(False, "id-5", "m", include_usage=False, logprobs=False)
    chunk = _decode(plain.chunk("x", []))
    assert set(chunk) == {"id", "object", "created", "model", "choices"}
    assert isinstance(chunk["created"], int) and chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]
    lp = Logprobs(1, 3, -0.25, b"x", ((3, -0.25, b"x"),))
    with_lps = _Render(True, "id-6", "m", include_usage=False, logprobs=True)
    c = _decode(with_lps.chunk("x", [lp]))
    assert c["object"] == "chat.completion.chunk"
    assert c["choices"][0]["logprobs"] == chat_logprobs([lp])
    assert c["choices"][0]["delta"] == {"content": "x"}
    marker = "\u2063piece\u2063"  # the hot path's own marker, as the model's name
    tricky = _Render(True, "id-7", marker, include_usage=False, logprobs=False)
    assert _decode(tricky.chunk("y", []))["model"] == marker
    assert _decode(tricky.chunk("y", []))["choices"][0]["delta"] == {"content": "y"}
    assert _decode(tricky.chunk("é", []))["choices"][0]["delta"] == {"content": "é"}
    assert "é".encode() in tricky.chunk("é", [])  # not escaped


def test_offsets_over_three_chunks_and_the_whole_answers_logprobs() -> None:
    render = _Render(False, "id-8", "m", include_usage=False, logprobs=True)
    out = _Output(chat=False)
    offsets = []
    for text in ("ab", "é", "cd"):
        piece, lps = out.take([Logprobs(1, 0, -1.0, text.encode(), ()), Token(1, 0, 0, text)])
        offsets += _decode(render.chunk(piece, lps))["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [0, 2, 3]
    assert legacy_logprobs(out.logprobs, 0)["text_offset"] == [0, 2, 3]
    out.take([Done(1, DoneReason.MAX_TOKENS, 1, 3, 0.1)])
    whole = render.whole(out)
    assert whole["choices"][0]["text"] == "abécd"
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 2, 3]
    assert whole["choices"][0]["logprobs"]["tokens"] == ["ab", "é", "cd"]
    chat_render = _Render(True, "id-9", "m", include_usage=False, logprobs=True)
    chat_out = _Output(chat=True)
    chat_out.take(_events(("a", b"a"), logprobs=True)[:2])
    chat_out.take(_events(("b", b"b"), logprobs=True))
    assert [
        e["token"] for e in chat_render.whole(chat_out)["choices"][0]["logprobs"]["content"]
    ] == ["a", "b"]
    closing = _decode(chat_render.closing(chat_out))
    assert closing["object"] == "chat.completion.chunk"
    tail = _Render(True, "id-10", "m", include_usage=True, logprobs=False).closing(chat_out)
    assert [_decode(p + b"\n\n")["object"] for p in tail.split(b"\n\n") if p] == [
        "chat.completion.chunk"
    ] * 2


def test_error_bodies_are_openais() -> None:
    err = HttpError(404, "no such model", code="model_not_found")
    assert str(err) == "no such model" and err.status == 404
    assert err.body == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }
    assert (
        HttpError(400, "bad", param="top_p").body
        == error_body("bad", "invalid_request_error", "top_p")
        == {
            "error": {
                "message": "bad",
                "type": "invalid_request_error",
                "param": "top_p",
                "code": None,
            }
        }
    )


def test_the_fair_queues_counts() -> None:
    for bad in ((0, 1), (1, -1)):
        with pytest.raises(ValueError, match="max_active must be >= 1 and max_waiting >= 0"):
            FairQueue(*bad)
    assert FairQueue(1, 0).max_waiting == 0

    async def main() -> None:
        q = FairQueue(max_active=3, max_waiting=2)
        for _ in range(3):
            await q.acquire("a")
        assert q.active == 3
        waiters = [asyncio.ensure_future(q.acquire(k)) for k in ("b", "c")]
        await asyncio.sleep(0)
        assert q.waiting == 2
        with pytest.raises(QueueFull, match="3 requests run and 2 wait"):
            await q.acquire("d")
        q.release()
        await asyncio.sleep(0)
        assert (q.active, q.waiting) == (3, 1)  # one let in for the one place freed
        q.release()
        await asyncio.gather(*waiters)
        assert (q.active, q.waiting) == (3, 0)  # both let in, never past max_active

    asyncio.run(main())


def _asgi_stream(chunks: list[bytes], leave_after: int | None) -> tuple[list[Any], int, bool]:
    """An EventStream driven as uvicorn drives it: the messages sent, ``on_close`` calls and
    whether the body's generator was closed, both when the stream returned. ``leave_after``:
    the client disconnects once that many body chunks were sent, while the last send still
    waits on it (None: it stays and takes everything)."""
    sent: list[Any] = []
    state = {"closed": 0, "finally": False}
    at_return: dict[str, Any] = {}

    async def main() -> None:
        gone = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            try:
                for c in chunks:
                    yield c
                if leave_after is not None:  # more to come, later than the client stays
                    await asyncio.Event().wait()
            finally:
                state["finally"] = True

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            bodies = [m for m in sent if m["type"] == "http.response.body"]
            if leave_after is not None and len(bodies) >= leave_after:
                gone.set()
                await asyncio.Event().wait()  # a client that left takes nothing more

        def on_close() -> None:
            state["closed"] += 1

        await EventStream(body(), on_close)(
            {"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send
        )
        at_return.update(state)  # before the loop's shutdown would close the generator

    asyncio.run(main())
    return sent, at_return["closed"], at_return["finally"]


def test_an_event_stream_as_the_client_sees_it() -> None:
    sent, closed, finished = _asgi_stream([b"data: 1\n\n", SSE_DONE], leave_after=None)
    start, *bodies = sent
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache"
    assert b"".join(b["body"] for b in bodies) == b"data: 1\n\n" + SSE_DONE
    assert bodies[-1].get("more_body", False) is False
    assert (closed, finished) == (1, True)


def test_a_client_that_leaves_mid_stream_closes_the_stream_at_once() -> None:
    sent, closed, finished = _asgi_stream([b"data: 1\n\n"], leave_after=1)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert (closed, finished) == (1, True)  # its generator closed (CANCEL), on_close once
