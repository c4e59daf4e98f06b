"""Quantized model files: kept in their stored type in memory, the engine against the float32
reference, block-aligned tensor-parallel cuts, and the files ``foundry export --type``
writes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from quant_weights import KQUANTS, perturbed, random_blocks

from foundry.model.formats.gguf_io import (
    block_sizes,
    load_gguf,
    load_gguf_stored,
    save_gguf,
    values_by_type,
)
from foundry.model.formats.gguf_model import storage_type
from foundry.model.infer.inference import Engine
from foundry.model.infer.kv_cache import KVCache
from foundry.model.kernels import quant
from foundry.model.kernels.quant import QTensor, QType
from foundry.model.kernels.types import TYPES
from foundry.model.shard.slices import heads_note, rank_weights
from foundry.model.shard.table import ExpertSplit, SplitError
from foundry.model.spec.config import ModelConfig
from foundry.tp.handshake import expert_split_for, identity_for, load_rank

CFG = ModelConfig(n_ctx=64)


@pytest.mark.parametrize(
    ("dtype", "big", "head"),
    [
        ("f16", QType.F16, QType.F16),
        ("q8_0", QType.Q8_0, QType.Q8_0),
        ("q4_0", QType.Q4_0, QType.Q8_0),
    ],
)
def test_quantized_files_keep_their_type_in_memory(
    tmp_path: Path, dtype: str, big: QType, head: QType
) -> None:
    path = tmp_path / f"m-{dtype}.gguf"
    save_gguf(path, CFG, perturbed(CFG), dtype=dtype)  # type: ignore[arg-type]
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == types["token_embd.weight"] == big
    assert types["output.weight"] == head
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_norm.weight"] == QType.F32
    m = load_gguf_stored(path)
    held = sum(p.nbytes for p in m.params.values())
    data = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert held == data and held > 0.95 * path.stat().st_size - 16384
    w = m.params["blk.1.attn_q.weight"]
    assert isinstance(w, QTensor) and w.qtype == big
    assert isinstance(m.params["blk.1.ffn_norm.weight"], np.ndarray)
    assert identity_for(path, m.cfg, 64).quant_bits == TYPES[big].nominal_bits
    # load_gguf still gives float32 (training, the reference engine), the same values.
    f32 = load_gguf(path).params["blk.1.attn_q.weight"]
    np.testing.assert_array_equal(f32, w.dequantize())


def test_storage_type_falls_back_to_f16_where_rows_are_not_whole_blocks() -> None:
    assert storage_type("q8_0", "blk.0.attn_q.weight", (48, 48)) == QType.F16
    assert storage_type("q4_0", "output.weight", (259, 64)) == QType.Q8_0
    assert storage_type("q4_0", "blk.0.ffn_gate_inp.weight", (4, 64)) == QType.F32


def test_a_file_with_k_quants_loads_as_stored(tmp_path: Path) -> None:
    """The types llama-quantize's Q4_K_M gives rows of 256 (Q4_K, Q5_K, Q6_K) beside Q8_0."""
    cfg = ModelConfig(
        n_ctx=32,
        n_embd=256,
        n_layer=1,
        n_head=4,
        n_head_kv=2,
        n_ff=256,
        n_expert=2,
        n_expert_used=1,
    )
    params: dict[str, quant.Param] = dict(perturbed(cfg))
    kinds = {
        "attn_q": QType.Q4_K,
        "attn_output": QType.Q5_K,
        "ffn_down_exps": QType.Q6_K,
        "attn_v": QType.Q8_0,
    }
    for name, shape in cfg.param_shapes().items():
        kind = next((q for key, q in kinds.items() if f".{key}." in name), None)
        if kind in KQUANTS:
            rows = int(np.prod(shape[:-1]))
            blocks = random_blocks(kind, rows, shape[-1], seed=len(name))
            params[name] = QTensor(kind, shape, blocks.data.reshape(*shape[:-1], -1))
        elif kind is not None:
            params[name] = quant.quantize(params[name], kind)  # type: ignore[arg-type]
    path = tmp_path / "mixed.gguf"
    save_gguf(path, cfg, params)
    assert values_by_type(path)[QType.Q6_K] == 2 * 256 * 256
    stored_model = load_gguf_stored(path)
    reference = Engine(cfg, load_gguf(path).params)
    engine = Engine(cfg, stored_model.params)
    prompt = [5, 17, 200, 33]
    got = engine.decode(engine.new_session(), prompt)
    want = reference.decode(reference.new_session(), prompt)
    # Q8_0 multiplies int8 inputs: about 1% of the largest logit; the K-quants add rounding.
    np.testing.assert_allclose(got, want, rtol=0, atol=0.03 * np.abs(want).max())


