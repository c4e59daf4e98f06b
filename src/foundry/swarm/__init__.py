"""Swarm training: the coordinator (parameter server) and its workers over FDTC.

- ``coordinator``, ``worker``: the two services; ``policy``: the round rules as pure functions.
- ``model_config``: MODEL_CONFIG <-> ``ModelConfig``, the model the workers are told to build.
"""
