"""The block kernels give the same bits on x86-64, arm64 (NEON, with and without sdot) and armv7
(NEON), at any thread count: the C files built by cross compilers and run under qemu-user,
against this machine's module (its best SIMD path) at one thread.

    apt-get install gcc-aarch64-linux-gnu gcc-arm-linux-gnueabihf libc6-dev-arm64-cross \\
        libc6-dev-armhf-cross qemu-user-static
    python bench/determinism/cross_arch.py --threads 1,4

The kernels' files (``src/foundry/model/kernels/csrc/*.c`` but the Python interface: module.c,
py_*.c) get a small ``main`` that reads a type, the shapes, the weight bytes and the inputs
from a file and writes the products, once at each thread count of ``--threads`` (the pool's
pool_set_threads, every product cut into tasks however small: pool_split_below(0), as
tests/test_threads.py does). Each build runs on the same random inputs: the products of every
supported type (one input and blocks of inputs, rows enough for several tasks a thread), the
pool's attention (one row cut by query heads, one over a window of more than 4096 positions
cut by positions and value columns, a block of rows), then the decode step's other operations
(RMSNorm, rotation, router, SiLU x up, attention), and the sampler's tokens (``sample.c``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

from foundry.model.kernels import quant
from foundry.model.kernels.quant import QType
from foundry.model.kernels.types import SUPPORTED
from foundry.model.nn.layers import gelu_table, rope_tables

CSRC = Path(__file__).resolve().parents[2] / "src" / "foundry" / "model" / "kernels" / "csrc"
FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]  # setup.py's
MAIN = r"""
#include <stdio.h>

#include "kernels.h"
static void *bytes_of(FILE *f, size_t n) { /* n bytes read from f (NULL when short) */
    void *p = malloc(n + 4);
    return p != NULL && fread(p, 1, n, f) == n ? p : NULL;
}
static float *floats(FILE *f, size_t n) { return bytes_of(f, 4 * n); }

/* in: -1 n d heads n_kv dh n_expert k f n_pos, then x, norm w, cos, sin, qk, router, gu, q,
 * k cache, v cache, the GELU table; out: rmsnorm, rope (adjacent pairs, then NEOX), route's
 * weights and top, swiglu, geglu, attend */
static int decode_ops(FILE *f, FILE *o) {
    int h[9];
    if (fread(h, 4, 9, f) != 9) return 3;
    const int n = h[0], d = h[1], heads = h[2], n_kv = h[3], dh = h[4], ne = h[5], k = h[6],
              ff = h[7], n_pos = h[8];
    const size_t qk_n = (size_t)n * heads * dh, cache = (size_t)n_pos * n_kv * dh;
    float *x = floats(f, (size_t)n * d), *w = floats(f, d), *cs = floats(f, (size_t)n * dh / 2),
          *sn = floats(f, (size_t)n * dh / 2), *qk = floats(f, qk_n),
          *wr = floats(f, (size_t)ne * d), *gu = floats(f, (size_t)n * 2 * ff),
          *q = floats(f, (size_t)heads * dh), *kc = floats(f, cache), *vc = floats(f, cache),
          *table = floats(f, 65536);
    if (!x || !w || !cs || !sn || !qk || !wr || !gu || !q || !kc || !vc || !table) return 4;
    float *y = malloc(4 * (size_t)n * d), *r = malloc(4 * qk_n), *r2 = malloc(4 * qk_n),
          *wt = malloc(4 * (size_t)n * k), *s = malloc(4 * (size_t)n * ff),
          *g = malloc(4 * (size_t)n * ff), *a = malloc(4 * (size_t)heads * dh),
          *p = malloc(4 * ((size_t)n_pos * heads + (size_t)n_kv * dh));
    int64_t *top = malloc(8 * (size_t)n * k);
    rmsnorm(x, w, n, d, 1e-5f, y);
    rope(qk, cs, sn, n, heads, dh, 0, r);
    rope(qk, cs, sn, n, heads, dh, 1, r2);
    route(x, wr, n, d, ne, k, wt, top);
    swiglu(gu, n, ff, s);
    geglu(gu, table, n, ff, g);
    attend(q, kc, vc, 0, n_pos, heads, n_kv, dh, p, a);
    fwrite(y, 4, (size_t)n * d, o);
    fwrite(r, 4, qk_n, o);
    fwrite(r2, 4, qk_n, o);
    fwrite(wt, 4, (size_t)n * k, o);
    fwrite(top, 8, (size_t)n * k, o);
    fwrite(s, 4, (size_t)n * ff, o);
    fwrite(g, 4, (size_t)n * ff, o);
    fwrite(a, 4, (size_t)heads * dh, o);
    return 0;
}