@pytest.mark.parametrize(("dtype", "atol"), [("f16", 1e-5), ("q8_0", 0.02), ("q4_0", 0.02)])
def test_engine_on_a_quantized_file_tracks_the_f32_reference(
    tmp_path: Path, dtype: str, atol: float
) -> None:
    """The same file through the f32 engine (dequantized at load) and the stored-type engine:
    F16 differs by rounding only; Q8_0 and Q4_0 also by the int8 inputs (which can flip a
    close routing decision: hence the median over positions). Both with a float32 cache (a
    stored file's default is float16): the products are what is compared."""
    path = tmp_path / "m.gguf"
    save_gguf(path, CFG, perturbed(CFG), dtype=dtype)  # type: ignore[arg-type]
    reference = Engine(CFG, load_gguf(path).params)
    engine = Engine(CFG, load_gguf_stored(path).params, kv_cache=KVCache.F32)
    prompt = list(range(10, 40))
    want = reference.decode(reference.new_session(), prompt)
    got = engine.decode(engine.new_session(), prompt)
    relative = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)  # per position
    assert np.median(relative) <= atol, relative
    assert (np.argmax(got, axis=1) == np.argmax(want, axis=1)).mean() >= 0.9


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("mode", list(ExpertSplit))
def test_a_block_gives_the_bits_of_one_row_decoding(
    tmp_path: Path, dtype: str, mode: ExpertSplit
) -> None:
    """Speculative decoding verifies drafts as one block and keeps a token only where the
    block's logits choose it; greedy output is plain decoding's only if every row of a block
    has the bits the one-row pass would give. The int8 inputs make that strict: a float32 part
    (attention, router) off by one bit can round an input value the other way, a jump of
    1/254 of its block's largest value, which later layers carry on."""
    path = tmp_path / "m.gguf"
    save_gguf(path, CFG, perturbed(CFG), dtype=dtype)  # type: ignore[arg-type]
    engine = Engine(CFG, load_gguf_stored(path).params, expert_split=mode)
    prompt, tokens = list(range(10, 30)), [int(t) for t in np.arange(40, 56) * 7 % CFG.n_vocab]
    one = engine.new_session()
    engine.decode(one, prompt)
    rows = np.concatenate([engine.decode(one, [t]) for t in tokens])  # (16, V)
    block = engine.new_session()
    engine.decode(block, prompt)
    blocks = np.concatenate([engine.decode(block, tokens[:5]), engine.decode(block, tokens[5:])])
    np.testing.assert_array_equal(blocks, rows)


