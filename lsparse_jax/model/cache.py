"""Per-layer caches of one request (a slot). Batched state adds a leading slot axis.

Rows that must never be read are NaN; nothing here is read without a position mask.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import struct

from lsparse_jax.config import ModelConfig
from lsparse_jax.model.store import (
    RESIDENT_DSA,
    RESIDENT_KV,
    RESIDENT_ROWS,
    DSAStores,
    ExactIndex,
    KeyIndex,
    KVStore,
    ResidentRowStore,
)
from lsparse_jax.quant import KVRowFormat


@struct.dataclass
class SWACache:
    window: jnp.ndarray  # [W, D] f32 ring of raw KV rows; position q at q % W


@struct.dataclass
class CSACache:
    window: jnp.ndarray  # [W, D] f32 ring of raw KV rows (the SWA part)
    kv_ring: jnp.ndarray  # [2m, 4D] f32 compressor inputs of the last 2m tokens
    kv: Any  # the KVStore's state of the compressed KV; entry i pools tokens (i-1)m .. im+m-1
    #   (model.store.ResidentKV, or a serving method's paged store), rows in cfg.kv_dtype
    index_ring: jnp.ndarray  # [2m, 4 D_I] f32 indexer-compressor inputs of the last 2m tokens
    keys: Any  # the KeyIndex's state of the FP8 indexer keys of the compressed entries


@struct.dataclass
class HCACache:
    window: jnp.ndarray  # [W, D] f32 ring of raw KV rows
    kv_ring: jnp.ndarray  # [m_hca, 2D] f32 compressor inputs of the last m_hca tokens
    entries: Any  # [N_hca, ...] compressed KV in ModelConfig.kv_dtype (KVRowFormat, as CSA
    #   rows; the model's layout), or the state of a serving method's row store (device
    #   pages: the page being filled)


@struct.dataclass
class DSACache:
    kv: Any  # the DSA store's state of the per-token KV rows (f32; row i = position i):
    #   model.store.ResidentKV [L, D], or a serving method's paged store (``DSAStores``)
    #   (None: a member reading its leader's rows, ModelConfig.dsa_shared_kv)
    keys: Any  # the leader's KeyIndex state of its FP8 indexer keys (ResidentKeys [L, D_I]);
    #   None for member layers, which reuse their group leader's selection


LayerCache = SWACache | CSACache | HCACache | DSACache


def empty_layer_cache(cfg: ModelConfig, layer: int, kv_store: KVStore = RESIDENT_KV,
                      key_index: KeyIndex | None = None,
                      hca_store: ResidentRowStore = RESIDENT_ROWS,
                      dsa: DSAStores = RESIDENT_DSA) -> LayerCache:
    """A NaN-poisoned cache for one layer of one slot; CSA layers keep their compressed KV and
    indexer keys in ``kv_store`` / ``key_index``, HCA layers their rows in ``hca_store``, DSA
    layers their rows and keys in ``dsa`` (default: the resident layout)."""
    kind = cfg.layer_pattern[layer]
    d, di, w = cfg.head_dim, cfg.indexer.head_dim, cfg.swa_window
    nb = di // cfg.indexer.fp8_block
    nan = lambda *s: jnp.full(s, jnp.nan, jnp.float32)  # noqa: E731
    n = cfg.num_compressed(kind)
    if kind == "swa":
        return SWACache(window=nan(w, d))
    if kind == "csa":
        m = cfg.csa_ratio
        key_index = key_index or ExactIndex(cfg.indexer.top_k)
        return CSACache(window=nan(w, d), kv_ring=nan(2 * m, 4 * d),
                        kv=kv_store.empty(n, KVRowFormat.of(cfg)),
                        index_ring=nan(2 * m, 4 * di), keys=key_index.empty(n, di, nb))
    if kind == "hca":
        m = cfg.hca_ratio
        return HCACache(window=nan(w, d), kv_ring=nan(m, 2 * d),
                        entries=hca_store.empty(n, KVRowFormat.of(cfg)))
    rows = dsa_row_format(cfg)
    if cfg.dsa_leader(layer) != layer:  # no keys; no rows either under dsa_shared_kv
        kv = None if cfg.kv_source(layer) != layer else dsa.member.empty(n, rows)
        return DSACache(kv=kv, keys=None)
    keys = (dsa.keys or ExactIndex(cfg.indexer.top_k)).empty(n, di, nb)
    return DSACache(kv=dsa.kv.empty(n, rows), keys=keys)


def dsa_row_format(cfg: ModelConfig) -> KVRowFormat:
    """How DSA layers store their per-token KV rows: f32 (``ModelConfig.kv_dtype`` is CSA's)."""
    return KVRowFormat("f32", cfg.head_dim, cfg.rope_dim)


def empty_cache(cfg: ModelConfig, kv_store: KVStore = RESIDENT_KV,
                key_index: KeyIndex | None = None,
                hca_store: ResidentRowStore = RESIDENT_ROWS,
                dsa: DSAStores = RESIDENT_DSA) -> tuple[LayerCache, ...]:
    return tuple(empty_layer_cache(cfg, i, kv_store, key_index, hca_store, dsa)
                 for i in range(cfg.num_layers))
