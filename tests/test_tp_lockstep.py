"""The shared session commands of both ranks, and the hello check, below the services.

Two ``RankState`` objects (rank 0 and rank 1 engines) run each command in two threads, joined
by an in-memory gate exchange, and must agree with each other (state hash) and with one process
running the same operations (joined logits, bit for bit). The hello check runs over a real
socket pair, once for every identity field.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest

from foundry.model.infer.inference import Engine
from foundry.model.kernels.quant import Param, QType, quantize
from foundry.model.nn import transformer as T
from foundry.model.shard.slices import rank_weights
from foundry.model.spec.config import ModelConfig
from foundry.tp.handshake import exchange_hellos
from foundry.tp.link import ControlLink
from foundry.tp.lockstep import LockstepError, RankState, TracingExchange
from foundry.wire.tp import (
    DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT,
    Hello,
    Identity,
    IdentityMismatch,
    Role,
    VerifyCommitMode,
    VersionMismatch,
)

F32 = npt.NDArray[np.float32]
R = TypeVar("R")
CFG = ModelConfig(n_ctx=64)


class MemoryTransport:
    """Both ranks post a partial; both read the sum (rank order), like a real exchange."""

    world = 2

    def __init__(self, barrier: threading.Barrier, slots: list[Any], rank: int) -> None:
        self.barrier, self.slots, self.rank = barrier, slots, rank

    def exchange(self, layer: int, gate: int, partial: np.ndarray) -> F32:
        self.slots[self.rank] = partial
        self.barrier.wait()
        total: F32 = self.slots[self.rank] + self.slots[1 - self.rank]
        self.barrier.wait()
        return total


class Alone:
    """The exchange of a world-1 engine: the partial is already the sum."""

    world = 1

    def exchange(self, layer: int, gate: int, partial: np.ndarray) -> F32:
        return partial


class Pair:
    def __init__(self, qtype: QType | None = None) -> None:
        """Two ranks of a random model; with ``qtype`` its matrices stored in that type."""
        rng = np.random.default_rng(1)
        f32 = T.init_params(CFG, seed=3)
        for p in f32.values():
            p += np.float32(0.1) * rng.standard_normal(p.shape, dtype=np.float32)
        self.params: dict[str, Param] = {
            n: quantize(p, qtype) if qtype and p.ndim > 1 and "gate_inp" not in n else p
            for n, p in f32.items()
        }
        barrier = threading.Barrier(2, timeout=30)
        slots: list[Any] = [None, None]
        self.ranks = []
        for r in range(2):
            st = RankState(Engine(CFG, rank_weights(CFG, self.params, r, 2), r, 2), CFG.n_ctx)
            st.exchange = TracingExchange(MemoryTransport(barrier, slots, r), lambda g, s, n: None)
            self.ranks.append(st)
        self.pool = ThreadPoolExecutor(1)

    def both(self, fn: Callable[[RankState], R]) -> tuple[R, R]:
        job = self.pool.submit(fn, self.ranks[1])
        return fn(self.ranks[0]), job.result(timeout=60)

    def joined(self, fn: Callable[[RankState], F32]) -> F32:
        a, b = self.both(fn)
        return np.concatenate([a, b], axis=1)

    def hashes_agree(self) -> bool:
        return self.ranks[0].state_hash() == self.ranks[1].state_hash()


def chunks(size: int) -> Callable[[int, int], int | None]:
    return lambda current, total: min(current + size, total)


@pytest.mark.parametrize("qtype", [None, QType.F16, QType.Q8_0, QType.Q4_0, QType.Q5_0])
def test_commands_match_one_process_bit_for_bit(qtype: QType | None) -> None:
    pair = Pair(qtype)
    ref = Engine(CFG, pair.params)
    a, b, c, d = (ref.new_session() for _ in range(4))
    prompt_a, prompt_b = list(range(10, 31)), list(range(40, 49))
    prompt_c, prompt_d = list(range(60, 66)), list(range(70, 81))
    for sid in (1, 2, 3, 4):
        pair.both(lambda st, sid=sid: st.create(sid, CFG.n_ctx))

    # SYNC in chunks of 8 against the same chunks in one process.
    got = pair.joined(lambda st: st.sync(1, prompt_a, chunks(8)))  # type: ignore[arg-type,return-value]
    want = None
    for i in range(0, len(prompt_a), 8):
        want = ref.decode(a, prompt_a[i : i + 8])[-1:]
    assert np.array_equal(got, want) and pair.hashes_agree()

    # MIXED_BATCH: a prefill chunk of session 2 with one token of session 1.
    got = pair.joined(lambda st: st.mixed([(2, prompt_b)], [(1, 7)]))
    want = ref.forward_rows([(b, prompt_b), (a, [7])])[len(prompt_b) - 1 :]
    assert np.array_equal(got, want) and pair.hashes_agree()

    # MIXED_PREFILLS: chunks of sessions 3 and 4 with one token of sessions 1 and 2; each
    # chunk's last row, then the items' rows.
    got = pair.joined(lambda st: st.mixed([(3, prompt_c), (4, prompt_d)], [(1, 8), (2, 9)]))
    block = [(c, prompt_c), (d, prompt_d), (a, [8]), (b, [9])]
    want = ref.forward_rows(block, last_only=True)
    assert np.array_equal(got, want) and pair.hashes_agree()
    if qtype is not None:  # the kernels' rows are their own dot products: as in passes alone
        alone = Engine(CFG, pair.params)
        for prompt, row in ((prompt_c, 0), (prompt_d, 1)):
            assert np.array_equal(alone.forward_rows([(alone.new_session(), prompt)])[-1], got[row])

    # EVAL_BATCH of both sessions.
    got = pair.joined(lambda st: st.eval_batch([(2, 5), (1, 6)]))
    want = ref.forward_rows([(b, [5]), (a, [6])])
    assert np.array_equal(got, want) and pair.hashes_agree()
    assert [s.pos for s in (a, b, c, d)] == [pair.ranks[0].sessions[i].pos for i in (1, 2, 3, 4)]


@pytest.mark.parametrize("mode", list(VerifyCommitMode))
def test_verify_commit_modes_leave_both_ranks_equal(mode: VerifyCommitMode) -> None:
    pair = Pair()
    ref = Engine(CFG, pair.params)
    s = ref.new_session()
    pair.both(lambda st: st.create(9, CFG.n_ctx))
    pair.both(lambda st: st.sync(9, [1, 20, 21, 22], chunks(64)))
    ref.decode(s, [1, 20, 21, 22])
    block = [30, 31, 32, 33]
    got = pair.joined(lambda st: st.verify(9, block))
    assert np.array_equal(got, ref.decode(s, block))
    keep = len(block) if mode is VerifyCommitMode.COMMIT_FULL else 2
    pair.both(lambda st: st.commit(9, mode, keep))
    if mode is VerifyCommitMode.ROLLBACK_REPLAY:  # the kept rows are evaluated again
        s.rewind(4)
        ref.decode(s, block[:keep])
    else:
        s.rewind(4 + keep)
    assert pair.hashes_agree()
    assert pair.ranks[1].sessions[9].tokens == [1, 20, 21, 22, *block[:keep]]
    # Decoding goes on from the committed frontier exactly as in one process.
    got = pair.joined(lambda st: st.eval_batch([(9, 40)]))
    assert np.array_equal(got, ref.decode(s, [40]))


def test_cancelled_sync_stops_both_ranks_at_the_same_position() -> None:
    pair = Pair()
    pair.both(lambda st: st.create(3, CFG.n_ctx))

    def stop_at_12(current: int, total: int) -> int | None:
        return None if current >= 12 else min(current + 4, total)

    out = pair.both(lambda st: st.sync(3, list(range(3, 40)), stop_at_12))
    assert out == (None, None)
    assert [st.sessions[3].pos for st in pair.ranks] == [12, 12]
    assert pair.hashes_agree()
    # A later SYNC of the same context keeps the 12 positions and evaluates the rest.
    pair.both(lambda st: st.sync(3, list(range(3, 40)), chunks(64)))
    assert [st.sessions[3].pos for st in pair.ranks] == [37, 37]
    assert pair.ranks[0].kept["prefill"] == 37


def test_rewind_invalidate_and_destroy() -> None:
    pair = Pair()
    pair.both(lambda st: st.create(4, 32))
    pair.both(lambda st: st.sync(4, list(range(3, 20)), chunks(64)))
    pair.both(lambda st: st.rewind(4, 5))
    assert pair.ranks[1].sessions[4].tokens == list(range(3, 8)) and pair.hashes_agree()
    pair.both(lambda st: st.invalidate(4))
    assert pair.ranks[0].sessions[4].pos == 0
    pair.both(lambda st: st.destroy(4))
    assert not pair.ranks[0].sessions and pair.hashes_agree()


def test_commands_that_do_not_fit_are_refused_before_any_gate() -> None:
    cfg = CFG
    st = RankState(Engine(cfg, T.init_params(cfg), 0, 1), cfg.n_ctx)
    st.exchange = TracingExchange(Alone(), lambda g, s, n: None)
    st.create(1, 8)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: st.create(1, 8), "already open"),
        (lambda: st.create(2, cfg.n_ctx + 1), "outside"),
        (lambda: st.eval_batch([(5, 1)]), "session 5 is not open"),
        (lambda: st.eval_batch([]), "no items"),
        (lambda: st.sync(1, list(range(9)), chunks(4)), "SYNC of 9 tokens"),
        (lambda: st.sync(1, [999], chunks(4)), "token id outside"),
        (lambda: st.commit(1, VerifyCommitMode.COMMIT_FULL, 1), "without a VERIFY"),
        (lambda: st.verify(1, list(range(9))), "VERIFY of 9 rows"),
        (lambda: st.rewind(1, 3), "cannot rewind"),
    ]
    for call, message in cases:
        with pytest.raises(LockstepError, match=message):
            call()
    st.create(2, 8)
    with pytest.raises(LockstepError, match="listed twice"):
        st.eval_batch([(2, 1), (2, 2)])
    with pytest.raises(LockstepError, match="listed twice"):
        st.mixed([(2, [3, 4])], [(2, 1)])
    with pytest.raises(LockstepError, match="listed twice"):
        st.mixed([(2, [3]), (2, [4])], [])
    with pytest.raises(LockstepError, match="mixed prefill of 9 tokens with 8 positions free"):
        st.mixed([(2, list(range(9)))], [])
    st.verify(1, [5, 6])
    with pytest.raises(LockstepError, match="awaiting its commit"):
        st.eval_batch([(1, 7)])
    with pytest.raises(LockstepError, match="COMMIT_FULL of 1 rows of a 2-row block"):
        st.commit(1, VerifyCommitMode.COMMIT_FULL, 1)


# -- the hello -------------------------------------------------------------------------------

IDENTITY = Identity(
    gguf_bytes=123_456,
    model_id=0xABCD,
    n_layer=2,
    n_embd=64,
    n_vocab=259,
    quant_bits=32,
    ctx_size=256,
    gates_per_token=4,
)


def handshake_both(leader: Hello, worker: Hello) -> tuple[BaseException | None, ...]:
    a, b = socket.socketpair()
    links = [ControlLink(s, timeout_s=5, expect_hello=True) for s in (a, b)]
    errors: list[BaseException | None] = [None, None]

    def run(i: int, hello: Hello) -> None:
        try:
            exchange_hellos(links[i], hello, max_rows=1)
        except Exception as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i, h)) for i, h in enumerate((leader, worker))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for link in links:
        link.close()
    return tuple(errors)


def test_matching_hellos_pass() -> None:
    assert handshake_both(
        Hello(role=Role.LEADER, identity=IDENTITY), Hello(role=Role.WORKER, identity=IDENTITY)
    ) == (None, None)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Identity)])
def test_each_identity_field_mismatch_aborts_both_ranks_naming_it(name: str) -> None:
    value = getattr(IDENTITY, name)
    other = (value[0] + 1, *value[1:]) if isinstance(value, tuple) else value + 1
    worker_identity = dataclasses.replace(IDENTITY, **{name: other})
    errors = handshake_both(
        Hello(role=Role.LEADER, identity=IDENTITY),
        Hello(role=Role.WORKER, identity=worker_identity),
    )
    for exc in errors:
        assert isinstance(exc, IdentityMismatch), exc
        assert f"identity mismatch on {name}: leader has" in str(exc)
    assert str(errors[0]) == str(errors[1])  # both ranks say the same, leader's value first


def test_expert_split_mismatch_aborts_both_ranks_naming_it() -> None:
    split = DS4_TP_MODE_EXPERT_INTERMEDIATE_SPLIT
    errors = handshake_both(
        Hello(role=Role.LEADER, identity=IDENTITY, execution_mode=split),
        Hello(role=Role.WORKER, identity=IDENTITY),
    )
    for exc in errors:
        assert isinstance(exc, IdentityMismatch), exc
        assert str(exc) == (
            "execution mode mismatch on expert_split: leader has intermediate, "
            "worker has experts; start both ranks with the same --expert-split"
        )
    assert handshake_both(
        Hello(role=Role.LEADER, identity=IDENTITY, execution_mode=split),
        Hello(role=Role.WORKER, identity=IDENTITY, execution_mode=split),
    ) == (None, None)


def test_role_and_version_mismatches_abort() -> None:
    errors = handshake_both(
        Hello(role=Role.LEADER, identity=IDENTITY), Hello(role=Role.LEADER, identity=IDENTITY)
    )
    assert all(isinstance(e, IdentityMismatch) and "both ranks say" in str(e) for e in errors)
    errors = handshake_both(
        Hello(role=Role.LEADER, identity=IDENTITY),
        Hello(role=Role.WORKER, identity=IDENTITY, version=3),
    )
    assert isinstance(errors[0], VersionMismatch) and "version 3" in str(errors[0])
    assert isinstance(errors[1], VersionMismatch)
