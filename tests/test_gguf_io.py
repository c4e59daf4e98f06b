"""GGUF files: llama.cpp's names, shapes and keys; exact round trips; clear errors."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import pytest

from foundry.model.formats import gguf_io
from foundry.model.formats.gguf_io import load_gguf, load_gguf_stored, model_id, save_gguf
from foundry.model.formats.gguf_model import GGUFError
from foundry.model.kernels.quant import QTensor
from foundry.model.spec.config import ModelConfig

Params = dict[str, npt.NDArray[np.float32]]

CFG = ModelConfig(n_ctx=64, n_embd=32, n_layer=2, n_head=4, n_head_kv=2, n_ff=48, n_expert=4)
CFG_SHARED = ModelConfig(
    n_ctx=64,
    n_embd=32,
    n_layer=1,
    n_head=4,
    n_head_kv=4,
    n_ff=24,
    n_expert=2,
    n_expert_used=1,
    n_ff_shared=40,
    rope_theta=500000.0,
    norm_eps=1e-6,
)


def random_params(cfg: ModelConfig, seed: int = 0) -> Params:
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(shape).astype(np.float32)
        for name, shape in cfg.param_shapes().items()
    }


@pytest.fixture
def f32_file(tmp_path: Path) -> tuple[Path, Params]:
    params = random_params(CFG)
    path = tmp_path / "model.gguf"
    save_gguf(path, CFG, params)
    return path, params


def field_value(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    assert field is not None, key
    return field.contents()


def rewrite(
    src: Path,
    dst: Path,
    *,
    arch: str = "llama",
    drop_keys: tuple[str, ...] = (),
    drop_tensor: str | None = None,
    replace_tensor: tuple[str, npt.NDArray[Any]] | None = None,
) -> None:
    """Copy a GGUF file through gguf-py, changing one thing, to make a broken model."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        if t.name == drop_tensor:
            continue
        data = np.array(t.data)
        if replace_tensor is not None and t.name == replace_tensor[0]:
            data = replace_tensor[1]
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [CFG, CFG_SHARED], ids=["moe", "shared-expert"])
def test_f32_round_trip_is_bit_exact(tmp_path: Path, cfg: ModelConfig) -> None:
    params = random_params(cfg, seed=1)
    path = tmp_path / "m.gguf"
    save_gguf(path, cfg, params, name="tiny-test")
    loaded = load_gguf(path)
    assert loaded.cfg == cfg
    assert list(loaded.params) == list(cfg.param_shapes())
    for name, arr in params.items():
        got = loaded.params[name]
        assert got.dtype == np.float32 and got.flags.c_contiguous and got.flags.writeable
        assert got.tobytes() == arr.tobytes(), name
    assert loaded.metadata["general.name"] == "tiny-test"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temp file left behind


def test_f16_round_trip_within_f16_rounding(tmp_path: Path) -> None:
    params = random_params(CFG, seed=2)
    path = tmp_path / "m16.gguf"
    save_gguf(path, CFG, params, dtype="f16")
    loaded = load_gguf(path)
    assert loaded.cfg == CFG
    assert loaded.metadata["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)
    for name, arr in params.items():
        got = loaded.params[name]
        assert got.dtype == np.float32
        if arr.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
            np.testing.assert_array_equal(got, arr)
        else:
            np.testing.assert_array_equal(got, arr.astype(np.float16).astype(np.float32))
            np.testing.assert_allclose(got, arr, rtol=2**-11, atol=2**-24)
    save_gguf(tmp_path / "m32.gguf", CFG, params)
    assert path.stat().st_size < 0.6 * (tmp_path / "m32.gguf").stat().st_size


def test_f16_keeps_norms_and_router_in_f32(tmp_path: Path) -> None:
    path = tmp_path / "m16.gguf"
    save_gguf(path, CFG, random_params(CFG), dtype="f16")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == F32
    assert types["blk.1.ffn_norm.weight"] == F32
    assert types["output_norm.weight"] == F32
    assert types["blk.0.ffn_gate_inp.weight"] == F32
    assert types["token_embd.weight"] == F16
    assert types["blk.0.ffn_down_exps.weight"] == F16
    assert types["output.weight"] == F16


# -- what llama.cpp reads ----------------------------------------------------------------------


def test_metadata_keys_as_llama_cpp_reads_them(f32_file: tuple[Path, Params]) -> None:
    r = gguf.GGUFReader(f32_file[0])
    expected_ints = {
        "llama.context_length": 64,
        "llama.embedding_length": 32,
        "llama.block_count": 2,
        "llama.feed_forward_length": 48,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 8,
        "llama.expert_count": 4,
        "llama.expert_used_count": 2,
        "llama.vocab_size": 259,
        "general.file_type": 0,
    }
    for key, value in expected_ints.items():
        field = r.get_field(key)
        assert field is not None, key
        assert field.types == [gguf.GGUFValueType.UINT32], key
        assert field.contents() == value, key
    assert field_value(r, "general.architecture") == "llama"
    assert field_value(r, "general.name") == "foundry"
    eps = r.get_field("llama.attention.layer_norm_rms_epsilon")
    assert eps is not None and eps.types == [gguf.GGUFValueType.FLOAT32]
    assert np.float32(eps.contents()) == np.float32(1e-5)
    assert field_value(r, "llama.rope.freq_base") == 10000.0
    assert r.get_field("llama.expert_shared_feed_forward_length") is None


def test_shared_expert_key(tmp_path: Path) -> None:
    path = tmp_path / "s.gguf"
    save_gguf(path, CFG_SHARED, random_params(CFG_SHARED))
    r = gguf.GGUFReader(path)
    assert field_value(r, "llama.expert_shared_feed_forward_length") == 40
    assert field_value(r, "llama.rope.freq_base") == 500000.0
    names = [t.name for t in r.tensors]
    assert "blk.0.ffn_up_shexp.weight" in names


def test_tokenizer_keys(f32_file: tuple[Path, Params]) -> None:
    r = gguf.GGUFReader(f32_file[0])
    assert field_value(r, "tokenizer.ggml.model") == "llama"
    tokens = field_value(r, "tokenizer.ggml.tokens")
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3] == "<0x00>" and tokens[3 + 0x0A] == "<0x0A>" and tokens[-1] == "<0xFF>"
    assert len(tokens) == 259
    types = field_value(r, "tokenizer.ggml.token_type")
    assert types == [2, 3, 3] + [6] * 256
    scores = field_value(r, "tokenizer.ggml.scores")
    assert len(scores) == 259
    assert field_value(r, "tokenizer.ggml.bos_token_id") == 1
    assert field_value(r, "tokenizer.ggml.eos_token_id") == 2
    assert field_value(r, "tokenizer.ggml.unknown_token_id") == 0
    assert field_value(r, "tokenizer.ggml.add_bos_token") is True
    assert field_value(r, "tokenizer.ggml.add_space_prefix") is False


