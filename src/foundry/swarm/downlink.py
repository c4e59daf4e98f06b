"""The downlink: what the coordinator sends its workers.

It keeps the shadow (``sync.Shadow``: the weights every worker holds, whichever way they reached
them), makes each step's UPDATE (the compressed move of the shadow after the master) and the
shadow's digests, brings a worker up to date (that UPDATE to a worker one step behind, full
weights otherwise), sends a round's assignments one worker at a time, and broadcasts the
control messages of the seed (START, SYNC, CHECKPOINT, PAUSE, RESUME, SHUTDOWN).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import numpy as np

from foundry.compression import Codec, get_codec
from foundry.model.train.training import Params
from foundry.swarm import sync
from foundry.swarm.core import Member, SwarmCore, SwarmState
from foundry.wire import fdtc
from foundry.wire.errors import LocalProtocolError
from foundry.wire.fdtc import Compression

log = logging.getLogger("foundry.coordinator")

# Assignments go out one worker at a time (``_send_staggered``): the next begins once fewer
# than STAGGER_BELOW bytes of the last are unsent, or after its bytes' time at the best rate
# the port has shown x STAGGER_SLACK (at least STAGGER_MIN_S; STAGGER_UNMEASURED_S before any
# rate is known). Sends above STAGGER_MEASURE_ABOVE bytes measure that rate, which decays by
# STAGGER_DECAY a send.
STAGGER_BELOW = 64 * 1024
STAGGER_SLACK = 1.5
STAGGER_MIN_S = 0.002
STAGGER_UNMEASURED_S = 0.25
STAGGER_POLL_S = 0.001
STAGGER_MEASURE_ABOVE = 256 * 1024
STAGGER_DECAY = 0.9


class Downlink:
    def __init__(self, core: SwarmCore, shadow: Params) -> None:
        self.core = core
        options = core.opt
        self.shadow = sync.Shadow(shadow)
        down_levels = (
            options.qsgd_levels if options.down_qsgd_levels is None else options.down_qsgd_levels
        )
        self._down_codec: Codec = get_codec(
            options.downlink,
            topk_ratio=options.topk_ratio,
            qsgd_levels=down_levels,
            seed=options.seed,
        )
        self.update: fdtc.Update | None = None  # the last step's UPDATE, for every worker
        self._digests: dict[int, bytes] = {}  # step -> digest of the shadow, recent ones
        self._weights_cache: tuple[int, fdtc.WeightsMeta, fdtc.Weights] | None = None
        self._port_rate = 0.0  # bytes/s: the best a staggered send has shown lately
        self.weights_wanted: set[str] = set()  # seed-only peers asking during a step

    def random_state(self) -> dict[str, str]:
        """The downlink codec's random state for a checkpoint's extra (none if it draws none)."""
        state = self._down_codec.random_state()
        return {} if state is None else {"downlink_rng": state}

    def resume_random_state(self, state: str | None) -> None:
        """Continue the downlink codec's draws where a checkpoint left them."""
        if state is not None and self._down_codec.random_state() is not None:
            try:
                self._down_codec.set_random_state(state)
            except LocalProtocolError as exc:  # a run goes on; only its draws start afresh
                log.warning(
                    "the checkpoint's downlink random state is unusable (%s): the "
                    "UPDATEs' rounding draws start afresh",
                    exc,
                )

    async def send_to(self, m: Member, *msgs: fdtc.Message) -> None:
        m.sending += 1
        try:
            async with m.send_lock:
                await m.stream.send(*msgs)
        finally:
            m.sending -= 1

    def weights_messages(self) -> tuple[fdtc.WeightsMeta, fdtc.Weights]:
        if self._weights_cache is None or self._weights_cache[0] != self.core.step:
            metas = tuple(
                fdtc.TensorMeta(name=name, shape=tuple(shape), dtype=fdtc.DType.F32)
                for name, shape in self.core.shapes
            )
            meta = fdtc.WeightsMeta(
                global_step=self.core.step,
                learning_rate=self.core.trainer.learning_rate(),
                tensors=metas,
            )
            # One copy of every tensor into the payload, which each worker's send then writes
            # as it is (a view: no per-tensor bytes, no joined frame).
            # The shadow, not the master: every worker holds the same bytes, whichever way
            # they reached it (docs/architecture.md, "The downlink").
            flat = np.concatenate(
                [self.shadow.params[name].ravel() for name, _ in self.core.shapes]
            )
            weights = fdtc.Weights(flat.astype("<f4", copy=False).data)
            self._weights_cache = (self.core.step, meta, weights)
        return self._weights_cache[1], self._weights_cache[2]

    async def send_weights(self, m: Member) -> None:
        if not m.stream.may_send(fdtc.MsgType.WEIGHTS_META):
            return  # told SHUTDOWN already: training is over for it
        meta, weights = self.weights_messages()
        await self.send_to(m, meta, weights)
        m.weights_step = meta.global_step
        self.count_down(m, len(weights.data))
        self.core.metrics.weight_bytes.labels(direction="sent").inc(len(weights.data))
        # A worker holding weights learns at once where training stands (the seed's order:
        # WEIGHTS_META + WEIGHTS, then START), so a peer that waits for START never waits on
        # a swarm that is already training.
        if self.core.state is SwarmState.DONE:
            await self.send_to(m, fdtc.Shutdown())
        elif self.core.training_on() and not m.started:
            m.started = True
            await self.send_to(m, fdtc.Start())
            self.core.wake.set()

    async def announce_start(self) -> None:
        """START to every worker that holds weights and was not told yet."""
        for m in list(self.core.members.values()):
            if m.weights_step >= 0 and not m.started:
                m.started = True
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    await self.send_to(m, fdtc.Start())

    def count_down(self, m: Member, n: int) -> None:
        m.bytes_down += n
        self.core.round_bytes[1] += n

    async def bring_up_to_date(self, m: Member) -> None:
        """The last UPDATE to a worker that holds the step before; full weights otherwise."""
        if m.weights_step == self.core.step:
            return
        update = self.update
        if (
            m.extended
            and update is not None
            and m.weights_step == update.base_step
            and update.global_step == self.core.step
        ):
            await self.send_to(m, update)
            m.weights_step = update.global_step
            self.count_down(m, len(update.data))
            self.core.metrics.update_bytes.labels(
                compression=Compression(update.compression).name.lower()
            ).inc(len(update.data))
        else:
            await self.send_weights(m)

    def after_step(self, base: int) -> None:
        """The UPDATE that moves the shadow after the master's step from ``base``, and the
        shadow's digest when one is due (in the optimizer's thread, before the loop runs on)."""
        c = self.core
        data = self.shadow.update(c.trainer.params, self._down_codec)
        self.update = fdtc.Update(
            global_step=c.step,
            base_step=base,
            compression=c.opt.downlink,
            num_tensors=len(c.shapes),
            uncompressed_size=4 * sum(c.numels),
            data=data,
        )
        if sync.digest_due(base, c.step, c.opt.digest_every):
            self._digests[c.step] = self.shadow.digest()
            for old in [s for s in self._digests if s < c.step - 4 * c.opt.digest_every]:
                del self._digests[old]

    def check_digest(self, m: Member, msg: fdtc.WeightsDigest) -> None:
        """A worker whose digest differs from the shadow's gets full weights next."""
        expected = self._digests.get(msg.global_step)
        if expected is not None and expected != msg.digest:
            self.core.metrics.digest_mismatches.inc()
            log.warning(
                "worker %s holds other weights than expected at step %d; it gets full "
                "weights with its next assignment",
                m.worker_id,
                msg.global_step,
            )
            m.weights_step = -1

    async def send_staggered(
        self, sends: list[tuple[Member, fdtc.Assign | fdtc.LocalAssign]]
    ) -> list[BaseException | None]:
        """The round's assignments, each after what brings its worker up to date, one worker
        at a time: the next begins once the last one's bytes are on the wire, or after as long
        as they take at the best rate this port has shown (x ``STAGGER_SLACK``), whichever is
        first; a worker behind a slower link goes on receiving beside the next. Sent all at
        once, the UPDATEs share the port and every worker starts computing when the last byte
        is out, then all uploads arrive at once; one at a time, the first starts after 1/N of
        that and the uploads come in spread out while the rest go down (the port is full
        duplex). docs/architecture.md, "Synchronous training at LAN scale"."""
        tasks: list[asyncio.Task[None]] = []
        try:
            for m, assign in sends:
                before = m.stream.bytes_out
                tasks.append(asyncio.ensure_future(self.assign(m, assign)))
                await self.until_sent(m, tasks[-1], before)
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for pending in tasks:
                pending.cancel()
            raise
        return [r if isinstance(r, BaseException) else None for r in results]

    async def until_sent(self, m: Member, task: asyncio.Task[None], before: int) -> None:
        t0 = time.monotonic()
        while True:
            sent = m.stream.bytes_out - before
            if task.done() and (
                task.cancelled() or task.exception() is not None or m.stream.writer.is_closing()
            ):
                return
            if task.done() and m.stream.unsent() <= STAGGER_BELOW:
                elapsed = time.monotonic() - t0
                if sent >= STAGGER_MEASURE_ABOVE and elapsed > 0:
                    self._port_rate = max(sent / elapsed, STAGGER_DECAY * self._port_rate)
                return
            # Until a send has shown the port's rate, a fixed allowance (which a send that
            # completes within it then measures).
            budget = (
                sent / self._port_rate * STAGGER_SLACK if self._port_rate else STAGGER_UNMEASURED_S
            )
            if time.monotonic() - t0 >= max(STAGGER_MIN_S, budget):
                return
            await asyncio.sleep(STAGGER_POLL_S)

    async def assign(self, m: Member, assign: fdtc.Assign | fdtc.LocalAssign) -> None:
        m.assigned_steps = assign.inner_steps if isinstance(assign, fdtc.LocalAssign) else 1
        await self.bring_up_to_date(m)
        await self.send_to(m, assign)

    async def answer_weights_wanted(self) -> None:
        """The weights for the seed-only peers that asked while the step was applied."""
        wanted, self.weights_wanted = sorted(self.weights_wanted), set()
        for worker_id in wanted:
            if (peer := self.core.members.get(worker_id)) is not None:
                try:
                    await self.send_weights(peer)
                except (ConnectionError, OSError, RuntimeError) as exc:
                    log.info("could not send weights to %s: %s", worker_id, exc)

    async def broadcast(self, msg: fdtc.Message, *, only_started: bool = False) -> None:
        """``msg`` to every registered worker, seed-only peers included, whose link takes it
        now (after SHUTDOWN only the end of a round may still go)."""
        for m in list(self.core.members.values()):
            if (only_started and not m.started) or not m.stream.may_send(msg.TYPE):
                continue
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                await self.send_to(m, msg)
