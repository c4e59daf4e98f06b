"""Greedy text of a model's f32 file against the same model in other stored types.

    OPENBLAS_NUM_THREADS=1 python bench/quality/greedy.py MODEL-f32.gguf MODEL-q8_0.gguf [...]
        [--prompt "The "] [--tokens 64]

For each other file: the tokens greedy decoding gives after the prompt (each file in its
stored type, as ``foundry generate`` runs it), the first position where they differ from the
f32 file's, and the largest difference of the logits over the positions before it, absolute
and relative to each row's largest logit. Target (issue 16): Q8_0 identical for at least 32
tokens of the demo prompt on the trained demo model.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import argparse
from pathlib import Path

import numpy as np
import numpy.typing as npt

from foundry.model.formats.gguf_io import load_gguf_stored
from foundry.model.infer.inference import Engine
from foundry.model.text.vocab.byte import decode, encode

TARGET = 32


def greedy(path: Path, prompt: str, n: int) -> tuple[list[int], npt.NDArray[np.float32]]:
    m = load_gguf_stored(path)
    engine = Engine(m.cfg, m.params)
    s = engine.new_session()
    rows = [engine.decode(s, [int(t) for t in encode(prompt, bos=True)])[-1]]
    tokens = [int(np.argmax(rows[-1]))]
    while len(tokens) < n:
        rows.append(engine.decode(s, [tokens[-1]])[-1])
        tokens.append(int(np.argmax(rows[-1])))
    return tokens, np.stack(rows)


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("reference", type=Path, help="the f32 file")
    ap.add_argument("others", type=Path, nargs="+", help="the same model in other types")
    ap.add_argument("--prompt", default="The ", help="the demo prompt of `foundry up`")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    ref, ref_logits = greedy(args.reference, args.prompt, args.tokens)
    print(f"{args.reference.name}: {decode(ref)!r}")
    ok = True
    for path in args.others:
        got, logits = greedy(path, args.prompt, args.tokens)
        first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
        same = len(ref) if first is None else first
        diff = np.abs(logits[: same + 1] - ref_logits[: same + 1])  # up to the first choice apart
        rel = diff.max(axis=1) / np.abs(ref_logits[: same + 1]).max(axis=1)
        verdict = ""
        if "q8_0" in path.name:
            passed = same >= min(TARGET, args.tokens)
            ok = ok and passed
            verdict = f"  (target: {TARGET} identical) {'PASS' if passed else 'FAIL'}"
        where = "identical" if first is None else f"first differs at token {first}"
        print(
            f"{path.name}: {where} ({same} of {len(ref)} the same); logits up to there: "
            f"largest difference {diff.max():.4f}, {rel.max():.2%} of the row's largest "
            f"logit{verdict}"
        )
        print(f"  {decode(got)!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
