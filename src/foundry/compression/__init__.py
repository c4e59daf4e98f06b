"""Gradient and update codecs: NONE, FP16, TOPK, QSGD, and error feedback around the lossy ones.

Python counterparts of the seed's sw_serialize_tensor / sw_deserialize_tensor /
sw_estimate_compressed_size / sw_fp32_to_fp16 / sw_fp16_to_fp32 / sw_topk_compress /
sw_topk_decompress. ``base`` holds the ``Codec`` interface and the registry keyed by the wire
enum (checked here, once every codec module is imported, to cover every value); one module per
codec, each with its parameters dataclass (``none``, ``fp16``, ``topk``, ``qsgd``);
``feedback`` wraps every lossy codec in error feedback (``Compressor``), so senders have one
path. The per-tensor byte layouts are in each module's docstring and in ``docs/protocol.md``.
All decoders treat their input as a peer's bytes: truncated or inconsistent data raises
FdtcProtocolError. Layering: this package knows the wire enum and errors, nothing above them.
"""

from foundry.compression.base import (
    CODECS,
    Codec,
    CodecParams,
    check_registry,
    deserialize_tensors,
    estimate_compressed_size,
    get_codec,
    largest_message,
    largest_section,
    serialize_tensors,
)
from foundry.compression.feedback import Compressor, ErrorFeedback
from foundry.compression.fp16 import Fp16Codec, Fp16Params, fp16_to_fp32, fp32_to_fp16
from foundry.compression.none import NoneCodec, NoneParams
from foundry.compression.qsgd import QsgdCodec, QsgdParams
from foundry.compression.topk import TopKCodec, TopKParams, topk_compress, topk_decompress

check_registry()

__all__ = [
    "CODECS",
    "Codec",
    "CodecParams",
    "Compressor",
    "ErrorFeedback",
    "Fp16Codec",
    "Fp16Params",
    "NoneCodec",
    "NoneParams",
    "QsgdCodec",
    "QsgdParams",
    "TopKCodec",
    "TopKParams",
    "deserialize_tensors",
    "estimate_compressed_size",
    "fp16_to_fp32",
    "fp32_to_fp16",
    "get_codec",
    "largest_message",
    "largest_section",
    "serialize_tensors",
    "topk_compress",
    "topk_decompress",
]
