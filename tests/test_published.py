"""Published architectures on tiny random files: against llama.cpp, the pair against one process.

``tests/published.py`` writes a tiny file per architecture (same bytes every time; the
references keep its sha256); ``tests/refs/published.json`` holds llama.cpp's greedy tokens and
logits on them, recorded by ``tests/refs/record_published.py`` (its docstring has the command).

Tolerance: the files are float32; both engines keep K and V in float16 (llama.cpp's default
cache, and ours), but llama.cpp's CPU attention also rounds Q to float16 and sums V's weighted
rows in float16, so logits agree to about 1e-3 of each row's largest magnitude (measured: at
most 1.01e-3 over every architecture, 2.04e-3 with a float32 cache); the tests allow 2e-3.
Greedy tokens must be identical.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from published import TINY, prompts, write_tiny
from tp_harness import Client, InProcessLeader, loopback_options, start_worker, wait_paired

from foundry.model.formats.gguf_io import load_gguf_stored
from foundry.model.formats.gguf_model import GGUFError
from foundry.model.infer.inference import Engine, Gate, GateExchange
from foundry.model.infer.kv_cache import KVCache, Session
from foundry.model.shard.slices import rank_layout, rank_weights
from foundry.model.spec.arch import ArchConfig
from foundry.model.text.vocab import load_tokenizer
from foundry.tp.blas import limit_blas_threads
from foundry.tp.speculative import SpecMode
from foundry.wire import frontend as fw

F32 = npt.NDArray[np.float32]
REFS = json.loads((Path(__file__).parent / "refs" / "published.json").read_text())
REL_TOL = 2e-3


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    folder = tmp_path_factory.mktemp("published")
    for name in TINY:
        path = folder / f"{name}.gguf"
        # The references hold for exactly these bytes: the generator must be deterministic.
        assert write_tiny(path, name) == REFS[name]["sha256"], name
        out[name] = path
    return out


def test_every_architecture_has_references() -> None:
    assert set(REFS) == set(TINY)
    archs = {t.arch for t in TINY.values()}
    assert archs == {"llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "olmoe"}


@pytest.mark.parametrize("name", list(TINY))
def test_greedy_and_logits_equal_llama_cpp(files: dict[str, Path], name: str) -> None:
    m = load_gguf_stored(files[name])
    assert isinstance(m.cfg, ArchConfig) and m.cfg.architecture == TINY[name].arch
    assert m.cfg.head_dim == TINY[name].head_dim
    assert m.cfg.tied_output == TINY[name].tied
    engine = Engine(m.cfg, m.params, kv_cache=KVCache.F16)  # llama.cpp's (float32 files: F32)
    for case in REFS[name]["cases"]:
        session = engine.new_session()
        logits = engine.decode(session, case["prompt"])
        rows = [logits[0], logits[-1]]
        out: list[int] = []
        last = logits[-1]
        for _ in range(len(case["greedy"])):
            out.append(int(np.argmax(last)))
            last = engine.decode(session, [out[-1]])[-1]
            if len(out) == 1:
                rows.append(last)
        assert out == case["greedy"]
        ref = np.array(case["logits"], dtype=np.float32)
        err = np.abs(np.array(rows) - ref).max(axis=1) / np.abs(ref).max(axis=1)
        assert (err <= REL_TOL).all(), (name, err)


def test_sliding_window_changes_what_a_local_layer_sees(files: dict[str, Path]) -> None:
    """gemma3's local layers see the last 5 positions: with the window made wider, the logits
    past position 5 change, the ones before do not (the window is the only difference)."""
    m = load_gguf_stored(files["gemma3"])
    assert isinstance(m.cfg, ArchConfig)
    assert [m.cfg.is_swa(i) for i in range(7)] == [True] * 5 + [False, True]
    ids = prompts("gemma3")[1]
    narrow_engine = Engine(m.cfg, m.params)
    narrow = narrow_engine.decode(narrow_engine.new_session(), ids)
    wide_cfg = ArchConfig(**{**m.cfg.__dict__, "sliding_window": 64})
    wide_engine = Engine(wide_cfg, m.params)
    wide = wide_engine.decode(wide_engine.new_session(), ids)
    np.testing.assert_array_equal(narrow[:5], wide[:5])
    assert not np.allclose(narrow[5:], wide[5:], atol=1e-4)


class _Exchange:
    """Two ranks on two threads: each posts its partial, both read the sum."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(2, timeout=30)
        self._slots: list[F32 | None] = [None, None]

    def for_rank(self, rank: int) -> GateExchange:
        def exchange(layer: int, gate: Gate, partial: F32) -> F32:
            self._slots[rank] = partial
            self._barrier.wait()
            a, b = self._slots
            assert a is not None and b is not None
            total = a + b
            self._barrier.wait()
            return total

        return exchange


