"""The scheduler: waiting admission under slots, a device byte budget and the host pool; every
request's greedy tokens equal those it gets served alone (identity 9); stop conditions; exact
metrics on a fixed clock; the serve experiment end to end."""

import json

import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig, SamplingConfig
from lsparse_jax.memory.accounting import request_bytes
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.metrics import steady_state
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.scheduler import Clock, Scheduler
from lsparse_jax.tasks import tokenizer
from tests.helpers import model_and_tokens, tiny

CFG = tiny(max_len=128)


def make_engine(method="resident", slots=3, lean=None, **cache):
    params, _ = model_and_tokens(CFG, 1, seed=3)
    books = None
    if lean is not None:
        calib = np.random.default_rng(9).integers(0, 256, 128).astype(np.int32)
        books = calibrate_codebooks(params, CFG, calib, iters=4)
    if method != "resident":
        cache.setdefault("hot_cache_rows", 16)
    cache.setdefault("page_size", 8)
    engine = Engine(EngineConfig(model=CFG, method=method, sampling=SamplingConfig(0.0),
                                 leansparse=lean or LeanSparseConfig(),
                                 cache=CacheConfig(num_slots=slots, prefill_chunk=32,
                                                   **cache)), params, books)
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def resident():
    return make_engine()


def workload(n, seed=0, arrivals=None, **kw):
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(0, 256, int(rng.integers(20, 61))).astype(np.int32),
                    int(rng.integers(4, 13)), arrival_time=0.0 if arrivals is None
                    else arrivals[i], id=i, **kw) for i in range(n)]


def fresh(r: Request) -> Request:
    return Request(r.prompt, r.max_new_tokens, r.stop_tokens, r.stop_strings, r.arrival_time,
                   r.id)


def alone(engine: Engine, r: Request) -> list[int]:
    """``r``'s tokens served by itself on the engine (no scheduler): admit, step, release."""
    r = fresh(r)
    slot = engine.admit(r)
    while not r.done:
        engine.step()
    return engine.release(slot)


def serve(engine, requests, **kw) -> Scheduler:
    sched = Scheduler(engine, **kw)
    sched.submit(requests)
    sched.run()
    assert len(sched.finished) == len(requests) and not engine.active.any()
    return sched


def test_device_budget_bounds_admission_and_tokens_equal_alone(resident):
    requests = workload(6, seed=1, arrivals=[0.0, 0.0, 0.01, 0.02, 0.03, 0.5])
    per = [request_bytes(resident.config, len(r.prompt) + r.max_new_tokens).gpu_total
           for r in requests]
    budget = sorted(per)[-1] + sorted(per)[-2]  # any two fit, never three (3 slots)
    assert sum(sorted(per)[:3]) > budget
    sched = serve(resident, requests, device_budget_bytes=budget,
                  clock=Clock(step_s=0.01, prefill_token_s=1e-4))
    assert max(t["device_bytes"] for t in sched.trace) <= budget
    assert max(t["active"] for t in sched.trace) == 2
    assert sched.waits_by["device_budget"] > 0 and sched.waits_by["slots"] == 0
    assert sched.admission_waits == sum(r.admission_waits for r in requests)
    assert sched.device_bytes_in_use == 0
    for r in requests:  # identity 9
        assert r.tokens == alone(resident, r), r.id
        assert r.finish_reason == "length" and len(r.tokens) == r.max_new_tokens
    admitted = sorted(requests, key=lambda r: r.admitted_at)
    assert [r.id for r in admitted] == [r.id for r in requests]  # first come, first served


