"""Speculative decoding (serving/speculative.py, model/drafter.py): greedy speculative output
equals plain greedy output for every method, with a random drafter (rejections) and an oracle
drafter (acceptances); nothing a rejected token wrote survives; rejection sampling keeps the
target distribution; the ring window equals a windowed full-context drafter."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

from lsparse_jax.config import CacheConfig, DrafterConfig, EngineConfig, LeanSparseConfig
from lsparse_jax.memory.accounting import spec_bytes
from lsparse_jax.model.drafter import (
    DrafterWindow,
    context_kv,
    draft_block,
    draft_logits,
    init_drafter,
    ring_rows,
    target_io,
)
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.speculative import (
    SpecEngine,
    accept_greedy,
    accept_sampled,
    commit_ring,
    empty_spec_state,
    selection_overlap,
)
from tests.helpers import model_and_tokens
from tests.test_leansparse import setup as _setup

setup = functools.cache(_setup)

DCFG = DrafterConfig(gamma=4, window=16, target_layers=(1, 3), num_heads=2, head_dim=16,
                     mlp_hidden=64)
PROMPT = np.random.default_rng(3).integers(0, 256, 150).astype(np.int32)


def engine_config(method, implementation="xla"):
    cfg = setup()[0]
    paged = method != "resident"
    cache = CacheConfig(num_slots=2, prefill_chunk=32, page_size=8,
                        hot_cache_rows=80 if paged else None,
                        optional_pages=4 if method == "adaptive" else None)
    # leansparse: C below the eligible length (the PQ path runs), no miss filter: with it the
    # selection depends on the key cache's LRU history, which verification queries change
    return EngineConfig(model=cfg, cache=cache, method=method, implementation=implementation,
                        leansparse=LeanSparseConfig(32, None, 48))


def slot_leaves(state, slot):
    """(path, value) of one slot's caches, skipping caches of copies (hot cache, key cache:
    their LRU order follows the queries) -- every other leaf is what the committed tokens
    wrote."""
    flat = jax.tree_util.tree_flatten_with_path(state.caches)[0]
    out = []
    for path, leaf in flat:
        names = [getattr(k, "name", "") for k in path]
        if "hot" in names or "cache" in names:
            continue
        out.append((jax.tree_util.keystr(path), np.asarray(leaf[slot])))
    return out


def assert_same_rows(a, b, what):
    """Same NaN pattern; floats close (rows computed in a block vs one token at a time round
    differently; FP8 keys may land one e4m3 step apart); integers (positions, PQ codes)
    equal."""
    if np.issubdtype(np.asarray(a).dtype, np.integer):
        np.testing.assert_array_equal(a, b, err_msg=what)
        return
    fp8 = np.asarray(a).dtype.itemsize == 1
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"NaN pattern of {what}")
    np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=0.07 if fp8 else 1e-4,
                               atol=1e-3 if fp8 else 1e-4, err_msg=what)


@pytest.mark.parametrize("method,prompt,new", [
    ("hisparse", 70, 14),  # the fast variant: one page completed during decoding
    pytest.param("resident", 150, 40, marks=pytest.mark.slow),
    pytest.param("hisparse", 150, 40, marks=pytest.mark.slow),
    pytest.param("leansparse", 150, 40, marks=pytest.mark.slow),
    pytest.param("adaptive", 150, 40, marks=pytest.mark.slow)])
def test_greedy_speculative_equals_plain_greedy(method, prompt, new):
    check_greedy_exact(method, prompt, new)


def test_greedy_speculative_equals_plain_greedy_with_a_feature_ring():
    """``DrafterConfig(ring="features")``: the rings keep target features; serving is still
    greedy-exact and the ring's bytes are what the SpecEngine's budget counts."""
    check_greedy_exact("hisparse", 70, 14, dcfg=dataclasses.replace(DCFG, ring="features"))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["resident", "hisparse", "leansparse", "adaptive"])
@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_greedy_speculative_equals_plain_greedy_on_gpu(method, implementation):
    """The same identity on the GPU (hot_resolve reads pinned_host), with XLA ops in both runs
    and with the Triton kernels in both (verification blocks attend through the
    sparse_attention kernel query by query, plain steps one query at a time)."""
    check_greedy_exact(method, 150, 40, implementation)


# slow tier (session 49): 47 s; the identity stays at XLA
# (test_greedy_speculative_equals_plain_greedy)
@pytest.mark.slow
def test_greedy_speculative_equals_plain_greedy_with_kernels():
    """The identity with implementation "triton" (interpret mode): plain steps and
    verification blocks attend through the sparse_attention kernel, select through the
    top-k kernel."""
    check_greedy_exact("hisparse", 70, 14, "triton")


def check_greedy_exact(method, prompt, new, implementation="xla", dcfg=DCFG):
    """Slot 0 drafts with an untrained drafter (nearly every draft rejected), slot 1 with an
    oracle that proposes the plain run's own tokens (all accepted): both emit exactly the
    plain greedy tokens; slot 0's caches and host pages then equal the plain engine's at the
    same length (no row a rejected token wrote survives; only hot/key-cache order differs)."""
    config = engine_config(method, implementation)
    cfg, params, books = setup()
    plain = Engine(config, params, books)
    for _ in range(2):
        plain.admit(PROMPT[:prompt], new)
    for _ in range(new):
        plain.step()
    want = plain.generated[0]
    assert plain.generated[1] == want

    spec = SpecEngine(config, params, (init_drafter(cfg, dcfg, 1), dcfg), books)
    assert spec.request_device_bytes(prompt + new) == plain.request_device_bytes(
        prompt + new) + sum(spec_bytes(config, dcfg).values())
    for _ in range(2):
        spec.admit(PROMPT[:prompt], new)
    oracle_steps, out = 0, {}
    while spec.lengths[0] < spec.limit[0]:
        drafts = np.full((2, dcfg.gamma), -1, np.int32)
        if spec.active[1]:
            n = len(spec.generated[1])
            drafts[1] = (want[n:] + [0] * dcfg.gamma)[:dcfg.gamma]
            oracle_steps += 1
        spec.step(drafts=drafts)
        if spec.active[1] and spec.requests[1].done:
            out[1] = spec.release(1)
    # a request receives max_new_tokens (the engine-level plain run made one more)
    assert spec.generated[0] == want[:new] and out[1] == want[:new]
    assert spec.lengths[0] == plain.lengths[0]
    m = spec.metrics()
    assert m["verifications"] > 0 and 1.0 <= m["acceptance_length"] <= dcfg.gamma + 1
    assert oracle_steps <= -(-new // dcfg.gamma) + 2  # the oracle slot moved in blocks
    for (path, got), (_, ref) in zip(slot_leaves(spec.state, 0), slot_leaves(plain.state, 0)):
        assert_same_rows(got, ref, path)
    if method != "resident":
        assert m["union_miss_rows"] <= m["query_miss_rows"]
        table = np.asarray(spec.state.tier.page_table[0])
        np.testing.assert_array_equal(table, np.asarray(plain.state.tier.page_table[0]))
        p = config.cache.page_size
        rows = (table[table >= 0][:, None] * p + np.arange(p)).reshape(-1)
        pools = [spec.state.tier.kv_pools, plain.state.tier.kv_pools]
        if method == "leansparse":
            pools = [(a, b) for a, b in zip(pools, [spec.state.tier.key_pools,
                                                    plain.state.tier.key_pools])]
        for got, ref in zip(*(jax.tree.leaves(x) for x in pools)):
            assert_same_rows(np.asarray(got)[rows], np.asarray(ref)[rows], "host pages")


def test_commit_ring_keeps_committed_positions_only():
    """A ring after committing c of a block's tokens equals the ring written with those c."""
    r, start, block = 8, 13, 5
    old = np.arange(r, dtype=np.float32) * 10  # slot r holds some old row
    for committed in range(block + 1):
        new = old.copy()
        for q in range(start, start + block):
            new[q % r] = 1000 + q
        want = old.copy()
        for q in range(start, start + committed):
            want[q % r] = 1000 + q
        got = commit_ring(jnp.asarray(old), jnp.asarray(new), start, committed, start + block)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_accept_greedy_takes_the_matching_prefix_and_a_bonus():
    logits = jax.nn.one_hot(jnp.asarray([5, 6, 7, 8, 9]), 12)  # argmax chain 5, 6, 7, 8, 9
    cases = [([5, 6, 7, 8], 5, 4, 9), ([5, 6, 0, 8], 5, 2, 7), ([0, 6, 7, 8], 5, 0, 5),
             ([5, 6, 7, 8], 3, 2, 7)]  # the last: a block cut to 3 verified tokens
    for drafts, valid, a, bonus in cases:
        got = accept_greedy(logits, jnp.asarray(drafts), valid)
        assert (int(got[0]), int(got[1])) == (a, bonus)


