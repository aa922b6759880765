"""Exact lightning-indexer scores."""

import jax
import jax.numpy as jnp


def index_scores(q: jnp.ndarray, weights: jnp.ndarray, keys: jnp.ndarray) -> jnp.ndarray:
    """Exact lightning-indexer scores of every key.

    Notation: H indexer heads, D head dim, N keys.
      q [..., H, D], weights [..., H], keys [..., N, D] (float; no quantization here).
    Math: I[n] = sum_h w_h * ReLU(q_h . k_n), computed in f32 at HIGHEST precision.
    Returns [..., N] f32. The per-key FP8 scale of stored keys is applied by dequantizing them
    first (``quant.dequantize_index_keys``), which multiplies k_n by its scale.
    """
    dots = jnp.einsum("...hd,...nd->...hn", q.astype(jnp.float32), keys.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("...h,...hn->...n", weights.astype(jnp.float32), jax.nn.relu(dots),
                      precision=jax.lax.Precision.HIGHEST)
