"""Device page pools (``CacheConfig.device_pages``): resident with pools equals resident bit
for bit; freed pages are reused without leaking a previous request's rows (NaN-poisoned);
capacity at a fixed byte budget differs per method exactly as the accounting predicts;
admission that does not fit now raises DeviceCapacityError and changes nothing, one that can
never fit is a ValueError. (hisparse, leansparse and adaptive with pools: their identity
tests in test_hierarchy.py, test_leansparse.py, test_adaptive.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig
from lsparse_jax.memory.accounting import (
    budget_capacity,
    budget_pools,
    device_page_bytes,
    pool_pages,
    pooled_capacity,
    request_bytes,
)
from lsparse_jax.memory.device_pool import DeviceCapacityError, PoolView, gather_slot_rows
from lsparse_jax.methods.base import pool_bytes
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.steps import prefill
from tests.helpers import model_and_tokens, tiny

PAGE = 8


def engine(cfg, params, method, device_pages=None, slots=2, books=None, **cache):
    rows = None if method == "resident" else 16
    return Engine(EngineConfig(model=cfg, method=method, cache=CacheConfig(
        num_slots=slots, prefill_chunk=32, hot_cache_rows=rows, page_size=PAGE,
        device_pages=device_pages, **cache)), params, books)


def poison(state, pages):
    """The state with every row of device ``pages`` poisoned in every pool (NaN; codes
    255)."""
    rows = jnp.asarray((np.asarray(pages)[:, None] * PAGE + np.arange(PAGE)).ravel())

    def bad(leaf):
        fill = jnp.nan if jnp.issubdtype(leaf.dtype, jnp.floating) else 255
        return leaf.at[rows].set(jnp.asarray(fill, leaf.dtype))

    pools = state.tier.pools
    pools = pools.replace(kv=jax.tree.map(bad, pools.kv), keys=jax.tree.map(bad, pools.keys),
                          codes=jax.tree.map(bad, pools.codes))
    return state.replace(tier=state.tier.replace(pools=pools))


@pytest.mark.parametrize("method", ["resident", pytest.param("hisparse", marks=pytest.mark.slow)])
def test_pools_equal_resident_and_reused_pages_leak_nothing(method):
    """Two requests (4 + 5 pages) fill a 9-page pool; the first leaves, its pages are
    NaN-poisoned, and a third request (4 pages) gets exactly those pages. Logits, tokens and
    selections equal resident's (no pools) bit for bit at every step: no read reaches a page
    that is not the slot's, and nothing of the first request survives in the third."""
    cfg = tiny(max_len=256)
    params, _ = model_and_tokens(cfg, 1, seed=3)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (70, 100, 80)]
    news = (60, 60, 48)  # 130, 160, 128 tokens: 4, 5, 4 pages of 8 rows
    ref = engine(cfg, params, "resident", slots=3)
    pooled = engine(cfg, params, method, 9, slots=3)  # a slot is free: the pool binds
    for e in (ref, pooled):
        e.admit(prompts[0], max_new_tokens=news[0])
        e.admit(prompts[1], max_new_tokens=news[1])
    assert pooled.control.device.in_use == 9
    with pytest.raises(DeviceCapacityError, match="needs 4 pages, 0 of 9 are free"):
        pooled.admit(prompts[2], max_new_tokens=news[2])
    for step in range(60):
        if step == 25:
            freed = list(pooled.control.device.slot_pages[0])
            for e in (ref, pooled):
                e.release(0)
            pooled.state = poison(pooled.state, freed)
            for e in (ref, pooled):
                e.admit(prompts[2], max_new_tokens=news[2])
            assert sorted(pooled.control.device.slot_pages[0]) == sorted(freed)
        want, got = ref.step(), pooled.step()
        for field in ("logits", "tokens", "selected"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field))[ref.active],
                                          np.asarray(getattr(want, field))[ref.active])
    assert ref.generated == pooled.generated
    for slot in (0, 1):
        pooled.release(slot)
    assert pooled.control.device.in_use == 0
    assert (np.asarray(pooled.state.tier.pools.page_table) == -1).all()


