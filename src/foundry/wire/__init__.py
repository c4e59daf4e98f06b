"""Wire formats as sans-IO codecs: bytes in, messages out, and back; no sockets here.

- ``framing``: ``FrameDecoder``, the one frame buffer and decoder interface of every codec.
- ``layout``: packed C structs declared as data (field kinds, ``Layout``), the form the FDTC,
  TP control and frontend messages are written in.
- ``fdtc``: the swarm protocol's messages and codec; ``fdtc_lifecycle``: which message may
  pass when, per role (and per port of the coordinator); ``fdtc_connection``:
  ``FdtcConnection``, the two together, which the swarm's services drive every link through.
- ``tp``: the tensor-parallel hello, control frames and gate header.
- ``frontend``: the TP leader's frontend link (GENERATE / TOKEN / DONE ...).
- ``errors``: the protocol exception tree.
"""
