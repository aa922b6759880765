"""The ECHO-style baseline (methods.echo): lossless (bit-identical to resident), its shared GPU
KV pool bounds admission (waits, never loses a request), and its accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig
from lsparse_jax.memory import HotCache, empty_pool, write_host_page
from lsparse_jax.memory.accounting import max_concurrency, request_bytes, shared_pool_bytes
from lsparse_jax.memory.paged_kv import PagedKV, PagedKVStore, PageView
from lsparse_jax.methods.echo import SharedPoolCapacityError
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.scheduler import Clock, Scheduler
from tests.helpers import assert_resolved_rows, model_and_tokens, tiny

CFG = tiny(max_len=256)


def engine(method, pool=None, slots=3, page=8, rows=16, prefetch=0):
    params, _ = model_and_tokens(CFG, 1, seed=5)
    rows = None if method == "resident" else rows
    return Engine(EngineConfig(model=CFG, method=method, sampling=SamplingConfig(0.0),
                               cache=CacheConfig(num_slots=slots, prefill_chunk=32,
                                                 hot_cache_rows=rows, page_size=page,
                                                 shared_pool_rows=pool,
                                                 prefetch_rows=prefetch)), params)


@pytest.mark.parametrize("prefetch", [0, 8])
def test_echo_is_lossless_and_bit_identical_to_resident(prefetch):
    """Two requests decode together, a third joins and the first leaves: echo's logits,
    tokens and selections equal resident's at every step (lossless prefetch from host), with
    and without the prefetch of the 8 positions ranked after the top-16 (whose copies the
    statistics count apart)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (70, 101, 45)]
    want = engine("resident")
    got = engine("echo", pool=512, rows=16 + 2 * prefetch, prefetch=prefetch)
    host_rows = prefetched = 0
    for e in (want, got):
        e.admit(prompts[0], max_new_tokens=60)
        e.admit(prompts[1], max_new_tokens=60)
    for step in range(50):
        if step == 15:
            for e in (want, got):
                e.admit(prompts[2], max_new_tokens=40)
        if step == 35:
            for e in (want, got):
                e.release(0)
        a, b = want.step(), got.step()
        act = want.active
        np.testing.assert_array_equal(np.asarray(b.logits)[act], np.asarray(a.logits)[act])
        np.testing.assert_array_equal(np.asarray(b.selected)[act], np.asarray(a.selected)[act])
        host_rows += int(np.asarray(b.sources)[act][..., 2].sum())
        prefetched += int(np.asarray(b.prefetched)[act].sum())
    assert want.generated == got.generated
    assert host_rows > 0  # the buffer missed and fetched from the host: still identical
    sel = got.metrics()["selection"]
    assert sel["host_rows"] == host_rows and sel["prefetched_rows"] == prefetched
    assert (prefetched > 0) == (prefetch > 0)


def test_prefetched_rows_are_hits_at_the_next_step():
    """``PagedKVStore.gather_band`` on a buffer of 8 rows, pages of 4: step 1 selects 3 and 7
    and prefetches 10 and 11 (4 host copies: 2 selected, 2 prefetched); step 2 selects 10, 3
    and 11, all hits, and prefetches 20 (1 copy). The rows read are the selection's only, in
    order, each equal to the host truth; the buffer then holds every row it was given."""
    page, dim, pages = 4, 3, 8
    rng = np.random.default_rng(0)
    truth = rng.normal(size=(pages * page, dim)).astype(np.float32)
    pool = empty_pool(pages, page, dim)
    for p in range(pages):
        pool = write_host_page(pool, p, jnp.asarray(truth[p * page:(p + 1) * page]))
    store = PagedKVStore(page, 8)
    state = PagedKV(jnp.full((page, dim), jnp.nan), HotCache.empty(8, dim))
    view_ctx = PageView(pool, jnp.arange(pages, dtype=jnp.int32))
    completed = pages * page  # every row is on the host
    step = jax.jit(store.gather_band)
    for sel, band, sources, fetched in (([3, 7, -1], [10, 11], [0, 0, 2], 2),
                                        ([10, 3, 11], [20, -1], [0, 3, 0], 1)):
        state, view, got = step(state, completed, jnp.asarray([sel], jnp.int32),
                                jnp.asarray([band], jnp.int32), view_ctx)
        assert np.asarray(view.sources).tolist() == [sources] and int(got) == fetched
        assert np.asarray(view.slots).tolist() == [[j if p >= 0 else -1
                                                    for j, p in enumerate(sel)]]
        assert_resolved_rows(np.asarray(view.table)[0], sel, truth)  # [k, D]: the selection
    held = np.asarray(state.hot.positions)
    assert sorted(held[held >= 0].tolist()) == [3, 7, 10, 11, 20]
    rows = np.asarray(state.hot.rows)
    for j in np.flatnonzero(held >= 0):
        np.testing.assert_array_equal(rows[j], truth[held[j]])


