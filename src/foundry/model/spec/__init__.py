"""What a model is, as data: ``config`` (``ModelConfig``, presets, the canonical parameter
table) and ``arch`` (the architectures a GGUF file may name, one row each)."""
