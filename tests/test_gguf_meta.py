"""The GGUF header reader (foundry.model.formats.gguf_meta): golden bytes, the gguf package's
reading of a file we write, and the refusals."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from foundry.model.formats.gguf_io import save_gguf
from foundry.model.formats.gguf_meta import GGUFMetaError, read_metadata
from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import ModelConfig
from foundry.model.text.vocab import load_tokenizer, own_tokenizer


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


# Hand-assembled: magic, version 3, 0 tensors, 5 keys; each key: name, u32 type, value.
GOLDEN = (
    b"GGUF"
    + struct.pack("<IQQ", 3, 0, 5)
    + _string("general.architecture")
    + struct.pack("<I", 8)
    + _string("llama")
    + _string("llama.block_count")
    + struct.pack("<II", 4, 2)
    + _string("llama.rope.freq_base")
    + struct.pack("<I", 6)
    + struct.pack("<f", 1e-5)
    + _string("tokenizer.ggml.add_bos_token")
    + struct.pack("<IB", 7, 1)
    + _string("tokenizer.ggml.tokens")
    + struct.pack("<IIQ", 9, 8, 2)
    + _string("a")
    + _string("é")
)
GOLDEN_VALUES = {
    "general.architecture": "llama",
    "llama.block_count": 2,
    "llama.rope.freq_base": 1e-5,
    "tokenizer.ggml.add_bos_token": True,
    "tokenizer.ggml.tokens": ["a", "é"],
}


def test_golden_header(tmp_path: Path) -> None:
    path = tmp_path / "h.gguf"
    path.write_bytes(GOLDEN)
    assert read_metadata(path) == GOLDEN_VALUES


def test_a_written_file_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    cfg = ModelConfig(n_ctx=32, n_embd=16, n_layer=1, n_head=2, n_head_kv=1, n_ff=24, n_expert=2)
    path = tmp_path / "m.gguf"
    save_gguf(path, cfg, init_params(cfg, 0))
    reader = gguf.GGUFReader(path)
    expected = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        expected[key] = value
    meta = read_metadata(path)
    assert meta == expected
    # our own files give Foundry's byte tokenizer
    text = "héllo wörld"
    assert load_tokenizer(meta).encode(text) == own_tokenizer().encode(text)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"GGML" + GOLDEN[4:], "not a GGUF file"),
        (b"GGUF" + struct.pack("<I", 1) + GOLDEN[8:], "GGUF version 1"),
        (GOLDEN[:-3], "the header ends early"),
        (GOLDEN[:24] + struct.pack("<Q", 1 << 40) + GOLDEN[32:], "a count of"),
    ],
)
def test_bad_headers_are_refused_naming_what_is_wrong(
    tmp_path: Path, data: bytes, message: str
) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFMetaError, match=message):
        read_metadata(path)
