"""The tensor-parallel pair against one process, measured in one run, for each expert split.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/performance/tp.py [--preset bench|small]
        [--tokens 64]
        [--expert-split both|experts|intermediate] [--type f32|f16|q8_0|q4_0]
        [--link 1gbit [--burst-ms 10] [--ip ip] [--tc tc]] [--model FILE] [--timeout S]
        [--no-spec]

For each expert split (``experts``: each rank holds half of the experts whole; ``intermediate``:
each rank holds half of every expert's intermediate size), one after the other:

1. Decode tokens/s of one process (a world-1 ``Engine`` in that split, one BLAS thread, pinned
   to core A) against the pair (leader in this process pinned to core A, worker a process
   pinned to core B, one BLAS thread each), greedy, speculative decoding off. Target: the pair
   at least 1.6x. The pair's tokens must equal the single process's. The one process also
   times each half's share of every gate: the **balance bound** is the one process's time over
   the time of a pair whose every gate costs the slower half's work (no exchange, no waiting
   on memory bandwidth): the most this split lets a pair gain, whatever the machine.
2. Gate exchange p50/p99 inside the pair (every gate of the decode run, over shared memory and
   over TCP) against a raw ping-pong of the same bytes (tag + one row of n_embd float32) over
   plain blocking sockets between the same two cores. Target: the TCP gate's p50 at most 2x
   the raw p50. A gate inside the pair also waits for the slower rank to reach it, so the ATTN
   gates (equal work on both ranks) are shown apart from the FFN gates (with ``experts`` the
   router may send both of a token's experts to one rank).
3. Bytes per decoded token on the wire, per rank and direction, against the formula: 2 gates x
   n_layer x (20-byte tag + 4 n_embd bytes), plus the control frames (EVAL from the leader, the
   worker's LOGITS half: 28-byte header + 4 + 4 n_vocab/2 bytes).
4. Speculative decoding's speed-up on repetitive text (full-prefix mode against off, same
   prompt, twice as many tokens, identical output required).
5. With ``--link RATE`` (as root): the pair once more over TCP, each rank in a network
   namespace of its own, joined by a veth pair shaped to RATE by ``tc tbf`` in both
   directions (the leader's namespace holds this process's frontend client too). Target at
   1gbit: the pair at least 1.4x the one process. The tokens must equal the one process's.

``--type`` stores the model as f16, q8_0 or q4_0 (``foundry export --type``): both the one
process and the ranks then hold it in that type and multiply with the block kernels, and the
pair's tokens must still equal the one process's.

``--model FILE`` runs a published GGUF file instead (docs/models.md, "Speed and memory"): the
prompt is encoded by the file's tokenizer (as the leader encodes it), greedy decoding stops at
its end-of-generation token as the leader's does, and a dense model runs once (no experts to
split). For each pair run the bench says where a token's time goes on the leader: its time in
the 2 x n_layer gates and, of it, the exchange itself (each gate's shorter time of the two
ranks); its wait for the worker's half of the logits (``PairCommands.join``, timed); and its
own work; and for the one process, the output head's time (each vocabulary half, alone).
``--burst-ms`` sets the shaped link's tbf burst (default 10 ms at the rate: a frame smaller
than that passes at the veth's speed when the bucket is full; 1 ms paces a 524 KB logits half
as a wire would). ``--timeout S`` raises both ranks' gate and control timeouts, for a machine
busy with other work; ``--no-spec`` skips step 4.

Its parts are modules beside it: the one process (``tp_single``), the pair's ranks and what
they measured (``tp_ranks``), the shaped link (``tp_link``).

The ``bench`` preset (~1.7 GB of float32 weights: decode is bound by memory bandwidth) is
built in memory from a seeded normal * 0.02 and written to /tmp once (reused afterwards);
``--preset small`` is a quick run. Prints PASS/FAIL per target and a table of both splits;
exit status 1 on a FAIL.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import ctypes
import multiprocessing as mp
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
import numpy as np
from tp_gates import cores, pin, raw_exchange
from tp_link import CLONE_NEWNET, LINK_SUBNET, Link, enter_netns
from tp_ranks import (
    TIMEOUTS,
    GatePairs,
    InProcessLeader,
    JoinTimer,
    WorkerProc,
    aligned,
    counters,
    exchange_ms,
    generate,
    rate,
    wait_paired,
    where,
    with_timeouts,
)
from tp_single import build_model, single_process

from foundry.model.formats.gguf_io import load_gguf
from foundry.model.formats.gguf_model import FILE_DTYPES
from foundry.model.shard.table import ExpertSplit, Gate
from foundry.model.spec.config import PRESETS, ModelConfig
from foundry.model.text.vocab import load_tokenizer_file
from foundry.tp.blas import limit_blas_threads
from foundry.tp.leader import LeaderOptions
from foundry.tp.speculative import SpecMode
from foundry.wire.tp import GATE_HEADER_SIZE

SPEEDUP_TARGET = 1.6
LINK_TARGET = 1.4  # the pair over a 1 Gb/s shaped link, against the one process
GATE_TARGET = 2.0
PROMPT = "Tensor parallel decoding splits every layer in two halves. "
REPETITIVE = "for i in range(10):\n    print(i)\n" * 6
RAW_ITERS, RAW_WARMUP = 3000, 300


def bench_link(
    model: Path,
    mode: ExpertSplit,
    prompt: str,
    tokens: int,
    one_tokens: list[int],
    one_rate: float,
    core_b: int | None,
    tmp: Path,
    link: Link,
    n_layer: int,
) -> dict[str, object]:
    """The pair over TCP across the shaped link: this process (leader and frontend client) in
    the leader's namespace, the worker in its own."""
    tag = f"[{mode.value}]"
    link.up()
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        enter_netns(f"/var/run/netns/{link.names[0]}")
        leader = InProcessLeader(
            with_timeouts(
                LeaderOptions(
                    model=model,
                    host=f"{LINK_SUBNET}.1",
                    port=0,
                    frontend_port=0,
                    spec_mode=SpecMode.OFF,
                    expert_split=mode,
                )
            )
        )
        lead = leader.leader
        joins = JoinTimer(lead)
        worker = WorkerProc(
            model,
            lead.port,
            core_b,
            False,
            tmp / f"link-{mode.value}.npy",
            mode,
            netns=link.names[1],
            host=f"{LINK_SUBNET}.1",
        )
        try:
            wait_paired(lead, shm=False)
            generate(lead.frontend_port, prompt, 4)  # warm-up
            n_trace = len(lead.gate_latencies())
            got, times = generate(lead.frontend_port, prompt, tokens)
            gates = lead.gate_latencies()
        finally:
            leader.stop()  # first, as for the TCP pair on loopback
            worker_gates = worker.stop()
    finally:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns(home, CLONE_NEWNET)
        os.close(home)
        link.down()
    link_rate = rate(times)
    speedup = link_rate / one_rate
    same = got == one_tokens
    spent = where(tag, "link", link_rate, gates, joins.times, len(got) - 1, n_layer)
    pairs = aligned(gates, worker_gates, n_trace, len(gates) - n_trace)
    spent["link_exchange_ms"] = exchange_ms(tag, "link", pairs, len(got) - 1, n_layer)
    passed = speedup >= LINK_TARGET and same
    print(
        f"{tag} pair, TCP over a {link.rate} tbf-shaped veth between two namespaces: "
        f"{link_rate:.2f} tokens/s  speed-up {speedup:.2f}x (target >= {LINK_TARGET}x) "
        f"{'PASS' if passed else 'FAIL'}{'' if same else '  (tokens differ from one process!)'}"
    )
    return {
        "pair_link_tokens_per_s": link_rate,
        "speedup_link": speedup,
        "same_tokens_link": same,
        "link_pass": passed,
        **spent,
    }


