"""Frozen, validated configuration dataclasses.

Every dataclass validates itself on construction: a bad value raises ``ValueError`` naming the
field, the value and what is allowed. Configs are hashable, so they can be static arguments of
``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from lsparse_jax.kernels import ENGINE_IMPLEMENTATIONS

LayerKind = Literal["swa", "csa", "hca", "dsa"]
LAYER_KINDS: tuple[str, ...] = ("swa", "csa", "hca", "dsa")
KV_DTYPES: tuple[str, ...] = ("f32", "bf16", "fp8_v4")  # stored CSA KV rows (quant.kv_rows)
MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "tf32", "bf16")  # ModelConfig.matmul_precision
ATTENTION_PRECISIONS: tuple[str, ...] = ("f32", "bf16")  # ModelConfig.attention_precision
SCORE_PRECISIONS: tuple[str, ...] = ("f32", "fp8")  # IndexerConfig.score_precision
WEIGHT_DTYPES: tuple[str, ...] = ("f32", "bf16")  # ModelConfig.weight_dtype



@dataclasses.dataclass(frozen=True)
class Storage:
    """Where a serving method keeps a CSA layer's history (data for memory accounting).

    kv_on_host: compressed KV rows in host pages behind a per-request GPU hot cache.
    keys_on_host: FP8 indexer keys in host pages behind a GPU key cache, PQ codes on the GPU.
    lent_pages: complete prompt pages may also be lent device pages (``cache.optional_pages``),
      with a per-slot ready map beside the page table.
    """

    kv_on_host: bool = False
    keys_on_host: bool = False
    lent_pages: bool = False


# Serving methods by name -> (settings check, storage). ``lsparse_jax.methods`` registers each
# policy module when it is imported; ``import lsparse_jax`` imports them all.
_METHOD_CHECKS: dict[str, Callable[[EngineConfig], None]] = {}
_METHOD_STORAGE: dict[str, Storage] = {}


def register_method(name: str, check: Callable[[EngineConfig], None], storage: Storage) -> None:
    """Makes ``name`` a valid ``EngineConfig.method``; ``check(engine)`` raises ValueError on
    settings the method cannot serve."""
    _METHOD_CHECKS[name] = check
    _METHOD_STORAGE[name] = storage


def method_names() -> tuple[str, ...]:
    return tuple(_METHOD_CHECKS)


def method_storage(name: str) -> Storage:
    """Where method ``name`` keeps KV rows and indexer keys (what settings it needs)."""
    if name not in _METHOD_STORAGE:
        raise ValueError(f"unknown method {name!r}; allowed methods are {method_names()}")
    return _METHOD_STORAGE[name]


def invalid(cls: str, field: str, value, allowed: str):
    """Raises the project's config error: the field, its value and what is allowed."""
    raise ValueError(f"{cls}.{field}={value!r} is invalid: {allowed}")


