"""A GGUF file rebuilt from its head (``bench/performance/shaped_gguf.py``): the same key/value
pairs, tensor table and size as the original as the ``gguf`` package reads them, every block's
scales finite, weights of order 0.01-0.1, and a file the engine loads and decodes.

The scripts' ``head`` and ``fill`` run as the benchmark machine runs them: as processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from published import write_tiny
from quant_weights import KQUANTS, perturbed, random_blocks

from foundry.model.formats.gguf_io import load_gguf_stored, save_gguf
from foundry.model.infer.inference import Engine
from foundry.model.kernels import quant
from foundry.model.kernels.quant import QTensor, QType
from foundry.model.kernels.types import TYPES
from foundry.model.spec.config import ModelConfig

PERFORMANCE = Path(__file__).resolve().parents[1] / "bench" / "performance"
sys.path.insert(0, str(PERFORMANCE))

import shaped_gguf  # noqa: E402

SCRIPT = PERFORMANCE / "shaped_gguf.py"
# Rows of 256: every type the engine reads, one weight each.
CFG = ModelConfig(
    n_ctx=32, n_embd=256, n_layer=1, n_head=4, n_head_kv=2, n_ff=256, n_expert=2, n_expert_used=1
)
KINDS = {
    "attn_q": QType.Q4_K,
    "attn_k": QType.Q8_0,
    "attn_v": QType.Q5_0,
    "attn_output": QType.Q5_K,
    "ffn_gate_exps": QType.Q4_0,
    "ffn_up_exps": QType.Q4_1,
    "ffn_down_exps": QType.Q6_K,
    "token_embd": QType.Q5_1,
    "output": QType.F16,
}


def _mixed(path: Path) -> None:
    """A file of Foundry's writer with every type the engine reads."""
    params: dict[str, quant.Param] = dict(perturbed(CFG))
    for name, shape in CFG.param_shapes().items():
        prefixes = {key: (f"{key}.", f"blk.0.{key}.") for key in KINDS}
        kind = next((q for key, q in KINDS.items() if name.startswith(prefixes[key])), None)
        value = params[name]
        assert isinstance(value, np.ndarray)
        if kind in KQUANTS:
            rows = int(np.prod(shape[:-1]))
            blocks = random_blocks(kind, rows, shape[-1])
            params[name] = QTensor(kind, shape, blocks.data.reshape(*shape[:-1], -1))
        elif kind is not None:
            params[name] = quant.quantize(value, kind)
    save_gguf(path, CFG, params)
    assert {t.tensor_type for t in gguf.GGUFReader(path).tensors} == {QType.F32, *KINDS.values()}


