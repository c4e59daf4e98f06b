"""Tiny random GGUF files in each published architecture, written with the ``gguf`` package.

``write_tiny(path, name)`` writes the same bytes every time (fixed seed per architecture, fixed
key and tensor order), so ``tests/refs/published.json`` (llama.cpp's greedy tokens and logits
on these files, recorded by ``tests/refs/record_published.py``) stays valid; the JSON keeps
each file's sha256 and the tests check it first.

The shapes are the uneven ones published files have: 9 query heads over 3 kv heads, a single
kv head, odd vocabulary sizes, head sizes that are not n_embd / n_head, a tied output head,
sliding-window layers with a window shorter than the prompts.

The matrices are float32 (an untied ``token_embd`` Q8_0, read by row lookup only): llama.cpp
then multiplies in float32 as we do, so the comparison checks each graph's maths to float
accuracy. On block-quantized weights llama.cpp rounds each activation block to int8 with a
float16 scale and our kernels with a float32 scale, a difference of about 1 % of the logits
after a few layers that would hide a wrong graph; ``tests/test_published_gemma.py`` covers the
quantized path on the real file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Tiny:
    arch: str
    seed: int
    n_vocab: int
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 96
    n_expert: int = 0
    n_expert_used: int = 0
    tied: bool = False
    rope_freqs: bool = False  # Llama 3's per-pair rope factors
    keys: dict[str, Any] = field(default_factory=dict)  # extra metadata (arch-prefixed)


TINY: dict[str, Tiny] = {
    t.arch if t.arch != "llama" or not t.n_expert else "llama-moe": t
    for t in (
        Tiny("llama", 11, n_vocab=301, n_head=4, n_head_kv=4, rope_freqs=True),
        Tiny("llama", 12, n_vocab=263, n_head=4, n_head_kv=2, n_ff=64, n_expert=4, n_expert_used=2),
        Tiny("qwen2", 13, n_vocab=317, n_head=4, n_head_kv=2, tied=True),
        Tiny("qwen3", 14, n_vocab=289, n_head=9, n_head_kv=3, head_dim=32),
        Tiny(
            "qwen3moe", 15, n_vocab=271, n_head=4, n_head_kv=1, n_ff=32, n_expert=4, n_expert_used=2
        ),
        Tiny(
            "gemma3",
            16,
            n_vocab=293,
            n_layer=7,
            n_head=4,
            n_head_kv=1,
            head_dim=32,
            tied=True,
            keys={"attention.sliding_window": 5},
        ),
        Tiny("olmoe", 17, n_vocab=283, n_head=4, n_head_kv=4, n_ff=32, n_expert=4, n_expert_used=2),
    )
}
"""Each test model by the name the references use."""


def _tokens(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary llama.cpp loads: <unk> <s> </s>, the 256 byte tokens, then
    plain pieces up to n_vocab."""
    tt = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [int(tt.UNKNOWN), int(tt.CONTROL), int(tt.CONTROL), *[int(tt.BYTE)] * 256]
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n_vocab:
        tokens.append("\u2581" + letters[i % 26] + letters[(i // 26) % 26])
        types.append(int(tt.NORMAL))
        i += 1
    scores = [0.0] * 3 + [0.0] * 256 + [-float(j) for j in range(n_vocab - 259)]
    return tokens, scores, types


def write_tiny(path: Path, name: str) -> str:
    """Write test model ``name`` to ``path``; returns the file's sha256 (hex)."""
    t = TINY[name]
    rng = np.random.default_rng(t.seed)
    a = t.arch
    w = gguf.GGUFWriter(path, a)
    w.add_name(f"tiny-{name}")
    w.add_uint32(f"{a}.context_length", 128)
    w.add_uint32(f"{a}.embedding_length", t.n_embd)
    w.add_uint32(f"{a}.block_count", t.n_layer)
    w.add_uint32(f"{a}.feed_forward_length", t.n_ff)
    w.add_uint32(f"{a}.attention.head_count", t.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", t.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", t.head_dim)
    w.add_uint32(f"{a}.attention.value_length", t.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{a}.rope.freq_base", 1e6 if a == "gemma3" else 10000.0)
    w.add_uint32(f"{a}.rope.dimension_count", t.head_dim)
    if t.n_expert:
        w.add_uint32(f"{a}.expert_count", t.n_expert)
        w.add_uint32(f"{a}.expert_used_count", t.n_expert_used)
        if a == "qwen3moe":
            w.add_uint32(f"{a}.expert_feed_forward_length", t.n_ff)
    for key, value in t.keys.items():
        w.add_uint32(f"{a}.{key}", value)
    tokens, scores, types = _tokens(t.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    d, dh, q, kv, ff = t.n_embd, t.head_dim, t.head_dim * t.n_head, t.head_dim * t.n_head_kv, t.n_ff

    def matrix(tname: str, shape: tuple[int, ...], scale: float, q8: bool = False) -> None:
        value = (rng.standard_normal(shape) * scale).astype(np.float32)
        if q8:  # read by row lookup only: exact in both engines
            w.add_tensor(tname, gguf.quants.quantize(value, QT.Q8_0), raw_dtype=QT.Q8_0)
        else:
            w.add_tensor(tname, value)

    def vector(tname: str, n: int, center: float = 1.0, scale: float = 0.1) -> None:
        w.add_tensor(tname, (center + rng.standard_normal(n) * scale).astype(np.float32))

    matrix("token_embd.weight", (t.n_vocab, d), 0.05 if a == "gemma3" else 0.5, not t.tied)
    if t.rope_freqs:  # factors 1 for the fast pairs up to 8 for the slow ones, as Llama 3's
        w.add_tensor("rope_freqs.weight", np.geomspace(1.0, 8.0, dh // 2).astype(np.float32))
    for i in range(t.n_layer):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", d)
        matrix(b + "attn_q.weight", (q, d), 0.3)
        matrix(b + "attn_k.weight", (kv, d), 0.3)
        matrix(b + "attn_v.weight", (kv, d), 0.3)
        if a == "qwen2":
            vector(b + "attn_q.bias", q, 0.0, 0.5)
            vector(b + "attn_k.bias", kv, 0.0, 0.5)
            vector(b + "attn_v.bias", kv, 0.0, 0.5)
        if a in ("qwen3", "qwen3moe", "gemma3"):
            vector(b + "attn_q_norm.weight", dh)
            vector(b + "attn_k_norm.weight", dh)
        if a == "olmoe":
            vector(b + "attn_q_norm.weight", q)
            vector(b + "attn_k_norm.weight", kv)
        matrix(b + "attn_output.weight", (d, q), 0.2)
        if a == "gemma3":
            vector(b + "post_attention_norm.weight", d)
        vector(b + "ffn_norm.weight", d)
        if t.n_expert:
            w.add_tensor(
                b + "ffn_gate_inp.weight",
                (rng.standard_normal((t.n_expert, d)) * 0.5).astype(np.float32),
            )
            matrix(b + "ffn_gate_exps.weight", (t.n_expert, ff, d), 0.3)
            matrix(b + "ffn_up_exps.weight", (t.n_expert, ff, d), 0.3)
            matrix(b + "ffn_down_exps.weight", (t.n_expert, d, ff), 0.2)
        else:
            matrix(b + "ffn_gate.weight", (ff, d), 0.3)
            matrix(b + "ffn_up.weight", (ff, d), 0.3)
            matrix(b + "ffn_down.weight", (d, ff), 0.2)
        if a == "gemma3":
            vector(b + "post_ffw_norm.weight", d)
    vector("output_norm.weight", d)
    if not t.tied:
        matrix("output.weight", (t.n_vocab, d), 0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prompts(name: str) -> list[list[int]]:
    """Two prompts of token ids (BOS first) for a test model: 9 and 14 tokens."""
    rng = np.random.default_rng(TINY[name].seed + 100)
    n_vocab = TINY[name].n_vocab
    return [[1, *(int(x) for x in rng.integers(3, n_vocab, n))] for n in (8, 13)]
