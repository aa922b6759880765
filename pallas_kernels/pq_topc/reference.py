"""XLA reference of ``pq_topc``: coarse PQ scores (Eq. 6) in f32, then the top-C positions.

Plain and obviously right: it decodes the PQ codes into keys (``decode_codes``), scores them
exactly (``exact_index_scores``: f32, HIGHEST precision) and selects with ``topk_positions``
(higher score first, ties to the lower position, -1 padding). Inputs are assumed validated by
``api.pq_topc``; ``lsparse_jax.quant.pq`` validates and re-exports ``decode``/``coarse_scores``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.index_scores.reference import exact_index_scores
from pallas_kernels.topk.reference import topk_positions


def decode_codes(codes, codebooks) -> jnp.ndarray:
    """Keys [..., N, D] f32 from PQ codes [..., N, M] uint8 and codebooks [M, K, d]:
    concat_j C_j[c_ij]. A code outside [0, K) decodes to NaN, not a clamped centroid."""
    codebooks = jnp.asarray(codebooks, jnp.float32)
    m, k, dsub = codebooks.shape
    ids = jnp.asarray(codes).astype(jnp.int32)
    ids = jnp.where(ids < 0, k, ids)  # negative ids would wrap around; send them out of range
    parts = codebooks.at[jnp.arange(m), ids].get(mode="fill", fill_value=jnp.nan)
    return parts.reshape(*codes.shape[:-1], m * dsub)


def coarse_scores(q, weights, codes, codebooks) -> jnp.ndarray:
    """Eq. 6: s_i = sum_h w_h ReLU(sum_j q_{h,j} . C_j[c_ij]) for q [..., H, D], weights
    [..., H], codes [..., N, M], codebooks [M, K, D/M] -> [..., N] f32."""
    return exact_index_scores(q, weights, decode_codes(codes, codebooks))


def eligible_mask(lengths: jnp.ndarray, n: int) -> jnp.ndarray:
    """[B, N] bool: position n of request b is eligible iff n < lengths[b]."""
    return jnp.arange(n, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]


def masked_coarse_scores(q, weights, codes, codebooks, lengths) -> jnp.ndarray:
    """Coarse scores [B, N] f32 of every position; -inf at positions >= lengths[b].

    Codes past a row's length may be garbage (even >= K, which decodes to NaN); they are masked.
    """
    scores = coarse_scores(q, weights, codes, codebooks)  # [B, N]
    return jnp.where(eligible_mask(lengths, codes.shape[1]), scores, -jnp.inf)


E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
PRECISIONS = ("bf16", "fp8")


def _to_e4m3(x, scale):
    """e4m3(x / scale), |x / scale| clipped to 448 (guards the division's last-bit rounding:
    nothing saturates to NaN). Behind an optimization barrier, so no compiler pass can fold
    the convert to e4m3 and back to f32 into nothing. Why (session 27, H200): jitted there, the
    "xla" fp8 twin's scores lay up to 2.2% of max |score| from these values computed eagerly
    (the fp8 kernels: within 1.5e-4), about e4m3's rounding; the suspected cause is XLA's
    allow_excess_precision (on by default) eliding the round trip inside a fusion. The CPU
    keeps the rounding either way; the barrier's effect on the GPU is not yet measured."""
    return lax.optimization_barrier(
        jnp.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn))


def quantize_fp8(q, weights, codebooks):
    """The fp8 kernels' quantization: (q8 [B, H, D] e4m3, w8 [B, H] f32, books8 [M, K, d] e4m3).

    Notation: B requests, H heads, D = M * d, M subspaces of d dims, K centroids; C_j the
    codebook of subspace j, q[h, j] the j-th d-slice of head h's query.
    Scale rule (every scale > 0; an all-zero block gets scale 1):
      sc[j]    = max_{k, i} |C_j[k, i]| / 448                 per subspace
      books8_j = e4m3(C_j / sc[j])                            |values| <= 448
      q'[h, j] = q[h, j] * sc[j]                              the codebook scale folded into q
      sq[h]    = max_D |q'[h]| / 448                          per (request, head)
      q8[h]    = e4m3(q'[h] / sq[h]),   w8[h] = w[h] * sq[h]
    so q[h, j] . C_j[c] ~= sq[h] * (q8[h, j] . books8_j[c]) and, since sq[h] > 0,
      s[n] = sum_h w8[h] * ReLU( sum_j q8[h, j] . books8_j[codes[n, j]] ).
    e4m3 rounds to nearest even with 3 mantissa bits (relative error <= 2^-4, subnormal
    spacing 2^-9 of the scaled unit); products of two e4m3 values are exact in f32.
    """
    books = jnp.asarray(codebooks, jnp.float32)
    m, _, ds = books.shape
    amax = jnp.max(jnp.abs(books), axis=(1, 2))  # [M]
    sc = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    books8 = _to_e4m3(books, sc[:, None, None])
    b, h, _ = q.shape
    qs = q.astype(jnp.float32).reshape(b, h, m, ds) * sc[None, None, :, None]
    qs = qs.reshape(b, h, m * ds)
    qmax = jnp.max(jnp.abs(qs), axis=2)  # [B, H]
    sq = jnp.where(qmax > 0, qmax / E4M3_MAX, 1.0)
    q8 = _to_e4m3(qs, sq[:, :, None])
    return q8, weights.astype(jnp.float32) * sq, books8


def coarse_scores_fp8(q, weights, codes, codebooks) -> jnp.ndarray:
    """Eq. 6 of the fp8-quantized q and codebooks (``quantize_fp8``), exact f32 accumulation:
    [..., N] f32 (the reference of the fp8 kernels)."""
    q8, w8, books8 = quantize_fp8(q, weights, codebooks)
    return coarse_scores(q8.astype(jnp.float32), w8, codes, books8.astype(jnp.float32))


def masked_coarse_scores_fp8(q, weights, codes, codebooks, lengths) -> jnp.ndarray:
    """``masked_coarse_scores`` of the fp8-quantized inputs: [B, N] f32, -inf past lengths."""
    scores = coarse_scores_fp8(q, weights, codes, codebooks)
    return jnp.where(eligible_mask(lengths, codes.shape[1]), scores, -jnp.inf)


def pq_topc_xla(q, weights, codes, codebooks, lengths, *, num_candidates: int,
                precision: str = "bf16"):
    """q [B, H, D], weights [B, H], codes [B, N, M] uint8, codebooks [M, K, D/M], lengths [B]
    -> (positions [B, C] int32 best-first, -1 padded; scores [B, C] f32, -inf at padding).
    precision "bf16": exact f32 scores of the given values (the bf16 kernels' reference);
    "fp8": exact f32 scores of the ``quantize_fp8`` values (the fp8 kernels' twin)."""
    score_fn = coarse_scores_fp8 if precision == "fp8" else coarse_scores
    scores = score_fn(q, weights, codes, codebooks)  # [B, N]
    eligible = eligible_mask(lengths, codes.shape[1])
    return topk_positions(scores, eligible, num_candidates)
