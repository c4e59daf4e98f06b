"""The leader's front end (tp/frontend_server.py) as a client sees it, frame by frame: each
refusal's request id, code, message and counter; the admission limits at the limit and one
past it; cancels, a client that goes away, bad bytes, a stalled frame, a stopping leader, the
loss of the worker, a chat's template stop and TOKEN text in the model's own vocabulary.

The leader runs in this process (``InProcessLeader``: its own event loop on a thread), so that
the ``frontend`` target of bench/mutation/mutate.py sees the code these tests run (a leader
process imports the installed tree); its worker is a process, and every client speaks raw
frames over a real socket. One pair serves the module and the tests run in any order (the
worker's loss pairs a new worker); two tests start a leader of their own (a small context,
another vocabulary).
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import wait_for
from tiny_bpe import write_tiny_bpe
from tp_harness import (
    InProcessLeader,
    Proc,
    loopback_options,
    make_model,
    start_worker,
    wait_paired,
)

from foundry.model.spec.config import ModelConfig
from foundry.model.text.chat import Message, chat_prompt
from foundry.tp.blas import limit_blas_threads
from foundry.tp.frontend_server import INLINE_PROMPT_CHARS, MAX_CHARS_PER_TOKEN, PREPARE_QUEUE
from foundry.tp.speculative import SpecMode
from foundry.wire import frontend as fw

CTX = 1024  # the model's context; the byte vocabulary adds BOS to a prompt
LONG = 1000  # tokens: a generation still running when the test acts on it
FRAME_DEADLINE_S = 0.5
BAD = fw.ErrorCode.BAD_REQUEST
WAIT_S = 20.0  # bounds every wait (a loaded two-core machine); no test needs it
# Far above a loaded machine's scheduling delay: the pair is lost only when a test kills the
# worker (its closed connection is seen at once; the engine's gate then waits this long).
GATE_S = 3.0


@dataclass
class Served:
    leader: InProcessLeader
    model: Path
    logs: Path
    worker: Proc
    first_status: fw.Status  # before any request

    @property
    def port(self) -> int:
        return self.leader.leader.frontend_port

    def count(self, outcome: str) -> float:
        """The leader's requests counter for ``outcome`` (a Done reason or an error code)."""
        return float(self.leader.leader.metrics.requests.labels(outcome)._value.get())

    def restart_worker(self) -> None:
        self.worker, _ = pair_worker(self.leader, self.model, self.logs)


def pair_worker(leader: InProcessLeader, model: Path, logs: Path) -> tuple[Proc, fw.Status]:
    """A worker process for ``leader``, and the STATUS that shows them paired."""
    worker = start_worker(
        model, leader.leader.port, logs / "worker.log", "--gate-timeout", str(GATE_S)
    )
    return worker, wait_paired(leader.leader.frontend_port)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One running and one waiting generation at most; two messages a conversation. The tests
    run in any order (mutmut runs those that reach a mutant): each leaves the pair serving."""
    tmp = tmp_path_factory.mktemp("frontend")
    model = make_model(tmp / "model.gguf", ModelConfig(n_ctx=CTX))
    limit_blas_threads(1)
    leader = InProcessLeader(
        loopback_options(
            model,
            max_sessions=1,
            queue_size=1,
            max_messages=2,
            spec_mode=SpecMode.OFF,
            frame_deadline_s=FRAME_DEADLINE_S,
            gate_timeout_s=GATE_S,
            shm=False,  # gates over TCP: a blocked read, no spinning on two shared cores
        )
    )
    s: Served | None = None
    try:
        worker, first = pair_worker(leader, model, tmp)
        s = Served(leader, model, tmp, worker, first)
        yield s
    finally:
        leader.stop()
        if s is not None:
            s.worker.stop()


class Link:
    """A raw frontend connection: frames out, every frame in, in arrival order."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.decoder = fw.FrontendDecoder()
        self.frames: list[fw.Frame] = []
        self.eof = False

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, *frames: fw.Frame) -> None:
        """All in one write: the leader reads and handles them in one go."""
        self.sock.sendall(b"".join(fw.encode(f) for f in frames))

    def read_until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            if self.eof:
                raise AssertionError(f"the leader closed the connection before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {WAIT_S:g} s: {what}")
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                self.eof = True
                continue
            self.decoder.feed(data)
            while (frame := self.decoder.next_event()) is not None:
                self.frames.append(frame)

    def end(self, rid: int) -> fw.Done | fw.Error | None:
        """The last DONE or ERROR of ``rid``."""
        for f in reversed(self.frames):
            if f.request_id == rid and isinstance(f, fw.Done | fw.Error):
                return f
        return None

    def ends(self, *rids: int) -> list[fw.Done | fw.Error]:
        """Each request's DONE or ERROR (read until all are in)."""
        self.read_until(lambda: all(self.end(r) is not None for r in rids), f"ends of {rids}")
        return [e for r in rids if (e := self.end(r)) is not None]

    def tokens(self, rid: int) -> list[fw.Token]:
        return [f for f in self.frames if isinstance(f, fw.Token) and f.request_id == rid]

    def first_token(self, rid: int) -> None:
        self.read_until(lambda: bool(self.tokens(rid)), f"a token of request {rid}")

    def status(self) -> fw.Status:
        n = len(self.frames)
        self.send(fw.StatusReq(0))
        self.read_until(lambda: any(isinstance(f, fw.Status) for f in self.frames[n:]), "STATUS")
        return next(f for f in self.frames[n:] if isinstance(f, fw.Status))

    def closed(self) -> None:
        """Read until the leader closes the connection."""
        self.read_until(lambda: self.eof, "the leader closed the connection")


