"""The host page pool: compressed KV pages in ``pinned_host`` memory, and the XLA copy path.

XLA rejects a gather from a host array inside jit (on the GPU and on the CPU alike), so rows
move one at a time: ``dynamic_slice`` of the host array, then ``device_put`` to device memory
(the path ../shared/gpu_facts measured at ~7 us a row on an H200). The fused zero-copy Pallas
read is a later kernel; this is its reference and fallback.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

HOST = jax.memory.Space.Host  # pinned_host
DEVICE = jax.memory.Space.Device


def empty_pool(num_pages: int, page_size: int, dim: int, dtype=jnp.float32) -> jax.Array:
    """A NaN-filled pool [num_pages, page_size, dim] in pinned host memory."""
    return jax.device_put(np.full((num_pages, page_size, dim), np.nan, dtype), HOST)


def _read_rows(pool, row_ids):
    """pool [NP, P, D] (host), row_ids [n] (page * P + offset, -1 = skip) -> [n, D] device.

    Rows with id -1 stay NaN. Valid ids are copied first-to-last, one transfer each.
    """
    n, (_, page, dim) = row_ids.shape[0], pool.shape
    valid = row_ids >= 0
    order = jnp.argsort(~valid, stable=True)  # valid ids first
    count = jnp.sum(valid)
    out = jnp.full((n, dim), jnp.nan, pool.dtype)

    def body(j, out):
        rid = row_ids[order[j]]
        row = jax.lax.dynamic_slice(pool, (rid // page, rid % page, 0), (1, 1, dim))
        row = jax.device_put(row, DEVICE).reshape(1, dim)
        return jax.lax.dynamic_update_slice(out, row, (order[j], 0))

    return jax.lax.fori_loop(0, count, body, out)


@custom_vmap
def read_host_rows(pool, row_ids):
    """Copies rows of a host pool to the device: row_ids [..., n] -> [..., n, D].

    Under ``vmap`` (one call per decode slot) the ids of every slot are flattened into one
    copy loop: the pool is shared by all slots and must not be batched.
    """
    flat = row_ids.reshape(-1)
    return _read_rows(pool, flat).reshape(row_ids.shape + pool.shape[-1:])


@read_host_rows.def_vmap
def _read_host_rows_vmap(axis_size, in_batched, pool, row_ids):
    pool_batched, ids_batched = in_batched
    if pool_batched:
        raise ValueError("read_host_rows: the host pool is shared by all slots; do not vmap it")
    if not ids_batched:
        row_ids = jnp.broadcast_to(row_ids, (axis_size,) + row_ids.shape)
    return read_host_rows(pool, row_ids), True


def write_host_page(pool, page, rows):
    """pool[page] = rows ([P, D] device rows) -> the updated host pool."""
    update = jax.device_put(rows[None].astype(pool.dtype), HOST)
    return jax.lax.dynamic_update_slice(pool, update, (page, 0, 0))


class HostCapacityError(RuntimeError):
    """Admission needs more host pages than the pool has free."""


class PageAllocator:
    """Control-plane free list of host pages (shared by every CSA layer's pool)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, count: int, *, what: str) -> list[int]:
        if count > len(self._free):
            raise HostCapacityError(
                f"host pool exhausted: {what} needs {count} pages, {len(self._free)} of "
                f"{self.num_pages} are free (raise CacheConfig.host_pages or admit fewer "
                "requests)")
        return [self._free.pop() for _ in range(count)]

    def release(self, pages) -> None:
        pages = [int(p) for p in pages if p >= 0]
        if len(set(pages)) != len(pages) or set(pages) & set(self._free):
            raise ValueError(f"release: pages {pages} are not all allocated")
        self._free.extend(sorted(pages, reverse=True))
