"""The measuring half of services/arm-smoke.sh: probes run on each architecture, comparisons
run on the x86 host.

  probe OUT.npz --data FILE        (any architecture) one gradient of the tiny preset on a fixed
                                   batch, plus the two kernels a gradient's rounding depends on:
                                   float32 matrix products (BLAS sgemm) and numpy's float32 exp
  compare-probes REF.npz OTHER.npz  where OTHER differs from REF, and by how much (in ulps)
  compare-weights A B               the weights of two checkpoints: bit-identical or how far apart
  tp-leader --model M --port P      an x86 leader in this process, against a worker rank started
                                    elsewhere (under emulation): identity, greedy text and logits
                                    against one x86 process

Run from the repository root; `tp-leader` uses the TP tests' harness (tests/tp_harness.py).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
PROMPT = "The "


def _probe_inputs() -> tuple[F32, F32, F32]:
    # Fixed inputs from integer arithmetic, not from a generator whose stream could differ.
    i = np.arange(64 * 256, dtype=np.int64)
    a = (((i * 7919) % 1000) / 250.0 - 2.0).astype(np.float32).reshape(64, 256)
    b = (((i * 104729) % 997) / 400.0 - 1.25).astype(np.float32).reshape(256, 64)
    x = np.linspace(-20.0, 5.0, 1 << 16, dtype=np.float32)
    return a, b, x


def probe(out: Path, data: Path) -> None:
    from foundry.model.nn.transformer import init_params
    from foundry.model.spec.config import preset
    from foundry.model.text.data import load_corpus
    from foundry.model.train.training import compute_gradients

    cfg = preset("tiny")
    grads = compute_gradients(
        init_params(cfg, 0), cfg, load_corpus(data), 0, 8,
        seq_len=64, micro_batch=8, aux_loss_coef=0.01,
    ).grads
    a, b, x = _probe_inputs()
    np.savez(
        out, machine=np.array(platform.machine()), numpy=np.array(np.__version__),
        sgemm=a @ b, exp=np.exp(x), **{f"grad:{k}": v for k, v in grads.items()},
    )
    print(f"probe {platform.machine()} numpy {np.__version__}: {len(grads)} gradients -> {out}")


def _ulps(a: F32, b: F32) -> int:
    ia = a.astype(np.float32).view(np.int32).astype(np.int64)
    ib = b.astype(np.float32).view(np.int32).astype(np.int64)
    return int(np.abs(ia - ib).max()) if ia.size else 0


def compare_probes(ref_path: Path, other_path: Path) -> None:
    ref, other = np.load(ref_path), np.load(other_path)
    who = f"{other['machine']} (numpy {other['numpy']}) vs {ref['machine']} (numpy {ref['numpy']})"
    print(f"kernels and one gradient, {who}:")
    for key in ("sgemm", "exp"):
        r, o = ref[key], other[key]
        n = int((r != o).sum())
        print(f"  {key:<6} {'bit-identical' if n == 0 else f'{n} of {r.size} differ'}"
              + ("" if n == 0 else f", at most {_ulps(r, o)} ulp"))
    names = [k for k in ref.files if k.startswith("grad:")]
    differ = [k for k in names if not np.array_equal(ref[k], other[k])]
    worst = max((float(np.abs(ref[k] - other[k]).max()) for k in names), default=0.0)
    print(f"  gradient: {len(names) - len(differ)} of {len(names)} tensors bit-identical"
          + ("" if not differ else f"; max abs diff {worst:.3g}, at most "
             f"{max(_ulps(ref[k], other[k]) for k in differ)} ulp"))


def compare_weights(a_path: Path, b_path: Path) -> None:
    from foundry.model.formats.checkpoint import latest_checkpoint, load_checkpoint

    def load(p: Path) -> tuple[int, dict[str, F32]]:
        found = latest_checkpoint(p) if p.is_dir() else p
        assert found is not None, f"no checkpoint in {p}"
        state = load_checkpoint(found)
        return state.step, state.params

    (sa, a), (sb, b) = load(a_path), load(b_path)
    assert sa == sb and a.keys() == b.keys(), f"step {sa} vs {sb}"
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    n_diff = sum(int((a[k] != b[k]).sum()) for k in differ)
    n_all = sum(v.size for v in a.values())
    if not differ:
        print(f"weights after step {sa}: bit-identical ({n_all:,} values)")
        return
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in differ)
    rel = max(float(np.abs(a[k] - b[k]).max() / (np.abs(a[k]).max() or 1.0)) for k in differ)
    print(f"weights after step {sa}: {n_diff:,} of {n_all:,} values differ, in {len(differ)} of "
          f"{len(a)} tensors; max abs diff {worst:.3g} ({rel:.2g} of the tensor's largest value)")


def tp_leader(model: Path, port: int, tokens: int) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tp_harness import Client, InProcessLeader, reference_greedy, wait_paired

    from foundry.model.text.vocab.byte import decode
    from foundry.tp.blas import limit_blas_threads
    from foundry.tp.leader import LeaderOptions
    from foundry.tp.policy import SpecMode
    from foundry.wire import frontend as fw

    limit_blas_threads(1)  # as the worker rank: BLAS results depend on the thread count
    rows: list[F32] = []
    leader = InProcessLeader(
        LeaderOptions(model=model, host="127.0.0.1", port=port, frontend_port=0,
                      spec_mode=SpecMode.OFF, shm=False, gate_timeout_s=60.0,
                      handshake_timeout_s=60.0, control_timeout_s=60.0),
        hook=lambda rid, r: rows.append(r.copy()),
    )
    print(f"tp-leader (x86, in process) listening on 127.0.0.1:{leader.leader.port}", flush=True)
    try:
        st = wait_paired(leader.leader.frontend_port, timeout=600.0)
        print(f"paired: identity agreed (n_layer {st.n_layer}, n_embd {st.n_embd}, n_vocab "
              f"{st.n_vocab}, ctx {st.ctx_size}, {st.model_bytes} model bytes)", flush=True)
        with Client(leader.leader.frontend_port, timeout=600.0) as c:
            got = c.generate(PROMPT, tokens)
        assert isinstance(got.end, fw.Done), got.end
    finally:
        leader.stop()
    ref = reference_greedy(model, PROMPT, tokens, LeaderOptions(model=model).prefill_chunk)
    same = got.tokens == ref.tokens
    print(f"greedy text, pair: {PROMPT + got.text!r}")
    print(f"greedy text, one x86 process: {PROMPT + decode(ref.tokens)!r}")
    pair, one = np.concatenate(rows), np.concatenate(ref.logits)
    diff = float(np.abs(pair - one).max())
    print(f"tokens {'identical' if same else 'DIFFERENT'} ({len(got.tokens)}); logits of "
          f"{len(rows)} steps: " + ("bit-identical" if np.array_equal(pair, one)
                                    else f"max abs diff {diff:.3g}"))
    return 0 if same and diff <= 1e-3 else 1


def main() -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe", allow_abbrev=False)
    pr.add_argument("out", type=Path)
    pr.add_argument("--data", type=Path, required=True)
    cp = sub.add_parser("compare-probes", allow_abbrev=False)
    cp.add_argument("ref", type=Path)
    cp.add_argument("other", type=Path)
    cw = sub.add_parser("compare-weights", allow_abbrev=False)
    cw.add_argument("a", type=Path)
    cw.add_argument("b", type=Path)
    tl = sub.add_parser("tp-leader", allow_abbrev=False)
    tl.add_argument("--model", type=Path, required=True)
    tl.add_argument("--port", type=int, required=True)
    tl.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    if args.cmd == "probe":
        probe(args.out, args.data)
    elif args.cmd == "compare-probes":
        compare_probes(args.ref, args.other)
    elif args.cmd == "compare-weights":
        compare_weights(args.a, args.b)
    else:
        return tp_leader(args.model, args.port, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
