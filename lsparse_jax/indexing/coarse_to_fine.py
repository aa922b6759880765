"""LeanSparse coarse-to-fine selection (Section 5): PQ coarse top-C, miss filter, exact rerank.

These are the XLA reference functions for one query; ``jax.vmap`` them over queries/slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lsparse_jax.indexing.scores import index_scores
from lsparse_jax.indexing.topk import topk_positions


def miss_filter(scores, valid, cached, top_k: int, offset: float | None):
    """Which coarse candidates to keep.

    Notation: C candidates with coarse scores s (valid ones only count); s_(k) the k-th largest
      (the smallest valid score if fewer than k are valid); sigma the sample standard deviation
      (ddof = 1) of the valid scores.
    Rule: keep every cached candidate; keep an uncached one iff s >= s_(k) - offset * sigma.
      ``offset=None`` disables the filter (every valid candidate is kept).
    scores, valid, cached: [C]. Returns keep [C] bool.
    """
    if offset is None:
        return valid
    n = jnp.sum(valid)
    ordered = jnp.sort(jnp.where(valid, scores, -jnp.inf))[::-1]
    kth = ordered[jnp.clip(jnp.minimum(top_k, n) - 1, 0, scores.shape[0] - 1)]
    mean = jnp.sum(jnp.where(valid, scores, 0.0)) / jnp.maximum(n, 1)
    var = jnp.sum(jnp.where(valid, (scores - mean) ** 2, 0.0)) / jnp.maximum(n - 1, 1)
    threshold = kth - offset * jnp.sqrt(var)
    return valid & (cached | (scores >= threshold))


def rerank(positions, scores, top_k: int):
    """Exact top-k among scored candidate positions.

    positions [R] int32 (-1 = none, any order, no duplicates); scores [R] their exact scores.
    Candidates are put in position order first so that equal scores go to the lower position,
    as in exact top-k over the whole history.
    Returns (positions [top_k] best first, -1 padded; their scores).
    """
    big = jnp.iinfo(jnp.int32).max
    order = jnp.argsort(jnp.where(positions >= 0, positions, big), stable=True)
    positions, scores = positions[order], scores[order]
    picked, values = topk_positions(scores, positions >= 0, top_k)
    return jnp.where(picked >= 0, positions[jnp.maximum(picked, 0)], -1), values


def select_candidates(coarse, eligible, cached, *, num_candidates: int, top_k: int,
                      filter_offset: float | None):
    """Steps 1-2 of coarse-to-fine: top-C by coarse score over eligible, then the miss filter.

    coarse [N], eligible [N], cached [N] bool. Returns (retained [C] int32 positions with -1 for
    dropped or missing candidates, stats dict of int32: candidates, kept, fetched (kept and
    not cached)).
    """
    cand, cand_scores = topk_positions(coarse, eligible, num_candidates)
    valid = cand >= 0
    hit = valid & cached[jnp.maximum(cand, 0)]
    keep = miss_filter(cand_scores, valid, hit, top_k, filter_offset)
    stats = {"candidates": jnp.sum(valid), "kept": jnp.sum(keep),
             "fetched": jnp.sum(keep & ~hit)}
    return jnp.where(keep, cand, -1), jax.tree.map(lambda x: x.astype(jnp.int32), stats)


def coarse_to_fine(q, weights, coarse, eligible, cached, exact_keys, tail_positions, *,
                   num_candidates: int, top_k: int, filter_offset: float | None):
    """LeanSparse selection for one query over a history of N positions.

    Notation: H heads, D dim, N history positions, C = num_candidates, T tail positions.
      q [H, D], weights [H]; coarse [N] approximate (PQ) scores; eligible [N] bool (paged and
      causally eligible: the coarse pass covers these); cached [N] bool (exact key in the GPU
      key cache); exact_keys [N, D] the exact keys (only retained rows are read);
      tail_positions [T] int32 recent positions scored exactly without a coarse pass (-1 none).
    Steps: (1) top-C of coarse scores over eligible; (2) miss filter; (3) exact scores of the
      kept candidates and the tail; (4) exact top-k.
    Returns (positions [top_k], stats dict of int32 scalars: candidates, kept, fetched).
    """
    kept, stats = select_candidates(coarse, eligible, cached, num_candidates=num_candidates,
                                    top_k=top_k, filter_offset=filter_offset)
    retained = jnp.concatenate([kept, tail_positions])
    scores = index_scores(q, weights, exact_keys[jnp.maximum(retained, 0)])
    selected, _ = rerank(retained, scores, top_k)
    return selected, stats


def direct_topk(coarse, eligible, top_k: int):
    """The direct-PQ baseline: top-k straight from coarse scores."""
    return topk_positions(coarse, eligible, top_k)[0]


def recall(selected, exact):
    """|selected & exact| / |exact| over valid (>= 0) entries of the last axis; 1 if exact is
    empty. selected [..., a], exact [..., b] int32 -> [...] f32."""
    match = (selected[..., :, None] == exact[..., None, :]) & (exact[..., None, :] >= 0)
    found = jnp.sum(jnp.any(match, axis=-2), axis=-1)
    total = jnp.sum(exact >= 0, axis=-1)
    return jnp.where(total > 0, found / jnp.maximum(total, 1), 1.0).astype(jnp.float32)