def test_prefill_memory_delays_a_monolithic_admission_not_a_streamed_one(resident):
    """LeanSparse section 3: with the prefill's transient bytes charged (``prefill_memory``),
    a budget that holds both requests' decode state plus one layer-streamed prefill's two
    layer buffers admits b beside a when b streams its prefill, and makes b wait
    ("prefill_memory") while a decodes when b's prefill holds every layer at once. Transients
    are the accounting's (streamed: the two largest adjacent layers; monolithic: every layer,
    sized to the prompt); the trace's bytes never exceed the budget; tokens equal alone."""
    from lsparse_jax.memory.accounting import layer_state_bytes, sized_for

    streamed = make_engine(streamed_prefill=True)
    rng = np.random.default_rng(11)
    a, b = [Request(rng.integers(0, 256, 60).astype(np.int32), 6, arrival_time=t, id=i)
            for i, t in enumerate([0.0, 0.01])]
    layers = layer_state_bytes(sized_for(resident.config, 60).model)
    assert resident.prefill_device_bytes(60) == sum(layers)
    assert streamed.prefill_device_bytes(60) == max(x + y for x, y in zip(layers, layers[1:]))
    assert streamed.prefill_device_bytes(60) < resident.prefill_device_bytes(60)
    budget = 2 * resident.request_device_bytes(66) + streamed.prefill_device_bytes(60)
    out = {}
    for name, engine in (("monolithic", resident), ("streamed", streamed)):
        reqs = [fresh(r) for r in (a, b)]
        sched = serve(engine, reqs, device_budget_bytes=budget, prefill_memory=True,
                      clock=Clock(step_s=0.01, prefill_token_s=1e-4))
        assert max(t["device_bytes"] for t in sched.trace) <= budget
        assert sched.summary()["peak_device_bytes"] <= budget
        for r in reqs:
            assert r.tokens == alone(resident, r), (name, r.id)
        out[name] = sched
    mono, stream = out["monolithic"], out["streamed"]
    assert mono.waits_by["prefill_memory"] > 0 and mono.waits_by["device_budget"] == 0
    assert max(t["active"] for t in mono.trace) == 1  # b only after a finished
    assert stream.admission_waits == 0 and max(t["active"] for t in stream.trace) == 2
    with pytest.raises(ValueError, match="set device_budget_bytes"):
        Scheduler(resident, prefill_memory=True)
    with pytest.raises(ValueError, match="prefill transient"):
        alone_fits = resident.request_device_bytes(66) + resident.prefill_device_bytes(60)
        Scheduler(resident, device_budget_bytes=alone_fits - 1,
                  prefill_memory=True).submit([fresh(a)])


def test_memory_model_counts_bytes_at_its_depth_and_changes_no_token(resident):
    """``memory_model``: the same engine config with a deeper layer pattern. The scheduler's
    decode and prefill-transient bytes are the accounting's on that config (monolithic: every
    layer of the deeper model; streamed: still two layer buffers), so a budget the engine's own
    bytes fit makes a monolithic admission wait at depth; tokens equal alone. Any other
    difference raises."""
    import dataclasses

    from lsparse_jax.memory.accounting import prefill_transient_bytes

    deep = dataclasses.replace(resident.config, model=dataclasses.replace(
        CFG, layer_pattern=CFG.layer_pattern * 3))
    streamed = make_engine(streamed_prefill=True)
    deep_streamed = dataclasses.replace(streamed.config, model=deep.model)
    rng = np.random.default_rng(12)
    a, b = [Request(rng.integers(0, 256, 60).astype(np.int32), 6, arrival_time=t, id=i)
            for i, t in enumerate([0.0, 0.01])]
    s = Scheduler(resident, device_budget_bytes=10**9, prefill_memory=True, memory_model=deep)
    assert s.device_bytes(a) == request_bytes(deep, 66).gpu_total
    assert s.device_bytes(a) > resident.request_device_bytes(66)
    assert s.prefill_bytes(a) == prefill_transient_bytes(deep, 60)
    assert s.prefill_bytes(a) == 3 * resident.prefill_device_bytes(60)
    s2 = Scheduler(streamed, device_budget_bytes=10**9, prefill_memory=True,
                   memory_model=deep_streamed)
    assert s2.prefill_bytes(a) == streamed.prefill_device_bytes(60)  # two buffers at any depth
    # both fit with one monolithic prefill of the slice, not one of the deeper model
    budget = 2 * request_bytes(deep, 66).gpu_total + resident.prefill_device_bytes(60)
    waits = {}
    for memory in (None, deep):
        reqs = [fresh(r) for r in (a, b)]
        sched = serve(resident, reqs, device_budget_bytes=budget, prefill_memory=True,
                      memory_model=memory, clock=Clock(step_s=0.01, prefill_token_s=1e-4))
        waits[memory is None] = sched.waits_by["prefill_memory"]
        assert sched.summary()["memory_model_layers"] == (None if memory is None else 12)
        for r in reqs:
            assert r.tokens == alone(resident, r)
    assert waits[True] == 0 and waits[False] > 0
    other = dataclasses.replace(deep, cache=dataclasses.replace(deep.cache, num_slots=4))
    with pytest.raises(ValueError, match="memory_model must equal"):
        Scheduler(resident, memory_model=other)
    pooled = make_engine(device_pages=64)
    with pytest.raises(ValueError, match="device pools"):
        Scheduler(pooled, memory_model=dataclasses.replace(pooled.config, model=deep.model))


