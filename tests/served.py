"""The served path end to end, for the tests that pin it: a real tensor-parallel pair
(``tp-leader`` and ``tp-worker`` processes) behind a real gateway process (gRPC and the
OpenAI-compatible HTTP API), on loopback, serving a real vocabulary: the published Gemma 3
file ($FOUNDRY_GEMMA_GGUF) or the tiny Llama 3 model of ``tiny_bpe``.

Clients here read what a client reads: HTTP as raw bytes (``http.client``, or a socket for a
stream, so the server-sent events' framing is checked byte for byte) and gRPC through the
generated stub. The reference is the one-process engine on the same file (``Greedy``), fed the
ids of the file's own tokenizer, with the template the leader uses.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from gateway_pair import Pair, free_port
from procs import Service
from tp_harness import metric, start_leader, start_worker, wait_paired

from foundry.api.v1 import inference_pb2, inference_pb2_grpc
from foundry.model.formats.gguf_io import load_gguf_stored
from foundry.model.formats.gguf_meta import read_metadata
from foundry.model.infer.inference import Engine
from foundry.model.infer.sampling import make_rng, sample
from foundry.model.text.chat import ChatTemplate, Message, chat_prompt, template_for
from foundry.model.text.vocab import Tokenizer
from foundry.model.text.vocab.tokenizer import load_tokenizer
from foundry.tp.policy import TextStream

HTTP_LINE = r"http 127\.0\.0\.1:(\d+)"
GRPC_LINE = r"grpc 127\.0\.0\.1:(\d+)"
METRICS_LINE = r"metrics :(\d+)"
MODEL_NAME = "served-model"
# The leader's default prefill chunk: the reference prefills in the same chunks.
PREFILL_CHUNK = 64
# Loading the Gemma file in both ranks on a loaded two-core machine.
STARTUP_S = 120.0
# Time for one request on a loaded two-core machine, with 16 others beside it.
REQUEST_S = 120.0


@dataclass
class Chat:
    """A conversation, or a prompt (``messages`` empty): what a client asks."""

    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()

    def body(self) -> dict[str, Any]:
        if self.messages:
            return {"messages": [{"role": r, "content": c} for r, c in self.messages]}
        return {"prompt": self.prompt}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages else "/v1/completions"


class Reference:
    """The one-process engine on the file, with the file's tokenizer and the leader's template.
    Greedy answers are memoized (the same prompt is asked many times)."""

    def __init__(self, model: Path, ctx_size: int, template: str | None = None) -> None:
        meta = read_metadata(model)
        self.tokenizer: Tokenizer = load_tokenizer(meta)
        self.template: ChatTemplate = template_for(meta, template)
        m = load_gguf_stored(model)
        self.engine = Engine(m.cfg, m.params, ctx_size=ctx_size)
        self.ctx_size = ctx_size

    def prompt_ids(self, ask: Chat) -> list[int]:
        if ask.messages:  # as the leader: the template's markers parsed, the content text
            return chat_prompt(
                self.template, self.tokenizer, [Message(r, c) for r, c in ask.messages]
            )
        return self.tokenizer.encode(ask.prompt)

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one Reference per module)
    def _generate(
        self, ids: tuple[int, ...], n: int, temperature: float = 0.0, seed: int = 0
    ) -> tuple[int, ...]:
        s = self.engine.new_session()
        rng = make_rng(seed)  # the leader's generator of a request with this seed
        row = None
        for start in range(0, len(ids), PREFILL_CHUNK):
            row = self.engine.decode(s, list(ids[start : start + PREFILL_CHUNK]))[-1]
        assert row is not None
        out: list[int] = []
        while True:
            out.append(
                int(np.argmax(row)) if temperature == 0 else sample(row, temperature, rng=rng)
            )
            # A full context ends it too: the last token is sampled from the last position's
            # row and is never evaluated itself (as in foundry.model.infer.generate).
            if (
                out[-1] in self.tokenizer.eog_ids
                or len(out) == n
                or len(ids) + len(out) > self.ctx_size
            ):
                return tuple(out)
            row = self.engine.decode(s, [out[-1]])[-1]

    def greedy(self, ask: Chat, n: int) -> list[int]:
        """The tokens a greedy generation of at most ``n`` gives, its end-of-turn included."""
        return list(self._generate(tuple(self.prompt_ids(ask)), n))

    def sampled(self, ask: Chat, n: int, temperature: float, seed: int) -> list[int]:
        """The tokens a generation sampled at ``temperature`` with ``seed`` gives (top_p 1,
        top_k 0), as ``greedy``."""
        return list(self._generate(tuple(self.prompt_ids(ask)), n, temperature, seed))

    def stops(self, tokens: Sequence[int], stop: Sequence[str]) -> bool:
        """Whether the leader's stream of ``tokens`` completes one of ``stop``."""
        return self._stream(tokens, stop)[1]

    def text(self, tokens: Sequence[int], stop: Sequence[str] = ()) -> str:
        """The text the leader streams for ``tokens`` (its stream decoder, its stop strings)."""
        return self._stream(tokens, stop)[0]

    def _stream(self, tokens: Sequence[int], stop: Sequence[str]) -> tuple[str, bool]:
        """The leader's stream of ``tokens``: the text it sends, and whether a stop string
        ended it."""
        stream = TextStream(stop, self.tokenizer.stream_decoder())
        out = []
        for i, t in enumerate(tokens):
            piece, hit = stream.push(t, final=i == len(tokens) - 1)
            out.append(piece)
            if hit:
                return "".join(out), True
        return "".join(out), False


