"""GLM-5-style DSA layers paged like CSA (issue 15 item 5): bit-identical to resident for the
paged methods, location reuse (members follow their leader's location vector) changes nothing,
each member fetches the leader's missing rows once, speculative decoding stays greedy-exact."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig
from lsparse_jax.memory import HotCache, empty_pool
from lsparse_jax.memory.host_pool import write_host_page
from lsparse_jax.memory.hot_cache import follow, resolve_plan
from lsparse_jax.memory.invariant import hierarchy_violations
from lsparse_jax.memory.paged_kv import FollowerKV
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.serving.engine import Engine
from tests.helpers import assert_same_continuation, model_and_tokens, slot0_steps, tiny

# five DSA layers in share groups of 3: leaders 0 and 3, members 1, 2 and 4
GLM = dict(layer_pattern=("dsa",) * 5, dsa_share_group=3)
MEMBERS = {1: 0, 2: 0, 4: 3}


@functools.cache
def setup():
    cfg = tiny(max_len=256, **GLM)
    params, _ = model_and_tokens(cfg, 1, seed=3)
    return cfg, params


@functools.cache
def codebooks():
    """PQ codebooks of the DSA leaders (0 and 3) for leansparse."""
    cfg, params = setup()
    calib = np.random.default_rng(9).integers(0, 256, 300).astype(np.int32)
    return calibrate_codebooks(params, cfg, calib, iters=2)


def make(method, reuse=True, hot_rows=16, slots=2):
    """P = 8 (DSA pages of 32 per-token rows); leansparse with C and a key cache above every
    eligible history (128 of max_len 256's tokens are never reached) and no miss filter:
    exact (identity 6)."""
    cfg, params = setup()
    books = codebooks() if method == "leansparse" else None
    cache = CacheConfig(num_slots=slots, prefill_chunk=32, page_size=8,
                        hot_cache_rows=None if method == "resident" else hot_rows,
                        optional_pages=3 if method == "adaptive" else None,
                        shared_pool_rows=4096 if method == "echo" else None,
                        location_reuse=reuse)
    return Engine(EngineConfig(model=cfg, cache=cache, method=method,
                               leansparse=LeanSparseConfig(128, None, 128)), params, books)


PROMPTS = [np.random.default_rng(0).integers(0, 256, n).astype(np.int32) for n in (75, 45, 52)]


def check_against_resident(method, steps, reuse_off=False):
    """Two requests, a third joins and the first leaves; every step's logits, tokens and
    selections equal resident's and the invariant holds (every row of every paged DSA layer on
    the GPU or in a host page). reuse_off: also an engine whose members resolve themselves,
    equal bit for bit, and each member of the reuse engine copies exactly its leader's host
    rows (the missing positions decided once, each fetched once per member layer)."""
    engines = [make("resident"), make(method)] + ([make(method, reuse=False)] if reuse_off
                                                  else [])
    resident, paged = engines[:2]
    for engine in engines:
        engine.admit(PROMPTS[0], 60)
        engine.admit(PROMPTS[1], 60)
    fetched = 0
    for step in range(steps):
        if step == 8:
            for engine in engines:
                engine.release(0)
                engine.admit(PROMPTS[2], 40)
        before = [np.asarray(paged.state.caches[i].kv.hot) for i in MEMBERS]
        want, *got = [engine.step() for engine in engines]
        act = resident.active
        for out in got:
            for field in ("logits", "tokens", "selected"):
                np.testing.assert_array_equal(np.asarray(getattr(out, field))[act],
                                              np.asarray(getattr(want, field))[act])
        assert hierarchy_violations(paged.config, paged.state, resident.state.caches, act) == []
        host = np.asarray(got[0].sources)[..., 2]  # [S, leaders] rows the leaders fetched
        fetched += int(host[act].sum())
        for (i, lead), old in zip(MEMBERS.items(), before):
            new = np.asarray(paged.state.caches[i].kv.hot)
            changed = (new.view(np.uint32) != old.view(np.uint32)).any(-1).sum(-1)  # [S]
            np.testing.assert_array_equal(changed[act], host[act, lead // 3])
        if reuse_off:
            other = engines[2].state.caches
            for i in MEMBERS:  # the same hot rows, and the same positions as the leader's
                np.testing.assert_array_equal(np.asarray(paged.state.caches[i].kv.hot),
                                              np.asarray(other[i].kv.hot.rows))
                np.testing.assert_array_equal(np.asarray(other[i].kv.hot.positions),
                                              np.asarray(other[MEMBERS[i]].kv.hot.positions))
    assert resident.generated == paged.generated
    assert paged.metrics()["selection"]["host_rows"] == fetched > 0
    assert isinstance(paged.state.caches[1].kv, FollowerKV)  # no LRU state: it cannot resolve


def test_hisparse_dsa_paged_equals_resident():
    check_against_resident("hisparse", 22)


@pytest.mark.slow
def test_location_reuse_on_and_off_equal_bit_for_bit():
    """Members following the leader's location vector vs members resolving through their own
    hot caches: the same logits, tokens, selections and hot rows (``test_follow_equals_an_own
    _resolve`` is the same identity at the resolver's level, in the default suite)."""
    check_against_resident("hisparse", 22, reuse_off=True)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["adaptive", "leansparse"])
