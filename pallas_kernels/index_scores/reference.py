"""XLA reference of ``index_scores``: exact rescoring of gathered FP8 candidate keys.

Notation:
  B requests, H indexer heads, D head dim, C gathered candidates per request,
  NB scale blocks per key (block = D / NB values share one fp32 scale).

Math: I[b, c] = sum_h w[b, h] * ReLU(q[b, h] . dequant(k[b, c])) for valid candidates and
-inf for invalid ones; dequant multiplies each block of ``block`` FP8 values by its scale.
Computed in f32 at HIGHEST precision (``exact_index_scores``). This module is also where the
library's exact indexer score and FP8 key dequantization are defined (``lsparse_jax.indexing``
and ``lsparse_jax.quant`` re-export them), so the kernels' ground truth imports nothing above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def exact_index_scores(q: jnp.ndarray, weights: jnp.ndarray, keys: jnp.ndarray,
                       precision=jax.lax.Precision.HIGHEST) -> jnp.ndarray:
    """Exact lightning-indexer scores of every key.

    Notation: H indexer heads, D head dim, N keys.
      q [..., H, D], weights [..., H], keys [..., N, D] (float; no quantization here).
    Math: I[n] = sum_h w_h * ReLU(q_h . k_n), computed in f32 at HIGHEST precision (or the
    given matmul ``precision``: the model's prefill may trade it for tensor-core speed).
    Returns [..., N] f32. The per-key FP8 scale of stored keys is applied by dequantizing them
    first (``dequantize_index_keys``), which multiplies k_n by its scale.
    """
    dots = jnp.einsum("...hd,...nd->...hn", q.astype(jnp.float32), keys.astype(jnp.float32),
                      precision=precision)
    if precision is jax.lax.Precision.HIGHEST:
        return jnp.einsum("...h,...hn->...n", weights.astype(jnp.float32), jax.nn.relu(dots),
                          precision=precision)
    # reduced precision (the model's fast prefill): the head sum as one f32 multiply-reduce
    # over the [..., H, N] products, which XLA fuses into a single read of them (the einsum
    # form is a batched matrix-vector product that first transposes them)
    return jnp.sum(weights.astype(jnp.float32)[..., None] * jax.nn.relu(dots), axis=-2)


def dequantize_index_keys(values: jnp.ndarray, scales: jnp.ndarray) -> jnp.ndarray:
    """FP8 keys back to f32: (values [..., D] e4m3, scales [..., D/b]) -> [..., D], each block
    of b = D / NB values times its scale (inverse of ``quant.quantize_index_keys``)."""
    d, nb = values.shape[-1], scales.shape[-1]
    if d % nb:
        raise ValueError(f"dequantize_index_keys: {nb} scales do not divide key dim {d}")
    x = values.astype(jnp.float32).reshape(*values.shape[:-1], nb, d // nb)
    return (x * scales[..., None]).reshape(values.shape)


@jax.jit
def index_scores_xla(q: jnp.ndarray, weights: jnp.ndarray, key_values: jnp.ndarray,
                     key_scales: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
    """Plain-jnp implementation (shapes are checked by ``api.index_scores``).

    Inputs:
      q          [B, H, D]   f32 or bf16 queries
      weights    [B, H]      f32 head weights
      key_values [B, C, D]   float8_e4m3fn key values
      key_scales [B, C, NB]  f32 block scales
      valid      [B, C]      bool; invalid rows may hold NaN poison in values and scales
    Outputs:
      scores     [B, C]      f32; -inf on invalid rows
    """
    keys = dequantize_index_keys(key_values, key_scales)           # [B, C, D] f32
    keys = jnp.where(valid[..., None], keys, 0.0)                  # drop NaN poison
    scores = exact_index_scores(q.astype(jnp.float32), weights.astype(jnp.float32), keys)
    return jnp.where(valid, scores, -jnp.inf)                      # [B, C]
