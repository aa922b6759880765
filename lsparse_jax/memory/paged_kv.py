"""Compressed KV paged to the host behind a per-request GPU hot cache (HiSparse's layout).

A slot's layer keeps on the device only the tail (rows of the page being filled) and a hot
cache of B rows; every completed page is in the shared host pool (``memory.host_pool``).
``PagedKVStore`` implements ``model.store.KVStore`` over them; the per-slot context it reads is
a ``PageView`` (the layer's host pool and the slot's page-table row).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.memory.hot_cache import HotCache, Plan, follow, resolve_plan
from lsparse_jax.model.store import Locations, RowView, write_rows
from lsparse_jax.quant import KVRowFormat


@struct.dataclass
class PagedKV:
    tail: jnp.ndarray  # [P, D] f32 rows of the page being filled (not yet on the host), or
    #   a pytree of [P, ...] arrays (the model's KVRowFormat; hot rows and pools alike)
    hot: HotCache  # B rows copied from the host pool


@struct.dataclass
class PageView:
    """What one slot's layer sees of the shared host pages."""

    pool: jax.Array  # [NP * P, D] pinned_host pages of this layer (page p: rows p*P ..);
    #   a pytree of [NP * P, ...] arrays for rows of several arrays
    page_table: jnp.ndarray  # [max_pages] int32 physical page of each logical page, -1 none


def paged_rows(page_size: int, completed) -> jnp.ndarray:
    """Rows already written back to the host, given ``completed`` rows before this chunk.

    Every completed page is written back at the end of the step that completes it, so the
    tail holds rows paged .. completed-1 (and the rows this chunk adds).
    """
    return (completed // page_size) * page_size


@dataclasses.dataclass(frozen=True)
class PagedKVStore:
    """``KVStore``: tail on the device, pages on the host, hot cache of ``hot_rows`` rows.

    Serves decode (one query per slot); prefill runs on the resident layout and the method
    pages its result out at admission.
    """

    page_size: int
    hot_rows: int
    implementation: str | None = "xla"  # the hot_resolve kernel

    def empty(self, num_rows: int, rows: KVRowFormat) -> PagedKV:
        return PagedKV(rows.empty(self.page_size),
                       HotCache.empty_like(rows.template(), self.hot_rows))

    def write(self, state: PagedKV, completed, ids, rows, ok) -> PagedKV:
        paged = paged_rows(self.page_size, completed)
        return state.replace(tail=write_rows(state.tail, ids - paged, rows, ok))

    def gather(self, state: PagedKV, completed, selected, context: PageView):
        if selected.shape[0] != 1:
            raise ValueError("PagedKVStore serves decode (one query per slot); prefill runs "
                             "on the resident layout")
        rows, hot, counts, plan = resolve_plan(
            state.hot, selected[0], state.tail, paged_rows(self.page_size, completed),
            context.page_table, context.pool, self.implementation, *self.lent(context))
        slots = jnp.where(selected >= 0, jnp.arange(selected.shape[-1]), -1)
        table = jax.tree.map(lambda r: r[None], rows)
        return state.replace(hot=hot), RowView(table, slots, counts[None], plan)

    def gather_band(self, state: PagedKV, completed, selected, band, context: PageView):
        """``gather`` that also loads ``band`` [1, P] (the positions ranked just below the
        selection: echo's prefetch) into the hot cache, in the same resolve: the request is
        [selected; band], so band rows are misses ranked after the selection's (all of them
        take the LRU rows), are stamped as used after them, and the attention reads only the
        selection's rows (lossless).

        Returns (state, RowView of the selection (its sources count the selection alone),
        band rows copied from the host [] int32)."""
        k = selected.shape[-1]
        request = jnp.concatenate([selected, band], axis=-1)
        state, view = self.gather(state, completed, request, context)
        plan = view.plan
        copied = (plan.row_of >= 0) & (plan.fetch[jnp.maximum(plan.row_of, 0)] >= 0)
        first = (plan.in_tail | (plan.opt >= 0))[:k]
        valid = selected[0] >= 0
        host = jnp.sum(copied[:k] & valid)
        sources = jnp.stack([jnp.sum(first & valid), jnp.sum(valid & ~first) - host,
                             host]).astype(jnp.int32)
        plan = plan.replace(selected=plan.selected[:k], in_tail=plan.in_tail[:k],
                            opt=plan.opt[:k], row_of=plan.row_of[:k])
        table = jax.tree.map(lambda r: r[:, :k], view.table)
        view = RowView(table, view.slots[:, :k], sources[None], plan)
        return state, view, jnp.sum(copied[k:] & (band[0] >= 0)).astype(jnp.int32)

    def follow(self, state: PagedKV, completed, locations: Locations, context: PageView):
        """A DSA member layer without location reuse (``CacheConfig.location_reuse`` False):
        resolves the leader's positions through its own hot cache (a second scan; the same
        hits and victims, since it saw the same selections)."""
        new, view = self.gather(state, completed, locations.plan.selected[None], context)
        return new, view.replace(slots=locations.slots)

    def lent(self, context) -> tuple:
        """(optional pages, ready row) read before the hot cache; none here (adaptive: yes)."""
        return ()

    def all_rows(self, state: PagedKV):
        raise ValueError("dense_selection needs the resident KV store; a paged store holds "
                         "only its tail and hot cache on the device")


@struct.dataclass
class FollowerKV:
    """A DSA member layer's rows under location reuse: its tail and hot rows, without hot-cache
    metadata (positions, stamps, clock: its group leader's decide where rows go)."""

    tail: jnp.ndarray  # [P, D] rows of the page being filled (as ``PagedKV.tail``)
    hot: jnp.ndarray  # [B, D] hot rows: row r holds the position the leader's hot row r holds


@dataclasses.dataclass(frozen=True)
class FollowerKVStore:
    """``KVStore`` of a DSA share group's member layers under location reuse: rows paged as
    ``store`` pages them (tail, host pages, lent pages), read with ``follow`` at the leader's
    location vector (``hot_cache.Plan``): the leader's resolve decides the missing positions
    once, and this layer copies its own rows of them from its host pages into the same victim
    rows (fetched once per step). It never resolves, so it keeps no LRU metadata."""

    store: PagedKVStore  # the leader's paged layout, which this layer's rows follow

    def empty(self, num_rows: int, rows: KVRowFormat) -> FollowerKV:
        empty = self.store.empty(num_rows, rows)
        return FollowerKV(empty.tail, empty.hot.rows)  # rows only: no positions, stamps

    def write(self, state: FollowerKV, completed, ids, rows, ok) -> FollowerKV:
        paged = paged_rows(self.store.page_size, completed)
        return state.replace(tail=write_rows(state.tail, ids - paged, rows, ok))

    def follow(self, state: FollowerKV, completed, locations: Locations, context: PageView):
        plan: Plan = locations.plan
        optional = self.store.lent(context)
        got, hot, counts = follow(plan, state.hot, state.tail, context.pool,
                                  self.store.implementation, optional[0] if optional else None)
        table = jax.tree.map(lambda r: r[None], got)
        return state.replace(hot=hot), RowView(table, locations.slots, counts[None])

    def gather(self, state, completed, selected, context):
        raise ValueError("FollowerKVStore serves DSA member layers (follow); a group leader "
                         "resolves its selection with PagedKVStore")

    def all_rows(self, state):
        return self.store.all_rows(state)


__all__ = ["FollowerKV", "FollowerKVStore", "PageView", "PagedKV", "PagedKVStore",
           "paged_rows"]