def _positive(cls: str, **fields):
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            invalid(cls, name, value, "must be a positive int")


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """The lightning indexer of CSA and DSA layers.

    Attributes:
      num_heads: indexer query heads H.
      head_dim: indexer key/query dim D (one shared key head per entry).
      top_k: positions selected per query.
      fp8_block: values per FP8 scale; a key of D values stores D / fp8_block fp32 scales.
      score_precision: the arithmetic of a decode step's exact scores of the stored FP8 keys
        (each decode or verification query's top-k, LeanSparse's rescoring; every method and
        implementation alike, so the hierarchy identities hold at either): "f32" (q as is; the
        kernels split it into bf16 hi + lo, ~1e-5 relative) or "fp8" (DeepSeek-V4's indexer
        arithmetic: q quantized per head to e4m3, its scale moved into the head weight, an
        fp8 x fp8 dot; ``index_scores``' "triton_fp8" / "xla_fp8"). A prefill chunk's scores
        keep the model's matmul precision.
    """

    num_heads: int = 4
    head_dim: int = 32
    top_k: int = 16
    fp8_block: int = 32
    score_precision: str = "f32"

    def __post_init__(self):
        _positive("IndexerConfig", num_heads=self.num_heads, head_dim=self.head_dim,
                  top_k=self.top_k, fp8_block=self.fp8_block)
        if self.head_dim % self.fp8_block:
            invalid("IndexerConfig", "fp8_block", self.fp8_block,
                  f"must divide head_dim={self.head_dim}")
        if self.score_precision not in SCORE_PRECISIONS:
            invalid("IndexerConfig", "score_precision", self.score_precision,
                    f"must be one of {SCORE_PRECISIONS}")

    @property
    def key_bytes(self) -> int:
        """Bytes of one stored FP8 key: D e4m3 values plus D / fp8_block fp32 scales."""
        return self.head_dim + 4 * (self.head_dim // self.fp8_block)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A model of the native sparse-attention family (DeepSeek-V4 CSA/HCA/SWA, GLM-5 DSA).

    Attributes:
      vocab_size: token vocabulary (256 for the byte tokenizer).
      hidden: residual stream width.
      num_heads: attention query heads; there is one KV head of dim ``head_dim``.
      head_dim: dim of the KV head (a compressed entry is both key and value).
      rope_dim: trailing dims of q/k that get RoPE (even, <= head_dim).
      mlp_hidden: dense FFN width (FFNs are not our subject: a small gated MLP).
      layer_pattern: the kind of each layer, from "swa", "csa", "hca", "dsa".
      swa_window: raw tokens each query sees in SWA (including itself).
      csa_ratio: CSA compression stride m (V4: 4); windows overlap by m.
      hca_ratio: HCA compression stride (V4: 128); windows do not overlap.
      indexer: the lightning indexer of CSA/DSA layers.
      dsa_share_group: DSA layers are grouped in runs of this size; later layers of a group
        reuse the first layer's selection (GLM-5 index sharing). 1 = no sharing.
      dsa_shared_kv: V4-style KV-source sharing (Adaptive DHiSparse: "DeepSeek-V4.1-Flash
        shares one physical global KV source across compatible layers, so Reuse layers
        inherit the prior location vector"): the later layers of a DSA share group keep no
        KV rows of their own and attend to their leader's rows, read at the leader's
        resolved locations (no second resolve, no fetch: ``model.store.Locations``). False
        (GLM-5, and every preset): each layer keeps its own rows (the selection is shared,
        the payloads are fetched per layer). No preset sets it: DeepSeek-V4-Flash's public
        config gives every CSA and HCA layer its own compressor, so none of its layers share
        a KV source; this is the minimal notion of one, carried by DSA share groups.
      rope_theta: RoPE base.
      max_len: the longest context (prompt + generated) a slot can hold.
      kv_dtype: how CSA and HCA layers store compressed KV rows (``lsparse_jax.quant.kv_rows``):
        "f32" (4D bytes a row), "bf16" (2D), or "fp8_v4" (DeepSeek-V4: FP8 e4m3 non-RoPE part
        with a power-of-two scale per 64 values, bf16 RoPE part). The resident layout, the
        host pages, hot cache, lent pages and device pools hold rows in this format; attention
        reads them dequantized to f32. SWA windows and DSA rows stay f32 (before session 35
        HCA rows did too).
      matmul_precision: the model's matmuls and indexer scores (``model.layers``): "highest"
        (f32; decode equals forward bit for bit on CPU), "tf32" (GPU tensor cores at TF32;
        f32 on CPU) or "bf16" (bf16 operands, f32 accumulation). Pallas kernels keep their own.
      attention_precision: what a CSA layer's decode hands the sparse_attention kernel
        (implementation != "xla"; the XLA decode path always attends in f32):
        "f32" (default): f32 rows: bf16 and FP8 rows decoded to f32 after the gather, f32
        rows as stored; the kernel's f32 path (3-pass TF32 on the GPU, within ~1e-6 of XLA).
        "bf16": rows in the kernel's fast formats: FP8 (fp8_v4) and bf16 rows read in place
        as stored (no decoded copy), f32 rows' selected ones and the window rounded to bf16;
        bf16 tensor-core dots (q and the probabilities rounded to bf16, f32 accumulation).
        Its logit error (tests/test_kv_rows.py) is below what fp8_v4 rows already cost.
        Every method reads the kernel in the same form, so the hierarchy identities
        (hisparse == resident, ...) hold bit for bit at either setting. HCA layers attend
        in the kernel only at "bf16" (every row read where it lies, a device pool in place);
        at "f32" they attend in XLA (the kernel's f32 path is slow over thousands of rows).
      weight_dtype: how serving stores the model's matmul weights (every Dense kernel;
        ``model.transformer.serving_params``, applied by ``Engine`` and ``steps.prefill``):
        "f32" as trained, or "bf16" (needs matmul_precision "bf16", whose matmuls round their
        operands to bf16 anyway): each decode step then reads half the weight bytes. Serving
        bf16-stored weights equals serving f32 weights that hold the same bf16 values, bit for
        bit (tested); against the f32 originals it is the rounding the bf16 matmuls apply on
        a GPU (XLA's CPU backend computes "bf16" matmuls in f32, so there it differs).
    """

    vocab_size: int = 256
    hidden: int = 128
    num_heads: int = 4
    head_dim: int = 64
    rope_dim: int = 16
    mlp_hidden: int = 256
    layer_pattern: tuple[str, ...] = ("swa", "csa", "hca", "csa")
    swa_window: int = 32
    csa_ratio: int = 4
    hca_ratio: int = 128
    indexer: IndexerConfig = dataclasses.field(default_factory=IndexerConfig)
    dsa_share_group: int = 1
    dsa_shared_kv: bool = False
    rope_theta: float = 10000.0
    max_len: int = 2048
    kv_dtype: str = "f32"
    matmul_precision: str = "highest"
    attention_precision: str = "f32"
    weight_dtype: str = "f32"

    def __post_init__(self):
        if isinstance(self.layer_pattern, list):
            object.__setattr__(self, "layer_pattern", tuple(self.layer_pattern))
        _positive("ModelConfig", vocab_size=self.vocab_size, hidden=self.hidden,
                  num_heads=self.num_heads, head_dim=self.head_dim, mlp_hidden=self.mlp_hidden,
                  swa_window=self.swa_window, csa_ratio=self.csa_ratio,
                  hca_ratio=self.hca_ratio, dsa_share_group=self.dsa_share_group,
                  max_len=self.max_len)
        if not isinstance(self.dsa_shared_kv, bool):
            invalid("ModelConfig", "dsa_shared_kv", self.dsa_shared_kv, "must be a bool")
        if not self.layer_pattern:
            invalid("ModelConfig", "layer_pattern", self.layer_pattern, "needs at least one layer")
        for kind in self.layer_pattern:
            if kind not in LAYER_KINDS:
                invalid("ModelConfig", "layer_pattern", self.layer_pattern,
                      f"unknown layer kind {kind!r}; allowed kinds are {LAYER_KINDS}")
        if not isinstance(self.rope_dim, int) or self.rope_dim < 0 or self.rope_dim % 2 \
                or self.rope_dim > self.head_dim:
            invalid("ModelConfig", "rope_dim", self.rope_dim,
                  f"must be an even int in [0, head_dim={self.head_dim}]")
        for name in ("csa_ratio", "hca_ratio"):
            if self.max_len % getattr(self, name):
                invalid("ModelConfig", "max_len", self.max_len, f"must be a multiple of {name}")
        if not isinstance(self.indexer, IndexerConfig):
            invalid("ModelConfig", "indexer", self.indexer, "must be an IndexerConfig")
        if self.rope_theta <= 0:
            invalid("ModelConfig", "rope_theta", self.rope_theta, "must be > 0")
        if self.kv_dtype not in KV_DTYPES:
            invalid("ModelConfig", "kv_dtype", self.kv_dtype, f"allowed: {KV_DTYPES}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            invalid("ModelConfig", "matmul_precision", self.matmul_precision,
                    f"allowed: {MATMUL_PRECISIONS}")
        if self.attention_precision not in ATTENTION_PRECISIONS:
            invalid("ModelConfig", "attention_precision", self.attention_precision,
                    f"allowed: {ATTENTION_PRECISIONS}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            invalid("ModelConfig", "weight_dtype", self.weight_dtype,
                    f"allowed: {WEIGHT_DTYPES}")
        if self.weight_dtype == "bf16" and self.matmul_precision != "bf16":
            invalid("ModelConfig", "weight_dtype", self.weight_dtype,
                    f"bf16 weights need matmul_precision='bf16' (got "
                    f"{self.matmul_precision!r}: its matmuls would use the rounded weights at "
                    f"higher precision)")
        if self.kv_dtype == "fp8_v4" and not 0 < self.rope_dim < self.head_dim:
            invalid("ModelConfig", "kv_dtype", self.kv_dtype,
                    f"'fp8_v4' splits a row into FP8 non-RoPE and bf16 RoPE parts: needs "
                    f"0 < rope_dim < head_dim, got rope_dim={self.rope_dim}, "
                    f"head_dim={self.head_dim}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_pattern)

    def num_compressed(self, kind: str) -> int:
        """Compressed entries a slot of ``max_len`` tokens holds for a layer of ``kind``."""
        return {"csa": self.max_len // self.csa_ratio, "hca": self.max_len // self.hca_ratio,
                "dsa": self.max_len}.get(kind, 0)

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """Layers that run their own indexer: CSA layers and the leaders of DSA groups."""
        return tuple(i for i, k in enumerate(self.layer_pattern)
                     if k == "csa" or (k == "dsa" and self.dsa_leader(i) == i))

    def kv_source(self, layer: int) -> int:
        """The layer whose KV rows ``layer`` attends to: itself, or (``dsa_shared_kv``) its
        DSA group leader."""
        if self.dsa_shared_kv and self.layer_pattern[layer] == "dsa":
            return self.dsa_leader(layer)
        return layer

    def dsa_leader(self, layer: int) -> int:
        """The layer whose selection DSA layer ``layer`` uses (itself if it leads its group)."""
        dsa_layers = [i for i, k in enumerate(self.layer_pattern) if k == "dsa"]
        rank = dsa_layers.index(layer)
        return dsa_layers[rank - rank % self.dsa_share_group]


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Serving-side capacities.

    Attributes:
      num_slots: requests decoded together (the decode batch).
      prefill_chunk: tokens per prefill chunk (a multiple of the CSA stride is not required).
      hot_cache_rows: per-request, per-CSA-layer GPU hot-cache rows B (hierarchy methods);
        None for methods that keep everything resident.
      page_size: compressed rows per host page P (hierarchy methods).
      host_pages: pages in each CSA layer's host pool, shared by all slots; None = enough for
        every slot at max_len.
      streamed_prefill: prefill layer by layer with each layer's prefix state in host memory,
        streamed through two device buffers (LeanSparse; serving/prefill_stream.py).
      optional_pages: adaptive only: device pages per CSA layer, shared by all slots, lent to
        complete pages of imported (prompt) history (Adaptive DHiSparse's optional residency).
      refill_pages: adaptive only: optional pages refilled per decode step at most (bounded
        round-robin over the requests that lost theirs).
      device_pages: pages of P compressed rows in each device pool (``memory.device_pool``):
        the GPU state of CSA layers that grows with context (resident KV rows, exact indexer
        keys, PQ codes) is then paged, reserved per request by prompt + max_new_tokens, so
        the method's footprint per token decides how many requests fit;
        ``memory.accounting.pool_pages`` converts a byte budget. None: every slot holds that
        state at max_len (the preallocated layout). num_slots stays the cap of concurrent
        requests (per-slot state: SWA window, tails, hot caches, page-table rows).
      shared_pool_rows: echo only: compressed KV entries per CSA layer of the GPU KV pool
        shared by all requests (ECHO; 256K in the LeanSparse paper's replay). Each decoding
        request holds its buffer of hot_cache_rows entries in it and each prefill the
        compressed rows of its whole prompt until it enters decode (``methods.echo``).
      shared_budget_bytes: adaptive only: device bytes that the admitted requests' required
        state (``memory.accounting.request_bytes`` at prompt + max_new_tokens) and the lent
        optional pages share (required + optional <= budget). An admission that leaves a
        deficit reclaims whole requests' optional pages in reclaim order, and waits if all of
        them cannot cover it; new and refilled pages are lent only from spare bytes. None:
        the optional pages are a separate allocation, lent whenever one is free.
      prefetch_rows: echo only: P positions ranked just below each decode step's top-k
        (ranks k .. k + P - 1 of the exact index scores) that the step also copies into the
        request's buffer when missing: ECHO's intra-query prefetch, which counts on adjacent
        steps' selections crossing the top-k boundary (``methods.echo``). Lossless: the
        attention reads only the top-k. Needs hot_cache_rows >= top_k + P. 0: none.
      location_reuse: paged methods with DSA share groups: member layers inherit their
        leader's location vector (``model.store.Locations``: the leader's resolve decides the
        missing positions once; each member copies its own rows of them into the same hot
        rows and keeps no LRU metadata). False: each member resolves the shared selection
        through its own hot cache (the same rows bit for bit; the reference of the tests).
    """

    num_slots: int = 1
    prefill_chunk: int = 256
    hot_cache_rows: int | None = None
    page_size: int = 64
    host_pages: int | None = None
    streamed_prefill: bool = False
    optional_pages: int | None = None
    refill_pages: int = 4
    device_pages: int | None = None
    shared_pool_rows: int | None = None
    shared_budget_bytes: int | None = None
    location_reuse: bool = True
    prefetch_rows: int = 0

    def __post_init__(self):
        if not isinstance(self.location_reuse, bool):
            invalid("CacheConfig", "location_reuse", self.location_reuse, "must be a bool")
        _positive("CacheConfig", num_slots=self.num_slots, prefill_chunk=self.prefill_chunk,
                  page_size=self.page_size, refill_pages=self.refill_pages)
        if isinstance(self.prefetch_rows, bool) or not isinstance(self.prefetch_rows, int) \
                or self.prefetch_rows < 0:
            invalid("CacheConfig", "prefetch_rows", self.prefetch_rows, "must be an int >= 0")
        for name in ("hot_cache_rows", "host_pages", "optional_pages", "device_pages",
                     "shared_pool_rows", "shared_budget_bytes"):
            if getattr(self, name) is not None:
                _positive("CacheConfig", **{name: getattr(self, name)})


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Token sampling: temperature 0 is greedy; otherwise seeded categorical sampling."""

    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0.0:
            invalid("SamplingConfig", "temperature", self.temperature, "must be >= 0")


HOST_KEY_ROWS = ("split", "packed")


@dataclasses.dataclass(frozen=True)
class LeanSparseConfig:
    """LeanSparse coarse-to-fine indexing (paper defaults: C = 2048, 4K key cache, offset 1).

    Attributes:
      num_candidates: C, positions kept by the PQ coarse pass (>= top-k).
      miss_filter_offset: an uncached candidate is dropped if its coarse score is below the
        candidates' k-th largest minus this many sample standard deviations; None = no filter.
      key_cache_rows: per-request, per-CSA-layer GPU cache of exact FP8 keys (>= C).
      pq_subspace_dim: dims per PQ subvector (one byte each): M = head_dim / this.
      warm_steps: a request's first decode steps with a cold key cache (admission leaves it
        empty): during them the miss filter keeps every candidate, whose exact keys are then
        fetched and fill the cache; 0 = the filter from the first step. Our choice (the paper
        is silent on admission): README "Cold start".
      groups: request groups of the decode step (Section 5): the batch of slots is split into
        this many groups (it must divide ``cache.num_slots``) whose selections run as
        independent sub-batches, so that one group's indexer-key fetch (host reads) can run
        while another group's coarse pass does (``lsparse_jax.request_groups`` says what
        overlap XLA gives). 1 = one batch (the step is then exactly the ungrouped program).
        Tokens, selections and statistics do not depend on it.
      fetch_stream: with groups > 1, the GPU stream (>= 1) that each group's key fetch runs
        on as an async call; None keeps it on the main stream (the grouping alone). Ignored
        off the GPU and with groups = 1.
      coarse_precision: the coarse pass's dot: "bf16" (q and codebooks in bf16) or "fp8"
        (e4m3 with per-head / per-subspace scales, ``pallas_kernels.pq_topc``; H200: 1.33 vs
        2.36 ms at B 64, N 131072, top-C recall 0.956 on random data).
      coarse_implementation: the coarse pass's kernel (``pq_topc``'s implementation: "xla",
        "triton", "jax_triton"), None: the engine's ``implementation``. "jax_triton" (GPU
        only) is the fastest FP8 form in isolation (1.33 ms at B 64, N 131072; the Pallas
        kernel 3.01 ms); it runs in the decode step's vmap through ``batch_folding``.
      host_key_rows: how the host key pages store a key row: "split" (the D_I e4m3 values
        and the nb f32 scales in two arrays: two host reads a missed row) or "packed" (both
        side by side in one row of D_I / 4 + nb words, ``PackedPool``: one read; the same
        bytes). H100, session 43, a bare copy of 12288 random rows of a 2.2 GB pool: 157 us
        packed vs 287 us split (``benchmarks/host_rows_gpu.py --layouts keys``).
    """

    num_candidates: int = 2048
    miss_filter_offset: float | None = 1.0
    key_cache_rows: int = 4096
    pq_subspace_dim: int = 4
    warm_steps: int = 1
    groups: int = 1
    fetch_stream: int | None = 1
    coarse_precision: str = "bf16"
    coarse_implementation: str | None = None
    host_key_rows: str = "split"

    def __post_init__(self):
        if self.host_key_rows not in HOST_KEY_ROWS:
            invalid("LeanSparseConfig", "host_key_rows", self.host_key_rows,
                    f"must be one of {HOST_KEY_ROWS}")
        _positive("LeanSparseConfig", num_candidates=self.num_candidates,
                  key_cache_rows=self.key_cache_rows, pq_subspace_dim=self.pq_subspace_dim)
        if self.miss_filter_offset is not None and not self.miss_filter_offset >= 0:
            invalid("LeanSparseConfig", "miss_filter_offset", self.miss_filter_offset,
                  "must be >= 0 or None (no filter)")
        if not isinstance(self.warm_steps, int) or self.warm_steps < 0:
            invalid("LeanSparseConfig", "warm_steps", self.warm_steps, "must be an int >= 0")
        if self.key_cache_rows < self.num_candidates:
            invalid("LeanSparseConfig", "key_cache_rows", self.key_cache_rows,
                  f"must be >= num_candidates={self.num_candidates}: one step's candidates "
                  "must fit in the key cache")
        if not isinstance(self.groups, int) or isinstance(self.groups, bool) \
                or self.groups < 1:
            invalid("LeanSparseConfig", "groups", self.groups, "must be an int >= 1")
        if self.fetch_stream is not None and (not isinstance(self.fetch_stream, int)
                                              or isinstance(self.fetch_stream, bool)
                                              or self.fetch_stream < 1):
            invalid("LeanSparseConfig", "fetch_stream", self.fetch_stream,
                    "must be an int >= 1 (a GPU stream other than the main one) or None")
        if self.coarse_precision not in ("bf16", "fp8"):
            invalid("LeanSparseConfig", "coarse_precision", self.coarse_precision,
                    'must be "bf16" or "fp8"')
        if self.coarse_implementation not in (None, "xla", "triton", "jax_triton"):
            invalid("LeanSparseConfig", "coarse_implementation", self.coarse_implementation,
                    'must be None, "xla", "triton" or "jax_triton"')


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """A serving method on a model with its capacities."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    method: str = "resident"
    leansparse: LeanSparseConfig = dataclasses.field(default_factory=LeanSparseConfig)
    implementation: str | None = "xla"  # kernels of the decode step: "xla" (reference),
    #   "triton" (Pallas; interpret mode on CPU), "jax_triton" / "mosaic" (GPU: "triton" with
    #   pq_topc's jax-triton / sparse_attention's Mosaic kernel; ``lsparse_jax.kernels``), or
    #   None = fastest available
    tp: int = 1  # tensor parallelism: devices of the ``model`` mesh axis that split the
    #   attention heads, indexer heads and MLP width (``lsparse_jax.parallel``); 1 = one device

    def __post_init__(self):
        _positive("EngineConfig", tp=self.tp)
        for what, n in (("model.num_heads", self.model.num_heads),
                        ("model.indexer.num_heads", self.model.indexer.num_heads),
                        ("model.mlp_hidden", self.model.mlp_hidden)):
            if n % self.tp:
                invalid("EngineConfig", "tp", self.tp, f"must divide {what}={n}")
        if self.tp > 1 and self.cache.streamed_prefill:
            invalid("EngineConfig", "tp", self.tp, "cache.streamed_prefill runs on one device; "
                    "use tp=1 or the monolithic prefill")
        if self.implementation not in ENGINE_IMPLEMENTATIONS:
            invalid("EngineConfig", "implementation", self.implementation,
                    f"allowed: {ENGINE_IMPLEMENTATIONS} (lsparse_jax.kernels)")
        if self.method not in _METHOD_CHECKS:
            invalid("EngineConfig", "method", self.method,
                    f"allowed methods are {method_names()}")
        rows = self.cache.hot_cache_rows
        if rows is not None and rows < self.model.indexer.top_k:
            invalid("EngineConfig", "cache.hot_cache_rows", rows,
                  f"must be >= indexer.top_k={self.model.indexer.top_k}: a step's selection "
                  "must fit in the hot cache")
        _METHOD_CHECKS[self.method](self)

    @property
    def storage(self) -> Storage:
        """Where this engine's method keeps KV rows and indexer keys."""
        return method_storage(self.method)

    @property
    def pages_per_slot(self) -> int:
        """Host pages one slot needs to hold max_len tokens' CSA rows (paged methods)."""
        return -(-self.model.num_compressed("csa") // self.cache.page_size)

    @property
    def host_pages(self) -> int:
        if self.cache.host_pages is not None:
            return self.cache.host_pages
        return self.cache.num_slots * self.pages_per_slot

    @property
    def pq_subspaces(self) -> int:
        return self.model.indexer.head_dim // self.leansparse.pq_subspace_dim


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash-style block drafter (``model.drafter``) and its speculative decoding.

    Attributes:
      gamma: tokens drafted per verification (the block is [last token, gamma masks]).
      num_layers: draft layers (1-2).
      num_heads, head_dim: draft attention heads and their dim.
      mlp_hidden: draft FFN width.
      window: W, the committed positions a draft layer attends to (its ring buffer).
      target_layers: target layers whose output hidden states condition the drafter
        (concatenated, projected, injected as extra keys/values in every draft layer).
      ring: what a slot's ring keeps per position (``model.drafter.DrafterWindow``): "kv"
        every draft layer's keys and values (l * 2 * h * d values), or "features" the
        projected target feature (H values, the target's hidden), from which the keys and
        values of the window are recomputed at each draft. The same parameters serve both;
        ``memory.accounting.spec_bytes`` gives each one's bytes.
    """

    gamma: int = 4
    num_layers: int = 1
    num_heads: int = 4
    head_dim: int = 32
    mlp_hidden: int = 256
    window: int = 64
    target_layers: tuple[int, ...] = (1, 3)
    ring: str = "kv"

    def __post_init__(self):
        if isinstance(self.target_layers, list):
            object.__setattr__(self, "target_layers", tuple(self.target_layers))
        if self.ring not in ("kv", "features"):
            invalid("DrafterConfig", "ring", self.ring, "must be 'kv' or 'features'")
        _positive("DrafterConfig", gamma=self.gamma, num_layers=self.num_layers,
                  num_heads=self.num_heads, head_dim=self.head_dim,
                  mlp_hidden=self.mlp_hidden, window=self.window)
        if self.window < self.gamma + 1:
            invalid("DrafterConfig", "window", self.window,
                    f"must be >= gamma + 1 = {self.gamma + 1} (a verification commits up to "
                    "gamma + 1 positions into the ring)")
        if not self.target_layers or any(not isinstance(i, int) or i < 0
                                          for i in self.target_layers):
            invalid("DrafterConfig", "target_layers", self.target_layers,
                    "must be a non-empty tuple of layer indices >= 0")

    def check(self, model: ModelConfig) -> None:
        """Raises ValueError if this drafter cannot serve ``model``."""
        if max(self.target_layers) >= model.num_layers:
            invalid("DrafterConfig", "target_layers", self.target_layers,
                    f"the target has {model.num_layers} layers")
        rings = {"swa window": model.swa_window, "CSA compressor ring": 2 * model.csa_ratio}
        if "hca" in model.layer_pattern:
            rings["HCA compressor ring"] = model.hca_ratio
        for name, size in rings.items():
            if size < self.gamma + 1:
                invalid("DrafterConfig", "gamma", self.gamma,
                        f"a verification block of gamma + 1 tokens must fit in the target's "
                        f"{name} ({size} positions)")