def test_slots_bound_admission(resident):
    requests = workload(5, seed=2)
    sched = serve(resident, requests, clock=Clock(step_s=0.01))
    assert sched.waits_by["slots"] > 0 and sched.waits_by["device_budget"] == 0
    assert max(t["active"] for t in sched.trace) == 3
    for r in requests:
        assert r.tokens == alone(resident, r), r.id


def test_host_pool_admission_waits_and_frees_pages():
    """hisparse, 7 host pages of 4 rows, three slots; a request of 36 + 12 tokens (12 rows)
    needs 3 pages, so two fit and the third waits for a release, never raising; the pool is
    whole again at the end. One of 128 tokens (8 pages) can never fit: an error, not a hang."""
    engine = make_engine("hisparse", slots=3, host_pages=7, page_size=4)
    rng = np.random.default_rng(4)
    requests = [Request(rng.integers(0, 256, 36).astype(np.int32), 12, id=i) for i in range(4)]
    sched = serve(engine, requests, clock=Clock(step_s=0.01))
    assert sched.waits_by["host_pool"] > 0 and sched.waits_by["slots"] == 0
    assert max(t["active"] for t in sched.trace) == 2
    assert engine.control.pages.free == 7
    for r in requests:
        assert r.tokens == alone(engine, r), r.id
    too_big = Scheduler(engine)
    too_big.submit([Request(np.zeros(100, np.int32), 28)])
    with pytest.raises(RuntimeError, match="would wait forever"):
        too_big.run()
    assert engine.control.pages.free == 7 and not engine.active.any()


@pytest.mark.parametrize("method", ["resident", pytest.param("hisparse", marks=pytest.mark.slow)])
def test_device_pool_admission_waits_and_tokens_equal_alone(method, resident):
    """Device pools of 5 pages of 8 rows (requests of 24-72 tokens need 1-3 pages), six
    slots: requests wait for pages (reason "device_pool"), never for slots, and every
    request's greedy tokens equal those it gets alone on the preallocated resident engine.
    The pages in use always equal the accounting's pages of the running requests and never
    exceed the pool; at the end the pool is whole."""
    engine = make_engine(method, slots=6, device_pages=5)
    requests = workload(7, seed=6)
    sched = Scheduler(engine, clock=Clock(step_s=0.01))
    sched.submit(requests)
    pages = lambda r: request_bytes(  # noqa: E731
        engine.config, len(r.prompt) + r.max_new_tokens).device_pages
    while sched.waiting or sched.running:
        sched.iterate()
        in_use = engine.control.device.in_use
        assert in_use == sum(pages(r) for r in sched.running.values()) <= 5
    assert sched.waits_by["device_pool"] > 0 and sched.waits_by["slots"] == 0
    assert engine.control.device.in_use == 0
    for r in requests:
        assert r.tokens == alone(resident, r), r.id


