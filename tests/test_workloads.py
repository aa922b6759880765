"""Workloads (serving.workloads) through the scheduler: closed-loop clients, multi-turn
sessions, and the prefix-reuse path (against a stand-in engine with the prefix API)."""

import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.scheduler import Clock, Scheduler
from lsparse_jax.serving.workloads import ClosedLoop, MultiTurn, session_records
from tests.helpers import model_and_tokens, tiny

CFG = tiny(max_len=128)


@pytest.fixture(scope="module")
def params():
    return model_and_tokens(CFG, 1, seed=3)[0]


def make_engine(params, slots=3, cls=Engine):
    engine = cls(EngineConfig(model=CFG, method="resident", sampling=SamplingConfig(0.0),
                              cache=CacheConfig(num_slots=slots, prefill_chunk=32)), params)
    return engine


def alone(engine, prompt, new):
    r = Request(prompt, new)
    slot = engine.admit(r)
    while not r.done:
        engine.step()
    return engine.release(slot)


@pytest.mark.slow
def test_closed_loop_keeps_c_requests_and_submits_after_each_finish(params):
    """Two clients, three requests each, 0.05 s think time, fixed clock: never more than two
    requests in the system, each client's next request arrives exactly think_s after its
    previous one finished, and every request's greedy tokens equal those it gets alone."""
    engine = make_engine(params, slots=3)
    load = ClosedLoop(clients=2, input_tokens=24, output_tokens=5, requests_per_client=3,
                      vocab=CFG.vocab_size, think_s=0.05, seed=1)
    sched = Scheduler(engine, clock=Clock(step_s=0.01), workload=load)
    sched.run()
    done = sched.finished
    assert len(done) == 6 and max(t["active"] for t in sched.trace) == 2
    for client in range(2):
        mine = sorted((r for r in done if r.session == client), key=lambda r: r.turn)
        assert [r.turn for r in mine] == [0, 1, 2] and mine[0].arrival_time == 0.0
        for prev, nxt in zip(mine, mine[1:]):
            assert nxt.arrival_time == pytest.approx(prev.finished_at + 0.05)
    for r in done:
        assert r.tokens == alone(engine, r.prompt, 5), r.id


def test_multi_turn_prompt_is_previous_prompt_response_and_new_turn():
    """Call i's prompt starts with call i-1's prompt + its response; turns, lengths and waits
    come from per-session generators (finishing order does not change them); a session
    stops before a call that would not fit max_len."""
    kw = dict(sessions=2, calls=4, first_prompt_tokens=(10, 20), turn_tokens=(5, 8),
              output_tokens=(3, 4), vocab=256, max_len=64, session_rate=1.0, tool_wait_s=0.5)
    a, b = MultiTurn(**kw, seed=7), MultiTurn(**kw, seed=7)
    first_a, first_b = a.initial(), b.initial()
    assert [r.arrival_time for r in first_a][0] == 0.0
    for r in first_a + first_b:
        r.tokens[:] = list(range(r.max_new_tokens))  # stand-in responses
    # a finishes session 0 then 1; b in the other order: the same next calls
    na = a.on_finish(first_a[0], 1.0) + a.on_finish(first_a[1], 2.0)
    nb = b.on_finish(first_b[1], 2.0) + b.on_finish(first_b[0], 1.0)
    nb = nb[::-1]
    for x, y, prev in zip(na, nb, first_a):
        np.testing.assert_array_equal(x.prompt, y.prompt)
        assert x.arrival_time == y.arrival_time and x.max_new_tokens == y.max_new_tokens
        n = len(prev.prompt) + len(prev.tokens)
        np.testing.assert_array_equal(x.prompt[:n], np.concatenate([prev.prompt,
                                                                    prev.tokens]))
        assert 5 <= len(x.prompt) - n <= 8 and x.turn == 1 and x.session == prev.session
        assert x.arrival_time > (1.0 if prev.session == 0 else 2.0)
    call, ends = na[0], 0
    while True:  # the session grows until the next call would exceed max_len
        call.tokens[:] = [1] * call.max_new_tokens
        nxt = a.on_finish(call, 0.0)
        if not nxt:
            break
        call = nxt[0]
        assert len(call.prompt) + call.max_new_tokens <= 64
    ends = a.truncated + (call.turn == 3)
    assert ends == 1
    with pytest.raises(ValueError, match="exceeds max_len"):
        MultiTurn(**(kw | {"first_prompt_tokens": (10, 62)}))


