"""Model files: ``gguf_meta`` (the GGUF header), ``gguf_io`` (reading and writing models),
``checkpoint`` (atomic training checkpoints), ``outfile`` (where an export may write)."""