def test_capacity_at_a_fixed_budget_differs_per_method_as_accounted():
    """One byte budget (2 resident pages), requests of 64 tokens (2 pages): a page holds 8
    rows of 2 CSA layers and 2 HCA rows (256 B); resident (164 B per CSA row) fits 1,
    hisparse and adaptive (keys only, 36 B) 3, leansparse (8 B of PQ codes) 7, each exactly
    ``pooled_capacity``; the next admission raises DeviceCapacityError and
    changes nothing (host pages included); a release frees its pages at once."""
    cfg = tiny(max_len=128)
    params, prompt = model_and_tokens(cfg, 60, seed=5)
    prefilled = prefill(params, cfg, prompt, 32)  # shared: capacity is the control plane's
    books = {1: np.zeros((8, 16, 4), np.float32), 3: np.zeros((8, 16, 4), np.float32)}
    slots = 24
    base = EngineConfig(model=cfg, cache=CacheConfig(num_slots=slots, page_size=PAGE))
    budget = 2 * device_page_bytes(base)
    fits = {}
    for method in ("resident", "hisparse", "adaptive", "leansparse"):
        probe = dataclasses.replace(base, method=method, cache=dataclasses.replace(
            base.cache, hot_cache_rows=None if method == "resident" else 16,
            optional_pages=4 if method == "adaptive" else None))
        pages = pool_pages(probe, budget)
        e = engine(cfg, params, method, pages, slots=slots, books=books,
                   optional_pages=4 if method == "adaptive" else None)
        assert request_bytes(e.config, 64).device_pages == 2
        admitted = 0
        while True:
            host = getattr(e.control, "pages", None)
            free = (e.control.device.pages.free, host and host.free)
            try:
                e.admit(prompt, max_new_tokens=4, prefilled=prefilled)
            except DeviceCapacityError:
                assert (e.control.device.pages.free, host and host.free) == free
                break
            admitted += 1
        fits[method] = admitted
        assert admitted == pooled_capacity(e.config, 64), method
        e.release(0)
        e.admit(prompt, max_new_tokens=4, prefilled=prefilled)  # its two pages, at once
    assert fits == {"resident": 1, "hisparse": 3, "adaptive": 3, "leansparse": 7}


def test_a_request_that_can_never_fit_is_an_error():
    cfg = tiny(max_len=256)
    params, prompt = model_and_tokens(cfg, 60, seed=6)
    e = engine(cfg, params, "resident", device_pages=3)
    with pytest.raises(ValueError, match="needs 4 device pages per pool; the pool has 3"):
        e.admit(prompt, max_new_tokens=68)  # 128 tokens = 32 rows = 4 pages
    assert e.control.device.in_use == 0 and not e.active.any()
    # a page must hold whole HCA rows: 8 rows x stride 4 = 32 tokens, HCA stride 128
    with pytest.raises(ValueError, match="must be a multiple of hca_ratio=128"):
        EngineConfig(model=tiny(hca_ratio=128), cache=CacheConfig(page_size=8,
                                                                  device_pages=4))


def test_gather_slot_rows_reads_tail_own_pages_and_poisons_the_rest():
    """Positions before ``paged`` come from the slot's pages, the next P from the tail;
    -1, positions of unreserved pages and rows of other slots' pages are never returned."""
    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.normal(size=(6 * PAGE, 3)).astype(np.float32))
    table = jnp.asarray([4, 1, -1, -1], jnp.int32)  # logical 0 -> page 4, 1 -> page 1
    tail = jnp.asarray(rng.normal(size=(PAGE, 3)).astype(np.float32))
    positions = jnp.asarray([0, 7, 8, 15, 16, 23, -1, 24, 40], jnp.int32)
    got = np.asarray(gather_slot_rows(PoolView(pool, table), positions, tail, 16, PAGE))
    p = np.asarray(pool)
    want = [p[32], p[39], p[8], p[15], np.asarray(tail)[0], np.asarray(tail)[7]]
    np.testing.assert_array_equal(got[:6], np.stack(want))
    assert np.isnan(got[6:]).all()  # -1, and logical pages 3 and 5 (not reserved)


@pytest.mark.parametrize("method", ["resident"] + [
    pytest.param(m, marks=pytest.mark.slow) for m in ("hisparse", "leansparse", "echo")])
