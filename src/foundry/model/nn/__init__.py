"""The maths: ``layers`` (forward/backward function pairs, the GELU table), ``transformer`` (init,
training forward, hand-written backward, loss), ``torch_model`` (the same in PyTorch) and
``device`` (``--device`` resolved once for training and serving)."""
