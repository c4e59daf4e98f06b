"""The kernels' thread pool (``csrc/pool.c``): results never depend on the thread count.

Every product, attention and engine pass is run at 1, 2 and 3 threads and compared bit for bit:
the products of every stored type (one input and blocks of inputs, row counts that leave
partial row groups), attention over a block of rows with and without a sliding window, our own
MoE files decoded and prefilled by one process and by the pair, and the published Gemma file.
The tiny models' products are far below the work the pool splits by default, so the tests
lower that bound to 0 (``split_below``): every product of 32 rows or more is then cut into
tasks, and a task computed differently from the one-thread code would show in the bits. A
product moved by one task computing its rows off by one bit must differ, so the comparison
reads real bits (``test_a_product_cut_wrongly_is_seen``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from quant_weights import KQUANTS, QUANTIZABLE, perturbed, stored

from foundry.model.formats.gguf_io import load_gguf_stored, save_gguf
from foundry.model.infer.inference import Engine, Gate
from foundry.model.infer.kv_cache import KVCache
from foundry.model.kernels import quant
from foundry.model.kernels.quant import QTensor, QType
from foundry.model.shard.slices import rank_weights
from foundry.model.shard.table import ExpertSplit
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]
COUNTS = (1, 2, 3)
CFG = ModelConfig(
    n_ctx=96, n_embd=128, n_layer=2, n_head=8, n_head_kv=4, n_ff=128, n_expert=4, n_expert_used=2
)

pytestmark = pytest.mark.skipif(quant.KERNELS == "numpy", reason="needs the C kernels")


@pytest.fixture(autouse=True)
def split_everything() -> Iterator[None]:
    from foundry.model.kernels import _kernels  # type: ignore[attr-defined]

    _kernels.split_below(0)
    try:
        yield
    finally:
        _kernels.split_below(64 * 1024)
        quant.set_threads(1)


def at_counts(fn: Callable[[], list[F32]]) -> list[list[F32]]:
    out = []
    for n in COUNTS:
        quant.set_threads(n)
        assert quant.threads() == n
        out.append(fn())
    return out


def assert_same_bits(runs: list[list[F32]]) -> None:
    first = runs[0]
    for other in runs[1:]:
        assert len(other) == len(first)
        for a, b in zip(first, other, strict=True):
            assert a.tobytes() == b.tobytes()


PATHS = {
    "avx512-vnni+amx": ["best", "avx512-vnni", "avx2", "portable"],
    "avx512-vnni": ["best", "avx2", "portable"],
    "avx2+vnni": ["best", "avx2", "portable"],
    "avx2": ["best", "portable"],
}.get(quant.KERNELS, ["best"])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", QUANTIZABLE + KQUANTS)
@pytest.mark.parametrize(("rows", "n"), [(1030, 1), (517, 3), (96, 130)])
def test_products_are_the_same_bits_at_any_thread_count(
    path: str, qtype: QType, rows: int, n: int
) -> None:
    """On every SIMD path here; each path's bits are the portable C's (test_quant_kernels)."""
    rng = np.random.default_rng(rows + n)
    k = 512
    w = stored(rng.standard_normal((rows, k)).astype(np.float32), qtype)
    x = rng.standard_normal((n, k)).astype(np.float32)
    quant._kernels.use(path)  # type: ignore[union-attr]
    try:
        runs = at_counts(lambda: [quant.linear(x, w)])
        quant.set_threads(1)
        alone = np.stack([quant.linear(x[t : t + 1], w)[0] for t in range(n)])  # one row each
    finally:
        quant._kernels.use("best")  # type: ignore[union-attr]
    assert_same_bits(runs)
    assert alone.tobytes() == runs[0][0].tobytes()


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q5_0, QType.F16])
def test_a_blocks_groups_are_each_groups_own_product_at_any_thread_count(qtype: QType) -> None:
    """A prompt's experts (linear_groups): groups of 1 to 70 rows, each times its own matrix,
    in shared pool calls, give each group's rows the bits of its own product at every count."""
    rng = np.random.default_rng(6)
    k, n_out, sizes = 256, 96, [3, 1, 70, 17, 9]
    ws = [stored(rng.standard_normal((n_out, k)).astype(np.float32), qtype) for _ in sizes]
    x = rng.standard_normal((sum(sizes) + 4, k)).astype(np.float32)
    edges = np.cumsum([2, *sizes]).tolist()  # rows 0, 1 and the last 2 in no group
    groups = [(lo, hi, w) for lo, hi, w in zip(edges[:-1], edges[1:], ws, strict=True)]

    def grouped() -> list[F32]:
        out = np.zeros((x.shape[0], n_out), np.float32)
        return [quant.linear_groups(x, groups, out)]

    runs = at_counts(grouped)
    assert_same_bits(runs)
    quant.set_threads(1)
    alone = np.zeros((x.shape[0], n_out), np.float32)
    for lo, hi, w in groups:
        alone[lo:hi] = quant.linear(x[lo:hi], w)
    assert alone.tobytes() == runs[0][0].tobytes()


