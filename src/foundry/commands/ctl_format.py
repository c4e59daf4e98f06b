"""What `foundry ctl` prints: tables of the swarm's workers, its state and training, the TP
pair's, from the gateway's replies (the actions that ask are `foundry.commands.ctl`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def number(value: float, fmt: str) -> str:
    """``value`` as ``fmt`` writes it, or "-" where it is NaN (not known yet)."""
    return "-" if math.isnan(value) else format(value, fmt)


def enum_name(value: int, enum: Any, prefix: str) -> str:
    name: str = enum.Name(value)
    return name.removeprefix(prefix)


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Columns left-aligned to their widest cell, two spaces apart."""
    rows = [list(header), *(list(r) for r in rows)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_workers(workers: Sequence[Any]) -> str:
    from foundry.api.v1 import training_pb2

    if not workers:
        return "no workers registered"
    return table(
        [
            "worker",
            "profile",
            "state",
            "batch",
            "accum",
            "samples/s",
            "loss",
            "step",
            "inner steps",
            "bytes up",
            "bytes down",
            "heartbeat",
        ],
        (
            [
                w.worker_id,
                w.profile,
                enum_name(w.state, training_pb2.WorkerState, "WORKER_STATE_"),
                str(w.batch_size),
                str(w.accumulation_steps),
                number(w.samples_per_second, ".1f"),
                number(w.loss, ".4f"),
                str(w.local_step),
                str(w.inner_steps),
                _bytes(w.bytes_up),
                _bytes(w.bytes_down),
                f"{w.seconds_since_heartbeat:.1f} s ago",
            ]
            for w in workers
        ),
    )


def format_state(status: Any) -> str:
    """The run's state and why: FAILED with its cause, WAITING with the workers it lacks."""
    from foundry.api.v1 import training_pb2

    state = enum_name(status.state, training_pb2.TrainingState, "TRAINING_STATE_")
    if status.state == training_pb2.TRAINING_STATE_FAILED:
        return f"FAILED: {status.note}"
    if status.state == training_pb2.TRAINING_STATE_WAITING:
        have = len(status.workers)
        if have < status.min_workers:
            return (
                f"WAITING: {have} of {status.min_workers} workers (min-workers "
                f"{status.min_workers})"
            )
        return "WAITING for START (foundry ctl start)"
    if status.state == training_pb2.TRAINING_STATE_TRAINING:
        return f"TRAINING (last step {status.seconds_since_step:.1f} s ago)"
    return state


def format_training(status: Any) -> str:
    from foundry.api.v1 import training_pb2

    head = (
        f"training: {format_state(status)}  step {status.global_step}/{status.max_steps}  "
        f"loss {number(status.train_loss, '.4f')}  val {number(status.validation_loss, '.4f')} "
        # validation_loss is in nats per held-out byte: over ln 2, bits per byte.
        f"({number(status.validation_loss / math.log(2), '.3f')} bits/byte)  "
        f"lr {status.learning_rate:.2e}  {number(status.samples_per_second, '.1f')} samples/s  "
        f"{status.samples_total} samples"
    )
    if status.note and status.state != training_pb2.TRAINING_STATE_FAILED:
        head += f"\nwarning: {status.note}"
    return head + "\n\n" + format_workers(status.workers)


def format_pair(pair: Any) -> str:
    world = len(pair.ranks)
    if world > 2:
        rank = (
            f"all {world} ranks connected"
            if pair.worker_connected
            else f"world of {world} ranks DISCONNECTED"
        )
    else:
        rank = "worker rank connected" if pair.worker_connected else "worker rank DISCONNECTED"
    link = "shared memory" if pair.shared_memory else "tcp"
    text = (
        f"pair: {rank} ({link} gates)  model n_layer {pair.n_layer} n_embd {pair.n_embd} "
        f"n_vocab {pair.n_vocab} ctx {pair.ctx_size} ({pair.model_bytes} bytes, "
        f"id {pair.model_id:#010x})\n"
        f"      threads {pair.threads} (leader)  sessions {pair.active_sessions}  "
        f"requests {pair.requests_served}  "
        f"tokens {pair.tokens_generated}  speculative acceptance {pair.spec_acceptance:.2f}"
    )
    total = sum(r.share for r in pair.ranks)
    for r in pair.ranks:
        role = "leader" if r.rank == 0 else "worker"
        state = "" if r.connected else "  DISCONNECTED"
        threads = f"  threads {r.threads}" if r.threads else ""
        wait = "" if r.rank == 0 else f"  gate wait {1e6 * r.gate_wait_seconds:.0f} us"
        text += f"\n      rank {r.rank} ({role})  share {r.share}/{total}{threads}{wait}{state}"
    return text
