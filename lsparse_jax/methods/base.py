"""The serving-method policy type: one value per method, passed to the same engine.

A method decides where a CSA layer's compressed KV and indexer keys live and how the top-k is
selected from them (its ``kv_store`` and ``key_index``, which the model calls), what state it
shares across slots (its ``tier``: host pools, page tables, codebooks) and how a prefilled
request enters a slot (``admit``). Those are the data plane: pure functions of the decode state,
traced under jit with the method as a static argument. Its ``controller`` is the control plane:
host-side bookkeeping (free pages, lent pages) that says what an admission needs and which
jitted updates a release, the next step or the last step's completed pages must run.

The base class is the ``resident`` method: every row and key on the device. A new method is a
subclass in a module of its own, registered by name with ``register``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lsparse_jax.config import EngineConfig, Storage, invalid, register_method
from lsparse_jax.memory.device_pool import (
    DevicePages,
    DevicePools,
    PooledIndex,
    PooledKeys,
    PooledKV,
    PooledKVStore,
    PooledRows,
    PooledRowStore,
    PoolView,
    empty_device_pool,
    page_in,
    write_completed_tails,
)
from lsparse_jax.memory.paging import CompletedPages, clear_table_row
from lsparse_jax.model import store
from lsparse_jax.model.cache import (
    CSACache,
    LayerCache,
    dsa_row_format,
    empty_cache,
    empty_layer_cache,
)
from lsparse_jax.model.store import (
    RESIDENT_KV,
    ExactIndex,
    KeyIndex,
    KVStore,
    ResidentRowStore,
)
from lsparse_jax.quant import KVRowFormat

Update = Callable[[Any], Any]  # a jitted function of the decode state, run by the engine

_POLICIES: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: makes ``cls.name`` a valid ``EngineConfig.method``."""
    _POLICIES[cls.name] = cls
    register_method(cls.name, cls.validate, cls.storage)
    return cls


def policy(engine: EngineConfig) -> Method:
    """The policy value serving ``engine.method``."""
    return _POLICIES[engine.method](engine)


@struct.dataclass
class NoTier:
    """Shared state of a method that shares nothing across slots."""


@struct.dataclass
class PoolTier:
    """Shared state of the resident method with device pools (``CacheConfig.device_pages``)."""

    pools: DevicePools


@struct.dataclass
class Grant:
    """What the controller reserved for one admission (passed to ``Method.admit``)."""

    pages: Any = None  # [max_pages] int32 physical host pages, -1 past the reservation (paged)
    lent: Any = None  # [max_pages] int32 optional device page of each logical page, -1 none
    #   (adaptive)
    device: Any = None  # [max_pages] int32 device pool page of each logical page, -1 past the
    #   reservation (CacheConfig.device_pages)
    written: Any = 0  # int32 leading host pages that already hold their rows (a reused
    #   prefix's complete pages: ``serving.prefix``); admission writes the pages after them


def _no_host_pages(pages) -> None:
    if len(pages):
        raise ValueError(f"this method keeps no host pages, got {len(pages)} to hold")


