"""Byte tokenizer, corpus loading and the global sample order shared by every worker."""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry.model.spec.config import BOS_ID, EOS_ID, VOCAB_SIZE
from foundry.model.text.data import (
    VAL_MAX_TOKENS,
    Corpus,
    DataError,
    compressor_bits_per_byte,
    corpus_from_documents,
    epoch_permutation,
    load_corpus,
    primed_bits_per_byte,
    shard_range,
)
from foundry.model.text.vocab import TokenizerError
from foundry.model.text.vocab.byte import decode, encode

# Text without lone surrogates (which UTF-8 cannot encode).
texts = st.text(alphabet=st.characters(exclude_categories=["Cs"]))


@pytest.fixture(scope="module")
def default_corpus() -> Corpus:
    return load_corpus(None)


# -- tokenizer ---------------------------------------------------------------------------------


def test_encode_is_bytes_plus_three_with_bos() -> None:
    assert encode("A\n").tolist() == [BOS_ID, 0x41 + 3, 0x0A + 3]
    assert encode("A", bos=False, eos=True).tolist() == [0x41 + 3, EOS_ID]
    assert encode("").tolist() == [BOS_ID]
    assert encode("é", bos=False).tolist() == [0xC3 + 3, 0xA9 + 3]
    assert encode("x").dtype == np.int32


@settings(deadline=None)
@given(texts)
def test_round_trip(text: str) -> None:
    tokens = encode(text, bos=True, eos=True)
    assert int(tokens.max(initial=0)) < VOCAB_SIZE
    assert decode(tokens) == text


def test_round_trip_non_ascii() -> None:
    text = "naïve café — 東京 🙂 \u0000 tab\tend"
    assert decode(encode(text)) == text


def test_decode_replaces_invalid_bytes_and_rejects_unknown_ids() -> None:
    assert decode([0xFF + 3, 0x41 + 3]) == "\ufffdA"
    with pytest.raises(TokenizerError, match="259"):
        decode([VOCAB_SIZE])
    with pytest.raises(TokenizerError, match="-1"):
        decode([-1])


# -- corpus ------------------------------------------------------------------------------------


def test_default_corpus_is_pythons_bundled_docs(default_corpus: Corpus) -> None:
    from pydoc_data.topics import topics

    c = default_corpus
    assert c.source == "pydoc_data.topics"
    assert len(c) > 100_000
    assert c.n_documents == len([t for t in topics.values() if t])
    assert int((c.tokens == BOS_ID).sum()) == c.n_documents
    assert c.tokens[0] == BOS_ID
    first = sorted(topics)[0]
    assert decode(c.tokens[1 : 1 + 200]) == topics[first][:200]


def test_fingerprint_is_stable_and_content_dependent(default_corpus: Corpus) -> None:
    again = load_corpus(None)
    assert again.fingerprint == default_corpus.fingerprint
    assert default_corpus.fingerprint.n_tokens == len(default_corpus)
    assert len(default_corpus.fingerprint.sha256) == 64
    a = corpus_from_documents(["hello world"], "a")
    b = corpus_from_documents(["hello worle"], "b")
    assert a.fingerprint.n_tokens == b.fingerprint.n_tokens
    assert a.fingerprint != b.fingerprint


def test_file_path(tmp_path: Path) -> None:
    f = tmp_path / "one.txt"
    f.write_text("über text\n" * 50, encoding="utf-8")
    c = load_corpus(f)
    assert c.n_documents == 1
    assert decode(c.tokens) == "über text\n" * 50
    assert load_corpus(str(f)).fingerprint == c.fingerprint


def test_folder_reads_text_kinds_recursively_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.py").write_text("print(1)\n")
    (tmp_path / "a.md").write_text("# title\n")
    (tmp_path / "c.rst").write_text("rst\n")
    (tmp_path / "d.txt").write_bytes(b"bad \xff byte\n")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / "skip.json").write_text("{}")
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "site.py").write_text("tooling\n")
    (tmp_path / ".hidden.txt").write_text("hidden\n")
    c = load_corpus(tmp_path)
    assert c.n_documents == 4
    docs = decode(c.tokens)
    assert docs == "# title\n" + "print(1)\n" + "rst\n" + "bad \ufffd byte\n"
    assert int((c.tokens == BOS_ID).sum()) == 4


