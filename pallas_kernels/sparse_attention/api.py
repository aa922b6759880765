"""Public entry point of ``sparse_attention``: decode attention over selected rows, a window
of raw rows and a per-head sink (DeepSeek-V4 CSA/HCA layers, one KV head).

Notation:
  S requests (one decode query each), H query heads, D head dim, R table rows per request,
  K selected rows per request (slot -1 = none), W window rows per request.

Math: each valid row r (table[s, slots[s, k]] with slots >= 0, window[s, w] with
window_mask) is both key and value; logits_{s,h,r} = q_{s,h} . r / sqrt(D) and
  out[s, h] = sum_r exp(logit_r) r / (exp(sink_h) + sum_r exp(logit_r)),
i.e. ``lsparse_jax.model.attention.sink_attention`` with T = 1 and the groups
[(window, window_mask), (table[slots], slots >= 0)]. Invalid rows and unselected table rows
never reach the output (they may hold NaN); a request with no valid row gets 0; duplicate
slots count twice. Slots >= R are undefined (callers must not pass them).

Implementations: "xla" (``reference.py``: gathers table[slots], f32 HIGHEST), "triton"
(``triton.py``: Pallas lowered through Triton, gathers the rows in place with an online
softmax; bf16 or f32 tensor-core dots with f32 accumulation, probabilities rounded to the
table's dtype, q cast to it; interpret mode without a GPU; needs D a power of two >= 16).
None picks "triton" on a GPU and "xla" elsewhere.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common

OP = "sparse_attention"
AVAILABLE = ("xla", "triton")
FASTEST_ON_GPU = "triton"
DTYPES = (jnp.float32, jnp.bfloat16)


def _check(q, table, slots, window, window_mask, sink, slots_dtype) -> None:
    """Raises ValueError naming the first argument with a bad shape or dtype (``slots_dtype``:
    the dtype the caller passed, before jnp.asarray narrows an int64 array to int32)."""
    def fail(arg, what):
        raise ValueError(f"{OP}: {arg} {what}")

    if q.ndim != 3:
        fail("q", f"must be [S, H, D], got shape {q.shape}")
    if q.dtype not in DTYPES:
        fail("q", f"must be float32 or bfloat16, got {q.dtype}")
    s, h, d = q.shape
    if table.ndim != 3 or table.shape[0] != s or table.shape[2] != d:
        fail("table", f"must be [S, R, D] with S={s}, D={d}, got shape {table.shape}")
    if table.dtype not in DTYPES:
        fail("table", f"must be float32 or bfloat16, got {table.dtype}")
    if table.shape[1] < 1:
        fail("table", f"must have at least one row, got shape {table.shape}")
    if slots.ndim != 2 or slots.shape[0] != s:
        fail("slots", f"must be [S, K] with S={s}, got shape {slots.shape}")
    if slots_dtype != jnp.int32:
        fail("slots", f"must be int32, got {slots_dtype}")
    if window.ndim != 3 or window.shape[0] != s or window.shape[2] != d:
        fail("window", f"must be [S, W, D] with S={s}, D={d}, got shape {window.shape}")
    if window.dtype != table.dtype:
        fail("window", f"must have table's dtype {table.dtype}, got {window.dtype}")
    if window_mask.shape != window.shape[:2]:
        fail("window_mask", f"must be [S, W] = {window.shape[:2]}, got shape "
             f"{window_mask.shape}")
    if window_mask.dtype != jnp.bool_:
        fail("window_mask", f"must be bool, got {window_mask.dtype}")
    if sink.shape != (h,):
        fail("sink", f"must be [H] = ({h},), got shape {sink.shape}")
    if sink.dtype != jnp.float32:
        fail("sink", f"must be float32, got {sink.dtype}")


def sparse_attention(q, table, slots, window, window_mask, sink, *,
                     implementation: common.Implementation | None = None) -> jnp.ndarray:
    """Decode attention of one query per request over its selected table rows and window.

    Inputs:
      q           [S, H, D]  f32 or bf16, one decode query per request
      table       [S, R, D]  f32 or bf16 per-request rows (hot cache rows or resident KV)
      slots       [S, K]     int32 row of ``table`` for each selected row; -1 = none
      window      [S, W, D]  table's dtype, the sliding-window rows
      window_mask [S, W]     bool, which window rows are valid
      sink        [H]        f32 per-head attention-sink logit
    Outputs:
      out         [S, H, D]  f32
    Raises ValueError for bad shapes/dtypes (naming the argument), implementations, or (for
    "triton") a D that is not a power of two >= 16.
    """
    impl = common.choose(OP, implementation, AVAILABLE, FASTEST_ON_GPU)
    slots_dtype = jnp.dtype(slots.dtype if hasattr(slots, "dtype") else jnp.asarray(slots).dtype)
    args = [jnp.asarray(a) for a in (q, table, slots, window, window_mask, sink)]
    _check(*args, slots_dtype)
    s, h, d = args[0].shape
    if impl == "triton":
        from pallas_kernels.sparse_attention.triton import (
            check_triton_shapes,
            sparse_attention_triton,
        )

        check_triton_shapes(OP, d)
        if s == 0 or h == 0:
            return jnp.zeros((s, h, d), jnp.float32)
        return sparse_attention_triton(*args)
    if s == 0 or h == 0:
        return jnp.zeros((s, h, d), jnp.float32)
    from pallas_kernels.sparse_attention.reference import sparse_attention_xla

    return sparse_attention_xla(*args)
