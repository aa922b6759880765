"""XLA reference of ``sparse_attention``: decode attention over selected rows + window + sink.

Notation:
  S requests (one decode query each), H query heads, D head dim, R table rows per request,
  K selected rows per request (slot -1 = none), W window rows per request.

Math: the K rows table[s, slots[s, k]] (valid where slots >= 0) and the W rows window[s, w]
(valid where window_mask) are keys and values at once; logits_{s,h,r} = q_{s,h} . row_r /
sqrt(D) over valid rows, the softmax denominator adds exp(sink_h) and the sink adds no value:
  out[s, h] = sum_r exp(l_r) row_r / (exp(sink_h) + sum_r exp(l_r)).
Gathers table[max(slots, 0)] (materialized: this is the plain version), dequantizes FP8 rows
(``rows.dequantize``), zeroes invalid rows (their NaN poison never reaches a valid output) and
computes in f32 at HIGHEST precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_attention import rows as rowfmt

HIGHEST = jax.lax.Precision.HIGHEST


@jax.jit
def sparse_attention_xla(q: jnp.ndarray, table: jnp.ndarray, slots: jnp.ndarray,
                         window: jnp.ndarray, window_mask: jnp.ndarray,
                         sink: jnp.ndarray) -> jnp.ndarray:
    """Plain-jnp implementation (shapes are checked by ``api.sparse_attention``).

    Inputs:
      q           [S, H, D]  f32 or bf16
      table       [S, R, D]  f32 or bf16, or the FP8 leaves (nope [S, R, n] e4m3,
                             scales [S, R, nb] e8m0, rope [S, R, r] bf16; ``rows.py``);
                             [1, R, ...]: one table shared by the S requests
      slots       [S, K]     int32, -1 = none
      window      [S, W, D]  f32 or bf16
      window_mask [S, W]     bool
      sink        [H]        f32
    Outputs:
      out         [S, H, D]  f32
    """
    table = rowfmt.broadcast(table, slots.shape[0])
    idx = jnp.maximum(slots, 0)[..., None]
    picked = rowfmt.dequantize(jax.tree.map(lambda t: jnp.take_along_axis(t, idx, axis=1),
                                            table))                            # [S, K, D]
    rows = jnp.concatenate([window.astype(jnp.float32), picked], axis=1)       # [S, W+K, D]
    valid = jnp.concatenate([window_mask, slots >= 0], axis=1)                 # [S, W+K]
    rows = jnp.where(valid[..., None], rows, 0.0)                              # drop NaN poison
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("shd,srd->shr", q.astype(jnp.float32), rows, precision=HIGHEST) * scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)                    # [S, H, W+K]
    sink_logit = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None],
                                  logits.shape[:2] + (1,))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink_logit], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("shr,srd->shd", probs, rows, precision=HIGHEST)          # [S, H, D]