# adaptive with overlap is slow: the overlap schedule is covered on resident (stop tokens,
# fixed-clock metrics, chunked prefill) and launch-ahead with adaptive's controller by
# tests/test_decode_pipeline.py
@pytest.mark.parametrize("method,overlap", [("leansparse", False), ("adaptive", False),
                                            pytest.param("adaptive", True,
                                                         marks=pytest.mark.slow)])
def test_every_method_under_load_equals_alone(method, overlap):
    """Identity 9 for an approximate method (leansparse, 32 candidates, miss filter) and for
    adaptive with 4 optional pages of 4 rows for prompts of 1-3 complete pages (reclaimed as
    requests join, refilled as they leave), under chunked prefill; adaptive also with each
    step launched before the previous one is read (its refills planned a step ahead)."""
    if method == "leansparse":
        engine = make_engine(method, lean=LeanSparseConfig(
            num_candidates=32, miss_filter_offset=1.0, key_cache_rows=48))
    else:
        engine = make_engine(method, page_size=4, optional_pages=4, refill_pages=2)
    requests = workload(5, seed=10, arrivals=[0.0, 0.0, 0.01, 0.02, 0.2])
    sched = serve(engine, requests, prefill_token_budget=32, clock=Clock(step_s=0.01),
                  overlap=overlap)
    assert max(t["active"] for t in sched.trace) == 3
    for r in requests:
        assert r.tokens == alone(engine, r), r.id


@pytest.mark.parametrize("overlap", [False, True])
def test_forced_inputs_feed_each_request_its_own_repeat(resident, overlap):
    """Scheduler(inputs=RepeatInputs(1.0)): every step feeds each request the token its
    admission sampled (a request new to its slot repeats its own token, not the slot's last
    one), so its tokens equal those it gets alone with that token forced at every step:
    the first one repeated, then the last step's sample."""
    from lsparse_jax.serving.workloads import RepeatInputs

    requests = workload(5, seed=12, arrivals=[0.0, 0.0, 0.0, 0.01, 0.02])
    sched = serve(resident, requests, clock=Clock(step_s=0.01), overlap=overlap,
                  inputs=RepeatInputs(1.0, CFG.vocab_size))
    assert max(t["active"] for t in sched.trace) == 3  # slots were reused
    for r in requests:
        one = fresh(r)
        slot = resident.admit(one)
        first = int(resident.next_token[slot])
        while not one.done:
            resident.step(tokens=np.full(resident.active.size, first, np.int32))
        want = resident.release(slot)
        assert r.tokens == want and want[:-1] == [first] * (len(want) - 1), r.id


def test_forced_inputs_refused_for_a_spec_engine_step():
    """SpecEngine's step takes no forced inputs: refused at construction, not mid-run."""
    from lsparse_jax.serving.speculative import SpecEngine
    from lsparse_jax.serving.workloads import RepeatInputs

    engine = SpecEngine.__new__(SpecEngine)  # the check reads only its class
    with pytest.raises(ValueError, match="SpecEngine runs its own step"):
        Scheduler(engine, inputs=RepeatInputs(0.3, 8))


# overlap: each step launched before the previous one is read (a stop token's request is
# launched once more, its token dropped): the same tokens and finish reasons
@pytest.mark.parametrize("overlap", [False, True])
def test_stop_tokens_and_strings_end_requests(resident, overlap):
    base = workload(1, seed=5)[0]
    base = Request(base.prompt, 12, id="base")
    full = alone(resident, base)
    stop = full[5]
    cut = full.index(stop) + 1
    text = tokenizer.decode(full)
    s = tokenizer.decode(full[6:8])
    want_s = next(n for n in range(1, 13) if s in tokenizer.decode(full[:n]))
    requests = [Request(base.prompt, 12, stop_tokens=(stop,), id="tok"),
                Request(base.prompt, 12, stop_strings=(s,), id="str"),
                Request(base.prompt, 1, id="one"), Request(base.prompt, 12, id="len"),
                Request(np.resize(base.prompt, 120), None, id="max_len")]  # 8 to max_len
    serve(resident, requests, clock=Clock(step_s=0.01), overlap=overlap)
    got = {r.id: r for r in requests}
    assert got["max_len"].tokens == alone(resident, Request(np.resize(base.prompt, 120), 8))
    assert got["max_len"].finish_reason == "length"
    assert got["tok"].tokens == full[:cut] and got["tok"].finish_reason == "stop_token"
    assert got["str"].tokens == full[:want_s] and got["str"].finish_reason == "stop_string"
    assert s in tokenizer.decode(got["str"].tokens) and s in text
    assert got["one"].tokens == full[:1] and got["one"].finish_reason == "length"
    assert got["len"].tokens == full