def test_dsa_paged_equals_resident(method):
    check_against_resident(method, 26)


def test_follow_equals_an_own_resolve():
    """``follow`` on a plan equals the second layer's own ``resolve_plan`` (its hot cache with
    the same history): same rows out, same hot rows, and it copies only the plan's rows."""
    page, b, k, dim = 4, 6, 4, 3
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.permutation(5).astype(np.int32))  # logical -> physical page

    def pool_of(seed):
        truth = np.random.default_rng(seed).normal(size=(5 * page, dim)).astype(np.float32)
        pool = empty_pool(5, page, dim)
        for lp in range(5):
            pool = write_host_page(pool, table[lp], jnp.asarray(truth[lp * page:(lp + 1) * page]))
        return pool, truth

    (pa, _), (pb, truth_b) = pool_of(2), pool_of(3)
    tail_a, tail_b = (jnp.full((page, dim), float(x)) for x in (7, 8))
    hot_a, hot_b = HotCache.empty(b, dim), HotCache.empty(b, dim)
    rows_b = hot_b.rows
    resolve_, follow_ = jax.jit(resolve_plan), jax.jit(follow)
    for _ in range(6):
        sel = jnp.asarray(np.append(rng.choice(22, k - 1, replace=False), -1).astype(np.int32))
        out_a, hot_a, counts_a, plan = resolve_(hot_a, sel, tail_a, 20, table, pa)
        want, hot_b, counts_b, _ = resolve_(hot_b, sel, tail_b, 20, table, pb)
        got, rows_b, counts = follow_(plan, rows_b, tail_b, pb)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(rows_b), np.asarray(hot_b.rows))
        np.testing.assert_array_equal(np.asarray(counts), np.asarray(counts_b))
        np.testing.assert_array_equal(np.asarray(counts), np.asarray(counts_a))
        for j, p in enumerate(np.asarray(sel)):  # row j is layer b's own row of position p
            if 0 <= p < 20:
                np.testing.assert_array_equal(np.asarray(got)[j], truth_b[p])


