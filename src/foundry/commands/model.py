"""`foundry model init`, `foundry train` and `foundry generate`: the model in one process."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from foundry.commands.common import (
    add_device_flags,
    add_finetune_flags,
    add_schedule_flags,
    add_threads_flag,
    fraction,
    integer_shares,
    nonneg_float,
    nonneg_int,
    positive_int,
    resolve_schedule,
    use_threads,
)
from foundry.model.formats.gguf_model import FILE_DTYPES
from foundry.model.shard.table import ExpertSplit
from foundry.model.spec.config import PRESETS
from foundry.model.train import recipe

log = logging.getLogger("foundry.train")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    m = sub.add_parser("model", help="create model files", description="Create model files.")
    msub = m.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    init = msub.add_parser(
        "init",
        help="write a randomly initialised model as GGUF",
        description="Write a randomly initialised model of a preset size as a GGUF file.",
    )
    init.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size")
    init.add_argument("--out", type=Path, required=True, help="GGUF file to write")
    init.add_argument("--seed", type=nonneg_int, default=0, help="init seed (default 0)")
    init.add_argument(
        "--type",
        "--dtype",
        dest="dtype",
        default="f32",
        choices=FILE_DTYPES,
        help="tensor type: f32, f16, or quantized q8_0 / q4_0 (default f32)",
    )
    init.set_defaults(func=run_init)

    t = sub.add_parser(
        "train",
        help="train in this one process (no swarm)",
        description="Train the model in one process on the bundled corpus (or --data), with "
        "a progress bar, validation loss and checkpoints; optionally write a GGUF at the end.",
    )
    t.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size")
    t.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=f"optimizer steps (default {recipe.STEPS}: words on the default corpus; "
        f"fine-tuning {recipe.FT_STEPS})",
    )
    add_schedule_flags(t)
    add_finetune_flags(t)
    t.add_argument(
        "--micro-batch",
        type=positive_int,
        default=None,
        help="samples per forward pass (default: the whole batch)",
    )
    t.add_argument(
        "--data",
        type=Path,
        default=None,
        help="text file or folder (default: Python's bundled documentation)",
    )
    t.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="write checkpoints here and resume from the newest one that verifies",
    )
    t.add_argument(
        "--checkpoint-every", type=positive_int, default=50, help="steps between checkpoints"
    )
    t.add_argument(
        "--fresh",
        action="store_true",
        help="start at step 0: move the checkpoints of --checkpoint-dir into a "
        "previous-N folder in it (nothing is deleted)",
    )
    t.add_argument(
        "--eval-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="steps between validation runs (default: a twentieth of --steps, 25 to 150)",
    )
    t.add_argument(
        "--sample-every",
        type=nonneg_int,
        default=None,
        metavar="N",
        help="print a greedy sample of --prompt every N steps (default: at each "
        "validation run; 0: never)",
    )
    t.add_argument("--prompt", default="The ", help="prompt of those samples (default 'The ')")
    t.add_argument(
        "--sample-tokens",
        type=positive_int,
        default=48,
        metavar="N",
        help="tokens of each sample (default 48)",
    )
    t.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the trained model as GGUF (fine-tuning with --lora-rank: the "
        "LoRA adapter file, which llama.cpp's --lora and `foundry generate --lora` "
        "load beside the base)",
    )
    t.add_argument("--seed", type=nonneg_int, default=0, help="weight init seed (default 0)")
    t.add_argument("--no-progress", action="store_true", help="log lines instead of a bar")
    add_device_flags(t, training=True)
    add_threads_flag(t, training=True)
    t.set_defaults(func=run_train)

    g = sub.add_parser(
        "generate",
        help="generate text from a GGUF model in this one process",
        description="Generate text after a prompt. Prints only the generated text, streamed "
        "as it comes, then a newline. --temperature 0 is greedy (deterministic).",
    )
    g.add_argument("--model", type=Path, required=True, help="GGUF model file")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument(
        "--max-tokens", type=positive_int, default=64, help="tokens to generate (default 64)"
    )
    g.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=fraction, default=1.0, help="nucleus sampling mass (default 1)")
    g.add_argument("--seed", type=nonneg_int, default=0, help="sampling seed (default 0)")
    g.add_argument(
        "--ctx-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="context in tokens: KV cache and rope tables are sized by it "
        "(default: the file's, at most 4096)",
    )
    g.add_argument(
        "--lora",
        type=Path,
        default=None,
        metavar="ADAPTER.gguf",
        help="apply this LoRA adapter (from `foundry train --base-model ... "
        "--lora-rank R --out ADAPTER.gguf`) to --model at load",
    )
    add_device_flags(g, training=False)
    add_threads_flag(g, training=False)
    g.add_argument(
        "--shares",
        type=integer_shares,
        default=None,
        metavar="W0,W1,...",
        help="evaluate the model cut as a tensor-parallel world of that many ranks with these "
        "shares is (`foundry tp-leader --world-size N --shares ...`: each rank's slice in "
        "turn, the partials added in rank order), so the tokens and logits are that world's "
        "bit for bit (default 1,1: the pair's; --device cpu)",
    )
    g.add_argument(
        "--expert-split",
        default="auto",
        choices=["auto", *(m.value for m in ExpertSplit)],
        help="how the routed experts are cut, as `foundry tp-leader --expert-split` (default "
        "auto: what a leader with --shares picks for this file, so a MoE file's tokens are "
        "that world's)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="with --device cuda, torch.compile the one-token step before it is "
        "captured in a CUDA graph: faster decoding after a compilation of some "
        "seconds (docs/gpu.md; default off)",
    )
    g.add_argument(
        "--stats",
        action="store_true",
        help="print tokens, time, tokens/s and why it ended to stderr (as "
        "`foundry ctl generate --stats`)",
    )
    g.set_defaults(func=run_generate)


def run_init(args: argparse.Namespace) -> int:
    from foundry.model.formats.gguf_io import save_gguf
    from foundry.model.formats.outfile import OutputRefused, check_output
    from foundry.model.nn.transformer import init_params
    from foundry.model.spec.config import preset

    try:  # a GGUF file may be replaced (as before); a checkpoint or any other file never
        check_output(args.out, force=True)
    except OutputRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = preset(args.preset)
    save_gguf(args.out, cfg, init_params(cfg, args.seed), dtype=args.dtype)
    print(f"wrote {args.out} ({args.preset}: {cfg.n_params():,} parameters, {args.dtype})")
    return 0


def run_train(args: argparse.Namespace) -> int:
    resolve_schedule(args)
    if args.base_model is not None:
        from foundry.commands.finetune import run_finetune

        return run_finetune(args)
    if args.steps is None:
        args.steps = recipe.STEPS
    from foundry.model.formats.checkpoint import CheckpointError
    from foundry.model.formats.checkpoint_dir import CheckpointRefused
    from foundry.model.formats.gguf_model import GGUFError
    from foundry.model.nn.device import DeviceError
    from foundry.model.text.data import DataError

    try:
        return _train(args)
    except (DataError, CheckpointRefused, DeviceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, GGUFError) as exc:  # GGUFError: --out cannot hold the weights
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from foundry.commands.train_checkpoints import Checkpoints, StepInterrupt
    from foundry.model.formats.gguf_io import save_gguf
    from foundry.model.infer.generate import greedy_text, printable
    from foundry.model.nn.transformer import init_params
    from foundry.model.spec.config import preset
    from foundry.model.text.data import (
        DataError,
        compressor_bits_per_byte,
        load_corpus,
        primed_bits_per_byte,
    )
    from foundry.model.train import backend as compute
    from foundry.model.train.training import (
        TrainSettings,
        against_compressors,
        beaten_line,
        bits_per_byte,
        held_out_line,
    )
    from foundry.runtime import retain_freed_memory
    from foundry.up.view import FALLBACK_COLUMNS, terminal_columns

    if args.steps <= 0 or args.global_batch <= 0:
        print("error: --steps and --global-batch must be positive", file=sys.stderr)
        return 2
    if args.out is not None:
        from foundry.model.formats.outfile import OutputRefused, check_output

        try:  # said before training, not after it (a GGUF file may be replaced)
            check_output(args.out, force=True)
        except OutputRefused as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        corpus = load_corpus(args.data)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    retain_freed_memory()
    cfg = preset(args.preset)
    settings = TrainSettings(
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=(
            recipe.warmup_steps(args.steps) if args.warmup_steps is None else args.warmup_steps
        ),
        total_steps=args.steps,
    )
    if args.eval_every is None:
        args.eval_every = recipe.validate_every(args.steps)
    note = recipe.short_run_note(args.steps, args.data is None)
    if note:
        print(note)
    backend = compute.select(args.device, bf16=args.bf16, training=True)
    threads = use_threads(
        args,
        blas=backend is compute.NUMPY,
        torch_cpu=backend.name.startswith("torch:cpu") and args.device == "auto",
    )
    print(f"training on {backend.name}, {threads} threads", flush=True)
    trainer = compute.make_trainer(backend, cfg, settings, init_params(cfg, args.seed))
    checkpoints = Checkpoints(args, cfg)
    refused = checkpoints.resume(trainer)
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2

    held_out = corpus.held_out_bytes(args.seq_len)
    yardstick = compressor_bits_per_byte(held_out) | primed_bits_per_byte(
        held_out, corpus.training_bytes(args.seq_len)
    )
    sample_every = args.eval_every if args.sample_every is None else args.sample_every
    print(
        f"training {args.preset} ({cfg.n_params():,} parameters) on {corpus.source}: "
        f"{len(corpus):,} tokens, {args.steps} steps of {args.global_batch}x{args.seq_len}"
        + ("" if backend is compute.NUMPY else f", on {backend.name}")
    )
    print(held_out_line(len(held_out), yardstick))

    def validation(val: float) -> str:
        return f"validation {bits_per_byte(val):.3f} bits/byte ({val:.4f} nats)"

    val = trainer.evaluate_loss(corpus, args.seq_len)
    print(f"step {trainer.step}: {validation(val)}")
    sized = terminal_columns(sys.stderr) > 0  # tqdm's bar goes to stderr
    bar = tqdm(
        total=args.steps,
        initial=trainer.step,
        unit="step",
        disable=args.no_progress,
        dynamic_ncols=sized,
        ncols=None if sized else FALLBACK_COLUMNS,
    )
    t0 = time.perf_counter()
    samples = 0
    try:
        with StepInterrupt() as ctrl_c:
            while trainer.step < args.steps:
                result = trainer.train_step(corpus, args.micro_batch)
                samples += result.n_samples
                rate = samples / (time.perf_counter() - t0)
                bar.update(1)
                bar.set_postfix(
                    loss=f"{result.loss:.3f}",
                    val_bpb=f"{bits_per_byte(val):.3f}",
                    samples_s=f"{rate:.1f}",
                )
                if args.no_progress and trainer.step % 10 == 0:
                    print(
                        f"step {trainer.step}: loss {result.loss:.4f} ({rate:.1f} samples/s)",
                        flush=True,
                    )
                last = trainer.step == args.steps
                if trainer.step % args.eval_every == 0 or last:
                    val = trainer.evaluate_loss(corpus, args.seq_len)
                    bar.write(f"step {trainer.step}: loss {result.loss:.4f}, {validation(val)}")
                if sample_every > 0 and (trainer.step % sample_every == 0 or last):
                    text = greedy_text(cfg, trainer.host_params(), args.prompt, args.sample_tokens)
                    bar.write(f"step {trainer.step}: sample {printable(args.prompt + text)!r}")
                checkpoints.due(trainer)
                ctrl_c.check()
    except KeyboardInterrupt:
        bar.close()
        checkpoints.save(trainer)
        print(f"interrupted at step {trainer.step}; {checkpoints.resume_hint()}")
        return 130
    bar.close()
    checkpoints.save(trainer)
    print(f"held-out: {against_compressors(bits_per_byte(val), yardstick)}")
    print(beaten_line(bits_per_byte(val), yardstick))
    if args.out is not None:
        save_gguf(args.out, cfg, trainer.host_params())
        print(f"wrote {args.out}; try: foundry generate --model {args.out} --prompt 'The '")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from foundry.model.formats.gguf_io import load_gguf_stored
    from foundry.model.formats.gguf_model import GGUFError
    from foundry.model.formats.lora import LoraError, apply_adapter, load_adapter
    from foundry.model.infer.engines import make_engine
    from foundry.model.infer.generate import generate_tokens
    from foundry.model.infer.sampling import SamplingError
    from foundry.model.nn.device import DeviceError
    from foundry.model.shard.shares import check_splittable, norm_shares
    from foundry.model.shard.slices import check_cuts, pick_expert_split, stored_blocks
    from foundry.model.shard.table import SplitError
    from foundry.model.text.vocab import TokenizerError, load_tokenizer

    try:
        loaded = load_gguf_stored(args.model)
        tokenizer = load_tokenizer(loaded.metadata)
        params = loaded.params
        if args.lora is not None:
            params = apply_adapter(loaded.cfg, params, load_adapter(args.lora), str(args.lora))
    except (GGUFError, OSError, LoraError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TokenizerError as exc:
        print(f"error: {args.model}: {exc}", file=sys.stderr)
        return 2
    shares = norm_shares(len(args.shares or (1, 1)), args.shares)
    blocks = stored_blocks(loaded.params)  # not the header again (gguf_io.block_sizes)
    split, why = (
        pick_expert_split(loaded.cfg, shares, blocks)
        if args.expert_split == "auto"
        else (ExpertSplit(args.expert_split), "")
    )
    if args.shares is not None:  # the world named must exist (without them: the pair, if any)
        try:
            check_splittable(loaded.cfg, len(shares), split, shares)
            check_cuts(loaded.cfg, split, shares, blocks)
        except SplitError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.stats and args.shares is not None:
        print(
            f"standing for a world of {len(shares)} ranks, shares "
            f"{','.join(map(str, shares))}"
            + (f", expert split {split.value}" if loaded.cfg.n_expert else "")
            + (f" ({why})" if why else ""),
            file=sys.stderr,
        )
    try:
        engine = make_engine(
            loaded.cfg,
            params,
            expert_split=split,
            device=args.device,
            ctx_size=args.ctx_size,
            compile_step=args.compile,
            threads=use_threads(args),
            shares=args.shares,
        )
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The engine holds what it needs (views of the loaded tensors, and its own stacked and cut
    # copies of the rest): the loaded tensors it copied would be held twice.
    del loaded, params
    text = tokenizer.stream_decoder()
    t0 = time.perf_counter()
    times: list[float] = []  # when each token came
    try:
        for token in generate_tokens(
            engine,
            args.prompt,
            args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            tokenizer=tokenizer,
        ):
            times.append(time.perf_counter())
            sys.stdout.write(text.feed(token))
            sys.stdout.flush()
    except (ValueError, SamplingError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text.flush() + "\n")
    sys.stdout.flush()
    if args.stats:
        print(
            generate_stats(len(tokenizer.encode(args.prompt)), t0, times, args.max_tokens),
            file=sys.stderr,
        )
    return 0


def generate_stats(prompt_tokens: int, t0: float, times: list[float], max_tokens: int) -> str:
    """`foundry generate --stats`: the line of ``ctl generate --stats``, with the prompt's time
    (to the first token) apart from the decoding rate after it."""
    n = len(times)
    total = (times[-1] if times else time.perf_counter()) - t0
    head = f"{n} tokens after a {prompt_tokens}-token prompt in {total:.3f} s"
    if n:
        rate = (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None
        head += (
            f" ({n / total:.1f} tokens/s; first token {times[0] - t0:.3f} s"
            + (f", then {rate:.1f} tokens/s" if rate is not None else "")
            + ")"
        )
    return f"{head}, finished: {'length' if n == max_tokens else 'stop'}"