def test_budget_capacity_is_what_the_pools_admit(method):
    """One byte budget holds slots' state and device pools; requests of 128 tokens (max_len).
    ``budget_capacity`` says N fit: pools sized from the budget beside N slots
    (``budget_pools``) admit all N and the allocated arrays (N slots' state + pools) fit the
    budget; carved for N + 1 slots, the pools cannot hold N + 1 requests (an admission raises
    DeviceCapacityError, or no request fits at all)."""
    cfg = tiny(max_len=128)
    params, prompt = model_and_tokens(cfg, 124, seed=7)
    prefilled = prefill(params, cfg, prompt, 32)
    books = {1: np.zeros((8, 16, 4), np.float32), 3: np.zeros((8, 16, 4), np.float32)}
    rows = None if method == "resident" else 16
    probe = EngineConfig(model=cfg, method=method, cache=CacheConfig(
        page_size=PAGE, hot_cache_rows=rows, device_pages=1,
        shared_pool_rows=64 if method == "echo" else None),
        leansparse=LeanSparseConfig(num_candidates=32, key_cache_rows=48))
    budget = 3 * request_bytes(EngineConfig(model=cfg, cache=CacheConfig(
        page_size=PAGE, device_pages=1)), 128).gpu_total + 1000  # three resident requests
    n = budget_capacity(probe, 128, budget)
    assert n == 3 if method == "resident" else n >= 1
    for slots in (n, n + 1):
        try:
            pages = budget_pools(probe, 128, budget, slots)
        except ValueError:  # N + 1 slots' state alone leaves no page
            assert slots == n + 1
            continue
        e = Engine(dataclasses.replace(probe, cache=dataclasses.replace(
            probe.cache, num_slots=slots, device_pages=pages,
            shared_pool_rows=16 * slots + 31 if method == "echo" else None)), params, books)
        admitted = 0
        try:
            while admitted < slots:
                e.admit(prompt, max_new_tokens=4, prefilled=prefilled)
                admitted += 1
                e.step()  # echo: the prefill's history leaves the shared pool
        except DeviceCapacityError:
            pass
        except ValueError as err:  # a pool smaller than one request
            assert slots == n + 1 and "can never fit" in str(err)
        if slots == n:
            assert admitted == n, method
            assert n * e.slot_bytes + pool_bytes(e.state.tier.pools) <= budget
        else:
            assert admitted < slots, method


@pytest.mark.parametrize("method", ["hisparse", pytest.param("leansparse", marks=pytest.mark.slow)])
def test_release_moves_no_pool(method):
    """Releasing a request rewrites its page-table rows and nothing else: every other leaf of
    the state, the host pools and device pools included, is the same buffer after the
    release as before (a release that copied the pools cost ~50-130 ms a slot on the H200's
    accuracy study at 200 slots)."""
    cfg = tiny(max_len=128)
    params, tokens = model_and_tokens(cfg, 60, seed=5)
    books = {1: np.zeros((8, 16, 4), np.float32), 3: np.zeros((8, 16, 4), np.float32)}
    e = Engine(EngineConfig(model=cfg, method=method, cache=CacheConfig(
        num_slots=2, prefill_chunk=32, hot_cache_rows=16, page_size=PAGE, device_pages=16,
        host_pages=16), leansparse=LeanSparseConfig(num_candidates=32, key_cache_rows=48)),
        params, books if method == "leansparse" else None)
    slot = e.admit(tokens, 2)
    e.step()
    before = jax.tree_util.tree_leaves_with_path(e.state)
    pages = list(e.control.slot_pages[slot])
    e.release(slot)
    after = dict(jax.tree_util.tree_leaves_with_path(e.state))
    moved = [jax.tree_util.keystr(k) for k, leaf in before
             if after[k].unsafe_buffer_pointer() != leaf.unsafe_buffer_pointer()]
    assert moved and all("page_table" in k for k in moved), moved
    tables = [k for k, _ in before if "page_table" in jax.tree_util.keystr(k)]
    assert tables and all((np.asarray(after[k])[slot] == -1).all() for k in tables)
    assert pages and e.control.pages.free == 16


