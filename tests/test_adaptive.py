"""Adaptive DHiSparse's optional residency: bit-identical to resident under any reclaim/refill
schedule (identity 3), every row on the GPU or in a host page (identity 8), the policy."""

import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig
from lsparse_jax.memory import HotCache, empty_pool, resolve
from lsparse_jax.memory.host_pool import write_host_page
from lsparse_jax.memory.invariant import hierarchy_violations
from lsparse_jax.methods.adaptive import OptionalResidency
from lsparse_jax.serving.engine import Engine
from tests.helpers import assert_resolved_rows, model_and_tokens, tiny

PAGE = 8


def make(cfg, params, method, optional=None, slots=3, refill=2, device_pages=None):
    rows = None if method == "resident" else 16
    return Engine(EngineConfig(model=cfg, method=method, cache=CacheConfig(
        num_slots=slots, prefill_chunk=32, hot_cache_rows=rows, page_size=PAGE,
        optional_pages=optional, refill_pages=refill, device_pages=device_pages)), params)


def check_step(resident, adaptive):
    want, got = resident.step(), adaptive.step()
    act = resident.active
    for field in ("logits", "tokens", "selected"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field))[act],
                                      np.asarray(getattr(want, field))[act])
    assert hierarchy_violations(adaptive.config, adaptive.state, resident.state.caches,
                                act) == []
    return np.asarray(got.sources)[act]


# 5: constant reclaiming; kv_dtype on both sides (lent pages hold the stored rows);
# device_pages: exact keys in device pools, 32 pages = the most held at once (12 + 9 + 11),
# the fourth request reuses the first one's pages; (5, 1, f32, None) and (since session 49)
# (5, 1, fp8_v4, None) are slow: the same load pattern runs with device pools in the fast
# suite, and FP8 rows keep their identities in test_kv_rows
@pytest.mark.parametrize("optional,refill,kv_dtype,device_pages", [
    pytest.param(5, 1, "f32", None, marks=pytest.mark.slow), (40, 4, "f32", None),
    pytest.param(5, 1, "fp8_v4", None, marks=pytest.mark.slow), (5, 1, "f32", 32)])
def test_adaptive_bit_identical_to_resident_under_load_changes(optional, refill, kv_dtype,
                                                               device_pages):
    cfg = tiny(max_len=512, kv_dtype=kv_dtype)
    params, _ = model_and_tokens(cfg, 1, seed=optional)
    rng = np.random.default_rng(optional)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (300, 200, 260, 150)]
    resident = make(cfg, params, "resident")
    adaptive = make(cfg, params, "adaptive", optional, refill=refill,
                    device_pages=device_pages)
    schedule = {0: ("admit", 0), 1: ("admit", 1), 12: ("admit", 2), 30: ("release", 0),
                34: ("admit", 3), 50: ("release", 2)}
    lent_changes, seen = 0, None
    for step in range(70):
        if step in schedule:
            what, i = schedule[step]
            for e in (resident, adaptive):
                if what == "admit":
                    e.admit(prompts[i], max_new_tokens=80)
                else:
                    e.release(i)
        check_step(resident, adaptive)
        lent = {s: dict(v) for s, v in adaptive.control.residency.lent.items()}
        lent_changes += lent != seen
        seen = lent
    assert resident.generated == adaptive.generated
    assert lent_changes >= 4  # residency grew and shrank with the load
    m = adaptive.metrics()
    assert m["optional_pages_in_use"] <= optional
    row = {"f32": 4 * cfg.head_dim, "fp8_v4": 16 + 1 + 2 * 16}[kv_dtype]  # D 32, rope 16
    assert m["optional_pool_bytes"] == 2 * optional * PAGE * row  # 2 CSA layers


def test_full_residency_serves_imported_history_without_host_copies():
    """With every prompt page lent, the first steps (before a generated page completes) copy
    nothing from the host, while hisparse does; both equal resident."""
    cfg = tiny(max_len=512)
    params, prompt = model_and_tokens(cfg, 320, seed=5)  # 80 rows = 10 complete pages
    # 3 slots (one used): the load test's resident engine, its compiled step reused
    resident = make(cfg, params, "resident")
    hisparse = make(cfg, params, "hisparse")
    adaptive = make(cfg, params, "adaptive", 10)
    for e in (resident, hisparse, adaptive):
        e.admit(prompt, max_new_tokens=20)
    host = {"hisparse": 0, "adaptive": 0}
    for _ in range(20):  # 20 tokens = 5 rows: the tail page (80..87) does not complete
        fed = resident.next_token.copy()
        src = check_step(resident, adaptive)
        host["adaptive"] += int(src[..., 2].sum())
        host["hisparse"] += int(np.asarray(hisparse.step(fed).sources)[0, ..., 2].sum())
    assert host["adaptive"] == 0 < host["hisparse"]