/* in: -2 rows n_head n_kv dh pos window half, then q (rows, n_head, dh) and the k and v caches
 * (pos + rows positions of n_kv x dh values, float16 where half); out: attend_rows' rows */
static int attention(FILE *f, FILE *o) {
    int h[7];
    if (fread(h, 4, 7, f) != 7) return 3;
    const int rows = h[0], n_head = h[1], n_kv = h[2], dh = h[3], pos = h[4], window = h[5],
              half = h[6];
    const size_t qn = (size_t)rows * n_head * dh,
                 cache = (size_t)(pos + rows) * n_kv * dh * (half ? 2 : 4);
    float *q = floats(f, qn), *out = malloc(4 * qn);
    void *k = bytes_of(f, cache), *v = bytes_of(f, cache);
    if (!q || !out || !k || !v) return 4;
    if (attend_rows(q, k, v, half, pos, window, rows, n_head, n_kv, dh, out) < 0) return 5;
    fwrite(out, 4, qn, o);
    free(q);
    free(out);
    free(k);
    free(v);
    return 0;
}

/* in: -3 rows vocab, then the rows' logits and their draws (temperature, top_p, u, top_k as
 * four doubles a row); out: sample_rows' tokens */
static int sampling(FILE *f, FILE *o) {
    int h[2];
    if (fread(h, 4, 2, f) != 2) return 3;
    const int rows = h[0], v = h[1];
    float *z = floats(f, (size_t)rows * v);
    double *a = bytes_of(f, 32 * (size_t)rows);
    const float **zr = malloc(sizeof *zr * (size_t)rows);
    sample_args *sa = malloc(sizeof *sa * (size_t)rows);
    int64_t *out = malloc(8 * (size_t)rows);
    if (!z || !a || !zr || !sa || !out) return 4;
    for (int r = 0; r < rows; r++) {
        zr[r] = z + (size_t)r * v;
        sa[r] = (sample_args){a[4 * r], a[4 * r + 1], a[4 * r + 2], (int64_t)a[4 * r + 3]};
    }
    sample_rows(zr, rows, v, sa, out);
    fwrite(out, 8, (size_t)rows, o);
    return 0;
}

/* in: -4 rows vocab k, the rows' logits of a block, then each row's sample_parts arguments
 * (PART_ARGS doubles); out: sample_parts' results (PART_OUTS doubles a row), then the rows'
 * candidates (k float32, then k int64, a row) */
static int parts(FILE *f, FILE *o) {
    int h[3];
    if (fread(h, 4, 3, f) != 3) return 3;
    const int rows = h[0], v = h[1], k = h[2];
    float *z = floats(f, (size_t)rows * v);
    double *a = bytes_of(f, 8 * PART_ARGS * (size_t)rows);
    float *e = malloc(4 * (size_t)rows * v), *ce = calloc((size_t)rows * k, 4);
    double *bsum = malloc(8 * (size_t)rows * ((v + 63) / 64));
    double *out = calloc((size_t)rows * PART_OUTS, 8);
    int64_t *cid = calloc((size_t)rows * k, 8);
    if (!z || !a || !e || !ce || !bsum || !out || !cid) return 4;
    sample_parts(z, rows, v, e, bsum, a, out, k, ce, cid);
    fwrite(out, 8, (size_t)rows * PART_OUTS, o);
    fwrite(ce, 4, (size_t)rows * k, o);
    fwrite(cid, 8, (size_t)rows * k, o);
    return 0;
}

