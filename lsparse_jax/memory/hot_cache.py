"""The per-request, per-layer GPU hot cache (HiSparse) and its resolver.

The resolver finds each selected compressed row, in order: (1) the tail of rows not yet paged,
(2) the hot cache, by a scan bounded by its B rows, (3) a copy from the host pool into the
least-recently-used rows not hit this step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.memory.host_pool import read_host_rows

NUM_SOURCES = 3  # resolved from: 0 tail / resident map, 1 hot-cache hit, 2 host copy


@struct.dataclass
class HotCache:
    rows: Any  # [B, ...] array (or pytree of them) of cached rows; NaN where empty
    positions: jnp.ndarray  # [B] int32 compressed position held by each row, -1 = empty
    stamps: jnp.ndarray  # [B] int32 last use (clock * k + rank in that step's selection), -1 empty
    clock: jnp.ndarray  # [] int32 decode steps this cache has served

    @classmethod
    def empty(cls, rows: int, dim: int, dtype=jnp.float32) -> HotCache:
        return cls.empty_like(jnp.zeros((dim,), dtype), rows)

    @classmethod
    def empty_like(cls, row, rows: int) -> HotCache:
        """B NaN rows shaped like ``row`` (an array or pytree of per-row arrays)."""
        return cls(rows=jax.tree.map(lambda r: jnp.full((rows,) + r.shape, jnp.nan, r.dtype), row),
                   positions=jnp.full((rows,), -1, jnp.int32),
                   stamps=jnp.full((rows,), -1, jnp.int32), clock=jnp.zeros((), jnp.int32))


def resolve(hot: HotCache, selected, tail, paged, page_table, pool,
            implementation: str | None = "xla"):
    """Makes every selected row readable on the device and returns the rows in order.

    Notation: k selected positions (best first, -1 padded); B hot rows; P rows per page.
      selected [k] int32; tail [P, D] rows of positions paged .. paged+P-1 (not yet on host);
      page_table [max_pages] int32 physical host page of each logical page; pool [NP * P, D]
      (row r of physical page p at p * P + r); implementation: the host-row copy kernel.
      Rows may be pytrees (e.g. FP8 keys and their scales): tail, pool and hot.rows alike.
    Steps:
      1. tail hits: selected >= paged.
      2. hot hits: a [k, B] compare of the other positions with hot.positions.
      3. misses take the LRU rows among those not hit this step (empty rows first), the j-th
         miss the j-th victim; their rows are copied from the host pool.
      4. every touched row gets stamp clock * k + rank, so the LRU order is the order of use.
    Returns (rows [k, D] with NaN where selected is -1, new hot cache, counts [3] int32 of
    rows resolved from tail, hot cache and host).
    """
    k, b = selected.shape[0], hot.positions.shape[0]
    page = jax.tree.leaves(tail)[0].shape[0]
    valid = selected >= 0
    in_tail = valid & (selected >= paged)
    want = valid & ~in_tail
    match = (hot.positions[None, :] == selected[:, None]) & want[:, None]  # bounded scan
    hit = jnp.any(match, axis=1)
    hit_row = jnp.argmax(match, axis=1)
    miss = want & ~hit
    lru_key = jnp.where(jnp.any(match, axis=0), jnp.iinfo(jnp.int32).max, hot.stamps)
    victims = jnp.argsort(lru_key, stable=True)
    victim = victims[jnp.clip(jnp.cumsum(miss) - 1, 0, b - 1)]
    row_of = jnp.where(hit, hit_row, jnp.where(miss, victim, -1))

    host_row = page_table[jnp.where(miss, selected // page, 0)] * page + selected % page
    host_row = jnp.where(miss, host_row, -1)
    fetched = jax.tree.map(lambda p: read_host_rows(p, host_row, implementation), pool)
    dest = jnp.where(miss, victim, b)  # b = out of bounds = dropped
    rows = jax.tree.map(lambda r, f: r.at[dest].set(f, mode="drop"), hot.rows, fetched)
    positions = hot.positions.at[dest].set(selected, mode="drop")
    touched = jnp.where(row_of >= 0, row_of, b)
    stamps = hot.stamps.at[touched].set(hot.clock * k + jnp.arange(k, dtype=jnp.int32),
                                        mode="drop")
    hot = HotCache(rows=rows, positions=positions, stamps=stamps, clock=hot.clock + 1)

    def pick(t, r):
        mask = lambda m: m.reshape(m.shape + (1,) * (t.ndim - 1))  # noqa: E731
        got = jnp.where(mask(in_tail), t[jnp.clip(selected - paged, 0, page - 1)],
                        r[jnp.clip(row_of, 0, b - 1)])
        return jnp.where(mask(valid), got, jnp.nan)

    out = jax.tree.map(pick, tail, rows)
    counts = jnp.stack([jnp.sum(in_tail), jnp.sum(hit), jnp.sum(miss)]).astype(jnp.int32)
    return out, hot, counts
