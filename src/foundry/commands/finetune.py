"""`foundry train --base-model FILE.gguf`: fine-tune a published model in this one process.

Not a subcommand of its own: ``foundry train`` hands over here when ``--base-model`` is given
(the coordinator, the worker and ``foundry up`` share :func:`open_base`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from foundry.model.train import recipe

if TYPE_CHECKING:
    from foundry.model.formats.lora import LoraSpec
    from foundry.model.text.data import Corpus
    from foundry.model.train.finetune import Base


class SetupError(Exception):
    """A fine-tuning run that cannot start; the message is the one line to print."""


def torch_device(device: str) -> str:
    """The torch device of ``--device``: the CPU for cpu and torch-cpu, the GPU for cuda (and
    auto where one is seen). Fine-tuning always computes with PyTorch."""
    from foundry.model.nn.device import INSTALL_HINT, torch_available

    if not torch_available():
        raise SetupError(
            f"fine-tuning (--base-model) needs PyTorch, which is not installed: {INSTALL_HINT}"
        )
    import torch

    if device in ("cuda", "auto") and torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        raise SetupError("--device cuda: PyTorch sees no CUDA GPU; use --device cpu")
    return "cpu"


@dataclass
class Tuning:
    """What a fine-tuning process holds: the base, the LoRA settings (None: full), the data."""

    base: Base
    spec: LoraSpec | None
    corpus: Corpus | None
    tokenizer: Any


def open_base(args: argparse.Namespace, *, data: bool = True) -> Tuning:
    """Load ``--base-model`` on the ``--device``, its tokenizer, and ``--data`` in its tokens
    (SetupError with the reason on any failure)."""
    from foundry.commands.common import lora_spec
    from foundry.model.formats.gguf_model import GGUFError
    from foundry.model.formats.lora import LoraError, target_tensors
    from foundry.model.text.chat import template_for
    from foundry.model.text.chat_sandbox import ChatTemplateError
    from foundry.model.text.data import DataError
    from foundry.model.text.finetune_data import load_tuning_corpus
    from foundry.model.text.vocab import TokenizerError, load_tokenizer
    from foundry.model.train.finetune import load_base

    try:
        spec = lora_spec(args)
    except LoraError as exc:
        raise SetupError(str(exc)) from None
    if data and args.data is None:
        raise SetupError(
            "--base-model needs --data: the text (a file or folder) or chat "
            "data (.jsonl) to fine-tune on"
        )
    # `foundry train` and workers compute on --device; the coordinator validates on
    # --validate-device
    device = torch_device(getattr(args, "device", None) or args.validate_device)
    try:
        base = load_base(args.base_model, device, keep_quantized=args.keep_quantized)
        if spec is not None:
            target_tensors(base.cfg, spec.targets)
        tokenizer = load_tokenizer(base.metadata)
        corpus = None
        if data:
            corpus = load_tuning_corpus(args.data, tokenizer, template_for(base.metadata))
    except (GGUFError, LoraError, TokenizerError, DataError, ChatTemplateError) as exc:
        raise SetupError(str(exc)) from None
    except OSError as exc:
        raise SetupError(f"cannot read {args.base_model}: {exc}") from None
    return Tuning(base, spec, corpus, tokenizer)


def describe(t: Tuning, n_trainable: int) -> str:
    from foundry.model.spec.arch import spec as arch_spec

    total = sum(math.prod(w.shape) for w in t.base.weights.values())
    how = (
        "full fine-tuning"
        if t.spec is None
        else f"LoRA r={t.spec.rank} alpha={t.spec.alpha:g} on {','.join(t.spec.targets)}"
    )
    return (
        f"{t.base.path.name} ({arch_spec(t.base.cfg).name}, {total:,} parameters), {how}: "
        f"{n_trainable:,} trainable"
    )


def loss_line(before: float, after: float, resumed_at: int = 0) -> str:
    """Held-out loss before and after; ``resumed_at``: this run began at that step's
    checkpoint, so "before" is that step's."""
    when = f"at step {resumed_at} (resumed)" if resumed_at else "before"
    return (
        f"held-out loss: {when} {before:.4f}, after {after:.4f} nats/token "
        f"(perplexity {math.exp(before):.2f} -> {math.exp(after):.2f})"
    )


