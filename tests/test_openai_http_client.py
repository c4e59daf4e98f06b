"""The OpenAI-compatible HTTP API driven by the official ``openai`` package: chat and
completions against greedy decoding in this process (``reference_greedy``), streams,
logprobs, sampling, stop strings, the same conversation over ctl and gRPC, auth, models.

A real gateway process in front of a real tensor-parallel pair (both ranks processes,
tests/gateway_pair.py's ``running_pair``; the ``server`` fixture, tests/openai_server.py), on
loopback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from gateway_pair import LONG, PREFILL_CHUNK
from openai_server import CONVERSATION, TOKEN, Server
from procs import ENV
from tp_harness import reference_greedy

from foundry.api.v1 import inference_pb2, inference_pb2_grpc
from foundry.model.spec.config import EOS_ID
from foundry.model.text.chat import BUILTINS, ChatTemplate, Message, prompt_text
from foundry.model.text.vocab.byte import decode


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
