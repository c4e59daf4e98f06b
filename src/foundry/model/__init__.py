"""The Mixture-of-Experts transformer, by job; imports point down this list (docs/architecture.md,
"Inside model"):

- ``spec``: ``ModelConfig``, presets, the parameter table; the architecture table.
- ``nn``: the maths (numpy forward/backward, the PyTorch model) and the ``--device`` resolver.
- ``kernels``: the quantization-type table, ``QTensor`` and the C kernels, finiteness checks.
- ``formats`` (GGUF files, checkpoints) and ``shard`` (the two-rank tensor-parallel cut).
- ``text``: tokenizers, chat templates, the corpus.
- ``train`` and ``infer``, which never import each other.
"""