def run_finetune(args: argparse.Namespace) -> int:
    if args.steps is None:
        args.steps = recipe.FT_STEPS
    if args.out is not None:
        from foundry.model.formats.outfile import OutputRefused, check_output

        try:
            check_output(args.out, force=True)
        except OutputRefused as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        t = open_base(args)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    assert t.corpus is not None
    from tqdm import tqdm

    from foundry.commands.train_checkpoints import Checkpoints, StepInterrupt
    from foundry.model.formats.checkpoint import CheckpointError
    from foundry.model.formats.tuning import tuned_config
    from foundry.model.text.data import DataError
    from foundry.model.train.finetune import initial_trainable
    from foundry.model.train.finetune_backend import FineTuneBackend, FineTuner, TuneSettings

    corpus = t.corpus
    try:
        corpus.n_sequences(args.seq_len)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = TuneSettings(
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        lr=args.lr,
        total_steps=args.steps,
        warmup_steps=(
            min(recipe.warmup_steps(args.steps), args.steps // 10)
            if args.warmup_steps is None
            else args.warmup_steps
        ),
    )
    from foundry.commands.common import use_threads

    # The kernels' pool and, on the CPU with --device auto or --threads, PyTorch's threads.
    threads = use_threads(args, torch_cpu=t.base.device.type == "cpu" and args.device == "auto")
    backend = FineTuneBackend(t.base, t.spec, micro_batch=args.micro_batch or 8)
    trainable = initial_trainable(t.base, t.spec, args.seed)
    tuner = FineTuner(backend, settings, trainable)
    n_trainable = sum(a.size for a in trainable.values())
    checkpoints = Checkpoints(args, tuned_config(t.base.cfg, t.base.identity, t.spec))
    try:
        refused = checkpoints.resume(tuner)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    print(f"fine-tuning {describe(t, n_trainable)}")
    print(
        f"on {corpus.source}: {len(corpus):,} tokens, {args.steps} steps of "
        f"{args.global_batch}x{args.seq_len}, on {backend.name}, {threads} threads",
        flush=True,
    )
    eval_every = args.eval_every or recipe.validate_every(args.steps)
    resumed_at = tuner.step
    before = val = tuner.evaluate_loss(corpus, args.seq_len)
    print(f"step {resumed_at}: held-out loss {val:.4f} nats/token", flush=True)
    bar = tqdm(
        total=args.steps,
        initial=tuner.step,
        unit="step",
        disable=args.no_progress,
        dynamic_ncols=True,
    )
    t0, first = time.perf_counter(), tuner.position
    try:  # a checkpoint the disk refuses ends the run with the reason
        try:
            with StepInterrupt() as ctrl_c:
                while tuner.step < args.steps:
                    result = tuner.train_step(corpus)
                    rate = (tuner.position - first) / (time.perf_counter() - t0)
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{result.loss:.3f}", val=f"{val:.3f}", samples_s=f"{rate:.2f}"
                    )
                    if args.no_progress and (tuner.step % 10 == 0 or tuner.step == 1):
                        print(
                            f"step {tuner.step}: loss {result.loss:.4f} ({rate:.2f} samples/s)",
                            flush=True,
                        )
                    if tuner.step % eval_every == 0 or tuner.step == args.steps:
                        val = tuner.evaluate_loss(corpus, args.seq_len)
                        bar.write(
                            f"step {tuner.step}: loss {result.loss:.4f}, held-out loss "
                            f"{val:.4f} nats/token"
                        )
                    checkpoints.due(tuner)
                    ctrl_c.check()
        except KeyboardInterrupt:
            bar.close()
            checkpoints.save(tuner)
            print(f"interrupted at step {tuner.step}; {checkpoints.resume_hint()}")
            return 130
        bar.close()
        checkpoints.save(tuner)
    except CheckpointError as exc:
        bar.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(loss_line(before, val, resumed_at), flush=True)
    if args.out is not None:
        from foundry.model.formats.gguf_model import GGUFError

        try:
            write_result(t, tuner.host_params(), args.out)
        except (GGUFError, OSError) as exc:
            print(f"error: could not write {args.out}: {exc}", file=sys.stderr)
            return 1
    return 0


def write_result(t: Tuning, trainable: dict[str, Any], out: Any) -> None:
    """The adapter file (LoRA) or the whole model in the base's architecture (full)."""
    from foundry.model.formats.gguf_rewrite import rewrite_gguf
    from foundry.model.formats.lora import save_adapter
    from foundry.model.spec.arch import spec as arch_spec

    base = t.base.path
    if t.spec is not None:
        save_adapter(
            out,
            arch_spec(t.base.cfg).name,
            t.spec.alpha,
            trainable,
            str(t.base.metadata.get("general.name", "")),
        )
        print(
            f"wrote {out} (LoRA adapter, {sum(a.nbytes for a in trainable.values()):,} "
            f"bytes of float32); try: foundry generate --model {base} --lora {out} "
            "--prompt '...'"
        )
        return
    types = rewrite_gguf(base, out, trainable)
    print(
        f"wrote {out} ({len(types)} tensors written, the base's types where Foundry writes "
        f"them, else Q8_0); try: foundry generate --model {out} --prompt '...'"
    )
