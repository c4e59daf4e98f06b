"""FRAGMENT: messages larger than one FDTC frame, cut by ``encode_parts`` and reassembled by the
decoder, admitted by the connection only where the link's table takes the message, and timed
frame by frame by the stream.

Here the stream, on loopback sockets: each fragment has the frame deadline to itself.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from fragments import BIG, split_frames

from foundry.transport.fdtc_stream import FdtcStream, FrameTimeout
from foundry.wire.fdtc import Weights, encode_parts


def _socket_pair(rcvbuf: int | None = None) -> tuple[socket.socket, socket.socket]:
    listener = socket.socket()
    if rcvbuf:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    return client, server


def test_each_fragment_has_the_frame_deadline_to_itself() -> None:
    """Three slices, each half-sent for 0.2 s, take longer than the 0.5 s deadline in all and
    arrive; a slice stalled in mid-frame past it is cut off."""
    pieces = encode_parts(Weights(BIG.tobytes()), fragment_size=4096, max_message=1 << 20)
    frames = [bytes(f) for f in split_frames(pieces)]
    assert len(frames) == 3

    async def main() -> None:
        client, server = _socket_pair()
        reader, writer = await asyncio.open_connection(sock=server)
        stream = FdtcStream(reader, writer, frame_deadline_s=0.5)
        stream.decoder.max_message = 1 << 20  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()

        async def trickle(stall: bool) -> None:
            for i, frame in enumerate(frames):
                if stall and i == 1:
                    await loop.sock_sendall(client, frame[:100])
                    await asyncio.sleep(1.0)
                    return
                # Each frame in two parts: the reader holds a partial frame for 0.2 s.
                await loop.sock_sendall(client, frame[:100])
                await asyncio.sleep(0.2)
                await loop.sock_sendall(client, frame[100:])
                await asyncio.sleep(0.1)

        client.setblocking(False)
        t0 = time.monotonic()
        sender = asyncio.ensure_future(trickle(stall=False))
        msg = await stream.recv()
        assert isinstance(msg, Weights) and bytes(msg.data) == BIG.tobytes()
        assert time.monotonic() - t0 > 0.5  # longer than one frame deadline in all
        await sender
        sender = asyncio.ensure_future(trickle(stall=True))
        with pytest.raises(FrameTimeout, match=r"did not finish it within 0\.5 s"):
            await stream.recv()
        await sender
        await stream.close()
        client.close()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_send_to_a_slow_but_steady_reader_outlasts_the_deadline() -> None:
    """The send deadline cuts a peer that takes nothing, not one that takes little at a time:
    4 MiB read at most 64 KiB every 10 ms takes over half a second against a 0.3 s deadline."""

    async def main() -> None:
        client, server = _socket_pair(rcvbuf=64 << 10)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        reader, writer = await asyncio.open_connection(sock=client)
        stream = FdtcStream(reader, writer, frame_deadline_s=0.3)
        server.setblocking(False)
        loop = asyncio.get_running_loop()
        got = 0

        async def read_slowly() -> None:
            nonlocal got
            while got < 9 + (4 << 20):
                data = await loop.sock_recv(server, 64 << 10)
                assert data
                got += len(data)
                await asyncio.sleep(0.01)

        t0 = time.monotonic()
        slow = asyncio.ensure_future(read_slowly())
        await stream.send(Weights(bytes(4 << 20)))
        await slow
        assert time.monotonic() - t0 > 0.3 and got == 9 + (4 << 20)
        await stream.close()
        server.close()

    asyncio.run(asyncio.wait_for(main(), 60))