@pytest.mark.parametrize("name", list(TINY))
def test_pair_equals_one_process_bit_for_bit(files: dict[str, Path], name: str) -> None:
    m = load_gguf_stored(files[name])
    cfg = m.cfg
    single = Engine(cfg, m.params)
    assert len(single.parts) == 2
    ranks = [Engine(cfg, rank_weights(cfg, m.params, r, 2), rank=r, world=2) for r in range(2)]
    ex = _Exchange()
    pool = ThreadPoolExecutor(1)
    s_one = single.new_session()
    s_pair: list[Session] = [e.new_session() for e in ranks]

    def pair(tokens: list[int]) -> F32:
        job = pool.submit(ranks[1].decode, s_pair[1], tokens, ex.for_rank(1))
        half0 = ranks[0].decode(s_pair[0], tokens, ex.for_rank(0))
        return np.concatenate([half0, job.result(timeout=60)], axis=1)

    ids = prompts(name)[1]
    ref, got = single.decode(s_one, ids), pair(ids)
    np.testing.assert_array_equal(got, ref)
    for _ in range(12):
        token = int(np.argmax(ref[-1]))
        ref, got = single.decode(s_one, [token]), pair([token])
        np.testing.assert_array_equal(got, ref)
    pool.shutdown()


def test_a_replicated_kv_head_is_cached_once(files: dict[str, Path]) -> None:
    """gemma3's single kv head: both halves of one process compute it from the same rows (the
    same bits, the test above) and share one cache array; qwen3's 3 kv heads split 2 + 1 keep
    one array each."""
    for name, shared in (("gemma3", True), ("qwen3", False)):
        m = load_gguf_stored(files[name])
        s = Engine(m.cfg, m.params).new_session()
        for layer in range(m.cfg.n_layer):
            assert (s.k[layer][0] is s.k[layer][1]) is shared, name
            assert (s.v[layer][0] is s.v[layer][1]) is shared, name
            assert s.k[layer][0] is not s.v[layer][0]


@pytest.mark.parametrize("name", list(TINY))
def test_last_rows_only_are_the_last_rows_of_all(files: dict[str, Path], name: str) -> None:
    """A prompt needs only its last row's logits: ``last_only`` gives each session's last row,
    the bits of the rows the whole block gives (stored heads multiply the last rows alone,
    the kernels being batch-invariant; float32 heads still multiply the block)."""
    m = load_gguf_stored(files[name])
    heads = []
    for last_only in (False, True):
        engine = Engine(m.cfg, m.params)
        a, b = engine.new_session(), engine.new_session()
        engine.decode(a, prompts(name)[0])
        rows = [(a, prompts(name)[1][:3]), (b, prompts(name)[1])]
        heads.append(engine.forward_rows(rows, last_only=last_only))
        assert a.pos == len(prompts(name)[0]) + 3 and b.pos == len(prompts(name)[1])
    full, last = heads
    assert last.shape == (2, full.shape[1])
    np.testing.assert_array_equal(last, full[[2, full.shape[0] - 1]])


