"""Foundry: train and serve a Mixture-of-Experts language model on the machines people own.

Subpackages, each named after a capability:

- ``wire``: the FDTC and tensor-parallel protocols as sans-IO codecs (no sockets).
- ``transport``: the asyncio/socket drivers that move wire bytes, and the TP gate exchange.
- ``model``: the numpy MoE transformer: config, maths, optimizer, data, GGUF, TP slicing.
- ``swarm``: the training coordinator and workers.
- ``tp``: the tensor-parallel leader and worker.
- ``gateway``: the gRPC gateway; ``api``: code generated from ``proto/``.
- ``obs``: metrics and timelines.
- ``up``: ``foundry up``, every service as a local process; ``commands``: the subcommands.
- ``runtime``: process-wide settings of the training processes.

Imports point down the layers of docs/architecture.md ("Layers"); tests/test_layers.py checks.
"""

__version__ = "0.1.0"
