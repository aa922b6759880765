"""Admission straight from the layer-streamed prefill, and host-resident prefix reuse.

- Streamed admission (each layer admitted into its slot as the stream finishes it) leaves the
  DecodeState equal bit for bit to today's admission (whole prefill, then ``state.admit``),
  and the decode steps after it emit the same tokens and logits; its device footprint beyond
  the decode state is the two layer buffers (accounting and a live-array measurement).
- ``Engine.detach`` / ``admit(prefix=)`` / ``drop``: a request extending a detached prefix
  emits the greedy tokens of admitting its whole prompt from scratch. Bit for bit when the
  prefix is a chunk-aligned prompt (the same chunks run on the same state); within float
  rounding (greedy tokens equal) when the prefix holds decode-generated tokens, whose rows a
  decode step wrote (one-token matmuls) where the fresh prefill computes them in a chunk.
"""

import functools

import jax
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig
from lsparse_jax.memory.accounting import (
    admission_device_bytes,
    layer_state_bytes,
    prefix_host_bytes,
    request_bytes,
    stream_state_bytes,
)
from lsparse_jax.memory.host_pool import HostCapacityError
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.steps import prefill
from tests.helpers import assert_same_continuation, model_and_tokens, slot0_steps, tiny

CHUNK, PAGE = 16, 4
slow = pytest.mark.slow
METHODS = ["hisparse", pytest.param("resident", marks=slow),
           pytest.param("leansparse", marks=slow), pytest.param("adaptive", marks=slow),
           pytest.param("leansparse_packed", marks=slow)]  # host_key_rows="packed"


@functools.cache
def setup():
    cfg = tiny(max_len=256)
    params, tokens = model_and_tokens(cfg, 200, seed=3)
    return cfg, params, tokens


@functools.cache
def codebooks():
    cfg, params, _ = setup()
    calib = np.random.default_rng(1).integers(0, cfg.vocab_size, 300).astype(np.int32)
    return calibrate_codebooks(params, cfg, calib, iters=2)


def make(method, streamed=True, slots=2, host_pages=None, device_pages=None):
    cfg, params, _ = setup()
    rows = "packed" if method == "leansparse_packed" else "split"
    method = method.removesuffix("_packed")
    cache = CacheConfig(num_slots=slots, prefill_chunk=CHUNK, page_size=PAGE,
                        hot_cache_rows=None if method == "resident" else 16,
                        streamed_prefill=streamed, host_pages=host_pages,
                        optional_pages=6 if method == "adaptive" else None,
                        device_pages=device_pages)
    engine = EngineConfig(model=cfg, cache=cache, method=method,
                          leansparse=LeanSparseConfig(num_candidates=32, key_cache_rows=32,
                                                      host_key_rows=rows))
    return Engine(engine, params, codebooks() if method == "leansparse" else None)


def as_bits(x):
    x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return np.asarray(x, np.float32)  # e4m3/e8m0/bf16 widen exactly; NaN compares equal


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(as_bits(x), as_bits(y))


@pytest.mark.parametrize("method", METHODS)
def test_streamed_admission_equals_todays_admission(method):
    cfg, params, tokens = setup()
    n = 70  # five chunks, the last partial; 17 CSA rows: four complete pages and a tail
    today, streamed = make(method, streamed=False), make(method)
    today.admit(tokens[:n], max_new_tokens=20, prefilled=prefill(params, cfg, tokens[:n],
                                                                 CHUNK))
    streamed.admit(tokens[:n], max_new_tokens=20)
    assert_trees_equal(today.state, streamed.state)  # caches, tier (host pages too), lengths
    (want, want_logits), (got, got_logits) = slot0_steps(today, 5), slot0_steps(streamed, 5)
    assert got == want and len(set(got)) > 1
    for a, b in zip(want_logits, got_logits):
        np.testing.assert_array_equal(a, b)


