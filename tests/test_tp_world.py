"""Worlds of N ranks as processes: one `foundry tp-leader --world-size N` and N-1
`foundry tp-worker` on 127.0.0.1, the gates over TCP (reduce-scatter + allgather).

Each world's tokens and full logits rows equal one process standing for the same split
(``Engine(shares=...)``, its partials added in rank order) bit for bit, with equal and uneven
shares, and STATUS lists every rank's threads as it was started with; a rank killed
mid-generation is waited for, the world forms again (the new process's threads in its entry)
and the sessions are re-synced; a world size or shares the model cannot take, and a --rank the
world has no place for, are refused in one line. Shares chosen at pairing (``--shares auto``
from the ranks' speeds, stated with ``--speed`` or measured; ``--shares ranks`` from each
rank's ``--share``) follow what the ranks stated, and the world equals one process standing for
them; a ``--share`` that conflicts with the leader's shares is refused in one line. The leader
runs in this process (for its logits), the workers are processes. The file's 4 kv heads take 2,
3 and 4 ranks.
"""

from __future__ import annotations

import logging
import re
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from procs import wait_for
from tls_certs import Certs, two_cas
from tp_harness import (
    Client,
    InProcessLeader,
    Proc,
    loopback_options,
    make_model,
    reference_greedy,
    start_worker,
    wait_paired,
)

from foundry.model.formats.gguf_model import TOKEN_TYPES
from foundry.model.formats.gguf_model import TOKENS as VOCAB
from foundry.model.shard.shares import norm_shares
from foundry.model.shard.table import ExpertSplit
from foundry.model.spec.config import ModelConfig
from foundry.model.text.vocab.byte import decode
from foundry.tp.blas import limit_blas_threads
from foundry.tp.handshake import load_rank
from foundry.tp.speculative import SpecMode
from foundry.transport import tls
from foundry.transport.gates import MeshGateExchange
from foundry.wire import frontend as fw
from foundry.wire.tp import SharesFrom

QT = gguf.GGMLQuantizationType
PROMPT = "Every rank adds the partials in rank order."
CHUNK = 16
TOKENS = 12
CFG = ModelConfig(n_ctx=256, n_head=4, n_head_kv=4, n_ff=96)  # 4 kv heads, n_ff 96 = 3 x 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("world") / "model.gguf", CFG)


class World:
    """The leader in this process (its logits rows collected), the workers as processes."""

    def __init__(
        self,
        model: Path,
        tmp: Path,
        world: int,
        shares: tuple[int, ...] | None,
        split: ExpertSplit,
        ranks: list[int | None],
        prefill_chunk: int = CHUNK,
        worker_args: list[list[str]] | None = None,
        tls: ssl.SSLContext | None = None,
        worker_tls: Sequence[Sequence[str]] = (),
        **leader: Any,
    ) -> None:
        """``tls``: the leader's server context; ``worker_tls``: each worker's --tls-* flags;
        ``worker_args``: each worker's other flags; ``leader``: more LeaderOptions."""
        limit_blas_threads(1)
        self.rows: list[np.ndarray] = []
        self.model, self.tmp, self.split = model, tmp, split
        self.worker_args = worker_args or [[] for _ in ranks]
        self.leader = InProcessLeader(
            loopback_options(
                model,
                prefill_chunk=prefill_chunk,
                spec_mode=SpecMode.OFF,
                hash_check=True,
                world_size=world,
                shares=shares,
                expert_split=split,
                gate_timeout_s=3.0,
                control_timeout_s=3.0,
                tls=tls,
                **leader,
            ),
            hook=lambda rid, r: self.rows.append(r.copy()),
        )
        self.workers = [
            self.start(rank, i, *(worker_tls[i] if worker_tls else ()))
            for i, rank in enumerate(ranks)
        ]

    def start(self, rank: int | None, i: int, *more: str) -> Proc:
        extra = [
            "--gate-listen",
            "127.0.0.1:0",
            "--expert-split",
            self.split.value,
            "--gate-timeout",
            "3",
            *more,
            *(self.worker_args[i] if i < len(self.worker_args) else []),
        ]
        if rank is not None:
            extra += ["--rank", str(rank)]
        return start_worker(
            self.model, self.leader.leader.port, self.tmp / f"worker{i}.log", *extra
        )

    @property
    def frontend(self) -> int:
        return self.leader.leader.frontend_port

    def close(self) -> None:
        self.leader.stop()
        for w in self.workers:
            assert w.exit_code() == 0, w.text()  # the leader's STOP ends every worker


