"""Host-resident prefixes for multi-turn serving (LeanSparse §4: a chunk extends a prefix
computed by an earlier request, streamed in layer by layer from host memory).

``Engine.detach(slot)`` ends a request but keeps its context (prompt + the generated tokens
whose KV was written) as a ``Prefix``:
  - paged methods (compressed KV, and leansparse's FP8 indexer keys, in host pages; with
    GLM-5-style DSA layers also their per-token rows and leaders' keys, P * m rows a page id):
    the request's complete host pages stay reserved and become the prefix's; nothing is copied;
  - everything else a slot keeps on the device is saved to ``pinned_host`` memory per layer,
    in the resident layout the prefill stream computes on: SWA windows, compressor rings,
    the tail rows of the partial page, exact indexer keys (resident, hisparse, adaptive),
    resident or device-pool KV rows and HCA rows, DSA rows. Hot, key and lent pages are not
    kept (an admission starts them empty, as a fresh one does); PQ codes are recomputed from
    the host keys at admission (the same ``encode_keys`` as any admission).
``Engine.admit(request, prefix=p)`` prefills only the suffix: ``stream_prefix`` loads each
layer's prefix state once (``PrefixLayer.load``: the saved state, plus the host pages read page
by page into the layer buffer) and the admission takes the prefix's pages as the request's first
logical pages. ``Engine.drop(p)`` frees them.

Notation: m CSA stride, P rows per page, n prefix tokens, c = n // m compressed rows of which
f = c // P fill complete pages (held) and c - fP sit in the saved tail; N = max_len // m. A
paged DSA layer's pages hold P * m per-token rows each (the same f page ids), its tail the
n - fPm rows after them, its resident layout max_len rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lsparse_jax.config import EngineConfig, invalid
from lsparse_jax.memory.device_pool import PoolView, gather_slot_rows
from lsparse_jax.memory.key_store import stored_form
from lsparse_jax.methods import policy
from lsparse_jax.model.cache import LayerCache
from lsparse_jax.model.store import ResidentKeys, ResidentKV
from pallas_kernels.common import as_bytes, from_bytes

DEVICE = jax.memory.Space.Device


@struct.dataclass
class HostPaged:
    """Stands in for rows of a saved CSA or DSA layer that live in the prefix's host pages."""

    tail: Any  # [P, ...] rows of the partial page (NaN past the prefix's rows; a DSA layer's
    #   [P * m, ...])


@dataclasses.dataclass(eq=False)
class Prefix:
    """A detached request's context, host-resident, ready to be extended by a later request.

    tokens: [n] int32 the tokens whose KV the state holds (prompt + written generated tokens).
    host_bytes: host bytes it holds: its pages in every host pool plus the saved state
      (``memory.accounting.prefix_host_bytes``).
    pages: the host pages it holds, in logical order (f of them; empty for methods without
      host pages).
    layers: per layer the saved state (``pinned_host``; a resident-layout ``LayerCache`` whose
      host-paged parts are ``HostPaged`` tails).
    owner: the controller (engine) whose host pools hold the pages.
    state: "held", then "consumed" (admitted) or "dropped".
    """

    tokens: np.ndarray
    host_bytes: int
    pages: tuple[int, ...]
    layers: tuple
    owner: Any = dataclasses.field(repr=False, default=None)
    state: str = "held"

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, np.int32).reshape(-1)

    @property
    def length(self) -> int:
        return int(self.tokens.size)

    def check_held(self, owner, what: str) -> None:
        if self.state != "held":
            raise ValueError(f"{what}: the prefix was already {self.state}")
        if self.owner is not owner:
            raise ValueError(f"{what}: the prefix belongs to another engine (its host pages "
                             "are in that engine's pools)")


def _poison(rows, keep):
    """rows with positions where ``keep`` [N] is False set to NaN."""
    return jax.tree.map(lambda r: jnp.where(keep.reshape((-1,) + (1,) * (r.ndim - 1)), r,
                                            jnp.asarray(jnp.nan, r.dtype)), rows)


