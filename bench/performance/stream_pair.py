"""Memory bandwidth of one core streaming weights alone against two cores streaming at once.

A tensor-parallel pair on one host shares that host's memory system: both ranks stream their
halves of the weights at the same moment, which two machines would do from two memories. This
measures what that sharing costs here, apart from everything else the pair does.

Two processes, pinned to two cores, each hold ``--mb`` MB of random Q8_0 weight rows of 1,024
values (by default more than a 300 MB L3, so the products stream from DRAM) and multiply one
float32 row by all of them with the block kernels (``quant.linear``), ``--reps`` times a round:

1. core A alone, then core B alone (the other process idle);
2. both at once, started together.

Rounds are interleaved (``--rounds``); it prints each core's GB/s of stored weights alone and
together (medians), and together over alone: 1.00x means the pair's ranks do not slow each
other's products here.

    OPENBLAS_NUM_THREADS=1 python bench/performance/stream_pair.py [--mb 1024] [--reps 3]
        [--rounds 3]
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
from tp_gates import cores, pin

from foundry.model.kernels import quant
from foundry.model.kernels.quant import QTensor, QType

K = 1024
Q8_0_ROW_BYTES = K // 32 * 34


def child(core: int, mb: int, conn: Connection) -> None:
    """Hold the weights; on each "go", stream them ``reps`` times and send back the GB/s."""
    pin(core)
    rows = mb * 1_000_000 // Q8_0_ROW_BYTES
    rng = np.random.default_rng(core)
    blocks = rng.integers(0, 256, (rows, K // 32, 34), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)  # the scales
    w = QTensor(QType.Q8_0, (rows, K), blocks.reshape(rows, -1))
    x = rng.standard_normal((1, K), dtype=np.float32)
    quant.linear(x, w)  # pages touched, code warm
    conn.send("ready")
    while (reps := conn.recv()) is not None:
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            quant.linear(x, w)
            rates.append(w.data.nbytes / (time.perf_counter() - t0) / 1e9)
        conn.send(harness.median(rates))


def main() -> int:
    ap = harness.parser(__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024, help="MB of Q8_0 weights per core")
    ap.add_argument("--reps", type=int, default=3, help="products per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    harness.add_json_flag(ap)
    args = ap.parse_args()
    pair = cores()
    if len(pair) < 2:
        print("needs two cores to pin the two processes apart")
        return 1
    print(f"kernels: {quant.KERNELS}; cores {pair[0]} and {pair[1]}, {args.mb} MB of Q8_0 each")
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for core in pair:
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=child, args=(core, args.mb, theirs))
        proc.start()
        conns.append(mine)
        procs.append(proc)
    try:
        for c in conns:
            if c.recv() != "ready":
                raise SystemExit("a child failed to start")
        alone: list[list[float]] = [[], []]
        both: list[list[float]] = [[], []]
        for r in range(args.rounds):
            for i, c in enumerate(conns):
                c.send(args.reps)
                alone[i].append(c.recv())
            for c in conns:
                c.send(args.reps)
            for i, c in enumerate(conns):
                both[i].append(c.recv())
            print(
                f"  round {r + 1}: alone "
                + " / ".join(f"{a[-1]:.1f}" for a in alone)
                + " GB/s, together "
                + " / ".join(f"{b[-1]:.1f}" for b in both)
            )
        for i, core in enumerate(pair):
            a, b = harness.median(alone[i]), harness.median(both[i])
            print(
                f"core {core}: alone {a:.1f} GB/s, both at once {b:.1f} GB/s: "
                f"{harness.ratio(b, a):.2f}x"
            )
        total_alone = sum(harness.median(a) for a in alone)
        total_both = sum(harness.median(b) for b in both)
        print(
            f"both cores together stream {total_both:.1f} GB/s, "
            f"{harness.ratio(total_both, total_alone):.2f}x "
            f"the sum of each alone ({total_alone:.1f})"
        )
        harness.emit(
            "stream_pair",
            {
                "cores": pair[:2],
                "mb": args.mb,
                "alone_gb_s": [harness.median(a) for a in alone],
                "both_gb_s": [harness.median(b) for b in both],
                "ratio": harness.ratio(total_both, total_alone),
            },
            None,
            args.json,
        )
    finally:
        for c in conns:
            c.send(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
