"""LeanSparse in the engine: identity 6, the invariant over keys and codes, writeback."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig
from lsparse_jax.indexing.coarse_to_fine import miss_filter, rerank
from lsparse_jax.memory.invariant import hierarchy_violations
from lsparse_jax.methods import policy
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.quant import dequantize_index_keys
from lsparse_jax.quant.pq import encode
from lsparse_jax.serving.engine import Engine
from pallas_kernels.topk.reference import canonical_scores, topk_positions
from tests.helpers import model_and_tokens, tiny


@functools.cache
def setup():
    cfg = tiny(max_len=512)
    params, _ = model_and_tokens(cfg, 1, seed=11)
    calib = np.random.default_rng(123).integers(0, 256, 600).astype(np.int32)
    return cfg, params, calibrate_codebooks(params, cfg, calib, iters=4)


def make(method, lean=None, slots=3, kv_rows=16, implementation="xla", device_pages=None):
    cfg, params, books = setup()
    cache = CacheConfig(num_slots=slots, prefill_chunk=32, page_size=8,
                        hot_cache_rows=None if method == "resident" else kv_rows,
                        device_pages=device_pages)
    return Engine(EngineConfig(model=cfg, cache=cache, method=method,
                               leansparse=lean or LeanSparseConfig(),
                               implementation=implementation), params, books)


def encoder(engine):
    books = setup()[2]  # the engine's own copies are donated step to step
    return lambda values, scales, layer: encode(
        dequantize_index_keys(jnp.asarray(values), jnp.asarray(scales)), books[layer])


# device_pages: PQ codes in device pools (21 pages hold the three requests' 7 + 9 + 5); the
# slot-held codes' identity case is slow (~15 s; the pooled case holds the same identity and
# lean1 runs the slot-held codes in the fast suite)
@pytest.mark.parametrize("lean,identical,device_pages", [
    pytest.param(LeanSparseConfig(num_candidates=128, miss_filter_offset=None,
                                  key_cache_rows=128), True, None, marks=pytest.mark.slow),
    (LeanSparseConfig(num_candidates=32, miss_filter_offset=1.0, key_cache_rows=48), False,
     None),
    (LeanSparseConfig(num_candidates=128, miss_filter_offset=None, key_cache_rows=128), True,
     21),
])
def test_leansparse_against_resident(lean, identical, device_pages):
    """Identity 6: with C >= every eligible history (128 rows at max_len 512) and no miss
    filter, leansparse emits resident's logits bit for bit. With a small C and the filter it
    is approximate. Either way the hierarchy invariant (KV, FP8 keys, PQ codes) holds after
    every step, with requests joining and leaving; contexts are kept identical by feeding both
    engines resident's tokens."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (77, 141, 50)]
    resident, lean_engine = make("resident"), make("leansparse", lean,
                                                   device_pages=device_pages)
    for engine in (resident, lean_engine):
        engine.admit(prompts[0], max_new_tokens=140)
        engine.admit(prompts[1], max_new_tokens=140)
    check = encoder(lean_engine)
    recalls = []
    for step in range(110):
        if step == 20:
            for engine in (resident, lean_engine):
                engine.admit(prompts[2], max_new_tokens=100)
        if step == 80:
            for engine in (resident, lean_engine):
                engine.release(1)
        inputs = resident.next_token.copy()
        want = resident.step()
        got = lean_engine.step(tokens=inputs)
        act = resident.active
        if identical:
            np.testing.assert_array_equal(np.asarray(got.logits)[act],
                                          np.asarray(want.logits)[act])
        sel, ref = np.asarray(got.selected)[act], np.asarray(want.selected)[act]
        for a, b in zip(sel.reshape(-1, sel.shape[-1]), ref.reshape(-1, ref.shape[-1])):
            recalls.append(len(set(a[a >= 0]) & set(b[b >= 0])) / max((b >= 0).sum(), 1))
        keys = np.asarray(got.key_sources)[act]
        assert (keys.sum(-1) > 0).all()  # every query scored exact keys
        # approximate selection changes what later layers compute: then only the first CSA
        # layer's rows (computed from identical inputs) can be checked against resident
        layers = None if identical else {1}
        assert hierarchy_violations(lean_engine.config, lean_engine.state,
                                    resident.state.caches, act, check, layers) == []
    if identical:
        assert min(recalls) == 1.0
    else:
        assert 0.5 < np.mean(recalls) < 1.0  # approximate, and not useless
    m = lean_engine.metrics()["selection"]
    assert m["host_key_rows"] > 0 and m["key_resolved_fraction"]["key_cache"] > 0


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_miss_filter_keeps_cached_and_applies_threshold(implementation):
    """The rule against numpy's sort (s_(k), ddof-1 sigma); the k-th score found by the
    ``candidate_topk`` op, XLA or the Pallas kernel in interpret mode."""
    rng = np.random.default_rng(0)
    for trial in range(20 if implementation == "xla" else 6):
        c, k = (40, 8) if trial % 3 else (12, 16)  # and fewer valid candidates than k
        scores = rng.normal(size=c).astype(np.float32)
        valid = rng.random(c) < 0.9
        cached = rng.random(c) < 0.3
        keep = np.asarray(miss_filter(jnp.asarray(scores), jnp.asarray(valid),
                                      jnp.asarray(cached & valid), k, 1.0, implementation))
        v = scores[valid]
        threshold = np.sort(v)[::-1][min(k, v.size) - 1] - np.std(v, ddof=1)
        assert keep[valid & cached].all()  # every cached candidate survives
        np.testing.assert_array_equal(keep[valid & ~cached], scores[valid & ~cached] >= threshold)
        assert not keep[~valid].any()
        assert np.array_equal(np.asarray(miss_filter(jnp.asarray(scores), jnp.asarray(valid),
                                                     jnp.asarray(cached), k, None)), valid)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("r, k", [(40, 8), (6, 8), (64, 64)])
