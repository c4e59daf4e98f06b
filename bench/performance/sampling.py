"""The leader's sampling of a batch: the C sampler (``kernels/csrc/sample.c``, the rows of a step
in one call, a row a task on the kernels' threads) against the numpy draw it replaced (row after
row in Python: ``sampling._draw_numpy``, what a build without the C kernels still runs).

    OPENBLAS_NUM_THREADS=1 python bench/performance/sampling.py [--rows 16] [--threads 1,8]
        [--vocab 259,128256,262144] [--rounds 7] [--json PATH]

For each vocabulary size: ``--rows`` rows of random logits (a normal, scaled so that the draw
spreads over many tokens), each its own request's draw at temperature 0.8 (top_p 1, then 0.95,
then top_k 40), every row seeded alike on both sides. Prints the median over the rounds of the
milliseconds a batch takes, numpy and C at each thread count, and the ratio (numpy over C:
above 1 the C sampler is faster), interleaved round by round. The two draw the same
distribution in different roundings, so their tokens may differ; the C sampler's tokens must
be the same at every thread count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np

from foundry.model.infer.sampling import _draw_numpy, make_rng, sample_rows
from foundry.model.kernels import quant

SETTINGS = ((1.0, 0), (0.95, 0), (1.0, 40))  # (top_p, top_k) at temperature 0.8


def numpy_batch(logits: np.ndarray, top_p: float, top_k: int) -> list[object]:
    return [
        _draw_numpy(row, 0.8, top_p, make_rng(i).random(), top_k) for i, row in enumerate(logits)
    ]


def c_batch(logits: np.ndarray, top_p: float, top_k: int) -> list[object]:
    return list(
        sample_rows([(row, 0.8, top_p, make_rng(i), top_k) for i, row in enumerate(logits)])
    )


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="rows of a batch (default 16)")
    ap.add_argument("--threads", default="1,8", help="the C sampler's thread counts (default 1,8)")
    ap.add_argument("--vocab", default="259,128256,262144", help="vocabulary sizes")
    ap.add_argument("--rounds", type=int, default=7)
    harness.add_json_flag(ap)
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    results: dict[str, object] = {"rows": args.rows, "threads": counts}
    ok = True
    print(
        f"{args.rows} rows a batch, temperature 0.8; ms a batch, median of {args.rounds} rounds; "
        "numpy row by row against the C sampler at each thread count"
    )
    print(" vocabulary  top_p top_k    numpy" + "".join(f"  C {t:2d} thr   ratio" for t in counts))
    for vocab in (int(v) for v in args.vocab.split(",")):
        logits = (3 * np.random.default_rng(vocab).standard_normal((args.rows, vocab))).astype(
            np.float32
        )
        for top_p, top_k in SETTINGS:
            times: dict[int, list[float]] = {t: [] for t in counts}
            slow: list[float] = []
            tokens: dict[int, list[object]] = {}
            for _ in range(args.rounds):
                slow.append(harness.timed(lambda: numpy_batch(logits, top_p, top_k)))  # noqa: B023
                for t in counts:
                    quant.set_threads(t)
                    times[t].append(harness.timed(lambda: c_batch(logits, top_p, top_k)))  # noqa: B023
                    tokens[t] = c_batch(logits, top_p, top_k)
            quant.set_threads(1)
            same = all(tokens[t] == tokens[counts[0]] for t in counts)
            ok = ok and same
            row = {"numpy_ms": 1e3 * harness.median(slow), "same_tokens": same}
            line = f" {vocab:10d} {top_p:6.2f} {top_k:5d} {row['numpy_ms']:8.2f}"
            for t in counts:
                ms, r = 1e3 * harness.median(times[t]), harness.median_ratio(slow, times[t])
                row[f"c_{t}_ms"], row[f"ratio_{t}"] = ms, r
                line += f"  {ms:8.2f} {r:6.1f}x"
            print(line + ("" if same else "  TOKENS DIFFER ACROSS THREAD COUNTS"))
            results[f"{vocab}_top_p_{top_p}_top_k_{top_k}"] = row
    harness.emit("sampling", results, ok, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
