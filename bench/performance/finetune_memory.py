"""The memory and the step time of LoRA fine-tuning with the frozen base dequantized to float32
at load (the default) and held in its file's types (``--keep-quantized``), measured in one run.

Each mode runs in a fresh process (so one's peak is not the other's): it loads ``--model``
(``finetune.load_base``), then takes ``--steps`` LoRA gradients of ``--batch`` x ``--seq-len``
tokens (``FineTuneBackend.compute_gradients``, what a worker and ``foundry train --base-model``
compute) on random tokens, on ``--threads`` threads. It prints, for each: the bytes the base's
weights take as held, the process's peak resident memory after the load and after the steps
(``ru_maxrss``: the file's pages read through its map count while they are resident), and the
median seconds of a step after the first; then quantized against float32.

    python bench/performance/finetune_memory.py --model gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: harness

import harness

MODES = ("float32", "quantized")


def measure(args: argparse.Namespace, quantized: bool) -> dict[str, float]:
    """One mode, in this process."""
    import numpy as np
    import torch

    from foundry.model.formats import lora as LR
    from foundry.model.text.data import Corpus
    from foundry.model.train import finetune as FT
    from foundry.model.train import finetune_backend as FB

    torch.set_num_threads(args.threads)

    def peak_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    before = peak_mb()
    base = FT.load_base(args.model, "cpu", keep_quantized=quantized)
    loaded = peak_mb()
    spec = LR.LoraSpec(rank=args.lora_rank, targets=LR.parse_targets(args.lora_targets))
    backend = FB.FineTuneBackend(base, spec, micro_batch=args.batch)
    rng = np.random.default_rng(0)
    n = args.batch * (args.seq_len + 1) * (args.steps + 1) * 2
    corpus = Corpus(rng.integers(3, base.cfg.n_vocab, n).astype(np.int32), "random", 1)
    params = FT.initial_trainable(base, spec)
    times = []
    loss = 0.0
    for i in range(args.steps + 1):
        t = time.perf_counter()
        loss = backend.compute_gradients(
            params, base.cfg, corpus, i * args.batch, args.batch, seq_len=args.seq_len
        ).loss
        times.append(time.perf_counter() - t)
    return {
        "held_mb": base.nbytes() / 1e6,
        "start_mb": before,
        "loaded_mb": loaded,
        "peak_mb": peak_mb(),
        "step_s": harness.median(times[1:]),
        "loss": loss,
    }


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a quantized GGUF file")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2, help="steps timed after a first one")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-targets", default="attn_q,attn_v")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child process's mode
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args, args.one == "quantized")))
        return 0
    rows = {}
    for mode in MODES:
        done = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--one", mode],
            capture_output=True,
            text=True,
            timeout=3600,
            env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
        )
        if done.returncode != 0:
            print(f"{mode}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"{args.model.name}: LoRA r={args.lora_rank} on {args.lora_targets}, batch "
        f"{args.batch}x{args.seq_len}, {args.threads} thread(s), median of {args.steps} steps"
    )
    print(
        f"{'base held as':<14} {'weights MB':>10} {'peak MB after load':>19} "
        f"{'peak MB after steps':>20} {'s/step':>8} {'loss':>8}"
    )
    for mode, r in rows.items():
        print(
            f"{mode:<14} {r['held_mb']:10.0f} {r['loaded_mb']:19.0f} {r['peak_mb']:20.0f} "
            f"{r['step_s']:8.2f} {r['loss']:8.4f}"
        )
    f, q = rows["float32"], rows["quantized"]
    print(
        f"quantized / float32: weights {q['held_mb'] / f['held_mb']:.2f}x, peak "
        f"{q['peak_mb'] / f['peak_mb']:.2f}x, step time {q['step_s'] / f['step_s']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