@pytest.fixture
def worlds(tmp_path: Path) -> Iterator[list[World]]:
    made: list[World] = []
    try:
        yield made
    finally:
        for w in made:
            w.close()


CASES = [
    (2, None, ExpertSplit.INTERMEDIATE, [None]),  # the pair, through the same path
    (2, (3, 1), ExpertSplit.EXPERTS, [1]),  # a pair with uneven shares: the extension
    (3, None, ExpertSplit.INTERMEDIATE, [None, None]),
    (3, (2, 1, 1), ExpertSplit.INTERMEDIATE, [2, 1]),  # 3 ranks on 4 kv heads: 2, 1, 1
    (4, None, ExpertSplit.EXPERTS, [None, None, None]),
]


@pytest.mark.parametrize(
    ("world", "shares", "split", "ranks"),
    CASES,
    ids=["2", "2-shares-3,1", "3", "3-shares-2,1,1", "4"],
)
def test_world_equals_one_process_standing_for_it(
    model: Path,
    tmp_path: Path,
    worlds: list[World],
    world: int,
    shares: tuple[int, ...] | None,
    split: ExpertSplit,
    ranks: list[int | None],
) -> None:
    threads = [1 + i % 2 for i in range(len(ranks))]  # each worker's --threads
    w = World(
        model,
        tmp_path,
        world,
        shares,
        split,
        ranks,
        worker_args=[["--threads", str(n)] for n in threads],
    )
    worlds.append(w)
    st = wait_paired(w.frontend)
    assert st.worker_connected and st.shared_memory == (world == 2)  # the slab: pairs only
    with Client(w.frontend) as c:
        got = c.generate(PROMPT, TOKENS)
    assert isinstance(got.end, fw.Done) and got.end.reason is fw.DoneReason.MAX_TOKENS
    ref = reference_greedy(model, PROMPT, TOKENS, CHUNK, split, norm_shares(world, shares))
    assert got.tokens == ref.tokens
    ours, one = np.concatenate(w.rows), np.concatenate(ref.logits)
    assert ours.shape == one.shape == (TOKENS, CFG.n_vocab)
    assert np.array_equal(ours, one), f"max abs diff {np.abs(ours - one).max():.3g}"
    assert w.leader.leader.metrics.hash_checks.labels("match")._value.get() > 0
    with Client(w.frontend) as c:
        status = c.status()
    norm = norm_shares(world, shares)
    assert [(r.rank, r.share, r.connected) for r in status.ranks] == [
        (r, norm[r], True) for r in range(world)
    ]
    assert status.ranks[0].gate_wait_us == 0
    assert all(r.gate_wait_us > 0 for r in status.ranks[1:])
    # Each rank's threads: the leader's own, a worker's as its hello stated them; the plain
    # pair's worker sends the plain hello, so its threads are not reported.
    assert status.ranks[0].threads == status.threads > 0
    stated = [r.threads for r in status.ranks[1:]]
    if world == 2 and shares is None:
        assert stated == [0]
    elif None in ranks:  # the ranks went to whichever worker came first
        assert sorted(stated) == sorted(threads)
    else:
        assert stated == [threads[ranks.index(r)] for r in range(1, world)]
    if world > 2:
        # Another grouping of the same sums (the pair's) differs in the last bits.
        pair = reference_greedy(model, PROMPT, TOKENS, CHUNK, split)
        assert not np.array_equal(np.concatenate(pair.logits), one)


