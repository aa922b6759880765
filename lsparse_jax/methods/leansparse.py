"""``leansparse``: LeanSparse's placement and selection. Compressed KV as in ``hisparse`` (host
pages behind a hot cache); the FP8 indexer keys also move to host pages behind a GPU key
cache, and the GPU keeps their PQ codes. Decode selection is coarse-to-fine (Section 5): PQ
coarse scores and top-C (``pallas_kernels.pq_topc``), the miss filter, exact FP8 rescoring of
the kept candidates and the tail (keys resolved through the key cache, scored by
``pallas_kernels.index_scores``), exact top-k. Approximate: recall is measured, and with
C >= the eligible length it equals ``resident`` (identity 6).

DSA share groups: the leader's FP8 keys go to host pages too (pages of P * m per-token keys)
and the leader alone runs the coarse-to-fine selection (PQ codes, key cache); its members run no
indexer and read their own KV rows at the leader's location vector (as in ``hisparse``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lsparse_jax.config import EngineConfig, LeanSparseConfig, ModelConfig, Storage, invalid
from lsparse_jax.indexing.coarse_to_fine import coarse_to_fine
from lsparse_jax.kernels import for_op
from lsparse_jax.memory.device_pool import (
    DevicePools,
    page_in,
    query_scores_in_place,
    scatter_pages,
)
from lsparse_jax.memory.hot_cache import resolve, resolve_in_place
from lsparse_jax.memory.key_store import (
    KeyPageView,
    PagedKeys,
    empty_packed_pool,
    stored_form,
)
from lsparse_jax.memory.paged_kv import PageView, paged_rows
from lsparse_jax.memory.paging import CompletedPages, page_out, tail_page
from lsparse_jax.methods.base import register
from lsparse_jax.methods.hisparse import HiSparse
from lsparse_jax.model.store import (
    NUM_SOURCES,
    IndexerQuery,
    Selection,
    decode_kernel,
    decode_scoring,
    select_each,
)
from lsparse_jax.model.traces import indexer_traces
from lsparse_jax.parallel import current_mesh, head_sum
from lsparse_jax.quant import dequantize_index_keys
from lsparse_jax.quant.pq import encode, train_codebooks
from lsparse_jax.request_groups import grouped, on_stream
from pallas_kernels import common
from pallas_kernels.index_scores.api import index_scores
from pallas_kernels.pq_topc.api import pq_topc
from pallas_kernels.pq_topc.reference import masked_coarse_scores, masked_coarse_scores_fp8
from pallas_kernels.topk.api import topk


def coarse_topc(q, w, codes, codebooks, lengths, num_candidates: int,
                implementation: str | None, precision: str = "bf16", page_table=None,
                page: int | None = None):
    """Step 1 of the selection: the top-C positions by PQ coarse score (``pq_topc``; precision
    "bf16" or "fp8": ``LeanSparseConfig.coarse_precision``; implementation: the engine's or
    ``LeanSparseConfig.coarse_implementation``, mapped by ``lsparse_jax.kernels``).
    page_table [Q, MP] with page P: codes is a device pool [R, M] read in place (``pq_topc``'s
    paged form).

    Under tensor parallelism (inside ``lsparse_jax.parallel.mesh_scope``) each device scores
    the codes with its indexer heads, the partial scores are summed over devices, then the
    ``topk`` op picks C: the fused Triton ``pq_topc`` (scores and top-C in one kernel) has no
    point between the head sum and the top-C where the devices' partial sums could meet.
    """
    if current_mesh() is None:
        return pq_topc(q, w, codes, codebooks, lengths, num_candidates=num_candidates,
                       implementation=for_op("pq_topc", implementation), precision=precision,
                       page_table=page_table, page=page)
    if page_table is not None:  # the partial scores below take the codes gathered
        codes = codes[common.paged_rows(page_table, page_table.shape[1] * page, page)[0]]

    def pick(scores, *args):  # args[-1]: lengths
        return topk(scores, args[-1], num_candidates,
                    implementation=for_op("topk", implementation))

    # fp8: quantize_fp8's scales are per head and per subspace, so a device's share of the
    # heads quantizes to the same values as all heads do
    scores = masked_coarse_scores_fp8 if precision == "fp8" else masked_coarse_scores
    return head_sum(scores, (1, 1, None, None, None), pick)(
        q, w.astype(jnp.float32), codes, codebooks.astype(jnp.float32), lengths)


@dataclasses.dataclass(frozen=True)
class CoarseToFineIndex:
    """``model.store.KeyIndex`` over paged FP8 keys: LeanSparse's coarse-to-fine top-k."""

    settings: LeanSparseConfig
    top_k: int
    page_size: int
    num_subspaces: int  # M PQ subspaces
    implementation: str | None = "xla"
    pooled: bool = False  # PQ codes in a device pool (CacheConfig.device_pages), not the slot

    def empty(self, num_rows: int, dim: int, num_scales: int) -> PagedKeys:
        return PagedKeys.empty(self.page_size, self.settings.key_cache_rows,
                               0 if self.pooled else num_rows, dim, num_scales,
                               self.num_subspaces)

    def write(self, state: PagedKeys, completed, ids, values, scales, ok) -> PagedKeys:
        return state.write(completed, ids, values, scales, ok)

    def select(self, state: PagedKeys, completed, query: IndexerQuery, eligible,
               context: KeyPageView):
        """Top-k positions for one decode query (``select_one``); with
        ``settings.groups`` > 1 the decode step's vmap over slots runs it as that many
        independent request groups, each group's key fetch on ``settings.fetch_stream``
        (``lsparse_jax.request_groups``; the results do not change)."""
        groups = self.settings.groups
        if groups == 1:
            return self.select_one(state, completed, query, eligible, context)

        def one(*args):  # only what the selection changes leaves the groups (no copy of
            #  the PQ codes or the tail through the groups' concatenation)
            new, selection = self.select_one(*args, fetch_stream=self.settings.fetch_stream)
            return new.cache, selection

        cache, selection = grouped(one, groups)(state, completed, query, eligible, context)
        return state.replace(cache=cache), selection

    def select_one(self, state: PagedKeys, completed, query: IndexerQuery, eligible,
                   context: KeyPageView, fetch_stream: int | None = None):
        """Top-k positions for one decode query.

        Notation: N history rows, P page rows, C candidates, Bk key-cache rows.
          query [1, H, D]; eligible [1, N] bool (causal); the tail holds rows paged ..
          paged+P-1, every earlier row is in host pages with its PQ code on the GPU.
        Steps: (1) coarse scores of the paged rows from PQ codes and their top-C (``coarse``);
          (2) the miss filter (a candidate is cached if the key cache holds it; while the cache
          is cold, its first ``warm_steps`` decode steps, every candidate counts as cached, so
          all are fetched and fill it); (3) the kept candidates and the eligible tail rows go
          through the key cache (tail, hit, or host copy into LRU victims: the key fetch, run
          on GPU stream ``fetch_stream`` when given); (4) exact scores of their FP8 keys and
          top-k (steps 2-4: ``fine``).
        """
        if query.q.shape[0] != 1:
            raise ValueError("CoarseToFineIndex serves decode (one query per slot); prefill "
                             "selects on the resident layout")
        cand, cand_scores = self.coarse(state, completed, query, context)
        return self.fine(state, completed, query, eligible, context, cand[0], cand_scores[0],
                         fetch_stream)

    def select_block(self, state: PagedKeys, completed, query: IndexerQuery, eligible,
                     context: KeyPageView):
        """A verification block's T queries, each with its own causal top-k, equal to T
        ``select`` calls in order: step 1 for the T queries at once (step 1 reads only the
        state's PQ codes and the block's one ``completed``, which no query changes), steps 2-4
        query by query with the key cache threaded through them. query [T, H, D]; eligible
        [T, N]. Request groups (``groups`` > 1) select query by query
        (``model.store.select_each``)."""
        if self.settings.groups != 1:
            return select_each(self.select, state, completed, query, eligible, context)
        cand = self.coarse(state, completed, query, context)
        return select_each(self.fine, state, completed, query, eligible, context, cand)

    def coarse(self, state: PagedKeys, completed, query: IndexerQuery, context: KeyPageView):
        """Step 1 for the Q queries of one slot (query [Q, H, D]): the top-C of its paged rows
        by PQ coarse score, positions and scores [Q, C]."""
        paged = paged_rows(self.page_size, completed)
        count = query.q.shape[0]
        every = lambda x: jnp.broadcast_to(x, (count,) + x.shape)  # noqa: E731  one a query
        if context.codes is None:
            codes, paging = every(state.codes), {}
        else:  # the device pool of codes, read in place through the slot's page table
            codes = context.codes.pool
            paging = dict(page_table=every(context.codes.page_table), page=self.page_size)
        return coarse_topc(query.q, query.weights, codes, context.codebooks,
                           every(jnp.asarray(paged, jnp.int32)), self.settings.num_candidates,
                           self.settings.coarse_implementation or self.implementation,
                           self.settings.coarse_precision, **paging)

    def fine(self, state: PagedKeys, completed, query: IndexerQuery, eligible,
             context: KeyPageView, cand, cand_scores, fetch_stream: int | None = None):
        """Steps 2-4 of ``select_one`` for one query (query [1, H, D], eligible [1, N]) from
        its top-C candidates ``cand`` [C] with coarse scores ``cand_scores`` [C]."""
        q, w, n = query.q[0], query.weights[0], eligible.shape[-1]
        paged = paged_rows(self.page_size, completed)
        held = state.cache.positions
        # distinct indices (a position sits in one row; empty rows point past n, each its own):
        # unique_indices lets XLA skip its scatter determinism expansion (a sort of the indices)
        spot = jnp.where(held >= 0, held, n + jnp.arange(held.shape[0]))
        cached = jnp.zeros((n,), bool).at[spot].set(True, mode="drop", unique_indices=True)
        tail = paged + jnp.arange(self.page_size)
        tail = jnp.where(eligible[0][jnp.clip(tail, 0, n - 1)] & (tail < n), tail, -1)
        # with kernels the exact scores read the key cache's rows in place (the candidate
        # gather fused into the scoring: ``index_scores_paged`` with rows for pages); either
        # scoring op at the query's precision
        in_place = decode_kernel(1, self.implementation, "index_scores_paged") and \
            decode_scoring(1, self.implementation, query.precision, "index_scores_paged")
        rescore = decode_scoring(1, self.implementation, query.precision) or "xla"
        fetch = on_stream(functools.partial(resolve if in_place is None else resolve_in_place,
                                            implementation=self.implementation), fetch_stream)

        def exact_scores(retained):
            # tp > 1: each device scores with its heads, partial scores summed before top-k
            ok = retained >= 0
            if in_place is None:
                (values, scales), cache, sources = fetch(
                    state.cache, retained, state.tail, paged, context.page_table, context.pool)
                exact = head_sum(functools.partial(index_scores, implementation=rescore),
                                 (1, 1, None, None, None))
                return exact(q[None], w[None], values[None], scales[None], ok[None])[0], (
                    cache, sources)
            cache, sources, row_of = fetch(state.cache, retained, state.tail, paged,
                                           context.page_table, context.pool)
            return cached_scores(in_place, q, w, cache.rows, row_of, ok, state.tail,
                                 retained.shape[0] - self.page_size), (cache, sources)

        cold = state.cache.clock < self.settings.warm_steps  # decode steps it has served
        selected, _, (cache, key_sources) = coarse_to_fine(
            cand, cand_scores, cached[jnp.maximum(cand, 0)] | cold, tail, exact_scores,
            top_k=self.top_k, filter_offset=self.settings.miss_filter_offset,
            implementation=self.implementation)
        selection = Selection(selected[None], jnp.sum(eligible, -1).astype(jnp.int32),
                              jnp.zeros((1, NUM_SOURCES), jnp.int32), key_sources[None])
        return state.replace(cache=cache), selection


