"""The gateway in front of a real `foundry coordinator` process: every training and model call,
health that follows the coordinator, and `foundry gateway` + `foundry ctl` as processes.

tests/procs.py starts the processes; its blocking waits run in a thread here, so that the
gateway in this process keeps serving meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import procs
from gateway_pair import expect_code, free_port, run, wait_health
from grpc_health.v1 import health_pb2

from foundry.api.v1 import model_pb2, model_pb2_grpc, training_pb2, training_pb2_grpc
from foundry.gateway.server import Gateway, GatewayOptions

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GATEWAY_LISTENING = r"gateway listening: grpc 127\.0\.0\.1:(\d+).*metrics :(\d+)"
# A training run small enough to finish in a few seconds on one core.
TINY_RUN = (
    "--preset",
    "tiny",
    "--max-steps",
    "3",
    "--global-batch",
    "2",
    "--seq-len",
    "16",
    "--checkpoint-every",
    "1000",
    "--warmup-steps",
    "1",
)


async def start_coordinator(tmp: Path, admin_port: int = 0) -> tuple[procs.Service, int, int]:
    """A coordinator waiting for START; returns it, its worker port and its admin port.
    procs.coordinator asks for admin port 0; argparse keeps the last of a repeated flag."""
    return await asyncio.to_thread(
        procs.coordinator,
        tmp,
        "--admin-listen",
        f"127.0.0.1:{admin_port}",
        "--wait-for-start",
        *TINY_RUN,
        name=f"coordinator-{time.monotonic_ns()}",
    )


async def exit_code(service: procs.Service, within_s: float = 20.0) -> int:
    """Wait for a process that ends by itself."""
    code: int = await asyncio.to_thread(service.proc.wait, within_s)
    return code


@contextlib.asynccontextmanager
async def gateway_for(admin_port: int) -> AsyncIterator[tuple[Gateway, grpc.aio.Channel]]:
    gateway = Gateway(
        GatewayOptions(
            listen_host="127.0.0.1",
            listen_port=0,
            coordinator_host="127.0.0.1",
            coordinator_port=admin_port,
            frontend_host="127.0.0.1",
            frontend_port=free_port(),
            probe_interval_s=0.2,
            grace_s=0.5,
        )
    )
    port = await gateway.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield gateway, channel
    finally:
        await channel.close()
        await gateway.stop()


# ---------------------------------------------------------------------------- tests


def test_health_follows_the_coordinator(tmp_path: Path) -> None:
    async def main() -> None:
        admin_port = free_port()
        async with gateway_for(admin_port) as (_, channel):
            training = "foundry.v1.TrainingService"
            await wait_health(channel, training, NOT_SERVING, 1)
            await wait_health(channel, "", SERVING, 1)
            coordinator, _, _ = await start_coordinator(tmp_path, admin_port)
            try:
                await wait_health(channel, training, SERVING, 3)
                await wait_health(channel, "foundry.v1.ModelService", SERVING, 1)
            finally:
                await asyncio.to_thread(coordinator.kill)
            await wait_health(channel, training, NOT_SERVING, 3)
            stub = training_pb2_grpc.TrainingServiceStub(channel)
            await expect_code(
                stub.GetTrainingStatus(training_pb2.GetTrainingStatusRequest(), timeout=5),
                grpc.StatusCode.UNAVAILABLE,
                f"--admin-listen 127.0.0.1:{admin_port}",
            )
            coordinator, _, _ = await start_coordinator(tmp_path, admin_port)
            try:
                await wait_health(channel, training, SERVING, 3)
                # The pooled admin connection died with the first coordinator; the gateway
                # reconnects on its own.
                got = await stub.GetTrainingStatus(
                    training_pb2.GetTrainingStatusRequest(), timeout=5
                )
                assert got.status.state == training_pb2.TRAINING_STATE_WAITING
            finally:
                await asyncio.to_thread(coordinator.stop)

    run(main, timeout_s=90)


def test_every_training_and_model_call_against_a_real_coordinator(tmp_path: Path) -> None:
    async def main() -> None:
        coordinator, worker_port, admin_port = await start_coordinator(tmp_path)
        joined: procs.Service | None = None
        try:
            async with gateway_for(admin_port) as (_, channel):
                t = training_pb2_grpc.TrainingServiceStub(channel)
                m = model_pb2_grpc.ModelServiceStub(channel)

                got = await t.GetTrainingStatus(training_pb2.GetTrainingStatusRequest(), timeout=5)
                assert got.status.state == training_pb2.TRAINING_STATE_WAITING
                assert (got.status.global_step, got.status.max_steps) == (0, 3)
                assert list(got.status.workers) == []
                assert (got.status.min_workers, got.status.note) == (1, "")
                assert list((await t.ListWorkers(training_pb2.ListWorkersRequest())).workers) == []

                ck = await t.CreateCheckpoint(training_pb2.CreateCheckpointRequest(), timeout=30)
                assert Path(ck.path).is_file() and ck.global_step == 0
                out = tmp_path / "exported.gguf"
                ex = await m.ExportModel(model_pb2.ExportModelRequest(path=str(out)), timeout=30)
                assert Path(ex.path) == out and out.stat().st_size > 0
                await expect_code(
                    m.ExportModel(model_pb2.ExportModelRequest(path="x" * 300), timeout=5),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "path",
                )

                started = await t.StartTraining(training_pb2.StartTrainingRequest(), timeout=5)
                assert started.message
                paused = await t.PauseTraining(training_pb2.PauseTrainingRequest(), timeout=5)
                assert "pause" in paused.message
                got = await t.GetTrainingStatus(training_pb2.GetTrainingStatusRequest(), timeout=5)
                assert got.status.state == training_pb2.TRAINING_STATE_PAUSED

                # A worker joins the paused run, so it is listed before any round runs.
                joined = procs.worker(tmp_path, worker_port, "w1")
                deadline = time.monotonic() + 60
                while not (
                    listed := list(
                        (await t.ListWorkers(training_pb2.ListWorkersRequest(), timeout=5)).workers
                    )
                ):
                    assert time.monotonic() < deadline, joined.text()[-3000:]
                    await asyncio.sleep(0.1)
                assert [w.worker_id for w in listed] == ["w1"]
                assert listed[0].profile and listed[0].batch_size > 0
                assert listed[0].state != training_pb2.WORKER_STATE_UNSPECIFIED

                await t.ResumeTraining(training_pb2.ResumeTrainingRequest(), timeout=5)
                # The watch ends by itself once the run is done.
                updates = [
                    u.status
                    async for u in t.WatchTrainingStatus(
                        training_pb2.WatchTrainingStatusRequest(interval_seconds=0.1), timeout=60
                    )
                ]
                assert updates[-1].state == training_pb2.TRAINING_STATE_DONE
                assert updates[-1].global_step == 3 and updates[-1].samples_total == 6
                assert [u.global_step for u in updates] == sorted(u.global_step for u in updates)
                # Per worker: the steps its gradients went into, and the bytes each way.
                seen = [(u.global_step, u.workers[0]) for u in updates if u.workers]
                assert seen, updates
                for step, w in seen:
                    assert w.inner_steps <= step <= 3
                    assert w.bytes_up > 0 or w.inner_steps == 0
                    assert w.bytes_down > 0  # its weights, before any step
                assert max(w.inner_steps for _, w in seen) >= 1

                await expect_code(
                    t.PauseTraining(training_pb2.PauseTrainingRequest(), timeout=5),
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "training is done",
                )
                await expect_code(
                    t.StartTraining(training_pb2.StartTrainingRequest(), timeout=5),
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "done",
                )

                bye = await t.ShutdownTraining(training_pb2.ShutdownTrainingRequest(), timeout=30)
                assert bye.global_step == 3
                assert await exit_code(coordinator) == 0
                await expect_code(
                    t.GetTrainingStatus(training_pb2.GetTrainingStatusRequest(), timeout=5),
                    grpc.StatusCode.UNAVAILABLE,
                    "--admin-listen",
                )
        finally:
            if joined is not None:
                await asyncio.to_thread(joined.stop)
            await asyncio.to_thread(coordinator.stop)

    run(main, timeout_s=120)


async def _ctl(gateway: str, token: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "foundry",
        "ctl",
        *args,
        "--gateway",
        gateway,
        "--token-file",
        str(token),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_gateway_and_ctl_processes(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("let-me-in\n")

    async def main() -> None:
        coordinator, _, admin_port = await start_coordinator(tmp_path)
        gateway = procs.Service(
            [
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--coordinator-admin",
                f"127.0.0.1:{admin_port}",
                "--tp-frontend",
                f"127.0.0.1:{free_port()}",
                "--token-file",
                str(token),
                "--metrics-port",
                "0",
                "--metrics-host",
                "127.0.0.1",
            ],
            tmp_path / "gateway.log",
        )
        try:
            m = await asyncio.to_thread(gateway.wait_for, GATEWAY_LISTENING, 30)
            target, metrics_port = f"127.0.0.1:{m.group(1)}", m.group(2)
            code, out, err = await _ctl(target, token, "status")
            # Healthy, and the pair not started yet (it starts after training): exit 0.
            assert code == 0, out + err
            assert "training: WAITING: 0 of 1 workers (min-workers 1)  step 0/3" in out
            assert "no workers registered" in out
            assert "pair: not started yet; it starts after training" in out
            assert "no tensor-parallel pair at" in out and "not reached since" in out
            for action, wording in [
                ("start", "step 0: training"),
                ("pause", "paused"),
                ("resume", "training"),
                ("checkpoint", "checkpoint at step 0"),
                ("workers", "no workers registered"),
            ]:
                code, out, err = await _ctl(target, token, action)
                assert code == 0 and wording in out, (action, out, err)
            code, out, err = await _ctl(target, token, "export", "--path", str(tmp_path / "m.gguf"))
            assert code == 0 and f"exported step 0 to {tmp_path / 'm.gguf'}" in out, out + err
            q8 = tmp_path / "q8.gguf"
            code, out, err = await _ctl(
                target, token, "export", "--path", str(q8), "--type", "q8_0"
            )
            assert code == 0 and f"exported step 0 to {q8}" in out, out + err
            # Q8_0: 34 bytes a block of 32 weights, against 128 in f32.
            assert q8.stat().st_size < 0.4 * (tmp_path / "m.gguf").stat().st_size
            code, out, err = await _ctl(target, token, "watch", "--count", "2", "--interval", "0.1")
            # Started, but no worker: WAITING, not TRAINING without progress.
            assert code == 0 and out.count("training: WAITING") == 2, out + err

            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
                text = r.read().decode()
            assert (
                'foundry_gateway_requests_total{code="OK",'
                'method="foundry.v1.TrainingService/StartTraining"} 1.0'
            ) in text

            code, out, err = await _ctl(target, token, "shutdown")
            assert code == 0 and "shut down at step 0" in out, out + err
            assert await exit_code(coordinator) == 0
            code, out, err = await _ctl(target, token, "pause")
            assert code == 1 and "UNAVAILABLE" in err and "--admin-listen" in err, err
        finally:
            assert await asyncio.to_thread(gateway.stop) == 0, gateway.text()[-3000:]
            await asyncio.to_thread(coordinator.stop)

    run(main, timeout_s=120)