/* One input: -1 the decode operations, -2 attention, -3 sampling, -4 a block's parts of the
 * draw, else a product: type k n_out n, the weights, x; out: y */
static int run(FILE *f, FILE *o) {
    int hdr[4], values, bytes;
    if (fread(hdr, 4, 1, f) != 1) return 1;
    if (hdr[0] == -1) return decode_ops(f, o);
    if (hdr[0] == -2) return attention(f, o);
    if (hdr[0] == -3) return sampling(f, o);
    if (hdr[0] == -4) return parts(f, o);
    if (fread(hdr + 1, 4, 3, f) != 3) return 1;
    type_block(hdr[0], &values, &bytes);
    size_t rb = (size_t)(hdr[1] / values) * bytes, nx = (size_t)hdr[3] * hdr[1];
    uint8_t *w = bytes_of(f, rb * hdr[2]);
    float *x = floats(f, nx), *y = malloc(4 * (size_t)hdr[3] * hdr[2]);
    if (!w || !x || !y) return 2;
    if (matmul(hdr[0], w, rb, hdr[2], hdr[1], x, hdr[3], y) < 0) return 5;
    fwrite(y, 4, (size_t)hdr[3] * hdr[2], o);
    free(w);
    free(x);
    free(y);
    return 0;
}

int main(int argc, char **argv) { /* in out threads...: the outputs at each count in turn */
    kernels_init();
    pool_split_below(0); /* every product cut into tasks, however small */
    FILE *o = fopen(argv[2], "wb");
    if (o == NULL) return 1;
    for (int a = 3; a < argc; a++) {
        if (pool_set_threads(atoi(argv[a])) < 0) return 6;
        FILE *f = fopen(argv[1], "rb");
        const int rc = f == NULL ? 1 : run(f, o);
        if (rc) return rc;
        fclose(f);
    }
    return fclose(o);
}
"""
BUILDS = {  # name: (compiler and flags, how to run)
    "x86-64 portable C": (["gcc"], []),
    "arm64 NEON": (["aarch64-linux-gnu-gcc", "-static"], ["qemu-aarch64-static"]),
    "arm64 NEON sdot": (
        ["aarch64-linux-gnu-gcc", "-static", "-march=armv8.2-a+dotprod"],
        ["qemu-aarch64-static", "-cpu", "max"],
    ),
    "armv7 NEON": (
        ["arm-linux-gnueabihf-gcc", "-static", "-mfpu=neon-vfpv4", "-mfloat-abi=hard"],
        ["qemu-arm-static"],
    ),
}
K = 512  # values a weight row
# (rows, inputs) of the products. At 4 threads 301 rows are 7 tasks of 48 rows, the last of 13
# (a part of every path's row group); 9 inputs a block (tiles, Q5_0 unpacked once); 99 rows of
# 130 inputs 7 row tasks, so the inputs are cut too (two tiles of 64 or more), and their
# preparation (8 a task).
PRODUCTS = ((301, 1), (301, 9), (99, 130))
# attend_rows' cases: what, rows, query heads, kv heads, head size, pos, window, cache type
ATTENTION = (
    ("one row, 2 kv heads: cut by query heads", 1, 8, 2, 64, 130, 0, np.float32),
    ("one row, 2 kv heads, float16 cache", 1, 8, 2, 64, 130, 0, np.float16),
    ("one row over 4101 positions, 2 heads: cut by positions", 1, 2, 1, 64, 4100, 0, np.float16),
    (
        "one row, window of 4100 at 4200, 2 heads: cut by positions",
        1,
        2,
        1,
        64,
        4200,
        4100,
        np.float32,
    ),
    ("5 rows, window 7: a task per row and kv head", 5, 8, 4, 32, 20, 7, np.float32),
)
RUN_S = 600  # the most one build's run of one input may take under emulation


def thread_counts(text: str) -> tuple[int, ...]:
    """``1,4`` as (1, 4): positive thread counts."""
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"thread counts are whole numbers >= 1 like 1,4, got {text!r}"
        )
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--threads",
        type=thread_counts,
        default=(1,),
        metavar="N,N,...",
        help="the thread counts each build runs every input at, each count's "
        "outputs compared with this machine's at 1 thread (default: 1)",
    )
    counts: tuple[int, ...] = parser.parse_args().threads
    missing = sorted(
        {t for cc, run in BUILDS.values() for t in cc[:1] + run[:1] if shutil.which(t) is None}
    )
    if missing:
        print(
            f"cross_arch.py: {', '.join(missing)} not found: install the packages --help names",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="foundry-cross-") as tmp:
        return check(Path(tmp), counts)


def check(tmp: Path, counts: tuple[int, ...]) -> int:
    """Build every build in ``tmp``, run each input on them at ``counts`` threads: 0 when all
    wrote this machine's bits."""
    main_c = tmp / "main.c"
    main_c.write_text(MAIN)
    sources = [
        str(p)
        for p in sorted(CSRC.glob("*.c"))  # but the Python interface
        if p.name != "module.c" and not p.name.startswith("py_")
    ]
    exes = {}
    for name, (cc, run) in BUILDS.items():
        exe = tmp / name.replace(" ", "-")
        if (
            subprocess.run(
                [
                    *cc,
                    *FLAGS,
                    "-I",
                    str(CSRC),
                    "-o",
                    str(exe),
                    str(main_c),
                    *sources,
                    "-lm",
                    "-pthread",
                ],
                timeout=RUN_S,
            ).returncode
            != 0
        ):
            print(f"FAIL: the {name} build did not compile (the compiler's messages above)")
            return 1
        exes[name] = [*run, str(exe)]
    quant.set_threads(1)
    print(
        f"this machine ({quant.KERNELS}) at 1 thread against each build at "
        f"{', '.join(map(str, counts))} threads"
    )
    rng = np.random.default_rng(7)
    ok = True
    for qtype in SUPPORTED:
        for n_out, n in PRODUCTS:
            w = stored(qtype, n_out, rng)
            x = rng.standard_normal((n, K), dtype=np.float32)
            (tmp / "in").write_bytes(
                np.array([int(qtype), K, n_out, n], np.int32).tobytes()
                + w.data.tobytes()
                + x.tobytes()
            )
            here = quant.linear(x, w).tobytes()
            ok = same_bits(f"{qtype.name:<5} {n_out} rows x {n:>3}", exes, tmp, here, counts) and ok
    ok = attention(exes, tmp, rng, counts) and ok
    ok = decode_ops(exes, tmp, rng, counts) and ok
    ok = sampling(exes, tmp, rng, counts) and ok
    ok = parts(exes, tmp, rng, counts) and ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def stored(qtype: QType, n_out: int, rng: np.random.Generator) -> quant.QTensor:
    """A weight of n_out rows of K values in ``qtype``: random values quantized, or for the
    K-quants random blocks with small scales (every code and sub-block scale taken)."""
    if qtype not in (QType.Q4_K, QType.Q5_K, QType.Q6_K):
        return quant.quantize(rng.standard_normal((n_out, K), dtype=np.float32), qtype)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (n_out, K // values, size), dtype=np.uint8)
    scale = (rng.random((n_out, K // values)) * 1e-3 + 1e-4).astype(np.float16)
    at = 208 if qtype == QType.Q6_K else 0
    data[..., at : at + 2] = scale.view(np.uint8).reshape(n_out, -1, 2)
    if qtype != QType.Q6_K:
        data[..., 2:4] = scale.view(np.uint8).reshape(n_out, -1, 2)
    return quant.QTensor(qtype, (n_out, K), data.reshape(n_out, -1))


def attention(
    exes: dict[str, list[str]], tmp: Path, rng: np.random.Generator, counts: tuple[int, ...]
) -> bool:
    """attend_rows, the pool's attention, on every build against this machine's module."""
    ok = True
    for what, rows, n_head, n_kv, dh, pos, window, dtype in ATTENTION:
        kc, vc = (rng.standard_normal((pos + rows, n_kv, dh)).astype(dtype) for _ in range(2))
        q = 3 * rng.standard_normal((rows, n_head, dh), dtype=np.float32)
        half = int(dtype == np.float16)
        (tmp / "in").write_bytes(
            np.array([-2, rows, n_head, n_kv, dh, pos, window, half], np.int32).tobytes()
            + q.tobytes()
            + kc.tobytes()
            + vc.tobytes()
        )
        out = np.empty_like(q)
        quant.attend_rows(q, kc, vc, pos, window, out)
        ok = same_bits(f"attention, {what}", exes, tmp, out.tobytes(), counts) and ok
    return ok


def decode_ops(
    exes: dict[str, list[str]], tmp: Path, rng: np.random.Generator, counts: tuple[int, ...]
) -> bool:
    """RMSNorm, the rotations (adjacent pairs and NEOX), the router, SiLU x up, GELU x up and
    attention (the decode step's operations besides the products) on every build against this
    machine's module."""
    n, d, heads, n_kv, dh, n_expert, k, f, n_pos = 3, 512, 8, 4, 64, 8, 2, 96, 37
    cos, sin = (a[5 : 5 + n] for a in rope_tables(64, dh, 10000.0))
    x = rng.standard_normal((n, d), dtype=np.float32)
    w = rng.standard_normal(d, dtype=np.float32)
    qk = rng.standard_normal((n, heads, dh), dtype=np.float32)
    w_router = rng.standard_normal((n_expert, d), dtype=np.float32)
    gu = 6 * rng.standard_normal((n, 2 * f), dtype=np.float32)
    q = 3 * rng.standard_normal((heads, dh), dtype=np.float32)
    kc, vc = (rng.standard_normal((n_pos, n_kv, dh), dtype=np.float32) for _ in range(2))
    (tmp / "in").write_bytes(
        np.array([-1, n, d, heads, n_kv, dh, n_expert, k, f, n_pos], np.int32).tobytes()
        + b"".join(a.tobytes() for a in (x, w, cos, sin, qk, w_router, gu, q, kc, vc, gelu_table()))
    )
    att = np.empty_like(q)
    quant.attend(q, kc, vc, n_pos, att)
    weights, top = quant.route(x, w_router, k)
    here = b"".join(
        a.tobytes()
        for a in (
            quant.rmsnorm(x, w, 1e-5),
            quant.rope(qk, cos, sin),
            quant.rope(qk, cos, sin, neox=True),
            weights,
            top,
            quant.swiglu(gu),
            quant.geglu(gu),
            att,
        )
    )
    return same_bits(
        "decode operations (RMSNorm, rotations, router, SiLU and GELU x up, attention)",
        exes,
        tmp,
        here,
        counts,
    )


# sample_rows' cases: (temperature, top_p, top_k), each drawn at several uniforms
DRAWS = ((0.0, 1.0, 0), (0.8, 1.0, 0), (1.1, 0.9, 0), (0.7, 1.0, 40), (1.3, 0.5, 20))
SAMPLE_VOCAB = 40_001  # not a multiple of the sampler's blocks of 64


def sampling(
    exes: dict[str, list[str]], tmp: Path, rng: np.random.Generator, counts: tuple[int, ...]
) -> bool:
    """sample_rows (the next token of each row: greedy, temperature, top-p, top-k) on every
    build against this machine's module, so the pair's ranks and a replay draw the same tokens
    on any machine: rows with masked (-inf) logits among them, each draw at five uniforms."""
    us = (0.0, 0.25, 0.5, 0.9, 1.0 - 2.0**-53)
    draws = [(t, p, u, k) for t, p, k in DRAWS for u in us]
    z = (3 * rng.standard_normal((len(draws), SAMPLE_VOCAB))).astype(np.float32)
    z[::3, ::7] = -np.inf
    args = np.array(draws, np.float64)
    (tmp / "in").write_bytes(
        np.array([-3, len(draws), SAMPLE_VOCAB], np.int32).tobytes() + z.tobytes() + args.tobytes()
    )
    kernels = quant._kernels
    assert kernels is not None
    here = np.empty(len(draws), np.int64)
    kernels.sample_rows(list(z), args, here)
    return same_bits(
        f"sampling, {len(draws)} rows of {SAMPLE_VOCAB} tokens", exes, tmp, here.tobytes(), counts
    )


def parts(
    exes: dict[str, list[str]], tmp: Path, rng: np.random.Generator, counts: tuple[int, ...]
) -> bool:
    """sample_parts (a rank's part of the draw of rows held in vocabulary blocks: the pair's
    ROW_DRAWS) on every build against this machine's module, so a leader and a worker of
    different machines draw the one process's tokens: the leader's pass and the worker's tail
    (uncut rows walked from several masses, rows cut to top_k), masked logits among them."""
    k = 64
    rows = []
    for temperature, top_k in ((0.8, 0), (1.3, 40), (0.5, 0), (1.0, 64)):
        for acc in (0.0, 10.0, 3000.0):
            for u in (0.0, 0.5, 1.0 - 2.0**-53):
                rows.append((1, 0.0, 1.0 / temperature, acc, u, 0.0, top_k, 500))  # PART_TAIL
        rows.append((0, 0.0, 1.0 / temperature, 0.0, 0.0, 0.0, 0, 0))  # PART_PASS
    args = np.array(rows, np.float64)
    z = (3 * rng.standard_normal((len(rows), SAMPLE_VOCAB))).astype(np.float32)
    z[::3, ::7] = -np.inf
    args[:, 1] = z.max(axis=1)  # the row's top
    args[:, 2] = args[:, 2].astype(np.float32)  # inv as the leader rounds it
    (tmp / "in").write_bytes(
        np.array([-4, len(rows), SAMPLE_VOCAB, k], np.int32).tobytes()
        + z.tobytes()
        + args.tobytes()
    )
    kernels = quant._kernels
    assert kernels is not None
    out = np.zeros((len(rows), 7), np.float64)
    ce, cid = np.zeros((len(rows), k), np.float32), np.zeros((len(rows), k), np.int64)
    e = np.empty((len(rows), SAMPLE_VOCAB), np.float32)
    bsum = np.empty((len(rows), (SAMPLE_VOCAB + 63) // 64), np.float64)
    kernels.sample_parts(z, e, bsum, args, out, ce, cid)
    return same_bits(
        f"a block's parts of the draw, {len(rows)} rows of {SAMPLE_VOCAB} tokens",
        exes,
        tmp,
        out.tobytes() + ce.tobytes() + cid.tobytes(),
        counts,
    )


def same_bits(
    what: str, exes: dict[str, list[str]], tmp: Path, here: bytes, counts: tuple[int, ...]
) -> bool:
    """Run every build on ``tmp/in`` at each thread count; one line on whether each count of
    each build wrote ``here``'s bytes."""
    verdicts, ok = [], True
    for name, argv in exes.items():
        subprocess.run(
            [*argv, str(tmp / "in"), str(tmp / "out"), *map(str, counts)], check=True, timeout=RUN_S
        )
        out = (tmp / "out").read_bytes()
        size = len(here)
        differ = [c for i, c in enumerate(counts) if out[i * size : (i + 1) * size] != here]
        if len(out) != size * len(counts):
            differ = list(counts)
        verdicts.append(
            f"{name}: same bits"
            if not differ
            else f"{name}: DIFFERENT at {', '.join(map(str, differ))} threads"
        )
        ok = ok and not differ
    print(f"{what}: " + ", ".join(verdicts))
    return ok


if __name__ == "__main__":
    sys.exit(main())
