"""Weights in their GGUF type and the products that read them: ``types`` (the quantization-type
table), ``quant`` (``QTensor``, the C block kernels and the one-token step, numpy fallback),
``finite`` (NaN and overflow checks), the C extensions ``_kernels`` (``csrc/``) and ``_optim``."""
