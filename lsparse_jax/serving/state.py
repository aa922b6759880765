"""The decode state pytree: every cache of every slot, the host tier, lengths, sampling key."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.config import EngineConfig
from lsparse_jax.memory.host_pool import empty_pool, read_host_rows, write_host_page
from lsparse_jax.memory.hot_cache import HotCache
from lsparse_jax.memory.key_store import PagedKeys
from lsparse_jax.memory.kv_store import HostView, PagedKV
from lsparse_jax.model.cache import CSACache, LayerCache, empty_cache
from lsparse_jax.quant import dequantize_index_keys
from lsparse_jax.quant.pq import encode


@struct.dataclass
class LayerPools:
    """One CSA layer's host pages (the page table is shared by every layer)."""

    kv: jax.Array  # [NP * P, D] f32 pinned_host compressed KV pages (page p: rows p*P ..)
    keys: tuple[jax.Array, jax.Array] | None  # leansparse: ([NP*P, D_I] e4m3, [NP*P, nb] f32)
    optional: jax.Array | None = None  # adaptive: [NO * P, D] f32 device pages lent to
    #   complete pages of imported history (copies of host pages; NaN when not lent)


@struct.dataclass
class HostTier:
    """What the paged methods share across slots: host pages, page table, PQ codebooks."""

    pools: tuple[LayerPools | None, ...]  # per layer (None for non-CSA layers)
    page_table: jnp.ndarray  # [S, max_pages] int32 physical page of each logical page, -1 none
    codebooks: tuple[jnp.ndarray | None, ...]  # per layer [M, K, D_I/M] (leansparse CSA)
    ready: jnp.ndarray | None = None  # adaptive: [S, max_pages] int32 optional page holding
    #   each logical page (the same page in every CSA layer's optional pool), -1 = not lent

    def view(self, layer: int, table, ready=None) -> HostView | None:
        """What one slot's layer sees: its pools, this slot's page-table (and ready-map) row,
        the codebooks."""
        pools = self.pools[layer]
        if pools is None:
            return None
        return HostView(pools.kv, table, pools.keys, self.codebooks[layer], pools.optional,
                        ready)


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
    """A CSA cache with its resident KV (and, for leansparse, keys) replaced by paged stores."""
    if not isinstance(cache, CSACache):
        return cache
    page, dim = engine.cache.page_size, engine.model.head_dim
    nan = lambda shape, dtype=jnp.float32: jnp.full(shape, jnp.nan, dtype)  # noqa: E731
    kv = PagedKV(nan((page, dim)), HotCache.empty(engine.cache.hot_cache_rows, dim))
    if engine.lean is None:
        return cache.replace(kv=kv)
    values, scales = cache.keys.values, cache.keys.scales
    row = (values[0], scales[0])
    keys = PagedKeys(tail=(nan((page,) + row[0].shape, values.dtype), nan((page,) + row[1].shape)),
                     cache=HotCache.empty_like(row, engine.leansparse.key_cache_rows),
                     codes=jnp.zeros((values.shape[0], engine.pq_subspaces), jnp.uint8))
    return cache.replace(kv=kv, keys=keys)


def empty_slot(engine: EngineConfig) -> tuple[LayerCache, ...]:
    """One slot's decode-time caches (no slot axis)."""
    caches = empty_cache(engine.model)
    return tuple(_paged(c, engine) for c in caches) if engine.paged else caches


def empty_state(engine: EngineConfig, codebooks: dict | None = None) -> DecodeState:
    """Empty slots; paged methods get NaN host pools; leansparse needs per-CSA-layer codebooks
    ({layer: [M, K, D_I/M]})."""
    slots, cfg = engine.cache.num_slots, engine.model
    caches = jax.tree.map(lambda a: jnp.broadcast_to(a, (slots,) + a.shape), empty_slot(engine))
    host = None
    if engine.paged:
        csa = [i for i, k in enumerate(cfg.layer_pattern) if k == "csa"]
        books = _check_codebooks(engine, codebooks, csa)
        n, size, di = engine.host_pages, engine.cache.page_size, cfg.indexer.head_dim
        nb = di // cfg.indexer.fp8_block

        def pools(i):
            if i not in csa:
                return None
            keys = optional = None
            if engine.lean is not None:
                keys = (empty_pool(n, size, di, jnp.float8_e4m3fn), empty_pool(n, size, nb))
            if engine.adaptive:
                optional = jnp.full((engine.cache.optional_pages * size, cfg.head_dim), jnp.nan,
                                    jnp.float32)
            return LayerPools(empty_pool(n, size, cfg.head_dim), keys, optional)

        none = lambda: jnp.full((slots, engine.pages_per_slot), -1, jnp.int32)  # noqa: E731
        host = HostTier(tuple(pools(i) for i in range(cfg.num_layers)), none(), books,
                        none() if engine.adaptive else None)
    state = DecodeState(caches=caches, lengths=jnp.zeros((slots,), jnp.int32),
                        rng=jax.random.key(engine.sampling.seed), host=host)
    # Commit every array to its memory now: jitted steps return committed arrays, and a jit
    # called with uncommitted inputs first would compile a second time.
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding), state)


