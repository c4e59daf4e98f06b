"""Where a prompt's prefill time goes, and how it scales with the kernels' threads.

    OPENBLAS_NUM_THREADS=1 python bench/performance/prefill.py [--gguf FILE]
        [--model-dir /tmp/pfmodels] [--prompt 512] [--threads 1,2] [--rounds 5]
        [--pooled linear,attend_rows] [--against avx512-vnni]

The file (``--gguf``, else the bench preset exported by Foundry as Q8_0 into ``--model-dir``,
written once) runs a ``--prompt``-token block in the engine (``Engine.decode(...,
last_only=True)``, as ``engine.py --gguf`` times it), ``--rounds`` times at each thread count,
the counts interleaved round by round, so that the ratio to the first count comes from the
same run on the same (shared, noisy) machine; medians printed.

At the first count each operation the engine calls is timed (two clock reads a call, wrapped
around the names ``inference`` and ``parts`` import from ``quant``): those the C module splits
over the pool (the products, attention, and the row operations: norms, rotation, routing,
SiLU x up, the experts' inputs and combination, the KV-cache writes, the sums) and the rest, the
engine's own numpy and Python. At every count above 1 the pool's counters
(``quant.profile``: PROF_POOL, csrc/kernels.h) say how much of the prefill ran inside pool
calls; what is left ran on one thread: the serial fraction that caps the scaling (Amdahl).
``--against PATH``: each round also one prefill at each count on that kernel path
(``quant._kernels.use``), its median time over ours.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
from engine_decode import bench_engine

from foundry.model.infer import inference, parts
from foundry.model.infer.inference import Engine
from foundry.model.kernels import quant

OPS = {
    inference: (
        "linear",
        "attend_rows",
        "store_attend",
        "rmsnorm",
        "rope",
        "route",
        "assign_experts",
        "combine_experts",
        "embed",
        "store_rows",
        "take_rows",
        "add",
    ),
    parts: ("linear", "linear_groups", "swiglu", "geglu", "add"),
}
"""The operations timed at the first count (a name a module does not import is skipped)."""

POOLED = {"linear", "attend_rows", "rmsnorm", "rope", "route", "combine_experts", "swiglu"}
POOLED |= {"linear_groups", "geglu", "store_rows", "take_rows", "add", "store_attend"}
"""Those the C module splits over the pool when a block of rows calls them."""


class OpTimes:
    """Seconds spent in each of ``OPS`` while entered."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._saved = {
            (module, n): vars(module)[n]
            for module, names in OPS.items()
            for n in names
            if n in vars(module)
        }

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            return out

        return timed

    def __enter__(self) -> OpTimes:
        self.seconds.clear()
        for (module, n), fn in self._saved.items():
            vars(module)[n] = self._timed(n, fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for (module, n), fn in self._saved.items():
            vars(module)[n] = fn


def prefill(engine: Engine, prompt: list[int]) -> float:
    """Seconds of one prefill of ``prompt`` in a new session."""
    s = engine.new_session(len(prompt) + 1)
    t0 = time.perf_counter()
    engine.decode(s, prompt, last_only=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--gguf", type=Path, default=None, help="the file (default: bench Q8_0)")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/pfmodels"))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--threads", default="1,2", metavar="N,N,...")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--pooled",
        default=",".join(sorted(POOLED)),
        metavar="NAME,...",
        help="the operations that run on the pool (default: this tree's; the engine before "
        "its row operations went to the pool: linear,attend_rows)",
    )
    ap.add_argument("--against", default=None, help="also time this kernel path, e.g. avx512-vnni")
    args = ap.parse_args()
    pooled_ops = set(args.pooled.split(","))
    engine, path = bench_engine(args.gguf, args.model_dir)
    counts = [int(n) for n in args.threads.split(",")]
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, engine.cfg.n_vocab, args.prompt)]
    print(
        f"{path.name}: a {args.prompt}-token prompt as one block, kernels {quant.KERNELS}, "
        f"threads {args.threads}, {args.rounds} rounds, one client",
        flush=True,
    )
    quant.set_threads(counts[0])
    prefill(engine, prompt[:32])  # weights paged in
    walls: dict[int, list[float]] = {n: [] for n in counts}
    ops: list[dict[str, float]] = []
    in_pool: dict[int, list[float]] = {n: [] for n in counts}
    against: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.rounds):
        for n in counts:
            quant.set_threads(n)
            if n == counts[0]:
                with OpTimes() as timed:
                    walls[n].append(prefill(engine, prompt))
                ops.append(dict(timed.seconds))
            quant.profile(True)
            wall = prefill(engine, prompt)
            pool_ns = quant.profile(False).get("pool", (0, 0))[0]
            if n != counts[0]:
                walls[n].append(wall)
            in_pool[n].append(pool_ns / 1e9 / wall)
            if args.against is not None and quant._kernels is not None:
                quant._kernels.use(args.against)
                against[n].append(prefill(engine, prompt))
                quant._kernels.use("best")
    base = harness.median(walls[counts[0]])
    names = sorted(
        {k for o in ops for k in o}, key=lambda k: -harness.median([o.get(k, 0.0) for o in ops])
    )
    med = {k: harness.median([o.get(k, 0.0) for o in ops]) for k in names}
    timed_walls = walls[counts[0]]
    # each round's own remainder, then the median (medians of parts do not add up)
    rest = harness.median([w - sum(o.values()) for w, o in zip(timed_walls, ops, strict=True)])
    serial = harness.median(
        [
            (w - sum(v for k, v in o.items() if k in pooled_ops)) / w
            for w, o in zip(timed_walls, ops, strict=True)
        ]
    )
    print(f"  {counts[0]} thread(s), a prefill {base * 1e3:.1f} ms (median; operations timed):")
    for k in names:
        where = "pool" if k in pooled_ops else "serial"
        print(f"    {k:<16} {med[k] * 1e3:8.1f} ms {med[k] / base:6.1%}  {where}")
    print(f"    {'the rest':<16} {rest * 1e3:8.1f} ms {rest / base:6.1%}  serial (numpy, Python)")
    print(
        f"  outside pooled operations at {counts[0]} thread(s): {serial:.1%} of the prefill "
        f"({serial * base * 1e3:.1f} ms; the median of the rounds' shares)"
    )
    for n in counts:
        wall = harness.median(walls[n])
        share = harness.median(in_pool[n]) if n > 1 else float("nan")
        print(
            f"  {n:>2} threads: prefill {args.prompt / wall:8.1f} tokens/s "
            f"({wall * 1e3:7.1f} ms), {base / wall:.2f}x {counts[0]} thread(s); in pool calls "
            + (f"{share:.1%}, outside {1 - share:.1%}" if n > 1 else "(not counted on one thread)"),
            flush=True,
        )
        if against[n]:
            other = harness.median(against[n])
            print(
                f"      {args.against}: {other * 1e3:7.1f} ms, {other / wall:.2f}x its time",
                flush=True,
            )


if __name__ == "__main__":
    main()