def test_kv_heads_whose_columns_cut_a_block_are_handed_out_in_groups(tmp_path: Path) -> None:
    """Three heads of 16 values a kv head: a rank's 48 attn_output columns would not be whole
    blocks of 32. Cut by hand so, the part is refused naming the tensor; the pair instead
    hands the kv heads out in groups that fill whole blocks (both to rank 0 here), rank 1
    holds no heads, and one process standing for that pair decodes the whole model's tokens
    with logits close to it (the FFN and vocabulary still cut; a zero attention partial)."""
    cfg = ModelConfig(n_ctx=32, n_embd=96, n_head=6, n_head_kv=2, n_ff=128)
    path = tmp_path / "m.gguf"
    save_gguf(path, cfg, perturbed(cfg), dtype="q8_0")
    params = load_gguf_stored(path).params
    with pytest.raises(SplitError, match=r"blk\.0\.attn_output\.weight \(Q8_0, blocks of 32"):
        rank_weights(cfg, params, 0, 2)
    held = [load_rank(path, r, expert_split=ExpertSplit.EXPERTS).weights.layout for r in (0, 1)]
    assert [(lay.heads, lay.kv_heads) for lay in held] == [((0, 6), (0, 2)), ((6, 6), (2, 2))]
    assert heads_note(cfg, (1, 1), block_sizes(path)) == (  # what the leader logs
        "kv heads 2 at a time (a kv head's 48 columns of attn_output would cut its blocks of "
        "32); rank 1 holds no heads"
    )
    whole_blocks = tmp_path / "whole.gguf"  # 2 heads of 16 a kv head: 32 columns, a block
    save_gguf(whole_blocks, ModelConfig(n_ctx=32), perturbed(ModelConfig(n_ctx=32)), dtype="q8_0")
    assert heads_note(ModelConfig(n_ctx=32), (1, 1), block_sizes(whole_blocks)) == ""
    pair, whole = Engine(cfg, params), Engine(cfg, params, shares=(1,))
    assert [p.layout.heads for p in pair.parts] == [(0, 6), (6, 6)] and len(whole.parts) == 1
    assert pair.layers_in_c == cfg.n_layer  # the part without heads in the C step too
    a, b = pair.new_session(), whole.new_session()
    x, y = pair.decode(a, list(range(10, 30))), whole.decode(b, list(range(10, 30)))
    for t in range(8):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
        assert int(x[-1].argmax()) == int(y[-1].argmax())
        x, y = pair.decode(a, [40 + t]), whole.decode(b, [40 + t])


def test_a_rank_without_heads_loads_and_decodes_k_quants(tmp_path: Path) -> None:
    """Two query heads of 32 a kv head: 64 attn_output columns of Q4_K's 256. The pair puts
    all 4 kv heads on rank 0; rank 1's Q, K and V rows (Q4_K, and Q6_K for V, whose block
    scale sits at byte 208) and output columns are empty slices, which load and check, and
    one process standing for the pair decodes as the whole model does."""
    cfg = ModelConfig(
        n_ctx=32, n_embd=256, n_layer=1, n_head=8, n_head_kv=4, n_ff=256, n_expert=2,
        n_expert_used=1,
    )  # fmt: skip
    params: dict[str, quant.Param] = dict(perturbed(cfg))
    kinds = {"attn_q": QType.Q4_K, "attn_k": QType.Q4_K, "attn_v": QType.Q6_K}
    kinds["attn_output"] = QType.Q4_K
    for name, shape in cfg.param_shapes().items():
        kind = next((q for key, q in kinds.items() if f".{key}." in name), None)
        if kind is not None:
            blocks = random_blocks(kind, shape[0], shape[1], seed=len(name))
            params[name] = blocks
    path = tmp_path / "kquant.gguf"
    save_gguf(path, cfg, params)
    held = [load_rank(path, r, expert_split=ExpertSplit.EXPERTS).weights for r in (0, 1)]
    assert [w.layout.heads for w in held] == [(0, 8), (8, 8)]
    assert held[1].params["blk.0.attn_v.weight"].shape == (0, 256)
    assert held[1].params["blk.0.attn_output.weight"].shape == (256, 0)
    assert held[1].params["blk.0.attn_output.weight"].dequantize().shape == (256, 0)
    stored_model = load_gguf_stored(path)
    pair = Engine(cfg, stored_model.params)
    whole = Engine(cfg, stored_model.params, shares=(1,))
    assert len(pair.parts) == 2 and pair.layers_in_c == whole.layers_in_c == 1
    a, b = pair.new_session(), whole.new_session()
    x, y = pair.decode(a, [5, 17, 200, 33]), whole.decode(b, [5, 17, 200, 33])
    for _ in range(4):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
        x, y = pair.decode(a, [int(x[-1].argmax())]), whole.decode(b, [int(y[-1].argmax())])