def test_a_product_cut_wrongly_is_seen() -> None:
    """Rows of a product computed from an input moved by a rounding step of its int8 values:
    the comparison sees it."""
    rng = np.random.default_rng(1)
    w = stored(rng.standard_normal((256, 512)).astype(np.float32), QType.Q8_0)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    moved = x.copy()
    moved[0, :8] *= np.float32(1.05)
    quant.set_threads(2)
    y = quant.linear(x, w)
    y[:, 128:] = quant.linear(moved, w)[:, 128:]  # "a second task" on other inputs
    with pytest.raises(AssertionError):
        assert_same_bits([[quant.linear(x, w)], [y]])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("window", [0, 7, 90])
@pytest.mark.parametrize(
    ("n_kv", "dh", "pos", "n", "n_head"),
    [
        (4, 32, 5, 20, 8),
        (2, 64, 130, 1, 8),
        (1, 256, 99, 1, 8),
        (2, 40, 70, 1, 8),
        (1, 64, 4100, 1, 2),  # past SPLIT_POSITIONS with fewer heads than threads: attend_split
    ],
)
def test_attention_of_a_block_is_each_rows_own_at_any_thread_count(
    dtype: type[np.floating[np.float16] | np.floating[np.float32]],
    window: int,
    n_kv: int,
    dh: int,
    pos: int,
    n: int,
    n_head: int,
) -> None:
    """A block's rows each over their own window; one row with more threads than kv heads
    (a task per fewer query heads), and over a long cache with more threads than heads
    (split by positions and by value columns), with attend's bits."""
    rng = np.random.default_rng(2)
    kc = rng.standard_normal((pos + n, n_kv, dh)).astype(dtype)
    vc = rng.standard_normal((pos + n, n_kv, dh)).astype(dtype)
    q = rng.standard_normal((n, n_head, dh)).astype(np.float32)

    def block() -> list[F32]:
        out = np.empty_like(q)
        quant.attend_rows(q, kc, vc, pos, window, out)
        return [out]

    runs = at_counts(block)
    assert_same_bits(runs)
    rows = np.empty_like(q)
    for t in range(n):  # the engine's loop before: one row at a time
        n_pos = pos + t + 1
        first = max(0, n_pos - window) if window else 0
        quant.attend(q[t], kc[first:], vc[first:], n_pos - first, rows[t])
    assert rows.tobytes() == runs[0][0].tobytes()