def test_rerank_equals_topk_of_candidates_in_position_order(r, k, implementation):
    """rerank equals ``topk_positions`` of the canonical scores (``select_topk``'s rule) over
    the given candidates laid out in position order: candidates in random order with -1
    poison, tied scores, -0.0 beside +0.0, -inf and NaN (given -inf candidates are kept, after
    the finite ones); fewer candidates than k pad with -1 / -inf. "xla" (one sort) gives them
    best first; the kernel ("triton", interpret mode) the same set, values aligned."""
    rng = np.random.default_rng(r * 31 + k)
    for _ in range(10 if implementation == "xla" else 4):
        pos = rng.choice(200, r, replace=False).astype(np.int32)
        scores = rng.choice(np.array([1.5, 0.0, -0.0, -2.0, -np.inf, np.nan], np.float32), r)
        scores = np.where(rng.random(r) < 0.5, rng.normal(size=r), scores).astype(np.float32)
        pos[rng.random(r) < 0.2] = -1
        got_pos, got_val = (np.asarray(x) for x in rerank(jnp.asarray(pos), jnp.asarray(scores),
                                                          k, implementation))
        order = np.argsort(np.where(pos >= 0, pos, 2**31 - 1), kind="stable")
        picked, want_val = topk_positions(canonical_scores(jnp.asarray(scores[order])),
                                          jnp.asarray(pos[order] >= 0), k)
        picked = np.asarray(picked)
        want_pos = np.where(picked >= 0, pos[order][np.maximum(picked, 0)], -1)
        if implementation == "triton":  # the same winners and values, in the order given
            at = np.argsort(np.where(got_pos >= 0, got_pos, 2**31 - 1), kind="stable")
            got_pos, got_val = got_pos[at], got_val[at]
            at = np.argsort(np.where(want_pos >= 0, want_pos, 2**31 - 1), kind="stable")
            want_pos, want_val = want_pos[at], np.asarray(want_val)[at]
        np.testing.assert_array_equal(got_pos, want_pos)
        np.testing.assert_array_equal(got_val, np.asarray(want_val))


