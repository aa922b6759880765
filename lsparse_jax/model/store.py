"""How a CSA layer keeps its compressed history: the two interfaces the model calls, and the
model's own resident implementation of each.

A CSA layer adds compressed KV rows and FP8 indexer keys as tokens arrive, selects top-k
positions with its indexer, and attends to the selected rows. Where rows and keys live (the
device, host pages behind a cache, PQ codes) and how the selection is computed from them are a
serving method's choice, so the model only calls:

  ``KVStore``   empty(num_rows, row_format) -> state
                write(state, completed, ids, rows, ok) -> state
                gather(state, completed, selected, context) -> (state, RowView)
                follow(state, completed, locations, context) -> (state, RowView)
                  (a DSA member layer: its own rows at the leader's ``Locations``)
                all_rows(state) -> [N, ...] (the dense reference; resident layouts only)
  ``KeyIndex``  write(state, completed, ids, values, scales, ok) -> state
                select(state, completed, query, eligible, context) -> (state, Selection)

KV rows are stored in the model's ``quant.KVRowFormat`` (``ModelConfig.kv_dtype``): the layer
encodes rows before ``write`` and decodes what ``gather`` / ``all_rows`` return, so a store
only moves rows, a pytree of per-row arrays (one f32 or bf16 array, or FP8Rows' three).
``completed`` is the number of compressed rows the slot held before this chunk; ``context`` is
what the method lends one slot's layer from shared state (its host pages, page-table row, PQ
codebooks; None for resident). Implementations are frozen dataclasses: hashable, static under
jit. ``RESIDENT_KV`` and ``EXACT_INDEX`` are the model's native layout (training, prefill, the
``resident`` method); ``lsparse_jax.methods`` supplies the others.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.indexing.topk import select_topk
from lsparse_jax.kernels import for_op
from lsparse_jax.model.layers import PRECISIONS, precision
from lsparse_jax.parallel import head_sum
from lsparse_jax.quant import KVRowFormat, dequantize_index_keys
from pallas_kernels.common import on_gpu
from pallas_kernels.index_logits import index_logits
from pallas_kernels.index_scores.api import index_scores
from pallas_kernels.index_scores.reference import exact_index_scores

NUM_SOURCES = 3  # a selected row was found in: 0 tail / resident (or lent) map, 1 cache, 2 host


@struct.dataclass
class Selection:
    """What a sparse layer's indexer chose for each query of a chunk."""

    positions: jnp.ndarray  # [T, k] int32, best first, -1 padded
    eligible: jnp.ndarray  # [T] int32 eligible positions per query
    sources: jnp.ndarray  # [T, 3] int32 selected KV rows found in (tail/resident, hot, host)
    key_sources: jnp.ndarray  # [T, 3] int32 exact keys scored from (tail/resident, cache, host)
    locations: Any = None  # DSA share-group leaders: the location vector of the resolved
    #   selection (``Locations``) that member layers read their own rows at; None elsewhere
    band: Any = None  # [T, P] int32 positions ranked k .. k + P - 1 (-1 padded): what a
    #   prefetching store also loads (``ExactIndex.band``, echo); None without prefetch
    prefetched: Any = None  # [T] int32 band rows the store copied from the host; None: none


@struct.dataclass
class IndexerQuery:
    """The indexer's queries of a chunk (Notation: T queries, H indexer heads, D indexer dim)."""

    q: jnp.ndarray  # [T, H, D] f32 RoPE'd indexer queries
    weights: jnp.ndarray  # [T, H] f32 head weights (already scaled by (H * D)^-1/2)
    # the arithmetic of a decode step's exact scores (``IndexerConfig.score_precision``)
    precision: str = struct.field(pytree_node=False, default="f32")


@struct.dataclass
class RowView:
    """Selected rows as the attention reads them: query t's j-th row is table[0, slots[t, j]].

    The resident store lends its whole table (the kernel gathers in place); a paged store
    returns the k resolved rows and slots 0..k-1. Rows are in the stored format (a pytree
    of [1, R, ...] leaves; ``KVRowFormat.decode`` gives [1, R, D] f32).
    """

    table: jnp.ndarray  # [1, R, D] rows, or a pytree of [1, R, ...] (NaN where never written)
    slots: jnp.ndarray  # [T, k] int32 row of each selected position in table[0], -1 none
    sources: jnp.ndarray  # [T, 3] int32 where the selected rows were found (NUM_SOURCES)
    plan: Any = None  # how the store filled ``table`` (a paged store's resolve plan,
    #   ``memory.hot_cache.Plan``); None: the table is the store's resident table


