"""The block kernels give the same bits on x86-64, arm64 (NEON, with and without sdot) and armv7
(NEON): the C file built by cross compilers and run under qemu-user, against this machine's
module (its best SIMD path).

    apt-get install gcc-aarch64-linux-gnu gcc-arm-linux-gnueabihf libc6-dev-arm64-cross \\
        libc6-dev-armhf-cross qemu-user-static
    python bench/determinism/cross_arch.py

The kernels' files (``src/foundry/model/kernels/csrc/*.c`` but the Python interface, module.c)
get a small ``main`` that reads a type, the shapes, the weight bytes and the inputs from a file
and writes the products; each build runs on the same random inputs for every supported type,
then on the decode step's other operations (RMSNorm, rotation, router, SiLU x up, attention).
"""

from __future__ import annotations

import argparse
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
static float *floats(FILE *f, size_t n) { /* n floats read from f (NULL when short) */
    float *p = malloc(4 * n + 4);
    return p != NULL && fread(p, 4, n, f) == n ? p : NULL;
}

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

int main(int argc, char **argv) { /* in: type k n_out n, weights, x; out: y */
    (void)argc;
    kernels_init();
    FILE *f = fopen(argv[1], "rb");
    int hdr[4], values, bytes;
    if (f == NULL || fread(hdr, 4, 1, f) != 1) return 1;
    if (hdr[0] < 0) {
        FILE *o = fopen(argv[2], "wb");
        const int rc = decode_ops(f, o);
        return rc ? rc : fclose(o);
    }
    if (fread(hdr + 1, 4, 3, f) != 3) return 1;
    type_block(hdr[0], &values, &bytes);
    size_t rb = (size_t)(hdr[1] / values) * bytes, nx = (size_t)hdr[3] * hdr[1];
    uint8_t *w = malloc(rb * hdr[2]);
    float *x = malloc(4 * nx), *y = malloc(4 * (size_t)hdr[3] * hdr[2]);
    if (fread(w, 1, rb * hdr[2], f) != rb * hdr[2] || fread(x, 4, nx, f) != nx) return 2;
    matmul(hdr[0], w, rb, hdr[2], hdr[1], x, hdr[3], y);
    FILE *o = fopen(argv[2], "wb");
    fwrite(y, 4, (size_t)hdr[3] * hdr[2], o);
    return fclose(o);
}
"""
BUILDS = {  # name: (compiler and flags, how to run)
    "x86-64 portable C": (["gcc"], []),
    "arm64 NEON": (["aarch64-linux-gnu-gcc", "-static"], ["qemu-aarch64-static"]),
    "arm64 NEON sdot": (["aarch64-linux-gnu-gcc", "-static", "-march=armv8.2-a+dotprod"],
                        ["qemu-aarch64-static", "-cpu", "max"]),
    "armv7 NEON": (["arm-linux-gnueabihf-gcc", "-static", "-mfpu=neon-vfpv4",
                    "-mfloat-abi=hard"], ["qemu-arm-static"]),
}


def main() -> int:
    argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="foundry-cross-"))
    main_c = tmp / "main.c"
    main_c.write_text(MAIN)
    sources = [str(p) for p in sorted(CSRC.glob("*.c"))  # but the Python interface
               if p.name != "module.c" and not p.name.startswith("py_")]
    exes = {}
    for name, (cc, run) in BUILDS.items():
        exe = tmp / name.replace(" ", "-")
        subprocess.run([*cc, *FLAGS, "-I", str(CSRC), "-o", str(exe), str(main_c), *sources,
                        "-lm", "-pthread"],
                       check=True)
        exes[name] = [*run, str(exe)]
    rng = np.random.default_rng(7)
    ok = True
    for qtype in SUPPORTED:
        k, n_out, n = 512, 13, 9  # 9 inputs: a block (tiles, Q5_0 unpacked once)
        w = rng.standard_normal((n_out, k), dtype=np.float32)
        if qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K):  # random blocks, small scales
            values, size = gguf.GGML_QUANT_SIZES[qtype]
            data = rng.integers(0, 256, (n_out, k // values, size), dtype=np.uint8)
            scale = (rng.random((n_out, k // values)) * 1e-3 + 1e-4).astype(np.float16)
            at = 208 if qtype == QType.Q6_K else 0
            data[..., at : at + 2] = scale.view(np.uint8).reshape(n_out, -1, 2)
            if qtype != QType.Q6_K:
                data[..., 2:4] = scale.view(np.uint8).reshape(n_out, -1, 2)
            q = quant.QTensor(qtype, (n_out, k), data.reshape(n_out, -1))
        else:
            q = quant.quantize(w, qtype)
        x = rng.standard_normal((n, k), dtype=np.float32)
        (tmp / "in").write_bytes(np.array([int(qtype), k, n_out, n], np.int32).tobytes()
                                 + q.data.tobytes() + x.tobytes())
        here = quant.linear(x, q).tobytes()
        ok = same_bits(f"{qtype.name:<5} this machine ({quant.KERNELS})", exes, tmp, here) and ok
    ok = decode_ops(exes, tmp, rng) and ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def decode_ops(exes: dict[str, list[str]], tmp: Path, rng: np.random.Generator) -> bool:
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
        + b"".join(a.tobytes() for a in (x, w, cos, sin, qk, w_router, gu, q, kc, vc,
                                         gelu_table())))
    att = np.empty_like(q)
    quant.attend(q, kc, vc, n_pos, att)
    weights, top = quant.route(x, w_router, k)
    here = b"".join(a.tobytes() for a in (
        quant.rmsnorm(x, w, 1e-5), quant.rope(qk, cos, sin), quant.rope(qk, cos, sin, neox=True),
        weights, top, quant.swiglu(gu), quant.geglu(gu), att))
    return same_bits("decode operations (RMSNorm, rotations, router, SiLU and GELU x up, "
                     "attention)", exes, tmp, here)


def same_bits(what: str, exes: dict[str, list[str]], tmp: Path, here: bytes) -> bool:
    """Run every build on ``tmp/in``; one line on whether each wrote ``here``'s bytes."""
    same = []
    for argv in exes.values():
        subprocess.run([*argv, str(tmp / "in"), str(tmp / "out")], check=True)
        same.append((tmp / "out").read_bytes() == here)
    print(f"{what} against " + ", ".join(f"{name}: {'same bits' if s else 'DIFFERENT'}"
                                          for name, s in zip(exes, same, strict=True)))
    return all(same)


if __name__ == "__main__":
    sys.exit(main())