def test_ranks_without_heads_serve_and_equal_one_process(
    tmp_path: Path, worlds: list[World], caplog: pytest.LogCaptureFixture
) -> None:
    """A Q8_0 file whose kv heads' attn_output columns (3 heads of 16: 48) are not whole
    blocks of 32: a world of 4 hands its 4 kv heads out 2 at a time, so ranks 2 and 3 hold
    no heads (a zero attention partial, experts and vocabulary rows as before), and the
    world's tokens and logits still equal one process standing for it bit for bit."""
    cfg = ModelConfig(n_ctx=256, n_embd=192, n_head=12, n_head_kv=4, n_ff=96)
    model = make_model(tmp_path / "grouped.gguf", cfg, dtype="q8_0")
    with caplog.at_level(logging.INFO, logger="foundry.tp.leader"):
        w = World(model, tmp_path, 4, None, ExpertSplit.EXPERTS, [None, None, None])
    worlds.append(w)
    assert (
        "attention: kv heads 2 at a time (a kv head's 48 columns of attn_output would cut its "
        "blocks of 32); ranks 2,3 hold no heads"
    ) in caplog.text
    wait_paired(w.frontend)
    with Client(w.frontend) as c:
        got = c.generate(PROMPT, TOKENS)
    assert isinstance(got.end, fw.Done) and got.end.reason is fw.DoneReason.MAX_TOKENS
    ref = reference_greedy(model, PROMPT, TOKENS, CHUNK, ExpertSplit.EXPERTS, (1, 1, 1, 1))
    assert got.tokens == ref.tokens
    ours, one = np.concatenate(w.rows), np.concatenate(ref.logits)
    assert ours.shape == one.shape == (TOKENS, cfg.n_vocab)
    assert np.array_equal(ours, one), f"max abs diff {np.abs(ours - one).max():.3g}"
    held = [load_rank(model, r, None, ExpertSplit.EXPERTS, 4).weights.layout for r in range(4)]
    assert [lay.heads for lay in held] == [(0, 6), (6, 12), (12, 12), (12, 12)]


