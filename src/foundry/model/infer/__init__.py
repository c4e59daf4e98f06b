"""Inference: ``inference`` (the numpy KV-cache ``Engine``), ``torch_engine`` (PyTorch),
``sessions`` (what both share of a session), ``engines`` (``make_engine``), ``generate`` and
``sampling``. Never imports ``train``."""
