"""Tokenizers read from a GGUF file's ``tokenizer.ggml.*`` metadata, with llama.cpp's ids.

``load_tokenizer(metadata)`` gives a :class:`Tokenizer` (``encode``, ``decode``,
``token_bytes``, ``stream_decoder``, the BOS / EOS / end-of-generation ids). The pipeline and
what each vocabulary type uses are in :mod:`.tokenizer`; docs/tokenizers.md says what is
supported and how the ids are checked against llama.cpp.
"""

from foundry.model.text.vocab.decoders import StreamDecoder
from foundry.model.text.vocab.models import TokenizerError
from foundry.model.text.vocab.tokenizer import (
    Tokenizer,
    is_byte_vocabulary,
    load_tokenizer,
    load_tokenizer_file,
    own_tokenizer,
)

__all__ = [
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "is_byte_vocabulary",
    "load_tokenizer",
    "load_tokenizer_file",
    "own_tokenizer",
]
