"""The OpenAI-compatible HTTP API, driven by the official ``openai`` package and by raw HTTP,
against a real gateway process in front of a real tensor-parallel pair (both ranks processes,
tests/gateway_pair.py's ``running_pair``), on loopback.

The model is one of our byte-vocabulary models, whose own template would be the built-in
``plain`` one; the leader runs with ``--chat-template gemma`` here, so that the flag and a
template's refusal are exercised too. The chat answers are compared with completions of the
rendered text and with greedy decoding in this process (``reference_greedy``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest
from gateway_pair import (
    LONG,
    MODEL_CFG,
    PAIR_FLAGS,
    PREFILL_CHUNK,
    Pair,
    free_port,
    running_pair,
)
from procs import ENV, Service
from tp_harness import make_model, metric, reference_greedy

from foundry.api.v1 import inference_pb2, inference_pb2_grpc
from foundry.gateway.admission import FairQueue, QueueFull
from foundry.gateway.openai import sse
from foundry.gateway.openai.render import _Render
from foundry.model.spec.config import EOS_ID
from foundry.model.text.chat import BUILTINS, ChatTemplate, Message, prompt_text
from foundry.model.text.vocab.byte import decode

TOKEN = "http-s3cret"
HTTP_LINE = r"http 127\.0\.0\.1:(\d+)"
METRICS_LINE = r"metrics :(\d+)"
MAX_ACTIVE = 4
QUEUE = 4
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


@dataclass
class Server:
    pair: Pair
    gateway: Service
    port: int
    metrics: int

    clients: list[openai.OpenAI] = field(default_factory=list)  # closed at the end

    def client(self, token: str = TOKEN) -> openai.OpenAI:
        c = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key=token, max_retries=0, timeout=60
        )
        self.clients.append(c)  # kept until closed: never left to the collector, open
        return c

    def raw(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(
                method, path, body, {"Authorization": f"Bearer {TOKEN}", **(headers or {})}
            )
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def metric(self, name: str) -> float:
        try:
            return metric(self.metrics, name)
        except AssertionError:  # a labelled series is exposed from its first count on
            return 0.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "model.gguf", MODEL_CFG)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("http")
    (logs / "token").write_text(TOKEN + "\n")
    with (
        running_pair(model, logs, (*PAIR_FLAGS, "--chat-template", "gemma")) as pair,
        Service(
            [
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
                "--http-max-active",
                str(MAX_ACTIVE),
                "--http-queue",
                str(QUEUE),
                "--token-file",
                str(logs / "token"),
                "--metrics-port",
                "0",
                "--coordinator-admin",
                f"127.0.0.1:{free_port()}",
                "--tp-frontend",
                f"127.0.0.1:{pair.frontend}",
            ],
            logs / "gateway.log",
        ) as gateway,
    ):
        port = int(gateway.wait_for(HTTP_LINE).group(1))
        metrics = int(gateway.wait_for(METRICS_LINE).group(1))
        server = Server(pair, gateway, port, metrics)
        try:
            yield server
        finally:
            for c in server.clients:
                c.close()
        assert "Traceback" not in gateway.text(), gateway.text()[-3000:]


def greedy(model: Path, prompt: str, n: int) -> tuple[list[int], str]:
    """What the pair must generate greedily: tokens up to and with the first EOS, their text."""
    ref = reference_greedy(model, prompt, n, PREFILL_CHUNK)
    tokens = ref.tokens
    if EOS_ID in tokens:
        tokens = tokens[: tokens.index(EOS_ID) + 1]
    return tokens, decode(tokens)


def log_softmax(row: np.ndarray) -> np.ndarray:
    z = row.astype(np.float64)
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


# ---------------------------------------------------------------------------- the client


def test_chat_is_the_rendered_conversation_greedily(server: Server, model: Path) -> None:
    c = server.client()
    rendered = prompt_text(
        ChatTemplate(BUILTINS["gemma"], "gemma"),
        [Message(m["role"], m["content"]) for m in CONVERSATION],
    )
    assert rendered == "<start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
    tokens, text = greedy(model, rendered, 24)
    chat = c.chat.completions.create(
        model="foundry",
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
    )
    assert chat.choices[0].message.content == text
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == ("stop" if tokens[-1] == EOS_ID else "length")
    assert chat.usage is not None
    assert chat.usage.completion_tokens == len(tokens)
    assert chat.usage.prompt_tokens == len(rendered.encode()) + 1  # BOS, then one per byte
    done = c.completions.create(model="foundry", prompt=rendered, max_tokens=24, temperature=0)
    assert done.choices[0].text == text
    assert done.object == "text_completion"


def test_streams_join_to_the_whole_answer(server: Server, model: Path) -> None:
    c = server.client()
    whole = c.chat.completions.create(
        model="foundry",
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
    )
    chunks = list(
        c.chat.completions.create(
            model="foundry",
            messages=CONVERSATION,
            max_tokens=40,
            temperature=0,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    pieces = list(
        c.completions.create(
            model="foundry", prompt="Once upon", max_tokens=30, temperature=0, stream=True
        )
    )
    _, want = greedy(model, "Once upon", 30)
    assert "".join(p.choices[0].text for p in pieces) == want


def test_logprobs_are_the_models(server: Server, model: Path) -> None:
    prompt = "Logprobs, please"
    ref = reference_greedy(model, prompt, 6, PREFILL_CHUNK)
    c = server.client()
    done = c.completions.create(
        model="foundry", prompt=prompt, max_tokens=6, temperature=0, logprobs=3
    )
    lp = done.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    n = len(lp.token_logprobs)
    assert n == min(6, [*ref.tokens, EOS_ID].index(EOS_ID) + 1)
    for i in range(n):
        want = log_softmax(ref.logits[i][0])
        assert lp.token_logprobs[i] == pytest.approx(want[ref.tokens[i]], abs=1e-4)
        assert lp.token_logprobs[i] == pytest.approx(want.max(), abs=1e-4)  # greedy: the top
        # Keys are token texts (two bytes may both read as U+FFFD): up to 3, each of the top 3.
        top3 = np.sort(want)[-3:]
        assert 1 <= len(lp.top_logprobs[i]) <= 3
        for v in lp.top_logprobs[i].values():
            assert np.min(np.abs(top3 - v)) < 1e-4
    chat = c.chat.completions.create(
        model="foundry",
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None
    raw = b"".join(bytes(e.bytes or []) for e in content.content)
    assert raw.decode("utf-8", errors="replace") == chat.choices[0].message.content
    for e in content.content:
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy takes the top
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob


def test_sampling_settings_reach_the_sampler(server: Server, model: Path) -> None:
    c = server.client()

    def text(**kw: Any) -> str:
        r = c.completions.create(model="foundry", prompt="Sample me", max_tokens=24, **kw)
        return r.choices[0].text

    greedy_text = text(temperature=0)
    # top_k travels in the body (the openai client passes unknown arguments as extra_body).
    assert text(temperature=1.5, seed=3, extra_body={"top_k": 1}) == greedy_text
    assert text(temperature=1.5, seed=3, top_p=1e-6) == greedy_text
    a = text(temperature=1.5, seed=11)
    assert a == text(temperature=1.5, seed=11)
    assert len({a, text(temperature=1.5, seed=12), text(temperature=1.5, seed=13)}) > 1


def test_stop_strings_across_token_boundaries(server: Server, model: Path) -> None:
    _, full = greedy(model, LONG[0], 80)  # runs to max_tokens: no EOS
    # Three characters: at least three tokens of the byte vocabulary (one byte each).
    stop = full[10:13]
    r = server.client().completions.create(
        model="foundry", prompt=LONG[0], max_tokens=80, temperature=0, stop=[stop, "\x00zz"]
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_ctl_and_grpc_send_the_same_conversation(server: Server, tmp_path: Path) -> None:
    """`foundry ctl generate --message` (gRPC Generate with messages) prints the reply the
    HTTP API gives for the same conversation."""
    grpc_port = server.gateway.wait_for(r"grpc 127\.0\.0\.1:(\d+)").group(1)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    ctl = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "ctl",
            "--gateway",
            f"127.0.0.1:{grpc_port}",
            "--token-file",
            str(token),
            "generate",
            "--max-tokens",
            "16",
            *(f"--message={m['role']}:{m['content']}" for m in CONVERSATION),
        ],
        capture_output=True,
        env=ENV,
        timeout=60,
    )
    assert ctl.returncode == 0, ctl.stderr
    chat = server.client().chat.completions.create(
        model="foundry",
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
    )
    content = chat.choices[0].message.content
    assert content is not None
    assert ctl.stdout == content.encode() + b"\n"


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (f"Bearer   {TOKEN}", "accepted"),  # spaces before the token belong to no token
        (f"bearer {TOKEN}", "accepted"),  # the scheme is case-insensitive
        (f"Bearer  {TOKEN}x", "wrong"),
        ("Bearer   ", "missing"),  # spaces only: no token at all
        (f"Basic {TOKEN}", "missing"),
    ],
    ids=["spaces-before", "scheme-case", "wrong", "spaces-only", "basic"],
)
def test_both_doors_answer_the_same_to_one_authorization_value(
    server: Server, value: str, want: str
) -> None:
    """The gRPC interceptor and the HTTP routes read the header with one function
    (``auth.check_bearer``): a token with spaces around it (RFC 6750: a b64token holds none)
    is accepted or refused alike."""
    grpc_port = server.gateway.wait_for(r"grpc 127\.0\.0\.1:(\d+)").group(1)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        try:
            inference_pb2_grpc.InferenceServiceStub(channel).GetPairStatus(
                inference_pb2.GetPairStatusRequest(),
                metadata=(("authorization", value),),
                timeout=10,
            )
            by_grpc = "accepted"
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
            by_grpc = "missing" if "requires a bearer token" in (exc.details() or "") else "wrong"
    status, _, answer = server.raw("GET", "/v1/models", headers={"Authorization": value})
    assert status in (200, 401), answer
    code = json.loads(answer)["error"]["code"] if status == 401 else None
    by_http = {None: "accepted", "missing_api_key": "missing", "invalid_api_key": "wrong"}[code]
    assert (by_grpc, by_http) == (want, want)


def test_models_and_health(server: Server) -> None:
    assert [m.id for m in server.client().models.list()] == ["foundry"]
    status, _, body = server.raw("GET", "/health", headers={"Authorization": ""})
    assert (status, json.loads(body)) == (200, {"status": "ok"})


# ---------------------------------------------------------------------------- raw HTTP


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


# ---------------------------------------------------------------------------- the queue


def test_fair_queue_takes_clients_in_turn() -> None:
    async def main() -> list[str]:
        q = FairQueue(max_active=1, max_waiting=5)
        await q.acquire("a")  # runs
        order: list[str] = []

        async def wait(key: str) -> None:
            await q.acquire(key)
            order.append(key)

        tasks = [asyncio.ensure_future(wait(k)) for k in ("a", "a", "a", "b", "c")]
        await asyncio.sleep(0)
        assert q.waiting == 5
        with pytest.raises(QueueFull):
            await q.acquire("d")
        for _ in range(5):
            q.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    # a's burst does not keep b and c waiting: the keys take turns.
    assert asyncio.run(main()) == ["a", "b", "c", "a", "a"]


def test_fair_queue_skips_a_waiter_cancelled_before_it_woke() -> None:
    async def main() -> None:
        q = FairQueue(max_active=1, max_waiting=2)
        await q.acquire("a")
        gone = asyncio.ensure_future(q.acquire("b"))
        stays = asyncio.ensure_future(q.acquire("c"))
        await asyncio.sleep(0)
        gone.cancel()  # its future is cancelled now; its task runs only at the next turn
        q.release()  # so this must pass over it to c
        await stays
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert (q.active, q.waiting) == (1, 0)

    asyncio.run(main())


def test_fair_queue_forgets_a_waiter_that_leaves() -> None:
    async def main() -> None:
        q = FairQueue(max_active=1, max_waiting=1)
        await q.acquire("a")
        gone = asyncio.ensure_future(q.acquire("b"))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert q.waiting == 0
        q.release()
        assert q.active == 0
        await q.acquire("c")  # at once: nobody waits
        assert q.active == 1

    asyncio.run(main())


# ---------------------------------------------------------------------------- TLS


def test_https_with_the_gateways_certificate(server: Server, tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    made = subprocess.run(
        [sys.executable, "-m", "foundry", "certs", "--out", str(certs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    with Service(
        [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--tls-cert",
            str(certs / "gateway.pem"),
            "--tls-key",
            str(certs / "gateway-key.pem"),
            "--coordinator-admin",
            f"127.0.0.1:{free_port()}",
            "--tp-frontend",
            f"127.0.0.1:{server.pair.frontend}",
        ],
        tmp_path / "gateway.log",
    ) as gateway:
        port = int(gateway.wait_for(HTTP_LINE).group(1))
        with openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1",
            api_key="none",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(
                verify=ssl.create_default_context(cafile=str(certs / "ca.pem"))
            ),
        ) as trusted:
            r = trusted.completions.create(
                model="foundry", prompt="secure", max_tokens=4, temperature=0
            )
        want = server.client().completions.create(
            model="foundry", prompt="secure", max_tokens=4, temperature=0
        )
        assert r.choices[0].text == want.choices[0].text
        with pytest.raises(openai.APIConnectionError):  # plain HTTP on the TLS port
            openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0
            ).models.list()
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        with (
            ssl.create_default_context().wrap_socket(  # a client that does not trust the CA
                raw, server_hostname="127.0.0.1", do_handshake_on_connect=False
            ) as untrusting,
            pytest.raises(ssl.SSLCertVerificationError),
        ):
            untrusting.do_handshake()


@pytest.mark.parametrize("chat", [True, False])
def test_a_text_chunk_is_its_whole_rendering(chat: bool) -> None:
    marker = "\u2063piece\u2063"
    render = _Render(chat, "cmpl-1", f'model "{marker}"', include_usage=False, logprobs=False)
    for piece in ["", "plain", 'quote " and \\ backslash', "é😀\n\t\x00", marker]:
        whole = sse(render._envelope([render._choice(piece, None)], True))
        assert render.chunk(piece, []) == whole
        assert json.loads(whole[len(b"data: ") :])["model"] == f'model "{marker}"'