def refused(code: fw.ErrorCode, rid: int, message: str) -> fw.Error:
    return fw.Error(rid, int(code), message)


def chat(rid: int, *contents: str, max_tokens: int = 1) -> fw.Generate:
    return fw.Generate(rid, "", max_tokens, messages=tuple(("user", c) for c in contents))


def idle(link: Link) -> None:
    """Wait until the engine runs nothing (so what a test sends next meets empty slots)."""
    wait_for(lambda: link.status().active_sessions == 0, WAIT_S, "no session running")


OVERLOAD = "generations in flight (1 running and 1 waiting at most)"


def test_admission_at_each_limit_and_one_past(served: Served) -> None:
    """First in the file: mutmut gives the fixture's construction of the front end to the
    test that builds it, so this one checks what starts at zero. Two generations in flight
    (one running, one waiting) are admitted and the next is refused, again once they ended;
    PREPARE_QUEUE conversations wait for the pool and the next is refused, and so is a plain
    prompt too long to tokenize on the loop, while one of INLINE_PROMPT_CHARS is tokenized at
    once (and refused for the context)."""
    assert served.first_status.requests_served == 0
    with Link(served.port) as link:
        idle(link)
        before = link.status().requests_served
        for a in (61, 64):
            b, c = a + 1, a + 2
            link.send(
                fw.Generate(a, "hi", LONG), fw.Generate(b, "hi", LONG), fw.Generate(c, "hi", 1)
            )
            (third,) = link.ends(c)
            assert third == refused(fw.ErrorCode.OVERLOADED, c, f"2 {OVERLOAD}")
            link.first_token(a)
            link.send(fw.Cancel(a), fw.Cancel(b))
            assert all(isinstance(e, fw.Done) for e in link.ends(a, b))
        assert link.status().requests_served == before + 4

        chats = [chat(1000 + i, "a") for i in range(PREPARE_QUEUE)]
        inline = fw.Generate(2000, "x" * INLINE_PROMPT_CHARS, 1)
        pooled = fw.Generate(2001, "x" * (INLINE_PROMPT_CHARS + 1), 1)
        one_more = chat(2002, "a")
        queue_full = f"{PREPARE_QUEUE} prompts wait to be rendered and tokenized"
        link.send(*chats, inline, pooled, one_more)
        ends = link.ends(*(f.request_id for f in [*chats, inline, pooled, one_more]))
    too_long = f"the prompt is {INLINE_PROMPT_CHARS + 1} tokens, longer than the context of {CTX}"
    assert ends[-3:] == [
        refused(BAD, 2000, too_long),
        refused(fw.ErrorCode.OVERLOADED, 2001, queue_full),
        refused(fw.ErrorCode.OVERLOADED, 2002, queue_full),
    ]
    # Each queued conversation was served, or refused for the generations in flight.
    for end in ends[:PREPARE_QUEUE]:
        assert isinstance(end, fw.Done) or (
            end.code == fw.ErrorCode.OVERLOADED and end.message.endswith(OVERLOAD)
        ), end