def test_reclaim_order_and_bounded_round_robin_refill():
    r = OptionalResidency(num_pages=10, pages_per_slot=16, refill_pages=2)
    victims, row = r.admit(0, 6)
    assert victims == [] and list(row[:7]) == [0, 1, 2, 3, 4, 5, -1]
    victims, row = r.admit(1, 3)  # fits beside slot 0: resident-first, nothing reclaimed
    assert victims == [] and list(row[:4]) == [6, 7, 8, -1]
    victims, _ = r.admit(2, 5)  # deficit 4: slot 0 (admitted first) gives back all six
    assert victims == [0] and r.lent[0] == {} and len(r.lent[2]) == 5 and r.pages.free == 2
    plans = r.plan_refill()  # two free pages go back to slot 0, one step at most two
    assert [(s, list(lg[lg >= 0])) for s, lg, _ in plans] == [(0, [0, 1])]
    assert r.plan_refill() == [] and r.pages.free == 0
    assert r.release(2) is True and r.pages.free == 5
    got = []
    for _ in range(3):
        got += [(s, int(p)) for s, lg, _ in r.plan_refill() for p in lg[lg >= 0]]
    assert got == [(0, 2), (0, 3), (0, 4), (0, 5)]  # slot 1 is complete; bounded by 2 a step
    assert r.release(1) is True and r.release(0) is True and r.pages.free == 10
    victims, _ = r.admit(1, 12)  # larger than the pool: the first ten pages, nothing to take
    assert victims == [] and sorted(r.lent[1]) == list(range(10))


def test_resolver_reads_ready_optional_pages_in_place():
    """Step 1 of the resolver: a position whose page is lent is read from the optional pool;
    the hot cache neither scans for it nor stores it."""
    dim, pages = 3, 4
    rng = np.random.default_rng(0)
    truth = rng.normal(size=(pages * PAGE, dim)).astype(np.float32)
    pool = empty_pool(pages, PAGE, dim)
    table = jnp.arange(pages, dtype=jnp.int32)
    for p in range(pages):
        pool = write_host_page(pool, p, jnp.asarray(truth[p * PAGE:(p + 1) * PAGE]))
    optional = np.full((2 * PAGE, dim), np.nan, np.float32)
    optional[PAGE:] = truth[PAGE:2 * PAGE]  # logical page 1 lent in optional page 1
    ready = jnp.asarray([-1, 1, -1, -1], jnp.int32)
    tail = jnp.full((PAGE, dim), jnp.nan)
    selected = jnp.asarray([9, 2, 14, 25, -1], jnp.int32)
    rows, hot, counts = resolve(HotCache.empty(4, dim), selected, tail, pages * PAGE, table,
                                pool, "xla", jnp.asarray(optional), ready)
    assert_resolved_rows(rows, np.asarray(selected), truth)
    np.testing.assert_array_equal(np.asarray(counts), [2, 0, 2])
    assert sorted(np.asarray(hot.positions)[np.asarray(hot.positions) >= 0]) == [2, 25]


def test_optional_pages_only_with_adaptive():
    cfg = tiny()
    with pytest.raises(ValueError, match="optional_pages"):
        EngineConfig(model=cfg, method="adaptive", cache=CacheConfig(hot_cache_rows=16))
    with pytest.raises(ValueError, match="optional_pages"):
        EngineConfig(model=cfg, method="hisparse",
                     cache=CacheConfig(hot_cache_rows=16, optional_pages=4))
    with pytest.raises(ValueError, match="refill_pages"):
        CacheConfig(refill_pages=0)


# slow tier: fp8_v4 ~1.5 min interpreted (the kernels' FP8 rows are tested in their own files),
# f32 since session 49 (46 s; hisparse's engine runs the same kernels in test_hierarchy)
@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,precision", [
    ("f32", "f32"), ("fp8_v4", "f32"), ("fp8_v4", "bf16")])