def test_auto_expert_split_follows_the_files_blocks(tmp_path: Path) -> None:
    """'auto' cuts every expert in halves where the halves are whole blocks (128 rows of
    Q8_0, or float32), and whole experts where they are not (96 rows: 48 a rank); a world
    whose cut falls inside a block is refused before anything loads, naming what fits."""
    odd = ModelConfig(n_ctx=64, n_ff=96)
    cases = [(CFG, "q8_0", ExpertSplit.INTERMEDIATE), (odd, "f32", ExpertSplit.INTERMEDIATE)]
    cases.append((odd, "q8_0", ExpertSplit.EXPERTS))
    for i, (cfg, dtype, want) in enumerate(cases):
        path = tmp_path / f"m{i}.gguf"
        save_gguf(path, cfg, perturbed(cfg), dtype=dtype)  # type: ignore[arg-type]
        split, why = expert_split_for(path)
        assert split is want, why
        load_rank(path, 1, expert_split=split)  # the pick loads
    assert why == (
        "intermediate would cut blk.0.ffn_down_exps.weight (96 columns) inside its blocks of 32"
    )
    with pytest.raises(SplitError) as err:
        load_rank(path, 0, expert_split=ExpertSplit.INTERMEDIATE)
    assert str(err.value) == (
        "cannot split blk.0.ffn_down_exps.weight (96 columns, stored in blocks of 32) over 2 "
        "ranks with shares 1,1: a rank's columns would start or end inside a block; "
        "--expert-split experts fits, or use a file of another quantization type, or f16/f32"
    )


def test_intermediate_split_cuts_down_projections_on_blocks(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    save_gguf(path, CFG, perturbed(CFG), dtype="q4_0")
    half = load_rank(path, 1, expert_split=ExpertSplit.INTERMEDIATE)
    down = half.weights.params["blk.0.ffn_down_exps.weight"]
    assert isinstance(down, QTensor) and down.shape == (CFG.n_expert, CFG.n_embd, CFG.n_ff // 2)
    full = load_gguf_stored(path).params["blk.0.ffn_down_exps.weight"]
    assert isinstance(full, QTensor)
    np.testing.assert_array_equal(down.dequantize(), full.dequantize()[..., CFG.n_ff // 2 :])
    assert half.identity.quant_bits == 4


def test_export_type_writes_a_quantized_file_generate_reads(tmp_path: Path) -> None:
    from foundry.model.formats.checkpoint import CheckpointState
    from foundry.model.formats.checkpoint_dir import save_checkpoint
    from foundry.model.train.optim import AdamW

    params = perturbed(CFG)
    ckpt = save_checkpoint(
        tmp_path / "ckpt",
        CheckpointState(
            config=CFG,
            step=3,
            params=params,
            optimizer=AdamW(params).state_dict(),
            data_position=0,
        ),
    )
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    out = tmp_path / "m-q8.gguf"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "export",
            "--checkpoint",
            str(ckpt),
            "--out",
            str(out),
            "--type",
            "q8_0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == 7  # MOSTLY_Q8_0
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "foundry",
            "generate",
            "--model",
            str(out),
            "--prompt",
            "The ",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert gen.returncode == 0, gen.stderr
    assert len(gen.stdout) > 1


def test_a_rank_holds_its_stored_weights_once(tmp_path: Path) -> None:
    """The engine's stacked Q/K/V and gate/up buffers replace the loaded tensors in the rank's
    own params (views of the same bytes), so the loaded model is not held a second time."""
    path = tmp_path / "m.gguf"
    save_gguf(path, CFG, perturbed(CFG), dtype="q8_0")
    half = load_rank(path, 0)
    engine = Engine(CFG, half.weights, rank=0, world=2)
    gate = half.weights.params["blk.1.ffn_gate_exps.weight"]
    q = half.weights.params["blk.1.attn_q.weight"]
    assert isinstance(gate, QTensor) and isinstance(q, QTensor)
    assert np.shares_memory(gate.data, engine.fused[0]["blk.1.gate_up"].data)
    assert np.shares_memory(q.data, engine.fused[0]["blk.1.qkv"].data)
    held = {id(b): b.nbytes for b in (_base(p) for p in half.weights.params.values())}
    stored_bytes = sum(p.nbytes for p in half.weights.params.values())
    assert sum(held.values()) == stored_bytes


def _base(p: quant.Param) -> np.ndarray:
    a = p.data if isinstance(p, QTensor) else p
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a
