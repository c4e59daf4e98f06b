"""QSGD's C coder gives the same bytes on x86-64, arm64 and armv7: the coder's part of
``compression/_qsgd.c`` built by cross compilers and run under qemu-user, against this
machine's module, on the same inputs and seeds.

    apt-get install gcc-aarch64-linux-gnu gcc-arm-linux-gnueabihf qemu-user-static
    python bench/determinism/qsgd_cross_arch.py

For each case (size, bucket, levels, with zeros, subnormals and huge values mixed in) it
compares the scales, the code stream, the decoded values the encoder computes and what the
decoder gives back, byte for byte, and prints PASS or FAIL per build.
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from foundry.compression import qsgd

SOURCE = Path(__file__).resolve().parents[2] / "src" / "foundry" / "compression" / "_qsgd.c"
HEAD = """#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef ptrdiff_t Py_ssize_t;
"""
MAIN = r"""
int main(int argc, char **argv) { /* in: n d s seed, values; out: scales codes decoded again */
    FILE *f = fopen(argv[1], "rb");
    long long h[4];
    (void)argc;
    if (!f || fread(h, 8, 4, f) != 4) return 1;
    Py_ssize_t n = h[0], d = h[1];
    int s = (int)h[2], bits = 1 + bit_length(s);
    float *v = malloc(4 * n);
    if (fread(v, 4, n, f) != (size_t)n) return 2;
    Py_ssize_t nb = (n + d - 1) / d, ns = (n * bits + 7) / 8;
    float *sc = malloc(4 * nb), *dec = malloc(4 * n), *re = malloc(4 * n);
    uint8_t *st = malloc(ns);
    if (encode_all(v, n, d, s, (uint64_t)h[3], sc, st, dec) < 0) return 3;
    if (decode_all(st, n, d, s, sc, re) < 0) return 4;
    FILE *o = fopen(argv[2], "wb");
    fwrite(sc, 4, nb, o); fwrite(st, 1, ns, o); fwrite(dec, 4, n, o); fwrite(re, 4, n, o);
    return fclose(o);
}
"""
BUILDS = {
    "arm64": (["aarch64-linux-gnu-gcc"], ["qemu-aarch64-static"]),
    "armv7": (
        ["arm-linux-gnueabihf-gcc", "-mfpu=neon-vfpv4", "-mfloat-abi=hard"],
        ["qemu-arm-static"],
    ),
}
CASES = [(100_003, 512, 7), (5000, 64, 127), (7777, 100, 3), (1000, 512, 1), (2049, 512, 31)]


def program() -> str:
    """The coder's C (its encode and decode loops, not the Python interface) with a main."""
    text = SOURCE.read_text()
    coder = text[
        text.index("static uint64_t splitmix64") : text.index("static PyObject *py_encode")
    ]
    decoder = text[text.index("static int decode_all(") : text.index("static PyObject *py_decode")]
    return HEAD + coder + decoder + MAIN


def expected(v: np.ndarray, d: int, s: int, seed: int) -> bytes:
    """This machine's module on the same case, in the program's output order."""
    assert qsgd._qsgd is not None
    n, bits = v.size, 1 + s.bit_length()
    scales, stream = bytearray(4 * -(-n // d)), bytearray(-(-n * bits // 8))
    decoded, again = np.empty(n, np.float32), np.empty(n, np.float32)
    qsgd._qsgd.encode(v.data, d, s, seed, scales, stream, decoded.data)
    qsgd._qsgd.decode(bytes(stream), d, s, bytes(scales), again.data)
    return bytes(scales) + bytes(stream) + decoded.tobytes() + again.tobytes()


def main() -> int:
    argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args()
    if qsgd._qsgd is None:
        print("the C coder is not built here (pip install -e . with a C compiler)")
        return 2
    rng = np.random.default_rng(0)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "q.c").write_text(program())
        for name, (cc, qemu) in BUILDS.items():
            exe = work / f"q-{name}"
            subprocess.run(
                [
                    *cc,
                    "-O3",
                    "-ffp-contract=off",
                    "-fno-trapping-math",
                    "-static",
                    str(work / "q.c"),
                    "-o",
                    str(exe),
                    "-lm",
                ],
                check=True,
            )
            same = True
            for n, d, s in CASES:
                v = (rng.standard_normal(n) * rng.uniform(0.01, 3, n)).astype(np.float32)
                v[:5] = [0.0, -0.0, 1e-40, -3e38, 5e-39]
                seed = 12345 + n
                (work / "in.bin").write_bytes(struct.pack("<4q", n, d, s, seed) + v.tobytes())
                run = subprocess.run(
                    [*qemu, str(exe), str(work / "in.bin"), str(work / "out.bin")], check=False
                )
                ok = run.returncode == 0 and (work / "out.bin").read_bytes() == expected(
                    v, d, s, seed
                )
                print(f"{name}: n {n}, bucket {d}, s {s}: {'same' if ok else 'DIFFERENT'}")
                same &= ok
            print(f"{name}: {'PASS' if same else 'FAIL'}")
            failed |= not same
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