def test_adaptive_with_the_triton_kernels_is_bit_identical(kv_dtype, precision):
    """Lent pages resolve before the hot_resolve kernel; sparse_attention reads them alike
    (attention_precision "bf16": FP8 rows in place, from lent pages and the hot cache)."""
    cfg = tiny(max_len=512, kv_dtype=kv_dtype, attention_precision=precision)
    params, prompt = model_and_tokens(cfg, 200, seed=2)
    engines = [Engine(EngineConfig(model=cfg, method=m, implementation="triton", cache=CacheConfig(
        num_slots=2, prefill_chunk=32, hot_cache_rows=rows, page_size=PAGE, optional_pages=opt)),
        params) for m, rows, opt in (("resident", None, None), ("adaptive", 16, 3))]
    for e in engines:
        e.admit(prompt, max_new_tokens=20)
    sources = np.zeros(3, int)
    for _ in range(8):
        sources += check_step(*engines)[0].sum(0)
    assert (sources > 0).all()  # lent pages / tail, hot hits and host copies all occurred


# slow tier (session 49): an experiment CLI (40 s); adaptive residency's identities stay in this
# file
@pytest.mark.slow
def test_residency_experiment_cli(tmp_path, monkeypatch):
    """The load-step study end to end (shortened): it checks token identity with resident
    itself; at step 0 a lone request with every prompt page lent copies nothing from the host,
    while hisparse's cold hot cache copies every selected paged row."""
    import json

    from experiments.cli import main

    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    rc = main(["run", "configs/experiments/residency.gin", "--gin.residency.prompt_tokens=512",
               "--gin.residency.requests=3", "--gin.residency.arrival_steps=2",
               "--gin.residency.decode_tokens=6", "--gin.residency.num_slots=2",
               "--gin.residency.optional_pages=8", "--gin.run.name='res'"])
    assert rc == 0
    out = json.loads((tmp_path / "res" / "results.json").read_text())
    assert out["tokens_identical_to_resident"]
    series = out["series"]
    assert series["adaptive"]["host_fraction"][0] == 0.0
    assert series["hisparse"]["host_fraction"][0] == 1.0
    assert series["adaptive"]["optional_pages"][0] == 8 and (tmp_path / "res" /
                                                             "residency.png").exists()
    assert series["adaptive"]["active"] == series["hisparse"]["active"]
    for m in ("hisparse", "adaptive"):  # the resolver's three steps account for every row
        total = (np.asarray(series[m]["step1_fraction"]) + series[m]["step2_fraction"]
                 + series[m]["host_fraction"])
        np.testing.assert_allclose(total, 1.0, atol=1e-9)
        by = out["summary"][m]["resolver_by_load"]
        assert by["1"]["host"] == out["summary"][m]["host_fraction_by_load"]["1"]


def test_residency_input_repeat_feeds_every_method_the_same_inputs(tmp_path, monkeypatch):
    """``residency.input_repeat``: every method is fed the same teacher-forced inputs each
    step (so their sampled tokens can be compared step by step, which the run asserts), and
    with repeat 1.0 a request's input never changes after its first step."""
    import json

    from experiments.cli import main

    fed = []  # (method, inputs [S], active [S]) per step
    step = Engine.step

    def recording(self, tokens=None, prefill=None):
        fed.append((self.config.method, np.asarray(tokens).copy(), self.active.copy()))
        return step(self, tokens, prefill)

    monkeypatch.setattr(Engine, "step", recording)
    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    rc = main(["run", "configs/experiments/residency.gin", "--gin.residency.prompt_tokens=512",
               "--gin.residency.requests=3", "--gin.residency.arrival_steps=2",
               "--gin.residency.decode_tokens=5", "--gin.residency.num_slots=2",
               "--gin.residency.optional_pages=8", "--gin.residency.input_repeat=1.0",
               "--gin.run.name='rep'"])
    assert rc == 0
    out = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert out["input_repeat"] == 1.0 and out["tokens_identical_to_resident"]
    by = {m: [(t, a) for mm, t, a in fed if mm == m] for m in ("resident", "hisparse",
                                                              "adaptive")}
    assert len(by["resident"]) == out["steps"] > 0
    for m in ("hisparse", "adaptive"):
        for (t, a), (t0, a0) in zip(by[m], by["resident"], strict=True):
            assert (a == a0).all() and (t[a] == t0[a0]).all()
    for (t, a), (prev, was) in zip(by["resident"][1:], by["resident"], strict=False):
        kept = a & was  # the same request as the step before: in this schedule a slot is
        assert (t[kept] == prev[kept]).all()  # idle for a step between two requests