def test_page_writeback_keeps_cache_contents_and_encodes_codes():
    engine = make("leansparse", LeanSparseConfig(32, 1.0, 48), slots=1)
    _, prompt = model_and_tokens(engine.config.model, 60, seed=8)
    engine.admit(prompt, max_new_tokens=40)
    for _ in range(10):
        engine.step()
    state = engine.state
    page, m = engine.config.cache.page_size, engine.config.model.csa_ratio
    before = jax.tree.map(np.asarray, state.replace(rng=None))
    # pretend the last step completed logical page 0 of slot 0 (its physical page is
    # table[0, 0]): that step wrote row page - 1, so the slot now holds page * m tokens
    after = policy(engine.config).write_completed(
        state.replace(lengths=jnp.asarray([page * m], jnp.int32)), jnp.asarray([0], jnp.int32))
    phys = int(before.tier.page_table[0, 0])
    for layer, (b, a) in enumerate(zip(before.caches, after.caches)):
        if not hasattr(b, "keys"):
            continue
        for old, new in ((b.kv.hot, a.kv.hot), (b.keys.cache, a.keys.cache)):
            for x, y in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
                assert np.asarray(x).tobytes() == np.asarray(y).tobytes()  # caches survive
        kv_pool, key_pool = after.tier.kv_pools[layer], after.tier.key_pools[layer]
        rows = slice(phys * page, (phys + 1) * page)
        np.testing.assert_array_equal(np.asarray(kv_pool)[rows], b.kv.tail[0])
        tail_v, tail_s = b.keys.tail
        assert np.asarray(key_pool[0])[rows].tobytes() == tail_v[0].tobytes()
        want = encoder(engine)(tail_v[0], tail_s[0], layer)
        np.testing.assert_array_equal(np.asarray(a.keys.codes)[0, :page], np.asarray(want))
        assert np.isnan(np.asarray(a.kv.tail)).all()  # the tail is poisoned for reuse


def test_leansparse_needs_valid_codebooks():
    cfg, params, books = setup()
    config = EngineConfig(model=cfg, method="leansparse",
                          cache=CacheConfig(hot_cache_rows=16, page_size=8),
                          leansparse=LeanSparseConfig(32, 1.0, 48))
    with pytest.raises(ValueError,
                       match="needs PQ codebooks for CSA layers and DSA leaders \\[1, 3\\]"):
        Engine(config, params)
    bad = {k: v[:, :, :2] for k, v in books.items()}
    with pytest.raises(ValueError, match="codebooks\\[1\\] has shape"):
        Engine(config, params, bad)
    with pytest.raises(ValueError, match="key_cache_rows"):
        LeanSparseConfig(num_candidates=64, key_cache_rows=32)
    with pytest.raises(ValueError, match="num_candidates"):
        EngineConfig(model=cfg, method="leansparse", cache=CacheConfig(hot_cache_rows=16),
                     leansparse=LeanSparseConfig(8, 1.0, 48))


def test_coarse_precision_reaches_the_coarse_pass():
    """``LeanSparseConfig.coarse_precision`` picks the coarse pass's dot: "fp8" selects the
    top-C of ``pq_topc``'s fp8 twin (as sets), which on random data is not bf16's set."""
    from lsparse_jax.methods.leansparse import coarse_topc
    from pallas_kernels.pq_topc.reference import pq_topc_xla
    from tests.kernel_helpers import pq_problem

    n, c = 2048, 256
    q, w, codes, books = pq_problem(3, 2, 4, 32, 8, 64, n)
    lengths = jnp.asarray([n, 1500], jnp.int32)
    got = {p: np.asarray(coarse_topc(q, w, codes, books, lengths, c, "xla", p)[0])
           for p in ("bf16", "fp8")}
    want = np.asarray(pq_topc_xla(q, w, codes, books, lengths, num_candidates=c,
                                  precision="fp8")[0])
    for row_got, row_want in zip(got["fp8"], want):
        assert set(row_got) == set(row_want)
    assert any(set(a) != set(b) for a, b in zip(got["fp8"], got["bf16"]))
    with pytest.raises(ValueError, match="coarse_precision"):
        LeanSparseConfig(coarse_precision="fp16")


