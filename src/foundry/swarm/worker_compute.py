"""A swarm worker's computing: each assignment trained in one thread and its upload sent.

ASSIGN (``--sync-every 1``) is a gradient over global samples ``[offset, offset + n)``;
LOCAL_ASSIGN (above 1) is inner AdamW steps from the held weights, after which the
pseudo-gradient (held minus trained weights) is the upload. Both run in the worker's one compute
thread (so heartbeats keep flowing on the link) and go out as HEARTBEAT + GRADIENTS through one
``Compressor`` (error feedback for every lossy codec). ``--slowdown`` makes the worker emulate a
slower machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from foundry.compression import Compressor, get_codec
from foundry.model.text.data import DataError
from foundry.model.train.training import GradientResult, Params
from foundry.obs.timeline import now_us
from foundry.swarm import sync
from foundry.swarm.worker_core import WorkerCore
from foundry.transport.fdtc_stream import FdtcStream
from foundry.transport.tasks import cancel_and_wait
from foundry.wire import fdtc
from foundry.wire.fdtc import Compression, ErrorCode

T = TypeVar("T")

log = logging.getLogger("foundry.worker")


class Compute:
    """The worker's assignments, one at a time in its compute thread (``start``, ``stop``), and
    the upload's codec (``make_uplink``); what they measure goes into the core."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        # Training and encoding run in this one thread, one job after the other: a cancelled
        # assignment's thread cannot be killed, and two jobs at once would both change the
        # inner moments and the error-feedback residuals. A cancelled local round stops at
        # its next inner step: each job keeps the generation it was started in.
        self._work = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-compute")
        self._generation = 0
        self._uplink_key: tuple[Compression, float, int] | None = None
        # --slowdown: the fastest seconds per sample seen, per kind of assignment (ASSIGN,
        # LOCAL_ASSIGN), which the emulated slower machine's extra time is made of.
        self._fastest_per_sample: dict[type, float] = {}
        self._compute: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        self._generation += 1  # the job in the thread, if any, stops at its next inner step
        await cancel_and_wait(self._compute)
        self._compute = None

    async def _in_work_thread(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """``fn`` in the worker's compute thread, after any job still running there."""
        return await asyncio.get_running_loop().run_in_executor(
            self._work, lambda: fn(*args, **kwargs)
        )

    async def start(self, stream: FdtcStream, assign: fdtc.Assign | fdtc.LocalAssign) -> None:
        core = self.core
        if core.idle_since_us is not None:
            core.timeline.span("wait", core.idle_since_us, step=assign.global_step)
            core.idle_since_us = None
        if self._compute is not None and not self._compute.done():
            await self.stop()
        self._compute = asyncio.ensure_future(self._compute_and_send(stream, assign))

    def make_uplink(self, plan: fdtc.TrainPlan) -> None:
        """The upload's codec as REGISTER_ACK and TRAIN_PLAN set it; a new one (its
        error-feedback residual from zero) only when that changed."""
        core = self.core
        key = (core.compression, core.topk_ratio, plan.qsgd_levels)
        if core.uplink is None or key != self._uplink_key:
            params: dict[str, float | int] = {
                "topk_ratio": core.topk_ratio,
                "seed": core.rng.randrange(2**31),
            }
            if plan.qsgd_levels:
                params["qsgd_levels"] = plan.qsgd_levels
            core.uplink = Compressor(get_codec(core.compression, **params))
            self._uplink_key = key

    def _local_steps(
        self, start: Params, assign: fdtc.LocalAssign, stop: Callable[[], bool]
    ) -> GradientResult:
        """``inner_steps`` AdamW steps from ``start``; the pseudo-gradient start - end."""
        core = self.core
        assert core.cfg is not None and core.plan is not None
        plan = core.plan
        backend = core.backend
        if core.inner is None:
            core.inner = backend.make_inner(start, plan.weight_decay)
        schedule = sync.InnerSchedule(
            plan.lr, plan.warmup_steps, plan.total_steps, plan.min_lr_ratio, plan.grad_clip
        )
        return backend.local_steps(
            start,
            core.inner,
            core.cfg,
            core.corpus,
            lr_at=schedule.lr_at,
            grad_clip=schedule.grad_clip,
            global_step=assign.global_step,
            sample_offset=assign.sample_offset,
            samples_per_step=assign.samples_per_step,
            steps=assign.inner_steps,
            micro_batch=assign.micro_batch,
            seq_len=assign.seq_len,
            aux_loss_coef=core.aux_loss_coef,
            stop=stop,
        )

    async def _compute_and_send(
        self, stream: FdtcStream, assign: fdtc.Assign | fdtc.LocalAssign
    ) -> None:
        core = self.core
        if core.params is None or core.cfg is None:
            log.warning("assignment before weights; asking for them")
            await stream.send(fdtc.WeightsReq())
            return
        t0 = time.monotonic()
        start_us = now_us()
        result: GradientResult
        try:
            if isinstance(assign, fdtc.LocalAssign):
                start = core.round_start(assign)
                gen = self._generation
                result = await self._in_work_thread(
                    self._local_steps, start, assign, lambda: self._generation != gen
                )
                # Before the upload: the next LOCAL_ASSIGN may follow its ack at once.
                core.unmerged = (assign.global_step, result.grads)
                core.inner_steps_done += assign.inner_steps
                core.metrics.inner_steps.inc(assign.inner_steps)
            else:
                result = await self._in_work_thread(
                    core.backend.compute_gradients,
                    core.params,
                    core.cfg,
                    core.corpus,
                    assign.sample_offset,
                    assign.n_samples,
                    seq_len=assign.seq_len,
                    micro_batch=assign.batch_size,
                    aux_loss_coef=core.aux_loss_coef,
                )
        except DataError as exc:
            await self._cannot_train(stream, f"cannot train step {assign.global_step}: {exc}")
            return
        n_samples = result.n_samples
        compute_s = time.monotonic() - t0
        if core.opt.slowdown > 1.0 and n_samples > 0:
            # A machine that many times slower takes (slowdown - 1) x its compute more: of its
            # fastest compute, so that what other processes on this computer take from this
            # one (a benchmark's whole swarm on one machine) is not multiplied along with it.
            kind = type(assign)
            fastest = min(self._fastest_per_sample.get(kind, math.inf), compute_s / n_samples)
            self._fastest_per_sample[kind] = fastest
            extra = fastest * n_samples * (core.opt.slowdown - 1.0)
            await asyncio.sleep(extra)
            compute_s += extra
        core.metrics.phase_duration.labels(phase="compute").observe(compute_s)
        step = assign.global_step
        core.timeline.span("compute", start_us, step=step, samples=n_samples)
        t1 = time.monotonic()
        start_us = now_us()
        data = await self._in_work_thread(self._encode, result.grads)
        if data is None:
            log.warning(
                "step %d: this worker's gradient holds NaN or inf; not sent, and the "
                "error-feedback residuals start again from zero",
                step,
            )
            return
        core.metrics.phase_duration.labels(phase="compress").observe(time.monotonic() - t1)
        core.timeline.span("compress", start_us, step=step, bytes=len(data))
        core.last_loss = result.loss
        core.rate = n_samples / compute_s if compute_s > 0 else 0.0
        core.samples_done += n_samples
        core.metrics.samples.inc(n_samples)
        core.metrics.samples_per_second.set(core.rate)
        core.metrics.loss.set(result.loss)
        t2 = time.monotonic()
        start_us = now_us()
        # The heartbeat goes first: it carries this round's loss, which the coordinator
        # records with the gradient that follows.
        await stream.send(
            fdtc.Heartbeat(
                worker_id=core.opt.worker_id,
                local_step=assign.global_step,
                current_loss=core.last_loss,
                samples_per_sec=core.rate,
            ),
            fdtc.Gradients(
                worker_id=core.opt.worker_id,
                local_step=assign.global_step,
                num_tensors=len(result.grads),
                compression=core.compression,
                uncompressed_size=sum(g.size * 4 for g in result.grads.values()),
                data=data,
            ),
        )
        core.metrics.phase_duration.labels(phase="send").observe(time.monotonic() - t2)
        core.idle_since_us = now_us()
        core.timeline.span("send", start_us, core.idle_since_us, step=step, bytes=len(data))
        core.metrics.gradient_bytes.inc(len(data))

    async def _cannot_train(self, stream: FdtcStream, reason: str) -> None:
        """Say so to the coordinator (ERROR, which drops this worker from the round at once)
        and end the session; ``run`` then exits non-zero instead of redialling."""
        core = self.core
        core.cannot_train = reason
        log.error("%s", reason)
        message = reason.encode()[: fdtc.MAX_PATH - 1].decode(errors="ignore")
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            await stream.send(fdtc.Error(int(ErrorCode.INTERNAL), message))
        await stream.close()

    def _encode(self, grads: Params) -> bytes | memoryview | None:
        """The upload's data section; None for a NaN/inf gradient through a lossy codec:
        QSGD and TOPK cannot encode it and FP16's residual would carry it into every later
        upload (inf - inf), so the residuals start again and nothing is sent (the coordinator
        drops a non-finite gradient anyway: the round goes on without this share)."""
        core = self.core
        assert core.uplink is not None
        if core.uplink.feedback is not None and not sync.all_finite(grads.values()):
            core.uplink.reset()
            return None
        return core.uplink.encode(grads)[0]
