"""Local-step training's quality, simulated in one process: the maths of ``--sync-every H``.

What ``bench/performance/lan.py`` measures on a real network costs a machine per worker and minutes
per configuration. The validation loss of local-step training does not depend on the network, only
on the maths: this script runs exactly the worker's inner steps (``sync.local_steps``), the
coordinator's sample plan (``policy.allocate_samples``, ``contiguous_offsets``), the sample-weighted
mean (``policy.weighted_mean``) and the outer step (``sync.OuterNesterov``), for N simulated workers
one after the other, with no sockets and lossless updates. It is a tuning tool: many configurations
run in parallel (one process and one BLAS thread each), and for each it prints the validation loss
at equal tokens against one process's (the same global batch and schedule, ``Trainer.train_step``),
and the tokens it needed to reach one process's final validation loss, as a ratio. ``ideal sooner``
is what N machines would gain in wall-clock time if computing were all they did: N x one process's
tokens to the target / the configuration's tokens to it. ``bench/performance/lan.py`` measures the
real thing.

A configuration is ``NAME=H,OUTER_LR,MOMENTUM[,GLOBAL_BATCH[,LR[,WARMUP]]]`` (``--config``,
repeatable); ``H = 1`` with lr 1 and momentum 0 is plain model averaging after every step.
``--stale-sync D`` adds synchronous training whose gradients are D steps stale (the maths of
overlapping a synchronous exchange with the next step's compute).
``WARMUP`` is the coordinator's ``--sync-warmup``: that many synchronous steps first (lossless
synchronous training is one process's AdamW on the whole batch), then local rounds, each
worker's inner AdamW starting fresh as a worker's does at its first LOCAL_ASSIGN.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.text.data import load_corpus
from foundry.model.train.optim import AdamW
from foundry.model.train.training import Trainer, TrainSettings, compute_gradients, evaluate_loss
from foundry.swarm import policy, sync

VALIDATION_BATCHES = 4  # as the coordinator and bench/performance/lan.py validate
CONFIG_FORM = "NAME=H,OUTER_LR,MOMENTUM[,GLOBAL_BATCH[,LR[,WARMUP]]]"


@dataclass(frozen=True)
class Config:
    name: str
    sync_every: int
    outer_lr: float
    momentum: float
    global_batch: int = 0  # 0: --global-batch
    lr: float = 0.0  # 0: --lr
    warmup: int = 0  # synchronous steps before the local rounds (--sync-warmup)


@dataclass
class Outcome:
    name: str
    curve: list[tuple[int, float]] = field(default_factory=list)  # (samples, validation loss)
    seconds: float = 0.0


def parse_config(text: str) -> Config:
    name, sep, spec = text.partition("=")
    parts = spec.split(",")
    if not sep or not name or not 3 <= len(parts) <= 6:
        raise argparse.ArgumentTypeError(f"{text!r}: want {CONFIG_FORM}")
    try:
        return Config(
            name,
            int(parts[0]),
            float(parts[1]),
            float(parts[2]),
            int(parts[3]) if len(parts) > 3 and parts[3] else 0,
            float(parts[4]) if len(parts) > 4 and parts[4] else 0.0,
            int(parts[5]) if len(parts) > 5 else 0,
        )
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def settings_of(args: argparse.Namespace, batch: int, lr: float) -> TrainSettings:
    return TrainSettings(
        global_batch=batch,
        seq_len=args.seq_len,
        total_steps=args.steps,
        warmup_steps=args.warmup_steps,
        lr=lr,
    )


def one_process(args: argparse.Namespace) -> Outcome:
    cfg = preset(args.preset)
    corpus = load_corpus(None)
    trainer = Trainer(cfg, settings_of(args, args.global_batch, args.lr), init_params(cfg, 0))
    out = Outcome("one process")
    t0 = time.perf_counter()
    for step in range(1, args.max_steps + 1):
        trainer.train_step(corpus, micro_batch=8)
        if step % args.validate_every == 0:
            loss = evaluate_loss(trainer.params, cfg, corpus, args.seq_len, VALIDATION_BATCHES)
            out.curve.append((step * args.global_batch, loss))
    out.seconds = time.perf_counter() - t0
    return out


def stale_sync(args: argparse.Namespace, delay: int) -> Outcome:
    """Synchronous training whose gradients are ``delay`` steps stale: one process's AdamW on
    the whole batch, each gradient taken at the weights of ``delay`` steps before (what
    overlapping a synchronous step's exchange with the next step's compute would train)."""
    cfg = preset(args.preset)
    corpus = load_corpus(None)
    s = settings_of(args, args.global_batch, args.lr)
    trainer = Trainer(cfg, s, init_params(cfg, 0))
    out = Outcome(f"sync, {delay} stale")
    t0 = time.perf_counter()
    behind = [{k: v.copy() for k, v in trainer.params.items()}]  # oldest first
    for step in range(1, args.max_steps + 1):
        result = compute_gradients(
            behind[0],
            cfg,
            corpus,
            trainer.position,
            s.global_batch,
            seq_len=s.seq_len,
            micro_batch=8,
            aux_loss_coef=s.aux_loss_coef,
            data_seed=s.data_seed,
        )
        trainer.apply(result.grads)
        behind = [*behind, {k: v.copy() for k, v in trainer.params.items()}][-(delay + 1) :]
        if step % args.validate_every == 0:
            loss = evaluate_loss(trainer.params, cfg, corpus, args.seq_len, VALIDATION_BATCHES)
            out.curve.append((step * args.global_batch, loss))
    out.seconds = time.perf_counter() - t0
    return out


def local_training(args: argparse.Namespace, c: Config) -> Outcome:
    """N workers' rounds in sequence: what the coordinator and workers compute, lossless."""
    cfg = preset(args.preset)
    corpus = load_corpus(None)
    batch = c.global_batch or args.global_batch
    s = settings_of(args, batch, c.lr or args.lr)
    # The schedule counts global steps of one process's batch: a bigger global batch covers
    # the same tokens in fewer steps, so its schedule is that much shorter.
    scale = args.global_batch / batch
    schedule = sync.InnerSchedule(
        s.lr,
        max(1, round(s.warmup_steps * scale)),
        max(1, round(s.total_steps * scale)),
        s.min_lr_ratio,
        s.grad_clip,
    )
    out = Outcome(c.name)
    t0 = time.perf_counter()
    warm = Trainer(cfg, s, init_params(cfg, 0))
    every = args.validate_every * args.global_batch
    for _ in range(c.warmup):
        warm.train_step(corpus, micro_batch=8)
        if warm.position % every == 0:
            loss = evaluate_loss(warm.params, cfg, corpus, s.seq_len, VALIDATION_BATCHES)
            out.curve.append((warm.position, loss))
    params = warm.params
    outer = sync.OuterNesterov(params, c.outer_lr, c.momentum)
    ids = [f"w{i}" for i in range(args.workers)]
    inner = {w: AdamW(params, weight_decay=s.weight_decay) for w in ids}
    per_step = policy.allocate_samples(batch, dict.fromkeys(ids, 1.0))
    step, position = warm.step, warm.position
    max_samples = args.max_steps * args.global_batch
    next_check = (position // every + 1) * every
    while position < max_samples:
        h = c.sync_every
        shares = {w: per_step[w] * h for w in ids}
        offsets = policy.contiguous_offsets(position, shares)
        parts = []
        for w in ids:
            res = sync.local_steps(
                params,
                inner[w],
                cfg,
                corpus,
                schedule,
                global_step=step,
                sample_offset=offsets[w],
                samples_per_step=per_step[w],
                steps=h,
                micro_batch=8,
                seq_len=s.seq_len,
                aux_loss_coef=s.aux_loss_coef,
            )
            parts.append((res.n_samples, [res.grads[k] for k in params]))
        mean = policy.weighted_mean(parts)
        outer.step(params, dict(zip(params, mean, strict=True)))
        step += h
        position += sum(shares.values())
        if position >= next_check:
            loss = evaluate_loss(params, cfg, corpus, s.seq_len, VALIDATION_BATCHES)
            out.curve.append((position, loss))
            next_check = (position // every + 1) * every
    out.seconds = time.perf_counter() - t0
    return out


def run(job: tuple[argparse.Namespace, Config | int | None]) -> Outcome:
    args, c = job
    if c is None:
        return one_process(args)
    return stale_sync(args, c) if isinstance(c, int) else local_training(args, c)


def at_tokens(curve: list[tuple[int, float]], samples: int) -> float:
    """The last validation at or before ``samples``."""
    before = [loss for n, loss in curve if n <= samples]
    return before[-1] if before else float("nan")


def to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((n for n, loss in curve if loss <= target), None)


def main() -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument(
        "--steps",
        type=int,
        default=128,
        help="one process's steps (the schedule's length); its validation loss there is the target",
    )
    ap.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="tokens to train, in one process's steps (default 2 x --steps)",
    )
    ap.add_argument("--validate-every", type=int, default=8, help="in one process's steps")
    ap.add_argument(
        "--config",
        dest="configs",
        type=parse_config,
        action="append",
        default=[],
        metavar=CONFIG_FORM,
    )
    ap.add_argument(
        "--stale-sync",
        type=int,
        action="append",
        default=[],
        metavar="D",
        help="also synchronous training with gradients D steps stale (repeatable)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="configurations run at once, one process each",
    )
    args = ap.parse_args()
    args.max_steps = max(args.max_steps or 2 * args.steps, args.steps)
    if args.workers < 1 or args.jobs < 1:
        ap.error("--workers and --jobs must be positive")
    if not args.configs and not args.stale_sync:
        ap.error("give at least one --config or --stale-sync")
    if any(d < 1 for d in args.stale_sync):
        ap.error("--stale-sync takes a delay of 1 step or more")
    print(
        f"# local-step quality: {args.workers} simulated workers, preset {args.preset}, "
        f"global batch {args.global_batch}x{args.seq_len}, target = one process's "
        f"validation after {args.steps} steps; "
        f"{len(args.configs) + len(args.stale_sync)} configurations, {args.jobs} at a time",
        flush=True,
    )
    jobs: list[tuple[argparse.Namespace, Config | int | None]] = [(args, None)]
    jobs += [(args, c) for c in args.configs]
    jobs += [(args, d) for d in args.stale_sync]
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs))) as pool:
        outcomes = list(pool.map(run, jobs))
    base = outcomes[0]
    equal = args.steps * args.global_batch
    target = at_tokens(base.curve, equal)
    base_n = to_target(base.curve, target) or equal
    print(
        f"one process: validation {target:.4f} after {args.steps} steps ({equal} samples) "
        f"= the target; {base.seconds:.0f} s for {args.max_steps} steps",
        flush=True,
    )
    print(
        f"{'configuration':22s} {'at equal tokens':>15s} {'vs target':>9s} "
        f"{'tokens to target':>16s} {'ideal sooner':>12s}  validation by samples"
    )
    for o in outcomes[1:]:
        v = at_tokens(o.curve, equal)
        n = to_target(o.curve, target)
        tokens = "-" if n is None else f"{n / base_n:.2f}x"
        sooner = "-" if n is None else f"{args.workers * base_n / n:.2f}x"
        curve = " ".join(f"{n_}:{loss:.3f}" for n_, loss in o.curve)
        print(
            f"{o.name:22s} {v:15.4f} {v / target:8.3f}x {tokens:>16s} {sooner:>12s}  {curve}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
