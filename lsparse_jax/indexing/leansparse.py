"""LeanSparse decode-time indexing over offloaded keys (one query of one slot).

PQ coarse pass over the GPU-resident codes of paged keys, miss filter, exact FP8 keys from the
key cache / GPU tail / host pool, exact rerank to top-k.
"""

from __future__ import annotations

import jax.numpy as jnp

from lsparse_jax.config import LeanSparseConfig
from lsparse_jax.indexing.coarse_to_fine import rerank, select_candidates
from lsparse_jax.memory.hot_cache import resolve
from lsparse_jax.memory.key_store import PagedKeys
from lsparse_jax.quant import dequantize_index_keys
from lsparse_jax.quant.pq import coarse_scores


def leansparse_select(q, weights, keys: PagedKeys, eligible, paged, host, lean: LeanSparseConfig,
                      top_k: int):
    """Selects top-k positions for one decode query.

    Notation: N history rows, P page rows, C candidates, Bk key-cache rows.
      q [H, D], weights [H]; eligible [N] bool (causal); paged: rows already on the host (the
      tail holds paged .. paged+P-1); host: HostView with key_pool, page_table, codebooks.
    Steps: (1) coarse scores of paged rows from PQ codes; (2) top-C and the miss filter
      (a candidate is cached if the key cache holds it); (3) the kept candidates and the
      eligible tail rows go through the key cache (tail, hit, or host copy into LRU victims);
      (4) exact scores of their dequantized FP8 keys and top-k.
    Returns (positions [top_k], new keys, key_sources [3] int32 (tail, cache hit, host),
      stats dict of candidate counts).
    """
    n = keys.codes.shape[0]
    page = keys.tail[0].shape[0]
    rows = jnp.arange(n)
    coarse = coarse_scores(q, weights, keys.codes, host.codebooks)
    held = keys.cache.positions
    cached = jnp.zeros((n,), bool).at[jnp.where(held >= 0, held, n)].set(True, mode="drop")
    kept, stats = select_candidates(coarse, eligible & (rows < paged), cached,
                                    num_candidates=lean.num_candidates, top_k=top_k,
                                    filter_offset=lean.miss_filter_offset)
    tail = paged + jnp.arange(page)
    tail = jnp.where(eligible[jnp.clip(tail, 0, n - 1)] & (tail < n), tail, -1)
    retained = jnp.concatenate([kept, tail])
    (values, scales), cache, sources = resolve(keys.cache, retained, keys.tail, paged,
                                               host.page_table, host.key_pool)
    exact = dequantize_index_keys(values, scales)
    selected, _ = rerank(q, weights, retained, exact, top_k)
    return selected, keys.replace(cache=cache), sources, stats