def test_rejection_sampling_keeps_the_target_distribution():
    """Two emitted tokens of a Markov target P, drafted by a different Markov drafter Q (gamma
    = 2, vocabulary 3), speculative rounds repeated until two tokens exist: their joint
    frequency matches P(x0, y1) P(y1, y2) (chi-square, 9 cells, 40000 draws)."""
    rng = np.random.default_rng(0)
    p_tab = rng.dirichlet(np.ones(3), 3).astype(np.float32)
    q_tab = rng.dirichlet(np.ones(3), 3).astype(np.float32)
    p_log, q_tab_j = jnp.log(jnp.asarray(p_tab)), jnp.asarray(q_tab)
    x0, gamma = 1, 2

    def round_(key, anchor):
        k1, k2, k3 = jax.random.split(key, 3)
        d1 = jax.random.categorical(k1, jnp.log(q_tab_j[anchor]))
        d2 = jax.random.categorical(k2, jnp.log(q_tab_j[d1]))
        drafts = jnp.stack([d1, d2]).astype(jnp.int32)
        logits = p_log[jnp.stack([anchor, d1, d2])]
        probs = q_tab_j[jnp.stack([anchor, d1])]
        a, bonus = accept_sampled(logits, probs, drafts, gamma + 1, k3, 1.0)
        emitted = jnp.where(jnp.arange(gamma + 1) < a, jnp.concatenate([drafts, drafts[:1]]),
                            0).at[a].set(bonus)
        return emitted, a + 1

    def two(key):
        ka, kb = jax.random.split(key)
        first, n = round_(ka, jnp.int32(x0))
        second, _ = round_(kb, first[0])
        return first[0], jnp.where(n >= 2, first[1], second[0])

    y1, y2 = jax.vmap(two)(jax.random.split(jax.random.key(7), 40000))
    counts = np.zeros((3, 3))
    np.add.at(counts, (np.asarray(y1), np.asarray(y2)), 1)
    expected = (p_tab[x0][:, None] * p_tab) * counts.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < sps.chi2.ppf(0.999, df=8), (counts, expected)


