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

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common


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


def query_scale(amax: jnp.ndarray):
    """(s, 1 / s) for rows of queries with max |q| = amax: s = 2^(E - 7) with E the exponent of
    amax (amax = 1.m x 2^E), so amax / s lies in [128, 256), inside e4m3's 448 (clamped to
    [2^-126, 2^120]: zero, subnormal and non-finite rows). Both are powers of two built from
    the exponent bits, so q / s = q * (1 / s) and w * s are exact in any arithmetic: the
    kernels quantize in-kernel to the same bits as this reference (a division would not: the
    GPU kernels divide approximately, XLA exactly). Usable inside Pallas kernels."""
    e = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32) >> 23
    se = jnp.clip((e & 0xFF) - 7, 1, 247)                  # biased exponent of s
    s = jax.lax.bitcast_convert_type(se << 23, jnp.float32)
    inv = jax.lax.bitcast_convert_type((254 - se) << 23, jnp.float32)
    return s, inv


def quantize_queries(q: jnp.ndarray, weights: jnp.ndarray):
    """FP8 queries for an fp8 x fp8 score (DeepGEMM ``fp8_mqa_logits`` form).

    Notation: q [B, H, D], weights [B, H]; s[b, h] = ``query_scale``(max_d |q[b, h, d]|), a
    power of two with max |q| / s in [128, 256). Returns (q8 [B, H, D] float8_e4m3fn =
    round(q / s), w8 [B, H] f32 = weights * s). Since s > 0, w * ReLU(q . k) ~= w8 *
    ReLU(q8 . k): the query scale moves into the head weight and the dot runs on FP8 operands.
    q8 carries e4m3's 3 mantissa bits (~3% per value; a power-of-two s changes no rounding
    against amax / 448, only where q8's exponents sit; session 44, before: s = amax / 448).
    The Pallas kernels quantize in-kernel with the same ops (``quantize_rows``).
    q8 comes out of an optimization barrier so that the twin, which widens it back to f32 in
    the same jitted program, keeps the rounding on the GPU too (see
    ``pallas_kernels.pq_topc.reference._to_e4m3``).
    """
    (q8,), w8 = quantize_rows([q.astype(jnp.float32)], weights.astype(jnp.float32))
    return jax.lax.optimization_barrier(q8), w8


def quantize_rows(blocks: list, weights: jnp.ndarray):
    """``quantize_queries`` without the barrier, also inside kernels: blocks, column blocks
    [..., H, D_j] f32 of q (whole rows: [q]; a kernel: its scale blocks, loaded apart), weights
    [..., H] f32 -> (the blocks in e4m3, w8); one scale a row over all blocks."""
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(b), axis=-1) for b in blocks])
    s, inv = query_scale(amax)
    return [(b * inv[..., None]).astype(jnp.float8_e4m3fn) for b in blocks], weights * s


@jax.jit
def index_scores_fp8_xla(q: jnp.ndarray, weights: jnp.ndarray, key_values: jnp.ndarray,
                         key_scales: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
    """XLA twin of the fp8 x fp8 kernel (``triton_fp8``): ``index_scores_xla`` on the FP8
    queries of ``quantize_queries`` (q8 widened exactly to f32, weights w8). Same signature and
    outputs as ``index_scores_xla``; it differs from it only by the rounding of q."""
    q8, w8 = quantize_queries(q, weights)
    return index_scores_xla(q8.astype(jnp.float32), w8, key_values, key_scales, valid)


def index_topk_xla(q, weights, key_values, key_scales, valid, *, k: int, fp8: bool = True):
    """Scores then top-k of each request's candidates (twin of the fused kernel).

    Returns (positions [B, k] int32 candidate indices best-first, -1 padded; values [B, k]
    f32, -inf padded), by ``topk_positions`` over the valid candidates (equal scores: the lower
    candidate index wins). fp8: the scores of ``index_scores_fp8_xla`` (else the exact ones).
    """
    from pallas_kernels.topk.reference import canonical_scores, topk_positions

    score = index_scores_fp8_xla if fp8 else index_scores_xla
    scores = canonical_scores(score(q, weights, key_values, key_scales, valid))
    return topk_positions(scores, valid, k)


def one_pool(pool_values, pool_scales, page_table, page: int):
    """Per-request pools ([B, R, D] values, [B, R, NB] scales: request b's pages are its own)
    as one pool [B R, ...] with each table's pages offset by b R / P (-1 kept); a shared pool
    ([R, ...]) unchanged."""
    if pool_values.ndim == 2:
        return pool_values, pool_scales, page_table
    b, r = pool_values.shape[:2]
    shift = (jnp.arange(b, dtype=jnp.int32) * (r // page))[:, None]
    return (pool_values.reshape((b * r,) + pool_values.shape[2:]),
            pool_scales.reshape((b * r,) + pool_scales.shape[2:]),
            jnp.where(page_table >= 0, page_table + shift, -1))


@functools.partial(jax.jit, static_argnames=("page", "fp8"))
def index_scores_paged_xla(q, weights, pool_values, pool_scales, page_table, tail_values,
                           tail_scales, tail_start, valid, *, page: int,
                           fp8: bool = False) -> jnp.ndarray:
    """XLA twin of ``index_scores_paged``: each request's keys gathered from the pool through
    its page table (``common.paged_rows``) and from its tail, then ``index_scores_xla``
    (``index_scores_fp8_xla`` when fp8) with invalid or unmapped positions masked.

    Inputs: q [B, H, D], weights [B, H], pool_values [R, D] e4m3, pool_scales [R, NB] f32
    (or [B, R, ...]: per-request pools, ``one_pool``), page_table [B, MP] int32 (-1: no
    page), tail_values [B, T, D] e4m3, tail_scales [B, T, NB] f32, tail_start [B] int32
    (positions t .. t + T - 1 are the tail's rows), valid [B, N] bool; page P. Output
    [B, N] f32, -inf where invalid or unmapped.
    """
    n = valid.shape[1]
    pool_values, pool_scales, page_table = one_pool(pool_values, pool_scales, page_table, page)
    ids, mapped = common.paged_rows(page_table, n, page)
    at = jnp.arange(n)[None, :] - tail_start[:, None]             # [B, N] row in the tail
    rows = tail_values.shape[1]
    in_tail = (at >= 0) & (at < rows)
    at = jnp.clip(at, 0, rows - 1)

    def rows(pool, tail):
        tail_rows = jnp.take_along_axis(tail, at.reshape(at.shape + (1,) * (tail.ndim - 2)),
                                        axis=1)
        mask = in_tail.reshape(in_tail.shape + (1,) * (tail.ndim - 2))
        return jnp.where(mask, tail_rows, pool[ids])

    score = index_scores_fp8_xla if fp8 else index_scores_xla
    return score(q, weights, rows(pool_values, tail_values), rows(pool_scales, tail_scales),
                 valid & (mapped | in_tail))