@pytest.mark.slow
def test_speculative_greedy_exact_with_paged_dsa():
    """Speculative decoding on the GLM-style model with DSA layers paged (hisparse): slot 0
    with an untrained drafter (rejections), slot 1 with an oracle (acceptances); both emit the
    plain greedy tokens, and slot 0's caches (hot rows aside) and host pages equal plain
    decoding's: no row a rejected token wrote survives in a leader's or a member's pages. The
    union of a block's selections is resolved once per group (its host rows counted by the
    leaders; the members follow it)."""
    from lsparse_jax.config import DrafterConfig
    from lsparse_jax.model.drafter import init_drafter
    from lsparse_jax.serving.speculative import SpecEngine
    from tests.test_speculative import assert_same_rows, slot_leaves

    cfg, params = setup()
    dcfg = DrafterConfig(gamma=3, window=16, target_layers=(0, 3), num_heads=2, head_dim=16,
                         mlp_hidden=64)
    config = make("hisparse", hot_rows=64).config  # >= (gamma + 1) * k: a block's union
    new, prompt = 30, PROMPTS[0]
    plain = Engine(config, params)
    for _ in range(2):
        plain.admit(prompt, new)
    for _ in range(new):
        plain.step()
    want = plain.generated[0]
    spec = SpecEngine(config, params, (init_drafter(cfg, dcfg, 1), dcfg))
    for _ in range(2):
        spec.admit(prompt, new)
    out = {}
    while spec.lengths[0] < spec.limit[0]:
        drafts = np.full((2, dcfg.gamma), -1, np.int32)
        if spec.active[1]:
            n = len(spec.generated[1])
            drafts[1] = (want[n:] + [0] * dcfg.gamma)[:dcfg.gamma]
        spec.step(drafts=drafts)
        if spec.active[1] and spec.requests[1].done:
            out[1] = spec.release(1)
    assert spec.generated[0] == want[:new] and out[1] == want[:new]
    for (path, got), (_, ref) in zip(slot_leaves(spec.state, 0), slot_leaves(plain.state, 0)):
        assert_same_rows(got, ref, path)
    table = np.asarray(spec.state.tier.page_table[0])
    np.testing.assert_array_equal(table, np.asarray(plain.state.tier.page_table[0]))
    rows = (table[table >= 0][:, None] * 32 + np.arange(32)).reshape(-1)  # DSA pages
    for got, ref in zip(spec.state.tier.kv_pools, plain.state.tier.kv_pools):
        assert_same_rows(np.asarray(got)[rows], np.asarray(ref)[rows], "host pages")
    m = spec.metrics()
    assert m["acceptance_length"] > 1 and 0 < m["union_miss_rows"] <= m["query_miss_rows"]


def test_dsa_members_keep_their_own_rows_not_the_leaders():
    """GLM-5 shares indices, not payloads: after admission a member's host pages hold its own
    rows (different from its leader's) and a decode step reads them."""
    paged = make("hisparse")
    paged.admit(PROMPTS[0], 4)
    pools = paged.state.tier.kv_pools
    lead, member = np.asarray(pools[0]), np.asarray(pools[1])
    table = np.asarray(paged.state.tier.page_table)[0]
    rows = slice(table[0] * 32, table[0] * 32 + 32)
    assert np.isfinite(member[rows]).all() and not np.array_equal(lead[rows], member[rows])
    assert jax.tree.leaves(paged.state.caches[1].keys) == []  # members keep no keys


@pytest.mark.parametrize("method", ["hisparse", pytest.param("adaptive", marks=pytest.mark.slow),
                                    pytest.param("leansparse", marks=pytest.mark.slow),
                                    pytest.param("echo", marks=pytest.mark.slow)])
def test_prefix_reuse_with_paged_dsa_equals_full_prefill(method):
    """Multi-turn reuse with host-paged DSA layers: a detached prefix keeps its complete DSA
    pages (P * m = 32 per-token rows a page id, leansparse's leader keys too) and saves the
    tails; a call extending it emits what a fresh whole-prompt admission of its full prompt
    emits: the same logits bit for bit when the prefix is a chunk-aligned prompt (64 tokens:
    two complete pages, an empty tail), the same greedy tokens when it holds decode-written
    rows (55 tokens: one page and a 23-row tail). The prefix holds the host bytes the
    accounting says."""
    check_prefix_reuse(make(method), make(method))


def check_prefix_reuse(engine, fresh):
    """The identities of ``test_prefix_reuse_with_paged_dsa_equals_full_prefill`` on two
    engines of one config (P = 8, chunks of 32)."""
    from lsparse_jax.memory.accounting import prefix_host_bytes

    tokens = np.random.default_rng(4).integers(0, 256, 200).astype(np.int32)

    engine.admit(tokens[:64], 20)
    prefix = engine.detach(0)
    assert len(prefix.pages) == 2
    assert prefix.host_bytes == prefix_host_bytes(engine.config, 64)
    engine.admit(tokens[:100], 8, prefix=prefix)
    fresh.admit(tokens[:100], 8)
    assert_same_continuation(fresh, engine, 6)
    engine.release(0)
    fresh.release(0)
    engine.admit(tokens[:50], 20)
    slot0_steps(engine, 5)
    prefix = engine.detach(0)
    assert prefix.length == 55 and len(prefix.pages) == 1
    assert prefix.host_bytes == prefix_host_bytes(engine.config, 55)
    prompt = np.concatenate([prefix.tokens, tokens[150:180]])
    engine.admit(prompt, 8, prefix=prefix)
    fresh.admit(prompt, 8)
    (want, want_logits), (got, got_logits) = slot0_steps(fresh, 6), slot0_steps(engine, 6)
    assert got == want
    for a, b in zip(want_logits, got_logits):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