@pytest.mark.parametrize("overlap", [False, True])
def test_metrics_exact_on_a_fixed_clock(resident, overlap):
    """One slot; decode steps cost 0.25 s, prefill 2^-7 s per prompt token.
    a (t=0, 32 tokens prompt, 4 new): admitted 0, tokens at 0.25, 0.5, 0.75, 1.0.
    b (t=0.5, 16, 3): waits two iterations, admitted 1.0, tokens at 1.125, 1.375, 1.625.
    c (t=10, 32, 2): the clock jumps to 10 while idle; tokens at 10.25, 10.5.
    overlap: a step's time is charged when it is read, the iteration after its launch (a
    run's first launch costs nothing on this clock): the same figures."""
    engine = make_engine(slots=1)
    rng = np.random.default_rng(6)
    reqs = [Request(rng.integers(0, 256, n).astype(np.int32), new, arrival_time=t, id=i)
            for i, (n, new, t) in enumerate([(32, 4, 0.0), (16, 3, 0.5), (32, 2, 10.0)])]
    sched = serve(engine, reqs, clock=Clock(step_s=0.25, prefill_token_s=2 ** -7),
                  overlap=overlap)
    a, b, c = reqs
    assert a.token_times == [0.25, 0.5, 0.75, 1.0] and a.finished_at == 1.0
    assert b.admitted_at == 1.0 and b.token_times == [1.125, 1.375, 1.625]
    assert b.admission_waits == 2 == sched.admission_waits == sched.waits_by["slots"]
    assert c.admitted_at == 10.0 and c.token_times == [10.25, 10.5]
    rec = {r["id"]: r for r in sched.records()}
    assert (rec[0]["ttft_s"], rec[0]["tpot_s"], rec[0]["e2e_s"], rec[0]["queue_s"]) == \
        (0.25, 0.25, 1.0, 0.0)
    assert (rec[1]["ttft_s"], rec[1]["tpot_s"], rec[1]["e2e_s"], rec[1]["queue_s"]) == \
        (0.625, 0.25, 1.125, 0.5)
    assert (rec[2]["ttft_s"], rec[2]["tpot_s"], rec[2]["e2e_s"]) == (0.25, 0.25, 0.5)
    s = sched.summary()
    assert s["completed"] == 3 and s["output_tokens"] == 9 and s["run_time_s"] == 10.5
    assert s["throughput_tok_s"] == pytest.approx(9 / 10.5)
    ttft = [0.25, 0.625, 0.25]
    for q in (50, 95, 99):
        assert s[f"ttft_p{q}_s"] == pytest.approx(np.percentile(ttft, q))
        assert s[f"e2e_p{q}_s"] == pytest.approx(np.percentile([1.0, 1.125, 0.5], q))
    assert s["tpot_p50_s"] == 0.25
    # steady state: one request decoding in both neighbouring entries, 0.25 s a step
    assert s["most_active"] == 1 and s["steady_iteration_p50_s"] == 0.25
    assert s["steady_iterations"] >= 1


