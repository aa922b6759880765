"""The decode state pytree: every cache of every slot, the host tier, lengths, sampling key."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.config import EngineConfig
from lsparse_jax.memory.host_pool import empty_pool, write_host_page
from lsparse_jax.memory.hot_cache import HotCache
from lsparse_jax.memory.kv_store import PagedKV
from lsparse_jax.model.cache import CSACache, LayerCache, empty_cache


@struct.dataclass
class HostTier:
    """Host-resident KV of the paged methods (one page table serves every CSA layer)."""

    pools: tuple[jax.Array | None, ...]  # per layer: [NP, P, D] pinned_host pages (CSA) or None
    page_table: jnp.ndarray  # [S, max_pages] int32 physical page of each logical page, -1 none


@struct.dataclass
class DecodeState:
    caches: tuple[LayerCache, ...]  # per layer; every array has a leading slot axis [S, ...]
    lengths: jnp.ndarray  # [S] int32 tokens each slot holds (prompt + generated)
    rng: jnp.ndarray  # PRNG key for temperature sampling
    host: HostTier | None  # None for methods that keep all KV on the device

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]


def _paged(cache: LayerCache, engine: EngineConfig) -> LayerCache:
    """A CSA cache with its resident KV table replaced by an empty tail and hot cache."""
    if not isinstance(cache, CSACache):
        return cache
    page, dim = engine.cache.page_size, engine.model.head_dim
    tail = jnp.full((page, dim), jnp.nan, jnp.float32)
    return cache.replace(kv=PagedKV(tail, HotCache.empty(engine.cache.hot_cache_rows, dim)))


def empty_slot(engine: EngineConfig) -> tuple[LayerCache, ...]:
    """One slot's decode-time caches (no slot axis)."""
    caches = empty_cache(engine.model)
    return tuple(_paged(c, engine) for c in caches) if engine.paged else caches


def empty_state(engine: EngineConfig) -> DecodeState:
    slots = engine.cache.num_slots
    caches = jax.tree.map(lambda a: jnp.broadcast_to(a, (slots,) + a.shape), empty_slot(engine))
    host = None
    if engine.paged:
        pools = tuple(empty_pool(engine.host_pages, engine.cache.page_size,
                                 engine.model.head_dim) if k == "csa" else None
                      for k in engine.model.layer_pattern)
        host = HostTier(pools, jnp.full((slots, engine.pages_per_slot), -1, jnp.int32))
    state = DecodeState(caches=caches, lengths=jnp.zeros((slots,), jnp.int32),
                        rng=jax.random.key(engine.sampling.seed), host=host)
    # Commit every array to its memory now: jitted steps return committed arrays, and a jit
    # called with uncommitted inputs first would compile a second time.
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding), state)


def slot_bytes(state: DecodeState) -> int:
    """Device bytes of one slot's caches and page-table row in this state."""
    per_slot = list(jax.tree.leaves(state.caches))
    if state.host is not None:
        per_slot.append(state.host.page_table)
    return sum(a.nbytes // state.num_slots for a in per_slot)


def insert(state: DecodeState, slot, caches: tuple[LayerCache, ...], length) -> DecodeState:
    """Puts one request's caches (no slot axis) into ``slot``."""
    new = jax.tree.map(lambda big, one: big.at[slot].set(one), state.caches, caches)
    return state.replace(caches=new, lengths=state.lengths.at[slot].set(length))


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("state",))
def admit_paged(engine: EngineConfig, state: DecodeState, slot, caches, length, pages):
    """Admits a prefilled request (resident caches, no slot axis) into a paged slot.

    Writes every complete page of each CSA layer's rows to the host pool (the prefix
    writeback at admission), keeps the partial page as the tail, starts an empty hot cache.
    pages [max_pages] int32: the slot's physical host pages, -1 past its reservation.
    """
    page, m = engine.cache.page_size, engine.model.csa_ratio
    completed = length // m
    full_pages = completed // page
    pools, paged = list(state.host.pools), []
    for i, cache in enumerate(caches):
        if not isinstance(cache, CSACache):
            paged.append(cache)
            continue
        entries = jnp.pad(cache.kv.entries, ((0, page), (0, 0)), constant_values=jnp.nan)

        def body(j, pool, entries=entries):
            rows = jax.lax.dynamic_slice_in_dim(entries, j * page, page)
            return write_host_page(pool, pages[j], rows)

        pools[i] = jax.lax.fori_loop(0, full_pages, body, pools[i])
        tail = jax.lax.dynamic_slice_in_dim(entries, full_pages * page, page)
        hot = HotCache.empty(engine.cache.hot_cache_rows, engine.model.head_dim)
        paged.append(cache.replace(kv=PagedKV(tail, hot)))
    host = HostTier(tuple(pools), state.host.page_table.at[slot].set(pages))
    return insert(state.replace(host=host), slot, tuple(paged), length)


def writeback(engine: EngineConfig, state: DecodeState, lengths_before, active) -> DecodeState:
    """Writes each tail page that this decode step completed to the host pool.

    A slot at position t wrote compressed row t // m if t % m == m - 1; when that row ends a
    page, the tail goes to the slot's physical page and is poisoned (NaN) for reuse.
    """
    page, m = engine.cache.page_size, engine.model.csa_ratio
    row = lengths_before // m
    full = active & (lengths_before % m == m - 1) & ((row + 1) % page == 0)
    dest = jnp.take_along_axis(state.host.page_table, (row // page)[:, None], axis=1)[:, 0]
    order = jnp.argsort(~full, stable=True)  # slots with a full page first
    count = jnp.sum(full)
    pools, caches = list(state.host.pools), list(state.caches)
    for i, cache in enumerate(caches):
        if not isinstance(cache, CSACache):
            continue

        def body(j, pool, tails=cache.kv.tail):
            s = order[j]
            return write_host_page(pool, dest[s], tails[s])

        pools[i] = jax.lax.fori_loop(0, count, body, pools[i])
        tail = jnp.where(full[:, None, None], jnp.nan, cache.kv.tail)
        caches[i] = cache.replace(kv=cache.kv.replace(tail=tail))
    return state.replace(caches=tuple(caches), host=state.host.replace(pools=tuple(pools)))


__all__ = ["DecodeState", "HostTier", "admit_paged", "empty_slot", "empty_state", "insert",
           "slot_bytes", "writeback"]
