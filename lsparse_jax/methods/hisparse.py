"""``hisparse``: compressed KV in host pages behind a per-request GPU hot cache of B rows
(HiSparse); indexer keys stay on the device and the selection is exact, so every output equals
``resident``'s bit for bit (identity 3).

GLM-5-style DSA layers are paged the same way (their per-token rows in pages of P * m rows,
the tokens of one page id, so one page table and one writeback serve both kinds), each layer
with its own hot cache; a share group's leader selects and resolves, and its members read their
own rows at the leader's location vector (``CacheConfig.location_reuse``,
``memory.paged_kv.FollowerKVStore``).

Data plane: at admission every complete page of the prefilled prefix goes to the host pool and
the partial page stays on the device as the tail; each decode step resolves the selected rows
(tail, hot cache, or a copy from the host into LRU victims: ``memory.hot_cache.resolve``).
Control plane: a free list of host pages, reserved per request for prompt + max_new_tokens
before anything changes; after a step, the writeback of the pages it completed (the host
mirrors the lengths, so it knows which slots those are without reading the device).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lsparse_jax.config import EngineConfig, Storage, invalid
from lsparse_jax.memory.device_pool import DevicePools
from lsparse_jax.memory.host_pool import CapacityError, PageAllocator, empty_pool
from lsparse_jax.memory.paged_kv import FollowerKVStore, PagedKVStore, PageView
from lsparse_jax.memory.paging import CompletedPages, clear_table_row, page_out
from lsparse_jax.methods.base import Grant, Method, PoolController, register
from lsparse_jax.model.cache import CSACache
from lsparse_jax.model.store import DSAStores, KeyIndex


@struct.dataclass
class HostTier:
    """What hisparse shares across slots."""

    kv_pools: tuple[jax.Array | None, ...]  # per layer [NP * P, D] f32 pinned_host pages of
    #   compressed KV (page p: rows p*P ..), a pytree of [NP * P, ...] arrays for another
    #   ModelConfig.kv_dtype; DSA layers [NP * P * m, D] f32; None for other layers
    page_table: jnp.ndarray  # [S, max_pages] int32 physical page of each logical page, -1 none
    pools: DevicePools | None = None  # the device pools of the exact indexer keys
    #   (CacheConfig.device_pages), None: keys at max_len in each slot


@register
@dataclasses.dataclass(frozen=True)
class HiSparse(Method):
    name: ClassVar[str] = "hisparse"
    storage: ClassVar[Storage] = Storage(kv_on_host=True)

    @classmethod
    def validate(cls, engine: EngineConfig) -> None:
        super().validate(engine)
        if engine.cache.hot_cache_rows is None:
            invalid("EngineConfig", "cache.hot_cache_rows", None,
                    f"method {cls.name!r} needs a hot cache size B >= indexer.top_k")

    @property
    def paged_layers(self) -> tuple[int, ...]:
        """CSA layers and the DSA layers with rows of their own (under
        ``ModelConfig.dsa_shared_kv`` a group's members read their leader's)."""
        cfg = self.engine.model
        own = tuple(i for i in self.dsa_layers if cfg.kv_source(i) == i)
        return tuple(sorted(self.csa_layers + own))

    def kv_store(self) -> PagedKVStore:
        cache = self.engine.cache
        return PagedKVStore(cache.page_size, cache.hot_cache_rows, self.engine.implementation)

    def dsa_stores(self) -> DSAStores:
        """DSA rows paged as CSA rows are (``kv_store`` with pages of P * m rows); members
        follow their leader's location vector (``CacheConfig.location_reuse``) or resolve
        through their own hot cache."""
        kv = dataclasses.replace(self.kv_store(), page_size=self.dsa_page_rows)
        reuse = self.engine.cache.location_reuse
        return DSAStores(kv, self.dsa_key_index(), FollowerKVStore(kv) if reuse else kv, reuse)

    def dsa_key_index(self) -> KeyIndex | None:
        """The DSA leaders' key index: None, every key resident in the slot (exact top-k)."""
        return None

    def _pools(self, dim: int, dtype=jnp.float32, layers=None) -> tuple:
        """A NaN host pool per paged layer (``layers``; None elsewhere) of rows [dim]
        ``dtype``, ``page_rows(layer)`` rows per page."""
        n = self.engine.host_pages
        layers = self.paged_layers if layers is None else layers
        return tuple(empty_pool(n, self.page_rows(i), dim, dtype) if i in layers else None
                     for i in range(self.engine.model.num_layers))

    def _kv_pools(self) -> tuple:
        """A NaN host pool per paged layer (None elsewhere) of KV rows in the layer's format
        (``row_format``: one pool per array of a row)."""
        out = []
        for i in range(self.engine.model.num_layers):
            if i not in self.paged_layers:
                out.append(None)
                continue
            row = self.row_format(i).template()
            out.append(jax.tree.map(lambda leaf, i=i: empty_pool(
                self.engine.host_pages, self.page_rows(i), leaf.shape[-1], leaf.dtype), row))
        return tuple(out)

    def _page_table(self) -> jnp.ndarray:
        shape = (self.engine.cache.num_slots, self.engine.pages_per_slot)
        return jnp.full(shape, -1, jnp.int32)

    def empty_tier(self, codebooks=None) -> HostTier:
        return HostTier(self._kv_pools(), self._page_table(), self.empty_pools())

    def slot_rows(self, tier: HostTier) -> tuple:
        return (tier.page_table,) + super().slot_rows(tier)

    def csa_context(self, tier: HostTier, rows, layer: int):
        return (PageView(tier.kv_pools[layer], rows[0]),
                self.pool_view(tier, "keys", layer, rows[-1]))

    # ------------------------------------------------------------------------------ admission
    def admit_layer(self, layer: int, cache: CSACache, empty: CSACache, tier, grant: Grant,
                    full_pages):
        """Each paged layer's complete prefix pages go to the host pages ``grant.pages``; the
        partial page stays as the tail; the GPU caches start empty (and a CSA layer's exact
        keys go to device pages, with device pools; a DSA leader's stay in the slot)."""
        cache, tier = super().admit_layer(layer, cache, empty, tier, grant, full_pages)
        pools = list(tier.kv_pools)
        pools[layer], tail = page_out(pools[layer], cache.kv.entries, grant.pages, full_pages,
                                      self.page_rows(layer), grant.written)
        return (cache.replace(kv=empty.kv.replace(tail=tail)),
                tier.replace(kv_pools=tuple(pools)))

    def with_tables(self, tier, slot, grant: Grant):
        tier = super().with_tables(tier, slot, grant)
        return tier.replace(page_table=tier.page_table.at[slot].set(grant.pages))

    # ------------------------------------------------------------------------------ writeback
    def host_table(self, tier):
        return tier.page_table

    def write_pages(self, layer: int, cache: CSACache, tier, host: CompletedPages,
                    device: CompletedPages | None):
        cache, tier = super().write_pages(layer, cache, tier, host, device)
        pools = list(tier.kv_pools)
        pools[layer] = host.write_tails(pools[layer], cache.kv.tail)
        cache = cache.replace(kv=cache.kv.replace(tail=host.poison(cache.kv.tail)))
        return cache, tier.replace(kv_pools=tuple(pools))

    def controller(self) -> PagedController:
        return PagedController(self)