def test_multi_turn_warmup_first_opens_the_window_after_every_warmup():
    """``warmup_first``: every call 0 arrives at 0; no call 1 is released before the last call
    0 finished, then all at once, session s's at that moment + its Poisson start (no tool
    wait); later calls as without it (a tool wait after the finish); prompts and lengths are
    those of the plain generator (the same per-session draws minus the skipped wait)."""
    kw = dict(sessions=3, calls=3, first_prompt_tokens=(10, 20), turn_tokens=(5, 8),
              output_tokens=(3, 4), vocab=256, max_len=64, session_rate=1.0, tool_wait_s=0.5,
              seed=5)
    w = MultiTurn(**kw, warmup_first=True)
    first = w.initial()
    assert [r.arrival_time for r in first] == [0.0] * 3
    for r in first:
        r.tokens[:] = [1] * r.max_new_tokens
    assert w.on_finish(first[2], 4.0) == [] and w.on_finish(first[0], 5.0) == []
    calls = w.on_finish(first[1], 6.0)
    assert sorted(c.session for c in calls) == [0, 1, 2]
    for c in calls:
        assert c.turn == 1 and c.arrival_time == 6.0 + w.starts[c.session]
        n = len(first[c.session].prompt) + first[c.session].max_new_tokens
        np.testing.assert_array_equal(c.prompt[:n], np.concatenate(
            [first[c.session].prompt, first[c.session].tokens]))
    assert sorted(w.starts)[0] == 0.0 and len(set(w.starts)) == 3
    c = calls[0]
    c.tokens[:] = [1] * c.max_new_tokens
    (nxt,) = w.on_finish(c, 10.0)  # after the window opened: a tool wait, not a start
    assert nxt.turn == 2 and nxt.arrival_time > 10.0
    one = MultiTurn(**(kw | {"calls": 1}), warmup_first=True)
    reqs = one.initial()
    for r in reqs:
        r.tokens[:] = [1] * r.max_new_tokens
    assert [one.on_finish(r, 1.0) for r in reqs] == [[], [], []]


