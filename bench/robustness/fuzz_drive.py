"""Driving ``fuzz.py``'s connections: each :class:`~fuzz_targets.Plan` sent over a connection of
its own, several lanes at once, and every connection's end checked against what the plan owes
(a close, an answer, a cut-off within the frame deadline) within ``--hang-after`` seconds, in
one :class:`PortStats` per port."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import live
from fuzz_targets import OPEN_WINDOW_S, Ending, Plan, Target

# -- driving connections -----------------------------------------------------------------------


@dataclass
class PortStats:
    port: str
    lanes: int = 0
    fuzz_frames: int = 0
    valid_frames: int = 0
    connections: int = 0
    errors_answered: int = 0  # connections that got an ERROR frame before the close
    closed_by_service: int = 0  # the service closed on its own (bad bytes or a refusal)
    closed_after_eof: int = 0  # the service closed after the harness ended its side
    resets: int = 0  # the service reset the connection (closed with our bytes unread)
    probes_answered: int = 0
    awaiting: int = 0  # streams that ended inside a declared frame (then we ended ours)
    held: int = 0  # ... and were left open for the service's frame deadline
    deadline_closes: int = 0  # held streams the service cut off
    frame_deadline_s: float | None = None  # the service's, where the harness could set it
    refused_unread: int = 0  # closed unread: bring-up slots full, or a connection limit
    connect_failures: int = 0
    garbled_answers: int = 0  # the service answered with bytes its own protocol refuses
    hangs: int = 0
    crashes: int = 0
    internal_errors: int = 0
    health_checks: int = 0
    health_failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    hang_samples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.hangs
            or self.crashes
            or self.internal_errors
            or self.health_failures
            or self.connect_failures
            or self.garbled_answers
        )

    def line(self) -> str:
        return (
            f"{self.port:20s} frames {self.fuzz_frames:7d} (+{self.valid_frames} valid)  "
            f"connections {self.connections:6d}  errors answered {self.errors_answered:6d}"
            f"  closes {self.closed_by_service + self.closed_after_eof + self.resets:6d}"
            f" (awaiting {self.awaiting}, cut off at the frame deadline "
            f"{self.deadline_closes}/{self.held})  probes {self.probes_answered:5d}  "
            f"hangs {self.hangs}  crashes {self.crashes}  unhandled {self.internal_errors}"
            f"{f'  refused unread {self.refused_unread}' if self.refused_unread else ''}"
            f"  health {self.health_checks - len(self.health_failures)}/"
            f"{self.health_checks}  {self.seconds:5.1f} s "
            f"({self.fuzz_frames / max(self.seconds, 1e-9):,.0f} frames/s)"
        )


async def drive(
    target: Target, plan: Plan, stats: PortStats, hang_s: float, hold: bool = False
) -> None:
    """One connection: send the plan's bytes, then wait for what the service owes.

    ``hold``: a stream that ends inside a frame is left open (the service's frame deadline
    must close it within ``hang_s``) instead of being ended by us at once.
    """
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(live.HOST, target.port), hang_s
        )
    except (OSError, TimeoutError):
        stats.connect_failures += 1
        return
    stats.connections += 1
    stats.fuzz_frames += plan.fuzz
    stats.valid_frames += plan.valid
    for k in plan.kinds:
        kind = k.split("/")[1]
        stats.kinds[kind] = stats.kinds.get(kind, 0) + 1
    answers = target.reader()
    eof_sent = False

    def end_ours() -> None:
        nonlocal eof_sent
        if not eof_sent:
            eof_sent = True
            if not writer.is_closing():
                writer.write_eof()

    def hang(why: str) -> None:
        stats.hangs += 1
        if len(stats.hang_samples) < 10:
            stats.hang_samples.append(
                f"{why}: {plan.ending.value} {plan.kinds} answers {answers.answers}/"
                f"{plan.answers} eof_sent {eof_sent}: {plan.data[:96].hex()}"
            )

    holding = False
    try:
        writer.write(plan.data)
        try:
            await asyncio.wait_for(writer.drain(), hang_s)
        except TimeoutError:
            hang("took none of our bytes")
            return
        if plan.ending is Ending.PARTIAL:
            if hold:
                stats.held += 1
                holding = True
            else:
                stats.awaiting += 1
                end_ours()
        deadline = time.monotonic() + hang_s
        if plan.ending is Ending.OPEN and plan.answers == 0:
            deadline = time.monotonic() + OPEN_WINDOW_S
        while True:
            if (
                plan.ending is Ending.OPEN
                and not eof_sent
                and (plan.answers and answers.answers >= plan.answers)
            ):
                stats.probes_answered += 1
                end_ours()
                deadline = time.monotonic() + hang_s
            try:
                data = await asyncio.wait_for(
                    reader.read(1 << 16), max(0.0, deadline - time.monotonic())
                )
            except TimeoutError:
                if plan.ending is Ending.OPEN and plan.answers == 0 and not eof_sent:
                    end_ours()
                    deadline = time.monotonic() + hang_s
                    continue
                hang("neither answered nor closed")
                return
            if not data:
                if eof_sent:
                    stats.closed_after_eof += 1
                else:
                    stats.closed_by_service += 1
                    stats.deadline_closes += int(hold and plan.ending is Ending.PARTIAL)
                return
            answers.feed(data)
    except OSError:  # reset, broken pipe: the service closed with our bytes unread
        stats.resets += 1
        # A held stream reset rather than closed was cut off all the same (the service closed
        # it with some of our partial frame still unread in its socket).
        stats.deadline_closes += int(holding)
    finally:
        stats.errors_answered += int(answers.errors > 0)
        stats.garbled_answers += int(answers.garbled)
        writer.transport.abort()


async def held_lane(
    target: Target,
    rng: random.Random,
    stats: PortStats,
    deadline_s: float,
    hang_s: float,
    done: asyncio.Event,
) -> None:
    """Streams that stop inside a frame and stay open: the service must cut each one off by
    its frame deadline (``deadline_s``)."""
    while not done.is_set():
        for _ in range(100):
            plan = target.plan(rng)
            if plan.ending is Ending.PARTIAL and plan.data:
                break
        else:
            continue
        await drive(target, plan, stats, deadline_s + hang_s, hold=True)
        if stats.connect_failures > 10:
            return
