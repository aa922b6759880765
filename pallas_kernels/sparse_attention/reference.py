"""XLA reference of ``sparse_attention``: decode attention over selected rows + window + sink.

Notation:
  S requests (one decode query each), H query heads, D head dim, R table rows per request,
  K selected rows per request (slot -1 = none), W window rows per request.

Math: the K rows table[s, slots[s, k]] (valid where slots >= 0) and the W rows window[s, w]
(valid where window_mask) are keys and values at once; logits_{s,h,r} = q_{s,h} . row_r /
sqrt(D) over valid rows, the softmax denominator adds exp(sink_h) and the sink adds no value:
  out[s, h] = sum_r exp(l_r) row_r / (exp(sink_h) + sum_r exp(l_r)).
Gathers table[max(slots, 0)] (materialized: this is the plain version), zeroes invalid rows
(their NaN poison never reaches a valid output) and computes in f32 at HIGHEST precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


@jax.jit
def sparse_attention_xla(q: jnp.ndarray, table: jnp.ndarray, slots: jnp.ndarray,
                         window: jnp.ndarray, window_mask: jnp.ndarray,
                         sink: jnp.ndarray) -> jnp.ndarray:
    """Plain-jnp implementation (shapes are checked by ``api.sparse_attention``).

    Inputs:
      q           [S, H, D]  f32 or bf16
      table       [S, R, D]  f32 or bf16
      slots       [S, K]     int32, -1 = none
      window      [S, W, D]  table's dtype
      window_mask [S, W]     bool
      sink        [H]        f32
    Outputs:
      out         [S, H, D]  f32
    """
    picked = jnp.take_along_axis(table, jnp.maximum(slots, 0)[..., None], axis=1)  # [S, K, D]
    rows = jnp.concatenate([window, picked], axis=1).astype(jnp.float32)       # [S, W+K, D]
    valid = jnp.concatenate([window_mask, slots >= 0], axis=1)                 # [S, W+K]
    rows = jnp.where(valid[..., None], rows, 0.0)                              # drop NaN poison
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("shd,srd->shr", q.astype(jnp.float32), rows, precision=HIGHEST) * scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)                    # [S, H, W+K]
    sink_logit = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None],
                                  logits.shape[:2] + (1,))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink_logit], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("shr,srd->shd", probs, rows, precision=HIGHEST)          # [S, H, D]
