"""Text: ``vocab`` (tokenizers, the byte one among them), ``chat`` (chat templates), ``data``
(corpus, held-out split, sample order, the compressors' yardstick)."""
