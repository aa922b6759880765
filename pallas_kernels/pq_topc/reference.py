"""XLA reference of ``pq_topc``: coarse PQ scores (Eq. 6) in f32, then the top-C positions.

Plain and obviously right: it decodes the PQ codes into keys (``decode_codes``), scores them
exactly (``exact_index_scores``: f32, HIGHEST precision) and selects with ``topk_positions``
(higher score first, ties to the lower position, -1 padding). Inputs are assumed validated by
``api.pq_topc``; ``lsparse_jax.quant.pq`` validates and re-exports ``decode``/``coarse_scores``.
"""

from __future__ import annotations

import jax.numpy as jnp

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


def pq_topc_xla(q, weights, codes, codebooks, lengths, *, num_candidates: int):
    """q [B, H, D], weights [B, H], codes [B, N, M] uint8, codebooks [M, K, D/M], lengths [B]
    -> (positions [B, C] int32 best-first, -1 padded; scores [B, C] f32, -inf at padding)."""
    scores = coarse_scores(q, weights, codes, codebooks)  # [B, N]
    eligible = eligible_mask(lengths, codes.shape[1])
    return topk_positions(scores, eligible, num_candidates)
