"""XLA twin of ``index_logits``: the per-head products materialized, then ReLU and the head sum.

Notation: T queries, H heads, D head dim, N keys.
Math: logits[t, n] = sum_h w[t, h] ReLU(q[t, h] . k[n]), with q and k rounded to bf16 and every
product and sum in f32 (the model's "bf16" matmul precision, DotAlgorithmPreset.BF16_BF16_F32),
for n < num_keys; -inf for n >= num_keys.
Memory: [T, H, N] f32 products at once (what the kernel avoids).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def index_logits_xla(q: jnp.ndarray, weights: jnp.ndarray, keys: jnp.ndarray,
                     num_keys: jnp.ndarray) -> jnp.ndarray:
    """q [T, H, D], weights [T, H], keys [N, D] (float), num_keys int32 scalar in [0, N] ->
    logits [T, N] f32."""
    dots = jnp.einsum("thd,nd->thn", q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)
    logits = jnp.sum(weights.astype(jnp.float32)[..., None] * jax.nn.relu(dots), axis=1)
    return jnp.where(jnp.arange(keys.shape[0]) < num_keys, logits, -jnp.inf)
