"""Device page pools: the GPU state of CSA and HCA layers that grows with context, paged.

With ``CacheConfig.device_pages`` set, a request's resident compressed KV rows, its exact FP8
indexer keys (resident, hisparse, adaptive) or its PQ codes (leansparse), and its HCA rows
(every method) live in pools of pages shared by all slots, allocated per request by its
length (prompt + max_new_tokens, reserved at admission) instead of a per-slot array at
max_len. So the number of requests that fit depends on each method's footprint per token,
not on max_len.

The pattern is the host pages' (``memory.paged_kv``): a slot keeps the page being filled as
a per-slot tail inside the jitted step; the controller writes each completed page back
(``write_completed_tails``: one scatter per pool array), because a pool shared across
slots cannot be written inside the per-slot map. A read gathers the slot's rows through its
row of the device page table (one gather of the pool) and takes the tail's rows from the
tail. One page id names the same logical page in every pool: P compressed rows of each CSA
layer and the P_h = P * m / m_hca HCA rows of the same tokens (Notation: P rows per page, NP
pages; row r of page p at p * P + r).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lsparse_jax.memory.host_pool import CapacityError, PageAllocator
from lsparse_jax.memory.paged_kv import paged_rows
from lsparse_jax.model.store import (
    HCAKernelView,
    RowView,
    decode_scoring,
    each_query,
    exact_selection,
    ranked_selection,
    resident_counts,
    write_rows,
)
from lsparse_jax.parallel import head_sum
from lsparse_jax.quant import KVRowFormat
from pallas_kernels.index_scores.api import index_scores_paged


class DeviceCapacityError(CapacityError):
    """Admission needs more device pool pages than are free now."""


@struct.dataclass
class DevicePools:
    """The device pools a method keeps (None for parts it keeps elsewhere or not at all)."""

    kv: tuple  # per layer: [NP * P, D] compressed KV rows in the model's kv_dtype (a pytree
    #   of [NP * P, ...] arrays for FP8 rows), NaN where never written; None if not pooled
    keys: tuple  # per layer: ([NP * P, D_I] e4m3, [NP * P, D_I / fp8_block] f32) exact
    #   indexer keys, NaN where never written; None if not pooled
    codes: tuple  # per layer: [NP * P, M] uint8 PQ codes of paged keys; None if not pooled
    hca: tuple  # per layer: [NP * P_h, ...] HCA rows (kv_dtype), P_h = P * m / m_hca a page
    #   (the HCA rows of the tokens of one page of CSA rows); None for other layers
    page_table: jnp.ndarray  # [S, max_pages] int32 device page of each logical page, -1 none


@struct.dataclass
class PoolView:
    """What one slot's layer sees of a device pool."""

    pool: Any  # [NP * P, ...] array (or a pytree of them) shared by all slots
    page_table: jnp.ndarray  # [max_pages] int32 the slot's device page of each logical page


def _fill(dtype) -> Any:
    """The poison of never-read values: NaN for floats, 0 for integer codes."""
    return jnp.nan if jnp.issubdtype(dtype, jnp.floating) else 0


def empty_device_pool(num_pages: int, page: int, template) -> Any:
    """A poisoned pool of ``num_pages`` pages of ``page`` rows like ``template`` (a pytree of
    per-row arrays)."""
    return jax.tree.map(lambda r: jnp.full((num_pages * page,) + r.shape,
                                           _fill(r.dtype), r.dtype), template)


