"""Byte-exact memory accounting per request: GPU and host bytes by component.

For the arrays this project allocates (``Layout.ours``) the GPU total equals the bytes of one
slot of ``DecodeState`` exactly (tested). ``Layout.v4_serving`` swaps in the byte sizes of
DeepSeek-V4 serving stacks (584 B compressed KV rows, 132 B FP8 indexer keys) to compare with the
papers' figures. CSA rows are counted in the model's ``kv_dtype`` (``quant.KVRowFormat``:
4D, 2D or the FP8 layout's bytes); SWA window, HCA and DSA rows are always f32 here. DSA
layers are resident in the slot under resident and paged like CSA layers under the host-paged
methods (pages of P * m per-token rows; ``methods.hisparse``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from lsparse_jax.config import DrafterConfig, EngineConfig, ModelConfig
from lsparse_jax.model.cache import dsa_row_format, empty_layer_cache
from lsparse_jax.quant import KVRowFormat

GPU_COMPONENTS = ("weights_share", "swa_window", "compressor_state", "attention_kv",
                  "indexer_keys", "pq_codes", "hot_cache", "key_cache", "tail", "page_table",
                  "staging")
HOST_COMPONENTS = ("attention_kv", "indexer_keys")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Bytes of one stored row of each kind.

    Attributes:
      kv_row: one compressed CSA KV row.
      index_key: one indexer key with its scales.
      other_row: one SWA-window or DSA row (None: kv_row, one format for every row).
      hca_row: one compressed HCA row (None: plain_row).
      hot_row_meta: per hot-cache row metadata (position and LRU stamp).
      hot_scalar: per hot cache scalars (its clock).
      compressor_value: one value of the compressors' pending-token rings.
    """

    kv_row: int
    index_key: int
    hot_row_meta: int = 8
    hot_scalar: int = 4
    compressor_value: int = 4
    other_row: int | None = None
    hca_row: int | None = None

    @classmethod
    def ours(cls, cfg: ModelConfig) -> Layout:
        """CSA and HCA rows in ``kv_dtype``, SWA and DSA rows f32."""
        row = KVRowFormat.of(cfg).row_bytes
        return cls(kv_row=row, index_key=cfg.indexer.key_bytes, other_row=4 * cfg.head_dim,
                   hca_row=row)

    @property
    def plain_row(self) -> int:
        """Bytes of one SWA-window or DSA row."""
        return self.kv_row if self.other_row is None else self.other_row

    @property
    def hca_bytes(self) -> int:
        """Bytes of one compressed HCA row."""
        return self.plain_row if self.hca_row is None else self.hca_row

    @classmethod
    def v4_serving(cls) -> Layout:
        """DeepSeek-V4 FP8 serving layout: 448 FP8 + 64 BF16 rope + 7 scale + 1 pad = 584 B
        for every KV row (``kv_dtype="fp8_v4"`` stores CSA rows in 583 B: no pad byte)."""
        return cls(kv_row=584, index_key=132, hot_row_meta=0, hot_scalar=0)


@dataclasses.dataclass(frozen=True)
class RequestBytes:
    gpu: dict[str, int]  # component -> bytes on the GPU for one request
    host: dict[str, int]  # component -> bytes in host memory for one request
    per_layer: tuple[dict[str, int], ...]  # GPU component bytes of each layer
    device_pages: int = 0  # pages the request holds in each device pool (device_pages set;
    #   their bytes are in ``gpu``: device_pages * device_page_bytes)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def sized_for(engine: EngineConfig, context: int) -> EngineConfig:
    """``engine`` with max_len = context rounded up to a multiple of both strides."""
    from lsparse_jax.model.presets import fit_max_len

    return dataclasses.replace(engine, model=fit_max_len(engine.model, context))