def test_split_rules_on_published_shapes() -> None:
    """What each rank holds: KV groups split unevenly (qwen3: 3 kv heads), a single kv head
    replicated with the query heads split (qwen3moe, gemma3), whole-vector QK-norm's Q and K
    rows replicated (olmoe), dense FFNs by whole blocks of intermediate rows."""

    def cfg(name: str) -> ArchConfig:
        t = TINY[name]
        return ArchConfig(
            architecture=t.arch,
            n_vocab=t.n_vocab,
            n_embd=t.n_embd,
            n_layer=t.n_layer,
            n_head=t.n_head,
            n_head_kv=t.n_head_kv,
            n_ff=t.n_ff,
            n_expert=t.n_expert,
            n_expert_used=t.n_expert_used,
            key_length=t.head_dim,
            tied_output=t.tied,
        )

    q3 = [rank_layout(cfg("qwen3"), r, 2) for r in range(2)]
    assert [(lay.kv_heads, lay.heads) for lay in q3] == [((0, 2), (0, 6)), ((2, 3), (6, 9))]
    gm = [rank_layout(cfg("gemma3"), r, 2) for r in range(2)]
    assert [(lay.kv_heads, lay.heads, lay.ff) for lay in gm] == [
        ((0, 1), (0, 2), (0, 64)),
        ((0, 1), (2, 4), (64, 96)),
    ]
    ol = [rank_layout(cfg("olmoe"), r, 2) for r in range(2)]
    assert [(lay.q_rows, lay.k_rows, lay.heads, lay.kv_heads) for lay in ol] == [
        ((0, 4), (0, 4), (0, 2), (0, 2)),
        ((0, 4), (0, 4), (2, 4), (2, 4)),
    ]


