"""The host page pool: compressed KV pages in ``pinned_host`` memory, and host-row copies.

XLA rejects a gather from a host array inside jit (on the GPU and on the CPU alike), so the
XLA path moves rows one at a time: ``dynamic_slice`` of the host array, then ``device_put`` to
device memory (~20 us a row on an H200). The Pallas path (``pallas_kernels.gather_rows``)
reads the pinned_host pool in place over PCIe (0.3 ms for 1664 rows there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from pallas_kernels.common import as_bytes, cpu_fp8, from_bytes, on_gpu
from pallas_kernels.gather_rows.api import gather_rows

HOST = jax.memory.Space.Host  # pinned_host
DEVICE = jax.memory.Space.Device


def empty_pool(num_pages: int, page_size: int, dim: int, dtype=jnp.float32) -> jax.Array:
    """A NaN-filled pool [num_pages * page_size, dim] in pinned host memory: row r of logical
    page p sits at p * page_size + r (rows flat, so a row gather needs no reshape)."""
    return jax.device_put(np.full((num_pages * page_size, dim), np.nan, dtype), HOST)


def _reader(implementation: str):
    """``read_host_rows`` for one kernel implementation (custom_vmap takes arrays only)."""

    @custom_vmap
    def read(pool, row_ids):
        flat = row_ids.reshape(-1)
        impl = implementation if kernel_rows(pool) else "xla"
        rows = gather_rows(pool, flat, implementation=impl)
        return rows.reshape(row_ids.shape + pool.shape[-1:])

    @read.def_vmap
    def _vmap(axis_size, in_batched, pool, row_ids):
        pool_batched, ids_batched = in_batched
        if pool_batched:
            raise ValueError("read_host_rows: the host pool is shared by all slots; do not vmap "
                             "it")
        if not ids_batched:
            row_ids = jnp.broadcast_to(row_ids, (axis_size,) + row_ids.shape)
        return read(pool, row_ids), True

    return read


MIN_KERNEL_ROW = 16  # narrower rows (e.g. one FP8 scale per key) always take the XLA path


def kernel_rows(pool) -> bool:
    """Whether the gather_rows kernel can copy rows of ``pool``: at least MIN_KERNEL_ROW
    values, a power of two (Triton blocks), not e8m0 scales; others take the XLA path."""
    d = pool.shape[-1]
    return d >= MIN_KERNEL_ROW and d & (d - 1) == 0 and pool.dtype != jnp.float8_e8m0fnu
_READERS = {impl: _reader(impl) for impl in ("xla", "triton")}


def read_host_rows(pool, row_ids, implementation: str | None = "xla"):
    """Copies rows of a host pool to the device: row_ids [..., n] (-1 = skip: NaN row) ->
    [..., n, D].

    "xla": one dynamic_slice + device_put per row (``pallas_kernels.gather_rows`` reference);
    "triton": the Pallas kernel that reads the pinned_host pool in place (None: the fastest
    available). Under ``vmap`` (one call per decode slot) the ids of every slot are flattened
    into one gather: the pool is shared by all slots and must not be batched.
    """
    impl = "triton" if implementation is None and on_gpu() else (implementation or "xla")
    if impl not in _READERS:
        raise ValueError(f"read_host_rows: implementation={implementation!r}; allowed: "
                         f"{sorted(_READERS)} or None")
    return _READERS[impl](pool, row_ids)


def write_host_page(pool, page, rows):
    """Rows page*P .. page*P+P-1 of the pool = rows ([P, D] device rows) -> the new host pool."""
    update = jax.device_put(rows.astype(pool.dtype), HOST)
    return jax.lax.dynamic_update_slice(pool, update, (page * rows.shape[0], 0))


def byte_view(pool, rows):
    """(pool, rows) with every FP8 pool leaf and its rows seen as uint8 bytes on a CPU
    backend (rows converted to the pool's dtype first); other leaves, and every leaf on a GPU,
    unchanged. XLA's CPU backend has no FP8 dynamic_update_slice: it converts the whole pool
    to f16 and back around each page written, O(pool) per page (measured: a 200-slot
    LeanSparse admission 15.7 s); as bytes the pages are written in place. Write the pages,
    then ``from_byte_view``."""
    return (jax.tree.map(as_bytes, pool),
            jax.tree.map(lambda p, r: as_bytes(r.astype(p.dtype)) if cpu_fp8(p.dtype) else r,
                         pool, rows))


def from_byte_view(viewed, like):
    """``byte_view``'s pool back in the dtypes of ``like`` (the pool before the view)."""
    return jax.tree.map(lambda v, p: from_bytes(v, p.dtype), viewed, like)


class CapacityError(RuntimeError):
    """An admission needs more pages than its pool has free now (it may fit after a
    release: a scheduler waits on it)."""


class HostCapacityError(CapacityError):
    """Admission needs more host pages than the pool has free."""


class PageAllocator:
    """Control-plane free list of pages (host pages shared by every CSA layer's pool, or
    ``memory.device_pool``'s device pages)."""

    def __init__(self, num_pages: int, error: type[CapacityError] = HostCapacityError,
                 pool: str = "host pool", setting: str = "CacheConfig.host_pages"):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._error, self._pool, self._setting = error, pool, setting

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, count: int, *, what: str) -> list[int]:
        if count > len(self._free):
            raise self._error(
                f"{self._pool} exhausted: {what} needs {count} pages, {len(self._free)} of "
                f"{self.num_pages} are free (raise {self._setting} or admit fewer "
                "requests)")
        return [self._free.pop() for _ in range(count)]

    def release(self, pages) -> None:
        pages = [int(p) for p in pages if p >= 0]
        if len(set(pages)) != len(pages) or set(pages) & set(self._free):
            raise ValueError(f"release: pages {pages} are not all allocated")
        self._free.extend(sorted(pages, reverse=True))