@pytest.mark.parametrize("ring", ["kv", "features"])
def test_ring_window_equals_a_windowed_full_context(ring):
    """The drafter over its ring (W newest committed positions, written block by block) gives
    the logits of the drafter over every position's features masked to the same window, with
    either ring: draft keys and values kept, or target features kept and their keys and values
    recomputed at each draft."""
    cfg, params, _ = setup()
    dcfg = dataclasses.replace(DCFG, ring=ring)
    dp = init_drafter(cfg, dcfg, 2)
    n, w = 37, dcfg.window
    feats = jax.random.normal(jax.random.key(0), (n, len(dcfg.target_layers), cfg.hidden))
    k, v = context_kv(dp, dcfg, feats, jnp.arange(n))
    ring = DrafterWindow.empty(dcfg, cfg.hidden)
    for s in range(0, n, 5):  # blocks of up to 5 committed positions
        pos = s + jnp.arange(5)
        rows = ring_rows(dp, dcfg, feats[jnp.minimum(pos, n - 1)], pos)
        ring = ring.write(rows, pos, pos < n)
    target = target_io(params)
    got = draft_block(dp, dcfg, target, ring, jnp.int32(65), n)
    pos = jnp.arange(n)
    want = draft_logits(dp, dcfg, target, jnp.int32(65), n, k, v, (pos < n) & (pos >= n - w))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ring", ["kv", "features"])