def test_streamed_admission_holds_decode_state_plus_two_layer_buffers():
    """Accounting: the streamed admission's peak is the decode footprint plus the two layer
    buffers (today's materializes every layer). Measured: the device arrays alive during the
    stream, beyond those before admission (params, the decode state), never exceed the two
    layer buffers plus a chunk's activations, less than one full resident state."""
    cfg, params, tokens = setup()
    engine = make("hisparse")
    acc = admission_device_bytes(engine.config)
    assert acc["decode"] == engine.slot_bytes == request_bytes(engine.config,
                                                               cfg.max_len).gpu_total
    assert acc["layer_buffers"] == stream_state_bytes(cfg) == max(
        a + b for a, b in zip(layer_state_bytes(cfg), layer_state_bytes(cfg)[1:]))
    assert acc["streamed_peak"] == acc["decode"] + acc["layer_buffers"]
    assert acc["monolithic_peak"] == acc["decode"] + sum(layer_state_bytes(cfg))
    n = 70
    engine.admit(tokens[:n], max_new_tokens=8)  # compile outside the measurement
    engine.release(0)

    def device_bytes():
        return sum(a.nbytes for a in jax.live_arrays()
                   if not a.is_deleted() and a.sharding.memory_kind == "device")

    before, extra = device_bytes(), []
    engine.admit(tokens[:n], max_new_tokens=8,
                 on_layer=lambda event: extra.append(device_bytes() - before))
    assert len(extra) == -(-n // CHUNK) * cfg.num_layers
    # a chunk's activations (x, a Selection, the prompt plain and padded) and the grant's
    # page rows
    activations = 4 * (CHUNK * cfg.hidden + CHUNK * (cfg.indexer.top_k + 7) + 2 * n + CHUNK
                       + 3 * engine.config.pages_per_slot)
    assert max(extra) <= acc["layer_buffers"] + activations
    assert max(extra) < acc["resident_state"]


@pytest.mark.parametrize("method", METHODS)
def test_prefix_reuse_equals_full_prefill(method):
    cfg, params, tokens = setup()
    engine, fresh = make(method), make(method)
    # 1. a chunk-aligned prompt detached at admission: the suffix runs the chunks a fresh
    #    prefill runs, on the same state: bit for bit
    engine.admit(tokens[:64], max_new_tokens=20)
    prefix = engine.detach(0)
    assert prefix.length == 64 and np.array_equal(prefix.tokens, tokens[:64])
    assert prefix.host_bytes == prefix_host_bytes(engine.config, 64)
    prompt = tokens[:100]
    engine.admit(prompt, max_new_tokens=8, prefix=prefix)
    assert prefix.state == "consumed"
    fresh.admit(prompt, max_new_tokens=8)
    assert_same_continuation(fresh, engine, 6)
    # 2. a multi-turn call: prompt + response (its KV written by decode steps) + a new turn
    engine.release(0)
    fresh.release(0)
    engine.admit(tokens[:50], max_new_tokens=20)
    slot0_steps(engine, 5)
    generated = list(engine.requests[0].tokens)  # 6: the last one's KV is not written yet
    prefix = engine.detach(0)
    assert np.array_equal(prefix.tokens, np.concatenate([tokens[:50], generated[:5]]))
    assert prefix.host_bytes == prefix_host_bytes(engine.config, 55)
    prompt = np.concatenate([prefix.tokens, tokens[150:180]])
    engine.admit(prompt, max_new_tokens=8, prefix=prefix)
    fresh.admit(prompt, max_new_tokens=8)
    (want, want_logits), (got, got_logits) = slot0_steps(fresh, 6), slot0_steps(engine, 6)
    assert got == want
    for a, b in zip(want_logits, got_logits):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@slow
@pytest.mark.parametrize("method", ["resident", "hisparse", "leansparse"])
def test_prefix_reuse_with_device_pools_is_bit_identical(method):
    """With device pools the prefix's device pages are exported to the resident layout."""
    _, _, tokens = setup()
    engine, fresh = make(method, device_pages=40), make(method, device_pages=40)
    engine.admit(tokens[:64], max_new_tokens=20)
    prefix = engine.detach(0)
    assert prefix.host_bytes == prefix_host_bytes(engine.config, 64)
    engine.admit(tokens[:100], max_new_tokens=8, prefix=prefix)
    fresh.admit(tokens[:100], max_new_tokens=8)
    (want, want_logits), (got, got_logits) = slot0_steps(fresh, 5), slot0_steps(engine, 5)
    assert got == want
    for a, b in zip(want_logits, got_logits):
        np.testing.assert_array_equal(a, b)


def test_prefix_errors_capacity_and_drop():
    _, _, tokens = setup()
    # 64 + 20 tokens: 21 CSA rows, 6 pages a request; 10 host pages in all
    engine = make("hisparse", host_pages=10)
    engine.admit(tokens[:64], max_new_tokens=20)
    prefix = engine.detach(0)  # keeps 16 rows: 4 pages
    pages = engine.control.pages
    assert len(prefix.pages) == 4 and pages.free == 6
    with pytest.raises(ValueError, match=r"prompt \(70 tokens\) does not start with the "
                                         r"prefix's tokens \(64 tokens\)"):
        engine.admit(tokens[1:71], max_new_tokens=4, prefix=prefix)
    with pytest.raises(ValueError, match=r"prompt \(64 tokens\) must be longer than"):
        engine.admit(tokens[:64], max_new_tokens=4, prefix=prefix)
    with pytest.raises(ValueError, match="belongs to another engine"):
        make("hisparse", host_pages=10).admit(tokens[:70], max_new_tokens=4, prefix=prefix)
    engine.admit(tokens[100:164], max_new_tokens=20)  # holds the other 6 pages
    table = np.asarray(engine.state.tier.page_table)
    with pytest.raises(HostCapacityError):  # 100 + 20 tokens: 30 rows, 8 pages, 4 held
        engine.admit(tokens[:100], max_new_tokens=20, prefix=prefix)
    assert prefix.state == "held" and pages.free == 0 and engine.active.sum() == 1
    np.testing.assert_array_equal(engine.state.tier.page_table, table)
    engine.release(0)
    slot = engine.admit(tokens[:100], max_new_tokens=20, prefix=prefix)  # fits now
    assert prefix.state == "consumed" and pages.free == 2
    np.testing.assert_array_equal(engine.state.tier.page_table[slot, :4], prefix.pages)
    with pytest.raises(ValueError, match="already consumed"):
        engine.drop(prefix)
    second = engine.detach(slot)
    assert pages.free == 10 - len(second.pages)
    engine.drop(second)
    assert pages.free == 10 and second.state == "dropped"
    with pytest.raises(ValueError, match="already dropped"):
        engine.admit(tokens[:120], max_new_tokens=4, prefix=second)
