"""Dense GGUF files with random weights in a published architecture, written with the ``gguf``
package: the shapes of a real model without its download, for timing (the speed of a product
depends on the types and shapes, not the values).

- ``write_dense(path, shape)``: a llama- or qwen3-architecture file, its matrices in f32 or
  f16, the norms f32, a SentencePiece vocabulary of the 256 byte tokens and plain pieces.
  Returns its parameter count.
- ``LLAMA_3B``: Llama 3.2 3B's shapes (3.2B parameters, tied output head, a 128,256-token
  vocabulary); ``llama_3b_q4_k_m(folder, llama_cpp)`` writes it once in f16 and has
  ``llama-quantize`` make the Q4_K_M file (about 2 GB) beside it.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # "llama" or "qwen3" (QK-norm)
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float = 1e6
    n_ctx: int = 512
    name: str = "bench"


LLAMA_3B = Shape(
    "llama",
    n_vocab=128256,
    n_embd=3072,
    n_layer=28,
    n_ff=8192,
    n_head=24,
    n_head_kv=8,
    head_dim=128,
    rope_base=500000.0,
    n_ctx=4096,
    name="llama-3b-shaped",
)


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    tt = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [int(tt.UNKNOWN), int(tt.CONTROL), int(tt.CONTROL), *[int(tt.BYTE)] * 256]
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    i = 0
    while len(tokens) < n_vocab:
        piece, k = "\u2581", i
        while True:  # as many letters as i needs: every piece distinct
            piece += letters[k % 26]
            k //= 26
            if k == 0:
                break
        tokens.append(piece)
        types.append(int(tt.NORMAL))
        i += 1
    return tokens, [0.0] * 259 + [-float(j) for j in range(n_vocab - 259)], types


def write_dense(path: Path, s: Shape, dtype: type[np.floating] = np.float32, seed: int = 0) -> int:
    """Write ``s`` to ``path`` (matrices in ``dtype``, the norms f32, the output head tied to
    the embedding); returns its parameter count."""
    rng = np.random.default_rng(seed)
    a, dh = s.arch, s.head_dim
    w = gguf.GGUFWriter(path, a)
    w.add_name(s.name)
    for key, value in (
        ("context_length", s.n_ctx),
        ("embedding_length", s.n_embd),
        ("block_count", s.n_layer),
        ("feed_forward_length", s.n_ff),
        ("attention.head_count", s.n_head),
        ("attention.head_count_kv", s.n_head_kv),
        ("attention.key_length", dh),
        ("attention.value_length", dh),
        ("rope.dimension_count", dh),
    ):
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6 if a == "qwen3" else 1e-5)
    w.add_float32(f"{a}.rope.freq_base", s.rope_base)
    tokens, scores, types = _vocab(s.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    total = 0

    def tensor(name: str, shape: tuple[int, ...], scale: float, center: float = 0.0) -> None:
        nonlocal total
        value = rng.standard_normal(shape, dtype=np.float32)
        value *= scale
        value += center
        w.add_tensor(name, value if len(shape) == 1 else value.astype(dtype))
        total += int(np.prod(shape))

    d, q, kv = s.n_embd, s.n_head * dh, s.n_head_kv * dh
    tensor("token_embd.weight", (s.n_vocab, d), 0.02)
    for layer in range(s.n_layer):
        b = f"blk.{layer}."
        tensor(b + "attn_norm.weight", (d,), 0.05, 1.0)
        tensor(b + "attn_q.weight", (q, d), d**-0.5)
        tensor(b + "attn_k.weight", (kv, d), d**-0.5)
        tensor(b + "attn_v.weight", (kv, d), d**-0.5)
        if a == "qwen3":
            tensor(b + "attn_q_norm.weight", (dh,), 0.05, 1.0)
            tensor(b + "attn_k_norm.weight", (dh,), 0.05, 1.0)
        tensor(b + "attn_output.weight", (d, q), q**-0.5)
        tensor(b + "ffn_norm.weight", (d,), 0.05, 1.0)
        tensor(b + "ffn_gate.weight", (s.n_ff, d), d**-0.5)
        tensor(b + "ffn_up.weight", (s.n_ff, d), d**-0.5)
        tensor(b + "ffn_down.weight", (d, s.n_ff), s.n_ff**-0.5)
    tensor("output_norm.weight", (d,), 0.05, 1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


def llama_3b_q4_k_m(folder: Path, llama_cpp: Path) -> Path:
    """The Llama-3.2-3B-shaped file in Q4_K_M, written into ``folder`` once (f16 by
    ``write_dense``, then ``llama-quantize`` from llama.cpp's build folder ``llama_cpp``)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{LLAMA_3B.name}-q4_k_m.gguf"
    if out.exists():
        return out
    f16 = folder / f"{LLAMA_3B.name}-f16.gguf"
    t0 = time.perf_counter()
    if not f16.exists():
        n = write_dense(f16, LLAMA_3B, np.float16)
        print(f"  wrote {f16.name} ({n / 1e9:.2f}B parameters) in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run(
        [str(llama_cpp / "llama-quantize"), str(f16), str(tmp), "Q4_K_M"],
        check=True,
        capture_output=True,
    )
    tmp.rename(out)
    f16.unlink()
    print(f"  wrote {out.name} with llama-quantize in {time.perf_counter() - t0:.0f} s")
    return out