@dataclass
class Reply:
    """One answer, as any of the three clients saw it."""

    text: str
    finish_reason: str | None
    usage: dict[str, int] | None = None
    token_ids: list[int] | None = None  # gRPC only
    token_bytes: list[bytes] | None = None  # with logprobs
    raw: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Served:
    """A running pair behind a running gateway."""

    pair: Pair
    gateway: Service
    http: int
    grpc: int
    metrics: int

    # -- HTTP, raw ----------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http, timeout=REQUEST_S)
        try:
            conn.request(
                method, path, body, {"Content-Type": "application/json", **(headers or {})}
            )
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        return self.request("POST", path, json.dumps({"model": MODEL_NAME, **body}).encode())

    def stream_bytes(self, path: str, body: dict[str, Any]) -> bytes:
        """A streamed response exactly as it came off the socket: status line, headers, the
        chunked body (HTTP/1.0: no chunk framing, the body ends with the connection)."""
        data = json.dumps({"model": MODEL_NAME, **body, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", self.http), timeout=REQUEST_S) as s:
            s.sendall(
                f"POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        return raw

    def whole(self, ask: Chat, **kw: Any) -> Reply:
        status, _, body = self.post(ask.path, {**ask.body(), **kw})
        assert status == 200, body
        r = json.loads(body)
        choice = r["choices"][0]
        text = choice["message"]["content"] if ask.messages else choice["text"]
        return Reply(
            text,
            choice["finish_reason"],
            r["usage"],
            token_bytes=_token_bytes(ask, [choice.get("logprobs")]),
            raw=body,
            events=[r],
        )

    def streamed(self, ask: Chat, **kw: Any) -> Reply:
        raw = self.stream_bytes(ask.path, {**ask.body(), **kw})
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), raw[:2000]
        events = sse_events(body)
        chunks = [e for e in events if e.get("choices")]
        if ask.messages:
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        else:
            text = "".join(c["choices"][0]["text"] for c in chunks)
        usage = next((e["usage"] for e in events if e.get("usage")), None)
        return Reply(
            text,
            chunks[-1]["choices"][0]["finish_reason"],
            usage,
            token_bytes=_token_bytes(ask, [c["choices"][0].get("logprobs") for c in chunks]),
            raw=body,
            events=events,
        )

    # -- gRPC ---------------------------------------------------------------------------

    def grpc_generate(
        self,
        ask: Chat,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop: Sequence[str] = (),
    ) -> Reply:
        request = inference_pb2.GenerateRequest(
            prompt=ask.prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop=list(stop),
            messages=[inference_pb2.ChatMessage(role=r, content=c) for r, c in ask.messages],
        )
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            ids: list[int] = []
            text: list[str] = []
            done = None
            for response in stub.Generate(request, timeout=REQUEST_S):
                for t in response.tokens:
                    ids.append(t.id)
                    text.append(t.text)
                if response.HasField("done"):
                    done = response.done
        assert done is not None
        reason = inference_pb2.FinishReason.Name(done.reason)
        return Reply(
            "".join(text),
            reason,
            {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.generated_tokens},
            token_ids=ids,
        )

    def wait_idle(self, within_s: float = 30.0) -> None:
        """Until the pair runs no session and the gateway holds no place and queues nothing
        (every slot back)."""
        deadline = time.monotonic() + within_s
        while True:
            status = self.pair.status()
            held = (
                self.metric("foundry_gateway_http_active_requests"),
                self.metric("foundry_gateway_http_queue_depth_requests"),
            )
            if status.active_sessions == 0 and held == (0, 0):
                return
            assert time.monotonic() < deadline, (status, held)
            time.sleep(0.02)

    def metric(self, name: str) -> float:
        try:
            return metric(self.metrics, name)
        except AssertionError:  # a labelled series is exposed from its first count on
            return 0.0


def _token_bytes(ask: Chat, logprobs: list[dict[str, Any] | None]) -> list[bytes] | None:
    given = [lp for lp in logprobs if lp is not None]  # a stream's closing chunk has none
    if not given:
        return None
    out: list[bytes] = []
    for lp in given:
        if ask.messages:
            out += [bytes(e["bytes"]) for e in lp["content"]]
        else:  # the legacy form has no bytes: the tokens' texts
            out += [t.encode() for t in lp["tokens"]]
    return out


def sse_events(body: bytes) -> list[dict[str, Any]]:
    """A server-sent event stream's JSON events, checking its framing on the way: every event
    is one ``data: `` line and an empty line, and the last is ``data: [DONE]``."""
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    blocks = body.split(b"\n\n")
    assert blocks[-1] == b"" and blocks[-2] == b"data: [DONE]", blocks[-3:]
    events = []
    for block in blocks[:-2]:
        assert block.startswith(b"data: ") and b"\n" not in block, block[:200]
        events.append(json.loads(block[len(b"data: ") :]))
    return events


@contextlib.contextmanager
def served(
    model: Path,
    logs: Path,
    ctx_size: int | None,
    leader_flags: Sequence[str] = (),
    gateway_flags: Sequence[str] = (),
) -> Iterator[Served]:
    """The pair (both ranks with context ``ctx_size``; None: the file's, and a worker that
    ``Pair.restart_worker`` starts again pairs) and the gateway, stopped by their pids at the
    end."""
    ctx = ("--ctx-size", str(ctx_size)) if ctx_size is not None else ()
    leader = start_leader(model, logs / "leader-1.log", *ctx, *leader_flags)
    pair = Pair(
        model,
        logs,
        (*ctx, *leader_flags),
        leader,
        start_worker(model, leader.port, logs / "worker-1.log", *ctx),
    )
    try:
        wait_paired(leader.frontend, timeout=STARTUP_S)
        yield from _with_gateway(pair, logs, gateway_flags)
    finally:
        pair.stop()
    for log in (logs / "gateway.log", *logs.glob("leader-*.log"), *logs.glob("worker-*.log")):
        assert "Traceback" not in log.read_text(errors="replace"), log


def _with_gateway(pair: Pair, logs: Path, gateway_flags: Sequence[str]) -> Iterator[Served]:
    with Service(
        [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--model-name",
            MODEL_NAME,
            "--metrics-port",
            "0",
            "--coordinator-admin",
            f"127.0.0.1:{free_port()}",
            "--tp-frontend",
            f"127.0.0.1:{pair.frontend}",
            *gateway_flags,
        ],
        logs / "gateway.log",
    ) as gateway:
        yield Served(
            pair,
            gateway,
            int(gateway.wait_for(HTTP_LINE).group(1)),
            int(gateway.wait_for(GRPC_LINE).group(1)),
            int(gateway.wait_for(METRICS_LINE).group(1)),
        )