# -- refusals ------------------------------------------------------------------------------


def test_each_bad_field_is_refused_with_its_id_code_and_message(served: Served) -> None:
    max_chars = CTX * MAX_CHARS_PER_TOKEN
    cases = [
        (fw.Generate(11, "hi", 0), "max_tokens must be >= 1, got 0"),
        (fw.Generate(12, "hi", 4, temperature=-1.0), "temperature must be in [0, 100], got -1.0"),
        (fw.Generate(13, "hi", 4, temperature=100.5), "temperature must be in [0, 100], got 100.5"),
        (fw.Generate(14, "hi", 4, top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (fw.Generate(15, "hi", 4, top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (chat(16, "a", "b", "c"), "the conversation has 3 messages, more than 2"),
        # One token past the context (BOS and one per byte), tokenized on the loop ...
        (
            fw.Generate(17, "x" * CTX, 4),
            f"the prompt is {CTX + 1} tokens, longer than the context of {CTX}",
        ),
        # ... and in the pool: as many characters as the context may hold is tokenized,
        (
            fw.Generate(18, "x" * max_chars, 4),
            f"the prompt is {max_chars + 1} tokens, longer than the context of {CTX}",
        ),
        # one more is refused before tokenizing.
        (
            fw.Generate(19, "x" * (max_chars + 1), 4),
            f"the prompt is {max_chars + 1} characters, more than the context of {CTX} "
            "tokens can hold",
        ),
    ]
    counted = served.count("bad_request")
    with Link(served.port) as link:
        link.send(*(frame for frame, _ in cases))
        got = link.ends(*(frame.request_id for frame, _ in cases))
        assert got == [refused(BAD, f.request_id, m) for f, m in cases]
        # A conversation that renders past the characters a prompt may have: the chat
        # module's one-line refusal, as it is.
        link.send(chat(20, "y" * max_chars))
        (err,) = link.ends(20)
        assert isinstance(err, fw.Error) and err.code == BAD, err
        assert err.message.startswith("the conversation renders to "), err.message
        assert err.message.endswith(f"more than the {max_chars} a prompt may have"), err.message
        assert link.tokens(20) == []
    assert served.count("bad_request") == counted + len(cases) + 1  # each counted by its code


def test_each_limit_itself_is_served(served: Served) -> None:
    """max_tokens 1, temperature 100, top_p 1, max_messages messages and a prompt of the whole
    context: each served (one at a time: the pair runs one and queues one)."""
    ends: list[fw.Done] = []
    with Link(served.port) as link:
        for frame in [
            fw.Generate(21, "hi", 1),
            fw.Generate(22, "hi", 1, temperature=100.0, seed=1),
            fw.Generate(23, "hi", 1, top_p=1.0),
            chat(24, "a", "b"),
            fw.Generate(25, "x" * (CTX - 1), 4),  # CTX tokens with BOS
        ]:
            link.send(frame)
            (end,) = link.ends(frame.request_id)
            assert isinstance(end, fw.Done), end
            assert end.generated_tokens == 1 and len(link.tokens(frame.request_id)) == 1
            ends.append(end)
    assert ends[-1].reason is fw.DoneReason.CONTEXT_FULL and ends[-1].prompt_tokens == CTX


def test_a_chat_is_its_rendered_prompt(served: Served) -> None:
    """A conversation is prepared in the pool as the template renders it: the same tokens
    as that text sent as a plain prompt, positions after its prompt."""
    leader = served.leader.leader
    messages = [Message("system", "Be brief."), Message("user", "Say something.")]
    ids = chat_prompt(leader.chat_template, leader.tokenizer, messages)
    text = leader.tokenizer.decode(ids[1:])  # without BOS: the plain prompt adds it
    with Link(served.port) as link:
        link.send(fw.Generate(31, "", 8, messages=tuple((m.role, m.content) for m in messages)))
        (as_chat,) = link.ends(31)
        link.send(fw.Generate(32, text, 8))
        (as_text,) = link.ends(32)
    assert isinstance(as_chat, fw.Done) and isinstance(as_text, fw.Done)
    assert as_chat.prompt_tokens == as_text.prompt_tokens == len(ids)
    chat_tokens, text_tokens = link.tokens(31), link.tokens(32)
    assert [t.token for t in chat_tokens] == [t.token for t in text_tokens]
    assert [t.position for t in chat_tokens] == list(range(len(ids), len(ids) + 8))


def test_a_small_context_and_a_stopping_leader_refuse_at_once(served: Served) -> None:
    """With --ctx-size 8 a plain prompt short enough to tokenize on the loop may still hold
    more characters than the context could (8 x MAX_CHARS_PER_TOKEN); with
    --chat-content-specials a message's "<s>" is the BOS token (the refusal counts the
    tokens); once the leader stops, a request is refused as such (before the missing worker is
    named). No worker needed."""
    leader = InProcessLeader(loopback_options(served.model, ctx_size=8, chat_content_specials=True))
    lead = leader.leader
    content = [Message("user", "<s></s><s>")]
    specials = len(chat_prompt(lead.chat_template, lead.tokenizer, content, content_specials=True))
    assert specials < len(chat_prompt(lead.chat_template, lead.tokenizer, content))
    try:
        n = 8 * MAX_CHARS_PER_TOKEN + 1
        with Link(lead.frontend_port) as link:
            link.send(fw.Generate(33, "x" * n, 1))
            assert link.ends(33) == [
                refused(
                    BAD,
                    33,
                    f"the prompt is {n} characters, more than the context of 8 tokens can hold",
                )
            ]
            link.send(chat(35, "<s></s><s>"))
            assert link.ends(35) == [
                refused(BAD, 35, f"the prompt is {specials} tokens, longer than the context of 8")
            ]
            # What request_stop sets first, alone: the loop serves on until the leader closes,
            # so the window between a stop and the connections' close is held open.
            lead._stopping.set()
            link.send(fw.Generate(34, "hi", 1))
            assert link.ends(34) == [
                refused(fw.ErrorCode.UNAVAILABLE, 34, "the leader is shutting down")
            ]
    finally:
        leader.stop()


def test_a_chat_reply_holds_back_its_templates_stop_and_a_plain_reply_does_not(
    served: Served,
) -> None:
    """The plain transcript's turn ends at "\\nUser:": a chat reply's newline is held until
    the next token shows it is not that; a plain prompt's reply has no such stop. Sampled
    replies, the first seed whose reply has a newline before its last token."""
    tokenizer = served.leader.leader.tokenizer

    def newline_text(frame: fw.Generate) -> str | None:
        with Link(served.port) as link:
            link.send(frame)
            link.ends(frame.request_id)
        tokens = link.tokens(frame.request_id)[:-1]
        return next((t.text for t in tokens if tokenizer.token_bytes(t.token) == b"\n"), None)

    def as_chat(seed: int) -> fw.Generate:
        return fw.Generate(34, "", 400, temperature=1.0, seed=seed, messages=(("user", "a"),))

    def as_text(seed: int) -> fw.Generate:
        return fw.Generate(35, "a", 400, temperature=1.0, seed=seed)

    for request, held in ((as_chat, ""), (as_text, "\n")):
        texts = (newline_text(request(seed)) for seed in range(1, 21))
        assert next((t for t in texts if t is not None), None) == held, request


def test_token_text_is_decoded_with_the_models_own_vocabulary(tmp_path: Path) -> None:
    """A model of another vocabulary than Foundry's bytes (tests/tiny_bpe.py: Llama 3's BPE, a
    planted answer after a blank line): each TOKEN's text is its piece of that vocabulary."""
    model = write_tiny_bpe(tmp_path / "tiny-llama3.gguf")
    leader = InProcessLeader(loopback_options(model, spec_mode=SpecMode.OFF))
    worker: Proc | None = None
    try:
        worker, _ = pair_worker(leader, model, tmp_path)
        with Link(leader.leader.frontend_port) as link:
            link.send(fw.Generate(36, "Hi\n\n", 16))
            (end,) = link.ends(36)
        assert isinstance(end, fw.Done) and end.reason is fw.DoneReason.EOS, end
        assert [t.text for t in link.tokens(36)] == ["The", " capital", " is", " Paris", ".", ""]
    finally:
        leader.stop()
        if worker is not None:
            worker.stop()


def test_an_id_in_use_on_the_connection_is_refused(served: Served) -> None:
    with Link(served.port) as link:
        # 41 running, 42 a chat whose prompt the pool prepares when its twin comes.
        link.send(fw.Generate(41, "hi", LONG), chat(42, "a", max_tokens=LONG))
        link.send(fw.Generate(41, "hi", 1), fw.Generate(42, "hi", 1))

        def errors() -> list[fw.Error]:
            return [f for f in link.frames if isinstance(f, fw.Error)]

        link.read_until(lambda: len(errors()) == 2, "both refusals")
        assert errors() == [
            refused(BAD, rid, f"request id {rid} is in use on this connection") for rid in (41, 42)
        ]
        # CANCEL ends each (the one running and the one waiting for its slot).
        link.frames.clear()
        link.send(fw.Cancel(41), fw.Cancel(42))
        for end in link.ends(41, 42):
            assert isinstance(end, fw.Done) and end.reason is fw.DoneReason.CANCELLED, end
            assert end.generated_tokens < LONG
        # An id is free again once its request ended.
        link.frames.clear()
        link.send(fw.Generate(41, "hi", 1))
        (again,) = link.ends(41)
        assert isinstance(again, fw.Done) and again.reason is fw.DoneReason.MAX_TOKENS, again


def test_a_cancel_while_the_prompt_is_prepared_ends_it_before_any_token(served: Served) -> None:
    with Link(served.port) as link:
        link.send(chat(51, "a", max_tokens=LONG), fw.Cancel(51))
        (end,) = link.ends(51)
        assert isinstance(end, fw.Done) and end.reason is fw.DoneReason.CANCELLED, end
        assert end.generated_tokens == 0 and link.tokens(51) == []


# -- admission limits ----------------------------------------------------------------------


def test_a_client_that_goes_away_frees_its_places(served: Served) -> None:
    """Its generations are cancelled and counted once and their places freed; the one waiting
    on another connection gets every token (the engine's DONE for the gone one comes in the
    same batch)."""
    cancelled = served.count("cancelled")
    with Link(served.port) as link:
        with Link(served.port) as gone:
            gone.send(fw.Generate(71, "hi", LONG))
            gone.first_token(71)
            link.send(fw.Generate(74, "hi", 8))  # waits for the running one
        (end,) = link.ends(74)
        assert isinstance(end, fw.Done) and end.generated_tokens == 8, end
        assert [t.position for t in link.tokens(74)] == list(range(3, 11))
        wait_for(lambda: served.count("cancelled") == cancelled + 1, WAIT_S, "71 cancelled")
        # A client that leaves with one running and one waiting: both cancelled.
        with Link(served.port) as gone:
            gone.send(fw.Generate(75, "hi", LONG), fw.Generate(76, "hi", LONG))
            gone.first_token(75)
        wait_for(lambda: served.count("cancelled") == cancelled + 3, WAIT_S, "75, 76 cancelled")
        idle(link)
        link.send(
            fw.Generate(71, "hi", LONG), fw.Generate(72, "hi", LONG), fw.Generate(73, "hi", 1)
        )
        (third,) = link.ends(73)
        assert third == refused(fw.ErrorCode.OVERLOADED, 73, f"2 {OVERLOAD}")
        link.send(fw.Cancel(71), fw.Cancel(72))
        assert all(isinstance(e, fw.Done) for e in link.ends(71, 72))
    # Counted once each: by the front end when the client left, not again at the engine's DONE.
    assert served.count("cancelled") == cancelled + 5


def test_a_client_that_leaves_while_its_prompt_is_prepared_leaves_nothing_running(
    served: Served,
) -> None:
    with Link(served.port) as gone:
        gone.send(chat(75, "a", max_tokens=LONG))
    with Link(served.port) as link:
        idle(link)
        link.send(
            fw.Generate(76, "hi", LONG), fw.Generate(77, "hi", LONG), fw.Generate(78, "hi", 1)
        )
        (third,) = link.ends(78)
        assert third == refused(fw.ErrorCode.OVERLOADED, 78, f"2 {OVERLOAD}")
        link.send(fw.Cancel(76), fw.Cancel(77))
        assert all(isinstance(e, fw.Done) for e in link.ends(76, 77))


def test_requests_served_counts_each_done_once(served: Served) -> None:
    max_tokens = served.count("max_tokens")
    timed = token_timings(served)
    with Link(served.port) as link:
        before = link.status().requests_served
        for rid in (81, 82):
            link.send(fw.Generate(rid, "hi", 2))
            link.ends(rid)
        assert link.status().requests_served == before + 2
    assert served.count("max_tokens") == max_tokens + 2
    assert token_timings(served) == timed + 4  # one per token generated


def token_timings(served: Served) -> float:
    """How many tokens the leader's time-per-token histogram holds."""
    (metric,) = served.leader.leader.metrics.token_duration.collect()
    return float(next(x.value for x in metric.samples if x.name.endswith("_count")))


def test_seeded_sampling_is_repeatable(served: Served) -> None:
    with Link(served.port) as link:
        for rid, seed in ((91, 5), (92, 5), (93, 6)):
            link.send(fw.Generate(rid, "hi", 24, temperature=1.0, seed=seed))
            link.ends(rid)
        a, b, c = ([t.token for t in link.tokens(r)] for r in (91, 92, 93))
    assert a == b and a != c


# -- bad input -----------------------------------------------------------------------------


def test_bad_bytes_get_a_protocol_error_then_the_connection_closes(served: Served) -> None:
    garbage = b"\xffNOT A FRAME" * 4
    try:
        probe = fw.FrontendDecoder()
        probe.feed(garbage)
        probe.next_event()
        raise AssertionError("the garbage decodes")
    except fw.FrontendProtocolError as exc:
        expected = refused(BAD, 0, f"protocol error: {exc}")
    with Link(served.port) as link:
        link.sock.sendall(garbage)
        link.closed()
        assert link.frames == [expected]


def test_a_frame_only_the_leader_sends_is_refused_then_the_connection_closes(
    served: Served,
) -> None:
    with Link(served.port) as link:
        link.send(fw.Token(7, 1, 2, "x"))
        link.closed()
        assert link.frames == [refused(BAD, 7, "unexpected TOKEN from a client")]


def test_a_frame_begun_and_not_finished_closes_the_connection(served: Served) -> None:
    """Closed at the frame deadline (``--frame-deadline``), not before and with no answer."""
    with Link(served.port) as link:
        t0 = time.monotonic()
        link.sock.sendall(fw.encode(fw.StatusReq(0))[:5])
        link.closed()
        assert time.monotonic() - t0 >= FRAME_DEADLINE_S * 0.9
        assert link.frames == []


# -- the worker's loss ---------------------------------------------------------------------


def test_the_workers_loss_fails_what_runs_and_refuses_what_comes(served: Served) -> None:
    unavailable = served.count("unavailable")
    with Link(served.port) as link:
        link.send(fw.Generate(101, "hi", LONG), fw.Generate(102, "hi", LONG))
        link.first_token(101)
        served.worker.stop(signal.SIGKILL)
        ends = link.ends(101, 102)
        for rid, end in zip((101, 102), ends, strict=True):
            assert isinstance(end, fw.Error) and end.request_id == rid, end
            assert end.code == fw.ErrorCode.UNAVAILABLE, end
            assert end.message.startswith("tensor-parallel worker lost: "), end.message
            assert end.message.endswith("; the leader waits for it to reconnect"), end.message
        assert served.count("unavailable") == unavailable + 2
        wait_for(lambda: not link.status().worker_connected, WAIT_S, "the worker gone")
        link.send(fw.Generate(103, "hi", 1))
        (end,) = link.ends(103)
        assert end == refused(
            fw.ErrorCode.UNAVAILABLE,
            103,
            "the tensor-parallel worker is not connected; the leader waits for it to reconnect",
        )
    # A worker again: the pair serves the tests that follow.
    served.restart_worker()
