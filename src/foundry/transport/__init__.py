"""Drivers that move wire bytes over sockets and shared memory.

- ``stream``: the one framed-stream driver, ``AsyncStream`` and ``BlockingStream``, generic over
  the decoder, with the frame deadline; every link reads and writes through it.
- ``fdtc_stream``: ``FdtcStream``, the asyncio FDTC link: the stream reading into an
  ``FdtcConnection``, which owns the link's frame buffer and lifecycle.
- ``gates``: the TP data plane, the gate exchange over TCP or a shared-memory slab.
- ``listener``, ``tls``: the asyncio listener of every native port (connection limit, TLS).
- ``backoff``: when to dial again; ``tasks``: cancelling tasks cleanly.
"""