def test_missing_or_empty_paths_say_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist.*pass a UTF-8 text file"):
        load_corpus(tmp_path / "nope.txt")
    with pytest.raises(DataError, match=r"holds no \.txt/\.md/\.rst/\.py files"):
        load_corpus(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="is empty"):
        load_corpus(tmp_path / "empty.txt")


def test_too_small_corpus_for_the_sequence_length() -> None:
    c = corpus_from_documents(["x" * 30], "tiny")
    assert c.n_sequences(8) >= 1
    with pytest.raises(DataError, match="too few for seq_len 64"):
        c.sample_batch(0, 1, 64)
    with pytest.raises(DataError, match="too few for seq_len 16"):
        c.held_out_bytes(16)  # 31 tokens: one block of 17, none left for training


# -- global sample order -----------------------------------------------------------------------


def test_sample_batch_shapes_and_shift(default_corpus: Corpus) -> None:
    x, y = default_corpus.sample_batch(5, 3, 32, seed=1)
    assert x.shape == y.shape == (3, 32)
    assert x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    empty_x, empty_y = default_corpus.sample_batch(0, 0, 32)
    assert empty_x.shape == empty_y.shape == (0, 32)


def test_sample_is_a_fixed_window_of_the_training_blocks(default_corpus: Corpus) -> None:
    seq_len = 16
    tokens = default_corpus.tokens
    # Training sequence t is block t + t // 19 + 1: blocks 0, 20, 40, ... are held out.
    training = [j for j in range(default_corpus.n_blocks(seq_len)) if j % 20]
    assert len(training) == default_corpus.n_sequences(seq_len)
    x, y = default_corpus.sample_batch(0, 40, seq_len, seed=3)
    for row, t in enumerate(default_corpus.sequence_indices(0, 40, seq_len, seed=3)):
        j = training[t]
        window = tokens[j * seq_len : j * seq_len + seq_len + 1]
        np.testing.assert_array_equal(x[row], window[:-1])
        np.testing.assert_array_equal(y[row], window[1:])


def test_sample_batch_is_deterministic(default_corpus: Corpus) -> None:
    a = default_corpus.sample_batch(1000, 8, 64, seed=7)
    b = load_corpus(None).sample_batch(1000, 8, 64, seed=7)
    np.testing.assert_array_equal(a[0], b[0])
    c = default_corpus.sample_batch(1000, 8, 64, seed=8)
    assert not np.array_equal(a[0], c[0])


