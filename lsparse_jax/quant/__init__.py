"""Quantized storage of indexer keys."""

from lsparse_jax.quant.fp8 import dequantize_index_keys, quantize_index_keys
from lsparse_jax.quant.pq import (
    coarse_scores,
    decode,
    encode,
    load_codebooks,
    save_codebooks,
    train_codebooks,
)

__all__ = [
    "quantize_index_keys",
    "dequantize_index_keys",
    "train_codebooks",
    "encode",
    "decode",
    "coarse_scores",
    "save_codebooks",
    "load_codebooks",
]
