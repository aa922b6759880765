"""Data-plane page moves shared by the paged methods: a prefilled prefix to host pages, a
completed tail page to its host page, whole pages into a device page pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.memory.host_pool import write_host_page


def page_out(pool, rows, pages, count, page: int):
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


def put_pages(pool, dest, rows, count, page: int):
    """pool [NO * P, D] with page dest[j] = rows(j) [P, D], for j < count with dest[j] >= 0
    (other pages unchanged)."""
    def body(j, out):
        at = jnp.maximum(dest[j], 0) * page
        new = jnp.where(dest[j] >= 0, rows(j), jax.lax.dynamic_slice_in_dim(out, at, page))
        return jax.lax.dynamic_update_slice_in_dim(out, new.astype(out.dtype), at, 0)

    return jax.lax.fori_loop(0, count, body, pool)


@struct.dataclass
class CompletedPages:
    """Which slots completed a tail page in a decode step (Notation: S slots, P page rows).

    A slot at position t wrote compressed row t // m if t % m == m - 1; when that row ends a
    page, the tail goes to the slot's physical host page ``dest`` and is poisoned for reuse.
    """

    full: jnp.ndarray  # [S] bool the slot completed a page this step
    dest: jnp.ndarray  # [S] int32 its physical host page
    first: jnp.ndarray  # [S] int32 first compressed row of that page
    order: jnp.ndarray  # [S] int32 slots with a completed page first
    count: jnp.ndarray  # [] int32 how many did

    @classmethod
    def of(cls, page_table, lengths_before, active, stride: int, page: int) -> CompletedPages:
        row = lengths_before // stride
        full = active & (lengths_before % stride == stride - 1) & ((row + 1) % page == 0)
        dest = jnp.take_along_axis(page_table, (row // page)[:, None], axis=1)[:, 0]
        return cls(full, dest, (row // page) * page, jnp.argsort(~full, stable=True),
                   jnp.sum(full))

    def for_each(self, fn, carry):
        """carry = fn(slot, carry) for each completing slot."""
        return jax.lax.fori_loop(0, self.count, lambda j, c: fn(self.order[j], c), carry)

    def write_tails(self, pool, tails):
        """Each completing slot's tail (tails [S, P, ...], a pytree like ``pool``) to its page."""
        return self.for_each(lambda s, p: jax.tree.map(
            lambda leaf, t: write_host_page(leaf, self.dest[s], t[s]), p, tails), pool)

    def poison(self, tail):
        """The tails of completing slots NaN (they start a new page)."""
        return jax.tree.map(lambda t: jnp.where(
            self.full.reshape((-1,) + (1,) * (t.ndim - 1)), jnp.nan, t), tail)


__all__ = ["CompletedPages", "page_out", "put_pages"]