def _dense_q8_model(path: Path) -> Path:
    """A dense llama file in Q8_0 whose kv heads cut attn_output inside its blocks: 12 query
    heads of 16 over 4 kv heads (48 columns a kv head, blocks of 32), 12 blocks of 32 FFN rows,
    our byte vocabulary (the prompt's ids are then the reference's)."""
    rng = np.random.default_rng(7)
    d, heads, kv, dh, ff, vocab = 192, 12, 4, 16, 384, len(VOCAB)
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (
        ("context_length", 256),
        ("embedding_length", d),
        ("block_count", 2),
        ("feed_forward_length", ff),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv),
        ("rope.dimension_count", dh),
    ):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(list(VOCAB))
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(list(TOKEN_TYPES))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_space_prefix(False)

    def matrix(name: str, rows: int, cols: int, scale: float) -> None:
        value = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(value, QT.Q8_0), raw_dtype=QT.Q8_0)

    def ones(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))

    matrix("token_embd.weight", vocab, d, 0.5)
    for i in range(2):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight")
        matrix(b + "attn_q.weight", heads * dh, d, 0.3)
        matrix(b + "attn_k.weight", kv * dh, d, 0.3)
        matrix(b + "attn_v.weight", kv * dh, d, 0.3)
        matrix(b + "attn_output.weight", d, heads * dh, 0.2)
        ones(b + "ffn_norm.weight")
        matrix(b + "ffn_gate.weight", ff, d, 0.3)
        matrix(b + "ffn_up.weight", ff, d, 0.3)
        matrix(b + "ffn_down.weight", d, ff, 0.2)
    ones("output_norm.weight")
    matrix("output.weight", vocab, d, 0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_dense_world_with_ranks_without_heads_equals_one_process(
    tmp_path: Path, worlds: list[World]
) -> None:
    """The dense file above over 4 ranks: kv heads 2 at a time to ranks 0 and 1, none to 2
    and 3, which hold their shares of the FFN rows and the vocabulary as the others do; greedy
    tokens and logits equal one process standing for the world bit for bit."""
    model = _dense_q8_model(tmp_path / "dense.gguf")
    held = [load_rank(model, r, None, ExpertSplit.INTERMEDIATE, 4).weights.layout for r in range(4)]
    assert [(lay.heads, lay.ff, lay.vocab) for lay in held] == [
        ((0, 6), (0, 96), (0, 65)),
        ((6, 12), (96, 192), (65, 130)),
        ((12, 12), (192, 288), (130, 195)),
        ((12, 12), (288, 384), (195, 259)),
    ]
    w = World(model, tmp_path, 4, None, ExpertSplit.INTERMEDIATE, [None, None, None])
    worlds.append(w)
    wait_paired(w.frontend)
    with Client(w.frontend) as c:
        got = c.generate(PROMPT, TOKENS)
    assert isinstance(got.end, fw.Done) and got.end.reason is fw.DoneReason.MAX_TOKENS, got.end
    ref = reference_greedy(model, PROMPT, TOKENS, CHUNK, ExpertSplit.INTERMEDIATE, (1, 1, 1, 1))
    assert got.tokens == ref.tokens
    ours, one = np.concatenate(w.rows), np.concatenate(ref.logits)
    assert ours.shape == one.shape == (TOKENS, len(VOCAB))
    assert np.array_equal(ours, one), f"max abs diff {np.abs(ours - one).max():.3g}"


def test_a_killed_rank_is_waited_for_and_the_world_resynced(
    model: Path, tmp_path: Path, worlds: list[World]
) -> None:
    one = ["--threads", "1"]
    w = World(model, tmp_path, 3, None, ExpertSplit.INTERMEDIATE, [1, 2], worker_args=[one, one])
    worlds.append(w)
    assert [r.threads for r in wait_paired(w.frontend).ranks[1:]] == [1, 1]
    with Client(w.frontend) as c:
        first = c.generate(PROMPT, TOKENS)
        assert isinstance(first.end, fw.Done)
    victim = w.workers[1]
    victim.stop(signal.SIGKILL)
    # Out of the world, no rank reports threads until its next hello.
    lost = wait_paired(w.frontend, connected=False)
    assert [(r.connected, r.threads) for r in lost.ranks[1:]] == [(False, 0), (False, 0)]
    with Client(w.frontend) as c:
        refused = c.generate(PROMPT, 4)
    assert isinstance(refused.end, fw.Error) and refused.end.code == fw.ErrorCode.UNAVAILABLE
    # A new process, no --rank: it gets the free one, 2, and its threads replace the old.
    w.workers[1] = w.start(None, 9, "--threads", "2")
    assert [r.threads for r in wait_paired(w.frontend).ranks[1:]] == [1, 2]
    metrics = w.leader.leader.metrics
    wait_for(
        lambda: metrics.sessions_resynced._value.get() >= 1,
        30,
        what="the kept session re-synced on the new world",
    )
    follow = PROMPT + " And again."
    with Client(w.frontend) as c:
        again = c.generate(follow, TOKENS)
    ref = reference_greedy(model, follow, TOKENS, CHUNK, ExpertSplit.INTERMEDIATE, (1, 1, 1))
    assert again.tokens == ref.tokens
    # The surviving rank 1 dialed again and kept its rank and its slices (loaded once).
    log = w.workers[0].text()
    assert log.count("paired with the leader") == 2
    assert log.count("loading rank 1 of 3") == 1


def test_a_cancel_stops_every_rank_at_one_checkpoint(
    model: Path, tmp_path: Path, worlds: list[World]
) -> None:
    """A prefill cancelled mid-way: the leader's verdict at the next checkpoint stops all
    three ranks at the same position (each worker logs it), their hashes still match, and the
    world serves on."""
    w = World(model, tmp_path, 3, None, ExpertSplit.INTERMEDIATE, [1, 2], prefill_chunk=2)
    worlds.append(w)
    wait_paired(w.frontend)
    metrics = w.leader.leader.metrics
    sent = metrics.gate_bytes.labels("sent")
    before = sent._value.get()
    with Client(w.frontend) as c:
        c.send(fw.Generate(1, "long prompt " * 18, 10))
        wait_for(lambda: sent._value.get() > before, 30, "the prefill's first gates", poll_s=0.01)
        c.send(fw.Cancel(1))
        (r,) = c.wait([1])
        assert isinstance(r.end, fw.Done) and r.end.reason is fw.DoneReason.CANCELLED
        assert isinstance(c.generate("hi", 3, request_id=2).end, fw.Done)  # still serving
    pattern = r"sync of session \d+ cancelled at (\d+) of (\d+)"
    found = [
        wait_for(lambda p=p: re.search(pattern, p.text()), 10, "a worker's cancel line")
        for p in w.workers
    ]
    assert found[0].groups() == found[1].groups()
    assert 0 <= int(found[0].group(1)) < int(found[0].group(2))
    assert metrics.hash_checks.labels("mismatch")._value.get() == 0
    assert metrics.hash_checks.labels("match")._value.get() >= 2


def test_a_worker_asking_to_stop_stops_every_rank_at_one_checkpoint(
    model: Path, tmp_path: Path, worlds: list[World]
) -> None:
    """SIGTERM to rank 2 during a prefill: it asks to stop at the next checkpoint, and the
    leader's verdict stops rank 1 there too (without it rank 1 would run into the next chunk's
    gates alone); rank 2 exits 0, and the world waits for it."""
    w = World(model, tmp_path, 3, None, ExpertSplit.INTERMEDIATE, [1, 2], prefill_chunk=2)
    worlds.append(w)
    wait_paired(w.frontend)
    sent = w.leader.leader.metrics.gate_bytes.labels("sent")
    before = sent._value.get()
    with Client(w.frontend) as c:
        c.send(fw.Generate(1, "long prompt " * 18, 10))
        wait_for(lambda: sent._value.get() > before, 30, "the prefill's first gates", poll_s=0.01)
        w.workers[1].popen.send_signal(signal.SIGTERM)
        (r,) = c.wait([1])
    assert isinstance(r.end, fw.Done | fw.Error)
    assert w.workers[1].exit_code(timeout=30) == 0
    pattern = r"sync of session \d+ cancelled at (\d+) of (\d+)"
    found = [
        wait_for(lambda p=p: re.search(pattern, p.text()), 10, "a worker's cancel line")
        for p in w.workers
    ]
    assert found[0].groups() == found[1].groups()
    wait_paired(w.frontend, connected=False)
    w.workers[1] = w.start(2, 9)  # back for the fixture's clean stop


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return two_cas(tmp_path_factory.mktemp("certs"))


def test_a_world_over_mutual_tls_equals_one_process(
    model: Path, tmp_path: Path, worlds: list[World], certs: Certs
) -> None:
    """Every link of a world of 3 under mutual TLS (each worker's control and gate links to the
    leader, the gate link between the two workers): the logits are the one process's bits."""
    d = certs.dir
    leader_tls = tls.server_context(d / "tp-leader.pem", d / "tp-leader-key.pem", d / "ca.pem")
    w = World(
        model,
        tmp_path,
        3,
        None,
        ExpertSplit.INTERMEDIATE,
        [1, 2],
        tls=leader_tls,
        worker_tls=[certs.flags("tp-worker")] * 2,
    )
    worlds.append(w)
    wait_paired(w.frontend, tls=certs.client())
    with Client(w.frontend, tls=certs.client()) as c:
        got = c.generate(PROMPT, TOKENS)
    ref = reference_greedy(model, PROMPT, TOKENS, CHUNK, ExpertSplit.INTERMEDIATE, (1, 1, 1))
    assert got.tokens == ref.tokens
    assert np.array_equal(np.concatenate(w.rows), np.concatenate(ref.logits))
    assert "rank 1 of 3: gates to ranks 0, 2 up (tls)" in w.workers[0].text()
    assert "rank 2 of 3: gates to ranks 0, 1 up (tls)" in w.workers[1].text()
    pair = w.leader.leader.engine._pair
    assert pair is not None and isinstance(pair.gate, MeshGateExchange)
    gate = pair.gate
    assert all(isinstance(ch.sock, ssl.SSLSocket) for ch in gate._channels.values())


def test_a_worker_of_another_ca_is_refused_on_the_gate_links(
    model: Path, tmp_path: Path, worlds: list[World], certs: Certs
) -> None:
    """A leader without --tls-ca admits any client; rank 1's certificate is another CA's, so
    rank 2, dialing rank 1's gates, refuses it in the TLS handshake, one line per attempt, and
    the world never forms (each attempt is bounded; every worker dials again)."""
    d, o = certs.dir, certs.other
    leader_tls = tls.server_context(d / "tp-leader.pem", d / "tp-leader-key.pem")
    foreign = [
        "--tls-cert",
        str(o / "tp-worker.pem"),
        "--tls-key",
        str(o / "tp-worker-key.pem"),
        "--tls-ca",
        str(d / "ca.pem"),
    ]
    w = World(
        model,
        tmp_path,
        3,
        None,
        ExpertSplit.INTERMEDIATE,
        [1, 2],
        tls=leader_tls,
        worker_tls=[foreign, certs.flags("tp-worker")],
    )
    worlds.append(w)
    line = (
        r"WARNING .*the gate link to rank 1 at 127\.0\.0\.1:\d+ failed in the TLS "
        r"handshake: CERTIFICATE_VERIFY_FAILED, the peer's certificate is not signed by "
        r"this side's --tls-ca: .*"
    )
    refused = wait_for(
        lambda: re.search(line, w.workers[1].text()), 30, "rank 2 refusing rank 1's certificate"
    )
    assert "\n" not in refused.group(0)
    wait_for(
        lambda: re.search(
            r"gate link: refused 127\.0\.0\.1:\d+ in the TLS handshake: "
            r"TLSV1_ALERT_UNKNOWN_CA",
            w.workers[0].text(),
        ),
        10,
        "rank 1 told that rank 2 does not trust its certificate",
    )
    assert not wait_paired(w.frontend, connected=False, tls=certs.client()).worker_connected
    assert "gates to ranks" not in w.workers[0].text() + w.workers[1].text()
    for p in w.workers:  # they would dial on after the leader's stop
        p.stop(signal.SIGKILL)
    w.workers = []


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "foundry", *args], capture_output=True, text=True, timeout=60
    )


