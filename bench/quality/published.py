"""A published GGUF file against llama.cpp: greedy tokens, logits, perplexity, decode speed.

Both run on one thread in this process: llama.cpp through llama-cpp-python's bindings over a
llama.cpp build (docs/quantization.md), Foundry's engine on the same file. Prompts are
tokenized by llama.cpp and the same ids fed to both.

- greedy: 64 tokens after each of 5 prompts; the first position where the ids differ, if any;
- logits: for every prompt row and generated step, max |ours - llama.cpp| over the row, and that
  divided by the row's largest |logit|;
- llama.cpp against itself: the same prompts fed to llama.cpp one token at a time instead of as
  one batch (its other code path: matrix-vector products and vec_dot attention instead of its
  tiled matrix products), the same two measures between its two runs. That is the yardstick
  for the two above: no engine can be closer to llama.cpp than its own two paths are, unless it
  reproduces one path's every rounding;
- perplexity: the text (the repository's docs, about 4,000 tokens) in windows of 512 tokens,
  each evaluated fresh from BOS, scored on its second half (as llama-perplexity scores);
- decode tokens/s of each, and their ratio (same run, same machine).

    PYTHONPATH=src:/work/llama/py LLAMA_CPP_LIB_PATH=/work/llama/build/bin \\
        python bench/quality/published.py --model /work/models/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

from foundry.model.formats.gguf_io import load_gguf_stored
from foundry.model.infer.inference import Engine

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
    "The three laws of thermodynamics are",
    "Translate to German: The weather is nice today.",
]
ROOT = Path(__file__).resolve().parents[2]


def llama_model(path: str, n_ctx: int) -> Any:
    sys.modules.setdefault("diskcache", types.SimpleNamespace(Cache=object))  # type: ignore[arg-type]
    import llama_cpp

    return llama_cpp.Llama(
        model_path=path, logits_all=True, n_threads=1, n_threads_batch=1, n_ctx=n_ctx, verbose=False
    )


def llama_stepwise(llm: Any, ids: list[int], follow: list[int]) -> list[np.ndarray]:
    """llama.cpp's rows for a prompt fed one token at a time, then for the tokens ``follow``
    (those its batch run chose, so that rows compare on the same inputs as ours do)."""
    llm.reset()
    rows = []
    for t in [*ids, *follow]:
        llm.eval([t])
        rows.append(np.array(llm.scores[llm.n_tokens - 1], np.float32))
    return rows


def log_softmax_nll(logits: np.ndarray, targets: list[int]) -> float:
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=1))
    return float((lse - z[np.arange(len(targets)), targets]).sum())


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()

    t0 = time.perf_counter()
    m = load_gguf_stored(args.model)
    print(f"foundry: loaded {args.model} in {time.perf_counter() - t0:.1f} s ({m.cfg})")
    engine = Engine(m.cfg, m.params, ctx_size=max(args.window, 256) + 1)
    llm = llama_model(args.model, max(args.window, 256) + 1)

    worst_abs = worst_rel = self_rel = 0.0
    same = self_same = 0
    t_ours = t_theirs = 0.0
    n_decoded = 0
    for text in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        llm.reset()
        llm.eval(ids)
        theirs_rows = [np.array(llm.scores[i], np.float32) for i in range(len(ids))]
        session = engine.new_session()
        ours = engine.decode(session, ids)
        ours_rows = list(ours)
        out_t: list[int] = []
        out_o: list[int] = []
        for _ in range(args.tokens):
            tok_t = int(np.argmax(theirs_rows[-1]))
            tok_o = int(np.argmax(ours_rows[-1]))
            out_t.append(tok_t)
            out_o.append(tok_o)
            t = time.perf_counter()
            llm.eval([tok_t])
            t_theirs += time.perf_counter() - t
            theirs_rows.append(np.array(llm.scores[llm.n_tokens - 1], np.float32))
            t = time.perf_counter()
            ours_rows.append(engine.decode(session, [tok_t])[-1])  # llama.cpp's token: rows align
            t_ours += time.perf_counter() - t
            n_decoded += 1
        for a, b in zip(ours_rows, theirs_rows, strict=True):
            d = float(np.abs(a - b).max())
            worst_abs = max(worst_abs, d)
            worst_rel = max(worst_rel, d / float(np.abs(b).max()))
        first = next((i for i, (x, y) in enumerate(zip(out_o, out_t, strict=True)) if x != y), None)
        same += first is None
        step_rows = llama_stepwise(llm, ids, out_t)
        step_out = [int(np.argmax(r)) for r in step_rows[len(ids) - 1 : -1]]
        self_first = next(
            (i for i, (x, y) in enumerate(zip(step_out, out_t, strict=True)) if x != y), None
        )
        self_same += self_first is None
        for a, b in zip(step_rows, theirs_rows, strict=True):
            self_rel = max(self_rel, float(np.abs(a - b).max()) / float(np.abs(b).max()))
        print(
            f"{text!r}: greedy {'identical' if first is None else f'differs at {first}'}"
            f" over {args.tokens} tokens; llama.cpp token by token against its batch: "
            f"{'identical' if self_first is None else f'differs at {self_first}'}"
        )
    print(
        f"greedy identical on {same}/{len(PROMPTS)} prompts (llama.cpp against itself: "
        f"{self_same}/{len(PROMPTS)})"
    )
    print(
        f"logits: max |ours - llama.cpp| {worst_abs:.4f}, relative to the row's largest "
        f"{worst_rel:.2e} (llama.cpp token by token against its batch: {self_rel:.2e})"
    )
    print(
        f"decode tokens/s: foundry {n_decoded / t_ours:.1f}, llama.cpp "
        f"{n_decoded / t_theirs:.1f}, ratio {t_theirs / t_ours:.2f}x"
    )

    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)[: args.ppl_tokens]
    half = args.window // 2
    nll_o = nll_t = 0.0
    count = 0
    for start in range(0, len(ids) - args.window + 1, args.window):
        chunk = [llm.token_bos(), *ids[start : start + args.window]]
        targets = chunk[half + 1 :]
        llm.reset()
        llm.eval(chunk)
        theirs = np.array(llm.scores[half : len(chunk) - 1], np.float32)
        session = engine.new_session()
        ours = engine.decode(session, chunk)[half : len(chunk) - 1]
        nll_t += log_softmax_nll(theirs, targets)
        nll_o += log_softmax_nll(ours, targets)
        count += len(targets)
    ppl_o, ppl_t = float(np.exp(nll_o / count)), float(np.exp(nll_t / count))
    print(
        f"perplexity over {count} scored tokens ({len(ids)} tokens in windows of "
        f"{args.window}): foundry {ppl_o:.4f}, llama.cpp {ppl_t:.4f}, "
        f"difference {100 * (ppl_o / ppl_t - 1):+.3f} %"
    )


if __name__ == "__main__":
    main()