def test_steady_state_counts_only_intervals_at_the_most_active():
    """Intervals whose two ends both show the most active requests: here (1.0, 1.5) and
    (1.5, 2.5); the admission interval (0.5, 1.0) and the drain are left out."""
    trace = [{"time_s": t, "active": a} for t, a in
             [(0.0, 0), (0.5, 1), (1.0, 2), (1.5, 2), (2.5, 2), (2.75, 1), (3.0, 0)]]
    assert steady_state(trace) == {"most_active": 2, "steady_iterations": 2,
                                   "steady_iteration_p50_s": 0.75}
    assert steady_state([{"time_s": 0.0, "active": 0}])["steady_iteration_p50_s"] is None



@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_interleaves_and_tokens_equal_alone(resident, overlap):
    requests = workload(6, seed=7, arrivals=[0.0, 0.0, 0.01, 0.02, 0.03, 0.5])
    per = [request_bytes(resident.config, len(r.prompt) + r.max_new_tokens).gpu_total
           for r in requests]
    budget = sorted(per)[-1] + sorted(per)[-2]
    sched = serve(resident, requests, device_budget_bytes=budget, prefill_token_budget=32,
                  clock=Clock(step_s=0.01, prefill_token_s=1e-4), overlap=overlap)
    assert max(t["device_bytes"] for t in sched.trace) <= budget
    assert max(t["active"] + t["prefilling"] for t in sched.trace) == 2
    assert any(t["active"] and t["prefilling"] for t in sched.trace)  # decode beside prefill
    assert sched.waits_by["device_budget"] > 0
    for r in requests:
        assert r.tokens == alone(resident, r), r.id


def test_chunked_prefill_holds_its_transient_until_it_enters_decode(resident):
    """Chunked mode with ``prefill_memory``: a prefilling request holds its decode bytes and
    its (monolithic) prefill transient until it enters the engine; a budget of two requests'
    decode bytes plus one transient lets one prefill run beside one decoding request, never
    two prefills at once; the bytes return to 0 and tokens equal alone."""
    requests = workload(4, seed=12, arrivals=[0.0, 0.0, 0.01, 0.02])
    per = [resident.request_device_bytes(len(r.prompt) + r.max_new_tokens) for r in requests]
    pre = [resident.prefill_device_bytes(len(r.prompt)) for r in requests]
    budget = sorted(per)[-1] + sorted(per)[-2] + max(pre)
    assert min(pre) * 2 + min(per) * 2 > budget  # two prefills at once never fit
    sched = serve(resident, requests, device_budget_bytes=budget, prefill_token_budget=32,
                  prefill_memory=True, clock=Clock(step_s=0.01, prefill_token_s=1e-4))
    assert max(t["device_bytes"] for t in sched.trace) <= budget
    assert max(t["prefilling"] for t in sched.trace) == 1
    assert any(t["active"] and t["prefilling"] for t in sched.trace)
    assert sched.waits_by["prefill_memory"] > 0
    assert sched.device_bytes_in_use == 0 and sched.prefill_bytes_in_use == 0
    for r in requests:
        assert r.tokens == alone(resident, r), r.id


def test_chunked_prefill_metrics_exact(resident):
    """Chunks of 32 tokens, one per iteration (2^-7 s per token), decode steps of 0.25 s.
    a (t=0, 40 tokens, 3 new): chunks end at 0.25 and 0.3125 (first token), decode 0.5625;
    b (t=0.5, 32, 2) prefills at 0.5625 -> 0.8125 (first token) before the step both decode
    in, which ends at 1.0625: a's last gap holds b's chunk."""
    rng = np.random.default_rng(8)
    a, b = [Request(rng.integers(0, 256, n).astype(np.int32), new, arrival_time=t, id=i)
            for i, (n, new, t) in enumerate([(40, 3, 0.0), (32, 2, 0.5)])]
    sched = serve(resident, [a, b], prefill_token_budget=32,
                  clock=Clock(step_s=0.25, prefill_token_s=2 ** -7))
    assert a.admitted_at == 0.0 and a.token_times == [0.3125, 0.5625, 1.0625]
    assert b.admitted_at == 0.5625 and b.token_times == [0.8125, 1.0625]
    rec = {r["id"]: r for r in sched.records()}
    assert (rec[0]["ttft_s"], rec[0]["tpot_s"], rec[0]["e2e_s"]) == (0.3125, 0.375, 1.0625)
    assert (rec[1]["ttft_s"], rec[1]["tpot_s"], rec[1]["queue_s"]) == (0.3125, 0.25, 0.0625)
    for r in (a, b):
        assert r.tokens == alone(resident, r)