def cached_scores(kernel: str, q, w, rows, row_of, ok, tail, start: int):
    """Exact scores [k] of one query (q [H, D], w [H]) over a candidate list whose entry j is
    key cache row row_of[j] (rows: ([Bk, D_I] e4m3, [Bk, nb] f32)) or, for j >= start, tail
    row j - start (tail ([P, D_I], [P, nb])); ok [k] which entries count. The
    ``index_scores_paged`` kernel reads the rows where they are (the cache as the slot's own
    pool of one-row pages), with the arithmetic of ``index_scores`` on a gathered copy (bit
    for bit)."""
    return query_scores_in_place(kernel, 1, q, w, jax.tree.map(lambda x: x[None], rows),
                                 row_of, ok, tail, start)


@struct.dataclass
class LeanTier:
    """What leansparse shares across slots."""

    kv_pools: tuple[jax.Array | None, ...]  # per layer [NP * P, D] f32 pinned_host KV pages
    #   (a pytree of arrays for another kv_dtype, as hisparse's)
    key_pools: tuple  # per layer ([NP * P, D_I] e4m3, [NP * P, D_I / fp8_block] f32)
    #   pinned_host pages of FP8 indexer keys, or a PackedPool of those rows
    #   (LeanSparseConfig.host_key_rows = "packed"); None for layers without keys
    page_table: jnp.ndarray  # [S, max_pages] int32 physical page of each logical page, -1 none
    codebooks: tuple[jnp.ndarray | None, ...]  # per layer [M, K, D_I / M] f32 PQ codebooks
    pools: DevicePools | None = None  # the device pools of the PQ codes
    #   (CacheConfig.device_pages), None: codes at max_len in each slot