# ------------------------------------------------------------ V4-style KV-source sharing
def test_v4_shared_kv_source_location_reuse_changes_nothing_in_prefill():
    """``dsa_shared_kv``: members attend to their leader's rows. Reading them at the leader's
    location vector (location reuse) or resolving the selection against the leader's source a
    second time gives the same logits bit for bit; members keep no rows; and sharing the
    source does change the model (members no longer read rows of their own)."""
    from lsparse_jax.model.cache import empty_cache
    from lsparse_jax.model.store import DSAStores
    from lsparse_jax.model.transformer import Transformer

    glm, params = setup()
    cfg = tiny(max_len=256, dsa_shared_kv=True, **GLM)
    tokens = jnp.asarray(PROMPTS[1][:24])

    def run(cfg, reuse):
        model = Transformer(cfg, dsa_stores=DSAStores(location_reuse=reuse))
        return jax.jit(lambda p: model.apply({"params": p}, tokens, empty_cache(cfg), 0, 24))(
            params)

    (on, caches, sels), (off, _, off_sels) = run(cfg, True), run(cfg, False)
    np.testing.assert_array_equal(np.asarray(on), np.asarray(off))
    for i in MEMBERS:
        assert caches[i].kv is None and caches[i].keys is None
        np.testing.assert_array_equal(np.asarray(sels[i].positions),
                                      np.asarray(sels[MEMBERS[i]].positions))
    assert off_sels[1].locations.table is None and sels[1].locations.table is not None
    assert not np.array_equal(np.asarray(on), np.asarray(run(glm, True)[0]))


@pytest.mark.slow
def test_prefix_reuse_with_a_shared_kv_source():
    """Prefix reuse on a ``dsa_shared_kv`` model under hisparse: only the leaders' rows are
    paged (members hold none); the reused call equals a fresh admission as above."""
    cfg, params = tiny(max_len=256, dsa_shared_kv=True, **GLM), setup()[1]
    cache = CacheConfig(num_slots=2, prefill_chunk=32, page_size=8, hot_cache_rows=16)
    engines = [Engine(EngineConfig(model=cfg, cache=cache, method="hisparse"), params)
               for _ in range(2)]
    check_prefix_reuse(*engines)


@pytest.mark.slow
def test_v4_shared_kv_source_paged_equals_resident_and_members_fetch_nothing():
    """Engines on a ``dsa_shared_kv`` model: resident and hisparse, each with and without
    location reuse, give the same logits and selections bit for bit; only the leaders hold
    host pages (members have no payload to fetch), and without location reuse a member's
    second resolve of the leader's source finds every row on the device (no second fetch)."""
    cfg = tiny(max_len=256, dsa_shared_kv=True, **GLM)
    params = setup()[1]

    def engine(method, reuse):
        cache = CacheConfig(num_slots=2, prefill_chunk=32, page_size=8,
                            hot_cache_rows=None if method == "resident" else 16,
                            location_reuse=reuse)
        return Engine(EngineConfig(model=cfg, cache=cache, method=method), params)

    engines = [engine(m, r) for m in ("resident", "hisparse") for r in (True, False)]
    for e in engines:
        for p in PROMPTS[:2]:
            e.admit(p, 30)
    for _ in range(22):
        want, *got = [e.step() for e in engines]
        for out in got:
            np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(want.logits))
            np.testing.assert_array_equal(np.asarray(out.selected), np.asarray(want.selected))
    pools = engines[2].state.tier.kv_pools
    assert [p is not None for p in pools] == [True, False, False, True, False]
    host = [e.metrics()["selection"]["host_rows"] for e in engines]
    assert host[0] == host[1] == 0 and host[2] == host[3] > 0  # the leaders' fetches only