def request_bytes(engine: EngineConfig, context: int, layout: Layout | None = None,
                  weights_share: int = 0) -> RequestBytes:
    """GPU and host bytes of one request whose slot holds ``context`` tokens.

    Notation: D KV dim, W SWA window, m CSA stride, N_c = ctx/m CSA rows, N_h = ctx/128 HCA
    rows, P page rows, B hot rows, k_b key bytes.
    Per layer on the GPU: SWA window W*row; CSA compressor rings 2m*4D + 2m*4D_I values, HCA
    ring m_h*2D values; resident KV N*row (CSA resident, HCA, DSA); indexer keys N*k_b (CSA,
    leading DSA layers); paged CSA layers: tail P*row + hot B*(row+meta) + clock instead of
    N_c*row, and N_c rows in host pages (a whole number of pages); leansparse also moves the
    keys: PQ codes N_c*M bytes + key cache Bk*(k_b+meta) + clock + key tail P*k_b on the GPU,
    the keys in host pages. The page table is one int32 per page, once per request (adaptive:
    twice, with its ready map of lent pages).
    DSA layers (L rows, one per token, f32): resident L*row, and L*k_b keys for group leaders;
    under host paging as CSA layers with pages of P*m rows: tail P*m*row, a hot cache of B rows
    (members under location reuse: B*row, no metadata or clock: the leader's locations are
    theirs), ceil(N_c/P)*P*m rows in host pages; leansparse pages the leaders' keys likewise
    (PQ codes L*M, key cache, key tail P*m*k_b on the GPU).
    Device pools (``CacheConfig.device_pages``): the CSA state that grows with context
    (resident rows, exact keys, PQ codes) is counted in whole pages, ceil(N_c/P)*P rows,
    plus a tail of P rows for rows and exact keys; HCA rows likewise in pages of
    P_h = P*m/m_h rows plus a P_h-row tail; one more page table (device pages).
    """
    engine = sized_for(engine, context)
    cfg, cache = engine.model, engine.cache
    lay = layout or Layout.ours(cfg)
    d, di, val = cfg.head_dim, cfg.indexer.head_dim, lay.compressor_value
    gpu = dict.fromkeys(GPU_COMPONENTS, 0)
    host = dict.fromkeys(HOST_COMPONENTS, 0)
    per_layer = []
    pooled = cache.device_pages is not None
    csa_pages = -(-(context // cfg.csa_ratio) // cache.page_size)  # as the controller reserves
    for i, kind in enumerate(cfg.layer_pattern):
        layer = dict.fromkeys(GPU_COMPONENTS, 0)
        n = cfg.num_compressed(kind)
        if kind in ("swa", "csa", "hca"):
            layer["swa_window"] = cfg.swa_window * lay.plain_row
        if kind == "csa":
            paged_rows = csa_pages * cache.page_size
            kept = paged_rows if pooled else n  # rows of device state that grows with context
            layer["compressor_state"] = 2 * cfg.csa_ratio * 4 * (d + di) * val
            layer["indexer_keys"] = kept * lay.index_key
            if pooled and not engine.storage.keys_on_host:
                layer["tail"] += cache.page_size * lay.index_key
            if engine.storage.kv_on_host:
                layer["tail"] += cache.page_size * lay.kv_row
                layer["hot_cache"] = (cache.hot_cache_rows * (lay.kv_row + lay.hot_row_meta)
                                      + lay.hot_scalar)
                host["attention_kv"] += paged_rows * lay.kv_row
            else:
                layer["attention_kv"] = kept * lay.kv_row
                if pooled:
                    layer["tail"] += cache.page_size * lay.kv_row
            if engine.storage.keys_on_host:
                layer["indexer_keys"] = 0
                layer["pq_codes"] = kept * engine.pq_subspaces
                layer["key_cache"] = (engine.leansparse.key_cache_rows
                                      * (lay.index_key + lay.hot_row_meta) + lay.hot_scalar)
                layer["tail"] += cache.page_size * lay.index_key
                host["indexer_keys"] += paged_rows * lay.index_key
        if kind == "hca":
            layer["compressor_state"] = cfg.hca_ratio * 2 * d * val
            if pooled:  # whole pages of P_h rows, and a tail of P_h rows
                page_rows = cache.page_size * cfg.csa_ratio // cfg.hca_ratio
                layer["attention_kv"] = csa_pages * page_rows * lay.hca_bytes
                layer["tail"] = page_rows * lay.hca_bytes
            else:
                layer["attention_kv"] = n * lay.hca_bytes
        if kind == "dsa" and cfg.kv_source(i) == i:  # (dsa_shared_kv members hold nothing)
            _dsa_layer(engine, lay, layer, host, n, csa_pages, cfg.dsa_leader(i) == i)
        per_layer.append(layer)
        for key, value in layer.items():
            gpu[key] += value
    # one int32 per page: host pages, a ready map of lent pages beside them, device pages
    tables = engine.storage.kv_on_host + engine.storage.lent_pages + pooled
    gpu["page_table"] = 4 * engine.pages_per_slot * tables
    gpu["weights_share"] = weights_share
    return RequestBytes(gpu=gpu, host=host, per_layer=tuple(per_layer),
                        device_pages=csa_pages if pooled else 0)


def _dsa_layer(engine: EngineConfig, lay: Layout, layer: dict, host: dict, n: int,
               pages: int, leads: bool) -> None:
    """Adds one DSA layer's bytes to ``layer`` (GPU) and ``host`` (see ``request_bytes``)."""
    cache, storage = engine.cache, engine.storage
    page = cache.page_size * engine.model.csa_ratio  # per-token rows of one page id
    if storage.kv_on_host:
        follower = not leads and cache.location_reuse
        meta, scalar = (0, 0) if follower else (lay.hot_row_meta, lay.hot_scalar)
        layer["tail"] += page * lay.plain_row
        layer["hot_cache"] = cache.hot_cache_rows * (lay.plain_row + meta) + scalar
        host["attention_kv"] += pages * page * lay.plain_row
    else:
        layer["attention_kv"] = n * lay.plain_row
    if not leads:
        return
    if storage.keys_on_host:
        layer["pq_codes"] = n * engine.pq_subspaces
        layer["key_cache"] = (engine.leansparse.key_cache_rows
                              * (lay.index_key + lay.hot_row_meta) + lay.hot_scalar)
        layer["tail"] += page * lay.index_key
        host["indexer_keys"] += pages * page * lay.index_key
    else:
        layer["indexer_keys"] = n * lay.index_key


def layer_state_bytes(cfg: ModelConfig) -> tuple[int, ...]:
    """Bytes of each layer's prefill state S_l: its resident ``LayerCache`` for one request
    at max_len (what a layer-streamed prefill moves and holds per layer)."""
    def size(tree):
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))

    return tuple(size(jax.eval_shape(functools.partial(empty_layer_cache, cfg, i)))
                 for i in range(cfg.num_layers))


