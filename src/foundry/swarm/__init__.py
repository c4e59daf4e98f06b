"""Swarm training: the coordinator (parameter server) and its workers over FDTC.

- ``coordinator``, ``worker``: the two services; ``policy``: the round rules as pure functions.
  Both drive every link through ``transport.fdtc_stream.FdtcStream`` over a
  ``wire.FdtcConnection``, which owns the order of the messages: they dispatch on what it
  admits and never re-check it.
- The coordinator's jobs, which ``coordinator`` wires around the shared state (``core``):
  ``worker_port`` and ``admin_port`` (its two links), ``round_loop`` with the two round
  policies of ``rounds`` (synchronous, local steps), ``downlink`` (shadow, UPDATEs, digests,
  staggered assignments, broadcasts) and ``records`` (resume, checkpoints, validation, export).
- ``model_config``: MODEL_CONFIG <-> ``ModelConfig``, the model the workers are told to build.
"""