def _from_pool(view: PoolView, tail, written, page: int, num_rows: int):
    """A slot's rows in the resident layout [N, ...] from its device pool pages and tail:
    pages below the tail's, the tail, NaN after it (as the resident table is past its rows)."""
    paged = (written // page) * page
    positions = jnp.arange(num_rows)
    rows = gather_slot_rows(view, positions, tail, paged, page)
    return _poison(rows, positions < paged + page)


@functools.partial(jax.jit, static_argnames=("engine", "layer"))
def export_layer(engine: EngineConfig, state, slot, layer: int):
    """What a prefix saves of ``slot``'s layer ``layer`` (on the device; the caller moves it to
    the host): the slot's cache in the resident layout the prefill computes on, except the
    CSA and DSA rows and keys in host pages, of which only the tail (partial page) is kept."""
    method, cfg, page = policy(engine), engine.model, engine.cache.page_size
    cache = jax.tree.map(lambda a: a[slot], state.caches[layer])
    length, kind = state.lengths[slot], cfg.layer_pattern[layer]
    pools = state.tier.pools if method.pooled else None
    device = pools.page_table[slot] if method.pooled else None
    if kind == "hca" and method.pooled:
        return cache.replace(entries=_from_pool(
            PoolView(pools.hca[layer], device), cache.entries.tail, length // cfg.hca_ratio,
            method.hca_page_rows, cfg.num_compressed("hca")))
    if kind == "dsa" and layer in method.paged_layers:  # rows (and leansparse's leader keys)
        keys = cache.keys  # in host pages; hisparse/adaptive leaders' keys stay resident
        if keys is not None and method.storage.keys_on_host:
            keys = HostPaged(keys.tail)
        return cache.replace(kv=HostPaged(cache.kv.tail), keys=keys)
    if kind != "csa":
        return cache
    rows, n, storage = length // cfg.csa_ratio, cfg.num_compressed("csa"), method.storage
    kv, keys = cache.kv, cache.keys
    if storage.kv_on_host:
        kv = HostPaged(kv.tail)
    elif method.pooled:
        kv = ResidentKV(_from_pool(PoolView(pools.kv[layer], device), kv.tail, rows, page, n))
    if storage.keys_on_host:
        keys = HostPaged(keys.tail)
    elif method.pooled:
        keys = ResidentKeys(*_from_pool(PoolView(pools.keys[layer], device), keys.tail, rows,
                                        page, n))
    return cache.replace(kv=kv, keys=keys)


def _from_host(pool, pages, full, tail, page: int, num_rows: int):
    """Rows [N, ...] on the device: host page pages[j] (of ``pool``, pinned_host) at logical
    page j < full, one page-granular slice + device_put each; the tail at page ``full``; NaN
    elsewhere."""
    size = pages.shape[0] * page + page
    # FP8 on CPU moves as bytes (pallas_kernels.common.cpu_fp8)
    buf = jax.tree.map(lambda t: as_bytes(jnp.full((size,) + t.shape[1:], jnp.nan, t.dtype)),
                       tail)

    def body(j, buf):
        def put(b, p):
            rows = jax.lax.dynamic_slice_in_dim(p, pages[j] * page, page)
            return jax.lax.dynamic_update_slice_in_dim(
                b, as_bytes(jax.device_put(rows, DEVICE)), j * page, 0)
        return jax.tree.map(put, buf, pool)

    buf = jax.lax.fori_loop(0, full, body, buf)
    buf = jax.tree.map(lambda b, t: jax.lax.dynamic_update_slice_in_dim(b, as_bytes(t),
                                                                          full * page, 0),
                       buf, tail)
    return jax.tree.map(lambda b, t: from_bytes(b[:num_rows], t.dtype), buf, tail)


@functools.partial(jax.jit, static_argnames=("num_rows", "page"))
def _assemble(saved, kv_pool, key_pool, pages, full, num_rows: int, page: int):
    """A saved CSA or DSA layer (on the device) with its host-paged parts read back: the
    resident layout ``stream_prefix`` computes on (``num_rows`` rows, ``page`` rows a page)."""
    kv, keys = saved.kv, saved.keys
    if isinstance(kv, HostPaged):
        kv = ResidentKV(_from_host(kv_pool, pages, full, kv.tail, page, num_rows))
    if isinstance(keys, HostPaged):  # packed key pools: read as words, unpacked here
        target, tail, _, rows_of = stored_form(key_pool, keys.tail)
        rows = rows_of(_from_host(target, pages, full, tail, page, num_rows))
        past = (jnp.arange(num_rows) >= (full + 1) * page)[:, None]  # NaN as a split read
        keys = ResidentKeys(*jax.tree.map(lambda r: jnp.where(past, jnp.nan, r), rows))
    return saved.replace(kv=kv, keys=keys)


@dataclasses.dataclass(frozen=True)
class PrefixLoad:
    """``prefill_stream.PrefixLayer`` of one layer of a ``Prefix``. ``tier()`` is the engine's
    current shared state (its host pools are replaced at every donated step, so they are read
    when the layer is loaded)."""

    engine: EngineConfig
    layer: int
    saved: LayerCache
    pages: np.ndarray  # [max_pages] int32 the prefix's host pages, -1 after them
    full: int  # f: complete pages
    tier: Any  # () -> the engine's tier

    def load(self, sharding) -> LayerCache:
        saved = jax.device_put(self.saved, sharding)
        if not any(isinstance(p, HostPaged) for p in (getattr(saved, "kv", None),
                                                      getattr(saved, "keys", None))):
            return saved
        tier = self.tier()
        kv_pool = tier.kv_pools[self.layer] if isinstance(saved.kv, HostPaged) else None
        key_pool = tier.key_pools[self.layer] if isinstance(saved.keys, HostPaged) else None
        kind = self.engine.model.layer_pattern[self.layer]
        return _assemble(saved, kv_pool, key_pool, jnp.asarray(self.pages), self.full,
                         self.engine.model.num_compressed(kind),
                         policy(self.engine).page_rows(self.layer))


def loaders(engine: EngineConfig, prefix: Prefix, tier) -> tuple[PrefixLoad, ...]:
    """One ``PrefixLoad`` per layer of ``prefix`` (``tier``: () -> the engine's tier)."""
    pages = np.full(engine.pages_per_slot, -1, np.int32)
    pages[:len(prefix.pages)] = prefix.pages
    return tuple(PrefixLoad(engine, i, saved, pages, len(prefix.pages), tier)
                 for i, saved in enumerate(prefix.layers))


def check_reuse(engine: EngineConfig) -> None:
    """Raises ValueError when ``engine`` cannot detach or reuse prefixes: their layer stream
    runs on one device (as ``CacheConfig.streamed_prefill``), so not with ``tp`` > 1."""
    if engine.tp != 1:
        invalid("EngineConfig", "tp", engine.tp, "prefix reuse (Engine.detach, "
                "admit(prefix=...)) streams layers on one device; use tp = 1")


def tree_bytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


__all__ = ["HostPaged", "Prefix", "PrefixLoad", "check_reuse", "export_layer", "loaders",
           "tree_bytes"]
