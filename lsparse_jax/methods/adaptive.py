"""``adaptive``: Adaptive DHiSparse's load-adaptive residency on top of ``hisparse``.

Complete pages of a request's imported (prompt) history may sit in optional device pages that
all slots share (``CacheConfig.optional_pages`` per CSA layer), on top of the fixed hot cache:
  - resident-first admission: a new request is lent a device page for every complete prompt
    page; when too few are free, whole requests' optional pages are reclaimed in reclaim order
    (the longest-held first, i.e. admission order) until the deficit is covered or no lent page
    is left; it then gets as many as are free, its first pages first;
  - reclamation is a ready-map reset (the host copy of every lent page was written at
    admission, so nothing is lost);
  - refill: after pages come free (a request leaves), at most ``refill_pages`` pages per decode
    step go back to requests missing some, round-robin over slots.
With ``CacheConfig.shared_budget_bytes`` required state and lent pages share one budget (the
paper's required + optional <= capacity): an admission's required bytes that leave a deficit
reclaim whole requests' optional pages in reclaim order until it is covered, and if all lent
pages cannot cover it the admission waits (``SharedBudgetError``, nothing changed); the
newcomer and the refill are lent pages only from spare bytes.
The resolver reads the ready map before the hot-cache scan (the paper's step 1), so outputs
equal ``resident``'s bit for bit (identity 3). Pages generated during decoding always follow
hot-cache rules. Control plane: ``OptionalResidency`` (which pages each slot holds);
data plane: ``Adaptive.admit_layer`` (lend), ``reclaim`` and ``refill``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lsparse_jax.config import Storage
from lsparse_jax.memory.accounting import request_bytes
from lsparse_jax.memory.device_pool import DevicePools
from lsparse_jax.memory.host_pool import CapacityError, PageAllocator, read_host_rows
from lsparse_jax.memory.paged_kv import PagedKVStore
from lsparse_jax.memory.paging import put_pages
from lsparse_jax.methods.base import Grant, register
from lsparse_jax.methods.hisparse import HiSparse, PagedController


@struct.dataclass
class LentPageView:
    """One slot's layer view of its host pages and of the optional pages lent to it."""

    pool: jax.Array  # [NP * P, D] pinned_host pages of this layer
    page_table: jnp.ndarray  # [max_pages] int32 physical host page of each logical page
    optional: jax.Array  # [NO * P, D] f32 device pages lent to imported history (rows in
    #   the model's kv_dtype, a pytree like the pool)
    ready: jnp.ndarray  # [max_pages] int32 optional page holding each logical page, -1 none


@dataclasses.dataclass(frozen=True)
class LentPagedKVStore(PagedKVStore):
    """``PagedKVStore`` whose resolver first reads rows from lent optional pages."""

    def lent(self, context: LentPageView) -> tuple:
        return context.optional, context.ready


@struct.dataclass
class AdaptiveTier:
    """What adaptive shares across slots."""

    kv_pools: tuple[jax.Array | None, ...]  # per layer [NP * P, D] f32 pinned_host KV pages
    optional_pools: tuple[jax.Array | None, ...]  # per layer [NO * P, D] f32 device pages lent
    #   to complete pages of imported history (copies of host pages; NaN when not lent); both
    #   pytrees of arrays for another ModelConfig.kv_dtype
    page_table: jnp.ndarray  # [S, max_pages] int32 physical page of each logical page, -1 none
    ready: jnp.ndarray  # [S, max_pages] int32 optional page holding each logical page (the same
    #   page in every CSA layer's optional pool), -1 = not lent
    pools: DevicePools | None = None  # device pools of the exact indexer keys, as hisparse's


