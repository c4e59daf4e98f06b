"""The pair serves published vocabularies to many clients at once: a matrix on real files.

{greedy with speculative decoding, greedy without it, sampled} x {1, 4, 16 concurrent
clients} x {gRPC stream, HTTP streamed, HTTP whole}, chat and completion, through a real pair
and a real gateway (tests/served.py), on two vocabulary families:

- the published Gemma 3 270M file (262,144 SentencePiece tokens): a verify block of eight
  rows, or a batch of sixteen, is a LOGITS frame of several MiB;
- the tiny Llama 3 model of tests/tiny_bpe.py (128,256 byte-level BPE tokens, Llama 3.1's
  template, a planted answer that ends at ``<|eot_id|>``), written by the test.

Greedy answers equal the one-process engine's token for token (gRPC gives the ids; HTTP the
text the leader's stream decoder makes of them, and the usage). Sampled answers are text of
the requested length, the same seed gives the same text on every transport and at every
level of concurrency, and over gRPC the ids are the one-process engine's sampled with that seed
(the pair draws them in the ranks' vocabulary blocks: ROW_DRAWS, no logits shipped). The pair
starts once per file and speculative-decoding mode; requests are a few tokens each.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from served import Chat, Reference, Reply, Served, served
from test_published_gemma import gemma_file
from tiny_bpe import N_CTX, write_tiny_bpe
from tp_harness import metric

GEMMA_CTX = 512
MAX_TOKENS = 5
TEMPERATURE = 0.9  # of the sampled requests
ASKS = (
    Chat(prompt="The capital of France is"),
    Chat(messages=(("user", "What is the capital of France?"),)),
    Chat(prompt="Once upon a time, in a village by the sea,"),
    Chat(messages=(("system", "Answer in one word."), ("user", "Name a colour."))),
)
TRANSPORTS = ("grpc", "http-stream", "http-whole")
CLIENTS = (1, 4, 16)
# gRPC's finish reasons as OpenAI's.
FINISH = {
    "FINISH_REASON_EOS": "stop",
    "FINISH_REASON_MAX_TOKENS": "length",
    "FINISH_REASON_STOP_STRING": "stop",
    "FINISH_REASON_CONTEXT_FULL": "length",
}


@pytest.fixture(scope="module", params=["gemma", "tiny-bpe"])
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, int]:
    if request.param == "gemma":
        return gemma_file(), GEMMA_CTX
    return write_tiny_bpe(tmp_path_factory.mktemp("tiny") / "tiny-llama3.gguf"), N_CTX


@pytest.fixture(scope="module")
def reference(model: tuple[Path, int]) -> Reference:
    return Reference(*model)


@pytest.fixture(scope="module")
def spec_stack(
    model: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """The pair as it starts by default: speculative decoding on."""
    with served(model[0], tmp_path_factory.mktemp("served"), model[1]) as s:
        yield s


@pytest.fixture(scope="module")
def no_spec_stack(
    model: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    with served(model[0], tmp_path_factory.mktemp("served"), model[1], ("--spec-mode", "off")) as s:
        yield s


# The same (file, prompt, seed) must sample the same text everywhere.
_SAMPLED: dict[tuple[str, int, int], str] = {}


def ask(s: Served, transport: str, chat: Chat, sampled: bool, seed: int) -> Reply:
    temperature = TEMPERATURE if sampled else 0.0
    if transport == "grpc":
        reply = s.grpc_generate(chat, MAX_TOKENS, temperature=temperature, seed=seed)
        reply.finish_reason = FINISH[str(reply.finish_reason)]
        return reply
    kw = {"max_tokens": MAX_TOKENS, "temperature": temperature, "seed": seed}
    if transport == "http-whole":
        return s.whole(chat, **kw)
    return s.streamed(chat, **kw, stream_options={"include_usage": True})


@pytest.mark.parametrize("clients", CLIENTS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("stack_name", "sampled"),
    [("spec_stack", False), ("no_spec_stack", False), ("spec_stack", True)],
    ids=["greedy-spec", "greedy-no-spec", "sampled"],
)
def test_many_clients_get_the_engines_answers(
    request: pytest.FixtureRequest,
    reference: Reference,
    model: tuple[Path, int],
    stack_name: str,
    sampled: bool,
    transport: str,
    clients: int,
) -> None:
    stack: Served = request.getfixturevalue(stack_name)
    chats = [ASKS[i % len(ASKS)] for i in range(clients)]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        replies = list(
            pool.map(lambda i: ask(stack, transport, chats[i], sampled, i), range(clients))
        )
    for i, (chat, reply) in enumerate(zip(chats, replies, strict=True)):
        assert reply.usage is not None
        assert reply.usage["prompt_tokens"] == len(reference.prompt_ids(chat))
        n = reply.usage["completion_tokens"]
        # a chat also ends where its template's turn ends without a token (the plain
        # transcript's "\nUser:"): that text is never sent, and the reason is "stop"
        stop = reference.template.stop if chat.messages else ()
        if sampled:
            assert n <= MAX_TOKENS
            assert reply.finish_reason == "stop" or n == MAX_TOKENS
            if reply.token_ids is not None:
                ids = reply.token_ids
                assert len(ids) == n
                # the one process's draw with the request's seed; a stop string ends it early
                assert ids == reference.sampled(chat, MAX_TOKENS, TEMPERATURE, i)[:n], (i, chat)
                assert reply.text == reference.text(ids, stop)
                ended = ids[-1] in reference.tokenizer.eog_ids or reference.stops(ids, stop)
                assert reply.finish_reason == ("stop" if ended else "length"), ids
            key = (model[0].name, ASKS.index(chat), i)
            assert _SAMPLED.setdefault(key, reply.text) == reply.text, (key, transport)
            continue
        want = reference.greedy(chat, MAX_TOKENS)
        if reply.token_ids is not None:
            assert reply.token_ids == want, (i, chat)
        assert reply.text == reference.text(want), (i, chat)
        assert n == len(want)
        eog = want[-1] in reference.tokenizer.eog_ids
        assert reply.finish_reason == ("stop" if eog else "length")
    kind = "row_draws" if sampled else "row_tops"  # no logits shipped for these rows
    leader = stack.pair.leader.metrics
    assert leader is not None
    assert metric(leader, f'foundry_tp_row_replies_total{{kind="{kind}"}}') > 0
    stack.wait_idle()


def test_greedy_and_sampled_rows_of_one_batch_each_get_the_engines_tokens(
    reference: Reference, no_spec_stack: Served
) -> None:
    """Eight streams at once, every other one sampled: a batch's greedy rows take their
    tops and its sampled rows their draws in the same ROW_DRAWS command, each the one
    process's tokens."""

    def one(i: int) -> Reply:
        temperature = TEMPERATURE if i % 2 else 0.0
        return no_spec_stack.grpc_generate(ASKS[i % 4], MAX_TOKENS, temperature, seed=i)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(8)))
    for i, reply in enumerate(replies):
        ids = reply.token_ids
        assert ids is not None
        chat = ASKS[i % 4]
        if i % 2:
            want = reference.sampled(chat, MAX_TOKENS, TEMPERATURE, i)[: len(ids)]
        else:
            want = reference.greedy(chat, MAX_TOKENS)
        assert ids == want, (i, chat)
    no_spec_stack.wait_idle()


