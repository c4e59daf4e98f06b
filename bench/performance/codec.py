"""What each gradient codec costs on one core: bytes on the wire and encode+decode throughput.

For a ``--numel`` element (default 10 million) f32 gradient it measures, in one run:

- a numpy memory copy of the same buffer (``x.copy()``): the yardstick, since the machine's
  memory bandwidth and load vary from run to run;
- for each codec (NONE, FP16, TOPK at ``--topk-ratio``, QSGD with its defaults): the encoded
  size, the best of ``--repeats`` encodes and the best of ``--repeats`` decodes.

Throughput is MB (10**6 bytes) of f32 input per second of encode + decode, also shown as a
fraction of the copy's throughput. The gradient is normal noise at log-uniform scales from
1e-7 to 1e-2 per 4096-element block, like the layers of a real model: FP16 meets its
subnormal range and TOPK a wide spread of magnitudes.

Targets (one core, OPENBLAS_NUM_THREADS=1), each printed PASS or FAIL:
every codec >= 125 MB/s, FP16 >= 1000 MB/s, TOPK at 1 % >= 60x fewer bytes than NONE.
Exit status 1 when a target is missed.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/performance/codec.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
import numpy.typing as npt

from foundry.compression import Codec, get_codec
from foundry.wire.fdtc import Compression

MB = 1e6
MIN_THROUGHPUT_MB_S = 125.0
MIN_FP16_MB_S = 1000.0
MIN_TOPK_REDUCTION = 60.0


def gradient_like(numel: int, seed: int) -> npt.NDArray[np.float32]:
    rng = np.random.default_rng(seed)
    block = 4096
    scales = 10.0 ** rng.uniform(-7, -2, -(-numel // block))
    x = rng.standard_normal(numel) * np.repeat(scales, block)[:numel]
    return x.astype(np.float32)


def measure(codec: Codec, x: npt.NDArray[np.float32], repeats: int) -> dict[str, Any]:
    data = codec.encode(x)
    out, used = codec.decode(data, x.size)
    assert used == len(data) == codec.encoded_size(x.size)
    assert out.shape == x.shape
    enc = harness.best_of(repeats, lambda: codec.encode(x))
    dec = harness.best_of(repeats, lambda: codec.decode(data, x.size))
    return {
        "bytes": len(data),
        "encode_s": enc,
        "decode_s": dec,
        "mb_s": x.nbytes / MB / (enc + dec),
    }


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    harness.add_json_flag(parser)
    args = parser.parse_args(argv)

    x = gradient_like(args.numel, args.seed)
    copy_s = harness.best_of(args.repeats * 2, x.copy)
    copy_mb_s = x.nbytes / MB / copy_s
    print(f"gradient: {args.numel} f32 ({x.nbytes / MB:.1f} MB); numpy copy {copy_mb_s:,.0f} MB/s")
    print(
        f"{'codec':<12} {'wire bytes':>12} {'x smaller':>9} {'encode ms':>10} "
        f"{'decode ms':>10} {'MB/s':>8} {'vs copy':>8}"
    )
    results: dict[str, dict[str, Any]] = {}
    for comp in Compression:
        codec = get_codec(comp, topk_ratio=args.topk_ratio, seed=args.seed)
        r = measure(codec, x, args.repeats)
        r["reduction"] = x.nbytes / r["bytes"]
        r["vs_copy"] = r["mb_s"] / copy_mb_s
        results[comp.name] = r
        print(
            f"{comp.name:<12} {r['bytes']:>12,} {r['reduction']:>9.1f} "
            f"{r['encode_s'] * 1e3:>10.1f} {r['decode_s'] * 1e3:>10.1f} "
            f"{r['mb_s']:>8,.0f} {r['vs_copy']:>8.3f}"
        )

    checks = [
        (
            f"{name} encode+decode >= {MIN_THROUGHPUT_MB_S:.0f} MB/s ({r['mb_s']:,.0f})",
            r["mb_s"] >= MIN_THROUGHPUT_MB_S,
        )
        for name, r in results.items()
    ]
    fp16 = results["FP16"]["mb_s"]
    checks.append(
        (f"FP16 encode+decode >= {MIN_FP16_MB_S:.0f} MB/s ({fp16:,.0f})", fp16 >= MIN_FP16_MB_S)
    )
    reduction = results["NONE"]["bytes"] / results["TOPK"]["bytes"]
    checks.append(
        (
            f"TOPK at {args.topk_ratio:g} >= {MIN_TOPK_REDUCTION:.0f}x fewer bytes than "
            f"NONE ({reduction:.1f}x)",
            reduction >= MIN_TOPK_REDUCTION,
        )
    )
    for label, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {label}")
    ok = all(ok for _, ok in checks)
    harness.emit(
        "codec", {"numel": args.numel, "copy_mb_s": copy_mb_s, "codecs": results}, ok, args.json
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
