"""The numpy Mixture-of-Experts transformer: config, maths, optimizer, data, GGUF, TP slicing."""
