"""The async stream driver on real loopback sockets: a send on a closed connection, the bytes
not yet on the wire."""

from __future__ import annotations

import asyncio
import sys

import pytest

from foundry.transport.fdtc_stream import FdtcStream
from foundry.transport.stream import StreamClosed
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
                await stream.send(fdtc.Heartbeat(worker_id="w", local_step=0, current_loss=0.0,
                                                 samples_per_sec=0.0))
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