def test_foundry_generate_stands_for_a_world_given_its_shares(
    model: Path, tmp_path: Path, worlds: list[World]
) -> None:
    """`foundry generate --shares 2,1,1` is one process standing for that world: its text is
    the world's greedy tokens (the prompt in one block on both sides), and --stats says what
    it stood for; shares the model cannot take are refused in one line."""
    w = World(model, tmp_path, 3, (2, 1, 1), ExpertSplit.INTERMEDIATE, [1, 2], prefill_chunk=256)
    worlds.append(w)
    wait_paired(w.frontend)
    with Client(w.frontend) as c:
        got = c.generate(PROMPT, TOKENS)
    ref = reference_greedy(model, PROMPT, TOKENS, 256, ExpertSplit.INTERMEDIATE, (2, 1, 1))
    assert got.tokens == ref.tokens
    common = ["generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", str(TOKENS)]
    out = _cli(*common, "--shares", "2,1,1", "--expert-split", "intermediate", "--stats")
    assert out.returncode == 0, out.stderr
    assert out.stdout == decode(got.tokens) + "\n"
    assert out.stderr.splitlines()[0] == (
        "standing for a world of 3 ranks, shares 2,1,1, expert split intermediate"
    )
    refused = _cli(*common, "--shares", "4,1,1", "--expert-split", "experts")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "error: cannot split the model by shares 4,1,1: a rank would hold none of its 4 kv "
        "heads; the nearest shares that work are 2,1,1"
    ]