def test_tensor_names_order_and_ggml_shapes(f32_file: tuple[Path, Params]) -> None:
    r = gguf.GGUFReader(f32_file[0])
    assert [t.name for t in r.tensors] == list(CFG.param_shapes())
    ne = {t.name: t.shape.tolist() for t in r.tensors}
    d, v, ff, e, kv = CFG.n_embd, CFG.n_vocab, CFG.n_ff, CFG.n_expert, CFG.n_embd_kv
    assert ne["token_embd.weight"] == [d, v]  # ggml ne: fastest dimension first
    assert ne["output.weight"] == [d, v]
    assert ne["output_norm.weight"] == [d]
    assert ne["blk.0.attn_q.weight"] == [d, d]
    assert ne["blk.0.attn_k.weight"] == [d, kv]
    assert ne["blk.0.attn_v.weight"] == [d, kv]
    assert ne["blk.0.ffn_gate_inp.weight"] == [d, e]
    assert ne["blk.1.ffn_gate_exps.weight"] == [d, ff, e]
    assert ne["blk.1.ffn_up_exps.weight"] == [d, ff, e]
    assert ne["blk.1.ffn_down_exps.weight"] == [ff, d, e]
    # The bytes are numpy C order: element [x, y, z] of the (E, n_ff, n_embd) array.
    params = f32_file[1]
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_gate_exps.weight")
    np.testing.assert_array_equal(t.data, params["blk.1.ffn_gate_exps.weight"])
    assert t.data_offset % 32 == 0


# -- partial loading ---------------------------------------------------------------------------


