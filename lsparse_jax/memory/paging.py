"""Data-plane page moves shared by the paged methods: a prefilled prefix to host pages, a
completed tail page to its host page, whole pages into a device page pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lsparse_jax.memory.host_pool import byte_view, from_byte_view, write_host_page
from pallas_kernels.common import as_bytes, from_bytes


@jax.jit
def clear_table_row(table, slot):
    """A page table [S, P] with row ``slot`` unmapped (-1). Jitted on the table alone: a jit
    that took the whole tier (its host pools included) and returned it would copy every pool
    on each call, since jit does not hand an input back as an output without donation."""
    return table.at[slot].set(-1)


def _padded(rows, page: int):
    """rows (a pytree of [N, ...] leaves) with P NaN rows after them."""
    return jax.tree.map(lambda r: jnp.concatenate(
        [r, jnp.full((page,) + r.shape[1:], jnp.nan, r.dtype)]), rows)


def _tail(padded, count, page: int):
    return jax.tree.map(lambda r: jax.lax.dynamic_slice_in_dim(r, count * page, page), padded)


def tail_page(rows, count, page: int):
    """rows[count*P:(count+1)*P] (a pytree of [N, ...] leaves), NaN past N."""
    return _tail(_padded(rows, page), count, page)


def page_out(pool, rows, pages, count, page: int, start=0):
    """Writes rows[j*P:(j+1)*P] to host page pages[j] for start <= j < count (pytrees of
    rows/pools; pages before ``start`` already hold their rows, e.g. a reused prefix's);
    returns (pool, the next P rows as the tail: ``tail_page``)."""
    rows = _padded(rows, page)
    tail = _tail(rows, count, page)
    viewed, written = byte_view(pool, rows)

    def body(j, out):
        chunk = jax.tree.map(lambda r: jax.lax.dynamic_slice_in_dim(r, j * page, page), written)
        return jax.tree.map(lambda p, c: write_host_page(p, pages[j], c), out, chunk)

    return from_byte_view(jax.lax.fori_loop(start, count, body, viewed), pool), tail


def put_pages(pool, dest, rows, count, page: int):
    """pool [NO * P, D] with page dest[j] = rows(j) [P, D], for j < count with dest[j] >= 0
    (other pages unchanged). ``pool`` and ``rows(j)`` may be pytrees of such arrays. FP8
    leaves move as bytes on CPU (``pallas_kernels.common.cpu_fp8``)."""
    dtypes = jax.tree.map(lambda leaf: leaf.dtype, pool)

    def body(j, out):
        at = jnp.maximum(dest[j], 0) * page

        def put(leaf, new, dtype):
            new = jnp.where(dest[j] >= 0, as_bytes(new.astype(dtype)),
                            jax.lax.dynamic_slice_in_dim(leaf, at, page))
            return jax.lax.dynamic_update_slice_in_dim(leaf, new, at, 0)

        return jax.tree.map(put, out, rows(j), dtypes)

    out = jax.lax.fori_loop(0, count, body, jax.tree.map(as_bytes, pool))
    return jax.tree.map(from_bytes, out, dtypes)


@struct.dataclass
class CompletedPages:
    """The slots whose last decode step completed a tail page (Notation: c such slots).

    A slot at position t writes compressed row t // m if t % m == m - 1; when that row ends a
    page, the tail goes to the slot's physical host page ``dest`` and is poisoned for reuse.
    The control plane knows which slots these are (it mirrors the lengths), so c is static:
    the writes are c unrolled page copies, with no loop whose trip count is on the device (a
    GPU while loop copies its predicate to the host on every trip).
    """

    slots: jnp.ndarray  # [c] int32 the slots
    dest: jnp.ndarray  # [c] int32 their physical host pages
    first: jnp.ndarray  # [c] int32 first compressed row of each completed page
    num_slots: int = struct.field(pytree_node=False)  # S

    @classmethod
    def of(cls, page_table, lengths, slots, stride: int, page: int) -> CompletedPages:
        """page_table [S, max_pages]; lengths [S] after the step; slots [c] int32."""
        row = (lengths[slots] - 1) // stride  # the row the step wrote
        logical = row // page
        return cls(slots, page_table[slots, logical], logical * page, page_table.shape[0])

    @staticmethod
    def completing(lengths_before: np.ndarray, active: np.ndarray, stride: int,
                   page: int) -> np.ndarray:
        """Host side: the slots whose step from ``lengths_before`` completes a page."""
        row = lengths_before // stride
        full = active & (lengths_before % stride == stride - 1) & ((row + 1) % page == 0)
        return np.flatnonzero(full).astype(np.int32)

    def for_each(self, fn, carry):
        """carry = fn(j, slot, carry) for each completing slot (unrolled: c is static)."""
        for j in range(self.slots.shape[0]):
            carry = fn(j, self.slots[j], carry)
        return carry

    def write_tails(self, pool, tails):
        """Each completing slot's tail (tails [S, P, ...], a pytree like ``pool``) to its page."""
        viewed, tails = byte_view(pool, tails)
        return from_byte_view(self.for_each(lambda j, s, p: jax.tree.map(
            lambda leaf, t: write_host_page(leaf, self.dest[j], t[s]), p, tails), viewed), pool)

    def poison(self, tail):
        """The tails of completing slots NaN (they start a new page)."""
        full = jnp.zeros((self.num_slots,), bool).at[self.slots].set(True)
        return jax.tree.map(lambda t: jnp.where(
            full.reshape((-1,) + (1,) * (t.ndim - 1)), jnp.nan, t), tail)


__all__ = ["CompletedPages", "page_out", "put_pages", "tail_page"]
