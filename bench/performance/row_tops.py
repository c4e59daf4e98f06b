"""Load on the pair with the workers' part of each row's pick (ROW_TOPS for greedy rows,
ROW_DRAWS for sampled ones, the default) against the same load with their logits shipped in
full (``tp-leader --no-row-tops``), in one run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/performance/row_tops.py --model FILE.gguf
        [--clients 1,16] [--tokens 64] [--temperature 0] [--rank-args "--threads 8"]
        [--rounds 2] [--json PATH]

A greedy pass whose rows nobody else reads (no logprobs) asks each worker for every row's
largest logit and its index in the worker's vocabulary block (8 bytes a row) instead of the
block itself (4 bytes a token a row: 512 KiB a row of Gemma 3's 262,144-token vocabulary); the
leader combines the blocks' picks (docs/protocol.md, ROW_TOPS). A sampled pass (``--temperature
0.8``) adds one exchange in which the ranks draw each row where it lies (ROW_DRAWS: 40 bytes a
row to the worker, 24 back). The tokens are the same either way
(``tests/test_tp_service_pair.py``, ``tests/test_served_matrix.py``). For each round the two
stacks (``serve_load.py``'s leader, worker and gateway) are started one after the other, A then
B, and each runs the client counts: N gRPC streams at once, ``--tokens`` tokens each (greedy:
one client decodes speculatively, VERIFY blocks of up to 8 rows). Prints each mode's
generation tokens/s (the tokens after every stream has its first, as ``serve_load.py``'s S_TG)
and inter-token latency p50, medians over the rounds, and the ratio picks / LOGITS; one JSON
row (bench/harness.py's schema; also written to ``--json PATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
from serve_load import Stack, load

# The workers' part of each row's pick (ROW_TOPS / ROW_DRAWS, the default) or their logits.
MODES = {"picks": (), "logits": ("--no-row-tops",)}


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a GGUF file")
    ap.add_argument("--clients", default="1,16", help="client counts (default 1,16)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a stream (default 64)")
    ap.add_argument("--rank-args", default="", help="extra flags for both ranks")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both modes (default 2)")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the streams' temperature (default 0: greedy, ROW_TOPS; above 0: ROW_DRAWS)",
    )
    harness.add_json_flag(ap)
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    rank_args = shlex.split(args.rank_args)
    runs: dict[str, dict[int, list[dict[str, float]]]] = {
        mode: {n: [] for n in clients} for mode in MODES
    }
    with tempfile.TemporaryDirectory(prefix="foundry-row-tops-") as tmp:
        for r in range(args.rounds):
            for mode, extra in MODES.items():
                work = Path(tmp) / f"{mode}-{r}"
                work.mkdir()
                stack = Stack(args.model, work, rank_args, *extra)
                try:
                    stack.wait_ready()
                    for n in clients:
                        row = asyncio.run(load(stack.grpc, n, args.tokens, args.temperature))
                        runs[mode][n].append(row)
                        print(
                            f"  round {r + 1}, {mode}, {n} clients: "
                            f"{row['generation_tokens_per_s']:.1f} tokens/s",
                            flush=True,
                        )
                finally:
                    stack.stop()
    print(
        f"{args.model.name}, ranks {args.rank_args or '(default flags)'}, temperature "
        f"{args.temperature:g}, {args.tokens} tokens a stream, medians of {args.rounds} rounds:"
    )
    print(" clients  rows' picks tok/s  ITL p50 ms  LOGITS tok/s  ITL p50 ms  picks / LOGITS")
    table = []
    for n in clients:
        med = {
            mode: {
                key: harness.median([row[key] for row in runs[mode][n]])
                for key in ("generation_tokens_per_s", "itl_p50_ms")
            }
            for mode in MODES
        }
        tops, full = med["picks"], med["logits"]
        ratio = harness.ratio(tops["generation_tokens_per_s"], full["generation_tokens_per_s"])
        print(
            f" {n:7d}  {tops['generation_tokens_per_s']:17.1f}  {tops['itl_p50_ms']:10.2f}  "
            f"{full['generation_tokens_per_s']:12.1f}  {full['itl_p50_ms']:10.2f}  {ratio:14.2f}"
        )
        table.append({"clients": n, "picks": tops, "logits": full, "ratio": ratio})
    results = {
        "model": str(args.model),
        "rank_args": args.rank_args,
        "temperature": args.temperature,
        "rows": table,
    }
    harness.emit("row_tops", results, True, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