@struct.dataclass
class Locations:
    """The location vector of a selection resolved by a share group's leader: where each
    selected row sits, so that member layers read *their own* rows there without resolving
    the selection again (GLM-5 index sharing with per-layer payloads; Adaptive DHiSparse's
    "reuse layers inherit the prior location vector").

    A member's store rebuilds its table from ``plan`` (a paged store: the same tail rows, lent
    pages and hot rows as the leader's, after copying the leader's misses from its own host
    pages into the same victim rows: each missing row fetched once per member layer, never
    decided twice) and reads row ``slots[t, j]`` of it (``KVStore.follow``).
    Under V4-style KV-source sharing (``ModelConfig.dsa_shared_kv``) the members have no rows
    of their own: they read the leader's resolved ``table`` at ``slots`` (location reuse), or
    resolve the selection against the leader's ``source`` a second time (no location reuse:
    the reference; its rows are all on the device by then, so it fetches nothing).
    """

    slots: jnp.ndarray  # [T, k] int32 row of each selected position in the table, -1 none
    plan: Any = None  # the leader's RowView.plan
    table: Any = None  # dsa_shared_kv: the leader's RowView.table [1, R, D]
    source: Any = None  # dsa_shared_kv without location reuse: (the leader's KV state after
    #   its resolve, its context)


class KVStore(Protocol):
    """Where a CSA layer's compressed KV rows live and how selected rows are read."""

    def empty(self, num_rows: int, rows: KVRowFormat) -> Any: ...

    def write(self, state, completed, ids, rows, ok) -> Any: ...

    def gather(self, state, completed, selected, context) -> tuple[Any, RowView]: ...

    def follow(self, state, completed, locations: Locations, context) -> tuple[Any, RowView]: ...

    def all_rows(self, state) -> Any: ...


class KeyIndex(Protocol):
    """Where a CSA layer's FP8 indexer keys live and how the top-k positions are selected."""

    def empty(self, num_rows: int, dim: int, num_scales: int) -> Any: ...

    def write(self, state, completed, ids, values, scales, ok) -> Any: ...

    def select(self, state, completed, query: IndexerQuery, eligible,
               context) -> tuple[Any, Selection]: ...


def select_each(select, state, completed, query: IndexerQuery, eligible, context,
                per_query: tuple = ()):
    """A block of T queries' selections (query [T, H, D], eligible [T, N]: a verification
    block, each query with its own causal top-k) as T ``select`` calls in order (a
    ``KeyIndex.select``, given each query's entries of ``per_query`` arrays [T, ...] as extra
    arguments), the index state threaded through them; (state, Selection with a leading T
    axis)."""
    def one(st, xs):
        q, w, ok, *extra = xs
        st, sel = select(st, completed, IndexerQuery(q[None], w[None], query.precision),
                         ok[None], context, *extra)
        return st, jax.tree.map(lambda a: a[0], sel)

    # unrolled: T is small, and a GPU while loop would copy its predicate to the host
    return jax.lax.scan(one, state, (query.q, query.weights, eligible, *per_query),
                        unroll=True)


def select_block(index: KeyIndex, state, completed, query: IndexerQuery, eligible, context):
    """``select_each`` of ``index.select``, through ``index.select_block`` where the index has
    one (a batched form with the same results, e.g. LeanSparse's coarse pass over the block
    at once)."""
    own = getattr(index, "select_block", None)
    if own is not None:
        return own(state, completed, query, eligible, context)
    return select_each(index.select, state, completed, query, eligible, context)


def write_rows(table, ids: jnp.ndarray, rows, ok: jnp.ndarray):
    """table[ids[j]] = rows[j] where ok[j]; other rows are dropped (never written). ``table``
    and ``rows`` may be pytrees of arrays with the row axis first (each leaf is written)."""
    size = jax.tree.leaves(table)[0].shape[0]
    ids = jnp.where(ok, ids, size)  # out of bounds -> dropped
    return jax.tree.map(lambda t, r: t.at[ids].set(r.astype(t.dtype), mode="drop"), table, rows)


