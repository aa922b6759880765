"""LeanSparse decode-time indexing over offloaded keys (one query of one slot).

PQ coarse pass over the GPU-resident codes of paged keys (``pallas_kernels.pq_topc``), miss
filter, exact FP8 keys from the key cache / GPU tail / host pool, exact rescoring
(``pallas_kernels.index_scores``) and top-k. ``implementation`` picks each kernel's XLA
reference or its Pallas version.
"""

from __future__ import annotations

import jax.numpy as jnp

from lsparse_jax.config import LeanSparseConfig
from lsparse_jax.indexing.coarse_to_fine import miss_filter, rerank
from lsparse_jax.memory.hot_cache import resolve
from lsparse_jax.memory.key_store import PagedKeys


def leansparse_select(q, weights, keys: PagedKeys, eligible, paged, host, lean: LeanSparseConfig,
                      top_k: int, implementation: str | None = "xla"):
    """Selects top-k positions for one decode query.

    Notation: N history rows, P page rows, C candidates, Bk key-cache rows.
      q [H, D], weights [H]; eligible [N] bool (causal); paged: rows already on the host (the
      tail holds paged .. paged+P-1); host: HostView with key_pool, page_table, codebooks.
    Steps: (1) coarse scores of the paged rows from PQ codes and their top-C; (2) the miss
      filter (a candidate is cached if the key cache holds it); (3) the kept candidates and
      the eligible tail rows go through the key cache (tail, hit, or host copy into LRU
      victims); (4) exact scores of their FP8 keys and top-k.
    Returns (positions [top_k], new keys, key_sources [3] int32 (tail, cache hit, host),
      stats dict of candidate counts).
    """
    from pallas_kernels.index_scores.api import index_scores
    from pallas_kernels.pq_topc.api import pq_topc

    n = keys.codes.shape[0]
    page = keys.tail[0].shape[0]
    cand, cand_scores = pq_topc(q[None], weights[None], keys.codes[None], host.codebooks,
                                jnp.reshape(paged, (1,)).astype(jnp.int32),
                                num_candidates=lean.num_candidates,
                                implementation=implementation)
    cand, cand_scores = cand[0], cand_scores[0]
    held = keys.cache.positions
    cached = jnp.zeros((n,), bool).at[jnp.where(held >= 0, held, n)].set(True, mode="drop")
    valid = cand >= 0
    hit = valid & cached[jnp.maximum(cand, 0)]
    keep = miss_filter(cand_scores, valid, hit, top_k, lean.miss_filter_offset)
    tail = paged + jnp.arange(page)
    tail = jnp.where(eligible[jnp.clip(tail, 0, n - 1)] & (tail < n), tail, -1)
    retained = jnp.concatenate([jnp.where(keep, cand, -1), tail])
    (values, scales), cache, sources = resolve(keys.cache, retained, keys.tail, paged,
                                               host.page_table, host.key_pool, implementation)
    scores = index_scores(q[None], weights[None], values[None], scales[None],
                          (retained >= 0)[None], implementation=implementation)[0]
    selected, _ = rerank(retained, scores, top_k)
    stats = {"candidates": jnp.sum(valid), "kept": jnp.sum(keep),
             "fetched": jnp.sum(keep & ~hit)}
    return selected, keys.replace(cache=cache), sources, stats