def test_a_world_the_model_cannot_take_is_refused_in_one_line(model: Path, tmp_path: Path) -> None:
    tiny = make_model(tmp_path / "tiny.gguf", ModelConfig(n_ctx=256))  # 2 kv heads
    out = _cli(
        "tp-leader",
        "--model",
        str(tiny),
        "--world-size",
        "3",
        "--expert-split",
        "experts",
        "--listen",
        "127.0.0.1:0",
        "--frontend-listen",
        "127.0.0.1:0",
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: cannot split the model over 3 ranks: it has 2 kv heads and every rank needs "
        "at least one; the nearest world size that works is 2"
    ]
    out = _cli(
        "tp-leader",
        "--model",
        str(model),
        "--world-size",
        "3",
        "--shares",
        "4,1,1",
        "--expert-split",
        "experts",
        "--listen",
        "127.0.0.1:0",
        "--frontend-listen",
        "127.0.0.1:0",
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: cannot split the model by shares 4,1,1: a rank would hold none of its 4 kv "
        "heads; the nearest shares that work are 2,1,1"
    ]


def test_a_rank_the_world_has_no_place_for_is_refused_in_one_line(
    model: Path, tmp_path: Path, worlds: list[World]
) -> None:
    w = World(model, tmp_path, 3, None, ExpertSplit.INTERMEDIATE, [])
    worlds.append(w)
    stray = w.start(5, 0)
    assert stray.exit_code(timeout=30) == 2
    errors = [line for line in stray.text().splitlines() if "ERROR" in line]
    assert len(errors) == 1 and errors[0].endswith(
        "--rank 5 does not exist in the leader's world of 3 ranks (ranks 1 .. 2 are workers)"
    )