class Controller:
    """Control plane of a method that keeps no host-side bookkeeping.

    request_extra_bytes: device bytes every request holds beyond ``request_bytes`` (a
    ``SpecEngine``'s drafter ring and verification staging); a controller that budgets device
    bytes itself (adaptive's shared budget) counts them."""

    request_extra_bytes: int = 0

    def reserve(self, slot: int, total_tokens: int, prompt_tokens: int,
                held=()) -> tuple[Grant, list[Update]]:
        """Reserves what a request of ``total_tokens`` needs, or raises before changing
        anything (``memory.HostCapacityError``). Returns the grant and the state updates to
        run before the admission (e.g. reclaiming other requests' lent pages). ``held``: host
        pages a prefix hands over as the request's first logical pages (``serving.prefix``);
        they become the slot's only if the reservation succeeds."""
        _no_host_pages(held)
        return Grant(), []

    def keep_pages(self, slot: int, count: int) -> list[int]:
        """Takes the slot's first ``count`` host pages out of its reservation (a detached
        prefix keeps them; ``release`` then frees the rest). No host pages here: []."""
        return []

    def free_pages(self, pages) -> None:
        """Frees host pages a prefix held (``Engine.drop``)."""
        _no_host_pages(pages)

    def release(self, slot: int) -> list[Update]:
        """Frees the slot's reservation; returns the state updates that must follow."""
        return []

    def before_step(self) -> list[Update]:
        """State updates to run before the next decode step."""
        return []

    def after_step(self, lengths_before, active) -> list[Update]:
        """State updates to run after a decode step (numpy [S] lengths before it, active)."""
        return []

    def warmup(self, state, writeback: bool = True):
        """Compiles the updates ``before_step`` may return, by running ones that change
        nothing (and, with ``writeback``, the completed-page writeback ``after_step`` may
        return; otherwise it compiles at its first use)."""
        return state

    def metrics(self, state) -> dict:
        """The controller's figures for ``Engine.metrics``."""
        return {}


