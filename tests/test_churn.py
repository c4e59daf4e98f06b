"""Churn soaks (``bench/robustness/churn.py``): kill -9 and restart pieces of a running system.

The swarm: a coordinator checkpointing every 10 steps and 3 workers; workers are killed and
started again every few seconds, and the coordinator once. The TP pair: its worker is killed
and started again while clients generate. The invariants are the harness's (its docstring);
the tests run each soak for a bounded time and require every one to hold.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path

import pytest
from procs import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # live, harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "robustness"))

import churn_swarm
import churn_tp
import live

from foundry.swarm.policy import INITIAL_DEADLINE_S
from foundry.transport.fdtc_stream import FdtcStream
from foundry.wire import fdtc

SEED = int(os.environ.get("FOUNDRY_CHURN_SEED", "1"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_swarm_survives_worker_and_coordinator_kills(tmp_path: Path) -> None:
    rep = churn_swarm.swarm_soak(
        tmp_path, seconds=30.0, seed=SEED, workers=3, checkpoint_every=10, kill_every=3.0
    )
    text = f"seed {SEED}\n{rep.summary()}\n" + "\n".join(rep.failures)
    print(text)
    assert rep.worker_kills >= 5 and rep.worker_restarts >= 4, text
    assert rep.coordinator_restarts == 1, text
    assert rep.registrations > rep.workers and rep.drops > 0, text  # membership did change
    assert not rep.step_regressions and not rep.corrupt_checkpoints, text
    assert 0 <= rep.steps_lost <= rep.checkpoint_every, text
    assert rep.checkpoints_verified >= 3, text
    assert rep.rounds_at_deadline == 0 and rep.rounds_abandoned == rep.rounds_emptied, text
    assert rep.loss_gap <= churn_swarm.LOSS_TOLERANCE, text  # no progress lost (below is fine)
    assert rep.ok, text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_pair_survives_worker_kills_during_generation(tmp_path: Path) -> None:
    rep = churn_tp.tp_soak(
        tmp_path, seconds=16.0, seed=SEED, clients=3, kill_every=2.0, out=lambda line: None
    )
    text = f"seed {SEED}\n{rep.summary()}\n" + "\n".join(rep.failures)
    print(text)
    assert rep.kills >= 3 and rep.served_again == rep.restarts == rep.kills, text
    assert rep.completed > 0 and rep.failed_unavailable > 0, text
    assert rep.hung == 0 and rep.wrong_text == 0 and not rep.other_errors, text
    assert rep.requests == rep.completed + rep.failed_unavailable, text
    assert rep.ok, text


def test_a_round_whose_workers_all_died_is_run_again_at_once(tmp_path: Path) -> None:
    """A worker that dies in its first round (no measured speed yet: the round's deadline is
    policy.INITIAL_DEADLINE_S, 120 s) must not keep a worker that joins after it idle."""
    coord, port, admin = live.start_coordinator(
        tmp_path, "--max-steps", "100000", "--global-batch", "16", "--checkpoint-every", "100000"
    )
    slow = live.start_worker(tmp_path, port, "slow", "--slowdown", "200")
    fresh = None
    try:
        coord.wait_for(r"worker slow registered")
        time.sleep(1.0)  # its first round is being computed, 200 times slower than usual
        assert live.swarm_status(admin).global_step == 0
        slow.kill9()
        fresh = live.start_worker(tmp_path, port, "fresh")
        coord.wait_for(r"worker fresh registered")
        # Well before the dead worker's deadline, which a round waiting it out would reach.
        wait_for(
            lambda: live.swarm_status(admin).global_step >= 1,
            INITIAL_DEADLINE_S / 4,
            "a step without the dead worker, before its round's deadline",
        )
        assert "every assigned worker left before reporting" in coord.text()
        assert coord.alive() and fresh.alive()
    finally:
        if fresh is not None:
            fresh.stop()
        slow.stop()
        coord.stop()


def test_a_stop_request_is_never_lost_in_an_fdtc_wait() -> None:
    """A worker stops by cancelling its task (SIGTERM). A cancellation that arrives in the
    same loop iteration as the result of a bounded wait (the drain of a send, the read of a
    frame's rest) must still propagate; ``asyncio.wait_for`` on Python 3.11 drops it, and a
    worker killed that way by the churn soak went on training until SIGKILL."""

    async def go() -> None:
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        stream = FdtcStream(reader, writer)

        async def send_then_wait() -> None:
            await stream.send(fdtc.StatusReq())  # its drain completes at once
            await asyncio.sleep(30)  # the worker's next wait

        try:
            task = asyncio.ensure_future(send_then_wait())
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5.0)
            reader.feed_data(fdtc.encode(fdtc.StatusReq())[:4])
            task = asyncio.ensure_future(stream.recv())
            for _ in range(3):
                await asyncio.sleep(0)  # recv waits for the rest of the frame begun
            reader.feed_data(b"\x00")  # ... which arrives with the stop request
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5.0)
        finally:
            writer.close()
            b.close()

    asyncio.run(go())
