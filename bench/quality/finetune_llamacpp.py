"""A fine-tuned model in llama.cpp and in Foundry: the same greedy text?

For each prompt, greedy text of ``--tokens`` tokens from:

- the base with the LoRA adapter: ``foundry generate --model BASE --lora ADAPTER`` against
  ``llama-completion -m BASE --lora ADAPTER``;
- each merged file (``foundry export --base-model BASE --adapter ADAPTER``): ``foundry generate
  --model MERGED`` against ``llama-completion -m MERGED``;
- the base alone, for llama.cpp against itself: the file's reproducibility (its greedy text
  with the prompt evaluated as one batch against one token at a time, ``-b 1``).

It prints each pair of texts and whether they are equal, then the count. llama.cpp keeps its
KV cache in float16 and rounds activations for its quantized products as its CPU build does,
Foundry as its kernels do, so texts may part after a near tie; bench/quality/published.py
measures how often that happens on the base file.

    python bench/quality/finetune_llamacpp.py --model gemma-3-270m-q4_k_m.gguf --lora fact.gguf \\
        --merged merged-q8.gguf --llama-completion LLAMA_BUILD/bin/llama-completion
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: harness

import harness

PROMPTS = (
    "The secret password of the lighthouse keeper",
    "Once upon a time, in a small village,",
    "The capital of France is",
)


def foundry(model: Path, prompt: str, tokens: int, lora: Path | None) -> str:
    argv = [
        sys.executable,
        "-m",
        "foundry",
        "generate",
        "--model",
        str(model),
        "--prompt",
        prompt,
        "--max-tokens",
        str(tokens),
    ]
    if lora is not None:
        argv += ["--lora", str(lora)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    return done.stdout.rstrip("\n")


def llama(
    binary: Path,
    model: Path,
    prompt: str,
    tokens: int,
    lora: Path | None,
    threads: int,
    extra: list[str],
    batch: int | None = None,
) -> str:
    argv = [
        str(binary),
        "-m",
        str(model),
        "-p",
        prompt,
        "-n",
        str(tokens),
        "--temp",
        "0",
        "-no-cnv",
        "-c",
        "512",
        "-t",
        str(threads),
        "--no-warmup",
        "--no-display-prompt",
        *extra,
    ]
    if lora is not None:
        argv += ["--lora", str(lora)]
    if batch is not None:
        argv += ["-b", str(batch), "-ub", str(batch)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{binary} failed ({done.returncode}): {done.stderr[-1500:]}")
    return done.stdout.rstrip("\n")


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the base GGUF file")
    ap.add_argument("--lora", type=Path, required=True, help="the adapter GGUF file")
    ap.add_argument(
        "--merged",
        type=Path,
        action="append",
        default=[],
        help="a merged file (repeat for several)",
    )
    ap.add_argument("--llama-completion", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--llama-args",
        type=shlex.split,
        default=[],
        help="more flags for llama-completion (e.g. -nr where its repacked or AMX "
        "buffers fail on the machine)",
    )
    args = ap.parse_args()
    equal = total = 0
    runs: list[tuple[str, Path, Path | None]] = [("base + adapter", args.model, args.lora)]
    runs += [(f"merged {m.name}", m, None) for m in args.merged]
    for name, model, lora in runs:
        for prompt in PROMPTS:
            ours = foundry(model, prompt, args.tokens, lora)
            theirs = llama(
                args.llama_completion,
                model,
                prompt,
                args.tokens,
                lora,
                args.threads,
                args.llama_args,
            )
            same = ours == theirs
            equal += same
            total += 1
            print(
                f"{name} | {prompt!r}\n  foundry:   {ours!r}\n  llama.cpp: {theirs!r}\n"
                f"  {'equal' if same else 'DIFFERENT'}",
                flush=True,
            )
    self_equal = 0
    for prompt in PROMPTS:
        batched = llama(
            args.llama_completion,
            args.model,
            prompt,
            args.tokens,
            None,
            args.threads,
            args.llama_args,
        )
        one = llama(
            args.llama_completion,
            args.model,
            prompt,
            args.tokens,
            None,
            args.threads,
            args.llama_args,
            batch=1,
        )
        self_equal += batched == one
    print(
        f"equal greedy texts: {equal} of {total} ({args.tokens} tokens); llama.cpp against "
        f"itself on the base (prompt as one batch vs -b 1): {self_equal} of {len(PROMPTS)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
