"""XLA reference of ``index_scores``: exact rescoring of gathered FP8 candidate keys.

Notation:
  B requests, H indexer heads, D head dim, C gathered candidates per request,
  NB scale blocks per key (block = D / NB values share one fp32 scale).

Math: I[b, c] = sum_h w[b, h] * ReLU(q[b, h] . dequant(k[b, c])) for valid candidates and
-inf for invalid ones; dequant multiplies each block of ``block`` FP8 values by its scale.
Computed in f32 at HIGHEST precision (``lsparse_jax.indexing.index_scores``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lsparse_jax.indexing import index_scores as _exact_index_scores
from lsparse_jax.quant import dequantize_index_keys


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
    scores = _exact_index_scores(q.astype(jnp.float32), weights.astype(jnp.float32), keys)
    return jnp.where(valid, scores, -jnp.inf)                      # [B, C]