@dataclasses.dataclass(frozen=True)
class Method:
    """``resident``: compressed KV and FP8 indexer keys of every slot on the device; exact
    top-k. The reference every other method is compared with."""

    engine: EngineConfig
    name: ClassVar[str] = "resident"
    exact: ClassVar[bool] = True  # selections equal resident's (identity 3)
    storage: ClassVar[Storage] = Storage()  # where KV rows and keys live (memory accounting)
    shared_pool: ClassVar[bool] = False  # needs CacheConfig.shared_pool_rows (echo)

    @classmethod
    def validate(cls, engine: EngineConfig) -> None:
        """Raises ValueError naming a setting this method cannot serve."""
        if (engine.cache.optional_pages is not None) != cls.storage.lent_pages:
            invalid("EngineConfig", "cache.optional_pages", engine.cache.optional_pages,
                    "the adaptive method needs it (device pages lent to imported history); "
                    "other methods must leave it None")
        if engine.cache.shared_budget_bytes is not None and not cls.storage.lent_pages:
            invalid("EngineConfig", "cache.shared_budget_bytes",
                    engine.cache.shared_budget_bytes,
                    "only the adaptive method shares a budget with lent pages; leave it None")
        if (engine.cache.shared_pool_rows is not None) != cls.shared_pool:
            invalid("EngineConfig", "cache.shared_pool_rows", engine.cache.shared_pool_rows,
                    "the echo method needs it (its GPU KV pool shared across requests); "
                    "other methods must leave it None")
        if engine.cache.prefetch_rows and not cls.shared_pool:
            invalid("EngineConfig", "cache.prefetch_rows", engine.cache.prefetch_rows,
                    "only the echo method prefetches (ECHO's intra-query prefetch); leave it 0")
        cfg, page = engine.model, engine.cache.page_size
        if engine.cache.device_pages is not None and "hca" in cfg.layer_pattern \
                and page * cfg.csa_ratio % cfg.hca_ratio:
            invalid("EngineConfig", "cache.page_size", page,
                    f"with device_pages, page_size * csa_ratio ({page * cfg.csa_ratio} tokens "
                    f"a page) must be a multiple of hca_ratio={cfg.hca_ratio} (a page holds "
                    "whole HCA rows)")

    @property
    def csa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.engine.model.layer_pattern) if k == "csa")

    @property
    def dsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.engine.model.layer_pattern) if k == "dsa")

    @property
    def paged_layers(self) -> tuple[int, ...]:
        """Layers whose rows this method places in pages (host pages, device pools) and that
        go through ``admit_layer`` / ``write_pages``: CSA layers here (DSA layers stay
        resident in the slot); the host-paged methods add DSA layers."""
        return self.csa_layers

    @property
    def dsa_page_rows(self) -> int:
        """Per-token rows of a DSA layer in one page id: P * m, the tokens of P CSA rows."""
        return self.engine.cache.page_size * self.engine.model.csa_ratio

    def page_rows(self, layer: int) -> int:
        """Rows of ``layer`` in one page id: P compressed rows of a CSA layer, or the P * m
        per-token rows of a DSA layer (the same tokens: one page table, one writeback)."""
        dsa = self.engine.model.layer_pattern[layer] == "dsa"
        return self.dsa_page_rows if dsa else self.engine.cache.page_size

    def row_format(self, layer: int) -> KVRowFormat:
        """How ``layer`` stores its KV rows (CSA: ``ModelConfig.kv_dtype``; DSA: f32)."""
        cfg = self.engine.model
        return dsa_row_format(cfg) if cfg.layer_pattern[layer] == "dsa" else KVRowFormat.of(cfg)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.engine.model.layer_pattern) if k == "hca")

    @property
    def hca_page_rows(self) -> int:
        """HCA rows of one device page: those of the tokens of P compressed CSA rows."""
        cfg = self.engine.model
        return self.engine.cache.page_size * cfg.csa_ratio // cfg.hca_ratio

    @property
    def pooled(self) -> bool:
        """Whether the state that grows with context is in device pools (``device_pages``)."""
        return self.engine.cache.device_pages is not None

    # ------------------------------------------------------------------------------ data plane
    def kv_store(self) -> KVStore:
        return PooledKVStore(self.engine.cache.page_size) if self.pooled else RESIDENT_KV

    def key_index(self) -> KeyIndex:
        top_k, impl = self.engine.model.indexer.top_k, self.engine.implementation
        return PooledIndex(top_k, self.engine.cache.page_size, impl) if self.pooled \
            else ExactIndex(top_k, impl)

    def hca_store(self):
        """Where HCA layers keep their rows (``model.store.ResidentRowStore`` interface)."""
        if self.pooled:
            return PooledRowStore(self.hca_page_rows)
        return ResidentRowStore(self.hca_page_rows or None)

    def dsa_stores(self) -> store.DSAStores:
        """Where DSA layers keep their per-token rows and keys: resident in the slot."""
        return dataclasses.replace(store.RESIDENT_DSA,
                                   location_reuse=self.engine.cache.location_reuse)

    def empty_slot(self) -> tuple[LayerCache, ...]:
        """One slot's decode-time caches (no slot axis), NaN poisoned."""
        return empty_cache(self.engine.model, self.kv_store(), self.key_index(),
                           self.hca_store(), self.dsa_stores())

    def empty_tier(self, codebooks: dict | None = None):
        """The state shared by all slots. ``codebooks`` ({CSA layer: [M, K, D_I/M]}) serve the
        methods that keep PQ codes; the others ignore them (one set can serve every engine)."""
        return PoolTier(self.empty_pools()) if self.pooled else NoTier()

    def empty_pools(self) -> DevicePools | None:
        """Poisoned device pools of the parts this method keeps on the device (KV rows unless
        ``storage.kv_on_host``; exact keys, or PQ codes with ``storage.keys_on_host``)."""
        if not self.pooled:
            return None
        engine, cfg = self.engine, self.engine.model
        n, page, ic = engine.cache.device_pages, engine.cache.page_size, cfg.indexer
        row = KVRowFormat.of(cfg).template()
        key = (jnp.zeros((ic.head_dim,), jnp.float8_e4m3fn),
               jnp.zeros((ic.head_dim // ic.fp8_block,), jnp.float32))
        code = jnp.zeros((engine.pq_subspaces,), jnp.uint8)
        per_layer = lambda keep, template: tuple(  # noqa: E731
            empty_device_pool(n, page, template) if keep and i in self.csa_layers else None
            for i in range(cfg.num_layers))
        on_host = self.storage
        return DevicePools(kv=per_layer(not on_host.kv_on_host, row),
                           keys=per_layer(not on_host.keys_on_host, key),
                           codes=per_layer(on_host.keys_on_host, code),
                           hca=tuple(empty_device_pool(n, self.hca_page_rows, row)
                                     if i in self.hca_layers else None
                                     for i in range(cfg.num_layers)),
                           page_table=jnp.full((engine.cache.num_slots, engine.pages_per_slot),
                                               -1, jnp.int32))

    def slot_rows(self, tier) -> tuple:
        """The tier's per-slot arrays ([S, ...]; mapped over slots in the decode step); the
        last is the device page table (None without device pools)."""
        return (tier.pools.page_table if self.pooled else None,)

    def contexts(self, tier, rows) -> tuple:
        """Per layer, what one slot's stores read of shared state (inside the slot map): paged
        layers (kv, keys) contexts (``csa_context``), HCA layers their device pool's view."""
        device = rows[-1]
        out = []
        for i, kind in enumerate(self.engine.model.layer_pattern):
            if i in self.paged_layers:
                out.append(self.csa_context(tier, rows, i))
            elif kind == "hca" and device is not None:
                out.append(PoolView(tier.pools.hca[i], device))
            else:
                out.append(None)
        return tuple(out)

    def csa_context(self, tier, rows, layer: int):
        """One paged layer's (kv, keys) contexts for one slot (``rows``: its slot_rows)."""
        device = rows[-1]
        if device is None:
            return None
        return PoolView(tier.pools.kv[layer], device), PoolView(tier.pools.keys[layer], device)

    def pool_view(self, tier, part: str, layer: int, row) -> PoolView | None:
        """One slot's view of device pool ``part`` ("kv", "keys", "codes") of ``layer``
        (``row``: its device page-table row), None when not pooled or the layer has none."""
        pool = None if row is None else getattr(tier.pools, part)[layer]
        return None if pool is None else PoolView(pool, row)

    # ------------------------------------------------------------------------------ admission
    def admit(self, state, slot, caches: tuple[LayerCache, ...], length, grant: Grant):
        """Puts one prefilled request (resident caches, no slot axis) into ``slot``: each
        layer through ``admit_one``, then ``admit_done``."""
        for i, cache in enumerate(caches):
            state = self.admit_one(state, slot, i, cache, length, grant)
        return self.admit_done(state, slot, length, grant)

    def admit_one(self, state, slot, layer: int, cache: LayerCache, length, grant: Grant):
        """One layer of an admission: its finished resident cache (no slot axis) into
        ``slot`` as the method stores it (CSA layers through ``admit_layer``; with device
        pools, an HCA layer's complete pages to its device pages). Layers are independent, so
        a layer-streamed prefill admits each as it finishes (``serving.state.admit_layer``)."""
        engine = self.engine
        full_pages = (length // engine.model.csa_ratio) // engine.cache.page_size
        tier, kind = state.tier, engine.model.layer_pattern[layer]
        if layer in self.paged_layers:
            empty = empty_layer_cache(engine.model, layer, self.kv_store(), self.key_index(),
                                      self.hca_store(), self.dsa_stores())
            cache, tier = self.admit_layer(layer, cache, empty, tier, grant, full_pages)
        elif kind == "hca" and self.pooled:  # HCA rows of the complete pages to device pages
            hca = list(tier.pools.hca)
            hca[layer], tail = page_in(hca[layer], cache.entries, grant.device, full_pages,
                                       self.hca_page_rows)
            cache = cache.replace(entries=PooledRows(tail))
            tier = tier.replace(pools=tier.pools.replace(hca=tuple(hca)))
        caches = list(state.caches)
        caches[layer] = jax.tree.map(lambda big, one: big.at[slot].set(one), caches[layer],
                                     cache)
        return state.replace(caches=tuple(caches), tier=tier)

    def admit_done(self, state, slot, length, grant: Grant):
        """The end of an admission: ``slot``'s page-table rows (``with_tables``) and length."""
        return state.replace(tier=self.with_tables(state.tier, slot, grant),
                             lengths=state.lengths.at[slot].set(length))

    def admit_layer(self, layer: int, cache: CSACache, empty: CSACache, tier, grant: Grant,
                    full_pages):
        """One CSA layer's admission: (its slot cache, the tier). Pooled parts (KV rows
        unless on the host, exact keys unless on the host) go to the device pages
        ``grant.device``, their partial page to the tail (CSA layers only)."""
        if not self.pooled or layer not in self.csa_layers:
            return cache, tier
        pools, page = tier.pools, self.engine.cache.page_size
        if not self.storage.kv_on_host:
            kv = list(pools.kv)
            kv[layer], tail = page_in(kv[layer], cache.kv.entries, grant.device, full_pages,
                                      page)
            cache, pools = cache.replace(kv=PooledKV(tail)), pools.replace(kv=tuple(kv))
        if not self.storage.keys_on_host:
            keys = list(pools.keys)
            keys[layer], tail = page_in(keys[layer], (cache.keys.values, cache.keys.scales),
                                        grant.device, full_pages, page)
            cache, pools = cache.replace(keys=PooledKeys(tail)), pools.replace(keys=tuple(keys))
        return cache, tier.replace(pools=pools)

    def with_tables(self, tier, slot, grant: Grant):
        """The tier with ``slot``'s page-table rows from ``grant``."""
        if not self.pooled:
            return tier
        pools = tier.pools
        return tier.replace(pools=pools.replace(page_table=pools.page_table.at[slot].set(
            grant.device)))

    # ------------------------------------------------------------------------------ writeback
    def host_table(self, tier):
        """[S, max_pages] host page table of the completed-page writeback, None: no host
        pages."""
        return None

    def write_completed(self, state, slots):
        """Writes the tail page that the last decode step completed in each of ``slots`` ([c]
        int32, from ``CompletedPages.completing``) to the slot's host page and device pages."""
        cfg, page = self.engine.model, self.engine.cache.page_size
        of = lambda table: None if table is None else CompletedPages.of(  # noqa: E731
            table, state.lengths, slots, cfg.csa_ratio, page)
        host = of(self.host_table(state.tier))
        device = of(state.tier.pools.page_table if self.pooled else None)
        tier, caches = state.tier, list(state.caches)
        for i in self.paged_layers:
            if i in self.csa_layers:
                caches[i], tier = self.write_pages(i, caches[i], tier, host, device)
            else:  # a DSA page: the same page ids, P * m rows from row first * m
                dsa = host.replace(first=host.first * cfg.csa_ratio)
                caches[i], tier = self.write_pages(i, caches[i], tier, dsa, None)
        if device is not None:  # the HCA rows of the same pages (same slots, same pages)
            hca = list(tier.pools.hca)
            for i in self.hca_layers:
                tail = caches[i].entries.tail
                hca[i] = write_completed_tails(device, hca[i], tail, self.hca_page_rows)
                caches[i] = caches[i].replace(entries=PooledRows(device.poison(tail)))
            tier = tier.replace(pools=tier.pools.replace(hca=tuple(hca)))
        return state.replace(caches=tuple(caches), tier=tier)

    def write_pages(self, layer: int, cache: CSACache, tier, host: CompletedPages | None,
                    device: CompletedPages | None):
        """One CSA layer's writeback: the pooled parts' completed tails to their device
        pages (``host``: the host pages' writeback, for the methods that have them)."""
        if device is None:
            return cache, tier
        pools, page = tier.pools, self.engine.cache.page_size
        if not self.storage.kv_on_host:
            kv = list(pools.kv)
            kv[layer] = write_completed_tails(device, kv[layer], cache.kv.tail, page)
            cache = cache.replace(kv=cache.kv.replace(tail=device.poison(cache.kv.tail)))
            pools = pools.replace(kv=tuple(kv))
        if not self.storage.keys_on_host:
            keys = list(pools.keys)
            keys[layer] = write_completed_tails(device, keys[layer], cache.keys.tail, page)
            cache = cache.replace(keys=cache.keys.replace(tail=device.poison(cache.keys.tail)))
            pools = pools.replace(keys=tuple(keys))
        return cache, tier.replace(pools=pools)

    def controller(self) -> Controller:
        return PoolController(self) if self.pooled else Controller()


def insert(state, slot, caches: tuple[LayerCache, ...], length):
    """The decode state with one request's caches (no slot axis) in ``slot``."""
    new = jax.tree.map(lambda big, one: big.at[slot].set(one), state.caches, caches)
    return state.replace(caches=new, lengths=state.lengths.at[slot].set(length))


def _clear_device_pages(tier, slot):
    pools = tier.pools
    return tier.replace(pools=pools.replace(page_table=clear_table_row(pools.page_table, slot)))


@functools.partial(jax.jit, static_argnames=("method",), donate_argnames=("state",))
def write_completed(method: Method, state, slots):
    """``method.write_completed`` under jit (one compilation per length of ``slots``: the
    controller pads it to a power of two, so there are at most log2(S) + 1)."""
    return method.write_completed(state, slots)


class PoolController(Controller):
    """Device pool pages per request (``CacheConfig.device_pages``): reserved at admission
    for prompt + max_new_tokens, freed at release; the writeback of completed pages after a
    step. The paged methods' controllers add their host pages to it."""

    def __init__(self, method: Method):
        self.method = method
        engine = method.engine
        self.device = (DevicePages(engine.cache.device_pages, engine.pages_per_slot)
                       if method.pooled else None)

    def logical_pages(self, total_tokens: int) -> int:
        """Pages of compressed CSA rows a request of ``total_tokens`` tokens holds."""
        engine = self.method.engine
        rows = total_tokens // engine.model.csa_ratio
        return -(-rows // engine.cache.page_size)

    def reserve(self, slot: int, total_tokens: int, prompt_tokens: int, held=()):
        _no_host_pages(held)  # the paged controllers take them (``PagedController``)
        if self.device is None:
            return Grant(), []
        row = self.device.reserve(slot, self.logical_pages(total_tokens),
                                  f"a request of {total_tokens} tokens")
        return Grant(device=jnp.asarray(row)), []

    def release(self, slot: int) -> list:
        if self.device is None:
            return []
        self.device.release(slot)
        return [lambda state: state.replace(tier=_clear_device_pages(state.tier, slot))]

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

    def warmup(self, state, writeback: bool = True):
        """Compiles the writeback for every padded length (ahead of time: nothing runs).
        Its page copies are unrolled, so compile time grows with the width: ~2 x num_slots
        page copies in all (the widest alone at 200 slots compiled for minutes on the H200).
        writeback=False leaves each width to compile at its first use."""
        if not writeback:
            return state
        for bits in range((state.lengths.shape[0] - 1).bit_length() + 1):
            write_completed.lower(self.method, state,
                                  slots=jnp.zeros((1 << bits,), jnp.int32)).compile()
        return state

    def metrics(self, state) -> dict:
        if self.device is None:
            return {}
        return {"device_pages_in_use": self.device.in_use,
                "device_pool_bytes": pool_bytes(state.tier.pools)}


def pool_bytes(pools: DevicePools) -> int:
    """Bytes of the device pools (not their page table)."""
    return sum(a.nbytes for a in jax.tree.leaves((pools.kv, pools.keys, pools.codes,
                                                  pools.hca)))


__all__ = ["Controller", "Grant", "Method", "NoTier", "PoolController", "PoolTier", "Update",
           "insert", "policy", "pool_bytes", "register", "write_completed"]