def _script(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def _layout(path: Path) -> tuple[object, ...]:
    """What gguf's reader sees of a file: every field's bytes, the tensor table, the size."""
    r = gguf.GGUFReader(path)
    fields = [(k, f.types, [bytes(p) for p in f.parts]) for k, f in r.fields.items()]
    tensors = [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in r.tensors]
    return r.data_offset, fields, tensors, path.stat().st_size


@pytest.mark.parametrize("kind", ["mixed", "gemma3"])
def test_head_and_fill_rebuild_the_layout_with_random_valid_weights(
    tmp_path: Path, kind: str
) -> None:
    src, head, out = tmp_path / "src.gguf", tmp_path / "src.head", tmp_path / "out.gguf"
    _mixed(src) if kind == "mixed" else write_tiny(src, kind)
    assert _script("head", src, head).returncode == 0
    res = _script("fill", head, out, "--seed", "3")
    assert res.returncode == 0, res.stderr
    assert "random data" in res.stdout
    assert _layout(out) == _layout(src)
    data_start = gguf.GGUFReader(src).data_offset
    assert head.read_bytes() == src.read_bytes()[:data_start]
    original = {t.name: t for t in gguf.GGUFReader(src).tensors}
    for t in gguf.GGUFReader(out).tensors:
        qtype = QType(t.tensor_type)
        assert bytes(t.data) != bytes(original[t.name].data), t.name  # the values are new
        if qtype == QType.F32:
            values = np.asarray(t.data)
            want = 1.0 if "norm" in t.name else 0.0
            assert np.isfinite(values).all() and abs(float(values.mean()) - want) < 0.05, t.name
            continue
        if qtype != QType.F16:
            size = gguf.GGML_QUANT_SIZES[qtype][1]
            blocks = np.asarray(t.data).reshape(-1, size)
            for offset, value in shaped_gguf.BLOCKS[qtype].scales:
                scale = blocks[:, offset : offset + 2].copy().view("<f2").astype(np.float32)
                assert np.isfinite(scale).all() and (scale / value >= 0.74).all(), t.name
        w = gguf.quants.dequantize(np.asarray(t.data), qtype)
        assert np.isfinite(w).all() and 0.01 <= float(np.abs(w).mean()) <= 0.1, t.name
    # The engine refuses a NaN or infinite weight at load; it loads this one and decodes.
    m = load_gguf_stored(out)
    engine = Engine(m.cfg, m.params)
    logits = engine.decode(engine.new_session(), [1, 5, 17, 33])
    assert np.isfinite(logits).all() and float(logits.std()) > 0


@pytest.mark.parametrize("qtype", list(shaped_gguf.BLOCKS), ids=lambda q: q.name)
def test_every_block_type_holds_small_finite_weights(qtype: QType) -> None:
    """Each row of BLOCKS against the gguf package's dequantizer (ggml's layouts) and the
    engine's own table of scale fields (``types.TYPES``)."""
    blocks = shaped_gguf.random_blocks(np.random.default_rng(0), qtype, 512)
    assert blocks.shape == (512, gguf.GGML_QUANT_SIZES[qtype][1])
    w = gguf.quants.dequantize(blocks, qtype)
    assert np.isfinite(w).all()
    assert 0.01 <= float(np.abs(w).mean()) <= 0.1 and float(np.abs(w).max()) < 1.0
    assert abs(float(w.mean())) < 0.2 * float(np.abs(w).mean())  # centred on zero
    signed = shaped_gguf.BLOCKS[qtype].signed
    if signed is not None:  # int8 quants or scales: never -128, which no quantizer writes
        start, end, shift = signed
        q = blocks[:, start:end].view(np.int8)
        assert int(q.min()) == max(-127, -128 >> shift) and int(q.max()) == 127 >> shift
    if qtype in TYPES:
        offsets = tuple(offset for offset, _ in shaped_gguf.BLOCKS[qtype].scales)
        assert offsets == TYPES[qtype].scale_offsets
    assert set(TYPES) <= {*shaped_gguf.BLOCKS, *shaped_gguf.PLAIN}


@pytest.mark.parametrize("qtype", [QType.F16, QType.BF16], ids=lambda q: q.name)
def test_plain_types_hold_small_normal_values(qtype: QType) -> None:
    t = shaped_gguf.Tensor("blk.0.attn_q.weight", qtype, 4096, 0, 0)
    raw = shaped_gguf.random_values(np.random.default_rng(0), t, 4096)
    w = gguf.quants.dequantize(raw.view(np.uint8), qtype)
    assert np.isfinite(w).all() and 0.01 <= float(w.std()) <= 0.03


def test_bad_input_gets_one_line(tmp_path: Path) -> None:
    text = tmp_path / "text.gguf"
    text.write_text("not a GGUF file at all, but long enough for a header\n")
    iq = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(iq, "llama")
    size = gguf.GGML_QUANT_SIZES[QType.IQ2_XXS][1]
    w.add_tensor("w", np.zeros((4, size), np.uint8), raw_dtype=QType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(iq.read_bytes()[:-100])
    for args, says in (
        (("fill", text, tmp_path / "o"), "magic"),
        (("fill", iq, tmp_path / "o"), "tensor 'w' is IQ2_XXS, a type this script does not fill"),
        (("head", cut, tmp_path / "o"), "bytes, its tensor table needs"),
        (("head", tmp_path / "absent", tmp_path / "o"), "No such file"),
    ):
        res = _script(*args)
        assert res.returncode == 1 and res.stdout == "", res
        assert res.stderr.count("\n") == 1 and says in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "iq.gguf", "text.gguf"]