def test_spec_bytes_equal_the_spec_state(ring):
    config = engine_config("hisparse")
    dcfg = dataclasses.replace(DCFG, ring=ring)
    state = empty_spec_state(dcfg, config.model.hidden, 3)
    per_slot = sum(a.nbytes for a in jax.tree.leaves(state)) // 3
    assert spec_bytes(config, dcfg)["drafter_ring"] == per_slot
    per_position = (config.model.hidden if ring == "features"
                    else dcfg.num_layers * dcfg.num_heads * dcfg.head_dim * 2)
    assert per_slot == dcfg.window * (4 * per_position + 4)
    t, k = dcfg.gamma + 1, config.model.indexer.top_k
    row = 4 * config.model.head_dim
    assert spec_bytes(config, dcfg)["staging"] == 2 * t * k * row + 4 * t * row


def test_bad_settings_are_refused():
    cfg, params = setup()[0], model_and_tokens(setup()[0], 1)[0]
    small_hot = EngineConfig(model=cfg, method="hisparse",
                             cache=CacheConfig(hot_cache_rows=cfg.indexer.top_k * 2))
    with pytest.raises(ValueError, match="hot_cache_rows.*union of gamma"):
        SpecEngine(small_hot, params, (init_drafter(cfg, DCFG), DCFG))
    with pytest.raises(ValueError, match="DrafterConfig.window"):
        DrafterConfig(gamma=8, window=8)
    with pytest.raises(ValueError, match="DrafterConfig.ring='bf16' is invalid"):
        DrafterConfig(ring="bf16")
    with pytest.raises(ValueError, match="target_layers"):
        init_drafter(cfg, DrafterConfig(target_layers=(7,)))
    with pytest.raises(ValueError, match="swa window"):
        init_drafter(cfg, DrafterConfig(gamma=8, window=16))
    # a verification's accepted count decides the next block: no launch-ahead
    spec = SpecEngine(engine_config("resident"), params, (init_drafter(cfg, DCFG), DCFG))
    with pytest.raises(ValueError, match="SpecEngine does not launch steps ahead"):
        spec.decode(2)
    from lsparse_jax.serving.scheduler import Scheduler

    with pytest.raises(ValueError, match="overlap launches steps ahead.*SpecEngine does not"):
        Scheduler(spec, overlap=True)


@pytest.mark.slow
def test_greedy_speculative_equals_plain_greedy_with_dsa_layers():
    """GLM-5-style DSA layers (with index sharing) roll back too: same tokens, and the caches'
    NaN pattern (what was written) equals plain decoding's at the same length."""
    from tests.helpers import PATTERNS, tiny

    cfg = tiny(max_len=256, **PATTERNS["dsa_shared"])
    params, prompt = model_and_tokens(cfg, 45, seed=5)
    config = EngineConfig(model=cfg, cache=CacheConfig(num_slots=1, prefill_chunk=16,
                                                       page_size=8))
    plain = Engine(config, params)
    plain.admit(prompt, 30)
    for _ in range(30):
        plain.step()
    spec = SpecEngine(config, params, (init_drafter(cfg, DCFG, 0), DCFG))
    spec.admit(prompt, 30)
    while spec.lengths[0] < spec.limit[0]:
        spec.step()
    assert spec.generated[0] == plain.generated[0][:30]
    for a, b in zip(jax.tree.leaves(plain.state.caches), jax.tree.leaves(spec.state.caches)):
        assert_same_rows(np.asarray(b), np.asarray(a), "DSA caches")