# slow tier (session 49): an experiment CLI (28 s); the scheduler's behaviour stays in this file
@pytest.mark.slow
def test_serve_experiment_smoke(tmp_path, monkeypatch):
    from experiments.cli import main

    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    assert main(["run", "configs/experiments/serve_smoke.gin", "--gin.run.name='smoke'",
                 "--gin.serve.requests=6", "--gin.serve.max_new_tokens=(2, 6)",
                 "--gin.serve.overlap=True", "--gin.serve.prefill_token_budget=64",
                 "--gin.serve.mixed=True"]) == 0
    out = json.loads((tmp_path / "smoke" / "results.json").read_text())
    assert out["completed"] == 6 and len(out["requests"]) == 6 and out["config"]["overlap"]
    assert out["config"]["mixed"] and out["mixed_iterations"] > 0  # chunks rode on steps
    for key in ("ttft_p50_s", "tpot_p50_s", "throughput_tok_s", "admission_waits"):
        assert key in out
    assert out["peak_device_bytes"] <= out["device_budget_bytes"]
    assert (tmp_path / "smoke" / "latency_cdf.png").is_file()


def test_overlap_refuses_prefix_reuse(resident):
    from lsparse_jax.serving.workloads import MultiTurn

    with pytest.raises(ValueError, match="overlap launches a step past"):
        Scheduler(resident, workload=MultiTurn, prefix_reuse=True, overlap=True)


def test_serve_budget_fit_and_niah_prompts(tmp_path, monkeypatch):
    """budget_fit=(hisparse, 2): the budget is exactly two hisparse requests' bytes at the
    longest request, so at most two run at once and the rest wait; prompt_task='niah' serves
    the NIAH prompts of the given length and seed range."""
    from experiments.cli import main
    from experiments.serve import NIAH_SEEDS, niah_prompts
    from lsparse_jax.model import preset
    from lsparse_jax.model.presets import fit_max_len
    from lsparse_jax.serving.workloads import poisson_requests
    from lsparse_jax.training.data import task_example

    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    assert main(["run", "configs/experiments/serve_smoke.gin", "--gin.run.name='fit'",
                 "--gin.serve.method='hisparse'", "--gin.serve.requests=4",
                 "--gin.serve.arrival_rate=1000.0", "--gin.serve.prompt_tokens=(400, 400)",
                 "--gin.serve.max_new_tokens=(4, 4)", "--gin.serve.prompt_task='niah'",
                 "--gin.serve.budget_fit=('hisparse', 2)"]) == 0
    out = json.loads((tmp_path / "fit" / "results.json").read_text())
    engine = EngineConfig(model=fit_max_len(preset("tiny"), 404), method="hisparse",
                          cache=CacheConfig(4, 64, 32, 16))
    assert out["device_budget_bytes"] == 2 * request_bytes(engine, 404).gpu_total
    assert out["completed"] == 4 and out["admission_waits"] > 0
    assert max(it["active"] for it in out["trace"]) == 2
    assert out["peak_device_bytes"] <= out["device_budget_bytes"]
    raw = poisson_requests(3, 5.0, (380, 420), (4, 8), 256, 7)
    got = niah_prompts(raw, 7)
    for i, (r, g) in enumerate(zip(raw, got)):
        want = task_example("niah", len(r.prompt), NIAH_SEEDS + 7 * 10**4 + i).prompt
        assert list(g.prompt) == list(want) and len(want) == len(r.prompt)
        assert (g.arrival_time, g.max_new_tokens, g.id) == (r.arrival_time, r.max_new_tokens,
                                                             r.id)
