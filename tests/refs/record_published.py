"""Record llama.cpp's greedy tokens and logits on the tiny test models of ``tests/published.py``
into ``tests/refs/published.json`` (and, with ``--gemma FILE``, on the published Gemma 3 270M
Q4_K_M file into ``tests/refs/gemma3_270m.json``). CI has no llama.cpp: the tests compare with
these files.

Run once, with llama-cpp-python's bindings over a llama.cpp build (docs/quantization.md)::

    PYTHONPATH=src:tests:/work/llama/py LLAMA_CPP_LIB_PATH=/work/llama/build/bin \\
        python tests/refs/record_published.py --gemma /work/models/gemma-3-270m-q4_k_m.gguf

One thread, the prompt evaluated as one batch, then one token at a time (as the tests decode).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np

# The bindings import diskcache for a prompt cache we do not use.
sys.modules.setdefault("diskcache", types.SimpleNamespace(Cache=object))  # type: ignore[arg-type]
import llama_cpp  # noqa: E402
from published import TINY, prompts, write_tiny  # noqa: E402

HERE = Path(__file__).resolve().parent
GREEDY = 16
GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
]
GEMMA_TOP = 64  # logits kept of each recorded row: llama.cpp's largest ones, by id


def run(
    model: str, ids: list[int], n_new: int, n_ctx: int
) -> tuple[np.ndarray, list[int], np.ndarray]:
    """(prompt rows' logits, greedy ids, each generated step's logits)."""
    llm = llama_cpp.Llama(
        model_path=model,
        logits_all=True,
        n_threads=1,
        n_threads_batch=1,
        n_ctx=n_ctx,
        verbose=False,
    )
    llm.eval(ids)
    rows = np.array(llm.scores[: len(ids)], dtype=np.float32)
    out: list[int] = []
    steps = []
    last = rows[-1]
    for _ in range(n_new):
        token = int(np.argmax(last))
        out.append(token)
        llm.eval([token])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        steps.append(last)
    return rows, out, np.array(steps)


def tiny() -> dict[str, Any]:
    refs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in TINY:
            path = Path(tmp) / f"{name}.gguf"
            sha = write_tiny(path, name)
            cases = []
            for ids in prompts(name):
                rows, out, steps = run(str(path), ids, GREEDY, 64)
                kept = np.stack([rows[0], rows[-1], steps[0]])  # first, last prompt row, step 1
                cases.append({"prompt": ids, "greedy": out, "logits": kept.round(4).tolist()})
            refs[name] = {"sha256": sha, "cases": cases}
            print(name, [c["greedy"] for c in cases])
    return refs


def gemma(path: str) -> dict[str, Any]:
    sha = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    llm = llama_cpp.Llama(model_path=path, n_threads=1, n_ctx=64, vocab_only=True, verbose=False)
    cases = []
    for text in GEMMA_PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        rows, out, _ = run(path, ids, GREEDY, 128)
        kept = []
        for r in (0, len(ids) - 1):
            top = np.argsort(-rows[r], kind="stable")[:GEMMA_TOP]
            kept.append({"row": r, "ids": top.tolist(), "logits": rows[r][top].round(4).tolist()})
        cases.append({"text": text, "prompt": ids, "greedy": out, "rows": kept})
        print(text, out)
    return {"sha256": sha, "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--gemma", help="the gemma-3-270m-q4_k_m.gguf file")
    args = parser.parse_args()
    (HERE / "published.json").write_text(json.dumps(tiny(), separators=(",", ":")) + "\n")
    if args.gemma:
        (HERE / "gemma3_270m.json").write_text(json.dumps(gemma(args.gemma), indent=1) + "\n")


if __name__ == "__main__":
    main()
