"""Model files: ``gguf_meta`` (the GGUF header), ``gguf_model`` (what a model file holds, the
config its metadata describes), ``gguf_io`` (reading and writing models), ``gguf_rewrite`` (a
published file with some tensors replaced), ``checkpoint`` (atomic training checkpoints),
``outfile`` (where an export may write)."""
