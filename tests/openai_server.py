"""A real gateway process with its OpenAI-compatible HTTP API in front of a real pair.

The model is one of our byte-vocabulary models, whose own template would be the built-in
``plain`` one; the leader runs with ``--chat-template gemma`` here, so that the flag and a
template's refusal are exercised too.
"""

from __future__ import annotations

import http.client
from dataclasses import dataclass, field

import openai
from gateway_pair import Pair
from procs import Service
from tp_harness import metric

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