@register
@dataclasses.dataclass(frozen=True)
class Adaptive(HiSparse):
    name: ClassVar[str] = "adaptive"
    storage: ClassVar[Storage] = Storage(kv_on_host=True, lent_pages=True)

    def kv_store(self) -> LentPagedKVStore:
        cache = self.engine.cache
        return LentPagedKVStore(cache.page_size, cache.hot_cache_rows,
                                self.engine.implementation)

    def empty_tier(self, codebooks=None) -> AdaptiveTier:
        base = super().empty_tier(codebooks)
        pages = self.engine.cache.optional_pages
        optional = tuple(None if p is None else self.row_format(i).empty(pages * self.page_rows(i))
                         for i, p in enumerate(base.kv_pools))
        return AdaptiveTier(base.kv_pools, optional, base.page_table, self._page_table(),
                            base.pools)

    def slot_rows(self, tier: AdaptiveTier) -> tuple:
        rows = super().slot_rows(tier)  # (host page table, device page table)
        return rows[:1] + (tier.ready,) + rows[1:]

    def csa_context(self, tier: AdaptiveTier, rows, layer: int):
        table, ready = rows[:2]
        return (LentPageView(tier.kv_pools[layer], table, tier.optional_pools[layer], ready),
                self.pool_view(tier, "keys", layer, rows[-1]))

    def admit_done(self, state, slot, length, grant: Grant):
        state = super().admit_done(state, slot, length, grant)
        return state.replace(tier=state.tier.replace(ready=state.tier.ready.at[slot].set(
            grant.lent)))

    def admit_layer(self, layer, cache, empty, tier, grant, full_pages):
        """As hisparse, and the complete prompt pages lent an optional page are copied there
        (resident-first admission; the host copy is written too, so reclaiming a page never
        loses a row)."""
        out, tier = super().admit_layer(layer, cache, empty, tier, grant, full_pages)
        page, entries = self.page_rows(layer), cache.kv.entries
        rows = lambda j: jax.tree.map(  # noqa: E731
            lambda e: jax.lax.dynamic_slice_in_dim(e, j * page, page), entries)
        pools = list(tier.optional_pools)
        pools[layer] = put_pages(pools[layer], grant.lent, rows,
                                 jnp.minimum(full_pages, grant.lent.shape[0]), page)
        return out, tier.replace(optional_pools=tuple(pools))

    def controller(self) -> AdaptiveController:
        return AdaptiveController(self)


def _with_optional(method: Adaptive, tier: AdaptiveTier, fn) -> tuple:
    """The tier's optional pools, each paged layer's replaced by fn(optional, host pool, rows
    per page)."""
    return tuple(None if o is None else fn(o, p, method.page_rows(i))
                 for i, (o, p) in enumerate(zip(tier.optional_pools, tier.kv_pools)))


@functools.partial(jax.jit, static_argnames=("method",), donate_argnames=("state",))
def reclaim(method: Adaptive, state, slot):
    """Takes back every optional page of ``slot``: its ready-map row becomes -1 and the pages
    are poisoned with NaN. Nothing is lost: every lent page has its host copy."""
    tier = state.tier
    row = tier.ready[slot]
    nan = lambda o, page: jax.tree.map(  # noqa: E731
        lambda leaf: jnp.full((page,) + leaf.shape[1:], jnp.nan, leaf.dtype), o)
    pools = _with_optional(method, tier, lambda o, p, page: put_pages(
        o, row, lambda j: nan(o, page), row.shape[0], page))
    return state.replace(tier=tier.replace(optional_pools=pools,
                                           ready=tier.ready.at[slot].set(-1)))


@functools.partial(jax.jit, static_argnames=("method",), donate_argnames=("state",))
def refill(method: Adaptive, state, slot, logical, lent):
    """Lends optional page lent[j] to logical page logical[j] of ``slot``, for j with
    lent[j] >= 0: copies the page from its host copy and marks it ready."""
    tier = state.tier
    host_pages = tier.page_table[slot, jnp.clip(logical, 0, None)]
    ok = (lent >= 0) & (logical >= 0) & (host_pages >= 0)
    dest = jnp.where(ok, lent, -1)

    def fill(optional, pool, page):
        ids = jnp.where(ok[:, None], host_pages[:, None] * page + jnp.arange(page), -1)  # [R, P]
        rows = jax.tree.map(lambda p: read_host_rows(p, ids), pool)  # [R, P, D] on the device
        return put_pages(optional, dest, lambda j: jax.tree.map(lambda r: r[j], rows),
                         dest.shape[0], page)

    where = jnp.where(ok, logical, tier.ready.shape[1])  # out of bounds -> dropped
    ready = tier.ready.at[slot, where].set(lent, mode="drop")
    return state.replace(tier=tier.replace(optional_pools=_with_optional(method, tier, fill),
                                           ready=ready))


