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

Row formats (``rows.py``): dense f32/bf16 tables, or DeepSeek-V4's FP8 rows as the tuple of
leaves (nope e4m3, scales e8m0 per 64 values, rope bf16), read in that format by the kernels.

Implementations: "xla" (``reference.py``: gathers table[slots], dequantizes, f32 HIGHEST),
"triton" (``triton.py``: Pallas lowered through Triton; all heads of a request in one program,
rows gathered in place and split across programs with a log-sum-exp combine; bf16 tensor-core
dots for bf16 and FP8 rows (q and probabilities rounded to bf16), 3-pass TF32 for f32 rows;
interpret mode without a GPU; dense D a power of two >= 16, FP8 n a multiple of 64 and r a
power of two >= 16), "mosaic" (``mosaic.py``: Pallas Mosaic GPU, TMA row copies and wgmma;
bf16 rows, D a multiple of 128 up to 512; needs a GPU to run, lowers for CUDA anywhere).
``triton_v1.py`` is the previous Triton kernel (head blocks; benchmarks only).
None picks "triton" on a GPU and "xla" elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.sparse_attention import rows as rowfmt

OP = "sparse_attention"
AVAILABLE = ("xla", "triton", "mosaic")
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
    rowfmt.check_table(OP, table, s, d)
    if slots.ndim != 2 or slots.shape[0] != s:
        fail("slots", f"must be [S, K] with S={s}, got shape {slots.shape}")
    if slots_dtype != jnp.int32:
        fail("slots", f"must be int32, got {slots_dtype}")
    if window.ndim != 3 or window.shape[0] != s or window.shape[2] != d:
        fail("window", f"must be [S, W, D] with S={s}, D={d}, got shape {window.shape}")
    if rowfmt.is_fp8(table):
        if window.dtype not in DTYPES:
            fail("window", f"must be float32 or bfloat16, got {window.dtype}")
    elif window.dtype != table.dtype:
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
      table       [S, R, D]  f32 or bf16 per-request rows (hot cache rows or resident KV),
                  or the FP8 leaves (nope [S, R, n] e4m3, scales [S, R, nb] e8m0,
                  rope [S, R, r] bf16) as a tuple (``rows.py``; n + r = D); [1, R, ...]:
                  one table shared by the S requests (a device page pool), read in place
      slots       [S, K]     int32 row of ``table`` for each selected row; -1 = none
      window      [S, W, D]  the sliding-window rows: table's dtype (f32 or bf16 with FP8 rows)
      window_mask [S, W]     bool, which window rows are valid
      sink        [H]        f32 per-head attention-sink logit
    Outputs:
      out         [S, H, D]  f32
    Under ``jax.vmap`` (e.g. the decode step's map over slots) the kernels run as one launch
    over all mapped requests (``_batched``), not as a grid axis added by Pallas's batching rule;
    an unmapped [1, R, ...] table stays one shared table (no copy per request).
    Raises ValueError for bad shapes/dtypes (naming the argument), implementations, or shapes
    an implementation does not support (``check_triton_shapes``, ``mosaic.check_shapes``).
    """
    impl = common.choose(OP, implementation, AVAILABLE, FASTEST_ON_GPU)
    slots_dtype = jnp.dtype(slots.dtype if hasattr(slots, "dtype") else jnp.asarray(slots).dtype)
    if rowfmt.is_fp8(table):
        table = tuple(jnp.asarray(t) for t in table)
    args = [table if i == 1 else jnp.asarray(a)
            for i, a in enumerate((q, table, slots, window, window_mask, sink))]
    _check(*args, slots_dtype)
    s, h, d = args[0].shape
    if impl == "triton":
        from pallas_kernels.sparse_attention.triton import check_triton_shapes

        check_triton_shapes(OP, table)
    elif impl == "mosaic":
        from pallas_kernels.sparse_attention.mosaic import check_shapes

        check_shapes(OP, table)
    if s == 0 or h == 0:
        return jnp.zeros((s, h, d), jnp.float32)
    if impl == "xla":
        from pallas_kernels.sparse_attention.reference import sparse_attention_xla

        return sparse_attention_xla(*args)
    *args, sink = args
    return _batched(impl)(*args, jnp.broadcast_to(sink, (s, h)))


def _kernel(impl: str):
    if impl == "triton":
        from pallas_kernels.sparse_attention.triton import sparse_attention_triton

        return sparse_attention_triton
    from pallas_kernels.sparse_attention.mosaic import sparse_attention_mosaic

    return sparse_attention_mosaic


@functools.cache
def _batched(impl: str):
    """The kernel ``impl`` on (q, table, slots, window, window_mask, sink [S, H]) with a vmap
    rule that folds mapped axes into S: vmap over B calls of S requests is one launch over
    B S requests (Pallas's own batching rule would add a grid axis instead, keeping the
    launch parameters of one call of S). Unmapped operands are broadcast over B, except a
    table of one leading row ([1, R, ...]): it stays the one table all B S requests share
    (the Triton kernel reads it in place; the Mosaic path broadcasts it). A mapped table of
    one leading row (each call's requests share their own) is repeated over its call's S
    requests (nested maps: a verification block's T queries under the map over slots)."""
    @jax.custom_batching.custom_vmap
    def call(q, table, slots, window, window_mask, sink):
        if impl == "mosaic":  # it reads per-request tables
            table = rowfmt.broadcast(table, q.shape[0])
        return _kernel(impl)(q, table, slots, window, window_mask, sink)

    @call.def_vmap
    def _rule(axis_size, in_batched, *args):
        def fold(a, batched):
            a = a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
            return a.reshape((axis_size * a.shape[1],) + a.shape[2:])

        q, table, table_batched = args[0], args[1], in_batched[1]
        s = q.shape[1] if in_batched[0] else q.shape[0]  # requests of one mapped call
        shared = not any(jax.tree.leaves(table_batched)) and rowfmt.leading(table)[0] == 1
        args, batched = list(args), list(in_batched)
        if not shared:  # per mapped call its own table: one shared by its S requests
            #  ([1, R, ...]) is repeated S times, as folding puts the calls' requests side by side
            def per_call(t, b):
                t = t if b else jnp.broadcast_to(t, (axis_size,) + t.shape)
                return jnp.broadcast_to(t, (axis_size, s) + t.shape[2:]) if (
                    t.shape[1] == 1 < s) else t

            args[1] = jax.tree.map(per_call, table, table_batched)
            batched[1] = jax.tree.map(lambda _: True, table_batched)
        folded = [a if i == 1 and shared else jax.tree.map(fold, a, b)  # shared: one table
                  for i, (a, b) in enumerate(zip(args, batched))]      # for all B S requests
        out = call(*folded)
        return out.reshape((axis_size, -1) + out.shape[1:]), True

    return call
