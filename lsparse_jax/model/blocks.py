"""Attention layers of the family: SWA, CSA, HCA (DeepSeek-V4) and DSA (GLM-5).

Every layer maps a chunk of T tokens at positions start .. start+T-1 (the first ``num_valid``
real) and its cache to (output, new cache, selection, stats). Decode is a chunk of one token;
prefill is a chunk of many; the cache makes chunking invisible.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lsparse_jax.config import ModelConfig
from lsparse_jax.indexing import index_scores
from lsparse_jax.kernels import for_op
from lsparse_jax.model.attention import sink_attention
from lsparse_jax.model.cache import CSACache, DSACache, HCACache, SWACache
from lsparse_jax.model.compressor import Compressor
from lsparse_jax.model.layers import MLP, RMSNorm, dense, extend_window, matmul_precision, rope
from lsparse_jax.model.store import (
    NUM_SOURCES,
    RESIDENT_DSA,
    RESIDENT_KV,
    RESIDENT_ROWS,
    DSAStores,
    ExactIndex,
    HCAKernelView,
    IndexerQuery,
    KeyIndex,
    KVStore,
    Locations,
    RowView,
    Selection,
    write_rows,
)
from lsparse_jax.parallel import per_head
from lsparse_jax.quant import KVRowFormat, dequantize_index_keys, quantize_index_keys
from pallas_kernels.sparse_attention.api import sparse_attention

KERNEL_QUERIES = 16  # a CSA chunk of at most this many queries (decode: 1; a speculative
#   verification block: gamma + 1) attends through the sparse_attention op when the layer's
#   implementation is not "xla"; longer chunks (prefill) through XLA's sink_attention


class Indexer(nn.Module):
    """Lightning indexer: query heads, head weights and (for CSA) its own compressor.

    Notation: H indexer heads, D indexer dim, x [T, hidden].
    Math: q_h = RoPE(x W_q)_h; w_h = (x W_w)_h * H^-1/2 * D^-1/2;
      score(t, n) = sum_h w_h ReLU(q_h . k_n) with k_n the dequantized FP8 key.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions):
        ic = self.cfg.indexer
        rope_dim = min(self.cfg.rope_dim, ic.head_dim)
        q = dense(ic.num_heads * ic.head_dim, "wq")(x).reshape(-1, ic.num_heads, ic.head_dim)
        q = rope(q, positions, rope_dim, self.cfg.rope_theta)
        w = dense(ic.num_heads, "ww")(x) * (ic.num_heads * ic.head_dim) ** -0.5
        return q, w


