"""Memory accounting equals the allocated state byte for byte; Figure 1 of LeanSparse."""

import dataclasses

import jax
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig
from lsparse_jax.memory.accounting import (
    Layout,
    device_page_bytes,
    figure1_ratio,
    max_concurrency,
    param_bytes,
    pool_pages,
    request_bytes,
)
from lsparse_jax.methods.base import pool_bytes
from lsparse_jax.model import init_params
from lsparse_jax.quant import KVRowFormat
from lsparse_jax.serving.state import empty_state, slot_bytes
from tests.helpers import tiny

PATTERNS = [("swa", "csa", "hca", "csa"), ("dsa", "dsa", "dsa", "csa")]


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16", "fp8_v4"])
@pytest.mark.parametrize("pattern,reuse", [(PATTERNS[0], True), (PATTERNS[1], True),
                                           (PATTERNS[1], False)])
@pytest.mark.parametrize("method,rows", [("resident", None), ("hisparse", 24),
                                         ("leansparse", 24), ("adaptive", 24)])
def test_gpu_and_host_bytes_equal_allocated_state(pattern, reuse, method, rows, kv_dtype):
    """Every method, V4 and GLM-5-style (DSA share groups: paged like CSA under the paged
    methods, members with or without location reuse) layouts."""
    cfg = tiny(max_len=256, layer_pattern=pattern, dsa_share_group=2, kv_dtype=kv_dtype)
    engine = EngineConfig(model=cfg, method=method,
                          cache=CacheConfig(num_slots=3, hot_cache_rows=rows, page_size=8,
                                            optional_pages=5 if method == "adaptive" else None,
                                            location_reuse=reuse),
                          leansparse=LeanSparseConfig(32, 1.0, 40))
    csa = [i for i, k in enumerate(pattern) if k == "csa"]
    books = {i: np.zeros((engine.pq_subspaces, 16, 4), np.float32)
             for i in cfg.indexer_layers}
    state = empty_state(engine, books if method == "leansparse" else None)
    acc = request_bytes(engine, cfg.max_len)
    assert acc.gpu_total == slot_bytes(engine, state)
    tier = state.tier  # the host pools of the paged methods' tiers
    pools = jax.tree.leaves((getattr(tier, "kv_pools", ()), getattr(tier, "key_pools", ())))
    assert acc.host_total == sum(p.nbytes for p in pools) // 3
    assert all(p.sharding.memory_kind == "pinned_host" for p in pools)
    if method == "adaptive":  # the shared lent pages: 5 pages of 8 rows per CSA layer (of
        #   8 * 4 f32 rows per DSA layer)
        lent = jax.tree.leaves(tier.optional_pools)
        dsa = pattern.count("dsa") * 5 * 8 * 4 * 4 * cfg.head_dim
        assert sum(p.nbytes for p in lent) == len(csa) * 5 * 8 * Layout.ours(cfg).kv_row + dsa


@pytest.mark.parametrize("kv_dtype", ["f32", "fp8_v4"])
@pytest.mark.parametrize("method,rows", [("resident", None), ("hisparse", 24),
                                         ("leansparse", 24), ("adaptive", 24)])