def percentiles_us(values: list[float]) -> tuple[float, float]:
    if not values:  # a rank whose gate trace was lost (it did not stop in time)
        return float("nan"), float("nan")
    arr = np.asarray(values) * 1e6
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def raw_child(port: int, nbytes: int, core: int | None, iters: int) -> None:
    pin(core)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, into = memoryview(bytes(nbytes)), memoryview(bytearray(nbytes))
    for _ in range(iters):
        raw_exchange(sock, out, into)
    sock.close()


def raw_pingpong(nbytes: int, core: int | None) -> list[float]:
    """Seconds of a symmetric exchange of nbytes over plain blocking sockets, per iteration."""
    ctx = mp.get_context("spawn")
    with socket.create_server(("127.0.0.1", 0)) as server:
        child = ctx.Process(
            target=raw_child, args=(server.getsockname()[1], nbytes, core, RAW_ITERS + RAW_WARMUP)
        )
        child.start()
        sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, into = memoryview(bytes(nbytes)), memoryview(bytearray(nbytes))
    times = []
    for i in range(RAW_ITERS + RAW_WARMUP):
        t0 = time.perf_counter()
        raw_exchange(sock, out, into)
        if i >= RAW_WARMUP:
            times.append(time.perf_counter() - t0)
    sock.close()
    child.join(30)
    return times


