"""FP8 (e4m3) storage of lightning-indexer keys with fp32 block scales.

A key of D values is stored as D float8_e4m3fn values plus D / block fp32 scales: 132 bytes at
D = 128 with one block (DeepSeek-V3.2/V4 indexer cache layout).
"""

import jax.numpy as jnp

from pallas_kernels.index_scores.reference import dequantize_index_keys

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


def quantize_index_keys(keys: jnp.ndarray, block: int | None = None):
    """Quantizes keys [..., D] to (values [..., D] e4m3, scales [..., D // block] f32).

    Notation: x = one block of ``block`` values; s = max|x| / 448 (1 where x == 0);
    value = e4m3(x / s). Dequantized x' = value * s, with |x - x'| <= 2^-4 |x| + 2^-9 s
    (e4m3 keeps 3 mantissa bits; subnormals bottom out at 2^-9).
    """
    d = keys.shape[-1]
    block = d if block is None else block
    if d % block:
        raise ValueError(f"quantize_index_keys: block={block} must divide the key dim {d}")
    x = keys.astype(jnp.float32).reshape(*keys.shape[:-1], d // block, block)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scales = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    values = (x / scales[..., None]).astype(jnp.float8_e4m3fn)
    return values.reshape(keys.shape), scales


__all__ = ["E4M3_MAX", "dequantize_index_keys", "quantize_index_keys"]