def gather_slot_rows(view: PoolView, positions, tail, paged, page: int):
    """Rows of one slot at ``positions`` (any shape, int32; -1 = none): positions >= paged
    from ``tail`` (rows paged .. paged+P-1), the others from the pool through the slot's page
    table: one gather of the pool. Poisoned (NaN, 0 for codes) where a position is -1 or its
    page is not the slot's. ``tail`` None: pool rows only (e.g. PQ codes, which have none)."""
    logical = jnp.clip(positions // page, 0, view.page_table.shape[0] - 1)
    phys = view.page_table[logical]
    valid = positions >= 0
    in_tail = (valid & (positions >= paged) & (positions < paged + page) if tail is not None
               else jnp.zeros_like(valid))
    ok = in_tail | (valid & (phys >= 0))
    src = jnp.where(ok & ~in_tail, phys * page + positions % page, 0)
    at = jnp.clip(positions - paged, 0, page - 1)

    def pick(leaf, tail_leaf=None):
        mask = lambda m: m.reshape(m.shape + (1,) * (leaf.ndim - 1))  # noqa: E731
        got = leaf[src]
        if tail_leaf is not None:
            got = jnp.where(mask(in_tail), tail_leaf[at], got)
        return jnp.where(mask(ok), got, jnp.asarray(_fill(leaf.dtype), leaf.dtype))

    if tail is None:
        return jax.tree.map(pick, view.pool)
    return jax.tree.map(pick, view.pool, tail)


def page_in(pool, rows, pages, count, page: int):
    """Writes rows[j*P:(j+1)*P] to device page pages[j] for j < count (pytrees of rows and
    pools alike; one scatter per array, no loop); returns (pool, the next P rows as the
    tail)."""
    num = jax.tree.leaves(rows)[0].shape[0]
    logical = jnp.arange(num) // page
    dest = jnp.where(logical < count, pages[jnp.clip(logical, 0, pages.shape[0] - 1)], -1)
    size = jax.tree.leaves(pool)[0].shape[0]
    ids = jnp.where(dest >= 0, dest * page + jnp.arange(num) % page, size)  # size: dropped
    pool = jax.tree.map(lambda p, r: p.at[ids].set(r.astype(p.dtype), mode="drop"), pool,
                        rows)
    rows = jax.tree.map(lambda r: jnp.concatenate(
        [r, jnp.full((page,) + r.shape[1:], _fill(r.dtype), r.dtype)]), rows)
    tail = jax.tree.map(lambda r: jax.lax.dynamic_slice_in_dim(r, count * page, page), rows)
    return pool, tail


def scatter_pages(pool, pages, rows, page: int):
    """pool with device page pages[j] = rows[j] ([c, P, ...], pytrees like the pool) where
    pages[j] >= 0: one scatter per array. (A chain of dynamic_update_slices would be c ops,
    and XLA on the CPU widens an FP8 array to f16 and back around each.)"""
    size = jax.tree.leaves(pool)[0].shape[0]
    ids = jnp.where(pages[:, None] >= 0, pages[:, None] * page + jnp.arange(page), size)
    return jax.tree.map(lambda p, r: p.at[ids.reshape(-1)].set(
        r.reshape((-1,) + r.shape[2:]).astype(p.dtype), mode="drop"), pool, rows)


def write_completed_tails(done, pool, tails, page: int):
    """The tails of the slots whose step completed a page (``paging.CompletedPages``; tails
    [S, P, ...]) to their device pages."""
    return scatter_pages(pool, done.dest, jax.tree.map(lambda t: t[done.slots], tails), page)


@struct.dataclass
class PooledKV:
    tail: Any  # [P, D] rows of the page being filled (a pytree of [P, ...] for FP8 rows)


@dataclasses.dataclass(frozen=True)
class PooledKVStore:
    """``model.store.KVStore``: every compressed row on the device, complete pages in a device
    pool, the page being filled in the slot's tail. Serves decode; prefill runs on the
    resident layout and the method pages its result in at admission."""

    page_size: int

    def empty(self, num_rows: int, rows: KVRowFormat) -> PooledKV:
        return PooledKV(rows.empty(self.page_size))

    def write(self, state: PooledKV, completed, ids, rows, ok) -> PooledKV:
        paged = paged_rows(self.page_size, completed)
        return state.replace(tail=write_rows(state.tail, ids - paged, rows, ok))

    def gather(self, state: PooledKV, completed, selected, context: PoolView):
        """The k selected rows (one gather of the pool), slots 0..k-1: the attention reads
        the same rows the resident table lends."""
        if selected.shape[0] != 1:
            raise ValueError("PooledKVStore serves decode (one query per slot); prefill runs "
                             "on the resident layout")
        rows = gather_slot_rows(context, selected[0], state.tail,
                                paged_rows(self.page_size, completed), self.page_size)
        slots = jnp.where(selected >= 0, jnp.arange(selected.shape[-1]), -1)
        return state, RowView(jax.tree.map(lambda r: r[None], rows), slots,
                              resident_counts(selected))

    def all_rows(self, state: PooledKV):
        raise ValueError("dense_selection needs the resident KV store; a pooled store holds "
                         "its rows in device pages")


@struct.dataclass
class PooledKeys:
    tail: tuple  # ([P, D_I] e4m3, [P, D_I / fp8_block] f32) keys of the page being filled


@dataclasses.dataclass(frozen=True)
class PooledIndex:
    """``model.store.KeyIndex``: every FP8 indexer key on the device (complete pages in a
    device pool, the page being filled in the tail); exact top-k as ``ExactIndex``."""

    top_k: int
    page_size: int
    implementation: str | None = "xla"  # the top-k kernel (``topk`` op implementation)

    def empty(self, num_rows: int, dim: int, num_scales: int) -> PooledKeys:
        nan = lambda shape, dtype: jnp.full(shape, jnp.nan, dtype)  # noqa: E731
        return PooledKeys((nan((self.page_size, dim), jnp.float8_e4m3fn),
                           nan((self.page_size, num_scales), jnp.float32)))

    def write(self, state: PooledKeys, completed, ids, values, scales, ok) -> PooledKeys:
        paged = paged_rows(self.page_size, completed)
        tv, ts = state.tail
        return state.replace(tail=(write_rows(tv, ids - paged, values, ok),
                                   write_rows(ts, ids - paged, scales, ok)))

    def select(self, state: PooledKeys, completed, query, eligible, context: PoolView):
        """Exact top-k over the slot's N keys (N = eligible.shape[-1], the resident layout's
        rows). A decode step with kernels scores them where they lie, in its pages and tail
        (``pooled_decode_scores``); otherwise they are gathered first (one gather of the
        pool) for ``exact_selection``."""
        paged = paged_rows(self.page_size, completed)
        kernel = decode_scoring(query.q.shape[0], self.implementation, query.precision,
                                "index_scores_paged")
        if kernel is not None:
            scores = pooled_decode_scores(kernel, context, state.tail, paged, self.page_size)
            return state, ranked_selection(scores(query.q, query.weights, eligible), eligible,
                                           self.top_k, self.implementation)
        positions = jnp.arange(eligible.shape[-1])
        values, scales = gather_slot_rows(context, positions, state.tail, paged,
                                          self.page_size)
        return state, exact_selection(query, values, scales, eligible, self.top_k,
                                      implementation=self.implementation)


def pooled_decode_scores(kernel: str, context: PoolView, tail, paged, page: int):
    """fn(q [T, H, D], weights [T, H], eligible [T, N]) -> [T, N] f32 exact index scores of
    one slot's FP8 keys read in place (the ``index_scores_paged`` op's ``kernel``): positions
    paged .. paged + P - 1 from ``tail`` ([P, D_I] e4m3, [P, NB] f32), the others from the pool
    through the slot's page table; -inf where not eligible. A key scores as
    ``store.decode_scores`` scores it in a contiguous copy (same kernel arithmetic and launch
    for N positions), without the copy: ~3x fewer key bytes moved a step."""
    return each_query(lambda q, w, ok: query_scores_in_place(
        kernel, page, q, w, context.pool, context.page_table, ok, tail, paged))


def query_scores_in_place(kernel: str, page: int, q, w, pool, table, ok, tail, start):
    """One query's exact index scores [N] by the ``index_scores_paged`` op's ``kernel`` (q
    [H, D], w [H]): position n from tail row n - start (tail ([T, D_I] e4m3, [T, NB] f32)),
    else from pool (values, scales) row table[n // P] * P + n % P (pool [R, ...] shared by
    the slots, or [1, R, ...] the slot's own); ok [N] which positions count. Under tensor
    parallelism each device scores with its heads and the partial scores are summed."""
    def op(q, w, v, s, table, ok, tv, ts, t0):
        return index_scores_paged(q, w, v, s, table, ok, page=page, tail=(tv, ts, t0),
                                  implementation=kernel)

    (values, scales), (tail_values, tail_scales) = pool, tail
    exact = head_sum(op, (1, 1) + (None,) * 7)
    return exact(q[None], w[None], values, scales, table[None], ok[None], tail_values[None],
                 tail_scales[None], jnp.asarray(start, jnp.int32)[None])[0]


@struct.dataclass
class PooledRows:
    tail: Any  # [P_h, ...] HCA rows of the page being filled (ModelConfig.kv_dtype)


@dataclasses.dataclass(frozen=True)
class PooledRowStore:
    """An HCA layer's row store (``model.store.ResidentRowStore``'s interface) over a device
    pool: complete pages of ``page_rows`` rows in the pool, the page being filled in the
    tail; a read gathers all the slot's rows (one gather), as the dense HCA attention needs;
    a decode with kernels reads them in place instead (``kernel_view``)."""

    page_rows: int  # P_h

    def empty(self, num_rows: int, rows: KVRowFormat) -> PooledRows:
        return PooledRows(rows.empty(self.page_rows))

    def write(self, state: PooledRows, completed, ids, rows, ok) -> PooledRows:
        paged = paged_rows(self.page_rows, completed)
        return state.replace(tail=write_rows(state.tail, ids - paged, rows, ok))

    def rows(self, state: PooledRows, completed, num_rows: int, context: PoolView):
        return gather_slot_rows(context, jnp.arange(num_rows), state.tail,
                                paged_rows(self.page_rows, completed), self.page_rows)

    def kernel_view(self, state: PooledRows, completed, num_rows: int,
                    context: PoolView) -> HCAKernelView:
        """The pool itself (shared by all slots, read in place through the slot's page
        table) and the tail as the extra rows: no gather of the slot's rows."""
        pos, page = jnp.arange(num_rows), self.page_rows
        paged = paged_rows(page, completed)
        phys = context.page_table[jnp.clip(pos // page, 0, context.page_table.shape[0] - 1)]
        slots = jnp.where((pos < paged) & (phys >= 0), phys * page + pos % page, -1)
        return HCAKernelView(jax.tree.map(lambda t: t[None], context.pool), slots, state.tail,
                             paged + jnp.arange(page))


class DevicePages:
    """Control plane of the device pools: a free list of pages and each slot's pages."""

    def __init__(self, num_pages: int, pages_per_slot: int):
        self.pages = PageAllocator(num_pages, DeviceCapacityError, "device pool",
                                   "CacheConfig.device_pages")
        self.pages_per_slot = pages_per_slot
        self.slot_pages: dict[int, list[int]] = {}

    @property
    def in_use(self) -> int:
        return self.pages.num_pages - self.pages.free

    def reserve(self, slot: int, count: int, what: str) -> np.ndarray:
        """Pages for ``count`` logical pages of ``slot``: its page-table row [max_pages]
        (-1 past them). Raises ValueError if the pool can never hold them,
        ``DeviceCapacityError`` if not now (nothing changes)."""
        if count > self.pages.num_pages:
            raise ValueError(f"{what} needs {count} device pages per pool; the pool has "
                             f"{self.pages.num_pages} (CacheConfig.device_pages): it can never "
                             "fit")
        pages = self.pages.allocate(count, what=what)
        self.slot_pages[slot] = pages
        row = np.full(self.pages_per_slot, -1, np.int32)
        row[:count] = pages
        return row

    def release(self, slot: int) -> None:
        """Frees the slot's pages at once (their rows stay until overwritten; no read
        reaches them: a slot reads only pages of its own page-table row)."""
        self.pages.release(self.slot_pages.pop(slot))


__all__ = ["DeviceCapacityError", "DevicePages", "DevicePools", "PoolView", "PooledIndex",
           "PooledKV", "PooledKVStore", "PooledKeys", "PooledRowStore", "PooledRows",
           "empty_device_pool", "gather_slot_rows", "pooled_decode_scores",
           "query_scores_in_place",
           "page_in", "scatter_pages", "write_completed_tails"]