def resident_counts(selected) -> jnp.ndarray:
    """Counts [T, 3] of selected rows [T, k] that a resident store holds: all valid ones."""
    counts = jnp.zeros(selected.shape[:1] + (NUM_SOURCES,), jnp.int32)
    return counts.at[:, 0].set(jnp.sum(selected >= 0, axis=-1))


SCORE_TILE_BYTES = 1 << 30  # most bytes of f32 scores (or head-by-key products) at once
FUSED_MIN_QUERIES = 16  # fewer queries (a decode step's one) stay in XLA's fused reduction


def logits_of_queries(num_queries: int, implementation: str | None):
    """(fn(q [T, H, D], weights [T, H], keys [N, D], num_keys) -> scores [T, N] f32, per_head);
    scores at n >= num_keys (an int32 scalar) are not to be used (a caller masks them).

    The ``index_logits`` kernel (products and head sum in registers; the key blocks past
    num_keys skipped) when the engine asks for kernels, the model's matmuls are bf16
    (``ModelConfig.matmul_precision="bf16"``, the kernel's numerics) and there are at least
    ``FUSED_MIN_QUERIES`` queries (a prefill chunk); else ``exact_index_scores`` of all N keys
    at the model's matmul precision, which materializes the [T, H, N] products (per_head True:
    a caller sizes its query tiles by them). A decode step's few queries with kernels do not
    come here: ``decode_kernel``."""
    kernel = for_op("index_logits", implementation)  # the engine's -> the op's
    if kernel is None:
        kernel = "triton" if on_gpu() else "xla"
    if kernel == "triton" and precision() == PRECISIONS["bf16"] \
            and num_queries >= FUSED_MIN_QUERIES:
        return functools.partial(index_logits, implementation="triton"), False
    scores = functools.partial(exact_index_scores, precision=precision())
    return (lambda q, weights, keys, num_keys: scores(q, weights, keys)), True


def decode_kernel(num_queries: int, implementation: str | None,
                  op: str = "index_scores") -> str | None:
    """The ``index_scores`` kernel that scores a decode step's stored FP8 keys (fewer than
    ``FUSED_MIN_QUERIES`` queries: one a slot, or a verification block's few) when the engine
    asks for kernels; None: ``logits_of_queries``' forms. op "index_scores_paged": the same
    choice for keys read in place from device page pools (``memory.device_pool``).

    Why: the XLA form dequantizes the N keys to f32 and writes the [T, H, N] products (at 512K
    context, batch 8, 64 heads: ~0.43 ms a CSA layer of HiSparse's step on the H200, session
    32), where the kernel reads the FP8 keys once (132 B a key) with the products in registers.
    LeanSparse rescores its candidates with the same op, so both methods' exact scores of a key
    are the same arithmetic."""
    if num_queries >= FUSED_MIN_QUERIES:
        return None
    kernel = for_op(op, implementation)
    if kernel is None:
        kernel = "triton" if on_gpu() else "xla"
    return None if kernel == "xla" else kernel


FP8_SCORING = {"xla": "xla_fp8", "triton": "triton_fp8", "xla_fp8": "xla_fp8",
               "triton_fp8": "triton_fp8"}  # a scoring op's implementation -> its fp8 form


def decode_scoring(num_queries: int, implementation: str | None, precision: str = "f32",
                   op: str = "index_scores") -> str | None:
    """``decode_kernel``'s choice at ``IndexerConfig.score_precision`` ``precision``: at
    "fp8" a decode step's scores always go through the op (its "triton_fp8", or "xla_fp8"
    where ``decode_kernel`` leaves them to XLA's forms); a prefill chunk's (None) are
    unchanged. Raises ValueError for an implementation with no fp8 form."""
    kernel = decode_kernel(num_queries, implementation, op)
    if precision == "f32" or num_queries >= FUSED_MIN_QUERIES:
        return kernel
    return fp8_scoring(kernel or "xla", op)