def stream_state_bytes(cfg: ModelConfig) -> int:
    """The two layer buffers of a layer-streamed prefill: max_l S_l + S_{l+1} (the layer
    computed and the next one loading)."""
    s = layer_state_bytes(cfg)
    return max((a + b for a, b in zip(s, s[1:])), default=s[0])


def admission_device_bytes(engine: EngineConfig, context: int | None = None) -> dict[str, int]:
    """Device bytes one admission needs, by component (the arrays; a chunk's activations
    and the kernels' scratch come on top).

    Notation: S_l the bytes of layer l's prefill state at max_len (``layer_state_bytes``).
      decode: the request's decode footprint (``request_bytes(engine, context).gpu_total``,
        context None: max_len), where it lives from then on;
      layer_buffers: the layer-streamed admission (``CacheConfig.streamed_prefill``: each
        layer admitted from the stream as it finishes) holds two layer states at once,
        max_l S_l + S_{l+1};
      resident_state: the monolithic admission instead materializes every layer, sum_l S_l
        (and ``steps.prefill`` holds input and output caches of a chunk, twice that);
      streamed_peak = decode + layer_buffers; monolithic_peak = decode + resident_state.
    """
    context = engine.model.max_len if context is None else context
    decode = request_bytes(engine, context).gpu_total
    buffers, resident = stream_state_bytes(engine.model), sum(layer_state_bytes(engine.model))
    return {"decode": decode, "layer_buffers": buffers, "resident_state": resident,
            "streamed_peak": decode + buffers, "monolithic_peak": decode + resident}


def prefill_transient_bytes(engine: EngineConfig, prompt_tokens: int) -> int:
    """Device bytes an admission's prefill holds beside the request's decode footprint until
    it enters decode (the arrays; a chunk's activations come on top).

    Notation: S_l(n) the bytes of layer l's prefill state sized to n prompt tokens
    (``layer_state_bytes`` at max_len = n rounded up to both strides).
    Layer-streamed (``CacheConfig.streamed_prefill``, LeanSparse section 4): two layer
    buffers, max_l S_l(n) + S_{l+1}(n). Otherwise the whole history on the device at once,
    sum_l S_l(n) (HiSparse's and ECHO's prefill: "prefill's temporary memory demand can
    delay admission even when enough memory remains for the same request's decode").
    """
    cfg = sized_for(engine, prompt_tokens).model
    if engine.cache.streamed_prefill:
        return stream_state_bytes(cfg)
    return sum(layer_state_bytes(cfg))


