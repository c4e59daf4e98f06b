"""A rank's one-token step: all its layers in one C call with the exchange called back at each
gate, against the layer loop it replaced (each layer's attention and FFN as separate C calls,
the norms, adds and exchange in Python between them), in the same run.

    OPENBLAS_NUM_THREADS=1 python bench/performance/rank_step.py --gguf FILE
        [--world 2] [--threads 1,2] [--rounds 7] [--tokens 16] [--json PATH]

Rank 0's slices of a world of ``--world`` ranks (``load_rank``, as the services load them)
decode ``--tokens`` tokens a round each way, interleaved, with an exchange that hands the
partial back at once (so the figure is the rank's own work: what the peer adds is the same
either way). ``layer loop`` is the engine with its one-call plan taken away for the run
(``Engine._all_whole = None``: each layer then takes the per-gate step calls). Medians of the
rounds, and the ratio (loop time over one-call time) of each round's pair.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np

from foundry.model.infer.engines import make_engine
from foundry.model.infer.inference import Engine
from foundry.model.kernels import quant
from foundry.model.shard.table import Gate
from foundry.tp.handshake import load_rank


def echo(layer: int, gate: Gate, partial: np.ndarray) -> np.ndarray:
    """An exchange whose peer added nothing: the partial back."""
    return partial


def decode(engine: Engine, tokens: int, ctx: int) -> float:
    """Seconds a token of ``tokens`` one-token steps after a 4-token prompt."""
    s = engine.new_session(ctx)
    engine.forward_rows([(s, [1, 2, 3, 4])], echo)
    t0 = time.perf_counter()
    for t in range(tokens):
        engine.forward_rows([(s, [5 + t])], echo)
    return (time.perf_counter() - t0) / tokens


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--gguf", type=Path, required=True, help="a file stored in blocks")
    ap.add_argument("--world", type=int, default=2, help="ranks of the world rank 0 is cut for")
    ap.add_argument("--threads", default="1,2", metavar="N,N,...")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=16, help="tokens a round, each way")
    harness.add_json_flag(ap)
    args = ap.parse_args()
    ctx = args.tokens + 8
    rank = load_rank(args.gguf, 0, ctx, world=args.world)
    one_call = make_engine(rank.cfg, rank.weights, rank=0, world=args.world, ctx_size=ctx)
    loop = make_engine(rank.cfg, rank.weights, rank=0, world=args.world, ctx_size=ctx)
    assert isinstance(one_call, Engine) and isinstance(loop, Engine)
    if one_call._all_whole is None:
        raise SystemExit(f"{args.gguf}: not every layer has a one-token step in C")
    loop._all_whole = None  # the layer loop, put back in its place for this run
    counts = [int(n) for n in args.threads.split(",")]
    print(
        f"{args.gguf.name}: rank 0 of {args.world}, {rank.cfg.n_layer} layers, kernels "
        f"{quant.KERNELS}, threads {args.threads}, {args.rounds} rounds of {args.tokens} "
        "tokens each way, one client",
        flush=True,
    )
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for n in counts:
            quant.set_threads(n)
            for way, engine in (("one call", one_call), ("layer loop", loop)):
                times.setdefault((n, way), []).append(decode(engine, args.tokens, ctx))
    results: dict[str, Any] = {}
    for n in counts:
        new, old = times[(n, "one call")], times[(n, "layer loop")]
        ratio = harness.median_ratio(old, new)
        print(
            f"  {n:>2} threads: one call {harness.median(new) * 1e3:7.3f} ms a token, "
            f"layer loop {harness.median(old) * 1e3:7.3f} ms: one call {ratio:.2f}x "
            "(median of rounds)",
            flush=True,
        )
        results[f"one_call_ms_t{n}"] = round(harness.median(new) * 1e3, 3)
        results[f"layer_loop_ms_t{n}"] = round(harness.median(old) * 1e3, 3)
        results[f"speedup_t{n}"] = round(ratio, 3)
    harness.emit("rank_step", results, None, args.json)


if __name__ == "__main__":
    main()