def fp8_scoring(kernel: str, op: str = "index_scores") -> str:
    """The fp8 form of the scoring op's implementation ``kernel`` (``FP8_SCORING``)."""
    if kernel not in FP8_SCORING:
        raise ValueError(f"{op}: implementation={kernel!r} has no fp8 form for "
                         f"score_precision='fp8'; forms: {sorted(FP8_SCORING)}")
    return FP8_SCORING[kernel]


def decode_scores(kernel: str, values, scales):
    """fn(q [T, H, D], weights [T, H], eligible [T, N]) -> [T, N] f32 scores of the stored
    FP8 keys (values [N, D] e4m3, scales [N, D/b] f32) by the ``index_scores`` op's ``kernel``;
    -inf where not eligible (their NaN poison never reaches a score). Each query is its own
    call of the op (a [1, N] problem), so a verification block's query t gets the same scores
    as the decode step of that position (no dependence on T)."""
    # tp > 1: each device scores with its heads; the partial scores are summed
    exact = head_sum(functools.partial(index_scores, implementation=kernel),
                     (1, 1, None, None, None))
    return each_query(lambda q, w, ok: exact(q[None], w[None], values[None], scales[None],
                                             ok[None])[0])


def each_query(one):
    """fn(q [T, H, D], weights [T, H], eligible [T, N]) -> [T, N] from one(q [H, D], w [H],
    ok [N]) -> [N]: each query its own call (no loop for T = 1, a decode step), so a
    verification block's query t is scored as the decode step of that position."""
    def scores(q, w, eligible):
        if q.shape[0] == 1:
            return one(q[0], w[0], eligible[0])[None]
        return jax.lax.map(lambda a: one(*a), (q, w, eligible))

    return scores


def query_tile(num_queries: int, bytes_per_query: int, budget: int) -> int:
    """Queries whose scores are computed at once: all of them if they fit in ``budget`` bytes,
    else the largest power of two that fits (at least 1)."""
    if num_queries * bytes_per_query <= budget:
        return num_queries
    tile = 1
    while tile * 2 * bytes_per_query <= budget:
        tile *= 2
    return tile


def exact_selection(query: IndexerQuery, values, scales, eligible, top_k: int,
                    tile_bytes: int = SCORE_TILE_BYTES,
                    implementation: str | None = "xla", band: int = 0) -> Selection:
    """Exact top-k of eligible stored keys.

    Notation: T queries, H heads, D dim, N stored keys.
      query.q [T, H, D], query.weights [T, H]; values [N, D] e4m3, scales [N, D/b] f32;
      eligible [T, N] bool.
    Math: I(t, n) = sum_h w_h ReLU(q_h . k_n) with k_n the dequantized key; top-k by I.
    Scores: a decode step's few queries with kernels: the ``index_scores`` op on the FP8 keys
    (``decode_kernel``); else ``logits_of_queries`` (the ``index_logits`` kernel for a prefill
    chunk with kernels and bf16 matmuls; else the XLA form).
    Memory: the scores (XLA form: the per-head dot products [t, H, N] f32) are computed for
    tiles of t queries at a time, t the largest power of two within ``tile_bytes`` (a prefill
    chunk of 4096 queries over 256K keys with 64 heads would otherwise need 256 GiB in the XLA
    form). Each query's selection does not depend on the tiling.
    Top-k: ``indexing.select_topk`` through the ``topk`` op's ``implementation`` (the same
    positions in the same order as "xla"). band > 0: the top-(k + band) is taken and split,
    the first k the selection (best first, so exactly the top-k) and the next ``band`` its
    ``Selection.band``.
    """
    num, heads = query.q.shape[:2]
    take = top_k + band
    kernel = decode_scoring(num, implementation, query.precision)
    if kernel is not None:
        scores = decode_scores(kernel, values, scales)(query.q, query.weights, eligible)
        return ranked_selection(scores, eligible, top_k, implementation, band)

    keys = dequantize_index_keys(values, scales)  # [N, D] f32
    logits, per_head = logits_of_queries(num, implementation)
    # tp > 1: each device scores with its heads; the partial scores are summed before top-k
    scores = head_sum(logits, (1, 1, None, None))

    def select(q, w, ok):
        # the keys any of these queries may select: past the last eligible one, none counts
        num_keys = jnp.max(jnp.where(jnp.any(ok, axis=0), jnp.arange(ok.shape[1]) + 1, 0))
        return select_topk(scores(q, w, keys, num_keys), ok, take, implementation)[0]

    tile = query_tile(num, (heads if per_head else 1) * keys.shape[0] * 4, tile_bytes)
    if tile >= num:
        positions = select(query.q, query.weights, eligible)
    else:  # pad to whole tiles (padding selects nothing), map over them, drop the padding
        pad = -num % tile
        tiles = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(
            (-1, tile) + a.shape[1:]) for a in (query.q, query.weights, eligible)]
        positions = jax.lax.map(lambda a: select(*a), tuple(tiles)).reshape(-1, take)[:num]
    return _selection(positions, eligible, top_k, band)