def _check_codebooks(engine: EngineConfig, codebooks, csa) -> tuple:
    """Per-layer codebooks for leansparse (None elsewhere), shape-checked."""
    if engine.lean is None:
        return (None,) * engine.model.num_layers
    if codebooks is None or sorted(codebooks) != csa:
        got = None if codebooks is None else sorted(codebooks)
        raise ValueError(f"leansparse needs PQ codebooks for CSA layers {csa}, got {got} "
                         "(train them with lsparse_jax.indexing.calibrate_codebooks)")
    m, ds = engine.pq_subspaces, engine.leansparse.pq_subspace_dim
    out = []
    for i in range(engine.model.num_layers):
        if i not in csa:
            out.append(None)
            continue
        book = jnp.array(codebooks[i], jnp.float32, copy=True)  # the state is donated
        if book.ndim != 3 or book.shape[0] != m or book.shape[2] != ds or book.shape[1] > 256:
            raise ValueError(f"codebooks[{i}] has shape {tuple(book.shape)}; leansparse needs "
                             f"[{m}, K <= 256, {ds}] (M = indexer head_dim / pq_subspace_dim)")
        out.append(book)
    return tuple(out)


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


def _encode_keys(values, scales, codebooks):
    """PQ codes of FP8 keys: codes of their dequantized values (what exact scoring sees)."""
    return encode(dequantize_index_keys(values, scales), codebooks)


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("state",))
def admit_paged(engine: EngineConfig, state: DecodeState, slot, caches, length, pages,
                ready=None):
    """Admits a prefilled request (resident caches, no slot axis) into a paged slot.

    For each CSA layer: every complete page of compressed KV (and, for leansparse, of FP8
    keys) goes to the host pool (the prefix writeback at admission); the partial page stays as
    the tail; GPU caches start empty; leansparse PQ-encodes the paged keys.
    pages [max_pages] int32: the slot's physical host pages, -1 past its reservation.
    ready [max_pages] int32 (adaptive): the optional page lent to each complete logical page,
    -1 none; those pages are also copied into the optional pools (resident-first admission;
    the host copy is written too, so reclaiming a page never loses a row).
    """
    page = engine.cache.page_size
    full_pages = (length // engine.model.csa_ratio) // page
    pools, out = list(state.host.pools), []
    for i, cache in enumerate(caches):
        if not isinstance(cache, CSACache):
            out.append(cache)
            continue
        fresh = _paged(cache, engine)  # empty paged stores of the right shapes
        kv_pool, kv_tail = _page_out(pools[i].kv, cache.kv.entries, pages, full_pages, page)
        kv = fresh.kv.replace(tail=kv_tail)
        optional = pools[i].optional
        if engine.adaptive:
            optional = _lend(optional, cache.kv.entries, ready, full_pages, page)
        keys, key_pools = cache.keys, pools[i].keys
        if engine.lean is not None:
            rows = (cache.keys.values, cache.keys.scales)
            key_pools, key_tail = _page_out(key_pools, rows, pages, full_pages, page)
            codes = _encode_keys(*rows, state.host.codebooks[i])
            paged = jnp.arange(codes.shape[0]) < full_pages * page
            keys = fresh.keys.replace(tail=key_tail, codes=jnp.where(paged[:, None], codes, 0))
        pools[i] = LayerPools(kv_pool, key_pools, optional)
        out.append(cache.replace(kv=kv, keys=keys))
    table = state.host.page_table.at[slot].set(pages)
    host = state.host.replace(pools=tuple(pools), page_table=table)
    if engine.adaptive:
        host = host.replace(ready=host.ready.at[slot].set(ready))
    return insert(state.replace(host=host), slot, tuple(out), length)


def _lend(optional, entries, ready, count, page):
    """Copies rows [j*P, (j+1)*P) of entries into optional page ready[j], for j < count with
    ready[j] >= 0."""
    rows = lambda j: jax.lax.dynamic_slice_in_dim(entries, j * page, page)  # noqa: E731
    return _put_pages(optional, ready, rows, jnp.minimum(count, ready.shape[0]), page)


def _put_pages(optional, dest, rows, count, page):
    """optional [NO * P, D] with page dest[j] = rows(j) [P, D], for j < count with
    dest[j] >= 0 (other pages unchanged)."""
    def body(j, opt):
        at = jnp.maximum(dest[j], 0) * page
        new = jnp.where(dest[j] >= 0, rows(j), jax.lax.dynamic_slice_in_dim(opt, at, page))
        return jax.lax.dynamic_update_slice_in_dim(opt, new.astype(opt.dtype), at, 0)

    return jax.lax.fori_loop(0, count, body, optional)


def _with_optional(host: HostTier, fn) -> tuple:
    """The host tier's pools with each CSA layer's optional pool replaced by fn(pools)."""
    return tuple(None if p is None else p.replace(optional=fn(p)) for p in host.pools)


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("state",))
def reclaim(engine: EngineConfig, state: DecodeState, slot) -> DecodeState:
    """Takes back every optional page of ``slot`` (adaptive): its ready-map row becomes -1 and
    the pages are poisoned with NaN. Nothing is lost: every lent page has its host copy."""
    row, page = state.host.ready[slot], engine.cache.page_size
    nan = lambda p: jnp.full((page, p.optional.shape[1]), jnp.nan)  # noqa: E731
    pools = _with_optional(state.host, lambda p: _put_pages(p.optional, row, lambda j: nan(p),
                                                            row.shape[0], page))
    host = state.host.replace(pools=pools, ready=state.host.ready.at[slot].set(-1))
    return state.replace(host=host)


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("state",))
def refill(engine: EngineConfig, state: DecodeState, slot, logical, lent) -> DecodeState:
    """Lends optional page lent[j] to logical page logical[j] of ``slot`` (adaptive), for j
    with lent[j] >= 0: copies the page from its host copy and marks it ready."""
    page = engine.cache.page_size
    host_pages = state.host.page_table[slot, jnp.clip(logical, 0, None)]
    ok = (lent >= 0) & (logical >= 0) & (host_pages >= 0)
    ids = jnp.where(ok[:, None], host_pages[:, None] * page + jnp.arange(page), -1)  # [R, P]
    dest = jnp.where(ok, lent, -1)

    def fill(p):
        rows = read_host_rows(p.kv, ids)  # [R, P, D] on the device
        return _put_pages(p.optional, dest, lambda j: rows[j], dest.shape[0], page)

    where = jnp.where(ok, logical, state.host.ready.shape[1])  # out of bounds -> dropped
    ready = state.host.ready.at[slot, where].set(lent, mode="drop")
    return state.replace(host=state.host.replace(pools=_with_optional(state.host, fill),
                                                 ready=ready))


