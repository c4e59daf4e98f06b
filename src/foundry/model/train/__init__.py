"""Training: ``optim`` (AdamW, clipping, schedule), ``training`` (one step as the swarm splits it),
``recipe`` (the defaults), ``backend`` and ``torch_backend`` (numpy or PyTorch). Never imports
``infer``."""