@dataclass
class ModeRun:
    """What one expert split measured: results, PASS/FAIL, and the two ranks' gate times of
    the decode runs (leader's, worker's), over shared memory and over TCP."""

    mode: ExpertSplit
    results: dict[str, object]
    ok: bool
    shm: GatePairs
    tcp: GatePairs


def bench_mode(
    mode: ExpertSplit,
    model: Path,
    cfg: ModelConfig,
    prompt_ids: list[int],
    tokens: int,
    core_b: int | None,
    tmp: Path,
    link: Link | None,
    eog: frozenset[int],
    spec: bool = True,
) -> ModeRun:
    """One process, then the pair over shared memory (bytes, speculative decoding), then over
    TCP, all with the experts cut by ``mode``."""
    tag = f"[{mode.value}]"
    one_tokens, one_rate, bal = single_process(model, prompt_ids, tokens, mode, eog)
    heads = [v for k, v in sorted(bal.items()) if k.startswith("head")]
    print(
        f"{tag} one process: {len(one_tokens)} tokens, a step {bal['step_ms']:.2f} ms of "
        f"which the output head {sum(heads):.2f} ms (its vocabulary halves "
        f"{' / '.join(f'{h:.2f}' for h in heads)} ms)"
    )
    if len(one_tokens) < tokens:
        print(f"{tag}   (an end-of-generation token after {len(one_tokens)} tokens)")
    tokens = len(one_tokens)
    print(
        f"{tag} one process: {one_rate:.2f} tokens/s; each half's work alone "
        f"{bal['half0_tokens_per_s']:.2f} / {bal['half1_tokens_per_s']:.2f} tokens/s, "
        f"balance bound {bal['bound']:.2f}x (the faster half waits "
        f"{bal['idle_share']:.0%} of the split work)"
    )
    results: dict[str, object] = {
        "one_process_tokens_per_s": one_rate,
        **{f"balance_{k}": v for k, v in bal.items()},
    }
    ok = True
    leader = InProcessLeader(
        with_timeouts(
            LeaderOptions(
                model=model,
                host="127.0.0.1",
                port=0,
                frontend_port=0,
                spec_mode=SpecMode.OFF,
                expert_split=mode,
            )
        )
    )
    lead = leader.leader
    joins = JoinTimer(lead)
    worker = WorkerProc(model, lead.port, core_b, True, tmp / f"shm-{mode.value}.npy", mode)
    try:
        wait_paired(lead, shm=True)
        generate(lead.frontend_port, PROMPT, 4)  # warm-up
        before, n_trace = counters(lead), len(lead.gate_latencies())
        pair_tokens, times = generate(lead.frontend_port, PROMPT, tokens)
        after = counters(lead)
        shm_gates = lead.gate_latencies()[n_trace:]
        pair_rate = rate(times)
        speedup = pair_rate / one_rate
        same = pair_tokens == one_tokens
        passed = speedup >= SPEEDUP_TARGET and same
        ok = ok and passed
        print(
            f"{tag} pair, shared-memory gates: {pair_rate:.2f} tokens/s  speed-up "
            f"{speedup:.2f}x (target >= {SPEEDUP_TARGET}x) {'PASS' if passed else 'FAIL'}"
            f"{'' if same else '  (tokens differ from one process!)'}"
        )
        results.update(pair_tokens_per_s=pair_rate, speedup=speedup, same_tokens=same)
        results.update(
            where(tag, "shm", pair_rate, shm_gates, joins.times, tokens - 1, cfg.n_layer)
        )

        # Bytes per decoded token (the prefill's are excluded: one SYNC, then tokens - 1
        # EVALs for tokens tokens; count the EVAL steps).
        steps = tokens - 1
        decode_gates = 2 * cfg.n_layer * steps
        per = {k: (after[k] - before[k]) for k in after}
        # The warm-up left a session the measured prompt continues: only the rest is prefilled.
        prefilled = len(prompt_ids) - int(per["prompt_reused"])
        prefill_gate_bytes = 2 * cfg.n_layer * (GATE_HEADER_SIZE + 4 * cfg.n_embd * prefilled)
        gate_per_token = (per["gate_sent"] - prefill_gate_bytes) / steps
        formula_gate = 2 * cfg.n_layer * (GATE_HEADER_SIZE + 4 * cfg.n_embd)
        v1 = cfg.n_vocab - (cfg.n_vocab + 1) // 2
        formula_logits = 28 + 4 + 4 * v1
        formula_eval = 28 + 4
        print(
            f"{tag} bytes per decoded token, each rank sends: gates {gate_per_token:.0f} "
            f"(formula 2 x {cfg.n_layer} x (20 + 4 x {cfg.n_embd}) = {formula_gate}); "
            f"leader control sent {per['control_sent'] / tokens:.0f} per token "
            f"(EVAL {formula_eval}, plus the SYNC, its checkpoint and SESSION_* once); "
            f"worker LOGITS {per['control_received'] / tokens:.0f} per token "
            f"(formula {formula_logits})"
        )
        bytes_ok = abs(gate_per_token - formula_gate) <= 0.01 * formula_gate
        ok = ok and bytes_ok
        print(
            f"{tag}   gate bytes match the formula: {'PASS' if bytes_ok else 'FAIL'}; "
            f"{len(shm_gates)} gates timed ({decode_gates} decode gates + the prefill's)"
        )
        results.update(
            gate_bytes_per_token=gate_per_token,
            formula_gate_bytes=formula_gate,
            logits_bytes_per_token=per["control_received"] / tokens,
        )

        # Speculative decoding on repetitive text (skipped with --no-spec).
        if spec:
            n_spec = 2 * tokens  # loops take a while to form in a random model's output
            plain_tokens, plain_times = generate(lead.frontend_port, REPETITIVE, n_spec)
            lead.spec_mode = SpecMode.FULL_PREFIX
            drafted0, accepted0 = lead.drafted, lead.accepted
            spec_tokens, spec_times = generate(lead.frontend_port, REPETITIVE, n_spec)
            lead.spec_mode = SpecMode.OFF
            spec_speedup = rate(spec_times) / rate(plain_times)
            drafted, accepted = lead.drafted - drafted0, lead.accepted - accepted0
            spec_ok = spec_tokens == plain_tokens and spec_speedup > 1.0
            ok = ok and spec_ok
            differ = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(spec_tokens, plain_tokens, strict=False))
                    if a != b
                ),
                None,
            )
            print(
                f"{tag} speculative (full-prefix) on repetitive text: {rate(spec_times):.2f} "
                f"against {rate(plain_times):.2f} tokens/s, speed-up {spec_speedup:.2f}x, "
                f"{accepted} of {drafted} drafts accepted, same tokens as plain greedy decoding "
                f"of the same prompt: {spec_tokens == plain_tokens}"
                f"{'' if differ is None else f' (first differs at token {differ})'} "
                f"{'PASS' if spec_ok else 'FAIL'}"
            )
            results.update(spec_speedup=spec_speedup, spec_drafted=drafted, spec_accepted=accepted)
    finally:
        shm_worker = worker.stop()
    shm_pairs = aligned(lead.gate_latencies(), shm_worker, n_trace, len(shm_gates))

    # The same pair over TCP gates.
    worker = WorkerProc(model, lead.port, core_b, False, tmp / f"tcp-{mode.value}.npy", mode)
    try:
        wait_paired(lead, shm=False)
        generate(lead.frontend_port, PROMPT, 4)  # warm-up
        n_trace = len(lead.gate_latencies())
        tcp_tokens, times = generate(lead.frontend_port, PROMPT, tokens)
        tcp_gates = lead.gate_latencies()[n_trace:]
        tcp_rate = rate(times)
        results.update(
            where(tag, "tcp", tcp_rate, tcp_gates, joins.times, len(tcp_tokens) - 1, cfg.n_layer)
        )
        print(
            f"{tag} pair, TCP gates: {tcp_rate:.2f} tokens/s  speed-up "
            f"{tcp_rate / one_rate:.2f}x"
            f"{'' if tcp_tokens == one_tokens else '  (tokens differ from one process!)'}"
        )
        results.update(
            pair_tcp_tokens_per_s=tcp_rate,
            speedup_tcp=tcp_rate / one_rate,
            same_tokens_tcp=tcp_tokens == one_tokens,
        )
    finally:
        # The leader first: a TCP worker blocked reading its link sees the SIGTERM only once
        # the link closes (it was killed, and its gate times lost, the other way round).
        leader.stop()
        tcp_worker = worker.stop()
    tcp_pairs = aligned(lead.gate_latencies(), tcp_worker, n_trace, len(tcp_gates))
    results["shm_exchange_ms"] = exchange_ms(tag, "shm", shm_pairs, tokens - 1, cfg.n_layer)
    results["tcp_exchange_ms"] = exchange_ms(tag, "tcp", tcp_pairs, tokens - 1, cfg.n_layer)
    if link is not None:
        shaped = bench_link(
            model, mode, PROMPT, tokens, one_tokens, one_rate, core_b, tmp, link, cfg.n_layer
        )
        ok = ok and bool(shaped["link_pass"])
        results.update(shaped)
    return ModeRun(mode, results, ok, shm_pairs, tcp_pairs)