def ranked_selection(scores, eligible, top_k: int, implementation: str | None,
                     band: int = 0) -> Selection:
    """``exact_selection``'s top-k (and band) of scores [T, N] already computed."""
    positions = select_topk(scores, eligible, top_k + band, implementation)[0]
    return _selection(positions, eligible, top_k, band)


def _selection(positions, eligible, top_k: int, band: int) -> Selection:
    """The ``Selection`` of ranked positions [T, top_k + band] (the last ``band``: the band)."""
    positions, ranked_next = positions[:, :top_k], positions[:, top_k:]
    counts = jnp.sum(eligible, axis=-1).astype(jnp.int32)
    scored = jnp.zeros((positions.shape[0], NUM_SOURCES), jnp.int32).at[:, 0].set(counts)
    return Selection(positions, counts, resident_counts(positions), scored,
                     band=ranked_next if band else None)


@struct.dataclass
class ResidentKV:
    entries: Any  # [N, D] f32 every compressed row of the slot (NaN past its length), or the
    #   pytree of [N, ...] arrays of another KVRowFormat


@dataclasses.dataclass(frozen=True)
class ResidentKVStore:
    """Every compressed row on the device; the attention reads the table in place."""

    def empty(self, num_rows: int, rows: KVRowFormat) -> ResidentKV:
        return ResidentKV(rows.empty(num_rows))

    def write(self, state: ResidentKV, completed, ids, rows, ok) -> ResidentKV:
        return state.replace(entries=write_rows(state.entries, ids, rows, ok))

    def gather(self, state: ResidentKV, completed, selected, context):
        table = jax.tree.map(lambda e: e[None], state.entries)
        return state, RowView(table, selected, resident_counts(selected))

    def follow(self, state: ResidentKV, completed, locations: Locations, context):
        """A member layer's own table read at the leader's slots (the positions)."""
        return self.gather(state, completed, locations.slots, context)

    def all_rows(self, state: ResidentKV):
        return state.entries


@struct.dataclass
class ResidentKeys:
    values: jnp.ndarray  # [N, D_I] float8_e4m3fn every key of the slot; NaN past its length
    scales: jnp.ndarray  # [N, D_I / fp8_block] f32


@dataclasses.dataclass(frozen=True)
class ExactIndex:
    """Every FP8 indexer key on the device; exact top-k over all eligible keys (and with
    ``band`` > 0 the next ``band`` ranked positions as ``Selection.band``: echo's prefetch)."""

    top_k: int
    implementation: str | None = "xla"  # the top-k kernel (``topk`` op implementation)
    band: int = 0

    def empty(self, num_rows: int, dim: int, num_scales: int) -> ResidentKeys:
        return ResidentKeys(values=jnp.full((num_rows, dim), jnp.nan, jnp.float8_e4m3fn),
                            scales=jnp.full((num_rows, num_scales), jnp.nan, jnp.float32))

    def write(self, state: ResidentKeys, completed, ids, values, scales, ok) -> ResidentKeys:
        return state.replace(values=write_rows(state.values, ids, values, ok),
                             scales=write_rows(state.scales, ids, scales, ok))

    def select(self, state: ResidentKeys, completed, query, eligible, context):
        return state, exact_selection(query, state.values, state.scales, eligible, self.top_k,
                                      implementation=self.implementation, band=self.band)


RESIDENT_KV = ResidentKVStore()