def encode_keys(values, scales, codebooks):
    """PQ codes of FP8 keys: codes of their dequantized values (what exact scoring sees)."""
    return encode(dequantize_index_keys(values, scales), codebooks)


@register
@dataclasses.dataclass(frozen=True)
class LeanSparse(HiSparse):
    name: ClassVar[str] = "leansparse"
    exact: ClassVar[bool] = False
    storage: ClassVar[Storage] = Storage(kv_on_host=True, keys_on_host=True)

    @classmethod
    def validate(cls, engine: EngineConfig) -> None:
        super().validate(engine)
        lean, ic = engine.leansparse, engine.model.indexer
        if lean.num_candidates < ic.top_k:
            invalid("EngineConfig", "leansparse.num_candidates", lean.num_candidates,
                    f"must be >= indexer.top_k={ic.top_k}")
        if ic.head_dim % lean.pq_subspace_dim:
            invalid("EngineConfig", "leansparse.pq_subspace_dim", lean.pq_subspace_dim,
                    f"must divide indexer.head_dim={ic.head_dim}")
        if engine.cache.num_slots % lean.groups:
            invalid("EngineConfig", "leansparse.groups", lean.groups,
                    f"must divide cache.num_slots={engine.cache.num_slots} (every request "
                    "group holds the same number of slots)")
        if lean.groups > 1 and engine.tp > 1:
            invalid("EngineConfig", "leansparse.groups", lean.groups,
                    f"request groups run on one device; use groups=1 with tp={engine.tp}")

    @property
    def settings(self) -> LeanSparseConfig:
        return self.engine.leansparse

    def key_index(self) -> CoarseToFineIndex:
        return CoarseToFineIndex(self.settings, self.engine.model.indexer.top_k,
                                 self.engine.cache.page_size, self.engine.pq_subspaces,
                                 self.engine.implementation, self.pooled)

    def dsa_key_index(self) -> CoarseToFineIndex:
        """The DSA leaders' keys paged as CSA keys are, in pages of P * m keys (their PQ codes
        in the slot: device pools hold CSA state only)."""
        return dataclasses.replace(self.key_index(), page_size=self.dsa_page_rows, pooled=False)

    @property
    def key_layers(self) -> tuple[int, ...]:
        """Layers whose FP8 keys are paged (with codebooks): CSA layers and DSA leaders."""
        return self.engine.model.indexer_layers

    def empty_tier(self, codebooks=None) -> LeanTier:
        ic = self.engine.model.indexer
        nb = ic.head_dim // ic.fp8_block
        if self.settings.host_key_rows == "packed":
            keys = tuple(empty_packed_pool(self.engine.host_pages * self.page_rows(i),
                                           ic.head_dim, nb) if i in self.key_layers else None
                         for i in range(self.engine.model.num_layers))
        else:
            values = self._pools(ic.head_dim, jnp.float8_e4m3fn, self.key_layers)
            scales = self._pools(nb, layers=self.key_layers)
            keys = tuple(None if v is None else (v, s) for v, s in zip(values, scales))
        return LeanTier(self._kv_pools(), keys, self._page_table(),
                        self._check_codebooks(codebooks), self.empty_pools())

    def _check_codebooks(self, codebooks) -> tuple:
        """Per-layer codebooks (None for layers without an indexer), shape-checked."""
        csa = list(self.key_layers)
        if codebooks is None or sorted(codebooks) != csa:
            got = None if codebooks is None else sorted(codebooks)
            raise ValueError(f"leansparse needs PQ codebooks for CSA layers and DSA leaders "
                             f"{csa}, got {got} "
                             "(train them with lsparse_jax.methods.leansparse."
                             "calibrate_codebooks)")
        m, ds = self.engine.pq_subspaces, self.settings.pq_subspace_dim
        out = []
        for i in range(self.engine.model.num_layers):
            if i not in csa:
                out.append(None)
                continue
            book = jnp.array(codebooks[i], jnp.float32, copy=True)  # the state is donated
            if book.ndim != 3 or book.shape[0] != m or book.shape[2] != ds \
                    or book.shape[1] > 256:
                raise ValueError(f"codebooks[{i}] has shape {tuple(book.shape)}; leansparse "
                                 f"needs [{m}, K <= 256, {ds}] (M = indexer head_dim / "
                                 "pq_subspace_dim)")
            out.append(book)
        return tuple(out)

    def csa_context(self, tier: LeanTier, rows, layer: int):
        table = rows[0]
        return (PageView(tier.kv_pools[layer], table),
                KeyPageView(tier.key_pools[layer], table, tier.codebooks[layer],
                            self.pool_view(tier, "codes", layer, rows[-1])))

    def admit_layer(self, layer, cache, empty, tier, grant, full_pages):
        """As hisparse, and the complete prefix pages of FP8 keys go to the host too, their PQ
        codes to the device (DSA members have no keys)."""
        out, tier = super().admit_layer(layer, cache, empty, tier, grant, full_pages)
        if layer not in self.key_layers:
            return out, tier
        page = self.page_rows(layer)
        rows = (cache.keys.values, cache.keys.scales)
        pools = list(tier.key_pools)
        target, stored, pool_of, _ = stored_form(pools[layer], rows)
        target, _ = page_out(target, stored, grant.pages, full_pages, page, grant.written)
        pools[layer], key_tail = pool_of(target), tail_page(rows, full_pages, page)
        codes = encode_keys(*rows, tier.codebooks[layer])
        paged = jnp.arange(codes.shape[0]) < full_pages * page
        codes = jnp.where(paged[:, None], codes, 0)
        tier = tier.replace(key_pools=tuple(pools))
        if self.pooled and layer in self.csa_layers:  # the complete pages' codes to device
            #   pages; the slot keeps none
            code_pools = list(tier.pools.codes)
            code_pools[layer], _ = page_in(code_pools[layer], codes, grant.device, full_pages,
                                           page)
            tier = tier.replace(pools=tier.pools.replace(codes=tuple(code_pools)))
            codes = empty.keys.codes
        return out.replace(keys=empty.keys.replace(tail=key_tail, codes=codes)), tier

    def write_pages(self, layer, cache, tier, host: CompletedPages,
                    device: CompletedPages | None):
        """As hisparse, and each completed key page goes to the host, its PQ codes to the
        slot's codes (or its device page, with device pools)."""
        cache, tier = super().write_pages(layer, cache, tier, host, device)
        if layer not in self.key_layers:
            return cache, tier
        keys, book = cache.keys, tier.codebooks[layer]
        pools = list(tier.key_pools)
        target, tails, pool_of, _ = stored_form(pools[layer], keys.tail)
        pools[layer] = pool_of(host.write_tails(target, tails))
        encoded = lambda s: encode_keys(keys.tail[0][s], keys.tail[1][s], book)  # noqa: E731
        if device is None:
            codes = host.for_each(lambda j, s, codes: jax.lax.dynamic_update_slice(
                codes, encoded(s)[None], (s, host.first[j], 0)), keys.codes)
        else:  # the completed pages' codes [c, P, M] to their device pages
            codes = keys.codes
            code_pools = list(tier.pools.codes)
            code_pools[layer] = scatter_pages(code_pools[layer], device.dest,
                                              jax.vmap(encoded)(device.slots),
                                              self.engine.cache.page_size)
            tier = tier.replace(pools=tier.pools.replace(codes=tuple(code_pools)))
        keys = keys.replace(tail=host.poison(keys.tail), codes=codes)
        return cache.replace(keys=keys), tier.replace(key_pools=tuple(pools))


