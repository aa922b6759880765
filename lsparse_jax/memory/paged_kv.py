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

from lsparse_jax.memory.hot_cache import HotCache, resolve
from lsparse_jax.model.store import RowView, write_rows
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
        rows, hot, counts = resolve(state.hot, selected[0], state.tail,
                                    paged_rows(self.page_size, completed), context.page_table,
                                    context.pool, self.implementation, *self.lent(context))
        slots = jnp.where(selected >= 0, jnp.arange(selected.shape[-1]), -1)
        table = jax.tree.map(lambda r: r[None], rows)
        return state.replace(hot=hot), RowView(table, slots, counts[None])

    def lent(self, context) -> tuple:
        """(optional pages, ready row) read before the hot cache; none here (adaptive: yes)."""
        return ()

    def all_rows(self, state: PagedKV):
        raise ValueError("dense_selection needs the resident KV store; a paged store holds "
                         "only its tail and hot cache on the device")


__all__ = ["PageView", "PagedKV", "PagedKVStore", "paged_rows"]