@pytest.mark.slow
def test_scheduler_serves_a_spec_engine_with_the_tokens_of_plain_greedy():
    """The serving scheduler (whole-prompt admission) drives a SpecEngine like an Engine:
    requests arriving over time, with a stop token and a stop string inside later blocks, get
    exactly the tokens plain greedy decoding gives each alone (a block commits past the stop;
    the request ends where plain decoding ends it)."""
    from lsparse_jax.serving.request import Request
    from lsparse_jax.serving.scheduler import Scheduler
    from lsparse_jax.tasks import tokenizer

    config = engine_config("hisparse")
    cfg, params, books = setup()
    rng = np.random.default_rng(5)
    base = [Request(rng.integers(0, 256, int(rng.integers(30, 80))).astype(np.int32),
                    int(rng.integers(8, 20)), arrival_time=0.01 * i, id=i) for i in range(4)]
    plain = Engine(config, params, books)

    def alone(r):
        slot = plain.admit(Request(r.prompt, r.max_new_tokens, r.stop_tokens, r.stop_strings))
        while not plain.requests[slot].done:
            plain.step()
        return plain.release(slot)

    free = [alone(r) for r in base[:2]]
    requests = [Request(base[0].prompt, base[0].max_new_tokens, stop_tokens=(free[0][3],),
                        arrival_time=0.0, id=0),
                Request(base[1].prompt, base[1].max_new_tokens,
                        stop_strings=(tokenizer.decode(free[1][4:6]),), arrival_time=0.01,
                        id=1)] + base[2:]
    want = {r.id: alone(r) for r in requests}
    spec = SpecEngine(config, params, (init_drafter(cfg, DCFG, 1), DCFG), books)
    sched = Scheduler(spec)
    sched.submit(requests)
    sched.run()
    assert {r.id: r.tokens for r in sched.finished} == want


def test_scheduler_budget_counts_the_drafter_ring_and_staging():
    """A SpecEngine's request holds its plain bytes plus ``spec_bytes`` (ring and staging):
    under a budget that three plain requests fit but three speculative ones do not, the
    scheduler runs two at a time (the third waits for the budget, not for a slot) and never
    holds more than the budget."""
    import dataclasses

    from lsparse_jax.memory.accounting import request_bytes
    from lsparse_jax.serving.request import Request
    from lsparse_jax.serving.scheduler import Clock, Scheduler

    config = engine_config("hisparse")
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_slots=3))
    cfg, params, books = setup()
    spec = SpecEngine(config, params, (init_drafter(cfg, DCFG, 1), DCFG), books)
    context = 60 + 6
    plain = request_bytes(config, context).gpu_total
    extra = sum(spec_bytes(config, DCFG).values())
    assert spec.request_device_bytes(context) == plain + extra
    budget = 2 * (plain + extra)
    assert 3 * plain <= budget < 3 * (plain + extra)  # fits three plain requests, two spec
    sched = Scheduler(spec, device_budget_bytes=budget, clock=Clock(step_s=0.01))
    sched.submit([Request(PROMPT[:60], 6, id=i) for i in range(3)])
    sched.run()
    assert len(sched.finished) == 3
    assert sched.waits_by["device_budget"] > 0 and sched.waits_by["slots"] == 0
    assert max(t["device_bytes"] for t in sched.trace) == 2 * (plain + extra) <= budget


