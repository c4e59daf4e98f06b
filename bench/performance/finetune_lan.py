"""Fine-tuning a published model across a shaped LAN: bytes per round each way with LoRA and
with full fine-tuning, and N LoRA workers against one, measured in one run.

A random base in a published architecture (qwen3, by default 384 wide, 6 layers, a 4,096-token
SentencePiece vocabulary: 11.3M parameters, 45 MB of float32) is written with the ``gguf``
package; every process loads it from that file (``--base-model``), as every machine of a swarm
loads its own copy. The text is Python's bundled documentation in the file's tokens. Then, with
``bench/performance/lan.py``'s machinery (each process in a network namespace behind one bridge,
every port shaped both ways by ``tc tbf`` to ``--rate``), three swarms train the same global batch:

1. ``lora x1``: one worker, LoRA (rank ``--lora-rank`` on attn_q and attn_v);
2. ``lora xN``: ``--workers`` workers, LoRA, the same batch split among them;
3. ``full x1``: one worker, full fine-tuning (every tensor trains and travels), a few rounds.

(1) and (2) run once for each ``--coordinator-args`` (e.g. ``"--compression fp16
--down-compression fp16"``), with those arguments. Before them it times a worker's gradient
alone, in this process, at the whole batch and at one worker's share (ms per sample).

For each swarm it prints samples/s after the first rounds, the bytes per round through the
coordinator's port each way (the switch's counters, TCP/IP headers included), the held-out
loss at the end, and where a round goes (``round_phases``: each span's mean from every
process's ``--timeline``, and the median critical path through the worker that reported last);
then the ratio of (2)'s samples/s to (1)'s. Every process has one thread
(``OMP_NUM_THREADS=1``): N workers are N cores of the machine, which must have N + 2 of them
free.

It needs root, ``ip`` and ``tc`` (or ``--ip``/``--tc``, ``FOUNDRY_IP``/``FOUNDRY_TC``), and
PyTorch.

    python bench/performance/finetune_lan.py --rate 100mbit --workers 4 --coordinator-args "" \
        --coordinator-args "--compression fp16 --down-compression fp16"
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: harness

import harness
from lan_net import Network, add_tool_flags
from lan_swarm import Baseline, Result, mb, run_config
from random_gguf import Shape, write_dense


def write_base(path: Path, n_vocab: int, n_embd: int, n_layer: int, n_ff: int) -> int:
    """A random qwen3-architecture file: QK-norm, 2 query heads per kv head, tied output, a
    SentencePiece vocabulary of the 256 byte tokens and plain pieces. Returns its parameters."""
    dh = 64
    shape = Shape("qwen3", n_vocab, n_embd, n_layer, n_ff, n_embd // dh, n_embd // dh // 2, dh)
    return write_dense(path, shape)


def bundled_text(path: Path, size: int) -> None:
    """The first ``size`` characters of Python's bundled documentation (its held-out
    twentieth is what the coordinator validates on, beside the rounds)."""
    from pydoc_data.topics import topics

    text = "".join(topics[k].rstrip("\n") + "\n\n" for k in sorted(topics))
    path.write_text(text[:size])


def compute_alone(base: Path, text: Path, args: argparse.Namespace) -> dict[int, float]:
    """Seconds per sample of a worker's LoRA gradient (``FineTuneBackend.compute_gradients``,
    as a worker computes it) in this process on one thread, at the whole global batch and at
    one worker's share of it: what a smaller slice costs PyTorch per sample, with no network
    and no other process. The median of ``--alone-rounds`` after one warm call."""
    import torch

    from foundry.model.formats import lora as LR
    from foundry.model.text.finetune_data import load_tuning_corpus
    from foundry.model.text.vocab import load_tokenizer
    from foundry.model.train import finetune as FT
    from foundry.model.train import finetune_backend as FB

    torch.set_num_threads(1)
    loaded = FT.load_base(base)
    spec = LR.LoraSpec(rank=args.lora_rank, targets=("attn_q", "attn_v"))
    backend = FB.FineTuneBackend(loaded, spec)
    corpus = load_tuning_corpus(text, load_tokenizer(loaded.metadata))
    params = FT.initial_trainable(loaded, spec)
    out = {}
    for count in sorted({args.global_batch, max(1, args.global_batch // args.workers)}):
        times = []
        for i in range(args.alone_rounds + 1):
            t = time.perf_counter()
            backend.compute_gradients(
                params, loaded.cfg, corpus, i * count, count, seq_len=args.seq_len
            )
            times.append(time.perf_counter() - t)
        out[count] = harness.median(times[1:]) / count
    return out


def swarm(
    args: argparse.Namespace,
    work: Path,
    name: str,
    workers: int,
    steps: int,
    base: Path,
    text: Path,
    lora: bool,
    extra: str = "",
) -> Result:
    a = argparse.Namespace(**vars(args))
    a.workers, a.max_steps, a.steps, a.stop_at_target = workers, steps, steps, False
    a.validate_every, a.slowdown, a.timeline = steps, 1.0, True
    a.worker_args = ["--base-model", str(base), "--data", str(text)]
    coordinator = ["--base-model", str(base), "--data", str(text), *shlex.split(extra)]
    if lora:
        coordinator += ["--lora-rank", str(args.lora_rank), "--lora-targets", "attn_q,attn_v"]
    net = Network(workers + 1, args.rate, args.ip, args.tc)
    never = Baseline(
        samples_per_s=float("nan"), target=float("-inf"), seconds_to_target=float("nan"), curve=[]
    )
    try:
        net.up()
        return run_config(
            net, work / re.sub(r"[^\w.]+", "-", name).strip("-"), a, never, name, coordinator
        )
    finally:
        net.down()


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="100mbit", help="every port (tc syntax)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-ff", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="steps of each LoRA swarm")
    ap.add_argument("--full-steps", type=int, default=5, help="steps of the full swarm")
    ap.add_argument("--text-chars", type=int, default=100_000)
    ap.add_argument("--config-timeout", type=float, default=240.0)
    ap.add_argument(
        "--coordinator-args",
        action="append",
        default=None,
        metavar="ARGS",
        help='more coordinator arguments for the LoRA swarms (e.g. "--compression '
        'fp16"); repeated, each runs its own pair of LoRA swarms (default: none)',
    )
    ap.add_argument("--no-full", action="store_true", help="skip the full fine-tuning swarm")
    ap.add_argument(
        "--alone-rounds",
        type=int,
        default=3,
        help="gradients timed alone at each slice size before the swarms (0: none)",
    )
    add_tool_flags(ap)
    args = ap.parse_args()
    args.preset = "tiny"  # unused with --base-model; lan_swarm.run_config passes one
    work = Path(tempfile.mkdtemp(prefix="ftlan-"))
    base, text = work / "base.gguf", work / "docs.txt"
    n = write_base(base, args.vocab, args.n_embd, args.n_layer, args.n_ff)
    bundled_text(text, args.text_chars)
    print(
        f"base: qwen3 {args.n_embd} wide, {args.n_layer} layers, vocab {args.vocab}: "
        f"{n:,} parameters ({4 * n / 1e6:.1f} MB f32); batch {args.global_batch}x"
        f"{args.seq_len}, LoRA r={args.lora_rank} on attn_q,attn_v; ports at {args.rate}; "
        f"one thread a process",
        flush=True,
    )
    if args.alone_rounds > 0:
        alone = compute_alone(base, text, args)
        print(
            "compute alone, one thread, ms per sample of a LoRA gradient: "
            + ", ".join(
                f"{n} samples {1000 * s:.1f}" for n, s in sorted(alone.items(), reverse=True)
            ),
            flush=True,
        )
    variants = args.coordinator_args or [""]
    runs, ratios = [], []
    for extra in variants:
        tag = f" [{extra}]" if extra else ""
        one = swarm(args, work, f"lora x1{tag}", 1, args.steps, base, text, True, extra)
        many = swarm(
            args,
            work,
            f"lora x{args.workers}{tag}",
            args.workers,
            args.steps,
            base,
            text,
            True,
            extra,
        )
        runs += [one, many]
        ratios.append(
            f"lora x{args.workers} / lora x1{tag}: "
            f"{many.samples_per_s / one.samples_per_s:.2f}x samples/s"
        )
    if not args.no_full:
        runs.append(swarm(args, work, "full x1", 1, args.full_steps, base, text, False))
    print(
        f"{'swarm':<10} {'samples/s':>10} {'MB up/round':>12} {'MB down/round':>14} "
        f"{'held-out':>9}  note"
    )
    for r in runs:
        print(
            f"{r.name:<10} {r.samples_per_s:10.2f} {mb(r.up_per_step):>12} "
            f"{mb(r.down_per_step):>14} {r.last_val:9.4f}  {r.note}"
        )
        print(f"{'':<10} {r.phases}")
    for line in ratios:
        print(f"{line} ({args.workers} workers, one thread each, {args.rate} ports)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
