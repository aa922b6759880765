"""LeanSparse coarse-to-fine selection (Section 5), for one query: the one implementation that
serving (``methods.leansparse``) and the recall study both run.

Step 1, top-C of coarse PQ scores, is the ``pq_topc`` op (its XLA reference is
``quant.coarse_scores`` + ``topk_positions``); steps 2-4 are ``coarse_to_fine``. The caller
supplies how exact keys are scored (serving: FP8 keys resolved through the key cache and the
``index_scores`` op; the study: keys held in memory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lsparse_jax.kernels import for_op
from pallas_kernels.miss_filter.api import miss_filter as miss_filter_op
from pallas_kernels.topk.api import candidate_topk


def miss_filter(scores, valid, cached, top_k: int, offset: float | None,
                implementation: str | None = "xla"):
    """Which coarse candidates to keep.

    Notation: C candidates with coarse scores s (valid ones only count); s_(k) the k-th largest
      (the smallest valid score if fewer than k are valid); sigma the sample standard deviation
      (ddof = 1) of the valid scores.
    Rule: keep every cached candidate; keep an uncached one iff s >= s_(k) - offset * sigma.
      ``offset=None`` disables the filter (every valid candidate is kept).
    scores, valid, cached: [C]; implementation: the engine's (``lsparse_jax.kernels``: what
    the ``miss_filter`` op runs: XLA, or one kernel a request; before session 30 a sort of the
    C scores and XLA reductions). Returns keep [C] bool.
    """
    if offset is None:
        return valid
    return miss_filter_op(scores.astype(jnp.float32)[None], valid[None], cached[None],
                          k=top_k, offset=offset,
                          implementation=for_op("miss_filter", implementation))[0]


def rerank(positions, scores, top_k: int, implementation: str | None = "xla"):
    """Exact top-k among scored candidate positions.

    positions [R] int32 (-1 = none, any order, no duplicates); scores [R] their exact scores.
    Rule (``select_topk``'s, as exact top-k over the whole history): higher canonical score
    first (NaN -> -inf, -0.0 -> +0.0), equal scores to the lower position (given candidates
    of score -inf included, after the finite ones), -1 (value -inf) where fewer than top_k
    positions are given. The ``candidate_topk`` op (``implementation``: the engine's,
    ``lsparse_jax.kernels``): "xla" one two-key sort of the R entries, best first; "triton" a
    radix selection in registers, the winners in the order given (session 29 had the sort,
    session 28 an argsort and a ``lax.top_k``).
    Returns (positions [top_k], -1 padded; their scores).
    """
    best, values = candidate_topk(scores.astype(jnp.float32)[None], positions[None], top_k,
                                  implementation=for_op("candidate_topk", implementation))
    return best[0], values[0]


def coarse_to_fine(candidates, candidate_scores, cached, tail,
                   exact_scores: Callable[[jnp.ndarray], tuple[jnp.ndarray, Any]], *,
                   top_k: int, filter_offset: float | None,
                   implementation: str | None = "xla"):
    """Steps 2-4 of LeanSparse's selection for one query.

    Notation: C candidates (the coarse top-C in any order, -1 padded), T tail positions.
      candidates [C] int32, candidate_scores [C] their coarse scores; cached [C] bool (the
      candidate's exact key is in the GPU key cache); tail [T] int32 recent positions scored
      exactly without a coarse pass (-1 none); exact_scores(retained [C+T] int32, -1 = none)
      -> (scores [C+T] f32, aux): the exact scores of the retained positions;
      implementation: the engine's (``lsparse_jax.kernels``; the ``miss_filter`` and
      ``candidate_topk`` ops of steps 2 and 4).
    Steps: (2) the miss filter drops weak uncached candidates; (3) exact scores of the kept
      candidates and the tail; (4) exact top-k.
    Returns (positions [top_k], stats dict of int32 scalars: candidates, kept, fetched (kept and
      not cached), aux from ``exact_scores``).
    """
    valid = candidates >= 0
    hit = valid & cached
    keep = miss_filter(candidate_scores, valid, hit, top_k, filter_offset, implementation)
    retained = jnp.concatenate([jnp.where(keep, candidates, -1), tail])
    scores, aux = exact_scores(retained)
    selected, _ = rerank(retained, scores, top_k, implementation)
    stats = {"candidates": jnp.sum(valid), "kept": jnp.sum(keep),
             "fetched": jnp.sum(keep & ~hit)}
    return selected, jax.tree.map(lambda x: x.astype(jnp.int32), stats), aux


def recall(selected, exact):
    """|selected & exact| / |exact| over valid (>= 0) entries of the last axis; 1 if exact is
    empty. selected [..., a], exact [..., b] int32 -> [...] f32."""
    match = (selected[..., :, None] == exact[..., None, :]) & (exact[..., None, :] >= 0)
    found = jnp.sum(jnp.any(match, axis=-2), axis=-1)
    total = jnp.sum(exact >= 0, axis=-1)
    return jnp.where(total > 0, found / jnp.maximum(total, 1), 1.0).astype(jnp.float32)