def _shares_of(w: World) -> tuple[int, ...]:
    with Client(w.frontend) as c:
        return tuple(r.share for r in c.status().ranks)


CHOSEN = [
    # --shares auto, every speed stated: 100, 300, 100 is 20%, 60%, 20% of 64, so 13, 38, 13;
    # the 4 kv heads go 1, 2, 1.
    (
        3,
        SharesFrom.SPEED,
        {"speed": 100},
        [["--speed", "300"], ["--speed", "100"]],
        (13, 38, 13),
        "speeds rank 0 100 (20%), rank 1 300 (60%), rank 2 100 (20%)",
    ),
    # --shares ranks: the leader's --share 2, the workers' 1 and none (1).
    (
        3,
        SharesFrom.SHARE,
        {"share": 2},
        [["--share", "1"], []],
        (2, 1, 1),
        "the ranks' --share 2,1,1",
    ),
    # --shares auto, measured by each rank's calibration: whatever it chose, the world holds it.
    (2, SharesFrom.SPEED, {}, [[]], None, "multiply-adds/us"),
]


@pytest.mark.parametrize(
    ("world", "shares_from", "leader", "worker_args", "chosen", "why"),
    CHOSEN,
    ids=["auto-stated", "ranks", "auto-measured"],
)
def test_shares_chosen_at_pairing_follow_the_ranks_and_equal_one_process(
    model: Path,
    tmp_path: Path,
    worlds: list[World],
    world: int,
    shares_from: SharesFrom,
    leader: dict[str, int],
    worker_args: list[list[str]],
    chosen: tuple[int, ...] | None,
    why: str,
) -> None:
    split = ExpertSplit.INTERMEDIATE
    w = World(
        model,
        tmp_path,
        world,
        None,
        split,
        list(range(1, world)),
        worker_args=worker_args,
        shares_from=shares_from,
        **leader,
    )
    worlds.append(w)
    wait_paired(w.frontend)
    got_shares = _shares_of(w)
    bringup = w.leader.leader._bringup
    assert bringup.choice is not None and why in bringup.choice
    assert bringup.choice.startswith("shares " + ",".join(map(str, got_shares)))
    if chosen is not None:
        assert got_shares == chosen
    assert w.leader.leader.engine.shares == got_shares  # rank 0 holds its chosen slices
    with Client(w.frontend) as c:
        got = c.generate(PROMPT, TOKENS)
    ref = reference_greedy(model, PROMPT, TOKENS, CHUNK, split, got_shares)
    assert got.tokens == ref.tokens
    ours, one = np.concatenate(w.rows), np.concatenate(ref.logits)
    assert np.array_equal(ours, one), f"max abs diff {np.abs(ours - one).max():.3g}"
    for p in w.workers:  # each stated its weight, was kept under its rank, then served
        assert "until every worker has stated its own" in p.text()
        assert "paired with the leader" in p.text()
    if shares_from is SharesFrom.SPEED and not leader:
        assert "this rank's speed: " in w.workers[0].text()


