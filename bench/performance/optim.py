"""AdamW's step in C against numpy's, and what it is worth in a training step, one thread.

    OPENBLAS_NUM_THREADS=1 python bench/performance/optim.py [--preset small] [--samples 8]
        [--reps 10]

For the preset's parameters it times one AdamW step with each (best of ``--reps``, the two
interleaved), checks that both give the same bits, and times a whole training step of
``--samples`` sequences (gradients, clipping, AdamW) with each: a swarm worker in local-step
mode takes 8 samples per inner step, so the step's fixed cost weighs most there.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
from harness import best_of

from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.text.data import load_corpus
from foundry.model.train import optim
from foundry.model.train.training import Trainer, TrainSettings, compute_gradients


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--samples", type=int, default=8, help="sequences per training step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    harness.add_json_flag(ap)
    args = ap.parse_args()
    if optim._optim is None:
        print("foundry.model.kernels._optim is not built (pip install . with a C compiler)")
        return 1
    built = optim._optim
    cfg = preset(args.preset)
    corpus = load_corpus(None)
    params = init_params(cfg, 0)
    n = sum(p.size for p in params.values())
    res = compute_gradients(
        params,
        cfg,
        corpus,
        0,
        args.samples,
        seq_len=args.seq_len,
        micro_batch=8,
        aux_loss_coef=0.01,
    )
    grads = res.grads
    print(f"# {args.preset}: {n / 1e6:.2f} M parameters; best of {args.reps}, interleaved")

    trainers = {}
    for name in ("c", "numpy"):
        optim._optim = built if name == "c" else None
        trainer = Trainer(
            cfg,
            TrainSettings(global_batch=args.samples, seq_len=args.seq_len),
            {k: v.copy() for k, v in params.items()},
        )
        trainer.optimizer.step(trainer.params, grads, 1e-3)
        trainers[name] = trainer
    same = all(
        trainers["c"].params[k].tobytes() == trainers["numpy"].params[k].tobytes() for k in params
    )
    times: dict[str, float] = {}
    train: dict[str, float] = {}
    for _ in range(2):
        for name in ("c", "numpy"):
            optim._optim = built if name == "c" else None
            trainer = trainers[name]

            def adamw(trainer: Trainer = trainer) -> None:
                trainer.optimizer.step(trainer.params, grads, 1e-3)

            t = best_of(args.reps, adamw)
            times[name] = min(times.get(name, t), t)

            def step(trainer: Trainer = trainer) -> None:
                trainer.train_step(corpus, micro_batch=8)

            t = best_of(max(2, args.reps // 3), step)
            train[name] = min(train.get(name, t), t)
    optim._optim = built
    adamw_ratio = harness.ratio(times["numpy"], times["c"])
    step_ratio = harness.ratio(train["numpy"], train["c"])
    print(
        f"AdamW step: C {times['c'] * 1e3:.1f} ms, numpy {times['numpy'] * 1e3:.1f} ms: "
        f"{adamw_ratio:.2f}x; same bits: {'yes' if same else 'NO'}"
    )
    print(
        f"training step of {args.samples} sequences: C {train['c'] * 1e3:.1f} ms, numpy "
        f"{train['numpy'] * 1e3:.1f} ms: {step_ratio:.2f}x"
    )
    harness.emit(
        "optim",
        {
            "preset": args.preset,
            "adamw_c_s": times["c"],
            "adamw_numpy_s": times["numpy"],
            "adamw_ratio": adamw_ratio,
            "step_c_s": train["c"],
            "step_numpy_s": train["numpy"],
            "step_ratio": step_ratio,
            "same_bits": same,
        },
        same,
        args.json,
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
