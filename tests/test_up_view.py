"""`foundry up`'s live view, the pure parts: waiting runs, failures told once, the workers'
traffic, a terminal that reports no size, a resumed run's summary.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import time

from foundry.model.infer.generate import printable
from foundry.up.view import LiveView, TrainingSummary, waiting_note, worker_line
from foundry.wire import fdtc


def test_a_waiting_run_says_how_many_workers_it_misses() -> None:
    def st(state: fdtc.SwarmState, rows: int) -> fdtc.SwarmStatus:
        row = fdtc.SwarmStatusRow(
            worker_id="w",
            profile=fdtc.HardwareProfile.SERVER,
            state=fdtc.WorkerState.IDLE,
            batch_size=1,
            accumulation_steps=1,
            samples_per_sec=0.0,
            loss=0.0,
            local_step=0,
            seconds_since_heartbeat=0.0,
        )
        return fdtc.SwarmStatus(
            global_step=3,
            max_steps=9,
            state=state,
            train_loss=1.0,
            val_loss=1.0,
            samples_per_sec=0.0,
            learning_rate=0.0,
            samples_total=0,
            rows=(row,) * rows,
        )

    assert waiting_note(st(fdtc.SwarmState.WAITING, 1), 2) == "waiting for 1 of 2 worker(s)"
    assert waiting_note(st(fdtc.SwarmState.TRAINING, 1), 2) is None
    assert waiting_note(st(fdtc.SwarmState.WAITING, 2), 2) is None


def test_the_live_view_tells_a_failure_once_and_the_workers_traffic() -> None:
    row = fdtc.SwarmStatusRow(
        worker_id="w0",
        profile=fdtc.HardwareProfile.SERVER,
        state=fdtc.WorkerState.IDLE,
        batch_size=4,
        accumulation_steps=2,
        samples_per_sec=10.0,
        loss=2.0,
        local_step=3,
        seconds_since_heartbeat=0.1,
    )
    st = fdtc.SwarmStatus(
        global_step=3,
        max_steps=9,
        state=fdtc.SwarmState.TRAINING,
        train_loss=1.0,
        val_loss=1.0,
        samples_per_sec=0.0,
        learning_rate=0.0,
        samples_total=0,
        rows=(row,),
    )
    more = fdtc.SwarmDetailRow(inner_steps=3, bytes_up=2_500_000, bytes_down=7_000_000)
    failed = fdtc.SwarmDetail(
        min_workers=1,
        seconds_since_step=0.5,
        failed=True,
        note="round loop failed: OSError: x",
        rows=(more,),
    )
    out = io.StringIO()
    view = LiveView(out, 9, tty=False, workers=1)
    view.update(st, failed)
    view.update(st, failed)
    assert out.getvalue().count("coordinator FAILED: round loop failed: OSError: x") == 1
    assert worker_line(row, more).endswith("3 steps  up 2.5 MB down 7.0 MB")


def _status(step: int) -> fdtc.SwarmStatus:
    return fdtc.SwarmStatus(
        global_step=step,
        max_steps=3000,
        state=fdtc.SwarmState.TRAINING,
        train_loss=1.0,
        val_loss=1.0,
        samples_per_sec=5.0,
        learning_rate=0.0,
        samples_total=0,
        rows=(),
    )


def test_the_live_view_draws_on_a_terminal_that_reports_no_size() -> None:
    """A pty nobody sized reports 0 columns: the bar still shows, and after a resume at step
    2000 its rate is this run's (one step a few ms apart), not 2000 steps in no time."""
    import pty

    master, slave = pty.openpty()  # a fresh pty: 0 rows, 0 columns
    try:
        out = os.fdopen(slave, "w", closefd=False)
        view = LiveView(out, 3000, tty=True, workers=0)
        detail = fdtc.SwarmDetail(
            min_workers=0, seconds_since_step=0.1, failed=False, note="", rows=()
        )
        view.update(_status(2000), detail)
        time.sleep(0.2)
        view.update(_status(2001), detail)
        view.close()
        out.flush()
        os.set_blocking(master, False)
        drawn = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(master, 65536):
                drawn += chunk
    finally:
        os.close(master)
        os.close(slave)
    text = drawn.decode(errors="replace")
    assert "training" in text and "2001/3000" in text, text
    rates = [float(r) for r in re.findall(r"([\d.]+)step/s", text)]
    assert rates and max(rates) < 100, text


def test_a_resumed_runs_summary_says_where_it_resumed() -> None:
    fresh = TrainingSummary(steps=30, first_loss=5.5, first_loss_step=1, last_loss=1.0744)
    assert fresh.loss_text() == "loss 5.5000 -> 1.0744"
    resumed = TrainingSummary(
        steps=30, first_loss=1.0717, first_loss_step=25, last_loss=1.0744, start_step=24
    )
    text = resumed.loss_text()
    assert text == (
        "resumed at step 24, 6 steps this run: loss 1.0717 after step 25, 1.0744 at the end"
    )
    assert "->" not in text


def test_printable_escapes_control_characters() -> None:
    assert printable("a\x1b[2Jb\nc\x07") == "a\\x1b[2Jb\nc\\x07"
