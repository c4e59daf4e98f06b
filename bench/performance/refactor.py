"""Two source trees against each other, interleaved: a swarm round and a decoded token.

For a change that moves code without meaning to change its speed (the coordinator split by job,
the kernels split by family), this runs the same two measurements on each tree in turn, round
after round (the order alternating), on the same machine:

- a swarm round: a coordinator and ``--workers`` workers of that tree on loopback
  (``bench/performance/swarm.py``'s ``run_swarm``), samples/s over ``--steps`` rounds after
  ``--warmup``;
- a decoded token: that tree's engine on a ``--preset`` model (random weights, float32),
  tokens/s over ``--tokens`` tokens (sessions of a 32-token prompt and 192 tokens), one
  thread.

Each tree is a checkout of a commit with its C extensions built in place (``git worktree add
/tmp/before COMMIT && cd /tmp/before && python setup.py build_ext --inplace``); ``--after``
defaults to this one. The bench code is this tree's, run on the other tree's package::

    python bench/performance/refactor.py --before /tmp/before --after /tmp/after --rounds 3

It prints every round and the medians, and each median's ratio this tree / the other, with
the rounds' spread: "no slower beyond noise" when the ratio is at least the slower of the two
trees' smallest round over its median.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

import harness  # noqa: E402  (bench/ is on the path only now)

SWARM = """
import argparse, json, sys
from pathlib import Path
sys.path.insert(0, {bench!r})
import swarm
args = argparse.Namespace(preset={preset!r}, global_batch={batch}, seq_len=64, steps={steps},
                          warmup={warmup}, coordinator_args="")
got = swarm.run_swarm(Path({work!r}), args, [1.0] * {workers})
print(json.dumps(got["samples_per_s"]))
"""

DECODE = """
import json, time
from foundry.model.spec.config import preset
from foundry.model.infer.inference import Engine
from foundry.model.nn.transformer import init_params
cfg = preset({preset!r})
engine = Engine(cfg, init_params(cfg, 0))
spent, done = 0.0, 0
while done < {tokens}:  # sessions of a 32-token prompt and up to 192 tokens (within any context)
    session = engine.new_session()
    engine.decode(session, list(range(32)))
    n = min(192, {tokens} - done)
    t = time.perf_counter()
    for i in range(n):
        engine.decode(session, [i % cfg.n_vocab])
    spent += time.perf_counter() - t
    done += n
print(json.dumps({tokens} / spent))
"""


def measure(tree: Path, code: str) -> float:
    """Run ``code`` under ``tree``'s src (ahead of the rest of PYTHONPATH); its last stdout
    line is the figure."""
    path = os.pathsep.join(p for p in (str(tree / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    if out.returncode != 0:
        raise SystemExit(f"{tree}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = harness.parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--before",
        type=Path,
        required=True,
        help="the other tree (a checkout with its extensions built)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--preset", default="small", help="model of both measurements (small)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12, help="measured swarm rounds (12)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens measured (64)")
    ap.add_argument("--after", type=Path, default=ROOT, help="the changed tree (this one)")
    harness.add_json_flag(ap)
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, tree in trees.items():
        if not (tree / "src" / "foundry").is_dir():
            raise SystemExit(f"--{name}: {tree} has no src/foundry")
    figures: dict[str, dict[str, list[float]]] = {
        what: {name: [] for name in trees} for what in ("swarm samples/s", "decode tokens/s")
    }
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                work = Path(tmp) / f"{name}-{r}"
                swarm_code = SWARM.format(
                    bench=str(HERE),
                    preset=args.preset,
                    batch=args.global_batch,
                    steps=args.steps,
                    warmup=args.warmup,
                    work=str(work),
                    workers=args.workers,
                )
                s = measure(trees[name], swarm_code)
                d = measure(trees[name], DECODE.format(preset=args.preset, tokens=args.tokens))
                figures["swarm samples/s"][name].append(s)
                figures["decode tokens/s"][name].append(d)
                print(
                    f"round {r + 1} {name:>6}: swarm {s:8.1f} samples/s, decode {d:7.2f} tokens/s",
                    flush=True,
                )
    ok = True
    results: dict[str, dict[str, float]] = {}
    for what, by_tree in figures.items():
        med = {name: harness.median(v) for name, v in by_tree.items()}
        ratio = harness.ratio(med["after"], med["before"])
        noise = min(min(v) / harness.median(v) for v in by_tree.values())
        same = ratio >= noise
        results[what] = {**med, "ratio": ratio, "noise": noise}
        ok &= same
        print(
            f"{what}: before {med['before']:.2f}, after {med['after']:.2f} (medians of "
            f"{args.rounds}): after / before {ratio:.3f}; the rounds' spread reaches "
            f"{noise:.3f} of a median: {'no slower beyond noise' if same else 'SLOWER'}"
        )
    harness.emit("refactor", results, ok, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
