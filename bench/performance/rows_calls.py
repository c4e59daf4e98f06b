"""Where a step of R sessions goes, call by call: every kernels call of the engine's layer loop
timed by name, for rank 0 of a world of N ranks at T threads against one process of the whole
file at the threads of all the ranks, in the same run.

    OPENBLAS_NUM_THREADS=1 python bench/performance/rows_calls.py --gguf FILE
        [--world 2] [--threads 8] [--rows 1,16] [--steps 20] [--json PATH]

Rank 0 is loaded as the services load it (``load_rank``) and steps with an exchange that hands
its partial back at once: the rank's own work, without the peer's. The one process holds every
rank's slices and runs at ``world x threads`` threads: the baseline, the same step on the same
cores without the split. Each of R sessions gets a 32-token prompt of its own, then ``--steps``
steps of one token each are timed (after two untimed). Every function the layer loop takes
from ``kernels.quant`` (in ``infer.inference`` and ``infer.parts``) is wrapped by a timer for
the run; products are keyed by their matrix's type and shape, the output head's apart. What the
timers do not hold ("untracked") is the Python and numpy between the calls; the timers add
about a microsecond a call, counted in the calls' time. R = 1 runs the one-token C step (one
``step_layers`` call), so its calls are that and the head.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np

from foundry.model.infer import inference, parts
from foundry.model.infer.engines import make_engine
from foundry.model.infer.inference import Engine
from foundry.model.kernels import quant
from foundry.model.shard.table import Gate
from foundry.tp.handshake import load_rank

PROMPT = 32
CTX = 256


class Calls:
    """The seconds and count of each kernels call while installed (``install``/``remove``)."""

    def __init__(self, vocab_rows: int) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.count: Counter[str] = Counter()
        self.vocab_rows = vocab_rows  # a product of at least half as many rows: the head
        self.saved: list[tuple[Any, str, Any]] = []

    def key(self, name: str, args: tuple[Any, ...]) -> str:
        if name != "linear":
            return name
        w = args[1]
        if w.shape[0] * 2 >= self.vocab_rows:
            return "linear: the head"
        kind = getattr(getattr(w, "qtype", None), "name", "F32")
        return f"linear: {kind} {w.shape[0]}x{w.shape[1]}"

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            k = self.key(name, args)
            self.seconds[k] += time.perf_counter() - t0
            self.count[k] += 1
            return out

        return timed

    def install(self) -> None:
        for mod in (inference, parts):
            for name, obj in list(vars(mod).items()):
                if callable(obj) and not isinstance(obj, type) and obj.__module__ == quant.__name__:
                    self.saved.append((mod, name, obj))
                    setattr(mod, name, self.wrap(name, obj))

    def remove(self) -> None:
        for mod, name, obj in self.saved:
            setattr(mod, name, obj)
        self.saved.clear()

    def clear(self) -> None:
        self.seconds.clear()
        self.count.clear()


def echo(layer: int, gate: Gate, partial: np.ndarray) -> np.ndarray:
    """An exchange whose peers added nothing: the partial back."""
    return partial


def steps(engine: Engine, rows: int, n: int, calls: Calls, rng: np.random.Generator) -> float:
    """Seconds a step of ``rows`` sessions (the mean of ``n``), ``calls`` holding its calls'."""
    xch = echo if engine.world > 1 else None
    sessions = [engine.new_session(CTX) for _ in range(rows)]
    for s in sessions:
        prompt = [int(t) for t in rng.integers(3, min(engine.cfg.n_vocab, 1000), PROMPT)]
        engine.forward_rows([(s, prompt)], xch, last_only=True)
    for _ in range(2):
        engine.forward_rows([(s, [5]) for s in sessions], xch)
    calls.clear()
    t0 = time.perf_counter()
    for _ in range(n):
        engine.forward_rows([(s, [5]) for s in sessions], xch)
    return (time.perf_counter() - t0) / n


def report(label: str, wall: float, rows: int, calls: Calls, n: int) -> dict[str, float]:
    tracked = sum(calls.seconds.values()) / n
    print(
        f"{label}, R {rows}: {wall * 1e3:.2f} ms a step ({rows / wall:.0f} tokens/s); "
        f"untracked (Python, numpy) {(wall - tracked) * 1e3:.2f} ms ({(wall - tracked) / wall:.0%})"
    )
    out = {"step_ms": round(wall * 1e3, 3), "untracked_ms": round((wall - tracked) * 1e3, 3)}
    for k, s in sorted(calls.seconds.items(), key=lambda kv: -kv[1]):
        each = calls.count[k] // n
        print(
            f"    {k:28s} {s / n * 1e3:7.3f} ms {s / n / wall:5.1%}  {each:4d} calls "
            f"{s / calls.count[k] * 1e6:7.1f} us a call"
        )
        out[k] = round(s / n * 1e3, 3)
    return out


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--gguf", type=Path, required=True, help="a file stored in blocks")
    ap.add_argument("--world", type=int, default=2, help="ranks of the world rank 0 is cut for")
    ap.add_argument("--threads", type=int, default=8, help="rank 0's threads")
    ap.add_argument("--rows", default="1,16", metavar="R,R,...", help="sessions a step")
    ap.add_argument("--steps", type=int, default=20, help="steps timed at each R")
    harness.add_json_flag(ap)
    a = ap.parse_args()
    rank = load_rank(a.gguf, 0, CTX, world=a.world)
    ranked = make_engine(rank.cfg, rank.weights, rank=0, world=a.world, ctx_size=CTX)
    whole = load_rank(a.gguf, 0, CTX, world=1)
    one = make_engine(whole.cfg, whole.weights, rank=0, world=1, ctx_size=CTX)
    assert isinstance(ranked, Engine) and isinstance(one, Engine)
    print(
        f"{a.gguf.name}: rank 0 of {a.world} at {a.threads} threads against one process at "
        f"{a.world * a.threads}, kernels {quant.KERNELS}, {a.steps} steps a size after a "
        f"{PROMPT}-token prompt each",
        flush=True,
    )
    calls = Calls(rank.cfg.n_vocab)
    results: dict[str, Any] = {}
    calls.install()
    try:
        for r in (int(v) for v in a.rows.split(",")):
            quant.set_threads(a.threads)
            wall = steps(ranked, r, a.steps, calls, np.random.default_rng(r))
            results[f"rank_r{r}"] = report(f"rank 0 of {a.world}", wall, r, calls, a.steps)
            quant.set_threads(a.world * a.threads)
            base = steps(one, r, a.steps, calls, np.random.default_rng(r))
            results[f"one_r{r}"] = report("one process", base, r, calls, a.steps)
            print(
                f"  R {r}: rank 0's step {wall * 1e3:.2f} ms, {base / wall:.2f}x the one "
                f"process's speed ({base * 1e3:.2f} ms)",
                flush=True,
            )
    finally:
        calls.remove()
    harness.emit("rows_calls", results, None, a.json)


if __name__ == "__main__":
    main()