def test_pooled_bytes_equal_allocated_state(method, rows, kv_dtype):
    """With device pools, a request's GPU bytes are its slot's arrays plus its pages of every
    device pool (ceil(N_c / P) at its context, not max_len; CSA and HCA), byte for byte; the
    pools hold exactly what ``device_page_bytes`` says a page is."""
    cfg = tiny(max_len=256, kv_dtype=kv_dtype)
    engine = EngineConfig(model=cfg, method=method,
                          cache=CacheConfig(num_slots=3, hot_cache_rows=rows, page_size=8,
                                            optional_pages=5 if method == "adaptive" else None,
                                            device_pages=7),
                          leansparse=LeanSparseConfig(32, 1.0, 40))
    books = {i: np.zeros((engine.pq_subspaces, 16, 4), np.float32) for i in (1, 3)}
    state = empty_state(engine, books if method == "leansparse" else None)
    assert pool_bytes(state.tier.pools) == 7 * device_page_bytes(engine)
    for context in (256, 100):  # 64 rows = 8 pages; 25 rows = 4 pages
        acc = request_bytes(engine, context)
        assert acc.device_pages == -(-(context // 4) // 8)
        # per-slot state (tails, page tables, hot caches) does not depend on max_len
        want = slot_bytes(engine, state) + acc.device_pages * device_page_bytes(engine)
        if context == 256:
            assert acc.gpu_total == want
        assert acc.host_total == request_bytes(dataclasses.replace(
            engine, cache=dataclasses.replace(engine.cache, device_pages=None)),
            context).host_total
    # the pooled parts per CSA row: KV row + key (resident), key (hisparse, adaptive), M
    # codes (leansparse); per page also 8 * 4 / 16 = 2 HCA rows, stored as the KV rows are
    row = Layout.ours(cfg)
    per_row = {"resident": row.kv_row + row.index_key, "hisparse": row.index_key,
               "adaptive": row.index_key, "leansparse": engine.pq_subspaces}[method]
    assert row.hca_bytes == KVRowFormat.of(cfg).row_bytes
    assert device_page_bytes(engine) == 2 * 8 * per_row + 2 * row.kv_row
    assert pool_pages(engine, 7 * device_page_bytes(engine) + 1) == 7


def test_hisparse_moves_csa_kv_to_host():
    cfg = tiny(max_len=2048)
    res = request_bytes(EngineConfig(model=cfg), 2048)
    his = request_bytes(EngineConfig(model=cfg, method="hisparse",
                                     cache=CacheConfig(hot_cache_rows=32, page_size=64)), 2048)
    csa_rows = 2 * (2048 // 4)  # two CSA layers
    assert his.host["attention_kv"] == csa_rows * 4 * cfg.head_dim
    saved = res.gpu["attention_kv"] - his.gpu["attention_kv"]
    assert saved == csa_rows * 4 * cfg.head_dim
    assert his.gpu["indexer_keys"] == res.gpu["indexer_keys"]  # HiSparse keeps keys on GPU
    assert his.gpu_total < res.gpu_total


def test_figure1_ratio_within_one_percent():
    # 131072 keys x 132 B over 4096 x 584 B = 7.233
    assert figure1_ratio() == pytest.approx(7.2, rel=0.01)
    assert figure1_ratio() == pytest.approx(131072 * 132 / (4096 * 584), rel=1e-12)


def test_max_concurrency_and_param_bytes():
    cfg = tiny(max_len=256)
    params = init_params(cfg)
    assert param_bytes(cfg) == sum(a.nbytes for a in jax.tree.leaves(params))
    engine = EngineConfig(model=cfg)
    per = request_bytes(engine, 256).gpu_total
    assert max_concurrency(engine, 256, 1000 + 5 * per + per - 1, 1000) == 5
    with pytest.raises(ValueError, match="exceed the HBM budget"):
        max_concurrency(engine, 256, 10, 1000)


def test_v4_layout_counts_serving_bytes():
    from lsparse_jax.model import preset

    engine = EngineConfig(model=preset("v4_flash"), method="hisparse",
                          cache=CacheConfig(hot_cache_rows=4096))
    acc = request_bytes(engine, 512 * 1024, Layout.v4_serving())
    n_csa = engine.model.layer_pattern.count("csa")
    assert acc.gpu["indexer_keys"] == n_csa * 131072 * 132
    assert acc.gpu["hot_cache"] == n_csa * 4096 * 584


def test_leansparse_keeps_least_on_gpu_at_long_context():
    """At V4-Flash shapes and 512K tokens, leansparse's per-request GPU bytes are the
    smallest: 32-byte PQ codes replace 132-byte keys, caches are fixed-size."""
    from lsparse_jax.model import preset

    cfg = preset("v4_flash")
    cache = CacheConfig(hot_cache_rows=4096, page_size=64)
    totals = {m: request_bytes(EngineConfig(model=cfg, method=m, cache=cache), 512 * 1024,
                               Layout.v4_serving()).gpu_total
              for m in ("resident", "hisparse", "leansparse")}
    assert totals["leansparse"] < totals["hisparse"] < totals["resident"]
