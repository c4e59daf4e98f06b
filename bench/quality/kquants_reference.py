"""Foundry's Q4_K and Q6_K writers against llama.cpp's reference quantizers, byte for byte.

``--lib`` is a shared library of ggml's ``ggml-quants.c`` (from llama.cpp's source, e.g. the
tree vendored in llama-cpp-python's sdist), built without FMA as the portable C is::

    gcc -c -fPIC -O2 -I ggml/include -I ggml/src -I build/ggml/src ggml/src/ggml-quants.c
    gcc -shared -fPIC ggml-quants.o stubs.c -o libggml-quants.so -lm

where ``stubs.c`` defines ``ggml_abort``, ``ggml_row_size``, ``ggml_type_name`` and
``ggml_type_size`` (the quantizers never call them). It quantizes random, heavy-tailed,
all-positive, constant and zero rows, and with ``--gguf`` every Q4_K and Q6_K tensor of a file
(dequantized first), with both, and prints how many bytes differ.

    python bench/quality/kquants_reference.py --lib libggml-quants.so \\
        --gguf gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: harness

import harness

from foundry.model.kernels import kquants

WRITERS = {"q4_K": (kquants.quantize_q4_k, 144), "q6_K": (kquants.quantize_q6_k, 210)}


def reference(lib: ctypes.CDLL, name: str, x: np.ndarray, block: int) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.zeros(x.size // 256 * block, np.uint8)
    getattr(lib, f"quantize_row_{name}_ref")(
        x.ctypes.data_as(ctypes.c_void_p),
        out.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_int64(x.size),
    )
    return out


def main() -> int:
    ap = harness.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", type=Path, required=True)
    ap.add_argument("--gguf", type=Path, default=None)
    args = ap.parse_args()
    lib = ctypes.CDLL(str(args.lib))
    rng = np.random.default_rng(0)
    inputs = {
        "normal": rng.standard_normal((64, 512)),
        "student-t 3": rng.standard_t(3, (64, 768)) * 0.05,
        "positive": np.abs(rng.standard_normal((16, 256))) + 1.0,
        "constant": np.full((4, 256), 0.25),
        "zero": np.zeros((4, 256)),
    }
    if args.gguf is not None:
        from foundry.model.formats.gguf_io import load_gguf_stored
        from foundry.model.kernels.quant import QTensor

        m = load_gguf_stored(args.gguf)
        for n, p in m.params.items():
            if isinstance(p, QTensor) and p.qtype.name in ("Q4_K", "Q6_K"):
                inputs[n] = p.dequantize()
    bad = 0
    for what, x in inputs.items():
        for name, (write, block) in WRITERS.items():
            t0 = time.perf_counter()
            ours = write(np.asarray(x, np.float32)).reshape(-1)
            seconds = time.perf_counter() - t0
            differ = int(np.count_nonzero(ours != reference(lib, name, x, block)))
            bad += differ > 0
            print(f"{what:<28} {name}: {differ} bytes differ ({seconds:.2f} s)")
    print(f"{len(inputs) * len(WRITERS) - bad} of {len(inputs) * len(WRITERS)} byte-equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