@pytest.mark.slow
def test_shared_budget_reclaims_whole_requests_or_waits():
    """Required state and lent pages share ``shared_budget_bytes`` (3 requests' required
    bytes + 3 optional pages); prompts of 70 tokens hold 2 complete pages. r0 and r1 are
    lent both pages from spare bytes; r2's required bytes leave a one-page deficit: r0's
    pages (a whole request, the oldest) are reclaimed, r1 keeps its own, r2 is lent the
    one spare page; a fourth admission cannot be covered by every lent page: it raises
    SharedBudgetError and changes nothing. Required + lent never exceed the budget; a
    release makes room and the refill lends only from spare bytes; tokens equal resident."""
    from lsparse_jax.memory.accounting import request_bytes
    from lsparse_jax.methods.adaptive import SharedBudgetError

    cfg = tiny(max_len=128)
    params, _ = model_and_tokens(cfg, 1, seed=4)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, 70).astype(np.int32) for _ in range(4)]
    probe = make(cfg, params, "adaptive", optional=8, slots=4)
    need = request_bytes(probe.config, 80).gpu_total
    page = probe.control.page_bytes
    budget = 3 * need + 3 * page
    e = Engine(EngineConfig(model=cfg, method="adaptive", cache=CacheConfig(
        num_slots=4, prefill_chunk=32, hot_cache_rows=16, page_size=PAGE, optional_pages=8,
        refill_pages=2, shared_budget_bytes=budget)), params)
    resident = make(cfg, params, "resident", slots=4)
    lent = lambda: {s: len(v) for s, v in e.control.residency.lent.items()}  # noqa: E731
    for i in range(3):
        e.admit(prompts[i], max_new_tokens=10)
        resident.admit(prompts[i], max_new_tokens=10)
        assert e.control.spare() >= 0  # required + lent within the budget
        if i < 2:
            check_step(resident, e)
    assert lent() == {0: 0, 1: 2, 2: 1}
    free = (e.control.pages.free, e.control.residency.pages.free)
    with pytest.raises(SharedBudgetError, match="cannot cover"):
        e.admit(prompts[3], max_new_tokens=10)
    assert lent() == {0: 0, 1: 2, 2: 1} and not e.active[3]
    assert (e.control.pages.free, e.control.residency.pages.free) == free
    check_step(resident, e)
    for engine in (e, resident):
        engine.release(1)
    assert e.control.spare() == need + 2 * page
    check_step(resident, e)  # the refill lends missing pages from spare bytes, one per slot
    assert lent() == {0: 1, 2: 2} and e.control.spare() >= 0
    check_step(resident, e)
    assert lent() == {0: 2, 2: 2} and e.control.spare() >= 0
    check_step(resident, e)
    assert [e.generated[s] for s in (0, 2)] == [resident.generated[s] for s in (0, 2)]


def test_shared_budget_counts_request_extra_bytes():
    """A controller's ``request_extra_bytes`` (a SpecEngine's ring and staging) count in
    adaptive's shared budget: with the budget of four plain requests and extra bytes of one
    more each, two are admitted and the third waits (SharedBudgetError, nothing changed)."""
    from lsparse_jax.memory.accounting import request_bytes
    from lsparse_jax.methods.adaptive import SharedBudgetError

    cfg = tiny(max_len=512)  # the model of the tests above: its prefill chunks are compiled
    params, _ = model_and_tokens(cfg, 1, seed=5)
    probe = make(cfg, params, "adaptive", optional=8, slots=4)
    need = request_bytes(probe.config, 30).gpu_total
    e = Engine(EngineConfig(model=cfg, method="adaptive", cache=CacheConfig(
        num_slots=4, prefill_chunk=32, hot_cache_rows=16, page_size=PAGE, optional_pages=8,
        shared_budget_bytes=4 * need)), params)
    e.control.request_extra_bytes = need
    prompt = np.arange(20, dtype=np.int32)
    for _ in range(2):
        e.admit(prompt, max_new_tokens=10)
    assert e.control.spare() == 0
    with pytest.raises(SharedBudgetError):
        e.admit(prompt, max_new_tokens=10)
    assert e.active.sum() == 2
