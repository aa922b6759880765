"""Public entry point of ``index_scores``: exact rescoring of C gathered FP8 candidate keys.

Notation:
  B requests, H indexer heads, D head dim, C gathered candidates per request,
  NB scale blocks per key (block = D / NB values share one fp32 scale; NB = 1 in V4).

Math: scores[b, c] = sum_h weights[b, h] * ReLU(q[b, h] . dequant(key[b, c])) for valid
candidates, -inf for invalid ones (whose NaN-poisoned values and scales never reach an output).

Implementations: "xla" (``reference.py``, f32 HIGHEST), "triton" (Pallas lowered through Triton;
interpret mode without a GPU), "jax_triton" (a plain Triton kernel via jax-triton; GPU only).
"triton_fp8" (the Pallas kernel as an fp8 x fp8
tensor-core dot: q quantized per head to e4m3 with its scale moved into the head weight,
``reference.quantize_queries``; ~3% per-value rounding of q), "xla_fp8" (its XLA twin,
``reference.index_scores_fp8_xla``: what a decode step at ``IndexerConfig.score_precision``
"fp8" runs without kernels). None picks "triton" on a GPU and "xla" elsewhere. "triton"
splits an f32 q into bf16 hi + lo parts (~1e-5 relative error); "jax_triton" rounds q to bf16
(~1e-2). Both need D a power of two >= 16 with scale blocks of >= 16 values.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels import common

OP = "index_scores"
AVAILABLE = ("xla", "xla_fp8", "triton", "triton_fp8", "jax_triton")
PAGED_AVAILABLE = ("xla", "xla_fp8", "triton", "triton_fp8")
TOPK_AVAILABLE = ("xla", "triton_fp8")
FASTEST_ON_GPU = "triton"


def _check(q, weights, key_values, key_scales, valid) -> None:
    """Raises ValueError naming the first argument with a bad shape or dtype."""
    def fail(arg, what):
        raise ValueError(f"{OP}: {arg} {what}")

    if q.ndim != 3:
        fail("q", f"must be [B, H, D], got shape {q.shape}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        fail("q", f"must be float32 or bfloat16, got {q.dtype}")
    b, h, d = q.shape
    if weights.shape != (b, h):
        fail("weights", f"must be [B, H] = {(b, h)}, got shape {weights.shape}")
    if weights.dtype not in (jnp.float32, jnp.bfloat16):
        fail("weights", f"must be float32 (or bfloat16), got {weights.dtype}")
    if key_values.ndim != 3 or key_values.shape[0] != b or key_values.shape[2] != d:
        fail("key_values", f"must be [B, C, D] with B={b}, D={d}, got shape {key_values.shape}")
    if key_values.dtype != jnp.float8_e4m3fn:
        fail("key_values", f"must be float8_e4m3fn, got {key_values.dtype}")
    c = key_values.shape[1]
    if key_scales.ndim != 3 or key_scales.shape[:2] != (b, c):
        fail("key_scales", f"must be [B, C, NB] with B={b}, C={c}, got shape "
             f"{key_scales.shape}")
    nb = key_scales.shape[2]
    if nb < 1 or d % nb:
        fail("key_scales", f"has {nb} scale blocks per key, which must divide D={d}")
    if key_scales.dtype != jnp.float32:
        fail("key_scales", f"must be float32, got {key_scales.dtype}")
    if valid.shape != (b, c):
        fail("valid", f"must be [B, C] = {(b, c)}, got shape {valid.shape}")
    if valid.dtype != jnp.bool_:
        fail("valid", f"must be bool, got {valid.dtype}")


def index_scores(q, weights, key_values, key_scales, valid, *,
                 implementation: common.Implementation | None = None) -> jnp.ndarray:
    """Exact index scores of gathered FP8 candidate keys.

    Inputs:
      q          [B, H, D]   f32 or bf16 queries
      weights    [B, H]      f32 head weights
      key_values [B, C, D]   float8_e4m3fn key values
      key_scales [B, C, NB]  f32 block scales (NB divides D)
      valid      [B, C]      bool; invalid rows may hold NaN poison in values and scales
    Outputs:
      scores     [B, C]      f32; -inf on invalid rows
    Raises ValueError for bad shapes/dtypes (naming the argument) or implementations.
    """
    impl = common.choose(OP, implementation, AVAILABLE, FASTEST_ON_GPU)
    args = [jnp.asarray(a) for a in (q, weights, key_values, key_scales, valid)]
    _check(*args)
    b, c = args[4].shape
    if b == 0 or c == 0:
        return jnp.zeros((b, c), jnp.float32)
    if impl == "xla":
        from pallas_kernels.index_scores.reference import index_scores_xla

        return index_scores_xla(*args)
    if impl == "xla_fp8":
        from pallas_kernels.index_scores.reference import index_scores_fp8_xla

        return index_scores_fp8_xla(*args)
    if impl in ("triton", "triton_fp8"):
        from pallas_kernels.index_scores.triton import index_scores_triton

        return index_scores_triton(*args, fp8=impl == "triton_fp8")
    from pallas_kernels.index_scores.jax_triton import index_scores_jax_triton

    return index_scores_jax_triton(*args)


def _check_paged(q, weights, pool_values, pool_scales, page_table, tail, valid,
                 page) -> None:
    """Raises ValueError naming the first bad argument of ``index_scores_paged``."""
    def fail(arg, what):
        raise ValueError(f"{OP}_paged: {arg} {what}")

    b = q.shape[0]
    per = pool_values.ndim == 3  # per-request pools [B, R, ...]
    if pool_values.dtype != jnp.float8_e4m3fn:
        fail("pool_values", f"must be float8_e4m3fn, got {pool_values.dtype}")
    if per and pool_values.shape[0] != b:
        fail("pool_values", f"per request must be [B, R, D] with B={b}, got shape "
             f"{pool_values.shape}")
    r = pool_values.shape[-2]
    if r % page:
        fail("pool_values", f"has {r} rows, not whole pages of {page}")
    if pool_scales.ndim != pool_values.ndim or pool_scales.shape[:-1] != pool_values.shape[:-1]:
        fail("pool_scales", f"must be [{'B, ' if per else ''}R, NB] like pool_values "
             f"{pool_values.shape}, got shape {pool_scales.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        fail("page_table", f"must be [B, MP] with B={b}, got shape {page_table.shape}")
    if page_table.dtype != jnp.int32:
        fail("page_table", f"must be int32, got {page_table.dtype}")
    if valid.ndim != 2:
        fail("valid", f"must be [B, N], got shape {valid.shape}")
    tail_values, tail_scales, tail_start = tail
    rows = tail_values.shape[1] if tail_values.ndim == 3 else 0
    if tail_values.shape != (b, rows) + pool_values.shape[-1:] or rows < 1 \
            or tail_values.dtype != pool_values.dtype:
        fail("tail", f"values must be {pool_values.dtype} [B, T, D] with B={b}, T >= 1, "
             f"D={pool_values.shape[-1]}, got {tail_values.dtype} {tail_values.shape}")
    if tail_scales.shape != (b, rows) + pool_scales.shape[-1:] \
            or tail_scales.dtype != pool_scales.dtype:
        fail("tail", f"scales must be like the pool's, [B, T, NB], got {tail_scales.dtype} "
             f"{tail_scales.shape}")
    if tail_start.shape != (b,) or tail_start.dtype != jnp.int32:
        fail("tail", f"start must be int32 [B] = {(b,)}, got {tail_start.dtype} "
             f"{tail_start.shape}")
    # the per-request checks of index_scores on stand-ins of the gathered rows
    row = lambda x: jax.ShapeDtypeStruct((b, valid.shape[1]) + x.shape[-1:], x.dtype)  # noqa
    _check(q, weights, row(pool_values), row(pool_scales), valid)


def index_scores_paged(q, weights, pool_values, pool_scales, page_table, valid, *, page: int,
                       tail=None,
                       implementation: common.Implementation | None = None) -> jnp.ndarray:
    """Exact index scores of FP8 keys read in place from a pool of pages.

    Inputs:
      q           [B, H, D]   f32 or bf16 queries
      weights     [B, H]      f32 head weights
      pool_values [R, D]      float8_e4m3fn key values, R = NP * P (pages of P rows), shared
                              by the batch; or [B, R, D]: a pool per request (its table
                              names its own pool's pages)
      pool_scales [R, NB]     f32 block scales (or [B, R, NB])
      page_table  [B, MP]     int32 pool page of each request's logical page, -1 none
      valid       [B, N]      bool: which positions 0..N-1 to score
      page        P           static int, rows per page
      tail        optional (values [B, T, D] e4m3, scales [B, T, NB] f32, start [B] int32):
                  rows outside the pool (e.g. the page being filled, T = P): positions
                  start .. start + T - 1 are its rows (not the page table's)
    Math: position n of request b is its tail's row n - start[b] if in the tail, else pool
      row page_table[b, n // P] * P + n % P; scores as ``index_scores`` of those rows.
    Outputs:
      scores      [B, N]      f32; -inf where invalid or, outside the tail, on an unmapped
                              page (-1 or n // P >= MP); such rows are never read
    Implementations: "xla" (``reference.index_scores_paged_xla``: gather, then
    ``index_scores_xla``), "triton" (``paged.py``: rows read in place, the contiguous kernel's
    arithmetic and launch, so a key scores bit for bit as there), "triton_fp8" (its fp8 x fp8
    form), "xla_fp8" (that form's twin: gather, then ``index_scores_fp8_xla``). None:
    "triton" on a GPU, else "xla". Vmappable over requests, a shared pool with
    in_axes None, per-request pools mapped: the kernel then runs once over every request.
    Raises ValueError for bad shapes/dtypes (naming the argument) or implementations.
    """
    impl = common.choose(f"{OP}_paged", implementation, PAGED_AVAILABLE, FASTEST_ON_GPU)
    args = [jnp.asarray(a) for a in (q, weights, pool_values, pool_scales, page_table)]
    valid = jnp.asarray(valid)
    if args[0].ndim != 3:
        raise ValueError(f"{OP}_paged: q must be [B, H, D], got shape {args[0].shape}")
    if isinstance(page, bool) or not isinstance(page, int) or page < 1:
        raise ValueError(f"{OP}_paged: page must be a static int >= 1, got {page!r}")
    if args[2].ndim not in (2, 3):
        raise ValueError(f"{OP}_paged: pool_values must be [R, D] (or [B, R, D] per request), "
                         f"got shape {args[2].shape}")
    b = args[0].shape[0]
    if tail is None:  # a tail no position reaches
        tail = (jnp.zeros((b, page) + args[2].shape[-1:], args[2].dtype),
                jnp.ones((b, page) + args[3].shape[-1:], args[3].dtype),
                jnp.full((b,), -2 ** 30, jnp.int32))
    tail = tuple(jnp.asarray(t) for t in tail)
    _check_paged(*args, tail, valid, page)
    args = [*args, *tail, valid]
    if b == 0 or valid.shape[1] == 0:
        return jnp.zeros(valid.shape, jnp.float32)
    if impl in ("xla", "xla_fp8"):
        from pallas_kernels.index_scores.reference import index_scores_paged_xla

        return index_scores_paged_xla(*args, page=page, fp8=impl == "xla_fp8")
    from pallas_kernels.index_scores.paged import index_scores_paged_triton

    kernel = partial(index_scores_paged_triton, page=page, fp8=impl == "triton_fp8")
    per_request = (args[2].ndim == 3,) * 2  # the pool's values and scales: shared or not
    return common.batch_folding(kernel, (True, True, *per_request, True, True, True, True,
                                         True))(*args)


def index_topk(q, weights, key_values, key_scales, valid, *, k: int,
               implementation: common.Implementation | None = None):
    """Index scores of gathered FP8 candidates and their top-k in one call.

    Inputs as ``index_scores``; k static int >= 1.
    Outputs: positions [B, k] int32 (candidate indices of the min(k, #valid) best valid
      candidates, as a set: "xla" best-first, "triton_fp8" in candidate order; equal scores go to
      the lower index; then -1), values [B, k] f32 aligned (-inf at -1), scores [B, C] f32.
    Implementations: "xla" (exact scores, ``topk_positions``), "triton_fp8" (``topk_fused.py``:
      fp8 x fp8 scores and the top-k in one kernel, one program per request; twin
      ``reference.index_topk_xla(..., fp8=True)``). None: "triton_fp8" on a GPU, else "xla".
    """
    impl = common.choose(OP, implementation, TOPK_AVAILABLE, "triton_fp8")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{OP}: k must be a static int >= 1, got {k!r}")
    args = [jnp.asarray(a) for a in (q, weights, key_values, key_scales, valid)]
    _check(*args)
    if impl == "xla":
        from pallas_kernels.index_scores.reference import index_scores_xla, index_topk_xla

        return (*index_topk_xla(*args, k=k, fp8=False), index_scores_xla(*args))
    from pallas_kernels.index_scores.topk_fused import index_topk_triton

    return index_topk_triton(*args, k=k)
