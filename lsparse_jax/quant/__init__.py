"""Quantized storage of indexer keys and compressed KV rows."""

from lsparse_jax.quant.fp8 import dequantize_index_keys, quantize_index_keys
from lsparse_jax.quant.kv_rows import FP8Rows, KVRowFormat
from lsparse_jax.quant.pq import (
    coarse_scores,
    decode,
    encode,
    load_codebooks,
    save_codebooks,
    train_codebooks,
)

__all__ = [
    "FP8Rows",
    "KVRowFormat",
    "quantize_index_keys",
    "dequantize_index_keys",
    "train_codebooks",
    "encode",
    "decode",
    "coarse_scores",
    "save_codebooks",
    "load_codebooks",
]
