"""The async stream driver on real loopback sockets: a send on a closed connection, the bytes
not yet on the wire, the kernel's watch on every link (its effect on a vanished host is
``test_slow_link.py``'s)."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest

from foundry.transport.fdtc_stream import FdtcStream
from foundry.transport.stream import LINK_DEAD_AFTER_S, StreamClosed
from foundry.wire import fdtc


def test_a_send_after_the_peer_reset_is_stream_closed_not_an_asyncio_error() -> None:
    """Writing to a connection the peer reset raises StreamClosed (a ConnectionError, which
    every service handles per peer), never asyncio's internal AttributeError."""

    async def main() -> None:
        accepted: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

        async def on_client(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await accepted.put(w)

        server = await asyncio.start_server(on_client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stream = await FdtcStream.connect("127.0.0.1", port)
        peer = await asyncio.wait_for(accepted.get(), 5)
        peer.transport.abort()  # RST
        with pytest.raises(StreamClosed):
            for _ in range(200):  # the reset lands within a few writes
                await stream.send(
                    fdtc.Heartbeat(
                        worker_id="w", local_step=0, current_loss=0.0, samples_per_sec=0.0
                    )
                )
                await asyncio.sleep(0.01)
        await stream.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIOCOUTQ is Linux's")
def test_unsent_counts_what_the_kernel_has_not_sent_until_the_peer_reads_it() -> None:
    """``unsent()``: bytes queued in asyncio and in the kernel's send queue. A peer that does
    not read leaves most of 8 MB unsent; once it reads everything, nothing is."""

    async def main() -> None:
        reading = asyncio.Event()
        done = asyncio.Event()

        async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await reading.wait()
            got = 0
            while got < 8_000_000:
                got += len(await r.read(1 << 20))
            done.set()
            w.close()
            await w.wait_closed()

        server = await asyncio.start_server(on_client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stream = await FdtcStream.connect("127.0.0.1", port)
        assert stream.unsent() == 0
        stream.write_pieces([bytes(8_000_000)])
        await asyncio.sleep(0.2)
        # Loopback's receive queue takes some of it; far from all.
        assert stream.unsent() > 1_000_000
        reading.set()
        await asyncio.wait_for(done.wait(), 10)
        for _ in range(100):
            if stream.unsent() == 0:
                break
            await asyncio.sleep(0.01)
        assert stream.unsent() == 0
        await stream.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


@pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="TCP_KEEPIDLE and TCP_USER_TIMEOUT are Linux's options",
)
@pytest.mark.parametrize("dead_after_s", [None, 3.0])
def test_both_ends_of_a_link_are_watched_by_the_kernel(dead_after_s: float | None) -> None:
    """Keepalive after half the time idle, three probes in the other half, and sent bytes
    unacknowledged for at most the whole of it: on the dialling end (with its own time) and
    on the accepting end (the default)."""

    def options(sock: socket.socket) -> tuple[int, int, int, int, int]:
        return (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        )

    async def main() -> None:
        accepted: asyncio.Queue[FdtcStream] = asyncio.Queue()

        async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await accepted.put(FdtcStream(r, w))

        server = await asyncio.start_server(on_client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        kw = {} if dead_after_s is None else {"dead_after_s": dead_after_s}
        stream = await FdtcStream.connect("127.0.0.1", port, **kw)
        peer = await asyncio.wait_for(accepted.get(), 5)
        mine = stream.writer.get_extra_info("socket")
        theirs = peer.writer.get_extra_info("socket")
        if dead_after_s is None:
            assert options(mine) == (1, 15, 5, 3, 30_000)
        else:
            assert options(mine) == (1, 1, 1, 3, 3_000)
        assert LINK_DEAD_AFTER_S == 30.0 and options(theirs) == (1, 15, 5, 3, 30_000)
        await stream.close()
        await peer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