@pytest.mark.parametrize("method", [pytest.param("resident", marks=pytest.mark.slow),
                                    "hisparse"])
def test_paged_index_kernel_reads_pools_in_place_bit_for_bit(method):
    """With kernels (implementation="triton", interpret mode) a pooled slot's decode indexer
    scores its FP8 keys where they lie (``pooled_decode_scores``: the ``index_scores_paged``
    kernel over its pages and tail) instead of a gathered copy: logits, tokens and selections
    equal resident's without pools (keys contiguous, ``index_scores``) bit for bit while the
    tail fills, completes and moves to a new page, with another request's pages between."""
    from lsparse_jax.memory import device_pool

    cfg = tiny(max_len=256)
    params, _ = model_and_tokens(cfg, 1, seed=5)
    rng = np.random.default_rng(5)
    # 37 and 27 compressed rows (csa_ratio 4, top-k 16) at admission: both tails complete a
    # page within the 20 steps (at 160 and 128 tokens)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (150, 110)]
    ref = Engine(EngineConfig(model=cfg, method="resident", implementation="triton",
                              cache=CacheConfig(num_slots=2, prefill_chunk=32, page_size=PAGE)),
                 params)
    pooled = engine(cfg, params, method, 12, slots=2)
    pooled = Engine(dataclasses.replace(pooled.config, implementation="triton"), params)
    calls = []
    original = device_pool.pooled_decode_scores
    device_pool.pooled_decode_scores = lambda *a: calls.append(a[0]) or original(*a)
    try:
        for e in (ref, pooled):
            for p in prompts:
                e.admit(p, max_new_tokens=40)
        for _ in range(20):
            want, got = ref.step(), pooled.step()
            for field in ("logits", "tokens", "selected"):
                np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                              np.asarray(getattr(want, field)))
    finally:
        device_pool.pooled_decode_scores = original
    assert calls and set(calls) == {"triton"}


# slow tier (session 49): 56 s; pooled rows read in place by a kernel stay in
# test_paged_index_kernel_reads_pools_in_place_bit_for_bit
@pytest.mark.slow
def test_hca_rows_are_attended_in_place_with_bf16_attention():
    """With kernels and attention_precision "bf16" (FP8 rows read as stored) an HCA layer's
    decode attends in sparse_attention to its rows where they lie: the device pool itself,
    shared by all slots, through the slot's page table, the tail with the window rows
    (``PooledRowStore.kernel_view``); no step gathers a slot's HCA rows. Logits equal the
    slot-held layout's bit for bit (it hands the kernel the same rows in the same order) while
    HCA pages complete, and stay within the bf16 tolerance of the XLA step."""
    from lsparse_jax.memory import device_pool

    cfg = tiny(max_len=256, kv_dtype="fp8_v4", attention_precision="bf16")
    params, _ = model_and_tokens(cfg, 1, seed=6)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (150, 110)]  # 9, 6 HCA rows

    def make(impl, pages):
        e = engine(cfg, params, "resident", pages, slots=2)
        return Engine(dataclasses.replace(e.config, implementation=impl), params)

    ref, pooled, xla = make("triton", None), make("triton", 12), make("xla", None)
    gathers, rows = [], device_pool.PooledRowStore.rows
    device_pool.PooledRowStore.rows = lambda *a: gathers.append(1) or rows(*a)
    try:
        for e in (ref, pooled, xla):
            for p in prompts:
                e.admit(p, max_new_tokens=40)
        agree = 0
        for _ in range(12):  # slot 0 completes its HCA page of P_h = 2 rows at token 160
            fed = ref.next_token.copy()
            want, got, plain = ref.step(), pooled.step(), xla.step(fed)
            np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))
            # vs XLA where the selections agree (a bf16 rounding can flip an indexer tie)
            same = np.array_equal(np.asarray(want.selected), np.asarray(plain.selected))
            agree += same
            if same:
                np.testing.assert_allclose(np.asarray(want.logits), np.asarray(plain.logits),
                                           atol=0.01, rtol=0.01)
    finally:
        device_pool.PooledRowStore.rows = rows
    assert not gathers and agree >= 6
