"""A tiny random Llama 3 model with Llama 3's real vocabulary: 128,256 byte-level BPE tokens
(``tokenizer.ggml.model = "gpt2"``, pre-tokenizer ``llama-bpe``) and Llama 3.1's chat template,
taken from llama.cpp's vocab-only file and template folder ($FOUNDRY_LLAMA_VOCAB_DIR, which
``.ci/run`` fetches). No download: ``write_tiny_bpe`` writes it with the ``gguf`` package.

The layers are random (2 layers, n_embd 64, 4 query heads over 2 KV heads), but one answer is
planted, so that the end of a turn is reached on purpose: a bigram chain from the last token of
the chat template's generation prompt (``"\\n\\n"`` after ``<|end_header_id|>``) through
``The capital is Paris.`` to ``<|eot_id|>``, which is an end-of-generation token but not the
file's EOS (``<|end_of_text|>``). Each chain token's embedding is a large multiple of a basis
direction kept for it (the last dimensions: no other embedding and no layer output writes
there), and the output row of the next token reads that direction alone. Every other token's
output row is zero in those directions, so text that is not on the chain never steps onto it
greedily, and a greedy generation from anything else runs until its limit.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import gguf
import numpy as np
from procs import missing

from foundry.model.formats.gguf_meta import read_metadata

VOCAB_DIR = Path(
    os.environ.get(
        "FOUNDRY_LLAMA_VOCAB_DIR",
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "foundry" / "llama-vocab",
    )
)
VOCAB_FILE = "ggml-vocab-llama-bpe.gguf"
TEMPLATE_FILE = "templates/meta-llama-Llama-3.1-8B-Instruct.jinja"

# The planted answer, as byte-level BPE pieces ("Ġ" is a space, "Ċ" a newline).
CHAIN = ("ĊĊ", "The", "Ġcapital", "Ġis", "ĠParis", ".", "<|eot_id|>")
ANSWER = "The capital is Paris."
EOT = "<|eot_id|>"
N_CTX = 256
N_EMBD = 64
N_LAYER = 2
N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF = 4, 2, 16, 96
# A chain token's embedding (A) dwarfs the layers' outputs; its successor's logit (B x 8 after
# the final norm) dwarfs the largest of 128k random logits (about 4.5 sigma of 0.5 x 8).
A, B = 50.0, 6.0

QT = gguf.GGMLQuantizationType


def vocab_path(name: str) -> Path:
    path = VOCAB_DIR / name
    if not path.exists():
        missing(
            f"{path} is missing: .ci/run fetches llama.cpp's vocab files (or set "
            "FOUNDRY_LLAMA_VOCAB_DIR to a llama.cpp models/ folder)"
        )
    return path


def write_tiny_bpe(path: Path, seed: int = 7) -> Path:
    """Write the model to ``path`` (about 17 MB: the two 128k-row matrices are Q8_0)."""
    meta = read_metadata(vocab_path(VOCAB_FILE))
    template = vocab_path(TEMPLATE_FILE).read_text(encoding="utf-8")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    n_vocab = len(tokens)
    ids = {t: i for i, t in enumerate(tokens)}
    chain = [ids[t] for t in CHAIN]
    rng = np.random.default_rng(seed)
    d, q, kv = N_EMBD, N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    kept = d - (len(chain) - 1)  # dimensions kept..d-1: one per chain step

    a = "llama"
    w = gguf.GGUFWriter(path, a)
    w.add_name("tiny-llama3-bpe")
    w.add_uint32(f"{a}.context_length", N_CTX)
    w.add_uint32(f"{a}.embedding_length", d)
    w.add_uint32(f"{a}.block_count", N_LAYER)
    w.add_uint32(f"{a}.feed_forward_length", N_FF)
    w.add_uint32(f"{a}.attention.head_count", N_HEAD)
    w.add_uint32(f"{a}.attention.head_count_kv", N_HEAD_KV)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{a}.rope.freq_base", 500000.0)
    w.add_uint32(f"{a}.rope.dimension_count", HEAD_DIM)
    w.add_uint32(f"{a}.vocab_size", n_vocab)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(list(meta["tokenizer.ggml.token_type"]))
    w.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    w.add_bos_token_id(int(meta["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(meta["tokenizer.ggml.eos_token_id"]))
    w.add_chat_template(template)

    def q8(name: str, value: np.ndarray) -> None:
        w.add_tensor(
            name, gguf.quants.quantize(value.astype(np.float32), QT.Q8_0), raw_dtype=QT.Q8_0
        )

    def rand(shape: tuple[int, ...], scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def vector(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32))

    embd = rand((n_vocab, d), 0.5)
    embd[:, kept:] = 0.0
    out = rand((n_vocab, d), 0.5)
    out[:, kept:] = 0.0
    for step, (here, after) in enumerate(itertools.pairwise(chain)):
        embd[here, kept + step] = A
        out[after] = 0.0
        out[after, kept + step] = B
    q8("token_embd.weight", embd)
    for i in range(N_LAYER):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", d)
        w.add_tensor(b + "attn_q.weight", rand((q, d), 0.3))
        w.add_tensor(b + "attn_k.weight", rand((kv, d), 0.3))
        w.add_tensor(b + "attn_v.weight", rand((kv, d), 0.3))
        attn_out = rand((d, q), 0.2)
        attn_out[kept:] = 0.0  # no layer writes into the chain's directions
        w.add_tensor(b + "attn_output.weight", attn_out)
        vector(b + "ffn_norm.weight", d)
        w.add_tensor(b + "ffn_gate.weight", rand((N_FF, d), 0.3))
        w.add_tensor(b + "ffn_up.weight", rand((N_FF, d), 0.3))
        down = rand((d, N_FF), 0.2)
        down[kept:] = 0.0
        w.add_tensor(b + "ffn_down.weight", down)
    vector("output_norm.weight", d)
    q8("output.weight", out)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