def test_a_blocks_row_operations_are_each_rows_own_at_any_thread_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RMSNorm, the rotation, SiLU x up, GeGLU, the router, the experts' inputs and their
    combination, the sums and the cache writes of a prompt's block, cut into one-row tasks: at
    every count the bits of each row computed alone (the cache rows: numpy's float16
    rounding, NaN included); the sums, rows and cache writes also those of the numpy path."""
    rng = np.random.default_rng(5)
    n, d, heads, dh, k = 37, 96, 3, 32, 2
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    cos, sin = (rng.standard_normal((n, dh // 2)).astype(np.float32) for _ in range(2))
    gu = rng.standard_normal((n, 2 * d)).astype(np.float32)
    router = rng.standard_normal((5, d)).astype(np.float32)
    y = rng.standard_normal((n, 4 * heads * dh)).astype(np.float32) * 3e4  # some overflow f16
    y[3, heads * dh + 1] = np.nan
    y[5, heads * dh : 2 * heads * dh] *= 1e-9  # float16's subnormals and zeros
    ys = rng.standard_normal((n * k, d)).astype(np.float32)
    order = rng.permutation(n * k)[: n * k - 5]  # 5 assignments held by another part

    def ops(rows: slice) -> list[F32]:
        r = x[rows]
        weights, top = quant.route(r, router, k)
        kv = [np.empty((r.shape[0], heads, dh), t) for t in (np.float16, np.float32)]
        for c in kv:
            quant.store_rows(y[rows], heads * dh, c)
        picked = np.flatnonzero(np.isin(order // k, np.arange(n)[rows]))
        local = order[picked] - (rows.start or 0) * k
        return [
            quant.rmsnorm(r, w, 1e-5),
            quant.rope(r.reshape(-1, heads, dh), cos[rows], sin[rows], neox=False),
            quant.rope(r.reshape(-1, heads, dh), cos[rows], sin[rows], neox=True),
            quant.swiglu(gu[rows]),
            quant.geglu(gu[rows]),
            weights,
            top.astype(np.float32),
            quant.combine_experts(ys[picked], weights * 0 + 0.5, local),
            quant.add(r, ys[rows]),
            quant.take_rows(ys, order[rows]),
            *(c.view(np.uint8).astype(np.float32) for c in kv),
        ]

    runs = at_counts(lambda: ops(slice(0, n)))
    assert_same_bits(runs)
    quant.set_threads(1)
    single = [ops(slice(t, t + 1)) for t in range(n)]
    alone = [np.concatenate(parts) for parts in zip(*single, strict=True)]
    assert_same_bits([runs[0], alone])
    with np.errstate(over="ignore", invalid="ignore"):  # numpy's rounding, to inf past 65504
        half = y[:, heads * dh : 2 * heads * dh].astype(np.float16)
    assert runs[0][-2].tobytes() == half.view(np.uint8).astype(np.float32).tobytes()
    quant._kernels.use("portable")  # type: ignore[union-attr]
    try:
        portable = ops(slice(0, n))
    finally:
        quant._kernels.use("best")  # type: ignore[union-attr]
    assert_same_bits([runs[0], portable])
    monkeypatch.setattr(quant, "_kernels", None)  # numpy's: the same sums, rows and cache
    with np.errstate(over="ignore", invalid="ignore"):
        numpy_ops = ops(slice(0, n))
    for i in (8, 9, 10, 11):
        assert numpy_ops[i].tobytes() == runs[0][i].tobytes()


def decode_run(engine: Engine, prompt: list[int], steps: int) -> list[F32]:
    """The prompt's logits as one block, then greedy tokens one at a time."""
    session = engine.new_session()
    out = [engine.decode(session, prompt)]
    for _ in range(steps):
        out.append(engine.decode(session, [int(np.argmax(out[-1][-1]))]))
    return out


@pytest.fixture(scope="module")
def own_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("threads")
    files = {}
    for dtype in ("q8_0", "q4_0", "f16"):
        files[dtype] = folder / f"{dtype}.gguf"
        save_gguf(files[dtype], CFG, perturbed(CFG), dtype=dtype)  # type: ignore[arg-type]
    return files


PROMPT = [int(t) for t in np.arange(3, 43) * 5 % 259]


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "f16"])
@pytest.mark.parametrize("mode", list(ExpertSplit))
def test_our_files_decode_the_same_bits_at_any_thread_count(
    own_files: dict[str, Path], dtype: str, mode: ExpertSplit
) -> None:
    params = load_gguf_stored(own_files[dtype]).params
    engine = Engine(CFG, params, expert_split=mode)
    assert_same_bits(at_counts(lambda: decode_run(engine, PROMPT, 6)))


