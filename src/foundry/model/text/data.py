"""The training corpus and the one global order of training samples.

The corpus is tokenized by Foundry's byte vocabulary (:mod:`foundry.model.text.vocab.byte`:
token ``b + 3`` is the byte ``b`` of the UTF-8 text; 0, 1, 2 are ``<unk>``, ``<s>`` and ``</s>``).

Corpus
------
:func:`load_corpus` reads the documents (by default the documentation bundled with every
CPython, ``pydoc_data.topics``; otherwise a text file or a folder of text files) and encodes them
into one int32 token stream, each document starting with one BOS. Its :class:`Fingerprint`
(token count and sha256 of the little-endian int32 tokens) lets a coordinator check that every
worker trains on the same data.

Held-out split and global sample order
--------------------------------------
For a sequence length ``S`` the stream is cut into ``m = (n_tokens - 1) // S`` blocks: block
``j`` is ``tokens[j*S : j*S + S + 1]`` (input ``[:-1]``, target ``[1:]``; neighbours share one
token). Every ``HOLDOUT_EVERY``-th block, ``j = 0, 20, 40, ...``, is held out for validation;
the others are the training sequences, in order: training sequence ``t`` is block
``t + t // 19 + 1``. The held-out text is thus drawn evenly from the whole corpus, the same
kind of text as training, and no token that validation predicts is ever a training target (a
held-out block's first token, which is only context, is its predecessor's last target). The
split is integer arithmetic on the token stream: the same on every machine.

Validation reads at most ``VAL_MAX_TOKENS`` held-out tokens: when there are more blocks than
that, an even stride over them (:meth:`Corpus.validation_blocks`). Its score counts the byte
targets only, so the validation loss in nats is per byte, and bits per byte is that over
ln 2; :meth:`Corpus.held_out_bytes` are those same bytes, for a compressor's yardstick
(:func:`compressor_bits_per_byte`: ``gzip -9``, ``xz -9e`` and ``zstd -19`` on them cold, and
:func:`primed_bits_per_byte`: ``xz -9e`` and ``zstd -19`` given :meth:`Corpus.training_bytes`
first, the text the model learnt from).

Global sample ``i`` (0, 1, 2, ... without end) is training sequence ``perm_e[i mod n]`` of
epoch ``e = i // n``, where ``n`` is the number of training sequences and ``perm_e`` sorts the
sequence indices by a splitmix64 hash of ``(seed, e, t)``. The permutation is pure integer
arithmetic, so every machine, whatever its numpy version or CPU, agrees on it: the same global
sample index is the same sequence everywhere. A training position is therefore one integer
(the next global sample index), and a round's global batch ``[P, P + G)`` is divided among
workers with :func:`shard_range`.
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from foundry.model.text.vocab.byte import TokenArray, encode, token_bytes

# File kinds read from a corpus folder: prose and code, the text a small model learns from.
CORPUS_SUFFIXES = (".txt", ".md", ".rst", ".py")
# One block in this many is held out for validation (5 %; block 0 always, so there is one).
HOLDOUT_EVERY = 20
# Validation reads at most this many held-out tokens (32 KiB of text for byte tokens: gzip's
# whole window), so its cost stays bounded on a large corpus.
VAL_MAX_TOKENS = 32 * 1024
# The target of a token that carries no loss (``Corpus.counted``): torch's ignore_index.
NOT_COUNTED = -1
# Permutations kept in memory: a window of global samples spans at most two epochs, the
# validation reader and a second sequence length (evaluation) may add one more each.
_PERM_CACHE_SIZE = 4

_U64 = np.uint64
_MASK64 = (1 << 64) - 1


class DataError(ValueError):
    """Text or a corpus that cannot be used; the message says what to pass instead."""


# -- corpus ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """Identity of a token stream: workers and coordinator compare it before training."""

    n_tokens: int
    sha256: str  # hex digest of the tokens as little-endian int32


def fingerprint(tokens: TokenArray, counted: npt.NDArray[np.bool_] | None = None) -> Fingerprint:
    """Token count and sha256 of the tokens (then of the loss mask's bytes, where a corpus
    has one: two workers with the same tokens and another mask are not the same data)."""
    h = hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i4").reshape(-1).view(np.uint8).data)
    if counted is not None:
        h.update(np.ascontiguousarray(counted, dtype=np.uint8).data)
    return Fingerprint(n_tokens=len(tokens), sha256=h.hexdigest())


def shard_range(
    global_start: int, global_count: int, shard: int, total_shards: int
) -> tuple[int, int]:
    """Part ``shard`` of the samples ``[global_start, global_start + global_count)``.

    The block is cut into ``total_shards`` contiguous parts in order; when it does not divide
    evenly the first parts get one sample more. Returns ``(start, count)``.
    """
    if total_shards < 1:
        raise DataError(f"total_shards must be >= 1, got {total_shards}")
    if not 0 <= shard < total_shards:
        raise DataError(f"shard {shard} is outside [0, {total_shards})")
    if global_start < 0 or global_count < 0:
        raise DataError(
            f"global_start and global_count must be >= 0, got {global_start}, {global_count}"
        )
    base, extra = divmod(global_count, total_shards)
    return global_start + shard * base + min(shard, extra), base + (1 if shard < extra else 0)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    # Vigna's splitmix64 finaliser; uint64 array arithmetic wraps modulo 2**64 by definition.
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def epoch_permutation(n: int, seed: int, epoch: int) -> npt.NDArray[np.int64]:
    """The order of sequences ``0..n-1`` in ``epoch``: a pure function of its arguments."""
    key = np.array([(seed * 0x2545F4914F6CDD1D + epoch) & _MASK64], dtype=np.uint64)
    salt = _splitmix64(_splitmix64(key))
    hashes = _splitmix64(np.arange(n, dtype=np.uint64) ^ salt)
    return np.argsort(hashes, kind="stable").astype(np.int64)


class Corpus:
    """A token stream with its fingerprint, validation split and global sample order."""

    def __init__(
        self,
        tokens: TokenArray,
        source: str,
        n_documents: int,
        counted: npt.NDArray[np.bool_] | None = None,
    ) -> None:
        if tokens.ndim != 1 or len(tokens) == 0:
            raise DataError(f"corpus from {source} has no tokens")
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.tokens.setflags(write=False)
        self.source = source
        self.n_documents = n_documents
        # Which tokens carry loss as targets (chat data: the assistant's); None: all. A target
        # that does not is given as NOT_COUNTED.
        self.counted = None if counted is None else np.ascontiguousarray(counted, dtype=bool)
        if self.counted is not None and self.counted.shape != self.tokens.shape:
            raise DataError(f"corpus from {source}: the loss mask does not match the tokens")
        self.fingerprint = fingerprint(self.tokens, self.counted)
        self._perms: dict[tuple[int, int, int], npt.NDArray[np.int64]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return (
            f"Corpus(source={self.source!r}, n_documents={self.n_documents}, "
            f"n_tokens={len(self.tokens)})"
        )

    def n_blocks(self, seq_len: int) -> int:
        """Blocks of ``seq_len + 1`` tokens, every ``seq_len`` tokens: training and held out."""
        _check_seq_len(seq_len)
        m = (len(self.tokens) - 1) // seq_len
        if m < 2:
            raise DataError(
                f"corpus {self.source} has {len(self.tokens)} tokens, too few for seq_len "
                f"{seq_len}: training and validation need {seq_len + 1} each; pass more text "
                "or a smaller seq_len"
            )
        return m

    def n_sequences(self, seq_len: int) -> int:
        """Training sequences per epoch: the blocks not held out."""
        m = self.n_blocks(seq_len)
        return m - -(-m // HOLDOUT_EVERY)

    def training_blocks(self, sequences: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Block index of each training sequence index (the held-out blocks skipped)."""
        return sequences + sequences // (HOLDOUT_EVERY - 1) + 1

    def validation_blocks(self, seq_len: int) -> npt.NDArray[np.int64]:
        """The held-out blocks validation reads, in order: all of them when they hold at most
        ``VAL_MAX_TOKENS`` tokens, else an even stride over them."""
        held_out = np.arange(0, self.n_blocks(seq_len), HOLDOUT_EVERY, dtype=np.int64)
        stride = -(-len(held_out) * seq_len // VAL_MAX_TOKENS)
        return held_out[::stride]

    def _blocks(self, blocks: npt.NDArray[np.int64], seq_len: int) -> TokenArray:
        window = blocks[:, None] * seq_len + np.arange(seq_len + 1)  # (count, seq_len + 1)
        chunk: TokenArray = self.tokens[window]
        return chunk

    def _pair(self, blocks: npt.NDArray[np.int64], seq_len: int) -> tuple[TokenArray, TokenArray]:
        """Inputs and targets (count, seq_len) of blocks; targets that carry no loss are
        NOT_COUNTED."""
        chunk = self._blocks(blocks, seq_len)  # (count, seq_len + 1)
        targets = np.ascontiguousarray(chunk[:, 1:])
        if self.counted is not None:
            window = blocks[:, None] * seq_len + np.arange(1, seq_len + 1)  # (count, seq_len)
            targets[~self.counted[window]] = NOT_COUNTED
        return np.ascontiguousarray(chunk[:, :-1]), targets

    def held_out_bytes(self, seq_len: int) -> bytes:
        """The text validation scores: the byte targets of :meth:`validation_blocks`, in
        order (specials dropped), for a compressor to compete on."""
        targets = self._blocks(self.validation_blocks(seq_len), seq_len)[:, 1:]
        return token_bytes(targets)

    def training_bytes(self, seq_len: int) -> bytes:
        """The text training predicts: every byte target of the training blocks, in corpus
        order (specials dropped), for a compressor primed with what the model saw."""
        m = self.n_blocks(seq_len)
        keep = np.zeros(len(self.tokens), dtype=bool)
        keep[1 : m * seq_len + 1] = True
        for j in range(0, m, HOLDOUT_EVERY):
            keep[j * seq_len + 1 : j * seq_len + seq_len + 1] = False
        return token_bytes(self.tokens[keep])

    def _permutation(self, n: int, seed: int, epoch: int) -> npt.NDArray[np.int64]:
        key = (n, seed, epoch)
        perm = self._perms.get(key)
        if perm is None:
            if len(self._perms) >= _PERM_CACHE_SIZE:
                self._perms.pop(next(iter(self._perms)), None)
            perm = self._perms[key] = epoch_permutation(n, seed, epoch)
        return perm

    def sequence_indices(
        self, start: int, count: int, seq_len: int, seed: int = 0
    ) -> npt.NDArray[np.int64]:
        """Training sequence index of each global sample in ``[start, start + count)``."""
        if start < 0 or count < 0:
            raise DataError(f"start and count must be >= 0, got {start}, {count}")
        n = self.n_sequences(seq_len)
        out = np.empty(count, dtype=np.int64)
        i = start
        while i < start + count:
            epoch, offset = divmod(i, n)
            take = min(n - offset, start + count - i)
            out[i - start : i - start + take] = self._permutation(n, seed, epoch)[
                offset : offset + take
            ]
            i += take
        return out

    def sample_batch(
        self, start: int, count: int, seq_len: int, seed: int = 0
    ) -> tuple[TokenArray, TokenArray]:
        """Inputs and targets, each (count, seq_len), of global samples [start, start+count)."""
        seqs = self.sequence_indices(start, count, seq_len, seed)
        return self._pair(self.training_blocks(seqs), seq_len)

    def validation_batches(
        self, seq_len: int, batch_size: int, max_batches: int | None = None
    ) -> Iterator[tuple[TokenArray, TokenArray]]:
        """The validation batches of :meth:`validation_blocks`, in order: the same on every
        call and every machine. Each holds ``batch_size`` blocks (the last may hold fewer);
        ``max_batches`` stops early."""
        if batch_size < 1 or (max_batches is not None and max_batches < 0):
            raise DataError(
                f"batch_size must be >= 1 and max_batches >= 0, got {batch_size}, {max_batches}"
            )
        blocks = self.validation_blocks(seq_len)
        n_batches = -(-len(blocks) // batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        for b in range(n_batches):
            yield self._pair(blocks[b * batch_size : (b + 1) * batch_size], seq_len)


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")


def compressor_bits_per_byte(data: bytes) -> dict[str, float]:
    """What ``gzip -9``, ``xz -9e`` and ``zstd -19`` make of ``data`` cold (nothing seen
    before), in bits per byte of it: the yardstick for a model's validation bits per byte on
    the same bytes. The same compressors as the command-line tools at those levels (zlib's
    deflate in a gzip container without a file name; an .xz stream, preset 9 extreme, CRC64; a
    zstd frame with its checksum and without the content size, as ``zstd -19 -c`` writes from
    a pipe), container headers included."""
    if not data:
        raise DataError("no bytes to compress")
    n = len(data)
    return {
        "gzip -9": len(gzip.compress(data, compresslevel=9, mtime=0)) * 8 / n,
        "xz -9e": len(_xz(data)) * 8 / n,
        "zstd -19": len(_zstd(data, None)) * 8 / n,
    }


def primed_bits_per_byte(data: bytes, primer: bytes) -> dict[str, float]:
    """What ``xz -9e`` and ``zstd -19`` make of ``data`` when they have seen ``primer`` (the
    training text) first, in bits per byte of ``data``: the fair yardstick for a model trained
    on ``primer``. xz: the size of ``primer + data`` compressed less that of ``primer`` alone
    (its 64 MiB window holds both); zstd: ``primer`` as a raw-content dictionary
    (``zstd -19 -D primer``)."""
    if not data or not primer:
        raise DataError("no bytes to compress")
    n = len(data)
    return {
        "xz -9e primed": (len(_xz(primer + data)) - len(_xz(primer))) * 8 / n,
        "zstd -19 primed": len(_zstd(data, primer)) * 8 / n,
    }


def _xz(data: bytes) -> bytes:
    return lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)


def _zstd(data: bytes, dictionary: bytes | None) -> bytes:
    import zstandard

    d = (
        zstandard.ZstdCompressionDict(dictionary, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        if dictionary is not None
        else None
    )
    z = zstandard.ZstdCompressor(
        level=19, dict_data=d, write_checksum=True, write_content_size=False, write_dict_id=False
    )
    stream = z.compressobj()  # size unknown up front, as the CLI reading a pipe: same bytes
    return stream.compress(data) + stream.flush()


def corpus_from_documents(documents: Iterable[str], source: str) -> Corpus:
    """Encode documents into one stream, each starting with BOS."""
    parts = [encode(doc, bos=True) for doc in documents if doc]
    if not parts:
        raise DataError(f"{source} holds no text")
    return Corpus(np.concatenate(parts), source=source, n_documents=len(parts))


def _default_documents() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError(
            f"this Python ({sys.executable}) was installed without pydoc_data, the default "
            "training text; pass a text file or a folder of .txt/.md/.rst/.py files instead"
        ) from None
    # Each help topic is a document; a blank line closes it, as in the rendered help.
    return [topics[key].rstrip("\n") + "\n\n" for key in sorted(topics)]


def _folder_files(folder: Path) -> Sequence[Path]:
    # Hidden entries (.git, .venv, .tox) hold tooling, not the user's text.
    return sorted(
        p
        for p in folder.rglob("*")
        if p.suffix.lower() in CORPUS_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        and p.is_file()
    )


def load_corpus(path: str | Path | None = None) -> Corpus:
    """The training text: ``None`` for CPython's bundled docs, else a text file or a folder.

    A folder contributes every ``*.txt``, ``*.md``, ``*.rst`` and ``*.py`` file below it
    (hidden files and folders skipped), in sorted path order, each file one document.
    """
    if path is None:
        return corpus_from_documents(_default_documents(), source="pydoc_data.topics")
    return corpus_from_documents(read_documents(path), source=str(path))


def read_documents(path: str | Path) -> list[str]:
    """The documents of a text file (one) or a folder (each ``*.txt``, ``*.md``, ``*.rst``
    and ``*.py`` file below it, hidden ones skipped, in sorted path order)."""
    p = Path(path)
    hint = (
        "pass a UTF-8 text file, a folder holding .txt/.md/.rst/.py files, or nothing for the "
        "bundled Python documentation"
    )
    if p.is_file():
        files: Sequence[Path] = [p]
    elif p.is_dir():
        files = _folder_files(p)
        if not files:
            raise DataError(f"corpus folder {p} holds no .txt/.md/.rst/.py files; {hint}")
    else:
        raise DataError(f"corpus path {p} does not exist; {hint}")
    try:
        documents = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    except OSError as exc:
        raise DataError(f"cannot read corpus {p}: {exc}; {hint}") from exc
    if not any(documents):
        raise DataError(f"corpus {p} is empty; {hint}")
    return documents