def test_select_takes_only_what_a_rank_needs(f32_file: tuple[Path, Params]) -> None:
    path, params = f32_file
    half = CFG.n_expert // 2

    def rank1(name: str, view: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
        if name.endswith("_exps.weight"):
            assert not view.flags.writeable  # a memory-mapped view, not a copy
            return view[half:]
        return view if name == "token_embd.weight" else None

    loaded = load_gguf(path, select=rank1)
    assert loaded.cfg == CFG
    assert set(loaded.params) == {
        n for n in CFG.param_shapes() if n.endswith("_exps.weight") or n == "token_embd.weight"
    }
    got = loaded.params["blk.0.ffn_down_exps.weight"]
    assert got.shape == (half, CFG.n_embd, CFG.n_ff) and got.flags.writeable
    np.testing.assert_array_equal(got, params["blk.0.ffn_down_exps.weight"][half:])
    header_only = load_gguf(path, select=lambda name, view: None)
    assert header_only.params == {} and header_only.cfg == CFG


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_copy_in_slices_gives_the_same_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """A tensor is copied off the mapped file in slices of rows (each slice's pages unmapped
    once copied): slices of a few rows, the last one short, give the tensors one copy gives."""
    path = tmp_path / "model.gguf"
    save_gguf(path, CFG, random_params(CFG), dtype=dtype)  # type: ignore[arg-type]
    whole = load_gguf_stored(path)
    monkeypatch.setattr(gguf_io, "COPY_CHUNK_BYTES", 100)
    sliced = load_gguf_stored(path)
    assert set(sliced.params) == set(whole.params)
    for name, want in whole.params.items():
        got = sliced.params[name]
        if isinstance(want, QTensor):
            assert isinstance(got, QTensor) and got.qtype == want.qtype
            assert got.shape == want.shape
            np.testing.assert_array_equal(got.data, want.data)
        else:
            np.testing.assert_array_equal(got, want)
        assert (got if isinstance(got, np.ndarray) else got.data).flags.writeable


def _mapped_kb(address: int) -> int:
    """Resident kB of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_release_unmaps_a_copied_tensors_pages(tmp_path: Path) -> None:
    """Once copied, a tensor's pages leave the process (the file stays in the page cache):
    loading does not hold the file twice. The values read again afterwards are the file's."""
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    values = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # 4 MiB
    writer.add_tensor("big", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf_io._Reader(path)
    (t,) = reader.tensors
    address = t.data.__array_interface__["data"][0]
    assert float(t.data.sum()) == float(values.sum())  # every page read: mapped
    assert _mapped_kb(address) >= 4096
    reader.release(t)
    assert _mapped_kb(address) < 64
    np.testing.assert_array_equal(t.data, values)


# -- errors ------------------------------------------------------------------------------------


def test_not_a_gguf_file(tmp_path: Path) -> None:
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am text")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf(p)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf(tmp_path / "empty.gguf")
    with pytest.raises(GGUFError, match="does not exist"):
        load_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("keep", [8, 60, 2000, -100], ids=["magic", "header", "kv", "data"])
def test_truncated_file(f32_file: tuple[Path, Params], tmp_path: Path, keep: int) -> None:
    data = f32_file[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(GGUFError, match="truncated"):
        load_gguf(cut)


def test_missing_tensor(f32_file: tuple[Path, Params], tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    rewrite(f32_file[0], bad, drop_tensor="blk.1.attn_v.weight")
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.1\.attn_v\.weight'"):
        load_gguf(bad)


def test_wrong_shape(f32_file: tuple[Path, Params], tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    wrong = np.zeros((4, 48, 31), dtype=np.float32)
    rewrite(f32_file[0], bad, replace_tensor=("blk.0.ffn_up_exps.weight", wrong))
    with pytest.raises(
        GGUFError,
        match=r"'blk\.0\.ffn_up_exps\.weight' has shape \(4, 48, 31\), expected "
        r"\(4, 48, 32\)",
    ):
        load_gguf(bad)


def test_wrong_tensor_type(f32_file: tuple[Path, Params], tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    rewrite(f32_file[0], bad, replace_tensor=("output_norm.weight", np.zeros(32, np.int32)))
    with pytest.raises(GGUFError, match=r"output_norm\.weight' has type I32"):
        load_gguf(bad)


def test_wrong_architecture(f32_file: tuple[Path, Params], tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    rewrite(f32_file[0], bad, arch="gpt2")
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        load_gguf(bad)


def test_missing_key(f32_file: tuple[Path, Params], tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    rewrite(f32_file[0], bad, drop_keys=("llama.block_count",))
    with pytest.raises(GGUFError, match=r"missing metadata key 'llama\.block_count'"):
        load_gguf(bad)
    # Without expert_count a llama file is dense, and then expert_used_count makes no sense.
    rewrite(f32_file[0], bad, drop_keys=("llama.expert_count",))
    with pytest.raises(GGUFError, match=r"expert_count and expert_used_count must both"):
        load_gguf(bad)


def test_foreign_tokenizer(f32_file: tuple[Path, Params], tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    rewrite(f32_file[0], bad, drop_keys=("tokenizer.ggml.tokens",))
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.tokens"):
        load_gguf(bad)


def test_save_rejects_params_that_do_not_fit(tmp_path: Path) -> None:
    params = random_params(CFG)
    del params["output.weight"]
    with pytest.raises(GGUFError, match=r"missing \['output\.weight'\]"):
        save_gguf(tmp_path / "x.gguf", CFG, params)
    params = random_params(CFG)
    params["blk.0.attn_q.weight"] = params["blk.0.attn_q.weight"][:, :3]
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_q\.weight has shape \(32, 3\)"):
        save_gguf(tmp_path / "x.gguf", CFG, params)
    with pytest.raises(GGUFError, match="dtype"):
        save_gguf(tmp_path / "x.gguf", CFG, random_params(CFG), dtype="q4")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# -- identity ----------------------------------------------------------------------------------


def test_model_id_is_stable_and_content_dependent(
    f32_file: tuple[Path, Params], tmp_path: Path
) -> None:
    path, params = f32_file
    digest = hashlib.sha256(path.read_bytes()).digest()
    assert model_id(path) == int.from_bytes(digest[:4], "little")
    assert 0 <= model_id(path) < 2**32
    again = tmp_path / "again.gguf"
    save_gguf(again, CFG, params)
    assert model_id(again) == model_id(path)  # writing is deterministic
    params["output_norm.weight"][0] += 1.0
    changed = tmp_path / "changed.gguf"
    save_gguf(changed, CFG, params)
    assert changed.stat().st_size == path.stat().st_size
    assert model_id(changed) != model_id(path)