def test_a_share_that_conflicts_with_the_leaders_is_refused_in_one_line(
    model: Path, tmp_path: Path, worlds: list[World]
) -> None:
    for i, (shares_from, shares, expected) in enumerate(
        [
            (
                SharesFrom.LIST,
                (2, 1, 1),
                "--share 3 conflicts with the leader's shares 2,1,1, which give rank 1 1: the "
                "leader's list wins; drop --share, or start the leader with --shares ranks",
            ),
            (
                SharesFrom.SPEED,
                None,
                "--share 3 conflicts with the leader's --shares auto, which gives every rank the "
                "share of its measured speed; drop --share, or start the leader with "
                "--shares ranks",
            ),
        ]
    ):
        w = World(model, tmp_path, 3, shares, ExpertSplit.INTERMEDIATE, [], shares_from=shares_from)
        worlds.append(w)
        stray = w.start(1, i, "--share", "3")
        assert stray.exit_code(timeout=30) == 2
        errors = [line for line in stray.text().splitlines() if "ERROR" in line]
        assert len(errors) == 1 and errors[0].endswith(expected), errors


def test_share_flags_that_do_not_go_together_are_refused_in_one_line(model: Path) -> None:
    base = [
        "tp-leader",
        "--model",
        str(model),
        "--world-size",
        "3",
        "--listen",
        "127.0.0.1:0",
        "--frontend-listen",
        "127.0.0.1:0",
    ]
    for extra, line in [
        (
            ["--shares", "2,1,1", "--share", "2"],
            "error: the leader's --share goes with --shares ranks (each rank states its own); "
            "with a list, rank 0's share is its first entry",
        ),
        (
            ["--speed", "100"],
            "error: --speed goes with --shares auto (it states the speed that would be measured)",
        ),
    ]:
        out = _cli(*base, *extra)
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [line]


def test_a_worker_without_its_certificate_is_told_in_one_line(
    model: Path, tmp_path: Path, worlds: list[World], certs: Certs
) -> None:
    """Only --tls-ca: enough to dial a leader that asks for no client certificate, not for the
    mutual TLS between the workers of a world of 3; the worker exits 2 saying what to give."""
    d = certs.dir
    leader_tls = tls.server_context(d / "tp-leader.pem", d / "tp-leader-key.pem")
    w = World(model, tmp_path, 3, None, ExpertSplit.INTERMEDIATE, [], tls=leader_tls)
    worlds.append(w)
    lone = w.start(1, 0, "--tls-ca", str(d / "ca.pem"))
    assert lone.exit_code(timeout=30) == 2
    errors = [line for line in lone.text().splitlines() if "ERROR" in line]
    assert len(errors) == 1 and errors[0].endswith(
        "the leader's world of 3 ranks runs TLS, and the gate links between its workers are "
        "mutual TLS: give this worker --tls-cert, --tls-key and --tls-ca (docs/guide/tls.md)"
    )
