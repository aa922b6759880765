"""FP8 indexer keys paged to the host behind a GPU key cache, with PQ codes on the device
(LeanSparse's layout). The selection over them is the method's (``methods.leansparse``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.memory.hot_cache import HotCache
from lsparse_jax.memory.paged_kv import paged_rows
from lsparse_jax.model.store import write_rows


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

    pool: tuple[jax.Array, jax.Array]  # ([NP*P, D_I] e4m3, [NP*P, nb] f32) pinned_host
    page_table: jnp.ndarray  # [max_pages] int32 physical page of each logical page, -1 none
    codebooks: jnp.ndarray  # [M, K, D_I / M] f32 PQ codebooks of this layer
    codes: Any = None  # device_pool.PoolView of the PQ codes' device pool (device pages),
    #   None: the codes are in the slot's PagedKeys.codes


__all__ = ["KeyPageView", "PagedKeys"]