@struct.dataclass
class HCAKernelView:
    """An HCA layer's rows as its decode attention kernel reads them: position n's row is
    table[0, slots[n]] (slots -1: not in the table), then the ``extra`` rows at positions
    ``extra_pos`` (the page being filled; None: none), which ride with the window rows."""

    table: Any  # [1, R, ...] stored rows (a pytree), read in place (a device pool: shared)
    slots: jnp.ndarray  # [N] int32 table row of each position, -1 none
    extra: Any = None  # [E, ...] stored rows
    extra_pos: jnp.ndarray | None = None  # [E] int32 their positions


@dataclasses.dataclass(frozen=True)
class ResidentRowStore:
    """Where an HCA layer keeps its compressed rows, in the stored format ``rows`` of
    ``empty`` (``quant.KVRowFormat``: the caller encodes and decodes): every row in the slot
    (the model's layout; a serving method may page them, ``memory.device_pool.PooledRowStore``).

      empty(num_rows, rows) -> state;  write(state, completed, ids, stored rows, ok) -> state;
      rows(state, completed, num_rows, context) -> [num_rows, ...] stored rows (NaN where
      never written);  kernel_view(state, completed, num_rows, context) -> what the decode's
      sparse_attention kernel reads (``HCAKernelView``).
    ``page_rows`` (P_h, a serving method's HCA rows per device page): the kernel view hands
    positions from the last complete page of P_h rows on as ``extra`` rows, as a pooled store
    hands its tail, so a method with and without device pools gives the kernel the same rows
    in the same order (the same output bit for bit). None: every position in the table.
    """

    page_rows: int | None = None

    def empty(self, num_rows: int, rows: KVRowFormat):
        return rows.empty(num_rows)

    def kernel_view(self, state, completed, num_rows: int, context) -> HCAKernelView:
        pos = jnp.arange(num_rows)
        table = jax.tree.map(lambda t: t[None], state)
        if self.page_rows is None:
            return HCAKernelView(table, pos)
        paged = (completed // self.page_rows) * self.page_rows
        extra_pos = paged + jnp.arange(self.page_rows)
        extra = jax.tree.map(lambda t: t[jnp.clip(extra_pos, 0, num_rows - 1)], state)
        in_table = (pos < paged) | (pos >= paged + self.page_rows)  # (a chunk's rows past
        #  the page: in the table; a decode adds none there)
        return HCAKernelView(table, jnp.where(in_table, pos, -1), extra, extra_pos)

    def write(self, state, completed, ids, rows, ok):
        return write_rows(state, ids, rows, ok)

    def rows(self, state, completed, num_rows: int, context):
        return state


RESIDENT_ROWS = ResidentRowStore()


@dataclasses.dataclass(frozen=True)
class DSAStores:
    """Where GLM-5-style DSA layers keep their per-token KV rows (f32) and FP8 indexer keys.

    A share group's leader (``ModelConfig.dsa_leader``) writes its rows through ``kv``, its
    keys through ``keys`` and selects with ``keys``; it then gathers the selection through
    ``kv`` and hands the resolved ``Locations`` on with its ``Selection``. Each member layer
    keeps its own rows in ``member`` (no keys, no indexer) and reads them with
    ``member.follow`` at the leader's locations. The model's layout is resident
    (``RESIDENT_DSA``); a serving method supplies paged ones (``Method.dsa_stores``).
    """

    kv: Any = RESIDENT_KV  # KVStore of the leaders' rows
    keys: KeyIndex | None = None  # the leaders' KeyIndex; None: ExactIndex(top_k)
    member: Any = RESIDENT_KV  # KVStore of the members' rows (``follow``)
    location_reuse: bool = True  # dsa_shared_kv members read the leader's resolved rows
    #   (True) or resolve its selection against its store again (``CacheConfig``)


RESIDENT_DSA = DSAStores()

__all__ = ["DSAStores", "ExactIndex", "IndexerQuery", "KVStore", "KeyIndex", "Locations",
           "NUM_SOURCES", "RESIDENT_DSA", "RESIDENT_KV", "RESIDENT_ROWS", "ResidentKV",
           "ResidentKVStore", "ResidentKeys", "ResidentRowStore",
           "RowView", "Selection", "decode_kernel", "decode_scoring", "each_query",
           "exact_selection", "fp8_scoring",
           "ranked_selection", "resident_counts", "write_rows"]
