"""Public entry point of ``hot_resolve``: HiSparse hot-cache resolve of one request.

Notation: k selected positions (best first, -1 = nothing), B hot rows (k <= B), D values per
row, P = page_size rows per host page, MP logical pages, N = NP * P rows of the flat host pool.

Math (an LRU cache of B rows, one step):
  1. hits: a bounded [k, B] scan of hot_positions for each selected position;
  2. the M misses take the M least-recently-used rows among the rows not hit this step
     (empty rows first, ties by lowest row index), the m-th miss (in selection order) the m-th
     victim in row order, and their rows are copied from pool row page_table[p // P] * P +
     p % P;
  3. every touched row gets stamp clock * k + rank (rank = index in ``selected``), so the LRU
     order is the order of use; victims get their new position.
Positions in ``selected`` must be distinct (a selection gives distinct positions; a repeat
would miss twice and take two rows). Rows may be pytrees (e.g. FP8 keys and their scales): the
control is computed once and every leaf moves.

Implementations: "xla" (``reference.py``: one ``dynamic_slice`` + ``device_put`` per missed
row), "triton_copy" (``triton.py``: XLA control, then one Pallas-Triton kernel per leaf reads
each missed row from the pinned_host pool in place and writes it into its victim row, aliased;
interpret mode without a GPU; leaves with D not a power of two and e8m0 leaves use the XLA
loop), "triton_fused" (``fused.py``: the control in-kernel too, three launches for all
requests and leaves, no XLA ops around them; any leaf dtype of ``DTYPES``, any D),
"triton_fused2" (the same kernels in two launches: map and control of a request in one
program, ordered by a block barrier, then apply), and "triton", the decode steps' switch, which
runs ``TRITON_RUNS``. None picks "triton" on a GPU and "xla" elsewhere. Both are vmappable
over requests (the pool shared: in_axes=None); under vmap every request's misses go through
one loop / one kernel launch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.hot_resolve.packed import PackedPool, pack, unpack

OP = "hot_resolve"
AVAILABLE = ("xla", "triton", "triton_fused", "triton_fused2", "triton_copy")
FASTEST_ON_GPU = "triton"
# What implementation="triton" (the decode steps' switch) runs: "triton_fused2" (control
# in-kernel, two launches; H200, session 17, B 64, k 512, donated: 0.162 / 0.116 ms per call
# at 5% / 0% misses, device span 95.8 / 24.3 us, vs "triton_fused" 0.196 / 0.118 ms and
# 97.3 / 26.0 us, "triton_copy" 0.317 / 0.262 ms); tests pin each explicitly.
TRITON_RUNS = "triton_fused2"
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e8m0fnu)
WORDS = (jnp.uint32,)  # the packed rows of a PackedPool on the paths that move one array


def _array(x):
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def _check(selected, hot_rows, hot_positions, hot_stamps, clock, page_table, pool,
           page_size, dtypes) -> None:
    """Raises ValueError naming the first argument with a bad shape, dtype or value
    (``dtypes``: the int dtypes the caller passed, before jnp.asarray narrows int64)."""
    def fail(arg, what):
        raise ValueError(f"{OP}: {arg} {what}")

    for name, x, ndim in (("selected", selected, 1), ("hot_positions", hot_positions, 1),
                          ("hot_stamps", hot_stamps, 1), ("clock", clock, 0),
                          ("page_table", page_table, 1)):
        if x.ndim != ndim:
            fail(name, f"must have {ndim} dimension(s), got shape {x.shape}")
        if dtypes[name] != jnp.int32:
            fail(name, f"must be int32, got {dtypes[name]}")
    k, b = selected.shape[0], hot_positions.shape[0]
    if b < 1:
        fail("hot_positions", "must have at least one row (B >= 1)")
    if hot_stamps.shape != (b,):
        fail("hot_stamps", f"must be [B] = [{b}], got shape {hot_stamps.shape}")
    if k > b:
        fail("selected", f"has k={k} positions > B={b} hot rows; k <= B is required (every "
             "miss needs a victim row)")
    if page_table.shape[0] < 1:
        fail("page_table", "must have at least one page")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        fail("page_size", f"must be a positive int, got {page_size!r}")
    rows, treedef = jax.tree.flatten(hot_rows)
    if not rows:
        fail("hot_rows", "must hold at least one array")
    for r in rows:
        if r.ndim != 2 or r.shape[0] != b:
            fail("hot_rows", f"leaves must be [B, D] with B={b}, got shape {r.shape}")
        if r.dtype not in DTYPES + WORDS:
            fail("hot_rows", f"must be float32, bfloat16, float8_e4m3fn, float8_e8m0fnu (or "
                 f"uint32 words of packed rows), got {r.dtype}")
    if isinstance(pool, PackedPool):
        want = tuple((jnp.dtype(r.dtype).name, int(r.shape[1])) for r in rows)
        if pool.treedef != treedef or pool.layout != want:
            fail("pool", f"packs rows {pool.layout} ({pool.treedef}); hot_rows are {want} "
                 f"({treedef})")
        w = sum(width for _, width in pool.offsets)
        if pool.words.ndim != 2 or pool.words.shape[1] != w or pool.words.dtype != jnp.uint32:
            fail("pool", f"words must be [N, W={w}] uint32, got {pool.words.shape} "
                 f"{pool.words.dtype}")
        if pool.words.shape[0] < page_size or pool.words.shape[0] % page_size:
            fail("pool", f"must hold whole pages of P={page_size} rows, got "
                 f"{pool.words.shape[0]} rows")
        return
    pools, pool_def = jax.tree.flatten(pool)
    if pool_def != treedef:
        fail("pool", f"must have the structure of hot_rows ({treedef}), got {pool_def}")
    for r, p in zip(rows, pools):
        if p.ndim != 2 or p.shape[1] != r.shape[1]:
            fail("pool", f"leaves must be [N, D] with D={r.shape[1]}, got shape {p.shape}")
        if p.dtype != r.dtype:
            fail("pool", f"must have the dtype of hot_rows ({r.dtype}), got {p.dtype}")
        if p.shape[0] < page_size or p.shape[0] % page_size:
            fail("pool", f"must hold whole pages of P={page_size} rows, got {p.shape[0]} rows")


def hot_resolve(selected, hot_rows, hot_positions, hot_stamps, clock, page_table, pool, *,
                page_size: int, implementation: common.Implementation | None = None):
    """Makes the selected positions resident in the hot cache of one request.

    Inputs:
      selected      [k]       int32 positions to make resident (best first); -1 = nothing
      hot_rows      [B, D]    f32 / bf16 / float8_e4m3fn / float8_e8m0fnu cached rows, NaN
                              where empty (or a pytree of [B, D_i] leaves)
      hot_positions [B]       int32 position held by each hot row, -1 empty
      hot_stamps    [B]       int32 LRU stamps (clock * k + rank), -1 empty
      clock         []        int32 steps served
      page_table    [MP]      int32 physical host page of each logical page
      pool          [N, D]    device or pinned_host flat pool (pytree like hot_rows); row r of
                              physical page p at p * P + r; left where it is. Or a
                              ``packed.PackedPool`` [N, W] of the same rows' leaves side by
                              side (one read a missed row; "triton_fused*" read it in place,
                              the other paths pack the hot rows alike and unpack them after)
    Outputs:
      slots [k] int32 hot row of each selected position (-1 where selected is -1),
      hot_rows, hot_positions, hot_stamps (new), clock + 1, counts [2] int32 (hits, misses)
    Raises ValueError for bad shapes/dtypes/values (naming the argument), k > B, or
    implementations.
    """
    impl = common.choose(OP, implementation, AVAILABLE, FASTEST_ON_GPU)
    if impl == "triton":
        impl = TRITON_RUNS
    ints = dict(selected=selected, hot_positions=hot_positions, hot_stamps=hot_stamps,
                clock=clock, page_table=page_table)
    dtypes = {n: jnp.dtype(x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype)
              for n, x in ints.items()}
    selected, hot_positions, hot_stamps, clock, page_table = map(_array, ints.values())
    hot_rows, pool = jax.tree.map(_array, hot_rows), jax.tree.map(_array, pool)
    _check(selected, hot_rows, hot_positions, hot_stamps, clock, page_table, pool, page_size,
           dtypes)
    args = (selected, hot_rows, hot_positions, hot_stamps, clock, page_table, pool)
    if isinstance(pool, PackedPool) and impl not in ("triton_fused", "triton_fused2"):
        # the other paths move one array: the hot rows packed alike, then unpacked (copies)
        out = hot_resolve(selected, pack(hot_rows), hot_positions, hot_stamps, clock,
                          page_table, pool.words, page_size=page_size, implementation=impl)
        return (out[0], unpack(out[1], pool.layout, pool.treedef)) + tuple(out[2:])
    if impl in ("triton_fused", "triton_fused2"):
        from pallas_kernels.hot_resolve.fused import hot_resolve_fused

        return hot_resolve_fused(*args, page_size=page_size, interpret=common.interpret(),
                                 launches=2 if impl == "triton_fused2" else 3)
    if impl == "triton_copy":
        from pallas_kernels.hot_resolve.triton import hot_resolve_triton

        return hot_resolve_triton(*args, page_size=page_size, interpret=common.interpret())
    from pallas_kernels.hot_resolve.reference import hot_resolve_xla

    return hot_resolve_xla(*args, page_size=page_size)
