"""``hisparse``: compressed KV in host pages behind a per-request GPU hot cache of B rows
(HiSparse); indexer keys stay on the device and the selection is exact, so every output equals
``resident``'s bit for bit (identity 3).

Data plane: at admission every complete page of the prefilled prefix goes to the host pool and
the partial page stays on the device as the tail; each decode step resolves the selected rows
(tail, hot cache, or a copy from the host into LRU victims: ``memory.hot_cache.resolve``).
Control plane: a free list of host pages, reserved per request for prompt + max_new_tokens
before anything changes; after a step, the writeback of the pages it completed (the host
mirrors the lengths, so it knows which slots those are without reading the device).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lsparse_jax.config import EngineConfig, Storage, invalid
from lsparse_jax.memory.host_pool import PageAllocator, empty_pool
from lsparse_jax.memory.paged_kv import PagedKVStore, PageView
from lsparse_jax.memory.paging import CompletedPages, page_out
from lsparse_jax.methods.base import Controller, Grant, Method, insert, register
from lsparse_jax.model.cache import CSACache
from lsparse_jax.quant import KVRowFormat


@struct.dataclass
class HostTier:
    """What hisparse shares across slots."""

    kv_pools: tuple[jax.Array | None, ...]  # per layer [NP * P, D] f32 pinned_host pages of
    #   compressed KV (page p: rows p*P ..), a pytree of [NP * P, ...] arrays for another
    #   ModelConfig.kv_dtype; None for layers that are not CSA
    page_table: jnp.ndarray  # [S, max_pages] int32 physical page of each logical page, -1 none


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
    def csa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.engine.model.layer_pattern) if k == "csa")

    def kv_store(self) -> PagedKVStore:
        cache = self.engine.cache
        return PagedKVStore(cache.page_size, cache.hot_cache_rows, self.engine.implementation)

    def _pools(self, dim: int, dtype=jnp.float32) -> tuple:
        """A NaN host pool per CSA layer (None elsewhere) of rows [dim] ``dtype``."""
        n, size = self.engine.host_pages, self.engine.cache.page_size
        return tuple(empty_pool(n, size, dim, dtype) if i in self.csa_layers else None
                     for i in range(self.engine.model.num_layers))

    def _kv_pools(self) -> tuple:
        """A NaN host pool per CSA layer (None elsewhere) of KV rows in the model's format
        (``quant.KVRowFormat``: one pool per array of a row)."""
        row = KVRowFormat.of(self.engine.model).template()
        leaves, treedef = jax.tree.flatten(row)
        per_leaf = [self._pools(leaf.shape[-1], leaf.dtype) for leaf in leaves]
        return tuple(None if pools[0] is None else jax.tree.unflatten(treedef, pools)
                     for pools in zip(*per_leaf))

    def _page_table(self) -> jnp.ndarray:
        shape = (self.engine.cache.num_slots, self.engine.pages_per_slot)
        return jnp.full(shape, -1, jnp.int32)

    def empty_tier(self, codebooks=None) -> HostTier:
        return HostTier(self._kv_pools(), self._page_table())

    def slot_rows(self, tier: HostTier):
        return tier.page_table

    def contexts(self, tier: HostTier, rows) -> tuple:
        return tuple(None if pool is None else (PageView(pool, rows), None)
                     for pool in tier.kv_pools)

    # ------------------------------------------------------------------------------ admission
    def admit(self, state, slot, caches, length, grant: Grant):
        """Each CSA layer's complete prefix pages go to the host pages ``grant.pages``; the
        partial page stays as the tail; the GPU caches start empty."""
        full_pages = (length // self.engine.model.csa_ratio) // self.engine.cache.page_size
        tier, out, empty = state.tier, list(caches), self.empty_slot()
        for i in self.csa_layers:
            out[i], tier = self.admit_layer(i, caches[i], empty[i], tier, grant, full_pages)
        tier = tier.replace(page_table=tier.page_table.at[slot].set(grant.pages))
        return insert(state.replace(tier=tier), slot, tuple(out), length)

    def admit_layer(self, layer: int, cache: CSACache, empty: CSACache, tier, grant: Grant,
                    full_pages):
        """One CSA layer's admission: (its slot cache, the tier)."""
        pools = list(tier.kv_pools)
        pools[layer], tail = page_out(pools[layer], cache.kv.entries, grant.pages, full_pages,
                                      self.engine.cache.page_size)
        return (cache.replace(kv=empty.kv.replace(tail=tail)),
                tier.replace(kv_pools=tuple(pools)))

    # ------------------------------------------------------------------------------ writeback
    def write_completed(self, state, slots):
        """Writes the tail page that the last decode step completed in each of ``slots`` ([c]
        int32, from ``CompletedPages.completing``) to the slot's host page."""
        done = CompletedPages.of(state.tier.page_table, state.lengths, slots,
                                 self.engine.model.csa_ratio, self.engine.cache.page_size)
        tier, caches = state.tier, list(state.caches)
        for i in self.csa_layers:
            caches[i], tier = self.write_pages(i, caches[i], tier, done)
        return state.replace(caches=tuple(caches), tier=tier)

    def write_pages(self, layer: int, cache: CSACache, tier, done: CompletedPages):
        pools = list(tier.kv_pools)
        pools[layer] = done.write_tails(pools[layer], cache.kv.tail)
        cache = cache.replace(kv=cache.kv.replace(tail=done.poison(cache.kv.tail)))
        return cache, tier.replace(kv_pools=tuple(pools))

    def controller(self) -> PagedController:
        return PagedController(self)


