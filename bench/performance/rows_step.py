"""A decode step of several sessions at once (a server batching concurrent clients), with the
layers' cache writes and attention in one C call against the per-session loop they replaced.

    OPENBLAS_NUM_THREADS=1 python bench/performance/rows_step.py [--gguf FILE]
        [--model-dir /tmp/pfmodels] [--rows 1,4,16] [--threads 1,2] [--prompt 32]
        [--rounds 7] [--steps 2] [--profile] [--json PATH]

The file (``--gguf``, else the bench preset exported by Foundry as Q8_0 into ``--model-dir``,
written once) gets R sessions (``--rows``) after a ``--prompt``-token prompt each; a step is
``Engine.forward_rows([(s, [token]) for s in sessions])``: R rows, one a client. Each round
times ``--steps`` steps at every thread count, every R and both ways, interleaved, so that the
ratio comes from the same run on the same (shared, noisy) machine:

- ``batched``: the engine as it is, a layer's cache writes and attention of every session in
  one call (``quant.store_attend``: a pool call of every row's kv heads);
- ``per-session``: the loop it replaced, put in its place by this script: per session two
  ``store_rows`` and an ``attend_rows`` (three calls into C, a pool call of as many tasks as
  the part's kv heads).

One session's step runs whole in C (``step_layers``) either way: R = 1 is the reference the
batch is weighed against, not a comparison. Medians of the rounds are printed, the step's time,
tokens/s (R per step) and, per round, the ratio of the two ways. ``--profile`` also times the
calls that write the caches and attend (the name ``inference`` imports, either way) and prints
their share of the step and their time a call (a layer's part, all sessions).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
import numpy.typing as npt
from engine_decode import bench_engine

from foundry.model.infer import inference
from foundry.model.infer.inference import Engine
from foundry.model.infer.kv_cache import Session
from foundry.model.kernels import quant
from foundry.model.kernels.quant import Cache

F32 = npt.NDArray[np.float32]


def per_session(
    q: F32, k_rows: F32, v_rows: F32, v_col: int, caches: Sequence[Cache], window: int, out: F32
) -> None:
    """``Engine._attention``'s loop before ``store_attend``, the same bits."""
    row = 0
    for k, v, pos, n in caches:
        quant.store_rows(k_rows[row : row + n], 0, k[pos : pos + n])
        quant.store_rows(v_rows[row : row + n], v_col, v[pos : pos + n])
        quant.attend_rows(q[row : row + n], k, v, pos, window, out[row : row + n])
        row += n


WAYS: dict[str, Callable[..., None]] = {
    "batched": quant.store_attend,
    "per-session": per_session,
}


class Timed:
    """Seconds spent in ``inference.store_attend`` (whichever way is in place) while on."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn: Callable[..., None]) -> Callable[..., None]:
        def timed(*args: Any) -> None:
            t0 = time.perf_counter()
            fn(*args)
            self.seconds += time.perf_counter() - t0
            self.calls += 1

        return timed


def step(engine: Engine, sessions: list[Session], token: int, steps: int) -> float:
    """Seconds of one step of every session (the mean of ``steps`` steps)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.forward_rows([(s, [token]) for s in sessions])
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--gguf", type=Path, default=None, help="the file (default: bench Q8_0)")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/pfmodels"))
    ap.add_argument("--rows", default="1,4,16", metavar="R,R,...", help="sessions a step")
    ap.add_argument("--threads", default="1,2", metavar="N,N,...")
    ap.add_argument("--prompt", type=int, default=32, help="tokens of each session's prompt")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2, help="steps timed a round, each way")
    ap.add_argument("--profile", action="store_true", help="time the attention calls too")
    harness.add_json_flag(ap)
    args = ap.parse_args()
    engine, path = bench_engine(args.gguf, args.model_dir)
    counts = [int(n) for n in args.threads.split(",")]
    sizes = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(1)
    ctx = args.prompt + 2 * len(counts) * len(WAYS) * args.rounds * args.steps + 2
    batches: dict[int, list[Session]] = {}
    quant.set_threads(counts[-1])
    for r in sizes:
        batches[r] = [engine.new_session(ctx) for _ in range(r)]
        for s in batches[r]:  # each its own prompt, as clients' are
            engine.decode(s, [int(t) for t in rng.integers(3, engine.cfg.n_vocab, args.prompt)])
    print(
        f"{path.name}: steps of R sessions one token each after a {args.prompt}-token prompt, "
        f"R {args.rows}, kernels {quant.KERNELS}, threads {args.threads}, {args.rounds} rounds "
        f"of {args.steps} steps each way",
        flush=True,
    )
    token = 5
    walls: dict[tuple[int, int, str], list[float]] = {}
    shares: dict[tuple[int, int, str], list[float]] = {}
    per_call: dict[tuple[int, int, str], list[float]] = {}
    saved = vars(inference)["store_attend"]
    try:
        for _ in range(args.rounds):
            for n in counts:
                quant.set_threads(n)
                for r in sizes:
                    for way, fn in WAYS.items():
                        timer = Timed()
                        vars(inference)["store_attend"] = timer.wrap(fn) if args.profile else fn
                        wall = step(engine, batches[r], token, args.steps)
                        walls.setdefault((n, r, way), []).append(wall)
                        shares.setdefault((n, r, way), []).append(timer.seconds / args.steps / wall)
                        per_call.setdefault((n, r, way), []).append(
                            timer.seconds / max(timer.calls, 1)
                        )
    finally:
        vars(inference)["store_attend"] = saved
    results: dict[str, Any] = {}
    for n in counts:
        for r in sizes:
            new, old = walls[(n, r, "batched")], walls[(n, r, "per-session")]
            line = f"  {n:>2} threads, R {r:>3}:"
            for way, series in (("batched", new), ("per-session", old)):
                wall = harness.median(series)
                line += f"  {way} {wall * 1e3:7.2f} ms ({r / wall:7.1f} tokens/s"
                if args.profile:
                    call = harness.median(per_call[(n, r, way)])
                    line += f", attention {harness.median(shares[(n, r, way)]):5.1%}"
                    line += f", {call * 1e6:5.0f} us a layer's part"
                    results[f"{way}_attention_us_t{n}_r{r}"] = round(call * 1e6, 1)
                line += ")"
                results[f"{way}_ms_t{n}_r{r}"] = round(wall * 1e3, 3)
            ratio = harness.median_ratio(old, new)
            results[f"speedup_t{n}_r{r}"] = round(ratio, 3)
            print(f"{line}  batched {ratio:.2f}x per-session (median of rounds)", flush=True)
    harness.emit("rows_step", results, None, args.json)


if __name__ == "__main__":
    main()