class SharedBudgetError(CapacityError):
    """An admission's required bytes exceed the shared budget's spare bytes plus every lent
    optional page (it waits)."""

    wait_reason = "shared_budget"


class AdaptiveController(PagedController):
    """Host pages as hisparse, plus which optional pages each slot holds (and, with
    ``shared_budget_bytes``, the required bytes each admitted request holds)."""

    def __init__(self, method: Adaptive):
        super().__init__(method)
        engine = method.engine
        cache = engine.cache
        self.residency = OptionalResidency(cache.optional_pages, engine.pages_per_slot,
                                           cache.refill_pages)
        self.budget = cache.shared_budget_bytes
        self.required: dict[int, int] = {}  # slot -> required device bytes (with a budget)
        # one optional page id = P rows in every CSA layer's optional pool (P * m f32 rows in
        #   every DSA layer's)
        self.page_bytes = sum(method.page_rows(i) * method.row_format(i).row_bytes
                              for i in method.paged_layers)

    def spare(self) -> int:
        """Bytes of the shared budget neither required nor lent."""
        return (self.budget - sum(self.required.values())
                - self.residency.in_use() * self.page_bytes)

    def reserve(self, slot: int, total_tokens: int, prompt_tokens: int, held=()):
        engine = self.method.engine
        full = prompt_tokens // engine.model.csa_ratio // engine.cache.page_size
        if self.budget is None:
            grant, before = super().reserve(slot, total_tokens, prompt_tokens, held)
            victims, ready = self.residency.admit(slot, full)
        else:
            need = request_bytes(engine, total_tokens).gpu_total + self.request_extra_bytes
            if need > self.budget:
                raise ValueError(f"adaptive: a request of {total_tokens} tokens needs {need} "
                                 f"required bytes, more than CacheConfig.shared_budget_bytes="
                                 f"{self.budget}: it can never be admitted")
            deficit = need - self.spare()
            victims = (self.residency.victims_for(-(-deficit // self.page_bytes))
                       if deficit > 0 else [])
            if victims is None:
                raise SharedBudgetError(
                    f"adaptive shared budget: {need} required bytes leave a deficit of "
                    f"{deficit} that the lent pages ({self.residency.in_use()} x "
                    f"{self.page_bytes} B) cannot cover")
            grant, before = super().reserve(slot, total_tokens, prompt_tokens, held)
            for victim in victims:
                self.residency.take_back(victim)
            self.required[slot] = need
            _, ready = self.residency.admit(slot, full,
                                            limit=max(self.spare(), 0) // self.page_bytes)
        before += [functools.partial(reclaim, self.method, slot=victim) for victim in victims]
        return grant.replace(lent=jnp.asarray(ready)), before

    def release(self, slot: int) -> list:
        updates = []
        self.required.pop(slot, None)
        if self.residency.release(slot):
            updates.append(functools.partial(reclaim, self.method, slot=slot))
        return updates + super().release(slot)

    def before_step(self) -> list:
        """The bounded round-robin refill of lent pages (from spare bytes, with a budget)."""
        limit = None if self.budget is None else max(self.spare(), 0) // self.page_bytes
        return [functools.partial(refill, self.method, slot=slot, logical=jnp.asarray(logical),
                                  lent=jnp.asarray(lent))
                for slot, logical, lent in self.residency.plan_refill(limit)]

    def warmup(self, state, writeback: bool = True):
        none = jnp.full((self.residency.refill_pages,), -1, jnp.int32)  # an all -1 plan
        return refill(self.method, super().warmup(state, writeback), 0, none, none)

    def metrics(self, state) -> dict:
        out = super().metrics(state) | {
            "optional_pages_in_use": self.residency.in_use(),
            "optional_pool_bytes": sum(o.nbytes for o in
                                       jax.tree.leaves(state.tier.optional_pools))}
        if self.budget is not None:
            out["shared_budget_bytes_in_use"] = self.budget - self.spare()
        return out


class OptionalResidency:
    """Which optional device pages each slot holds, and the next reclaim/refill decisions."""

    def __init__(self, num_pages: int, pages_per_slot: int, refill_pages: int):
        self.pages = PageAllocator(num_pages)
        self.pages_per_slot = pages_per_slot
        self.refill_pages = refill_pages
        self.lent: dict[int, dict[int, int]] = {}  # slot -> {logical page: optional page}
        self.imported: dict[int, int] = {}  # slot -> complete prompt pages (refill targets)
        self.order: list[int] = []  # slots in admission order (reclaim order)
        self._cursor = 0  # round-robin position of the refill

    def in_use(self) -> int:
        return self.pages.num_pages - self.pages.free

    def admit(self, slot: int, full_pages: int,
              limit: int | None = None) -> tuple[list[int], np.ndarray]:
        """A request with ``full_pages`` complete prompt pages enters ``slot``: returns (slots
        whose optional pages must be reclaimed first, in order; its ready row [max_pages]).
        limit: lend at most this many pages and reclaim nobody's (the shared budget's spare
        pages); None: reclaim whole requests' pages until ``full_pages`` are free."""
        victims = []
        for other in self.order if limit is None else ():
            if self.pages.free >= full_pages:
                break
            if self.lent.get(other):
                victims.append(other)
                self._take_back(other)
        count = min(full_pages, self.pages.free, full_pages if limit is None else limit)
        grant = self.pages.allocate(count, what="optional pages")
        self.lent[slot] = dict(enumerate(grant))
        self.imported[slot] = full_pages
        self.order.append(slot)
        return victims, self.ready_row(slot)

    def victims_for(self, pages: int) -> list[int] | None:
        """The requests, in reclaim order, whose whole optional pages together cover
        ``pages`` (the fewest from the front), or None if all lent pages cannot."""
        victims, got = [], 0
        for other in self.order:
            if got >= pages:
                break
            if self.lent.get(other):
                victims.append(other)
                got += len(self.lent[other])
        return victims if got >= pages else None

    def take_back(self, slot: int) -> None:
        """Reclaims all of ``slot``'s optional pages (the caller runs ``reclaim``)."""
        self._take_back(slot)

    def release(self, slot: int) -> bool:
        """The request in ``slot`` ends; returns whether it held optional pages to reclaim."""
        held = bool(self.lent.get(slot))
        self._take_back(slot)
        self.lent.pop(slot, None)
        self.imported.pop(slot, None)
        self.order.remove(slot)
        return held

    def plan_refill(self, limit: int | None = None) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """At most ``refill_pages`` free pages (and at most ``limit``) for slots missing some
        of their prompt pages, one page per slot per round, round-robin from where the last
        refill stopped: [(slot, logical [R], lent [R])], -1 padded to R = refill_pages (one
        compilation)."""
        budget = min(self.refill_pages, self.pages.free,
                     self.refill_pages if limit is None else limit)
        slots = sorted(self.imported)
        new: dict[int, list[int]] = {}  # slot -> logical pages lent now, in order
        if slots:
            start = self._cursor % len(slots)
            queue = slots[start:] + slots[:start]
            while budget and (needy := [s for s in queue if self._missing(s) is not None]):
                for slot in needy[:budget]:
                    logical = self._missing(slot)
                    self.lent[slot][logical] = self.pages.allocate(1, what="optional pages")[0]
                    new.setdefault(slot, []).append(logical)
                    self._cursor = slots.index(slot) + 1
                budget -= len(needy[:budget])
        out = []
        for slot, pages in new.items():
            logical = np.full(self.refill_pages, -1, np.int32)
            lent = np.full(self.refill_pages, -1, np.int32)
            logical[:len(pages)] = pages
            lent[:len(pages)] = [self.lent[slot][p] for p in pages]
            out.append((slot, logical, lent))
        return out

    def _missing(self, slot: int) -> int | None:
        """The first prompt page of ``slot`` that holds no optional page, or None."""
        return next((p for p in range(self.imported[slot]) if p not in self.lent[slot]), None)

    def ready_row(self, slot: int) -> np.ndarray:
        row = np.full(self.pages_per_slot, -1, np.int32)
        for logical, page in self.lent.get(slot, {}).items():
            row[logical] = page
        return row

    def _take_back(self, slot: int) -> None:
        pages = list(self.lent.get(slot, {}).values())
        if pages:
            self.pages.release(pages)
        self.lent[slot] = {}


__all__ = ["Adaptive", "AdaptiveController", "AdaptiveTier", "LentPageView", "SharedBudgetError",
           "LentPagedKVStore", "OptionalResidency", "reclaim", "refill"]