M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def reference_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The documented order in plain Python integers: what any machine must compute."""
    salt = splitmix64(splitmix64((seed * 0x2545F4914F6CDD1D + epoch) & M64))
    return sorted(range(n), key=lambda j: (splitmix64(j ^ salt), j))


@pytest.mark.parametrize(("n", "seed", "epoch"), [(10, 0, 0), (1000, 3, 7), (257, -1, 2**40)])
def test_permutation_matches_the_integer_reference(n: int, seed: int, epoch: int) -> None:
    assert epoch_permutation(n, seed, epoch).tolist() == reference_permutation(n, seed, epoch)


def test_permutation_is_pinned() -> None:
    perm = epoch_permutation(10, seed=0, epoch=0).tolist()
    assert perm == [0, 9, 1, 6, 3, 5, 4, 2, 8, 7]
    assert perm != epoch_permutation(10, seed=0, epoch=1).tolist()
    assert perm != epoch_permutation(10, seed=1, epoch=0).tolist()


def test_epochs_visit_every_sequence_once() -> None:
    c = corpus_from_documents(["abcdefghij" * 40], "small")
    n = c.n_sequences(8)
    for epoch in range(3):
        seqs = c.sequence_indices(epoch * n, n, 8, seed=5)
        assert sorted(seqs.tolist()) == list(range(n))
    across = c.sequence_indices(n - 2, 4, 8, seed=5)  # a block spanning two epochs
    np.testing.assert_array_equal(across[:2], c.sequence_indices(n - 2, 2, 8, seed=5))
    np.testing.assert_array_equal(across[2:], c.sequence_indices(n, 2, 8, seed=5))


@settings(max_examples=60, deadline=None)
@given(
    start=st.integers(0, 10**6),
    count=st.integers(0, 500),
    shards=st.integers(1, 17),
)
def test_shard_range_covers_the_block_exactly(start: int, count: int, shards: int) -> None:
    parts = [shard_range(start, count, s, shards) for s in range(shards)]
    pos = start
    for s_start, s_count in parts:
        assert s_start == pos and s_count >= 0
        pos += s_count
    assert pos == start + count
    counts = [c for _, c in parts]
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)  # the first ones take the extra samples


def test_shard_range_rejects_bad_arguments() -> None:
    with pytest.raises(DataError):
        shard_range(0, 10, 3, 3)
    with pytest.raises(DataError):
        shard_range(0, 10, 0, 0)
    with pytest.raises(DataError):
        shard_range(-1, 10, 0, 1)


@settings(max_examples=25, deadline=None)
@given(start=st.integers(0, 3000), count=st.integers(1, 40), shards=st.integers(1, 6))
def test_same_sample_index_same_sequence_however_split(
    default_corpus: Corpus, start: int, count: int, shards: int
) -> None:
    whole_x, whole_y = default_corpus.sample_batch(start, count, 24, seed=11)
    pieces = [
        default_corpus.sample_batch(*shard_range(start, count, s, shards), 24, seed=11)
        for s in range(shards)
    ]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in pieces]), whole_x)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in pieces]), whole_y)


def test_held_out_blocks_are_every_twentieth_and_never_trained_on() -> None:
    rng = np.random.default_rng(0)  # letters at random: every window of 9 tokens is unique
    c = corpus_from_documents(
        ["".join(rng.choice(list("abcdefghij"), 300)) for _ in range(20)], "docs"
    )
    seq_len = 8
    m = c.n_blocks(seq_len)
    assert m == (len(c) - 1) // seq_len
    held_out = c.validation_blocks(seq_len).tolist()
    assert held_out == list(range(0, m, 20))
    # Every training sample of an epoch is a block not held out, and each such block once.
    n = c.n_sequences(seq_len)
    x, y = c.sample_batch(0, n, seq_len, seed=1)
    starts = sorted(
        next(
            j
            for j in range(m)
            if np.array_equal(c.tokens[j * seq_len : j * seq_len + 8], row)
            and np.array_equal(c.tokens[j * seq_len + 1 : j * seq_len + 9], target)
        )
        for row, target in zip(x, y, strict=True)
    )
    assert starts == [j for j in range(m) if j % 20]
    # No position that validation predicts is ever a training target.
    trained = {j * seq_len + k for j in starts for k in range(1, seq_len + 1)}
    scored = {j * seq_len + k for j in held_out for k in range(1, seq_len + 1)}
    assert not trained & scored


def test_held_out_text_is_spread_over_the_whole_corpus(default_corpus: Corpus) -> None:
    seq_len = 64
    blocks = default_corpus.validation_blocks(seq_len)
    m = default_corpus.n_blocks(seq_len)
    assert blocks[0] == 0 and blocks[-1] >= m - 20
    assert len(blocks) == -(-m // 20)  # the bundled corpus fits VAL_MAX_TOKENS: all of them
    assert len(blocks) * seq_len <= VAL_MAX_TOKENS


def test_validation_is_capped_by_an_even_stride() -> None:
    c = corpus_from_documents(["lorem ipsum dolor sit amet " * 20_000], "big")
    seq_len = 32
    blocks = c.validation_blocks(seq_len)
    assert len(blocks) * seq_len <= VAL_MAX_TOKENS < 2 * len(blocks) * seq_len
    steps = np.diff(blocks)
    assert (steps == steps[0]).all() and steps[0] % 20 == 0
    assert blocks[-1] > c.n_blocks(seq_len) - steps[0] - 20  # reaches the end of the corpus


def test_held_out_bytes_are_the_scored_targets(default_corpus: Corpus) -> None:
    seq_len = 64
    targets = np.concatenate(
        [y.ravel() for _, y in default_corpus.validation_batches(seq_len, batch_size=16)]
    )
    data = default_corpus.held_out_bytes(seq_len)
    assert data == (targets[targets >= 3] - 3).astype(np.uint8).tobytes()  # token b + 3
    assert data.decode(errors="replace").startswith(decode(targets[:40]))
    assert data == load_corpus(None).held_out_bytes(seq_len)


def test_compressors_on_the_held_out_bytes(default_corpus: Corpus) -> None:
    data = default_corpus.held_out_bytes(64)
    got = compressor_bits_per_byte(data)
    assert set(got) == {"gzip -9", "xz -9e", "zstd -19"}
    assert got["gzip -9"] == len(gzip.compress(data, 9, mtime=0)) * 8 / len(data)
    assert 2.0 < got["xz -9e"] < got["gzip -9"] < 4.5  # text: well under 8 bits a byte
    assert 2.0 < got["zstd -19"] < got["gzip -9"]
    assert compressor_bits_per_byte(b"a" * 10_000)["gzip -9"] < 0.1
    with pytest.raises(DataError):
        compressor_bits_per_byte(b"")


def test_training_bytes_are_every_target_that_is_not_held_out() -> None:
    # 3 + 1 + 20 * 2 tokens of seq_len 2: blocks 0 and 20 held out, 1-19 trained on
    tokens = np.arange(3, 3 + 1 + 21 * 2, dtype=np.int32)
    corpus = Corpus(tokens, source="t", n_documents=1)
    trained = corpus.training_bytes(2)

    def text(t: np.ndarray) -> bytes:
        return (t - 3).astype(np.uint8).tobytes()

    held = text(tokens[1:3]) + text(tokens[41:43])
    assert trained == text(tokens[3:41])
    assert not set(trained) & set(held)


def test_primed_compressors_see_the_training_text_first(default_corpus: Corpus) -> None:
    data = default_corpus.held_out_bytes(64)
    primer = default_corpus.training_bytes(64)
    cold = compressor_bits_per_byte(data)
    primed = primed_bits_per_byte(data, primer)
    assert set(primed) == {"xz -9e primed", "zstd -19 primed"}
    # the training text is the same kind of text: priming halves what they need
    assert primed["xz -9e primed"] < cold["xz -9e"] / 1.5
    assert primed["zstd -19 primed"] < cold["zstd -19"] / 1.5
    seen = bytes(range(256)) * 64  # text seen before costs next to nothing
    assert primed_bits_per_byte(seen[:4096], seen)["zstd -19 primed"] < 0.1
    with pytest.raises(DataError):
        primed_bits_per_byte(data, b"")


def test_compressors_match_the_command_line_tools(default_corpus: Corpus, tmp_path: Path) -> None:
    data = default_corpus.held_out_bytes(64)
    primer = default_corpus.training_bytes(64)
    (tmp_path / "primer").write_bytes(primer)
    got = compressor_bits_per_byte(data) | primed_bits_per_byte(data, primer)

    def size(argv: list[str], stdin: bytes) -> int:
        return len(subprocess.run(argv, input=stdin, capture_output=True, check=True).stdout)

    for name, argv in (
        ("gzip -9", ["gzip", "-9", "-n", "-c"]),
        ("xz -9e", ["xz", "-9e", "-c"]),
        ("zstd -19", ["zstd", "-q", "-19", "-c"]),
        ("zstd -19 primed", ["zstd", "-q", "-19", "-D", str(tmp_path / "primer"), "-c"]),
    ):
        assert got[name] == size(argv, data) * 8 / len(data), name
    xz = ["xz", "-9e", "-c"]
    primed_xz = size(xz, primer + data) - size(xz, primer)
    assert got["xz -9e primed"] == primed_xz * 8 / len(data)


def test_validation_batches_are_fixed_and_bounded(default_corpus: Corpus) -> None:
    a = list(default_corpus.validation_batches(32, batch_size=4, max_batches=3))
    b = list(load_corpus(None).validation_batches(32, batch_size=4, max_batches=3))
    assert len(a) == 3
    for (ax, ay), (bx, by) in zip(a, b, strict=True):
        assert ax.shape == ay.shape == (4, 32)
        np.testing.assert_array_equal(ax, bx)
        np.testing.assert_array_equal(ay, by)
    whole = list(default_corpus.validation_batches(32, batch_size=4))
    assert sum(len(x) for x, _ in whole) == len(default_corpus.validation_blocks(32))
