"""The OpenAI-compatible HTTP API over raw HTTP: bad requests and the status each gets, clients
that disconnect or stop reading, 32 concurrent streams, metrics by endpoint and status.

A real gateway process in front of a real tensor-parallel pair (both ranks processes,
tests/gateway_pair.py's ``running_pair``; the ``server`` fixture, tests/openai_server.py), on
loopback.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import openai
import pytest
from gateway_pair import LONG, MODEL_CFG
from openai_server import CONVERSATION, MAX_ACTIVE, TOKEN, Server

BIG = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param"),
    [
        ("/v1/chat/completions", b'{"messages": [', {}, 400, None),
        ("/v1/completions", BIG, {}, 413, None),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', {}, 400, None),
        ("/v1/completions", b'{"prompt": 5}', {}, 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', {}, 400, "temperature"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -3}', {}, 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "top_p": 0}', {}, 400, "top_p"),
        ("/v1/completions", b'{"prompt": "x", "n": 2}', {}, 400, "n"),
        ("/v1/completions", b'{"prompt": "x", "stop": [""]}', {}, 400, "stop"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "king", "content": "x"}]}',
            {},
            400,
            "messages.0.role",
        ),
        ("/v1/chat/completions", b'{"messages": []}', {}, 400, "messages"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
            {},
            400,
            "max_completion_tokens",
        ),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 2}', {"Authorization": ""}, 401, None),
        (
            "/v1/completions",
            b'{"prompt": "x", "max_tokens": 2}',
            {"Authorization": "Bearer nope"},
            401,
            None,
        ),
        (
            "/v1/completions",
            b'{"prompt": "x", "max_tokens": 2, "frequency_penalty": 1, "user": "me"}',
            {},
            200,
            None,
        ),  # unknown and unserved fields are ignored
        ("/v1/nothing", b"{}", {}, 404, None),
    ],
    ids=[
        "malformed-json",
        "10MB",
        "invalid-utf8",
        "prompt-type",
        "temperature-type",
        "negative-max-tokens",
        "top-p-range",
        "n",
        "empty-stop",
        "role",
        "no-messages",
        "max-completion-tokens",
        "no-token",
        "wrong-token",
        "unknown-fields",
        "path",
    ],
)
def test_bad_requests_get_their_status_and_the_gateway_serves_on(
    server: Server,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    param: str | None,
) -> None:
    got, _, answer = server.raw("POST", path, body, headers)
    assert got == status, answer
    assert b"Traceback" not in answer
    parsed = json.loads(answer)
    if status != 200:
        assert set(parsed["error"]) == {"message", "type", "param", "code"}
        assert parsed["error"]["param"] == param
        if param is not None:
            assert param in parsed["error"]["message"]
    assert server.raw("GET", "/health")[0] == 200


def test_a_conversation_the_template_refuses_is_a_400(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="alternate") as exc:
        server.client().chat.completions.create(
            model="foundry",
            max_tokens=4,
            messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        )
    assert exc.value.status_code == 400
    assert server.raw("GET", "/health")[0] == 200


def test_a_prompt_past_the_context_is_a_400(server: Server) -> None:
    status, _, body = server.raw(
        "POST", "/v1/completions", json.dumps({"prompt": "x" * (MODEL_CFG.n_ctx + 5)}).encode()
    )
    assert status == 400 and b"context" in body


def _open_stream(port: int, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def _wait_cancelled(server: Server, before: float, within_s: float) -> float:
    """Seconds until the leader counts one more cancelled request (fails past ``within_s``)."""
    t0 = time.monotonic()
    while server.pair.requests("cancelled") < before + 1:
        assert time.monotonic() - t0 < within_s, "the generation was not cancelled"
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_generation(server: Server, stream: bool) -> None:
    before = server.pair.requests("cancelled")
    s = _open_stream(
        server.port, {"prompt": LONG[0], "max_tokens": LONG[1], "temperature": 0, "stream": stream}
    )
    if stream:
        assert s.recv(4096).startswith(b"HTTP/1.1 200")  # the stream has begun
    else:
        while server.pair.status().active_sessions == 0:  # the pair is decoding it now
            time.sleep(0.01)
    s.close()
    # The bound: the pair stops within a second of the disconnect.
    assert _wait_cancelled(server, before, within_s=1.0) < 1.0
    assert server.raw("GET", "/health")[0] == 200


def test_a_client_that_stops_reading_does_not_stop_the_others(server: Server) -> None:
    before = server.pair.requests("cancelled")
    stalled = _open_stream(
        server.port, {"prompt": LONG[0], "max_tokens": LONG[1], "temperature": 0, "stream": True}
    )
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        assert stalled.recv(64).startswith(b"HTTP/1.1 200")  # then it reads no more
        r = server.client().completions.create(
            model="foundry", prompt="meanwhile", max_tokens=8, temperature=0
        )
        assert r.choices[0].finish_reason in ("length", "stop")
    finally:
        stalled.close()
    _wait_cancelled(server, before, within_s=10.0)


def test_32_concurrent_streams_complete_or_get_429(server: Server) -> None:
    results: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            chunks = list(
                server.client().completions.create(
                    model="foundry", prompt=f"client {i}", max_tokens=30, temperature=0, stream=True
                )
            )
            outcome = chunks[-1].choices[0].finish_reason or "none"
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"] == "1"
            outcome = "429"
        with lock:
            results.append(outcome)

    before = server.metric(
        'foundry_gateway_http_requests_total{endpoint="completions",status="429"}'
    )
    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client hangs"
    assert len(results) == 32 and set(results) <= {"length", "stop", "429"}, results
    assert results.count("429") <= 32 - MAX_ACTIVE  # the first MAX_ACTIVE always get in
    after = server.metric(
        'foundry_gateway_http_requests_total{endpoint="completions",status="429"}'
    )
    assert after - before == results.count("429")
    assert server.metric("foundry_gateway_http_queue_depth_requests") == 0


def test_metrics_by_endpoint_and_status(server: Server) -> None:
    name = 'foundry_gateway_http_requests_total{endpoint="chat",status="200"}'
    before = server.metric(name)
    ttft = server.metric('foundry_gateway_http_time_to_first_token_seconds_count{endpoint="chat"}')
    itl = 'foundry_gateway_inter_token_latency_seconds_count{endpoint="chat"}'
    gaps = server.metric(itl)
    server.client().chat.completions.create(
        model="foundry",
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
    )
    assert server.metric(name) == before + 1
    assert (
        server.metric('foundry_gateway_http_time_to_first_token_seconds_count{endpoint="chat"}')
        == ttft + 1
    )
    assert server.metric(itl) - gaps <= 4 - 1
    gaps = server.metric(itl)
    streamed = list(
        server.client().chat.completions.create(
            model="foundry",
            messages=CONVERSATION,
            max_tokens=12,
            temperature=0.8,
            seed=1,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    generated = streamed[-1].usage.completion_tokens  # type: ignore[union-attr]
    # Every token after the first batch is one gap (sampled: one token a step, so the first
    # batch cannot hold all 12); the first batch holds at least one.
    assert 1 <= server.metric(itl) - gaps <= generated - 1