def main() -> int:
    parser = harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench", choices=["bench", "small"])
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per run")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="use this GGUF instead (a published file: its tokenizer encodes the "
        "prompt; a dense model runs once, its experts unsplit)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="both ranks' gate and control timeouts (on a busy machine)",
    )
    parser.add_argument(
        "--no-spec", action="store_true", help="skip the speculative-decoding measurement"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--expert-split",
        default="both",
        choices=["both", *(m.value for m in ExpertSplit)],
        help="the expert split(s) to measure, one after the other (default both)",
    )
    harness.add_json_flag(parser)
    parser.add_argument(
        "--type",
        default="f32",
        choices=FILE_DTYPES,
        help="store the built model as this type (default f32)",
    )
    parser.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="also run the pair across two namespaces shaped to RATE, e.g. "
        "1gbit (needs root, ip and tc)",
    )
    parser.add_argument(
        "--burst-ms",
        type=float,
        default=10.0,
        help="the shaped link's tbf burst, in ms at the rate (default 10)",
    )
    parser.add_argument("--ip", default="ip", help="the ip command (iproute2)")
    parser.add_argument("--tc", default="tc", help="the tc command (iproute2)")
    args = parser.parse_args()
    if args.timeout is not None:
        TIMEOUTS.update(gate_timeout_s=args.timeout, control_timeout_s=args.timeout)
    started = time.monotonic()
    limit_blas_threads(1)
    pair_cores = cores()
    core_a, core_b = (pair_cores[0], pair_cores[1]) if pair_cores else (None, None)
    pin(core_a)
    model = args.model or Path(f"/tmp/foundry-bench-tp-{args.preset}-{args.seed}-{args.type}.gguf")
    built = (
        build_model(PRESETS[args.preset], model, args.seed, args.type)
        if args.model is None
        else 0.0
    )
    link = Link(args.link, args.ip, args.tc, args.burst_ms) if args.link else None
    cfg = load_gguf(model, select=lambda n, v: None).cfg
    print(
        f"model {model} ({model.stat().st_size / 1e9:.2f} GB; built in {built:.1f} s), "
        f"{f'cores {core_a} and {core_b}' if pair_cores else 'not pinned'}"
    )
    tokenizer = load_tokenizer_file(model)  # the leader's too
    prompt_ids = tokenizer.encode(PROMPT)
    modes = list(ExpertSplit) if args.expert_split == "both" else [ExpertSplit(args.expert_split)]
    if cfg.n_expert == 0:
        modes = modes[:1]  # a dense model: no experts to split, one run

    tmp = Path(tempfile.mkdtemp(prefix="foundry-bench-tp-"))
    runs = [
        bench_mode(
            mode,
            model,
            cfg,
            prompt_ids,
            args.tokens,
            core_b,
            tmp,
            link,
            tokenizer.eog_ids,
            spec=not args.no_spec,
        )
        for mode in modes
    ]
    ok = all(run.ok for run in runs)
    results: dict[str, object] = {
        "preset": args.preset,
        "type": args.type,
        **{run.mode.value: run.results for run in runs},
    }

    raw = raw_pingpong(GATE_HEADER_SIZE + 4 * cfg.n_embd, core_b)
    raw50, raw99 = percentiles_us(raw)
    n_decode = 2 * cfg.n_layer * (args.tokens - 1)  # the decode steps' gates, the last ones
    print(
        f"gate exchange of {GATE_HEADER_SIZE + 4 * cfg.n_embd} bytes, us: p50, p99, p50 "
        f"against raw. 'leader' is the leader's time in the gate, waiting for the slower rank "
        f"included; 'exchange' is the shorter of the two ranks' times for the same gate: the "
        f"rank that arrived last waits for nobody, so that is the exchange itself."
    )
    print(f"  raw socket ping-pong                    {raw50:8.1f} {raw99:8.1f}")
    for run in runs:
        for name, pairs in (("shm", run.shm), ("tcp", run.tcp)):
            decode = pairs[-n_decode:]
            wrong = [i for i, ((g, _), (wg, _)) in enumerate(decode) if g is not wg]
            if decode and (len(decode) < n_decode or wrong):  # (none: the worker's were lost)
                print(
                    f"  {run.mode.value} {name}: the ranks' gate traces are not aligned "
                    f"({len(decode)} pairs for {n_decode} decode gates, the first of "
                    f"{len(wrong)} differing at {wrong[0] if wrong else None}); "
                    f"no gate times for it"
                )
                ok = False
                continue
            for label, pick in (("all", None), ("ATTN", Gate.ATTN), ("FFN", Gate.FFN)):
                rows = [(lt, wt) for (g, lt), (_, wt) in decode if pick is None or g is pick]
                lead50, lead99 = percentiles_us([lt for lt, _ in rows])
                ex50, ex99 = percentiles_us([min(lt, wt) for lt, wt in rows])
                verdict = ""
                if label == "all" and name == "tcp":
                    passed = ex50 / raw50 <= GATE_TARGET
                    ok = ok and passed
                    verdict = (
                        f"  {'PASS' if passed else 'FAIL'} (target: exchange <= {GATE_TARGET:g}x)"
                    )
                where = f"{run.mode.value:<12} {name} {label:<4}"
                print(f"  {where} leader   {lead50:8.1f} {lead99:8.1f} {lead50 / raw50:6.2f}x")
                print(f"  {where} exchange {ex50:8.1f} {ex99:8.1f} {ex50 / raw50:6.2f}x{verdict}")
                key = f"gate_{name}_{label.lower()}"
                run.results.update({
                    f"{key}_leader_p50_us": lead50, f"{key}_leader_p99_us": lead99,
                    f"{key}_exchange_p50_us": ex50, f"{key}_exchange_p99_us": ex99,
                })  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)

    print("decode tokens/s, greedy, speculative decoding off:")
    print(
        f"  {'expert split':<14}{'one process':>12}{'pair shm':>10}{'pair tcp':>10}"
        f"{'speed-up':>10}{'bound':>8}{f'tcp {args.link}' if link else '':>12}"
    )
    for run in runs:
        r = {k: v for k, v in run.results.items() if isinstance(v, float)}
        shaped = f"{r['pair_link_tokens_per_s']:>12.2f}" if link else ""
        print(
            f"  {run.mode.value:<14}{r['one_process_tokens_per_s']:>12.2f}"
            f"{r['pair_tokens_per_s']:>10.2f}{r['pair_tcp_tokens_per_s']:>10.2f}"
            f"{max(r['speedup'], r['speedup_tcp']):>9.2f}x{r['balance_bound']:>7.2f}x{shaped}"
        )
    results.update(
        raw_p50_us=raw50, raw_p99_us=raw99, pass_all=ok, seconds=time.monotonic() - started
    )
    print(f"took {time.monotonic() - started:.0f} s; overall {'PASS' if ok else 'FAIL'}")
    harness.emit("tp", results, ok, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