def test_coarse_implementation_reaches_the_coarse_pass():
    """``LeanSparseConfig.coarse_implementation`` overrides the engine's implementation for the
    coarse pass only: "jax_triton" (GPU only) is refused by pq_topc on CPU at the first step,
    which the engine's own "xla" would not be."""
    lean = LeanSparseConfig(num_candidates=32, key_cache_rows=48,
                            coarse_implementation="jax_triton")
    engine = make("leansparse", lean)
    engine.admit(np.arange(70, dtype=np.int32) % 256, max_new_tokens=4)
    with pytest.raises(ValueError, match="pq_topc: implementation='jax_triton' needs a CUDA"):
        engine.step()
    with pytest.raises(ValueError, match="coarse_implementation"):
        LeanSparseConfig(coarse_implementation="cuda")


def kernel_step_against_xla(lean, kernels, steps: int):
    """Two engines on one prompt, teacher-forced alike: ``lean`` with implementation "xla",
    ``kernels`` (a LeanSparseConfig) with "triton". The kernels' selections equal the XLA
    step's up to boundary ties (>= 95% of positions), and their logits agree within 1e-2
    wherever the selections are equal."""
    engines = {impl: make("leansparse", cfg, slots=1, implementation=impl)
               for impl, cfg in (("xla", lean), ("triton", kernels))}
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 256, 150).astype(np.int32)
    for e in engines.values():
        e.admit(prompt, max_new_tokens=steps + 4)
    same, found, total = [], 0, 0
    for _ in range(steps):
        inputs = engines["xla"].next_token.copy()
        a = engines["xla"].step()
        b = engines["triton"].step(tokens=inputs)
        sa, sb = np.asarray(a.selected[0]), np.asarray(b.selected[0])
        for x, y in zip(sa, sb):
            found += len(set(x[x >= 0]) & set(y[y >= 0]))
            total += int((x >= 0).sum())
        if all(set(x) == set(y) for x, y in zip(sa, sb)):
            same.append(float(np.abs(np.asarray(a.logits[0]) - np.asarray(b.logits[0])).max()))
    assert found / total >= 0.95
    assert same and max(same) < 1e-2


def test_kernel_step_selects_as_the_xla_step():
    """implementation="triton" on the CPU (interpret mode: the pq_topc, index_scores,
    hot_resolve and candidate_topk kernels in the decode step) against the XLA step
    (``kernel_step_against_xla``; the kernels score in bf16); the GPU twin is
    ``test_gpu_hierarchy``'s."""
    lean = LeanSparseConfig(num_candidates=64, miss_filter_offset=1.0, key_cache_rows=96)
    kernel_step_against_xla(lean, lean, steps=8)


# slow tier (session 49): 50 s; the kernels' wiring stays in
# test_kernel_step_selects_as_the_xla_step, pooled codes in the XLA tests
@pytest.mark.slow
def test_pooled_codes_are_read_in_place_bit_for_bit_with_kernels():
    """With kernels (implementation="triton", interpret mode) and PQ codes in device pools the
    coarse pass reads the codes in place through the slot's page table (``pq_topc``'s paged
    form) instead of a gathered copy: logits, tokens, selections and key sources equal the
    slot-held codes' bit for bit, while pages complete and a request joins."""
    from lsparse_jax.methods import leansparse as lean_module

    lean = LeanSparseConfig(num_candidates=32, miss_filter_offset=1.0, key_cache_rows=48)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (120, 90, 60)]
    slot, pooled = (make("leansparse", lean, implementation="triton", device_pages=pages)
                    for pages in (None, 21))
    paged_calls = []
    original = lean_module.pq_topc
    lean_module.pq_topc = lambda *a, **k: paged_calls.append(k.get("page_table") is not None) \
        or original(*a, **k)
    try:
        for e in (slot, pooled):
            e.admit(prompts[0], max_new_tokens=40)
            e.admit(prompts[1], max_new_tokens=40)
        for step in range(10):  # request 0's 30 compressed rows complete a page at step 8
            if step == 3:
                for e in (slot, pooled):
                    e.admit(prompts[2], max_new_tokens=30)
            want, got = slot.step(), pooled.step()
            for field in ("logits", "tokens", "selected", "key_sources"):
                np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                              np.asarray(getattr(want, field)))
    finally:
        lean_module.pq_topc = original
    assert True in paged_calls and False in paged_calls