def _page_out(pool, rows, pages, count, page):
    """Writes rows[j*P:(j+1)*P] to host page pages[j] for j < count (pytrees of rows/pools);
    returns (pool, the next P rows as the tail)."""
    rows = jax.tree.map(lambda r: jnp.concatenate([r, jnp.full((page,) + r.shape[1:], jnp.nan,
                                                                 r.dtype)]), rows)

    def body(j, pool):
        chunk = jax.tree.map(lambda r: jax.lax.dynamic_slice_in_dim(r, j * page, page), rows)
        return jax.tree.map(lambda p, c: write_host_page(p, pages[j], c), pool, chunk)

    pool = jax.lax.fori_loop(0, count, body, pool)
    tail = jax.tree.map(lambda r: jax.lax.dynamic_slice_in_dim(r, count * page, page), rows)
    return pool, tail


def writeback(engine: EngineConfig, state: DecodeState, lengths_before, active) -> DecodeState:
    """Writes each tail page that this decode step completed to the host pool.

    A slot at position t wrote compressed row t // m if t % m == m - 1; when that row ends a
    page, the tail goes to the slot's physical page and is poisoned (NaN) for reuse. For
    leansparse the FP8 key tail goes to the key pool too, and the page's PQ codes are written.
    """
    page, m = engine.cache.page_size, engine.model.csa_ratio
    row = lengths_before // m
    full = active & (lengths_before % m == m - 1) & ((row + 1) % page == 0)
    dest = jnp.take_along_axis(state.host.page_table, (row // page)[:, None], axis=1)[:, 0]
    first = (row // page) * page  # first row of the completed page
    order = jnp.argsort(~full, stable=True)  # slots with a full page first
    count = jnp.sum(full)
    pools, caches = list(state.host.pools), list(state.caches)
    poison = lambda t: jnp.where(full.reshape((-1,) + (1,) * (t.ndim - 1)), jnp.nan, t)  # noqa
    for i, cache in enumerate(caches):
        if not isinstance(cache, CSACache):
            continue
        lean = engine.lean is not None
        tails = (cache.kv.tail, cache.keys.tail if lean else None)
        codes = cache.keys.codes if lean else None

        def body(j, carry, tails=tails, book=state.host.codebooks[i]):
            pool, codes = carry
            s = order[j]
            pool = pool.replace(
                kv=write_host_page(pool.kv, dest[s], tails[0][s]),
                keys=None if pool.keys is None else tuple(
                    write_host_page(p, dest[s], t[s]) for p, t in zip(pool.keys, tails[1])))
            if codes is not None:
                new = _encode_keys(tails[1][0][s], tails[1][1][s], book)
                codes = jax.lax.dynamic_update_slice(codes, new[None], (s, first[s], 0))
            return pool, codes

        pools[i], codes = jax.lax.fori_loop(0, count, body, (pools[i], codes))
        kv = cache.kv.replace(tail=poison(cache.kv.tail))
        keys = cache.keys
        if lean:
            keys = keys.replace(tail=jax.tree.map(poison, keys.tail), codes=codes)
        caches[i] = cache.replace(kv=kv, keys=keys)
    return state.replace(caches=tuple(caches), host=state.host.replace(pools=tuple(pools)))


__all__ = ["DecodeState", "HostTier", "LayerPools", "admit_paged", "empty_slot",
           "empty_state", "insert", "reclaim", "refill", "slot_bytes", "writeback"]