def test_chunked_admission_equals_whole_prompt_admission():
    """The last ``SpecPrefill`` of ``SpecEngine.prefill_chunks`` (a scheduler's chunked
    admission) admits a slot whose caches and drafter ring equal bit for bit those of the
    engine's own whole-prompt admission; a prefill without the target features, and a prefix,
    are refused."""
    config = engine_config("hisparse")
    cfg, params, books = setup()
    spec = SpecEngine(config, params, (init_drafter(cfg, DCFG, 1), DCFG), books)
    prompt = PROMPT[:70]  # three chunks of 32; the ring's W = 16 positions from the last
    chunks = list(spec.prefill_chunks(prompt))
    assert [v for _, v in chunks] == [32, 32, 6] and chunks[0][0] is None
    with pytest.raises(ValueError, match="SpecPrefill"):
        spec.admit(prompt, 8, prefilled=(chunks[-1][0].caches, chunks[-1][0].last))
    with pytest.raises(ValueError, match="prefix reuse"):
        spec.admit(prompt, 8, prefix=object())
    whole = spec.admit(prompt, 8)
    chunked = spec.admit(prompt, 8, prefilled=chunks[-1][0])
    assert spec.next_token[whole] == spec.next_token[chunked]
    for tree in (spec.state.caches, spec.spec.windows):
        for leaf in jax.tree.leaves(tree):
            np.testing.assert_array_equal(np.asarray(leaf[whole], np.float32),
                                          np.asarray(leaf[chunked], np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["hisparse", "leansparse"])
def test_scheduler_chunked_prefill_serves_a_spec_engine_with_the_tokens_of_plain_greedy(
        method):
    """Chunked prefill under the scheduler (``prefill_token_budget``, one chunk an iteration
    beside the verification steps) with a SpecEngine: every request gets exactly the tokens
    plain greedy decoding gives it alone."""
    from lsparse_jax.serving.request import Request
    from lsparse_jax.serving.scheduler import Clock, Scheduler

    config = engine_config(method)
    cfg, params, books = setup()
    rng = np.random.default_rng(7)
    requests = [Request(rng.integers(0, 256, n).astype(np.int32), new, arrival_time=t, id=i)
                for i, (n, new, t) in enumerate([(90, 14, 0.0), (45, 20, 0.0),
                                                 (70, 12, 0.02)])]
    plain = Engine(config, params, books)

    def alone(r):
        slot = plain.admit(Request(r.prompt, r.max_new_tokens))
        while not plain.requests[slot].done:
            plain.step()
        return plain.release(slot)

    want = {r.id: alone(r) for r in requests}
    spec = SpecEngine(config, params, (init_drafter(cfg, DCFG, 1), DCFG), books)
    sched = Scheduler(spec, prefill_token_budget=32, clock=Clock(step_s=0.01))
    sched.submit(requests)
    sched.run()
    assert any(t["active"] and t["prefilling"] for t in sched.trace)  # beside verification
    assert {r.id: r.tokens for r in sched.finished} == want


def test_union_gather_fetches_each_missing_row_once():
    """Shared miss retrieval (UnionKV over hisparse's PagedKVStore): T queries with
    overlapping selections read their true rows; the host rows fetched are the distinct missing
    positions (the union), while each query alone would have fetched all of its own; asked
    again, nothing misses."""
    from lsparse_jax.memory import empty_pool
    from lsparse_jax.memory.host_pool import write_host_page
    from lsparse_jax.memory.paged_kv import PagedKVStore, PageView
    from lsparse_jax.quant import KVRowFormat
    from lsparse_jax.serving.speculative import UnionKV

    page, pages, dim, t_len, k = 4, 6, 8, 5, 6
    rng = np.random.default_rng(0)
    truth = rng.normal(size=(page * pages, dim)).astype(np.float32)
    pool = empty_pool(pages, page, dim)
    table = np.array([3, 0, 5, 1, 4, 2], np.int32)  # logical page -> physical page
    for logical, physical in enumerate(table):
        pool = write_host_page(pool, int(physical),
                               jnp.asarray(truth[logical * page:(logical + 1) * page]))
    store = UnionKV(PagedKVStore(page, t_len * k, "xla"))
    state = store.empty(page * pages, KVRowFormat("f32", dim, 0))
    completed = page * (pages - 1) + 2  # the last page is the tail (2 rows written)
    state = state.replace(tail=jnp.asarray(
        np.where(np.arange(page)[:, None] < 2, truth[page * (pages - 1):], np.nan)))
    pool_rows = rng.permutation(page * (pages - 1))[:9]  # 9 paged positions to choose from
    sel = np.stack([np.concatenate([rng.choice(pool_rows, k - 2, replace=False),
                                    [completed - 1], [-1]]) for _ in range(t_len)])
    sel = jnp.asarray(sel.astype(np.int32))
    view = PageView(pool, jnp.asarray(table))
    new, rows = store.gather(state, completed, sel, view)
    got = np.asarray(rows.table[0])[np.maximum(np.asarray(rows.slots), 0)]
    s = np.asarray(sel)
    for t in range(t_len):
        for j in range(k):
            if s[t, j] >= 0:
                np.testing.assert_array_equal(got[t, j], truth[s[t, j]])
    paged = s[(s >= 0) & (s < page * (pages - 1))]
    src = np.asarray(rows.sources)
    assert src[0, 3] == len(set(paged.tolist()))  # the union, fetched once
    np.testing.assert_array_equal(src[:, 2], ((s >= 0) & (s < page * (pages - 1))).sum(-1))
    _, again = store.gather(new, completed, sel, view)
    assert np.asarray(again.sources)[:, 2:].sum() == 0


@pytest.mark.parametrize("valid", [0, 1, 3, 5])
def test_selection_overlap_counts_distinct_positions_per_layer(valid):
    """selection_overlap against Python sets: per layer the distinct positions the first
    ``valid`` queries select (-1 never counts; queries past ``valid`` hold positions that must
    not count), and their selections query by query."""
    rng = np.random.default_rng(valid)
    t_len, layers, k = 5, 3, 7
    sel = rng.integers(0, 12, size=(t_len, layers, k)).astype(np.int32)  # many repeats
    sel[rng.random(sel.shape) < 0.3] = -1
    union, total = selection_overlap(jnp.asarray(sel), jnp.int32(valid))
    live = sel[:valid]
    want_union = sum(len({int(p) for p in live[:, layer].ravel() if p >= 0})
                     for layer in range(layers))
    assert (int(union), int(total)) == (want_union, int((live >= 0).sum()))


@pytest.mark.parametrize("filter_offset", [1.0, None])
def test_block_selection_equals_query_by_query_bit_for_bit(filter_offset):
    """LeanSparse's verification-block selection (``CoarseToFineIndex.select_block``: the
    coarse pass for the block's T = 5 queries at once) equals T ``select`` calls in order
    (``model.store.select_each``) for S = 4 slots: positions, eligible counts, key sources and
    the key cache after the block, bit for bit, with the miss filter on (later queries read the
    key cache the earlier ones filled) and off."""
    from lsparse_jax.memory.key_store import KeyPageView
    from lsparse_jax.methods.leansparse import CoarseToFineIndex
    from lsparse_jax.model.store import IndexerQuery, select_each
    from tests.test_request_groups import BK, C, D, H, K, M, N, P, S, assert_same, random_slots

    state, completed, _, _, tables, pool, books = random_slots(1)
    rng, t_len = np.random.default_rng(11), 5
    query = IndexerQuery(jnp.asarray(rng.normal(size=(S, t_len, H, D)), jnp.float32),
                         jnp.asarray(rng.uniform(0.1, 1.0, (S, t_len, H)), jnp.float32))
    ends = np.asarray(completed)[:, None, None] + 1 + np.arange(t_len)[None, :, None]
    eligible = jnp.asarray(np.arange(N)[None, None, :] < ends)  # causal within the block
    index = CoarseToFineIndex(LeanSparseConfig(C, filter_offset, BK, pq_subspace_dim=D // M),
                              K, P, M, "xla")

    def run(select):
        def one(st, c, q, e, t):
            return select(st, c, q, e, KeyPageView(pool, t, books))

        return jax.tree.map(np.asarray, jax.jit(jax.vmap(one))(
            state, completed, query, eligible, tables))

    want = run(functools.partial(select_each, index.select))
    assert (want[1].key_sources[..., 2] > 0).any()  # keys were fetched from host
    assert_same(want, run(index.select_block))
