"""Decode tokens/s of worlds of N ranks on one host, the host's threads divided between the
ranks, against one process with all of them, measured in one run; and a world with one rank
slowed, under equal shares against the shares its calibration chooses (``--shares auto``).

1. **one process**: ``Engine`` over the whole file at ``--threads`` kernel threads, greedy, the
   prompt encoded by the file's tokenizer as the leader encodes it, stopping at an
   end-of-generation token as the leader does: the baseline.
2. **worlds of N** (``--worlds 2,4,8``): ``foundry tp-leader --world-size N`` and N-1
   ``foundry tp-worker`` processes on 127.0.0.1, each rank ``--threads T/N`` pinned to its own
   T/N cores (``sched_setaffinity``), gates over TCP (chunked, the services'; the slab for N = 2),
   speculative decoding off (``--spare K``: T/N - K threads a rank on its T/N cores, the rest
   left to the rank's other threads). Decode tokens/s (the first token's time, the prompt's,
   left out) over the one process's, and whether the tokens equal its.
3. **one rank slowed** (``--slowed N``, 0 to skip): a world of N whose last rank runs on one
   core and one thread while the others keep T/N; once with equal shares, once with
   ``--shares auto`` (each rank's calibration measured at pairing): tokens/s of auto over
   equal, and the shares the leader chose (from its log).

4. **N machines, projected** (``--gate-us N:US,...`` with ``--llama-cpp``): each rank's slice
   of a world of N timed alone on its T/N cores, one rank after the other (its layers, its
   head block, each gate handing back its own partial: the rank's work without a peer), plus
   2 x n_layer gates a token at US microseconds each, the exchange of N ranks measured on a
   shaped link (``tp_world_gates.py --rate 1gbit --n-embd``), against ``llama-bench -t T/N``:
   one machine's llama.cpp against N such machines. ``--slice-rounds K`` times each slice K
   times, the ranks interleaved, and projects from each rank's median.

With ``--rate 1gbit`` (as root; ``--ip``/``--tc`` or ``FOUNDRY_IP``/``FOUNDRY_TC`` name the
tools) each rank of 2. and 3. runs in a network namespace of its own behind one bridge, its port
tbf-shaped both ways (``lan_net.Network``; ``--burst-bytes`` paces it in one-frame segments as
``tp_world_gates.py`` does), so every gate crosses a shaped port; the one process and the
slices of 4. need no network.

On one host the ranks share its memory bus: 2. is the cost of the split on one machine, 4. a
projection to N machines from measured parts (docs/benchmarks.md says which figure is which).
``--llama-3b`` takes a Llama-3.2-3B-shaped file of random weights (``random_gguf.py``), and
``--llama-cpp`` adds llama.cpp's decode of the same file with all the threads and with each
world's threads a rank.

The model: ``--model FILE``, or by default a file of ``--preset``'s shapes in Q4_K_M's types
(Q4_K, Q6_K for the output head, attn_v and ffn_down; attn_output in Q4_0, a 32-value block,
because a Q4_K column cut by 8 ranks would fall inside its 256-value blocks), its blocks filled
from a fixed seed with scales that keep the weights near 0.02 (the decode speed depends on the
types and shapes, not the values; writing the bench preset through our reference K-quant
writers takes longer than a device command may run), written to ``--model-dir`` once.

    OPENBLAS_NUM_THREADS=1 python bench/performance/tp_world_decode.py [--model FILE]
        [--preset bench] [--threads 16] [--worlds 2,4,8] [--tokens 32] [--slowed 4]
        [--timeout S] [--llama-3b] [--llama-cpp BUILD/bin [--gate-us 2:US,4:US]]
        [--rate 1gbit [--burst-bytes 3028]] [--no-shm] [--json PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import multiprocessing
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
from kernels import llama_bench_prompt_and_decode
from lan_net import Network, add_shaped_flags
from random_gguf import llama_3b_q4_k_m
from tp import generate
from tp_link import enter_netns

from foundry.model.formats.gguf_io import save_gguf
from foundry.model.formats.gguf_meta import read_metadata
from foundry.model.kernels.quant import Param, QTensor, QType, row_bytes
from foundry.model.spec.config import ModelConfig, preset
from foundry.model.text.vocab import load_tokenizer
from foundry.wire import frontend as fw

PROMPT = "Every rank of the world holds its slice of each layer. "
LEADER_LINE = re.compile(r"tp-leader listening: workers [\d.]+:(\d+), frontend [\d.]+:(\d+)")
CHOSEN = re.compile(r"the world of \d+ ranks: shares ([\d,]+) from")
STARTUP_S = 300.0
# Each stored type's scale fields (byte offset of the f16 d, and of dmin where there is one)
# and the value they get: weights of magnitude about 0.02 whatever the seeded bytes are.
SCALES: dict[QType, tuple[tuple[int, float], ...]] = {
    QType.Q4_K: ((0, 1e-4), (2, 3e-4)),
    QType.Q6_K: ((208, 2e-5),),
    QType.Q4_0: ((0, 5e-3),),
    QType.Q8_0: ((0, 3e-4),),
}
BLOCK_BYTES = {QType.Q4_K: 144, QType.Q6_K: 210, QType.Q4_0: 18, QType.Q8_0: 34}
BLOCK_VALUES = {QType.Q4_K: 256, QType.Q6_K: 256, QType.Q4_0: 32, QType.Q8_0: 32}


def q4_k_m_type(name: str, cols: int) -> QType | None:
    """The stored type of a matrix in the synthetic Q4_K_M-typed file (None: float32)."""
    want = (
        QType.Q6_K
        if name == "output.weight" or ".attn_v." in name or ".ffn_down" in name
        else QType.Q4_0
        if ".attn_output." in name
        else QType.Q4_K
    )
    for qtype in (want, QType.Q8_0):
        if cols % BLOCK_VALUES[qtype] == 0:
            return qtype
    return None


def synthetic(qtype: QType, shape: tuple[int, ...], rng: np.random.Generator) -> QTensor:
    data = rng.integers(0, 256, size=(*shape[:-1], row_bytes(qtype, shape[-1])), dtype=np.uint8)
    blocks = data.reshape(-1, BLOCK_BYTES[qtype])
    for offset, value in SCALES[qtype]:
        blocks[:, offset : offset + 2] = np.array([value], np.float16).view(np.uint8)
    return QTensor(qtype, shape, data)


def write_model(cfg: ModelConfig, path: Path) -> None:
    rng = np.random.default_rng(0)
    params: dict[str, Param] = {}
    for name, shape in cfg.param_shapes().items():
        qtype = None if len(shape) == 1 or "ffn_gate_inp" in name else q4_k_m_type(name, shape[-1])
        if qtype is not None:
            params[name] = synthetic(qtype, shape, rng)
        elif len(shape) == 1:
            params[name] = np.ones(shape, np.float32)
        else:
            params[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    save_gguf(path, cfg, params)


def one_process(
    model: Path, threads: int, tokens: int, part: tuple[int, int] | None = None, first: int = 0
) -> dict[str, object]:
    """The baseline, in a child process of its own (``--one``) pinned to ``threads`` cores
    from ``first``: JSON on stdout. With ``part`` (rank, world), that rank's slice alone."""
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one",
            str(model),
            "--threads",
            str(threads),
            "--tokens",
            str(tokens),
            *(["--slice", f"{part[0]}/{part[1]}"] if part is not None else []),
        ],
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
        preexec_fn=lambda: os.sched_setaffinity(0, cores(first, threads)),
    )
    if out.returncode:
        raise SystemExit(f"the one process failed:\n{out.stderr}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_slice(model: Path, threads: int, tokens: int, rank: int, world: int) -> None:
    """Rank ``rank`` of ``world``'s slice alone: its layers and its gates' partials with no
    peer (each gate returns the rank's own partial), greedy over its block of the vocabulary.
    The values are not the model's; the work per token is the rank's."""
    from foundry.model.formats.gguf_io import load_gguf_stored
    from foundry.model.infer.inference import Engine

    m = load_gguf_stored(model)
    engine = Engine(m.cfg, m.params, rank=rank, world=world, threads=threads)
    del m

    def alone(layer: int, gate: object, partial: np.ndarray) -> np.ndarray:
        return partial

    s = engine.new_session()
    last = int(np.argmax(engine.decode(s, [1, 2, 3, 4], exchange=alone)[-1]))
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        last = int(np.argmax(engine.decode(s, [last], exchange=alone)[-1]))
    print(json.dumps({"tokens_per_s": (tokens - 1) / (time.perf_counter() - t0)}))


def project(
    model: Path,
    threads: int,
    tokens: int,
    world: int,
    gate_us: float,
    n_layer: int,
    rounds: int = 1,
) -> tuple[list[float], float, list[list[float]]]:
    """N machines projected from measured parts: each rank's slice timed alone on its share
    of the cores (one after the other, so no two share the memory bus), plus 2 gates a layer
    at ``gate_us`` each (the exchange measured on a shaped link: ``tp_world_gates.py``).
    ``rounds``: every rank's slice timed that many times, the ranks interleaved (rank 0, 1,
    ..., then again), each rank's median taken. Returns the medians, the projected tokens/s
    and every round's figures."""
    each = max(1, threads // world)
    runs: list[list[float]] = [[] for _ in range(world)]
    for _ in range(rounds):
        for r in range(world):
            out = one_process(model, each, tokens, (r, world), r * each)
            runs[r].append(float(str(out["tokens_per_s"])))
    alone = [float(np.median(v)) for v in runs]
    token_s = max(1 / t for t in alone) + 2 * n_layer * gate_us * 1e-6
    return alone, 1 / token_s, runs


def run_one(model: Path, threads: int, tokens: int) -> None:
    from foundry.model.formats.gguf_io import load_gguf_stored
    from foundry.model.infer.inference import Engine
    from foundry.model.infer.sampling import sample
    from foundry.model.kernels.quant import set_threads

    set_threads(threads)
    tok = load_tokenizer(read_metadata(model))
    m = load_gguf_stored(model)
    engine = Engine(m.cfg, m.params)
    s = engine.new_session()
    out = [sample(engine.decode(s, [int(t) for t in tok.encode(PROMPT)])[-1], 0.0)]
    t0 = time.perf_counter()
    while len(out) < tokens and out[-1] not in tok.eog_ids:
        out.append(sample(engine.decode(s, [out[-1]])[-1], 0.0))
    rate = (len(out) - 1) / (time.perf_counter() - t0)
    print(json.dumps({"tokens": out, "tokens_per_s": rate}))


def cores(first: int, n: int) -> set[int]:
    have = sorted(os.sched_getaffinity(0))
    return {have[(first + i) % len(have)] for i in range(n)}


def in_netns(ns: str | None, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` from inside the network namespace ``ns`` (a forked child that enters it),
    or here when ``ns`` is None."""
    if ns is None:
        return fn(*args)
    ctx = multiprocessing.get_context("fork")
    out: Any = ctx.Queue()

    def child() -> None:
        enter_netns(f"/var/run/netns/{ns}")
        try:
            out.put((True, fn(*args)))
        except BaseException as exc:  # handed to the parent, which raises
            out.put((False, repr(exc)))

    proc = ctx.Process(target=child)
    proc.start()
    ok, value = out.get(timeout=STARTUP_S)
    proc.join(30)
    if not ok:
        raise SystemExit(f"in namespace {ns}: {value}")
    return value


def world_status(frontend: int) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
    """(whether the world formed, each rank's share, the mean microseconds the leader waited
    at a gate for each rank's partial beyond its own) from the leader's STATUS."""
    with socket.create_connection(("127.0.0.1", frontend), timeout=30) as s:
        s.sendall(fw.encode(fw.StatusReq(0)))
        decoder = fw.FrontendDecoder()
        while (frame := decoder.next_event()) is None:
            decoder.feed(s.recv(65536))
    if isinstance(frame, fw.Status) and frame.worker_connected:
        return True, tuple(r.share for r in frame.ranks), tuple(r.gate_wait_us for r in frame.ranks)
    return False, (), ()


class World:
    """A leader and N-1 workers as processes; ``threads[r]`` kernel threads for rank r, pinned
    to ``pin[r]`` cores of their own (default: as many as its threads). With a shaped ``net``
    each rank runs in namespace r behind its tbf-shaped port (``lan_net.Network``), and the
    client reaches the leader's frontend from inside the leader's namespace."""

    def __init__(
        self,
        model: Path,
        threads: Sequence[int],
        work: Path,
        timeout: float,
        *leader_args: str,
        pin: Sequence[int] | None = None,
        net: Network | None = None,
        no_shm: bool = False,
    ) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = [work / f"rank{r}.log" for r in range(len(threads))]
        self.net = net if net is not None and net.shaped else None
        pin = threads if pin is None else pin
        starts = [sum(pin[:r]) for r in range(len(threads))]
        common = ["--model", str(model), "--gate-timeout", str(timeout)]
        common += ["--no-shm"] if no_shm else []
        self._spawn(
            0,
            [
                "tp-leader",
                *common,
                "--world-size",
                str(len(threads)),
                "--listen",
                f"{self._addr(0)}:0",
                "--frontend-listen",
                "127.0.0.1:0",
                "--spec-mode",
                "off",
                "--threads",
                str(threads[0]),
                *leader_args,
            ],
            cores(0, pin[0]),
        )
        m = self._wait(LEADER_LINE, 0)
        port, self.frontend = int(m.group(1)), int(m.group(2))
        for r in range(1, len(threads)):
            self._spawn(
                r,
                [
                    "tp-worker",
                    *common,
                    "--leader",
                    f"{self._addr(0)}:{port}",
                    "--rank",
                    str(r),
                    "--threads",
                    str(threads[r]),
                    "--gate-listen",
                    f"{self._addr(r)}:0",
                ],
                cores(starts[r], pin[r]),
            )
        self._paired()

    def _addr(self, r: int) -> str:
        return "127.0.0.1" if self.net is None else self.net.addr(r)

    def _ns(self) -> str | None:
        return None if self.net is None else self.net.ns(0)

    def _spawn(self, r: int, args: list[str], pinned: set[int]) -> None:
        prefix = [] if self.net is None else self.net.prefix_argv(r)
        with open(self.logs[r], "wb") as log:
            self.procs.append(
                subprocess.Popen(
                    [*prefix, sys.executable, "-m", "foundry", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=lambda: os.sched_setaffinity(0, pinned),
                )
            )

    def text(self, r: int) -> str:
        return self.logs[r].read_text(errors="replace")

    def _wait(self, pattern: re.Pattern[str], r: int) -> re.Match[str]:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if (m := pattern.search(self.text(r))) is not None:
                return m
            if self.procs[r].poll() is not None:
                raise SystemExit(f"rank {r} exited:\n{self.text(r)[-2000:]}")
            time.sleep(0.1)
        raise SystemExit(f"rank {r}: no {pattern.pattern!r} within {STARTUP_S:g} s")

    def _paired(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            for r, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise SystemExit(f"rank {r} exited:\n{self.text(r)[-2000:]}")
            formed, shares, _ = in_netns(self._ns(), world_status, self.frontend)
            if formed:
                self.shares = shares
                return
            time.sleep(0.2)
        raise SystemExit(f"the world did not form within {STARTUP_S:g} s")

    def decode(self, tokens: int) -> tuple[list[int], float]:
        out, times = in_netns(self._ns(), generate, self.frontend, PROMPT, tokens)
        return out, (len(times) - 1) / (times[-1] - times[0])

    def gate_waits(self) -> tuple[int, ...]:
        """Each rank's mean wait at a gate as the leader's STATUS reports it (us)."""
        return in_netns(self._ns(), world_status, self.frontend)[2]

    def close(self) -> None:
        self.procs[0].send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def measure(
    model: Path,
    threads: Sequence[int],
    work: Path,
    timeout: float,
    tokens: int,
    *leader_args: str,
    pin: Sequence[int] | None = None,
    net: Network | None = None,
    no_shm: bool = False,
) -> dict[str, object]:
    world = World(model, threads, work, timeout, *leader_args, pin=pin, net=net, no_shm=no_shm)
    try:
        out, rate = world.decode(tokens)
        chosen = CHOSEN.search(world.text(0))
        waits = world.gate_waits()
        return {
            "tokens": out,
            "tokens_per_s": rate,
            "shares": list(world.shares),
            "gate_wait_us": list(waits),
            "chosen": chosen.group(1) if chosen else None,
        }
    finally:
        world.close()


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: synthetic)")
    ap.add_argument("--preset", default="bench", help="the synthetic file's shapes")
    ap.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--threads", type=int, default=16, help="the host's threads, divided")
    ap.add_argument("--worlds", default="2,4,8", help="world sizes besides one process")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument(
        "--slowed",
        type=int,
        default=4,
        help="the world with one rank slowed, equal shares against auto (0: skip)",
    )
    ap.add_argument("--timeout", type=float, default=30.0, help="the ranks' gate timeout")
    ap.add_argument(
        "--spare",
        type=int,
        default=0,
        help="cores of its share each rank leaves to its other threads: a rank of a world "
        "of N runs THREADS/N - SPARE kernel threads pinned to THREADS/N cores (default 0)",
    )
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        default=None,
        help="llama.cpp's build folder: llama-bench decodes the same file with all "
        "--threads, and with each world's threads a rank, in the same run",
    )
    ap.add_argument(
        "--llama-3b",
        action="store_true",
        help="the model: a Llama-3.2-3B-shaped file of random weights in Q4_K_M, "
        "written into --model-dir once (needs --llama-cpp)",
    )
    ap.add_argument(
        "--gate-us",
        default="",
        metavar="N:US,...",
        help="project N machines (needs --llama-cpp): each rank's slice timed alone, plus "
        "2 gates a layer at US microseconds each, the exchange of N ranks measured on a "
        "shaped link (tp_world_gates.py --rate), e.g. 2:210,4:900",
    )
    ap.add_argument(
        "--slice-rounds",
        type=int,
        default=1,
        help="with --gate-us: time each rank's slice this many times, the ranks interleaved, "
        "and project from each rank's median (default 1)",
    )
    ap.add_argument(
        "--no-shm",
        action="store_true",
        help="a pair (N = 2) swaps its gates over TCP, as on two machines, instead of the "
        "shared-memory slab one host gives it (the ranks' --no-shm)",
    )
    add_shaped_flags(ap)
    ap.add_argument("--one", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--slice", default=None, help=argparse.SUPPRESS)
    harness.add_json_flag(ap)
    a = ap.parse_args()
    if a.one is not None:
        if a.slice is not None:
            rank, world = (int(v) for v in a.slice.split("/"))
            run_slice(a.one, a.threads, a.tokens, rank, world)
        else:
            run_one(a.one, a.threads, a.tokens)
        return 0
    gate_us = {int(n): float(us) for n, us in (kv.split(":") for kv in a.gate_us.split(",") if kv)}
    if gate_us and a.llama_cpp is None:
        raise SystemExit("--gate-us projects against llama.cpp: it needs --llama-cpp")
    model = a.model
    if a.llama_3b:
        if a.llama_cpp is None:
            raise SystemExit("--llama-3b needs --llama-cpp (llama-quantize writes the file)")
        model = llama_3b_q4_k_m(a.model_dir, a.llama_cpp)
    if model is None:
        model = a.model_dir / f"foundry-world-{a.preset}-q4_k_m-synthetic.gguf"
        if not model.exists():
            t0 = time.perf_counter()
            a.model_dir.mkdir(parents=True, exist_ok=True)
            write_model(preset(a.preset), model)
            print(f"wrote {model} in {time.perf_counter() - t0:.1f} s")
    worlds = [int(w) for w in a.worlds.split(",") if w]
    net = Network(max([2, *worlds, a.slowed]), a.rate, a.ip, a.tc)
    print(
        f"{model.name}, {a.threads} threads on one host divided between the ranks, "
        f"{a.tokens} tokens greedy, 1 client"
        + (f"; each rank leaves {a.spare} of its cores spare" if a.spare else "")
        + (
            f"; the worlds' ranks each in a namespace, every port tbf-shaped to {a.rate}"
            + (f", burst {a.burst_bytes} bytes" if a.burst_bytes else "")
            if net.shaped
            else "; the worlds on loopback"
        )
    )
    net.up()
    try:
        if net.shaped and a.burst_bytes:
            net.pace(a.burst_bytes)
        return run_worlds(a, model, worlds, gate_us, net)
    finally:
        net.down()


def run_worlds(
    a: argparse.Namespace,
    model: Path,
    worlds: list[int],
    gate_us: dict[int, float],
    net: Network,
) -> int:
    """The baseline, the worlds, the projection and the slowed world (main's measurements)."""
    base = one_process(model, a.threads, a.tokens)
    rate0 = float(str(base["tokens_per_s"]))
    results: dict[str, object] = {
        "threads": a.threads,
        "clients": 1,
        "network": a.rate,
        "burst_bytes": a.burst_bytes,
        "one_process": base,
    }
    print(f"{'ranks':>5} {'threads each':>12} {'tokens/s':>9} {'x one':>7} {'same tokens':>11}")
    print(f"{1:>5} {a.threads:>12} {rate0:>9.2f} {1.0:>7.2f} {'':>11}")
    if a.llama_cpp is not None:
        theirs = {
            t: llama_bench_prompt_and_decode(a.llama_cpp, model, 16, None, 16, t)[1]
            for t in sorted({a.threads, *(max(1, a.threads // n) for n in [*worlds, *gate_us])})
        }
        results["llama_cpp_decode"] = theirs
        print(
            "llama.cpp (llama-bench -n 64 -d 16, same file): "
            + ", ".join(f"-t {t}: {r:.2f} tokens/s" for t, r in theirs.items())
            + f"; one process {rate0 / theirs[a.threads]:.2f}x llama.cpp -t {a.threads}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        for n in worlds:
            cores_each = max(1, a.threads // n)
            each = max(1, cores_each - a.spare)
            work = Path(tmp) / f"world{n}"
            work.mkdir()
            m = measure(
                model,
                [each] * n,
                work,
                a.timeout,
                a.tokens,
                pin=[cores_each] * n,
                net=net,
                no_shm=a.no_shm,
            )
            results[f"world_{n}"] = m
            rate = float(str(m["tokens_per_s"]))
            print(
                f"{n:>5} {each:>12} {rate:>9.2f} {rate / rate0:>7.2f} "
                f"{'yes' if m['tokens'] == base['tokens'] else 'no':>11}"
                + (
                    f"  {rate / theirs[a.threads]:.2f}x llama.cpp -t {a.threads}"
                    if a.llama_cpp is not None
                    else ""
                )
            )
            waits = m["gate_wait_us"]
            assert isinstance(waits, list)
            print(
                f"      the leader's mean wait at a gate for "
                f"{'rank 1' if n == 2 else f'ranks 1-{n - 1}'}'s partials beyond "
                f"its own: {', '.join(map(str, waits[1:]))} us"
            )
        if gate_us:
            meta = read_metadata(model)
            n_layer = int(meta[f"{meta['general.architecture']}.block_count"])
            print(
                f"N machines, projected: each rank's slice alone on its threads, plus 2 x "
                f"{n_layer} gates a token at the shaped link's time, against llama.cpp with "
                f"one rank's threads"
            )
        for n, us in gate_us.items():
            each = max(1, a.threads // n)
            alone, rate, rounds = project(
                model, a.threads, a.tokens, n, us, n_layer, a.slice_rounds
            )
            results[f"projected_{n}"] = {
                "slices": alone,
                "slice_rounds": rounds,
                "gate_us": us,
                "tokens_per_s": rate,
            }
            slices = ", ".join(f"{v:.2f}" for v in alone)
            if a.slice_rounds > 1:
                every = "; ".join(
                    f"rank {r}: " + ", ".join(f"{v:.2f}" for v in got)
                    for r, got in enumerate(rounds)
                )
                print(f"  {n} machines, each slice's {a.slice_rounds} rounds: {every}")
            print(
                f"  {n} machines of {each} threads: slices alone {slices} tokens/s, gates "
                f"{us:g} us: {rate:.2f} tokens/s, {rate / theirs[each]:.2f}x llama.cpp -t {each}"
            )
        if a.slowed:
            n, each = a.slowed, max(1, a.threads // a.slowed)
            threads = [each] * (n - 1) + [1]
            runs = {}
            for label, extra in (("equal", ()), ("auto", ("--shares", "auto"))):
                work = Path(tmp) / f"slowed-{label}"
                work.mkdir()
                runs[label] = measure(model, threads, work, a.timeout, a.tokens, *extra, net=net)
            eq, auto = (float(str(runs[k]["tokens_per_s"])) for k in ("equal", "auto"))
            results["slowed"] = {"threads": threads, **runs}
            print(
                f"one rank slowed: {n} ranks of {','.join(map(str, threads))} threads; equal "
                f"shares {eq:.2f} tokens/s, --shares auto {auto:.2f} tokens/s (shares "
                f"{runs['auto']['chosen']}): auto {auto / eq:.2f}x equal; same tokens "
                f"{'yes' if runs['auto']['tokens'] == runs['equal']['tokens'] else 'no'}"
            )
    harness.emit("tp_world_decode", results, None, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
