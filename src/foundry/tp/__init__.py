"""Tensor-parallel inference: the leader (rank 0) and worker (rank 1) in lockstep.

- ``lockstep``: ``RankState``, the session commands both ranks run, and ``COMMANDS``, the
  command table (frame -> RankState call, reply) both ranks dispatch with.
- ``policy``: scheduling, drafting and commit plans as pure functions.
- ``handshake``, ``link``: the hellos (identities, versions) and the control link.
- ``options``: ``LeaderOptions``, read by the leader and each of its jobs.
- ``calibrate``: a rank's speed, and the shares chosen at pairing from every rank's speed or
  ``--share`` (``--shares auto`` / ``ranks``).
- ``leader``: rank 0, wiring ``frontend_server`` (the clients' link), ``bringup`` (the worker
  port: accept, pairing) and ``engine`` (the scheduler and the pair's commands).
- ``worker``: rank 1; ``blas``: BLAS thread control.
"""
