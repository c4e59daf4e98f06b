"""A formed pair or world of ranks, as the leader's bring-up hands it to the engine: the
workers' control links (rank 1 first), the gate exchange, and a watcher thread that tells the
engine at once when a worker hangs up; and a :class:`Member`, a worker of a world of N > 2
ranks brought up as far as its gate link, waiting for the other ranks."""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Callable, Sequence

from foundry.model.shard.shares import Shares
from foundry.tp.link import ControlLink
from foundry.transport.gates import GateExchange
from foundry.wire.tp import GateTransport


class Pair:
    """A formed pair or world: the workers' control links (rank 1 first), the gate exchange,
    the threads each worker stated in the hello it formed with (rank 1 first; 0: not stated,
    the plain pair's worker), and the watcher's wake-up pipe."""

    def __init__(
        self,
        links: list[ControlLink],
        gate: GateExchange,
        transport: GateTransport,
        shares: Shares = (1, 1),
        threads: Sequence[int] = (),
    ) -> None:
        if len(links) != len(shares) - 1:
            raise ValueError(f"{len(links)} worker links for a world of {len(shares)} ranks")
        if threads and len(threads) != len(links):
            raise ValueError(f"{len(threads)} workers' threads for {len(links)} worker links")
        self.links = links
        self.gate = gate
        self.transport = transport
        self.shares = shares
        self.threads = tuple(threads) or (0,) * len(links)
        self.lost: str | None = None  # set by the watcher: a worker hung up
        self._wake_r, self._wake_w = os.pipe()
        self.watcher: threading.Thread | None = None

    @property
    def link(self) -> ControlLink:
        """Rank 1's control link (the pair's one)."""
        return self.links[0]

    @property
    def world(self) -> int:
        return len(self.shares)

    def watch(self, on_hangup: Callable[[Pair, int], None]) -> None:
        """Call ``on_hangup(pair, rank)`` on the watcher thread when a worker hangs up."""

        def run() -> None:
            poller = select.poll()
            ranks = {}
            for rank, link in enumerate(self.links, start=1):
                fd = link.sock.fileno()
                poller.register(fd, select.POLLRDHUP | select.POLLHUP)
                ranks[fd] = rank
            poller.register(self._wake_r, select.POLLIN)
            while True:
                for fd, _ in poller.poll():
                    if fd == self._wake_r:
                        return
                    on_hangup(self, ranks[fd])
                    return

        self.watcher = threading.Thread(target=run, name="tp-pair-watcher", daemon=True)
        self.watcher.start()

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        if self.watcher is not None and self.watcher is not threading.current_thread():
            self.watcher.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.gate.close()
        for link in self.links:
            link.close()


class Member:
    """A worker of a world of N > 2 ranks, brought up as far as its gate link to the leader,
    waiting for the other ranks; ``threads``: what its hello stated (0: unknown)."""

    def __init__(
        self,
        rank: int,
        link: ControlLink,
        gate_sock: socket.socket,
        host: bytes,
        gate_port: int,
        threads: int = 0,
    ) -> None:
        self.rank = rank
        self.link = link
        self.gate_sock = gate_sock
        self.host = host
        self.gate_port = gate_port
        self.threads = threads

    def alive(self) -> bool:
        """False once the worker hung up (nothing it may send while waiting is read here)."""
        poller = select.poll()
        poller.register(self.link.sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return not poller.poll(0)

    def close(self) -> None:
        self.gate_sock.close()
        self.link.close()
