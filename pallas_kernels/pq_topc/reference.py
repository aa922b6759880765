"""XLA reference of ``pq_topc``: coarse PQ scores (Eq. 6) in f32, then the top-C positions.

Plain and obviously right: it decodes the PQ codes into keys with
``lsparse_jax.quant.pq.coarse_scores`` (f32, HIGHEST precision) and selects with
``lsparse_jax.indexing.topk_positions`` (higher score first, ties to the lower position, -1
padding). Inputs are assumed validated by ``api.pq_topc``.
"""

from __future__ import annotations

import jax.numpy as jnp

from lsparse_jax.indexing.topk import topk_positions
from lsparse_jax.quant.pq import coarse_scores


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
