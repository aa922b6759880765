"""Pallas (Triton lowering) ``hot_resolve``: missed rows copied host -> hot row in place.

Notation: k selected positions, B hot rows, D values per row (a power of two for the
kernel), N pool rows, n = k (or S * k under vmap over S requests) copy slots.

Design: the control (hit scan, victims, stamps) is the XLA code of ``reference.resolve_control``
(small int arrays). The data movement is one kernel per row leaf, grid (n,): program j reads
src[j], dst[j] and, when src[j] >= 0, copies pool row src[j] [1, D] into hot row dst[j]. The
pool, the ids and the hot rows are passed with ``memory_space=pl.ANY``, so a pinned_host pool
is read in place over PCIe (zero-copy, as ``gather_rows``), and the hot rows are aliased to
the output (``input_output_aliases``): no [n, D] staging buffer and no copy of the B rows that
stay (when the caller donates or XLA can reuse the buffer). Skipped programs (hits, -1) touch
nothing; rows are copied without arithmetic, so FP8 bytes and NaN payloads are preserved.
Victims are distinct, so no two programs write one row. Ids are clamped to their tables before
the access so an id out of range (undefined) cannot write or read outside them.

Leaves whose D is not a power of two use the XLA row loop of ``reference.move_rows_xla``
(Triton blocks must have power-of-two sizes); narrow power-of-two leaves (one FP8 scale per
key, D = 1) take the kernel: the row loop moves one row per dynamic_slice + device_put, about
10 us a row on an H200, which made LeanSparse's key-cache misses dominate its decode step.
Leaves of e8m0 (the power-of-two scales of FP8 KV rows, ``kv_dtype="fp8_v4"``) also take the
row loop: the kernel has not been checked with that dtype under Triton.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.hot_resolve import reference


def kernel_row(d: int, dtype=jnp.float32) -> bool:
    """True when rows of D values go through the Triton kernel (D a power of two; e8m0 FP8
    row scales, not checked under Triton, take the XLA row loop)."""
    return d >= 1 and d & (d - 1) == 0 and dtype != jnp.float8_e8m0fnu


def _kernel(src_ref, dst_ref, pool_ref, rows_in_ref, rows_ref, *, pool_rows: int,
            hot_rows: int):
    # inputs
    #   src_ref      [n]     int32 pool row of each copy, -1 = none (whole array, ANY)
    #   dst_ref      [n]     int32 hot row of each copy (whole array, ANY)
    #   pool_ref     [N, D]  f32 / bf16 / float8_e4m3fn (whole array, device or pinned_host)
    #   rows_in_ref  [B, D]  the hot rows (aliased to rows_ref; not read)
    # outputs
    #   rows_ref     [B, D]  the hot rows, updated in place (whole array, device)
    # scratch: none
    del rows_in_ref
    j = pl.program_id(0)
    src, dst = src_ref[j], dst_ref[j]

    @pl.when((src >= 0) & (dst >= 0))
    def _copy():
        s, t = jnp.minimum(src, pool_rows - 1), jnp.minimum(dst, hot_rows - 1)
        rows_ref[pl.ds(t, 1), :] = pool_ref[pl.ds(s, 1), :]


def move_rows_triton(hot_rows, pool, src, dst, *, interpret: bool, num_warps: int):
    """hot_rows[dst[j]] = pool[src[j]] for src[j] >= 0, by the in-place kernel.

    hot_rows [B, D] device; pool [N, D] device or pinned_host; src, dst [n] int32. 1-byte
    rows move as words (``common.as_words``: a 2-4 GiB pool's offsets stay in int32).
    """
    from jax.experimental.pallas import triton as plt

    (n,), (b, d) = src.shape, hot_rows.shape
    if n == 0:
        return hot_rows
    if not kernel_row(d, hot_rows.dtype):
        return reference.move_rows_xla(hot_rows, pool, src, dst)
    like, hot_rows, pool = hot_rows, common.as_words(hot_rows), common.as_words(pool)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return common.from_words(pl.pallas_call(
        functools.partial(_kernel, pool_rows=pool.shape[0], hot_rows=b),
        out_shape=jax.ShapeDtypeStruct(hot_rows.shape, hot_rows.dtype),
        grid=(n,),
        in_specs=[any_spec] * 4,
        out_specs=any_spec,
        input_output_aliases={3: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps),
        interpret=interpret,
        name="hot_resolve_copy",
    )(src, dst, pool, hot_rows), like)


@functools.lru_cache(maxsize=None)
def _mover(interpret: bool, num_warps: int):
    return reference.vmappable(functools.partial(move_rows_triton, interpret=interpret,
                                       num_warps=num_warps))


@functools.partial(jax.jit, static_argnames=("page_size", "interpret", "num_warps"))
def hot_resolve_triton(selected, hot_rows, hot_positions, hot_stamps, clock, page_table, pool,
                       *, page_size: int, interpret: bool, num_warps: int = 1):
    """Pallas-Triton ``hot_resolve`` of one request (arguments checked by ``api.hot_resolve``;
    ``interpret`` resolved outside jit by ``common.interpret()``).

    Returns (slots [k], hot_rows, hot_positions, hot_stamps, clock + 1, counts [2]).
    """
    control = reference.resolve_control(selected, hot_positions, hot_stamps, clock,
                                        page_table, page_size=page_size)
    mover = _mover(interpret, num_warps)
    return reference.apply_control(control, clock, hot_rows, pool, lambda d: mover)
