"""What the NaN/infinity check of a model load costs, on the ``bench`` preset.

    OPENBLAS_NUM_THREADS=1 python bench/performance/finite_check.py [--types f32,f16,q8_0,q4_0]
        [--rounds 3]

For each file type, a random ``bench``-preset model (about 1.7 GB of float32 weights) is
written to a temporary folder, then loaded ``--rounds`` times as the engine loads it
(``gguf_io.load_gguf_stored``, which checks every tensor once: ``finite.nonfinite``), and the
check alone is timed over the loaded tensors in the same rounds. Prints, per type, the median
load time, the median check time, and the check's share of the load (the ratio of the two,
measured in the same run). The first load of each file is not counted (it reads the file into
the page cache).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness

from foundry.model.formats.gguf_io import load_gguf_stored, save_gguf
from foundry.model.formats.gguf_model import FILE_DTYPES
from foundry.model.kernels import finite
from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--types", default="f32,q8_0", help="file types (default f32,q8_0)")
    ap.add_argument("--rounds", type=int, default=3, help="loads per type (default 3)")
    ap.add_argument("--preset", default="bench", help="model preset (default bench)")
    harness.add_json_flag(ap)
    args = ap.parse_args()
    types = args.types.split(",")
    for t in types:
        if t not in FILE_DTYPES:
            ap.error(f"unknown type {t}; choose from {', '.join(FILE_DTYPES)}")
    cfg = preset(args.preset)
    params = init_params(cfg, seed=0)
    print(f"preset {args.preset}: {cfg.n_params():,} parameters")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for t in types:
            path = Path(tmp) / f"model-{t}.gguf"
            save_gguf(path, cfg, params, dtype=t)  # type: ignore[arg-type]
            load_gguf_stored(path)  # into the page cache
            loads, checks = [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                model = load_gguf_stored(path)
                loads.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for p in model.params.values():
                    assert finite.nonfinite(p) is None
                checks.append(time.perf_counter() - t0)
            load, check = harness.median(loads), harness.median(checks)
            size = path.stat().st_size / 1e6
            share = harness.ratio(check, load)
            print(
                f"{t:5s} {size:8.0f} MB: load {load:.3f} s (check included), check alone "
                f"{check:.3f} s = {share:.1%} of the load"
            )
            results[t] = {"mb": size, "load_s": load, "check_s": check, "check_share": share}
            path.unlink()
    harness.emit("finite_check", results, None, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