def test_the_profile_counts_a_decoded_tokens_layers_and_pool_calls(
    own_files: dict[str, Path],
) -> None:
    """quant.profile (bench/performance/engine.py --profile): a layer counted once a token
    per layer, its phases within it, the pool's calls and joins at 2 threads, nothing while
    off, and the counters reset by each read."""
    engine = Engine(CFG, load_gguf_stored(own_files["q8_0"]).params)
    session = engine.new_session()
    engine.decode(session, PROMPT[:4])
    quant.set_threads(2)  # split_everything: every product on the pool
    quant.profile(True)
    for t in PROMPT[4:7]:
        engine.decode(session, [t])
    counted = quant.profile(False)
    engine.decode(session, [PROMPT[7]])
    after = quant.profile(False)
    assert counted["layer"][1] == 3 * CFG.n_layer
    phases = sum(counted[k][0] for k in ("qkv", "attention", "out", "ffn"))
    assert 0 < phases <= counted["layer"][0]
    assert counted["pool"][1] > 0 and 0 < counted["join"][0] <= counted["pool"][0]
    assert all(v == (0, 0) for v in after.values())


class _Exchange:
    """The pair's gate exchange between two threads of this process."""

    def __init__(self) -> None:
        import threading

        self.barrier = threading.Barrier(2)
        self.slots: list[F32 | None] = [None, None]

    def for_rank(self, rank: int) -> Callable[[int, Gate, F32], F32]:
        def exchange(layer: int, gate: Gate, partial: F32) -> F32:
            self.slots[rank] = partial.copy()
            self.barrier.wait(timeout=60)
            total = self.slots[0] + self.slots[1]  # type: ignore[operator]
            self.barrier.wait(timeout=60)
            return total

        return exchange


@pytest.mark.parametrize("threads", [2, 3])
def test_the_pair_at_any_thread_count_equals_one_process_at_one(
    own_files: dict[str, Path], threads: int
) -> None:
    """Both ranks decode in one process on the shared pool (one of them at a time holds it,
    the other computes alone: the same tasks), against one process on one thread."""
    params = load_gguf_stored(own_files["q8_0"]).params
    quant.set_threads(1)
    ref = decode_run(Engine(CFG, params), PROMPT, 6)
    ranks = [
        Engine(CFG, rank_weights(CFG, params, r, 2), rank=r, world=2, threads=threads)
        for r in range(2)
    ]
    ex = _Exchange()
    sessions = [e.new_session() for e in ranks]
    with ThreadPoolExecutor(1) as pool:

        def pair(tokens: list[int]) -> F32:
            job = pool.submit(ranks[1].decode, sessions[1], tokens, ex.for_rank(1))
            half0 = ranks[0].decode(sessions[0], tokens, ex.for_rank(0))
            return np.concatenate([half0, job.result(timeout=60)], axis=1)

        got = [pair(PROMPT)]
        for _ in range(6):
            got.append(pair([int(np.argmax(got[-1][-1]))]))
    assert_same_bits([ref, got])


def test_the_gemma_file_decodes_the_same_bits_at_any_thread_count() -> None:
    from test_published_gemma import gemma_file

    m = load_gguf_stored(gemma_file())
    assert isinstance(m.params["token_embd.weight"], QTensor)
    engine = Engine(m.cfg, m.params, ctx_size=64, kv_cache=KVCache.F16)
    prompt = [2, 818, 5279, 529, 7001, 563, 496, 1729, 1003]
    assert_same_bits(at_counts(lambda: decode_run(engine, prompt, 4)))