def _rewrite(
    src: Path,
    dst: Path,
    *,
    set_keys: dict[str, tuple[object, gguf.GGUFValueType]] | None = None,
    arch: str | None = None,
) -> None:
    """A copy of a tiny file with some metadata changed (the tensors as they are)."""
    r = gguf.GGUFReader(src)
    name = arch or str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(dst, name)
    set_keys = set_keys or {}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in set_keys:
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for key, (value, vtype) in set_keys.items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_files_are_refused_in_one_line(files: dict[str, Path], tmp_path: Path) -> None:
    u32 = gguf.GGUFValueType.UINT32
    cases: list[tuple[dict[str, tuple[object, gguf.GGUFValueType]], str | None, str]] = [
        ({}, "phi3", r"architecture 'phi3' is not supported \(Foundry runs gemma3, llama"),
        ({"qwen3.context_length": (2**31, u32)}, None, None),  # loads: nothing is sized by it
        ({"qwen3.embedding_length": (2**31, u32)}, None, r"n_embd = 2147483648, above 65536"),
        (
            {"tokenizer.ggml.bos_token_id": (289, u32)},
            None,
            r"bos_token_id is 289, outside the vocabulary \[0, 289\)",
        ),
        (
            {"qwen3.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)},
            None,
            r"qwen3\.rope\.scaling\.type = 'yarn' is not supported",
        ),
    ]  # type: ignore[list-item]
    for i, (keys, arch, message) in enumerate(cases):
        bad = tmp_path / f"bad{i}.gguf"
        _rewrite(files["qwen3"], bad, set_keys=keys, arch=arch)
        if message is None:
            m = load_gguf_stored(bad)
            assert m.cfg.n_ctx == 2**31
            engine = Engine(m.cfg, m.params)  # the default context is capped
            assert engine.ctx_size == 4096 and engine.new_session().ctx_size == 4096
            assert Engine(m.cfg, m.params, ctx_size=50).new_session().k[0][0].shape[0] == 50
            continue
        with pytest.raises(GGUFError, match=message) as err:
            load_gguf_stored(bad)
        assert "\n" not in str(err.value)


def test_stored_types_stay_stored(files: dict[str, Path]) -> None:
    """The untied Q8_0 embedding stays blocks (looked up by rows); the tied head is a view of
    the one table, not a copy."""
    m = load_gguf_stored(files["llama"])
    assert not isinstance(m.params["token_embd.weight"], np.ndarray)
    g = load_gguf_stored(files["gemma3"])
    engine = Engine(g.cfg, g.params)
    table = engine.replicated["token_embd.weight"]
    assert isinstance(table, np.ndarray)
    assert all(np.shares_memory(h, table) for h in engine._head)
    blocks = [h.shape[0] for h in engine._head]
    assert blocks == [147, 146]


# gemma3's tiny file: one kv head replicated, a tied head split by vocabulary, sliding window;
# qwen3's: 9 query heads over 3 kv heads, split 6 + 3.
@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_pair_processes_equal_one_process(
    files: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """The leader here, the worker a process: every logits row of a greedy run equals one
    process's bit for bit (the prompt through the file's own tokenizer)."""
    model = files[name]
    limit_blas_threads(1)
    rows: list[F32] = []
    leader = InProcessLeader(
        loopback_options(
            model,
            prefill_chunk=8,
            spec_mode=SpecMode.OFF,
            hash_check=True,
        ),
        hook=lambda rid, r: rows.append(r.copy()),
    )
    worker = start_worker(model, leader.leader.port, tmp_path / "worker.log")
    try:
        wait_paired(leader.leader.frontend_port)
        with Client(leader.leader.frontend_port) as c:
            got = c.generate("abc", 12)
        assert isinstance(got.end, fw.Done)
    finally:
        leader.stop()
        assert worker.exit_code() == 0, worker.text()
    m = load_gguf_stored(model)
    engine = Engine(m.cfg, m.params)
    s = engine.new_session()
    ids = load_tokenizer(m.metadata).encode("abc")
    ref = [engine.decode(s, ids)[-1:]]
    for token in got.tokens[:-1]:
        ref.append(engine.decode(s, [token]))
    assert [int(np.argmax(r)) for r in ref] == got.tokens
    np.testing.assert_array_equal(np.concatenate(rows), np.concatenate(ref))


def test_file_hash_matches_references(files: dict[str, Path]) -> None:
    for name, path in files.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == REFS[name]["sha256"]


def test_up_serves_a_published_file_on_the_pair_without_training(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """`foundry up --model FILE`: gateway, tp-leader and tp-worker on the file, no coordinator
    and no workers; the sample is the file's greedy text; `ctl generate` answers; Ctrl+C ends
    all three."""
    from up_stack import ENV, running, start_up, wait_gone

    up, ports = start_up(
        tmp_path,
        1,
        "--model",
        str(files["gemma3"]),
        "--prompt",
        "abc",
        "--sample-tokens",
        "8",
        "--ctx-size",
        "64",
    )
    gateway = f"127.0.0.1:{ports[ports.index('--gateway-port') + 1]}"
    try:
        up.wait_for(r"serving .*gemma3\.gguf on the tensor-parallel pair", 60)
        up.wait_for(r"sample \(greedy, 8 tokens\): 'abc", 60)
        up.wait_for(rf"ready in \d+ s: `(?:\S*/)?foundry ctl --gateway {gateway} generate", 10)
        children = up.children()
        assert set(children) == {"gateway", "tp-leader", "tp-worker"}
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "foundry",
                "ctl",
                "--gateway",
                gateway,
                "generate",
                "--prompt",
                "abc",
                "--max-tokens",
                "8",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=ENV,
        )
        assert out.returncode == 0, out.stderr
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=30) == 0, up.text()
        assert wait_gone(children, 5.0) == []
        assert not any(running(pid) for pid in children.values())
    finally:
        up.cleanup()
    bad = tmp_path / "bad"
    bad.mkdir()
    phi = bad / "phi.gguf"
    _rewrite(files["qwen3"], phi, arch="phi3")
    up, _ = start_up(bad, 1, "--model", str(phi))
    try:
        assert up.proc.wait(timeout=30) == 1
        assert "architecture 'phi3' is not supported" in up.text()
    finally:
        up.cleanup()
