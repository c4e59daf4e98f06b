"""Resident memory of each rank of a world against one process holding the whole model.

Makes a model file (or takes ``--model``), then in one run:

- **bare**: a process that imports the ranks' modules and reads the file's header only (the
  interpreter, numpy and our code: what every rank carries whatever it holds);
- **one process**: ``Engine`` over the whole file (``load_gguf_stored``), world 1;
- **worlds of N** (``--worlds 2,3,4``): ``foundry tp-leader --world-size N`` and N-1
  ``foundry tp-worker`` processes on 127.0.0.1, read once the world is formed.

Each rank loads only its slices (``tp.handshake.load_rank``: the file is mapped, each tensor's
slice taken, the pages of what was copied given back), so its resident memory beyond the bare
process should be about its share of the split tensors plus the replicated ones (embeddings,
norms, routers). The table gives VmRSS per process, the part above the bare process, and that
part against the one process's.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/performance/tp_world_memory.py
        [--worlds 2,3,4] [--type q8_0] [--model FILE] [--json PATH]
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np

from foundry.model.formats.gguf_io import save_gguf
from foundry.model.nn import transformer as T
from foundry.model.spec.config import ModelConfig

# 8 layers, 8 experts of 512 x 512: 50M routed-expert weights, 4 kv heads (2, 3, 4 ranks).
CFG = ModelConfig(
    n_embd=512, n_layer=8, n_head=8, n_head_kv=4, n_ff=512, n_expert=8, n_expert_used=2, n_ctx=256
)
LEADER = re.compile(r"tp-leader listening: workers [\d.]+:(\d+)")
PROBE = """
import sys, numpy
import foundry.cli, foundry.commands.tp, foundry.tp.leader, foundry.tp.worker
from foundry.model.formats.gguf_io import load_gguf, load_gguf_stored
from foundry.model.infer.inference import Engine
if sys.argv[2] == "whole":
    m = load_gguf_stored(sys.argv[1])
    e = Engine(m.cfg, m.params, ctx_size=256)
else:
    load_gguf(sys.argv[1], select=lambda n, v: None)
print(open("/proc/self/status").read(), flush=True)
"""


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))  # type: ignore[union-attr]


def probe(model: Path, what: str) -> int:
    got = subprocess.run(
        [sys.executable, "-c", PROBE, str(model), what], capture_output=True, text=True, timeout=600
    )
    if got.returncode:
        raise SystemExit(f"the {what} probe failed: {got.stderr}")
    out = got.stdout
    return int(re.search(r"VmRSS:\s+(\d+)", out).group(1))  # type: ignore[union-attr]


def world_rss(model: Path, world: int, logs: Path) -> list[int]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    foundry = [sys.executable, "-m", "foundry"]
    leader = subprocess.Popen(
        [
            *foundry,
            "tp-leader",
            "--model",
            str(model),
            "--world-size",
            str(world),
            "--listen",
            "127.0.0.1:0",
            "--frontend-listen",
            "127.0.0.1:0",
            "--ctx-size",
            "256",
            "--expert-split",
            "experts",
        ],
        stdout=subprocess.PIPE,
        stderr=(logs / f"leader{world}.log").open("w"),
        env=env,
        text=True,
    )
    workers: list[subprocess.Popen[bytes]] = []
    try:
        assert leader.stdout is not None
        line = leader.stdout.readline()
        port = LEADER.search(line)
        if port is None:
            log = (logs / f"leader{world}.log").read_text()
            raise SystemExit(f"the leader did not start: {log}")
        for r in range(1, world):
            workers.append(
                subprocess.Popen(
                    [
                        *foundry,
                        "tp-worker",
                        "--model",
                        str(model),
                        "--leader",
                        f"127.0.0.1:{port.group(1)}",
                        "--rank",
                        str(r),
                        "--ctx-size",
                        "256",
                        "--gate-listen",
                        "127.0.0.1:0",
                        "--expert-split",
                        "experts",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=(logs / f"worker{world}-{r}.log").open("w"),
                    env=env,
                )
            )
        deadline = time.monotonic() + 300
        while not all(
            "paired with the leader" in (logs / f"worker{world}-{r}.log").read_text()
            for r in range(1, world)
        ):
            if time.monotonic() > deadline:
                raise SystemExit(f"the world of {world} did not form; logs in {logs}")
            time.sleep(0.2)
        time.sleep(0.5)
        return [rss_kib(p.pid) for p in (leader, *workers)]
    finally:
        leader.send_signal(signal.SIGTERM)
        leader.wait(30)
        for w in workers:
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--type", default="q8_0", help="the made model's storage (default q8_0)")
    ap.add_argument("--model", type=Path, default=None, help="a model file instead of made one")
    harness.add_json_flag(ap)
    a = ap.parse_args()
    results: dict[str, object] = {"threads_per_rank": 1, "clients": 0}
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        model = a.model
        if model is None:
            model = logs / "model.gguf"
            params = T.init_params(CFG, seed=0)
            rng = np.random.default_rng(1)
            for p in params.values():
                p += np.float32(0.1) * rng.standard_normal(p.shape, dtype=np.float32)
            save_gguf(model, CFG, params, dtype=a.type)
            del params
        size = model.stat().st_size
        bare = probe(model, "bare")
        whole = probe(model, "whole")
        print(
            f"model {model.name}: {size / 2**20:.1f} MiB on disk; VmRSS in MiB (1 BLAS thread, "
            f"ctx 256, one process each)"
        )
        print(f"{'process':<22} {'VmRSS':>8} {'above bare':>11} {'/ one process':>14}")
        print(f"{'bare (header only)':<22} {bare / 1024:>8.1f} {'':>11} {'':>14}")
        print(
            f"{'one process':<22} {whole / 1024:>8.1f} {(whole - bare) / 1024:>11.1f} {1.0:>14.2f}"
        )
        results.update(model_mib=size / 2**20, bare_kib=bare, one_process_kib=whole)
        for w in (int(x) for x in a.worlds.split(",")):
            ranks = world_rss(model, w, logs)
            results[f"world_{w}_kib"] = ranks
            for r, kib in enumerate(ranks):
                print(
                    f"{f'world {w} rank {r}':<22} {kib / 1024:>8.1f} "
                    f"{(kib - bare) / 1024:>11.1f} {(kib - bare) / (whole - bare):>14.2f}"
                )
    harness.emit("tp_world_memory", results, None, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