def test_the_gemma_pair_at_two_threads_equals_one_process_at_one() -> None:
    from test_published_gemma import gemma_file

    m = load_gguf_stored(gemma_file())
    prompt = [2, 818, 5279, 529, 7001, 563, 496, 1729, 1003]
    quant.set_threads(1)
    ref = decode_run(Engine(m.cfg, m.params, ctx_size=64), prompt, 3)
    ranks = [
        Engine(m.cfg, rank_weights(m.cfg, m.params, r, 2), rank=r, world=2, ctx_size=64, threads=2)
        for r in range(2)
    ]
    ex = _Exchange()
    sessions = [e.new_session() for e in ranks]
    with ThreadPoolExecutor(1) as pool:

        def pair(tokens: list[int]) -> F32:
            job = pool.submit(ranks[1].decode, sessions[1], tokens, ex.for_rank(1))
            half0 = ranks[0].decode(sessions[0], tokens, ex.for_rank(0))
            return np.concatenate([half0, job.result(timeout=120)], axis=1)

        got = [pair(prompt)]
        for _ in range(3):
            got.append(pair([int(np.argmax(got[-1][-1]))]))
    assert_same_bits([ref, got])


def test_the_count_is_checked() -> None:
    with pytest.raises(ValueError, match="threads"):
        quant.set_threads(0)


def test_the_default_is_the_physical_cores_among_the_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four allowed CPUs, two hyperthreads of each of two cores: two threads; a quota of one
    CPU: one; topology unknown: the four."""
    from foundry import hardware

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for cpu in range(4):
        topo = tmp_path / f"sys/devices/system/cpu/cpu{cpu}/topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{cpu // 2}\n")
        (topo / "physical_package_id").write_text("0\n")
    assert hardware.default_threads(tmp_path) == 2
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("100000 100000\n")
    assert hardware.default_threads(tmp_path) == 1
    assert hardware.default_threads(tmp_path / "nothing") == 4


def test_up_divides_the_threads_between_the_processes_that_compute() -> None:
    from foundry.up.plan import StackOptions, StackPorts, serving_services, training_services

    opt = StackOptions(workers=3, threads=16)
    ports = StackPorts.of(opt)
    argv = {
        s.name: s.argv
        for s in [
            *training_services(opt, ports, None),
            *serving_services(opt, ports, Path("m.gguf")),
        ]
    }
    for name in ("worker-0", "worker-1", "worker-2"):
        assert argv[name][argv[name].index("--threads") + 1] == "5"
    for name in ("tp-leader", "tp-worker"):
        assert argv[name][argv[name].index("--threads") + 1] == "8"
    assert "--threads" not in argv["coordinator"]
    none = StackOptions(workers=3)
    assert all(
        "--threads" not in s.argv for s in training_services(none, StackPorts.of(none), None)
    )


def test_colocated_services_divide_the_default_between_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--colocated K` (the ranks or workers of a Compose project on one machine): without
    --threads each takes the machine's default divided by K, at least one; --threads wins."""
    from foundry import hardware
    from foundry.cli import build_parser
    from foundry.commands.common import use_threads

    monkeypatch.setattr(hardware, "default_threads", lambda: 16)
    before = quant.threads()
    parse = build_parser().parse_args
    try:
        for argv, want in (
            (["tp-worker", "--model", "m.gguf", "--leader", "127.0.0.1:1"], 16),
            (["tp-worker", "--model", "m.gguf", "--leader", "127.0.0.1:1", "--colocated", "3"], 5),
            (["tp-leader", "--model", "m.gguf", "--colocated", "4"], 4),
            (["worker", "--coordinator", "127.0.0.1:1", "--colocated", "32"], 1),
            (["worker", "--coordinator", "127.0.0.1:1", "--colocated", "3", "--threads", "7"], 7),
        ):
            assert use_threads(parse(argv)) == want, argv
            assert quant.threads() == want
    finally:
        quant.set_threads(before)
    with pytest.raises(SystemExit):
        parse(["worker", "--coordinator", "127.0.0.1:1", "--colocated", "0"])


def test_generate_prints_the_same_text_at_any_thread_count(own_files: dict[str, Path]) -> None:
    import subprocess
    import sys

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    outs = [
        subprocess.run(
            [
                sys.executable,
                "-m",
                "foundry",
                "generate",
                "--model",
                str(own_files["q4_0"]),
                "--prompt",
                "The ",
                "--max-tokens",
                "24",
                "--threads",
                str(n),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=True,
        ).stdout
        for n in (1, 2, 3)
    ]
    assert outs[0] and outs[0] == outs[1] == outs[2]
