"""The leader's sampling of a batch: each row's draw one after another against the rows on a
pool of threads (``sampling.sample_rows``, as the pair's leader draws an EVAL_BATCH).

    OPENBLAS_NUM_THREADS=1 python bench/performance/sampling.py [--rows 16] [--threads 8]
        [--vocab 259,128256,262144] [--rounds 7] [--json PATH]

For each vocabulary size: ``--rows`` rows of random logits (a normal, scaled so that the draw
spreads over many tokens), each its own request's draw at temperature 0.8 (top_p 1, then 0.95),
every row seeded alike on both sides; the tokens must be equal. Prints the median over the
rounds of the milliseconds a batch takes, serial and on ``--threads`` threads, and the ratio
(serial over pooled: above 1 the pool is faster), interleaved round by round. The leader's pool
has a thread for each of its kernel threads (``--threads`` of tp-leader); rows narrower than
``PARALLEL_MIN_VOCAB`` are drawn serially by ``sample_rows`` whatever the pool.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np

from foundry.model.infer.sampling import Draw, make_rng, sample_rows


def draws(logits: np.ndarray, top_p: float) -> list[Draw]:
    return [(row, 0.8, top_p, make_rng(i), 0) for i, row in enumerate(logits)]


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="rows of a batch (default 16)")
    ap.add_argument("--threads", type=int, default=8, help="pool threads (default 8)")
    ap.add_argument("--vocab", default="259,128256,262144", help="vocabulary sizes")
    ap.add_argument("--rounds", type=int, default=7)
    harness.add_json_flag(ap)
    args = ap.parse_args()
    results: dict[str, object] = {"rows": args.rows, "threads": args.threads}
    ok = True
    print(
        f"{args.rows} rows a batch, temperature 0.8; ms a batch, median of {args.rounds} "
        f"rounds; pool of {args.threads} threads"
    )
    print(" vocabulary  top_p   serial   pooled  serial/pooled")
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        for vocab in (int(v) for v in args.vocab.split(",")):
            logits = (3 * np.random.default_rng(vocab).standard_normal((args.rows, vocab))).astype(
                np.float32
            )
            for top_p in (1.0, 0.95):
                batch = draws(logits, top_p)
                serial, pooled = [], []
                for _ in range(args.rounds):
                    serial.append(harness.timed(lambda: sample_rows(batch)))  # noqa: B023
                    pooled.append(harness.timed(lambda: sample_rows(batch, pool)))  # noqa: B023
                same = sample_rows(draws(logits, top_p)) == sample_rows(draws(logits, top_p), pool)
                ok = ok and same
                ms_s, ms_p = 1e3 * harness.median(serial), 1e3 * harness.median(pooled)
                r = harness.median_ratio(serial, pooled)
                print(
                    f" {vocab:10d} {top_p:6.2f} {ms_s:8.2f} {ms_p:8.2f} {r:10.2f}x"
                    + ("" if same else "  TOKENS DIFFER")
                )
                results[f"{vocab}_top_p_{top_p}"] = {
                    "serial_ms": ms_s,
                    "pooled_ms": ms_p,
                    "ratio": r,
                    "same_tokens": same,
                }
    harness.emit("sampling", results, ok, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