def test_up_serves_the_gemma_file_to_its_first_answer(tmp_path: Path) -> None:
    """`foundry up --model FILE` on the published file, as a new user runs it: the greedy
    sample (speculative decoding on, a verify block of 262,144-token rows), then a chat over
    HTTP whose reply is the transcript's, the one-process engine's."""
    from up_stack import running, start_up, wait_gone

    path = gemma_file()
    up, ports = start_up(
        tmp_path,
        1,
        "--model",
        str(path),
        "--ctx-size",
        str(GEMMA_CTX),
        "--prompt",
        "The capital of France is",
        "--sample-tokens",
        "6",
    )
    http_port = int(ports[ports.index("--http-port") + 1])
    try:
        up.wait_for(r"sample \(greedy, 6 tokens\): 'The capital of France is", 240)
        up.wait_for(r"ready in \d+ s", 10)
        ref = Reference(path, GEMMA_CTX)
        chat = ASKS[1]
        want = ref.greedy(chat, 12)
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "foundry", **chat.body(), "max_tokens": 12, "temperature": 0}),
        )
        answer = json.loads(conn.getresponse().read())
        conn.close()
        text = answer["choices"][0]["message"]["content"]
        full = ref.text(want)
        assert text == (full[: full.index("\nUser:")] if "\nUser:" in full else full)
        assert "Paris" in text
        children = up.children()
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=60) == 0, up.text()
        assert wait_gone(children, 5.0) == []
        assert not any(running(pid) for pid in children.values())
    finally:
        up.cleanup()