def test_rescoring_reads_the_key_cache_in_place_as_the_gathered_copy():
    """``cached_scores`` (LeanSparse's exact scores with kernels: the candidate list read in
    place from the key cache rows and the tail) equals ``index_scores`` on the rows a resolve
    would have gathered, bit for bit (interpret mode): dropped candidates (-1) and a tail not
    yet full score -inf."""
    from lsparse_jax.methods.leansparse import cached_scores
    from lsparse_jax.quant import quantize_index_keys
    from pallas_kernels.index_scores import index_scores

    rng = np.random.default_rng(9)
    h, d, rows, c, page = 4, 32, 48, 40, 8
    keys = rng.standard_normal((rows + page, d), np.float32)
    values, scales = (np.asarray(x) for x in quantize_index_keys(jnp.asarray(keys), d))
    row_of = rng.integers(-1, rows, c + page).astype(np.int32)
    row_of[c:] = -1
    ok = (row_of >= 0) | (np.arange(c + page) >= c)
    ok[c + 5:] = False
    q, w = rng.standard_normal((h, d), np.float32), rng.standard_normal(h).astype(np.float32)
    got = cached_scores("triton", jnp.asarray(q), jnp.asarray(w),
                        (jnp.asarray(values[:rows]), jnp.asarray(scales[:rows])),
                        jnp.asarray(row_of), jnp.asarray(ok),
                        (jnp.asarray(values[rows:]), jnp.asarray(scales[rows:])), c)
    pick = np.concatenate([np.maximum(row_of[:c], 0), rows + np.arange(page)])
    want = index_scores(q[None], w[None], values[pick][None], scales[pick][None], ok[None],
                        implementation="triton")[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.isneginf(np.asarray(got)[~ok]).all() and np.isfinite(np.asarray(got)[ok]).all()


@pytest.mark.parametrize("implementation", [  # the fused kernels on packed rows: also
    "xla", pytest.param("triton", marks=pytest.mark.slow)])  # test_kernel_hot_resolve's
def test_packed_host_key_rows_equal_split_bit_for_bit(implementation):
    """``host_key_rows="packed"`` (each host key row's values and scale side by side in one
    row of words) changes where the bytes sit, not what is computed: logits, selections and
    key sources equal the split pools' bit for bit step by step (admission pages out the
    prompt, decode completes a page and writes it back), the packed pools
    read back unpacked hold the split pools' bytes (NaN poison included), and the host bytes
    are the same. "triton" (interpret mode) resolves misses with the fused kernels reading the
    packed rows in place."""
    from lsparse_jax.memory.key_store import host_rows_numpy
    from pallas_kernels.hot_resolve.packed import PackedPool

    lean = dict(num_candidates=32, miss_filter_offset=1.0, key_cache_rows=48)
    engines = [make("leansparse", LeanSparseConfig(**lean, host_key_rows=rows), slots=1,
                    implementation=implementation) for rows in ("split", "packed")]
    split, packed = engines
    layers = [i for i, p in enumerate(packed.state.tier.key_pools) if p is not None]
    assert layers and all(isinstance(packed.state.tier.key_pools[i], PackedPool)
                          for i in layers)
    prompt = np.random.default_rng(9).integers(0, 256, 94).astype(np.int32)
    for e in engines:
        e.admit(prompt, max_new_tokens=40)

    def same_pools():  # -> rows written (scale not NaN) over the layers
        written = 0
        for i in layers:
            a, b = (host_rows_numpy(e.state.tier.key_pools[i]) for e in engines)
            assert [x.tobytes() for x in a] == [y.tobytes() for y in b], f"layer {i}"
            written += int((~np.isnan(b[1])).sum())
        return written

    admitted = same_pools()
    for _ in range(4):
        inputs = split.next_token.copy()
        a, b = split.step(), packed.step(tokens=inputs)
        for x, y in ((a.logits, b.logits), (a.selected, b.selected),
                     (a.key_sources, b.key_sources)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert same_pools() > admitted  # decode wrote completed pages back
    host_bytes = [sum(x.nbytes for x in jax.tree.leaves(e.state.tier.key_pools))
                  for e in engines]
    assert host_bytes[0] == host_bytes[1]
    assert packed.metrics()["selection"]["host_key_rows"] > 0