class AttentionLayer(nn.Module):
    """One attention layer of kind cfg.layer_pattern[layer].

    A CSA layer keeps its compressed KV in ``kv_store`` and its indexer keys in ``key_index``
    (``model.store``: the resident layout by default; a serving method passes its own, and a
    per-slot ``context`` of shared state to both); the layer itself is only the math. Its
    compressed rows are stored in ``cfg.kv_dtype`` (``quant.KVRowFormat``): encoded when
    written, decoded to f32 after the selected rows are gathered (the XLA path), or handed to
    the sparse_attention kernel in the form ``cfg.attention_precision`` names
    (``kernel_rows``).
    """

    cfg: ModelConfig
    layer: int
    dense_selection: bool = False  # attend to every eligible entry (the no-sparsity reference)
    implementation: str | None = "xla"  # kernels: "xla", "triton", ... (pallas_kernels api)
    indexer_loss: bool = False  # training: sow the indexer's KL to the attention (CSA layers)
    kv_store: KVStore = RESIDENT_KV
    key_index: KeyIndex | None = None  # None: model.store.ExactIndex (every key resident)
    hca_store: Any = RESIDENT_ROWS  # where an HCA layer's rows live (model.store.RowStore-like)
    dsa_stores: DSAStores = RESIDENT_DSA  # where a DSA layer's rows and keys live

    @property
    def kind(self) -> str:
        return self.cfg.layer_pattern[self.layer]

    @nn.compact
    def __call__(self, x, cache, start, num_valid, shared: Selection | None = None,
                 context=None):
        cfg = self.cfg
        h, d, w = cfg.num_heads, cfg.head_dim, cfg.swa_window
        t_len = x.shape[0]
        positions = start + jnp.arange(t_len)
        q = dense(h * d, "wq")(x).reshape(t_len, h, d)
        q = rope(q, positions, cfg.rope_dim, cfg.rope_theta)
        raw = rope(RMSNorm(name="kv_norm")(dense(d, "wkv")(x)), positions, cfg.rope_dim,
                   cfg.rope_theta)
        sink = self.param("sink", nn.initializers.zeros, (h,))
        groups, selection = [], None

        if self.kind in ("swa", "csa", "hca"):
            ext, ext_pos, window = extend_window(cache.window, raw, start, num_valid)
            if t_len == 1:  # decode: the ring as one shared group (as the kernels read it)
                rel = positions[:, None] - ext_pos[None, :]
                groups.append((ext[None], (rel >= 0) & (rel < w) & (ext_pos[None, :] >= 0)))
            else:  # a chunk: each query's own w rows (banded; a [T, R + T] mask costs T^2)
                first = ext.shape[0] - t_len - w + 1  # ext row of query 0's oldest position
                rows = jnp.arange(t_len)[:, None] + first + jnp.arange(w)[None, :]
                groups.append((ext[rows], ext_pos[rows] >= 0))
            cache = cache.replace(window=window)

        num = cfg.num_compressed(self.kind)
        # a CSA layer's decode query, or each query of a short chunk (a speculative
        # verification block), over its selection; an HCA layer's over all its rows at
        # attention_precision "bf16" (the kernel's f32 path reads ~0.13 TB/s: session 8's CSA
        # shape; an HCA layer at 1M attends 8192 rows, XLA is faster there): sparse_attention
        hca_kernel = self.kind == "hca" and cfg.attention_precision == "bf16"
        kernel_attend = ((self.kind == "csa" or hca_kernel) and t_len <= KERNEL_QUERIES
                         and not self.dense_selection and not self.indexer_loss
                         and self.implementation != "xla")
        if self.kind in ("csa", "hca"):
            m = cfg.csa_ratio if self.kind == "csa" else cfg.hca_ratio
            comp = Compressor(d, m, self.kind == "csa", cfg.rope_dim, cfg.rope_theta, name="comp")
            ids, rows, ok, kv_ring = comp(x, cache.kv_ring, start, num_valid)
            cache = cache.replace(kv_ring=kv_ring)
            eligible = jnp.arange(num)[None, :] < ((positions + 1) // m)[:, None]
        if self.kind == "csa":
            completed = start // m  # compressed rows the slot held before this chunk
            kv_ctx, key_ctx = (None, None) if context is None else context
            rowfmt = KVRowFormat.of(cfg)
            cache = cache.replace(kv=self.kv_store.write(cache.kv, completed, ids,
                                                         rowfmt.encode(rows), ok))
        elif self.kind == "hca":  # stored as CSA rows are (cfg.kv_dtype)
            cache = cache.replace(entries=self.hca_store.write(
                cache.entries, start // m, ids, KVRowFormat.of(cfg).encode(rows), ok))
        elif self.kind == "dsa":  # per-token rows: row i is position i (``completed`` = start)
            ok = jnp.arange(t_len) < num_valid
            dsa_kv = self.dsa_stores.kv if shared is None else self.dsa_stores.member
            kv_ctx, key_ctx = (None, None) if context is None else context
            if cache.kv is not None:  # None: a member reading its leader's rows
                cache = cache.replace(kv=dsa_kv.write(cache.kv, start, positions, raw, ok))
            eligible = jnp.arange(num)[None, :] <= positions[:, None]
        if self.kind in ("csa", "hca", "dsa"):
            eligible &= (jnp.arange(t_len) < num_valid)[:, None]  # padding selects nothing

        if self.kind in ("csa", "dsa") and shared is None:
            indexer = Indexer(cfg, name="indexer")
            xi = jax.lax.stop_gradient(x)  # the indexer learns from its own loss only
            iq, iw = indexer(xi, positions)
            self.sow("intermediates", "indexer_q", iq)  # read by model.traces
            self.sow("intermediates", "indexer_w", iw)
            ic = cfg.indexer
            if self.kind == "csa":
                icomp = Compressor(ic.head_dim, m, True, min(cfg.rope_dim, ic.head_dim),
                                   cfg.rope_theta, name="index_comp")
                kids, krows, kok, index_ring = icomp(xi, cache.index_ring, start, num_valid)
                cache = cache.replace(index_ring=index_ring)
            else:
                kids, kok = positions, jnp.arange(t_len) < num_valid
                krows = rope(dense(ic.head_dim, "index_wk")(xi), positions,
                             min(cfg.rope_dim, ic.head_dim), cfg.rope_theta)
            kval, kscale = quantize_index_keys(krows, ic.fp8_block)
            query = IndexerQuery(iq, iw, ic.score_precision)
            if self.kind == "dsa":
                index = self.dsa_stores.keys or ExactIndex(ic.top_k, self.implementation)
                completed = start
            else:
                index = self.key_index or ExactIndex(ic.top_k, self.implementation)
            keys = index.write(cache.keys, completed, kids, kval, kscale, kok)
            keys, selection = index.select(keys, completed, query, eligible, key_ctx)
            cache = cache.replace(keys=keys)
        elif self.kind == "dsa":
            selection = shared  # GLM-5 index sharing: reuse the group leader's positions

        if self.kind == "hca" and kernel_attend:  # every eligible row, read where it lies
            view, groups = hca_kernel_rows(cfg, self.hca_store.kernel_view(
                cache.entries, start // m, num, context), eligible, groups)
        elif self.kind == "hca":
            stored = self.hca_store.rows(cache.entries, start // m, num, context)
            groups.append((KVRowFormat.of(cfg).decode(stored)[None], eligible))
        elif self.dense_selection and self.kind == "dsa":
            if cache.kv is None:
                raise ValueError("dense_selection reads every row of a layer; with "
                                 "dsa_shared_kv a member has none of its own")
            groups.append((dsa_kv.all_rows(cache.kv)[None], eligible))
        elif self.dense_selection and self.kind == "csa":
            groups.append((rowfmt.decode(self.kv_store.all_rows(cache.kv))[None], eligible))
        elif self.kind == "csa":
            if selection.band is not None and t_len == 1:  # decode with echo's prefetch
                kv, view, fetched = self.kv_store.gather_band(
                    cache.kv, completed, selection.positions, selection.band, kv_ctx)
                selection = selection.replace(prefetched=fetched[None])
            else:
                kv, view = self.kv_store.gather(cache.kv, completed, selection.positions,
                                                kv_ctx)
            cache = cache.replace(kv=kv)
            if not kernel_attend:  # XLA path: the selected rows, query by query
                picked = jax.tree.map(lambda t: t[0][jnp.maximum(view.slots, 0)], view.table)
                groups.append((rowfmt.decode(picked), view.slots >= 0))
            else:  # the rows in the form cfg.attention_precision hands the kernel
                view = kernel_rows(rowfmt, view, cfg.attention_precision)
            selection = selection.replace(sources=view.sources)
        elif self.kind == "dsa":
            dsa = self.dsa_stores
            if shared is None:  # the leader resolves its selection; its members follow
                kv, view = dsa_kv.gather(cache.kv, start, selection.positions, kv_ctx)
                locations = Locations(view.slots, view.plan)
                if cfg.dsa_shared_kv:  # V4-style: its members read these very rows
                    locations = locations.replace(
                        table=view.table if dsa.location_reuse else None,
                        source=None if dsa.location_reuse else (kv, kv_ctx))
                selection = selection.replace(sources=view.sources, locations=locations)
                cache = cache.replace(kv=kv)
            elif cache.kv is not None:  # GLM-5: its own rows at the leader's location vector
                kv, view = dsa_kv.follow(cache.kv, start, shared.locations, kv_ctx)
                selection = shared.replace(sources=view.sources)
                cache = cache.replace(kv=kv)
            elif dsa.location_reuse:  # V4-style: the leader's rows where it resolved them
                loc = shared.locations
                view = RowView(loc.table, loc.slots, jnp.zeros_like(shared.sources))
                selection = shared.replace(sources=view.sources)
            else:  # V4-style without location reuse: a second resolve of the leader's source
                src, src_ctx = shared.locations.source  # (its state is the leader's: dropped)
                _, view = dsa.kv.gather(src, start, selection.positions, src_ctx)
                selection = shared.replace(sources=view.sources)
            groups.append((view.table[0][jnp.maximum(view.slots, 0)], view.slots >= 0))

        if self.indexer_loss:
            if self.kind != "csa":
                raise ValueError(f"indexer_loss trains CSA indexers; layer {self.layer} is "
                                 f"{self.kind!r}")
            out, probs = sink_attention(q, groups, sink, return_probs=True)
            attended = None if self.dense_selection else selection.positions
            self.sow("losses", "indexer_kl", indexer_kl(
                iq, iw, krows, kval, kscale, kids, kok, num, eligible, attended, probs[-1]))
        elif kernel_attend:
            ((window_rows, window_mask),) = groups
            if cfg.attention_precision == "bf16":  # the window as the rows: bf16
                window_rows = window_rows.astype(jnp.bfloat16)
            # tp > 1: each device attends with its query heads (q [1, H, D], sink [H])
            attend = per_head(functools.partial(
                sparse_attention, implementation=for_op("sparse_attention", self.implementation)),
                              (1, None, None, None, None, 0), 1)
            if t_len == 1:  # decode: the window is the ring, one group
                out = attend(q, view.table, view.slots, window_rows, window_mask, sink)
            else:  # query by query, each with its window rows; the table shared, unless
                #  selected_rows made it per query ([T, k, D])
                per_query = jax.tree.leaves(view.table)[0].shape[0] == t_len

                def one(qt, table, slots, rows, mask):
                    table = jax.tree.map(lambda a: a[None], table) if per_query else table
                    return attend(qt[None], table, slots[None], rows[None], mask[None],
                                  sink)[0]

                out = jax.vmap(one, in_axes=(0, 0 if per_query else None, 0, 0, 0))(
                    q, view.table, view.slots, window_rows, window_mask)
        else:
            out = sink_attention(q, groups, sink)
        y = dense(cfg.hidden, "wo")(out.reshape(t_len, h * d))
        return y, cache, selection


def kernel_rows(rowfmt: KVRowFormat, view, precision: str):
    """A view of T queries (slots [T, k], table [1, R, ...]) in the form the sparse_attention
    kernel reads at ``precision`` (``ModelConfig.attention_precision``):
      "f32"   f32 rows as stored; bf16 / fp8_v4 rows: the selected ones decoded to f32
              (``selected_rows``), the kernel's f32 path.
      "bf16"  bf16 and fp8_v4 rows as stored (the kernel gathers them in place, FP8 in its
              three leaves); f32 rows: the selected ones rounded to bf16 (``selected_rows``:
              k rows, not the whole table). The kernel's bf16 path.
    The kernel's output depends only on the selected rows' values in slot order (not on
    where they sit in the table), so every method's view gives the same output."""
    if precision == "f32":
        return view if rowfmt.kind == "f32" else selected_rows(rowfmt, view)
    if precision != "bf16":
        raise ValueError(f"attention_precision={precision!r}: allowed 'f32', 'bf16'")
    if rowfmt.kind == "f32":
        return selected_rows(rowfmt, view, jnp.bfloat16)
    if rowfmt.kind == "fp8_v4":  # the FP8Rows leaves (nope, scales, rope) as a plain tuple
        return view.replace(table=tuple(view.table))
    return view


def hca_kernel_rows(cfg: ModelConfig, hv: HCAKernelView, eligible, groups):
    """An HCA layer's T queries as the sparse_attention kernel reads them: (RowView of the
    table with slots [T, N], the eligible positions' table rows; groups with the ``extra``
    rows, decoded, appended to each query's window rows, masked by eligibility).

    Notation: T queries, N compressed positions, E extra rows, W window rows ([T, W]: in a
    decode the ring, T = 1; in a chunk each query's own)."""
    rowfmt = KVRowFormat.of(cfg)
    slots = jnp.where(eligible, hv.slots[None, :], -1)                       # [T, N]
    view = kernel_rows(rowfmt, RowView(hv.table, slots, jnp.zeros(
        (slots.shape[0], NUM_SOURCES), jnp.int32)), cfg.attention_precision)
    if hv.extra is None:
        return view, groups
    ((window_rows, window_mask),) = groups
    num = eligible.shape[-1]
    at = jnp.clip(hv.extra_pos, 0, num - 1)
    ok = eligible[:, at] & (hv.extra_pos < num)[None, :]                     # [T, E]
    extra = rowfmt.decode(hv.extra)                                          # [E, D]
    rows = jnp.concatenate([window_rows, jnp.broadcast_to(
        extra, (window_rows.shape[0],) + extra.shape)], axis=1)
    return view, [(rows, jnp.concatenate([window_mask, ok], axis=1))]


def selected_rows(rowfmt: KVRowFormat, view, dtype=jnp.float32):
    """A view of T queries whose table is each query's k selected rows, decoded to f32 and
    cast to ``dtype`` (table [T, k, D], slots 0..k-1 where selected, -1 elsewhere)."""
    slots = view.slots
    rows = rowfmt.decode(jax.tree.map(lambda t: t[0][jnp.maximum(slots, 0)], view.table))
    return view.replace(table=rows.astype(dtype),
                        slots=jnp.where(slots >= 0, jnp.arange(slots.shape[-1]), -1))


def indexer_kl(iq, iw, krows, kval, kscale, kids, kok, num, eligible, attended, probs):
    """KL divergence of the indexer's distribution from the attention's (DeepSeek-V3.2 recipe).

    Notation: T queries of a chunk that starts at position 0 and holds the whole sequence;
      N compressed entries; S attended entries per query (all N in the dense warm-up, the k
      selected ones in sparse training); H attention heads.
      iq [T, H_I, D_I], iw [T, H_I]: indexer queries and head weights; krows [n, D_I] the
      chunk's compressed indexer keys (ids kids, valid kok) and their FP8 form kval, kscale;
      eligible [T, N]; attended [T, k] positions (-1 none) or None (dense); probs [T, H, S].
    Math:
      1. keys k_n: the FP8 round trip in the forward pass (the scores equal serving's), the
         identity in the backward pass (straight-through).
      2. p_t = sum_h probs[t, h, :] / sum over the attended entries (the target, no gradient).
      3. q_t = softmax over attended entries of I(t, n) = sum_h w_h ReLU(q_h . k_n).
      4. loss = mean over queries with an attended entry of sum_n p_t(n) (log p_t(n) - log q_t(n)).
    """
    ste = krows + jax.lax.stop_gradient(
        dequantize_index_keys(kval, kscale).astype(krows.dtype) - krows)
    keys = write_rows(jnp.zeros((num, krows.shape[-1]), krows.dtype), kids, ste, kok)
    scores = index_scores(iq, iw, keys)  # [T, N]
    if attended is None:
        mask = eligible
    else:
        mask = attended >= 0
        scores = jnp.take_along_axis(scores, jnp.maximum(attended, 0), axis=-1)
    target = jax.lax.stop_gradient(jnp.sum(jnp.where(mask[:, None, :], probs, 0.0), axis=1))
    target = target / jnp.maximum(jnp.sum(target, axis=-1, keepdims=True), 1e-30)
    # a finite fill: a query with nothing attended must not put NaN into the backward pass
    logq = jax.nn.log_softmax(jnp.where(mask, scores, -1e30), axis=-1)
    terms = jnp.where(mask & (target > 0), target * (jnp.log(jnp.where(target > 0, target, 1.0))
                                                       - jnp.where(mask, logq, 0.0)), 0.0)
    rows = jnp.any(mask, axis=-1)
    return jnp.sum(jnp.where(rows, jnp.sum(terms, -1), 0.0)) / jnp.maximum(jnp.sum(rows), 1)


class Block(nn.Module):
    """attn_norm -> AttentionLayer -> residual, then mlp_norm -> MLP -> residual.

    The halves are methods too (``Block(...).apply(..., method="attend")``): ``attend`` mixes
    a sequence's tokens (one slot's caches), ``feed_forward`` treats every row alone, so
    ``serving.mixed`` runs decode and prefill rows through one ``feed_forward``."""

    cfg: ModelConfig
    layer: int
    dense_selection: bool = False
    implementation: str | None = "xla"
    indexer_loss: bool = False
    kv_store: KVStore = RESIDENT_KV
    key_index: KeyIndex | None = None
    hca_store: Any = RESIDENT_ROWS
    dsa_stores: DSAStores = RESIDENT_DSA

    def setup(self):
        self.attn_norm = RMSNorm()
        self.attn = AttentionLayer(self.cfg, self.layer, self.dense_selection,
                                   self.implementation, self.indexer_loss, self.kv_store,
                                   self.key_index, self.hca_store, self.dsa_stores)
        self.mlp_norm = RMSNorm()
        self.mlp = MLP(self.cfg.mlp_hidden)

    def __call__(self, x, cache, start, num_valid, shared=None, context=None):
        x, cache, selection = self.attend(x, cache, start, num_valid, shared, context)
        return self.feed_forward(x), cache, selection

    def attend(self, x, cache, start, num_valid, shared=None, context=None):
        """x + attention(attn_norm(x)) -> (x, cache, selection)."""
        with matmul_precision(self.cfg.matmul_precision):
            y, cache, selection = self.attn(self.attn_norm(x), cache, start, num_valid,
                                            shared, context)
        return x + y, cache, selection

    def feed_forward(self, x):
        """x + MLP(mlp_norm(x)), row by row."""
        with matmul_precision(self.cfg.matmul_precision):
            return x + self.mlp(self.mlp_norm(x))


__all__ = ["AttentionLayer", "Block", "Indexer", "Selection", "SWACache", "CSACache",
           "HCACache", "DSACache"]