def test_prefetch_settings_are_checked():
    with pytest.raises(ValueError, match="prefetch_rows.*only the echo method"):
        engine("hisparse", prefetch=4)
    with pytest.raises(ValueError, match="hot_cache_rows=16 < top_k \\+ prefetch_rows = 20"):
        engine("echo", pool=512, rows=16, prefetch=4)
    with pytest.raises(ValueError, match="prefetch_rows"):
        CacheConfig(prefetch_rows=-1)


def test_shared_pool_holds_buffers_and_prefill_history():
    """Pool of 64 entries, buffers of 16: a 100-token prompt holds 16 + 25 entries until the
    next step, then only its buffer; a second such admission before that step waits
    (SharedPoolCapacityError, nothing changes), after it fits; a prompt needing more than the
    whole pool is an error naming the setting."""
    e = engine("echo", pool=64)
    rng = np.random.default_rng(2)
    p = rng.integers(0, 256, 100).astype(np.int32)
    e.admit(Request(p, 4))
    assert e.control.in_use == 16 + 25
    free_pages = e.control.pages.free
    with pytest.raises(SharedPoolCapacityError, match="needs 41 entries, 23 of 64"):
        e.admit(Request(p, 4))
    assert e.control.in_use == 41 and e.control.pages.free == free_pages
    assert e.active.sum() == 1
    e.step()
    assert e.control.in_use == 16
    e.admit(Request(p, 4))
    assert e.control.in_use == 16 + 41 and e.control.peak == 57
    e.release(0)
    e.release(1)
    assert e.control.in_use == 0
    with pytest.raises(ValueError, match="shared_pool_rows=64: it can never be admitted"):
        e.admit(Request(rng.integers(0, 256, 200).astype(np.int32), 4))


@pytest.mark.slow
def test_scheduler_waits_on_the_shared_pool_and_tokens_equal_resident():
    """Whole-prompt admissions through the scheduler with a pool of 72 entries: requests of
    60-120 tokens wait (reason "shared_pool") yet every one emits resident's greedy tokens."""
    rng = np.random.default_rng(3)
    requests = [Request(rng.integers(0, 256, int(n)).astype(np.int32), 6, id=i)
                for i, n in enumerate(rng.integers(60, 121, 5))]
    sched = Scheduler(engine("echo", pool=72), clock=Clock(step_s=0.01))
    sched.submit(requests)
    sched.run()
    assert sched.waits_by["shared_pool"] > 0 and len(sched.finished) == 5
    ref = engine("resident", slots=1)
    for r in requests:
        slot = ref.admit(Request(r.prompt, 6))
        for _ in range(5):
            ref.step()
        assert ref.release(slot) == r.tokens, r.id


def test_accounting_echo_is_hisparse_per_request_plus_one_shared_pool():
    """Per request echo holds what hisparse holds with B = its buffer; the shared pool is one
    allocation of E entries (row + metadata) per CSA layer; max concurrency is capped by
    E // B buffers."""
    hi = EngineConfig(model=CFG, method="hisparse", cache=CacheConfig(hot_cache_rows=16))
    echo = EngineConfig(model=CFG, method="echo",
                        cache=CacheConfig(hot_cache_rows=16, shared_pool_rows=64))
    assert request_bytes(echo, 200).gpu == request_bytes(hi, 200).gpu
    csa = CFG.layer_pattern.count("csa")
    assert shared_pool_bytes(echo) == csa * 64 * (4 * CFG.head_dim + 8)
    assert shared_pool_bytes(hi) == 0
    big = 10 ** 9
    assert max_concurrency(echo, 200, big, 0) == 64 // 16
    assert max_concurrency(hi, 200, big, 0) > 4