class CountingEngine(Engine):
    """The engine, recording which requests the scheduler detached and admitted with a
    prefix."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def detach(self, slot):
        self.calls.append(("detach", self.requests[slot].id))
        return super().detach(slot)

    def admit(self, request, *a, prefix=None, **kw):
        if prefix is not None:
            self.calls.append(("admit_prefix", request.id))
        return super().admit(request, *a, prefix=prefix, **kw)


@pytest.mark.parametrize("warmup_first", [False, True])
def test_prefix_reuse_detaches_continuing_sessions_and_admits_with_their_prefix(params,
                                                                                warmup_first):
    """Three sessions of three calls (resident): every call but a session's last is detached,
    every call but the first admits with its session's prefix (only the suffix prefilled,
    the prefix streamed from host), none is left at the end; every call's greedy tokens
    equal serving the same calls without reuse; the fixed clock charges the suffix only."""
    kw = dict(sessions=3, calls=3, first_prompt_tokens=(16, 24), turn_tokens=(4, 8),
              output_tokens=(3, 5), vocab=CFG.vocab_size, max_len=128, session_rate=4.0,
              tool_wait_s=0.2, seed=3)
    engine = make_engine(params, slots=2, cls=CountingEngine)
    clock = Clock(step_s=0.01, prefill_token_s=1e-3)
    kw["warmup_first"] = warmup_first  # calls 1 held back until every call 0 finished
    sched = Scheduler(engine, clock=clock, workload=MultiTurn(**kw), prefix_reuse=True)
    sched.run()
    done = sched.finished
    assert len(done) == 9 and not sched.prefixes
    detached = {i for op, i in engine.calls if op == "detach"}
    reused = {i for op, i in engine.calls if op == "admit_prefix"}
    assert detached == {r.id for r in done if r.turn < 2}
    assert reused == {r.id for r in done if r.turn > 0}
    by_id = {r.id: r for r in done}
    for r in done:  # prefix = previous prompt + response minus its last token
        if r.turn:
            prev = by_id[f"s{r.session}.{r.turn - 1}"]
            n = len(prev.prompt) + len(prev.tokens) - 1
            assert r.first_token_at - r.admitted_at == pytest.approx(
                1e-3 * (len(r.prompt) - n))
    assert sched.summary()["reused_prefix_tokens"] == sum(
        len(by_id[f"s{r.session}.{r.turn - 1}"].prompt)
        + len(by_id[f"s{r.session}.{r.turn - 1}"].tokens) - 1 for r in done if r.turn)
    plain = Scheduler(make_engine(params, slots=2), clock=Clock(step_s=0.01),
                      workload=MultiTurn(**kw))
    plain.run()
    assert {r.id: r.tokens for r in plain.finished} == {r.id: r.tokens for r in done}
    sessions = session_records(sched.records(), from_turn=1)
    assert len(sessions) == 3 and all(s["calls"] == 2 for s in sessions)


def test_prefix_reuse_needs_a_workload(params):
    with pytest.raises(ValueError, match="needs a workload"):
        Scheduler(make_engine(params), prefix_reuse=True)


class ChunkCountingEngine(CountingEngine):
    """``CountingEngine`` that also records each prompt prefilled in chunks."""

    def prefill_chunks(self, prompt):
        self.calls.append(("chunks", len(prompt)))
        yield from super().prefill_chunks(prompt)


@pytest.mark.parametrize("method", ["resident", "leansparse"])
def test_chunked_prefill_with_prefix_reuse_and_streamed_layers(params, method):
    """Chunked mode (32-token chunks, one per iteration) with prefix reuse on a layer-streamed
    engine: a session's first call is prefilled in streamed chunks beside the decode steps
    (the state on the host between chunks, admitted layer by layer), its continuations are
    admitted whole from their prefix; every call's greedy tokens equal serving the same calls
    whole-prompt without reuse on a monolithic engine."""
    from lsparse_jax.config import LeanSparseConfig
    from lsparse_jax.methods.leansparse import calibrate_codebooks

    kw = dict(sessions=3, calls=3, first_prompt_tokens=(60, 90), turn_tokens=(4, 8),
              output_tokens=(3, 5), vocab=CFG.vocab_size, max_len=128, session_rate=20.0,
              tool_wait_s=0.05, seed=4)
    books, lean = None, {}
    if method == "leansparse":
        calib = np.random.default_rng(9).integers(0, 256, 128).astype(np.int32)
        books = calibrate_codebooks(params, CFG, calib, iters=4)
        lean = dict(key_cache_rows=16)

    def engine(cls, streamed):
        cfg = EngineConfig(model=CFG, method=method, sampling=SamplingConfig(0.0),
                           leansparse=LeanSparseConfig(num_candidates=16, **lean),
                           cache=CacheConfig(num_slots=2, prefill_chunk=32,
                                             streamed_prefill=streamed,
                                             **({} if method == "resident" else
                                                dict(hot_cache_rows=16, page_size=8))))
        return cls(cfg, params, books)

    streamed = engine(ChunkCountingEngine, True)
    sched = Scheduler(streamed, clock=Clock(step_s=0.01, prefill_token_s=1e-4),
                      workload=MultiTurn(**kw), prefix_reuse=True, prefill_token_budget=32)
    sched.run()
    done = {r.id: r for r in sched.finished}
    assert len(done) == 9 and not sched.prefixes
    chunked = [n for op, n in streamed.calls if op == "chunks"]
    assert sorted(chunked) == sorted(len(r.prompt) for r in done.values() if r.turn == 0)
    assert {i for op, i in streamed.calls if op == "admit_prefix"} == {
        i for i, r in done.items() if r.turn > 0}
    assert any(t["active"] and t["prefilling"] for t in sched.trace)  # decode beside chunks
    plain = Scheduler(engine(Engine, False), clock=Clock(step_s=0.01), workload=MultiTurn(**kw))
    plain.run()
    assert {r.id: r.tokens for r in plain.finished} == {i: r.tokens for i, r in done.items()}
    prompt = np.arange(40, dtype=np.int32)
    *_, (streamed_prefix, _) = streamed.prefill_chunks(prompt)
    with pytest.raises(ValueError, match="holds 40 tokens; the prompt has 41"):
        streamed.admit(Request(np.arange(41, dtype=np.int32), 2), prefilled=streamed_prefix)


@pytest.mark.slow
def test_prefixes_are_evicted_for_host_pages_and_tokens_do_not_change(params):
    """hisparse with 3 host pages of 8 rows and one slot: three sessions' held prefixes and
    the running call do not fit together, so admissions evict the oldest other session's
    prefix (that session's next call prefills its whole prompt) instead of waiting forever;
    every call's greedy tokens equal those served without reuse."""
    kw = dict(sessions=3, calls=3, first_prompt_tokens=(36, 40), turn_tokens=(4, 6),
              output_tokens=(3, 4), vocab=CFG.vocab_size, max_len=128, session_rate=1000.0,
              tool_wait_s=1.0, seed=5)  # first calls at once, next calls after all of them

    def run(reuse):
        engine = Engine(EngineConfig(model=CFG, method="hisparse", sampling=SamplingConfig(0.0),
                                     cache=CacheConfig(num_slots=1, prefill_chunk=32,
                                                       hot_cache_rows=16, page_size=8,
                                                       host_pages=3)), params)
        sched = Scheduler(engine, clock=Clock(step_s=0.01), workload=MultiTurn(**kw),
                          prefix_reuse=reuse)
        sched.run()
        assert engine.control.pages.free + sum(len(p.pages) for p in
                                               sched.prefixes.values()) == 3
        return sched

    reused, plain = run(True), run(False)
    assert reused.prefix_drops > 0 and reused.reused_tokens > 0
    assert len(reused.finished) == 9
    assert {r.id: r.tokens for r in reused.finished} == {r.id: r.tokens
                                                          for r in plain.finished}


def test_repeat_inputs_draws_and_errors():
    """repeat 1 keeps every slot's input, repeat 0 draws fresh tokens; seeded; bad args raise."""
    from lsparse_jax.serving.workloads import RepeatInputs

    start = np.array([3, 9, 200], np.int32)
    keep = RepeatInputs(1.0, 256)
    assert all(np.array_equal(keep(start), start) for _ in range(5))
    a, b = RepeatInputs(0.0, 256, seed=4), RepeatInputs(0.0, 256, seed=4)
    draws = np.stack([a(start) for _ in range(50)])
    assert np.array_equal(draws, np.stack([b(start) for _ in range(50)]))
    assert draws.min() >= 0 and draws.max() < 256 and len(np.unique(draws)) > 100
    half = RepeatInputs(0.5, 256, seed=1)
    seq = np.stack([half(start) for _ in range(400)])
    same = np.mean(seq[1:] == seq[:-1])
    assert 0.4 < same < 0.6  # repeats (plus 1/256 chance agreements)
    for bad in (dict(repeat=1.5, vocab=8), dict(repeat=0.5, vocab=0)):
        with pytest.raises(ValueError):
            RepeatInputs(**bad)
    # fresh slots (a new request since the last call) repeat their own start token
    keep(start)
    later = np.array([7, 8, 9], np.int32)
    assert np.array_equal(keep(later, fresh=np.array([False, True, False])), [3, 8, 200])
    assert np.array_equal(keep(later), [3, 8, 200])
    with pytest.raises(ValueError, match="fresh"):
        keep(later, fresh=np.array([True]))


@pytest.mark.slow  # ~16 s of compiles on 2 CPU cores
def test_repeat_inputs_raise_selection_reuse():
    """Through the engine (hisparse, 450-token context): repeating inputs makes each step's
    selection repeat the previous one's far more often than fresh random inputs do."""
    from lsparse_jax.serving.workloads import RepeatInputs

    cfg = tiny(max_len=480)
    params = model_and_tokens(cfg, 1, seed=3)[0]
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 450).astype(np.int32)
    reuse = {}
    for repeat in (0.0, 1.0):
        engine = Engine(EngineConfig(model=cfg, method="hisparse", cache=CacheConfig(
            num_slots=2, prefill_chunk=256, hot_cache_rows=64, page_size=8)), params)
        engine.admit(prompt, 14)
        engine.admit(prompt[:400], 14)
        inputs = RepeatInputs(repeat, cfg.vocab_size, seed=2)
        for _ in range(10):
            engine.step(tokens=inputs(engine.next_token))
        reuse[repeat] = engine.metrics()["selection"]["reuse_fraction"]
    assert reuse[1.0] > reuse[0.0] + 0.3, reuse
