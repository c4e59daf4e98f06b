"""The numpy Mixture-of-Experts transformer: config, maths, optimizer, data, GGUF, TP slicing.

- ``config``: ``ModelConfig``, presets, the canonical parameter table (GGUF tensor names).
- ``layers``: the building blocks as pure forward/backward function pairs.
- ``transformer``: init, training forward, hand-written backward, loss with load balancing.
- ``optim``: AdamW (decoupled decay on matrices), global-norm clipping, lr schedule.
- ``inference``: the KV-cache ``Engine`` with independent sessions, for one process or a TP rank.
- ``tp_split``: the two-rank tensor-parallel cut of the parameters, as a table.
- ``training``: one training step as the swarm splits it (worker gradients, coordinator update).
- ``data``, ``gguf_io``, ``sampling``, ``checkpoint``: corpus, model files, token sampling and
  checkpoints.
"""
