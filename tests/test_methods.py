"""Serving methods as policies: a new method is one module, the engine never branches on the
method, and requests carry their own limits and timestamps."""

import dataclasses
from typing import ClassVar

import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig, method_names
from lsparse_jax.methods import Method, policy, register
from lsparse_jax.methods.hisparse import HiSparse
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from tests.test_leansparse import make, setup


def test_direct_pq_policy_equals_the_leansparse_configuration_it_replaces():
    """direct_pq (methods/direct_pq.py) selects exactly what leansparse with C = k and no miss
    filter selected (the accuracy study's former configuration), bit for bit."""
    k = setup()[0].indexer.top_k
    direct = make("direct_pq", LeanSparseConfig(k, None, k))
    lean = make("leansparse", LeanSparseConfig(k, None, k))
    prompt = np.random.default_rng(3).integers(0, 256, 150).astype(np.int32)
    for engine in (direct, lean):
        engine.admit(Request(prompt, max_new_tokens=30))
    for _ in range(25):
        want, got = lean.step(), direct.step()
        np.testing.assert_array_equal(np.asarray(got.selected), np.asarray(want.selected))
        np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))
    assert direct.generated == lean.generated


def test_direct_pq_ignores_candidates_and_filter():
    """Its own C and filter settings do not matter: it always takes the coarse top-k."""
    a = policy(EngineConfig(model=setup()[0], method="direct_pq",
                            cache=CacheConfig(hot_cache_rows=16),
                            leansparse=LeanSparseConfig(64, 1.0, 64))).key_index()
    assert (a.settings.num_candidates, a.settings.miss_filter_offset) == (16, None)


@register
@dataclasses.dataclass(frozen=True)
class SmallHotCache(HiSparse):
    """A user's method in a few lines: hisparse whose hot cache is always exactly top-k."""

    name: ClassVar[str] = "test_small_hot"

    def kv_store(self):
        return dataclasses.replace(super().kv_store(), hot_rows=self.engine.model.indexer.top_k)


def test_a_new_method_is_one_registered_class():
    assert "test_small_hot" in method_names()
    cfg, params, _ = setup()
    cache = CacheConfig(num_slots=2, prefill_chunk=32, page_size=8, hot_cache_rows=64)
    new = Engine(EngineConfig(model=cfg, cache=cache, method="test_small_hot"), params)
    ref = Engine(EngineConfig(model=cfg, cache=dataclasses.replace(cache, hot_cache_rows=None)),
                 params)
    prompt = np.random.default_rng(4).integers(0, 256, 120).astype(np.int32)
    for engine in (new, ref):
        engine.admit(Request(prompt, max_new_tokens=12))
    for _ in range(10):
        np.testing.assert_array_equal(np.asarray(new.step().logits), np.asarray(ref.step().logits))
    hot = [c.kv.hot for c in new.state.caches if hasattr(c, "kv")]
    assert all(h.positions.shape == (2, cfg.indexer.top_k) for h in hot)


def test_unknown_and_misconfigured_methods_name_the_setting():
    with pytest.raises(ValueError, match="method.*allowed methods.*direct_pq"):
        EngineConfig(method="magic")
    with pytest.raises(ValueError, match="hot_cache_rows.*needs a hot cache"):
        EngineConfig(method="direct_pq")
    with pytest.raises(ValueError, match="optional_pages.*adaptive"):
        EngineConfig(method="hisparse", cache=CacheConfig(hot_cache_rows=16, optional_pages=4))
    assert isinstance(policy(EngineConfig()), Method) and policy(EngineConfig()).exact


def test_request_limits_and_timestamps():
    with pytest.raises(ValueError, match="prompt is empty"):
        Request([])
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        Request([1, 2], max_new_tokens=0)
    cfg, params, _ = setup()
    # the config of test_a_new_method_is_one_registered_class's reference engine (its compiled
    # step reused); one request in its first slot
    engine = Engine(EngineConfig(model=cfg, cache=CacheConfig(num_slots=2, prefill_chunk=32,
                                                              page_size=8)), params)
    req = Request(np.arange(40) % 256, max_new_tokens=4, stop_tokens=(7,), id="r1")
    slot = engine.admit(req)
    while not req.done:
        engine.step()
    tokens = engine.release(slot)
    assert tokens is req.tokens and len(req.tokens) <= 4
    assert req.tokens[-1] == 7 or len(req.tokens) == 4
    assert req.admitted_at <= req.first_token_at <= req.finished_at
    assert len(req.token_times) == len(req.tokens)
    assert req.token_times == sorted(req.token_times)
    with pytest.raises(ValueError, match="belongs to the Request"):
        engine.admit(req, max_new_tokens=3)
