"""FP8 indexer keys paged to the host behind a GPU key cache, with PQ codes on the device
(LeanSparse's layout). The selection over them is the method's (``methods.leansparse``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lsparse_jax.memory.host_pool import HOST
from lsparse_jax.memory.hot_cache import HotCache
from lsparse_jax.memory.paged_kv import paged_rows
from lsparse_jax.model.store import write_rows
from pallas_kernels.hot_resolve.packed import PackedPool, layout_of, pack, unpack, unpack_numpy


@struct.dataclass
class PagedKeys:
    tail: tuple[jnp.ndarray, jnp.ndarray]  # ([P, D_I] e4m3, [P, nb] f32) keys not yet paged
    cache: HotCache  # key cache: rows = ([Bk, D_I] e4m3, [Bk, nb] f32), LRU like the hot cache
    codes: jnp.ndarray  # [N, M] uint8 PQ codes of paged keys (junk past the paged rows)

    @classmethod
    def empty(cls, page_size: int, cache_rows: int, num_rows: int, dim: int, num_scales: int,
              num_subspaces: int) -> PagedKeys:
        nan = lambda shape, dtype: jnp.full(shape, jnp.nan, dtype)  # noqa: E731
        row = (jnp.zeros((dim,), jnp.float8_e4m3fn), jnp.zeros((num_scales,), jnp.float32))
        return cls(tail=(nan((page_size, dim), jnp.float8_e4m3fn),
                         nan((page_size, num_scales), jnp.float32)),
                   cache=HotCache.empty_like(row, cache_rows),
                   codes=jnp.zeros((num_rows, num_subspaces), jnp.uint8))

    def write(self, completed, ids, values, scales, ok) -> PagedKeys:
        """Stores new keys ids[j] (where ok[j]) in the tail."""
        paged = paged_rows(self.tail[0].shape[0], completed)
        tv, ts = self.tail
        return self.replace(tail=(write_rows(tv, ids - paged, values, ok),
                                  write_rows(ts, ids - paged, scales, ok)))


@struct.dataclass
class KeyPageView:
    """What one slot's layer sees of the shared key pages and codebooks."""

    pool: Any  # ([NP*P, D_I] e4m3, [NP*P, nb] f32) pinned_host, or their rows packed
    #   (``PackedPool`` [NP*P, D_I / 4 + nb] uint32: LeanSparseConfig.host_key_rows)
    page_table: jnp.ndarray  # [max_pages] int32 physical page of each logical page, -1 none
    codebooks: jnp.ndarray  # [M, K, D_I / M] f32 PQ codebooks of this layer
    codes: Any = None  # device_pool.PoolView of the PQ codes' device pool (device pages),
    #   None: the codes are in the slot's PagedKeys.codes


def empty_packed_pool(num_rows: int, dim: int, num_scales: int) -> PackedPool:
    """A pinned_host pool of ``num_rows`` FP8 key rows packed one row of words each
    (``LeanSparseConfig.host_key_rows = "packed"``: D_I e4m3 values, then nb f32 scales; a
    missed row is one host read instead of two), every row NaN (the e4m3 and f32 NaN bytes,
    as ``host_pool.empty_pool`` poisons a split pool)."""
    row = (np.full((1, dim), np.nan, jnp.float8_e4m3fn), np.full((1, num_scales), np.nan,
                                                                np.float32))
    layout, treedef = layout_of(row)
    words = np.asarray(pack(tuple(jnp.asarray(x) for x in row)))
    return PackedPool(jax.device_put(np.repeat(words, num_rows, axis=0), HOST), layout, treedef)


def stored_form(pool, rows):
    """How ``rows`` (FP8 key rows: a (values, scales) pytree) go into ``pool``: (the array(s)
    page writes update, the rows as stored there, arrays -> the pool, stored rows -> rows).
    A split pool stores the pytree as it is; a ``PackedPool`` its words."""
    if isinstance(pool, PackedPool):
        return (pool.words, pack(rows), lambda w: dataclasses.replace(pool, words=w),
                lambda w: unpack(w, pool.layout, pool.treedef))
    return pool, rows, lambda p: p, lambda r: r


def host_rows_numpy(pool):
    """The (values, scales) leaves of a host key pool as numpy arrays (for checks), read
    through a copy (``memory.invariant._read``: nothing cached on the pool's arrays)."""
    read = lambda x: np.asarray(x.copy())  # noqa: E731
    if isinstance(pool, PackedPool):
        return unpack_numpy(read(pool.words), pool.layout, pool.treedef)
    return tuple(read(x) for x in pool)


__all__ = ["KeyPageView", "PagedKeys", "empty_packed_pool", "host_rows_numpy", "stored_form"]