def _clear_pages(tier, slot):
    return tier.replace(page_table=clear_table_row(tier.page_table, slot))


class PagedController(PoolController):
    """Host pages per request: reserved at admission (prompt + max_new_tokens), freed at
    release; device pool pages beside them (``PoolController``) with device pools."""

    def __init__(self, method: HiSparse):
        super().__init__(method)
        self.pages = PageAllocator(method.engine.host_pages)
        self.slot_pages: dict[int, list[int]] = {}

    def reserve(self, slot: int, total_tokens: int, prompt_tokens: int, held=()):
        """As ``PoolController``, and host pages: ``held`` (a prefix's) first, then new ones."""
        held = [int(p) for p in held]
        count = self.logical_pages(total_tokens)
        if len(held) > count:
            raise ValueError(f"reserve: {len(held)} held pages exceed the {count} pages a "
                             f"request of {total_tokens} tokens holds")
        grant, before = super().reserve(slot, total_tokens, prompt_tokens)
        try:
            pages = held + self.pages.allocate(count - len(held),
                                               what=f"a request of {total_tokens} tokens")
        except CapacityError:
            if self.device is not None:  # nothing changes: give the device pages back
                self.device.release(slot)
            raise
        self.slot_pages[slot] = pages
        table = np.full(self.method.engine.pages_per_slot, -1, np.int32)
        table[:len(pages)] = pages
        return grant.replace(pages=jnp.asarray(table),
                             written=jnp.asarray(len(held), jnp.int32)), before

    def keep_pages(self, slot: int, count: int) -> list[int]:
        kept, self.slot_pages[slot] = (self.slot_pages[slot][:count],
                                       self.slot_pages[slot][count:])
        return kept

    def free_pages(self, pages) -> None:
        self.pages.release(pages)

    def release(self, slot: int) -> list:
        self.pages.release(self.slot_pages.pop(slot))
        return super().release(slot) + [
            lambda state: state.replace(tier=_clear_pages(state.tier, slot))]


__all__ = ["HiSparse", "HostTier", "PagedController"]
