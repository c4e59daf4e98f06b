"""The block kernels give the same bits on x86-64, arm64 (NEON, with and without sdot) and armv7
(NEON): the C file built by cross compilers and run under qemu-user, against this machine's
module (its best SIMD path).

    apt-get install gcc-aarch64-linux-gnu gcc-arm-linux-gnueabihf libc6-dev-arm64-cross \\
        libc6-dev-armhf-cross qemu-user-static
    python bench/cross_arch.py

The kernels' part of ``_kernels.c`` (everything before its Python interface) gets a small
``main`` that reads a type, the shapes, the weight bytes and the inputs from a file and writes
the products; each build runs on the same random inputs for every supported type.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from foundry.model import quant
from foundry.model.quant import QType

SOURCE = Path(__file__).resolve().parents[1] / "src" / "foundry" / "model" / "_kernels.c"
MAIN = r"""
#include <stdio.h>
int main(int argc, char **argv) { /* in: type k n_out n, weights, x; out: y */
    (void)argc;
    for (uint32_t h = 0; h < 65536; h++) f16_table[h] = f16_bits_to_f32((uint16_t)h);
    FILE *f = fopen(argv[1], "rb");
    int hdr[4], values, bytes;
    if (f == NULL || fread(hdr, 4, 4, f) != 4) return 1;
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
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="foundry-cross-"))
    text = SOURCE.read_text().split("/* ---- Python interface")[0]
    kernels = tmp / "kernels.c"
    kernels.write_text(text.replace("#include <Python.h>", "").replace(
        "#define PY_SSIZE_T_CLEAN", "") + MAIN)
    exes = {}
    for name, (cc, run) in BUILDS.items():
        exe = tmp / name.replace(" ", "-")
        subprocess.run([*cc, "-O3", "-ffp-contract=off", "-o", str(exe), str(kernels), "-lm"],
                       check=True)
        exes[name] = [*run, str(exe)]
    rng = np.random.default_rng(7)
    ok = True
    for qtype in quant.SUPPORTED:
        k, n_out, n = 512, 13, 3
        w = rng.standard_normal((n_out, k), dtype=np.float32)
        if qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K):  # random blocks, small scales
            values, size = quant.gguf.GGML_QUANT_SIZES[qtype]
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
        here = quant.linear(x, q)
        same = []
        for argv in exes.values():
            subprocess.run([*argv, str(tmp / "in"), str(tmp / "out")], check=True)
            got = np.fromfile(tmp / "out", np.float32).reshape(n, n_out)
            same.append(np.array_equal(got, here))
            ok = ok and same[-1]
        print(f"{qtype.name:<5} this machine ({quant.KERNELS}) against "
              + ", ".join(f"{name}: {'same bits' if s else 'DIFFERENT'}"
                          for name, s in zip(exes, same, strict=True)))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