def seed_positions(selected, rows: int) -> np.ndarray:
    """Key-cache seed of one CSA layer from the final prefill chunk's exact selections (our
    cold-start option, README "Cold start"; the paper is silent on admission).

    selected [T, k] int32: the chunk's valid queries' top-k positions (-1 none), last query
    last. Ranking: the last query's picks, then by how many of the chunk's queries picked a
    position, then the most recent position. Returns [rows] int32, -1 padded.
    """
    selected = np.asarray(selected)
    pos, count = np.unique(selected[selected >= 0], return_counts=True)
    last = np.isin(pos, selected[-1])
    order = np.lexsort((-pos, -count, ~last))  # primary key last
    out = np.full(rows, -1, np.int32)
    out[:min(rows, pos.size)] = pos[order][:rows]
    return out


@functools.partial(jax.jit, static_argnames=("layer",), donate_argnames=("state",))
def seed_key_cache(state, layer: int, slot, positions, values, scales, paged):
    """``state`` (a leansparse DecodeState) with ``slot``'s key cache of CSA ``layer`` holding
    the exact FP8 keys of ``positions`` [B] (-1 none; tail rows >= ``paged`` are skipped: the
    tail serves them) taken from the prefilled keys values [N, D_I] e4m3 / scales [N, nb].
    The seeded rows get stamp 0 (least recent: the first misses evict them first) and the
    cache clock stays 0, so ``warm_steps`` still counts from the first decode step."""
    caches = list(state.caches)
    keys = caches[layer].keys
    hot = keys.cache
    keep = (positions >= 0) & (positions < paged)
    idx = jnp.maximum(positions, 0)
    row = lambda old, new: old.at[slot].set(  # noqa: E731
        jnp.where(keep.reshape((-1,) + (1,) * (new.ndim - 1)), new, old[slot]))
    hot = hot.replace(rows=(row(hot.rows[0], values[idx]), row(hot.rows[1], scales[idx])),
                      positions=hot.positions.at[slot].set(jnp.where(keep, positions, -1)),
                      stamps=hot.stamps.at[slot].set(jnp.where(keep, 0, -1)))
    caches[layer] = caches[layer].replace(keys=keys.replace(cache=hot))
    return state.replace(caches=tuple(caches))


def calibrate_codebooks(params, cfg: ModelConfig, tokens, *, subspace_dim: int = 4,
                        num_centroids: int = 256, iters: int = 20, seed: int = 0) -> dict:
    """LeanSparse's offline step: runs the model over calibration ``tokens`` (use text the
    evaluation never sees) and trains one codebook per CSA layer on the dequantized FP8 keys
    its indexer stored. Returns {layer: [M, K, subspace_dim]} with M = indexer head_dim /
    subspace_dim and K = min(num_centroids, keys available)."""
    books = {}
    for trace in indexer_traces(params, cfg, tokens):
        k = min(num_centroids, trace.keys.shape[0])
        books[trace.layer] = train_codebooks(trace.keys, cfg.indexer.head_dim // subspace_dim,
                                             k, iters=iters, seed=seed + trace.layer)
    return books


__all__ = ["CoarseToFineIndex", "LeanSparse", "LeanTier", "calibrate_codebooks",
           "encode_keys", "seed_key_cache", "seed_positions"]