@jax.jit
def _clear_pages(tier, slot):
    return tier.replace(page_table=tier.page_table.at[slot].set(-1))


@functools.partial(jax.jit, static_argnames=("method",), donate_argnames=("state",))
def write_completed(method: HiSparse, state, slots):
    """``method.write_completed`` under jit (one compilation per length of ``slots``: the
    controller pads it to a power of two, so there are at most log2(S) + 1)."""
    return method.write_completed(state, slots)


class PagedController(Controller):
    """Host pages per request: reserved at admission (prompt + max_new_tokens), freed at
    release."""

    def __init__(self, method: HiSparse):
        self.method = method
        self.pages = PageAllocator(method.engine.host_pages)
        self.slot_pages: dict[int, list[int]] = {}

    def reserve(self, slot: int, total_tokens: int, prompt_tokens: int):
        engine = self.method.engine
        rows = total_tokens // engine.model.csa_ratio
        pages = self.pages.allocate(-(-rows // engine.cache.page_size),
                                    what=f"a request of {total_tokens} tokens")
        self.slot_pages[slot] = pages
        table = np.full(engine.pages_per_slot, -1, np.int32)
        table[:len(pages)] = pages
        return Grant(pages=jnp.asarray(table)), []

    def release(self, slot: int) -> list:
        self.pages.release(self.slot_pages.pop(slot))
        return [lambda state: state.replace(tier=_clear_pages(state.tier, slot))]

    def after_step(self, lengths_before: np.ndarray, active: np.ndarray) -> list:
        """The page writeback of the slots whose step completed a tail page."""
        engine = self.method.engine
        slots = CompletedPages.completing(lengths_before, active, engine.model.csa_ratio,
                                          engine.cache.page_size)
        if slots.size == 0:
            return []
        # pad to a power of two by repeating the last slot (writing a page twice is the same
        # as once), so that the writeback compiles for log2(S) + 1 lengths, at warmup
        width = 1 << (slots.size - 1).bit_length()
        slots = np.concatenate([slots, np.repeat(slots[-1:], width - slots.size)])
        return [functools.partial(write_completed, self.method, slots=jnp.asarray(slots))]

    def warmup(self, state):
        """Compiles the writeback for every padded length (ahead of time: nothing runs)."""
        for bits in range((state.lengths.shape[0] - 1).bit_length() + 1):
            write_completed.lower(self.method, state,
                                  slots=jnp.zeros((1 << bits,), jnp.int32)).compile()
        return state


__all__ = ["HiSparse", "HostTier", "PagedController"]
