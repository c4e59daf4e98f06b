"""Tensor-parallel inference: the leader (rank 0) and worker (rank 1) in lockstep.

- ``lockstep``: ``RankState``, the session commands both ranks run, and ``COMMANDS``, the
  command table (frame -> RankState call, reply) both ranks dispatch with.
- ``policy``: scheduling, drafting and commit plans as pure functions.
- ``handshake``, ``link``: bring-up (hellos, identities) and the control link.
- ``leader``, ``worker``: the two rank services; ``blas``: BLAS thread control.
"""
