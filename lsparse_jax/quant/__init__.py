"""Quantized storage of indexer keys."""

from lsparse_jax.quant.fp8 import dequantize_index_keys, quantize_index_keys

__all__ = ["quantize_index_keys", "dequantize_index_keys"]
