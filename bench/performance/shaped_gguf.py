"""A published GGUF file's layout at random weights: its head travels, the file is rebuilt
where the benchmark runs, the same bytes but for the tensor data.

    python bench/performance/shaped_gguf.py head FILE OUT
    python bench/performance/shaped_gguf.py fill HEAD OUT [--seed S]

``head`` writes FILE's bytes up to where its tensor data begins: the GGUF header, every
key/value pair (architecture, tokenizer, ...), the tensor table and the alignment padding after
it (6.5 MB of the 253 MB Gemma 3 270M Q4_K_M file). ``fill`` writes HEAD followed by a data
section of the size the table gives, each tensor at its offset, the padding between them
zeros, the last one padded to ``general.alignment``, as gguf's and llama.cpp's writers do:
FILE's layout and size with random values. The speed of a product depends on the types and
shapes, not the values; a benchmark on a machine that a 253 MB file cannot reach times the
published layout on the rebuilt file (docs/benchmarks.md, "Gemma-3-270M-shaped").

The values are random and valid for their type: F32 norms (``*norm*``) near 1, other F32, F16
and BF16 small normal values; a block type's quants random bytes, its f16 scales (d, and
dmin or m where it has one: :data:`BLOCKS`, from ggml-common.h's block structs) small and
finite (d and dmin positive, Q4_1's and Q5_1's added m negative: the weights centre on zero),
so that the weights it holds are of order 0.01-0.1 (``tests/test_shaped_gguf.py``
dequantizes each with the gguf package). A type not in :data:`BLOCKS` (the i-quants, the
ternary and FP4 types, the integer types) is refused in one line. The tables are read with the
project's GGUF reader (``gguf_meta.read_layout``: it reads a head alone, where the ``gguf``
package's reader wants the tensors' bytes, and Gemma's 262,144-token vocabulary in well under a
second); the data is generated and written a chunk at a time.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf
import harness
import numpy as np
import numpy.typing as npt

from foundry.model.formats import gguf_meta

QT = gguf.GGMLQuantizationType
U8 = npt.NDArray[np.uint8]
# Bytes generated at a time: the largest tensor is written in pieces of this size.
CHUNK = 1 << 23


@dataclass(frozen=True)
class Block:
    """What a random block of a type holds where (ggml-common.h's ``block_*`` structs)."""

    scales: tuple[tuple[int, float], ...]
    """(byte offset, typical value) of each f16 field of the block: d, then dmin (K-quants,
    subtracted) or m (Q4_1, Q5_1: added, so negative); each block's is 0.75-1.25x the value."""
    signed: tuple[int, int, int] | None = None
    """int8 bytes [start, end) shifted right by the third (0: the full int8 range but -128,
    which no quantizer writes), or None."""


BLOCKS: dict[QT, Block] = {
    QT.Q4_0: Block(((0, 0.008),)),  # d, qs[16]: w = d (q - 8), q 0..15
    QT.Q4_1: Block(((0, 0.008), (2, -0.064))),  # d, m, qs[16]: w = d q + m
    QT.Q5_0: Block(((0, 0.004),)),  # d, qh[4], qs[16]: w = d (q - 16), q 0..31
    QT.Q5_1: Block(((0, 0.004), (2, -0.064))),  # d, m, qh[4], qs[16]: w = d q + m
    QT.Q8_0: Block(((0, 0.0005),), (2, 34, 0)),  # d, qs[32] int8: w = d q
    # scales[16] (4-bit scale, 4-bit min), qs[64], d, dmin: w = d sc q - dmin m, q 0..3
    QT.Q2_K: Block(((80, 0.002), (82, 0.003))),
    # hmask[32], qs[64], scales[12] (6-bit, less 32), d: w = d sc q, q -4..3
    QT.Q3_K: Block(((108, 0.001),)),
    # d, dmin, scales[12] (6-bit scales and mins), qs[128]: w = d sc q - dmin m, q 0..15
    QT.Q4_K: Block(((0, 1.5e-4), (2, 1.1e-3))),
    # d, dmin, scales[12], qh[32], qs[128]: the same, q 0..31
    QT.Q5_K: Block(((0, 1e-4), (2, 1.5e-3))),
    # ql[128], qh[64], scales[16] int8, d: w = d sc (q - 32), q 0..63
    QT.Q6_K: Block(((208, 1.2e-4),), (192, 208, 2)),
}
"""Every block type ``fill`` writes."""
PLAIN: tuple[QT, ...] = (QT.F32, QT.F16, QT.BF16)
"""The element types ``fill`` writes."""


class ShapeError(ValueError):
    """A file or head this script cannot take; the message says why in one line."""


@dataclass(frozen=True)
class Tensor:
    name: str
    qtype: QT
    count: int  # values
    offset: int  # of its data in the file
    nbytes: int


@dataclass(frozen=True)
class Table:
    data_start: int
    data_end: int  # the file's size: the last tensor's end padded to the alignment
    tensors: list[Tensor]  # in the order of their offsets


def read_table(buf: mmap.mmap, path: Path) -> Table:
    """The tensor table of the GGUF file or head mapped as ``buf``, each tensor sized, checked
    not to overlap the next."""
    try:
        layout = gguf_meta.read_layout(buf, path, strict=False)
    except gguf_meta.GGUFMetaError as exc:
        raise ShapeError(str(exc)) from None
    align = int(layout.metadata.get("general.alignment", gguf_meta.DEFAULT_ALIGNMENT))
    tensors = []
    for t in layout.tensors:
        try:
            qtype = QT(t.ggml_type)
        except ValueError:
            raise ShapeError(f"{path}: tensor {t.name!r} has unknown type {t.ggml_type}") from None
        values, size = gguf.GGML_QUANT_SIZES[qtype]
        count = math.prod(t.dims)
        if t.dims and t.dims[0] % values:
            raise ShapeError(f"{path}: tensor {t.name!r} {t.dims} is no whole {qtype.name} blocks")
        tensors.append(Tensor(t.name, qtype, count, t.offset, count // values * size))
    tensors.sort(key=lambda t: t.offset)
    end = layout.data_start
    for tensor in tensors:
        if tensor.offset < end:
            raise ShapeError(f"{path}: tensor {tensor.name!r} overlaps the one before it")
        end = tensor.offset + tensor.nbytes
    return Table(layout.data_start, -(-end // align) * align, tensors)


def write_head(file: Path, out: Path) -> int:
    """Write ``file``'s bytes up to its data section to ``out``; returns their count."""
    with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        table = read_table(buf, file)
        if len(buf) < table.data_end:
            raise ShapeError(f"{file}: {len(buf)} bytes, its tensor table needs {table.data_end}")
        _atomic_write(out, lambda f: f.write(buf[: table.data_start]))
    return table.data_start


def random_blocks(rng: np.random.Generator, qtype: QT, n: int) -> U8:
    """``n`` random valid blocks of ``qtype`` (:data:`BLOCKS`), one row each."""
    spec = BLOCKS[qtype]
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.bit_generator.random_raw(-(-n * size // 8))
    blocks: U8 = np.asarray(raw).view(np.uint8)[: n * size].reshape(n, size)
    if spec.signed is not None:
        start, end, shift = spec.signed
        q = blocks[:, start:end].view(np.int8)
        np.right_shift(q, shift, out=q)
        np.maximum(q, -127, out=q)
    for offset, value in spec.scales:
        d = (rng.uniform(0.75, 1.25, n) * value).astype("<f2")
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(n, 2)
    return blocks


def random_values(rng: np.random.Generator, t: Tensor, n: int) -> npt.NDArray[np.generic]:
    """``n`` values of the element tensor ``t``: norms 1 + 0.05 N(0, 1), the rest 0.02 N(0, 1)."""
    v = rng.standard_normal(n, dtype=np.float32)
    v *= np.float32(0.05 if "norm" in t.name else 0.02)
    if "norm" in t.name:
        v += np.float32(1.0)
    if t.qtype == QT.F16:
        return v.astype("<f2")
    if t.qtype == QT.BF16:
        return (v.view(np.uint32) >> 16).astype("<u2")  # truncated to bfloat16
    return v


def fill(head: Path, out: Path, seed: int = 0) -> Table:
    """Write ``out``: ``head`` up to its data section, then random valid data for each tensor
    of its table at its offset (module docstring)."""
    with head.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        table = read_table(buf, head)
        refused = [t for t in table.tensors if t.qtype not in BLOCKS and t.qtype not in PLAIN]
        if refused:
            known = ", ".join(q.name for q in (*PLAIN, *BLOCKS))
            raise ShapeError(
                f"{head}: tensor {refused[0].name!r} is {refused[0].qtype.name}, a type this "
                f"script does not fill (it fills {known})"
            )
        rng = np.random.default_rng(seed)

        def write(f: BinaryIO) -> None:
            f.write(buf[: table.data_start])
            for t in table.tensors:
                f.seek(t.offset)
                values, size = gguf.GGML_QUANT_SIZES[t.qtype]
                per_chunk = max(1, CHUNK // size)
                for i in range(0, t.count // values, per_chunk):
                    n = min(per_chunk, t.count // values - i)
                    if t.qtype in BLOCKS:
                        f.write(random_blocks(rng, t.qtype, n).data)
                    else:
                        f.write(random_values(rng, t, n).data)
            f.truncate(table.data_end)

        _atomic_write(out, write)
    return table


def _atomic_write(out: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write`` into a temporary file beside ``out``, renamed to ``out`` when it is whole."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            write(f)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def main() -> int:
    ap = harness.parser(__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    h = sub.add_parser("head", allow_abbrev=False, help="write FILE's bytes up to its tensor data")
    h.add_argument("file", type=Path, metavar="FILE", help="a GGUF file")
    h.add_argument("out", type=Path, metavar="OUT", help="the head to write")
    f = sub.add_parser("fill", allow_abbrev=False, help="write HEAD and random tensor data")
    f.add_argument("head", type=Path, metavar="HEAD", help="a head `head` wrote (or a GGUF file)")
    f.add_argument("out", type=Path, metavar="OUT", help="the GGUF file to write")
    f.add_argument("--seed", type=int, default=0, help="the random values' seed (default 0)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    try:
        if args.command == "head":
            size = write_head(args.file, args.out)
            print(f"wrote {args.out}: the {size:,} bytes of {args.file} before its tensor data")
        else:
            table = fill(args.head, args.out, args.seed)
            data = table.data_end - table.data_start
            print(
                f"wrote {args.out}: {table.data_start:,} bytes of head, {len(table.tensors)} "
                f"tensors in {data:,} bytes of random data, in {time.perf_counter() - t0:.1f} s"
            )
    except (ShapeError, OSError) as exc:
        print(f"shaped_gguf: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
