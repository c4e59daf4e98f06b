"""What `foundry up` shows: the status lines and the live view (a tqdm bar with one line per
worker on a terminal, a plain line every tenth of the run on a pipe)."""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field
from typing import Any, TextIO

from foundry.wire import fdtc


def num(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def val_bpb(st: fdtc.SwarmStatus, per_token: bool = False) -> str:
    """The validation loss (nats per held-out byte) in bits per byte; with ``per_token`` (a
    fine-tuning run: tokens of the base's vocabulary) in nats per token."""
    if per_token:
        return f"{num(st.val_loss, '.4f')} nats/token"
    return f"{num(st.val_loss / math.log(2), '.3f')} bits/byte"


def status_line(st: fdtc.SwarmStatus, per_token: bool = False) -> str:
    return (
        f"{st.state.name.lower()} step {st.global_step}/{st.max_steps}  "
        f"loss {num(st.train_loss, '.4f')}  val {val_bpb(st, per_token)}  "
        f"{num(st.samples_per_sec, '.1f')} samples/s"
    )


def waiting_note(st: fdtc.SwarmStatus, expected: int) -> str | None:
    """What a WAITING run waits for: the workers that are missing (dead and being restarted,
    or not registered yet); None while it trains."""
    if st.state is not fdtc.SwarmState.WAITING or len(st.rows) >= expected:
        return None
    return f"waiting for {expected - len(st.rows)} of {expected} worker(s)"


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def worker_line(row: fdtc.SwarmStatusRow, more: fdtc.SwarmDetailRow) -> str:
    return (
        f"  {row.worker_id:<12} {row.profile.name.lower():<14} {row.state.name.lower():<10} "
        f"batch {row.batch_size}x{row.accumulation_steps}  "
        f"{num(row.samples_per_sec, '.1f')} samples/s  loss {num(row.loss, '.4f')}  "
        f"{more.inner_steps} steps  up {megabytes(more.bytes_up)} "
        f"down {megabytes(more.bytes_down)}"
    )


@dataclass
class TrainingSummary:
    steps: int = 0
    first_loss: float = float("nan")
    first_loss_step: int = 0  # the global step of first_loss
    last_loss: float = float("nan")
    val_loss: float = float("nan")
    first_val_loss: float = float("nan")  # the coordinator's first held-out loss (SWARM_DETAIL)
    first_val_step: int = 0  # its step: 0 on a fresh fine-tuning run (the base's loss)
    seconds: float = 0.0
    polls: int = 0
    start_step: int = 0  # the step the coordinator resumed at (its newest checkpoint); 0: fresh

    def loss_text(self) -> str:
        """The training loss of this run: first and last, and where a resumed run resumed
        (its first loss is of a model trained before, so first -> last is no trend)."""
        first, last = num(self.first_loss, ".4f"), num(self.last_loss, ".4f")
        if self.start_step > 0:
            return (
                f"resumed at step {self.start_step}, {self.steps - self.start_step} steps "
                f"this run: loss {first} after step {self.first_loss_step}, {last} at the "
                "end"
            )
        return f"loss {first} -> {last}"


# Bar width on a terminal that reports none (0 columns).
FALLBACK_COLUMNS = 80


def terminal_columns(out: TextIO) -> int:
    """The width of the terminal ``out`` writes to; 0 when it reports none or is no terminal."""
    try:
        return os.get_terminal_size(out.fileno()).columns
    except (OSError, ValueError, io.UnsupportedOperation):
        return 0


@dataclass
class LiveView:
    """A tqdm bar (step, loss, samples/s) with one line per worker on a terminal; on a pipe
    a plain line every tenth of the run.

    The bar counts from the first step it sees, so a resumed run's rate is this run's. A
    terminal that reports no size (a serial console, a pty nobody sized) gets bars
    ``FALLBACK_COLUMNS`` wide: tqdm would fit them into zero columns and print nothing."""

    out: TextIO
    total: int
    tty: bool
    workers: int = 0  # the run's --min-workers: fewer registered is told
    per_token: bool = False  # a fine-tuning run: its held-out loss is per token, not byte
    bars: list[Any] = field(default_factory=list)
    _printed_at: int = -1
    _told_waiting: str | None = None
    _told_failure: str | None = None

    def update(self, st: fdtc.SwarmStatus, detail: fdtc.SwarmDetail) -> None:
        failure = detail.note if detail.failed else None
        if failure is not None and failure != self._told_failure:
            self.note(f"coordinator FAILED: {failure}")
        self._told_failure = failure
        waiting = waiting_note(st, self.workers)
        if not self.tty:
            if waiting is not None and waiting != self._told_waiting:
                print(f"  {waiting}", file=self.out, flush=True)
            self._told_waiting = waiting
            every = max(1, st.max_steps // 10)
            mark = st.global_step // every
            if mark != self._printed_at and not math.isnan(st.train_loss):
                self._printed_at = mark
                print(f"  {status_line(st, self.per_token)}", file=self.out, flush=True)
            return
        from tqdm import tqdm

        sized = terminal_columns(self.out) > 0
        ncols = None if sized else FALLBACK_COLUMNS
        if not self.bars:
            self.bars.append(
                tqdm(
                    total=st.max_steps,
                    initial=st.global_step,
                    unit="step",
                    desc="training",
                    file=self.out,
                    dynamic_ncols=sized,
                    ncols=ncols,
                    leave=True,
                )
            )
        bar = self.bars[0]
        bar.set_description_str(waiting or "training", refresh=False)
        bar.n = st.global_step
        bar.set_postfix_str(
            f"loss {num(st.train_loss, '.4f')} val {val_bpb(st, self.per_token)} "
            f"{num(st.samples_per_sec, '.1f')} samples/s",
            refresh=False,
        )
        while len(self.bars) < 1 + len(st.rows):
            self.bars.append(
                tqdm(
                    total=0,
                    position=len(self.bars),
                    bar_format="{desc}",
                    file=self.out,
                    ncols=ncols,
                    leave=False,
                )
            )
        for i, row_bar in enumerate(self.bars[1:]):
            text = (
                worker_line(st.rows[i], detail.rows[i]) if i < len(st.rows) else "  (worker gone)"
            )
            row_bar.set_description_str(text, refresh=True)
        bar.refresh()

    def note(self, line: str) -> None:
        """A line above the bars (a terminal) or between the status lines (a pipe)."""
        if self.bars:
            self.bars[0].write(line, file=self.out)
        else:
            print(line, file=self.out, flush=True)

    def close(self) -> None:
        for bar in reversed(self.bars):
            bar.close()
        self.bars.clear()