def prefix_host_bytes(engine: EngineConfig, length: int) -> int:
    """Host bytes of a detached prefix of ``length`` tokens (``serving.prefix.Prefix``).

    Notation: S_l as in ``layer_state_bytes``, m CSA stride, P page rows, f = (length // m)
    // P complete pages; per host-paged layer l: N_l rows at max_len (max_len / m for CSA,
    max_len for DSA), P_l rows a page (P for CSA, P * m for DSA), r_l the bytes of one row in
    host pages (a KV row, plus an FP8 key for leansparse's CSA layers and DSA leaders; 0
    without host pages; DSA members under dsa_shared_kv hold none).
    The saved state is each layer's resident state with its host-paged rows cut to the
    P_l-row tail: sum_l S_l - sum_l (N_l - P_l) r_l; the pages: f sum_l P_l r_l.
    """
    cfg, storage, page = engine.model, engine.storage, engine.cache.page_size
    full = (length // cfg.csa_ratio) // page
    total = sum(layer_state_bytes(cfg))
    for i, kind in enumerate(cfg.layer_pattern):
        if kind == "csa":
            rows, per_page, kv = cfg.num_compressed("csa"), page, KVRowFormat.of(cfg).row_bytes
        elif kind == "dsa" and cfg.kv_source(i) == i:
            rows, per_page, kv = cfg.max_len, page * cfg.csa_ratio, dsa_row_format(cfg).row_bytes
        else:
            continue
        leads = i in cfg.indexer_layers
        row = ((kv if storage.kv_on_host else 0)
               + (cfg.indexer.key_bytes if storage.keys_on_host and leads else 0))
        total += full * per_page * row - (rows - per_page) * row
    return total


def device_page_bytes(engine: EngineConfig, layout: Layout | None = None) -> int:
    """Bytes of one device page id: P rows in every device pool of every CSA layer (KV rows
    unless on the host, exact keys unless on the host, else PQ codes) and P * m / m_hca rows
    of every HCA layer."""
    cfg, storage, page = engine.model, engine.storage, engine.cache.page_size
    lay = layout or Layout.ours(cfg)
    per_row = ((0 if storage.kv_on_host else lay.kv_row)
               + (engine.pq_subspaces if storage.keys_on_host else lay.index_key))
    hca = cfg.layer_pattern.count("hca") * (page * cfg.csa_ratio // cfg.hca_ratio) \
        * lay.hca_bytes  # the HCA rows of the same tokens
    return page * per_row * cfg.layer_pattern.count("csa") + hca


def pool_pages(engine: EngineConfig, budget_bytes: int, layout: Layout | None = None) -> int:
    """Device pages (``CacheConfig.device_pages``) that ``budget_bytes`` of device pools hold
    for this method."""
    return int(budget_bytes // device_page_bytes(engine, layout))


def pooled_capacity(engine: EngineConfig, context: int) -> int:
    """Requests of ``context`` tokens that fit at once with ``engine``'s device pools: the
    pages each holds against ``device_pages``, capped by ``num_slots``."""
    if engine.cache.device_pages is None:
        raise ValueError("pooled_capacity: CacheConfig.device_pages is None (no device pools)")
    per = -(-(context // engine.model.csa_ratio) // engine.cache.page_size)
    return min(engine.cache.num_slots, engine.cache.device_pages // max(per, 1))


def budget_capacity(engine: EngineConfig, context: int, budget_bytes: int,
                    layout: Layout | None = None) -> int:
    """Most requests of ``context`` tokens whose whole GPU state (per-slot state plus their
    device pool pages: ``engine`` needs ``device_pages`` set, any value) fits in
    ``budget_bytes``. ``budget_pools`` sizes the pools that then admit exactly that many."""
    if engine.cache.device_pages is None:
        raise ValueError("budget_capacity: CacheConfig.device_pages is None (no device pools)")
    return int(budget_bytes // request_bytes(engine, context, layout).gpu_total)


def budget_pools(engine: EngineConfig, context: int, budget_bytes: int, slots: int,
                 layout: Layout | None = None) -> int:
    """Device pages (``CacheConfig.device_pages``) left in ``budget_bytes`` beside the
    per-slot state of ``slots`` slots sized for ``context`` tokens (max_len = context)."""
    per = request_bytes(engine, context, layout)
    page = device_page_bytes(engine, layout)
    fixed = per.gpu_total - per.device_pages * page  # per-slot state, not in the pools
    pages = (budget_bytes - slots * fixed) // page
    if pages < 1:
        raise ValueError(f"budget_pools: {slots} slots' state ({slots * fixed} B) leaves no "
                         f"device page in the budget ({budget_bytes} B)")
    return int(pages)


def spec_bytes(engine: EngineConfig, drafter: DrafterConfig,
               layout: Layout | None = None) -> dict[str, int]:
    """Device bytes one request adds for speculative decoding (``serving.speculative``).

    Notation: l draft layers, W window, h draft heads, d head dim, H target hidden, T = gamma
      + 1, k top-k.
    drafter_ring: the persistent ring of W positions (f32) plus W int32 positions, equal to
      ``SpecState``'s slot: ``DrafterConfig.ring`` "kv" keeps every draft layer's keys and
      values, l * W * h * d * 4 * 2 + 4W; "features" the target feature, W * H * 4 + 4W.
    staging: what a verification holds while it runs, per CSA and DSA layer: the union of the
      block's T selections, T * k rows (resolved once per group leader, followed by its
      members), plus the block's T new raw rows per windowed layer. The block's compressed
      rows themselves are staged in the tail page (or resident table) the method already
      holds and rolled back on rejection, so staging adds no persistent bytes.
    """
    cfg = engine.model
    lay = layout or Layout.ours(cfg)
    t = drafter.gamma + 1
    per_position = (cfg.hidden if drafter.ring == "features"
                    else drafter.num_layers * drafter.num_heads * drafter.head_dim * 2)
    ring = drafter.window * per_position * 4
    csa = sum(k == "csa" for k in cfg.layer_pattern)
    dsa = cfg.layer_pattern.count("dsa")
    windowed = sum(k in ("swa", "csa", "hca") for k in cfg.layer_pattern)
    staging = (csa * t * cfg.indexer.top_k * lay.kv_row + dsa * t * cfg.indexer.top_k
               * lay.plain_row + windowed * t * lay.plain_row)
    return {"drafter_ring": ring + 4 * drafter.window, "staging": staging}


def shared_pool_bytes(engine: EngineConfig, layout: Layout | None = None) -> int:
    """Bytes of echo's GPU KV pool shared by all requests (``CacheConfig.shared_pool_rows``
    entries of row + metadata per CSA layer; 0 for the other methods). Each request's buffer
    of hot_cache_rows entries lives in it and is also in its ``request_bytes`` (hot_cache), the
    rest holds prefills' histories."""
    rows = engine.cache.shared_pool_rows
    if rows is None:
        return 0
    lay = layout or Layout.ours(engine.model)
    return engine.model.layer_pattern.count("csa") * rows * (lay.kv_row + lay.hot_row_meta)


def param_bytes(cfg: ModelConfig) -> int:
    """Bytes of the model's parameters (f32), from shapes alone (nothing is allocated)."""
    from lsparse_jax.model import init_params

    shapes = jax.eval_shape(lambda: init_params(cfg))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(shapes))


def max_concurrency(engine: EngineConfig, context: int, hbm_bytes: int, weight_bytes: int,
                    layout: Layout | None = None, host_bytes: int | None = None) -> int:
    """Most requests of ``context`` tokens whose GPU state fits beside the weights in
    ``hbm_bytes`` (and whose host state fits in ``host_bytes`` if given; echo: and whose
    buffers fit in its shared pool)."""
    per = request_bytes(engine, context, layout)
    free = hbm_bytes - weight_bytes
    if free < 0:
        raise ValueError(f"max_concurrency: weights ({weight_bytes} B) exceed the HBM budget "
                         f"({hbm_bytes} B)")
    count = free // per.gpu_total
    if host_bytes is not None and per.host_total:
        count = min(count, host_bytes // per.host_total)
    if engine.cache.shared_pool_rows is not None:
        count = min(count, engine.cache.shared_pool_rows // engine.cache.hot_cache_rows)
    return int(count)


def figure1_ratio(context: int = 512 * 1024, hot_rows: int = 4096) -> float:
    """LeanSparse Figure 1: one V4-Flash CSA layer's FP8 indexer keys over a hot KV buffer of
    ``hot_rows`` 584-byte entries, at ``context`` tokens (7.2x at 512K)."""
    from lsparse_jax.config import CacheConfig
    from lsparse_jax.model.presets import preset

    engine = EngineConfig(model=preset("v4_flash"), method="hisparse",
                          cache=CacheConfig(hot_cache_rows=hot_rows))
    layers = request_bytes(engine, context, Layout.v4_serving()).per_layer
    csa = next(layer for layer, kind in zip(layers, engine.model.layer_pattern) if kind == "csa")
    return csa["indexer_keys"] / csa["hot_cache"]
