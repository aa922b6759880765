"""Mixed iterations (Sarathi-style, ``serving.mixed``): one jitted program runs the decode step
and a prefill chunk with their norm + MLP and LM head over the concatenated rows. Its decode
outputs equal ``decode_step``'s and its chunk's logits and caches ``forward_chunk``'s bit for
bit; the scheduler's mixed iterations give every request the tokens of the unmixed schedule
and of serving it alone; the engines it cannot serve are refused."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig, SamplingConfig
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.mixed import mixed_step
from lsparse_jax.serving.scheduler import Clock, Scheduler
from lsparse_jax.serving.steps import decode_step, forward_chunk
from tests.helpers import PATTERNS, model_and_tokens, tiny
from tests.test_scheduler import alone, fresh, make_engine, serve, workload

LEAN = LeanSparseConfig(num_candidates=32, miss_filter_offset=1.0, key_cache_rows=48)


def dsa_engine():
    """A resident engine of the DSA model with index sharing (members follow their leader)."""
    cfg = tiny(max_len=128, **PATTERNS["dsa_shared"])
    params, _ = model_and_tokens(cfg, 1, seed=3)
    engine = Engine(EngineConfig(model=cfg, sampling=SamplingConfig(0.0),
                                 cache=CacheConfig(num_slots=3, prefill_chunk=32)), params)
    engine.warmup()
    return engine


@functools.cache  # one engine per method for the module (each test leaves it idle)
def engine_for(name):
    if name == "dsa_shared":
        return dsa_engine()
    if name == "adaptive":
        return make_engine(name, page_size=4, optional_pages=4, refill_pages=2)
    if name == "echo":
        return make_engine(name, shared_pool_rows=64)
    return make_engine(name, lean=LEAN if name == "leansparse" else None)


def as_numpy(leaf):
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def assert_trees_equal(want, got, what):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got),
                            strict=True):
        np.testing.assert_array_equal(as_numpy(a), as_numpy(b),
                                      err_msg=f"{what}{jax.tree_util.keystr(path)}")


# resident and hisparse: slow tier since session 49 (leansparse runs the most of the mixed step)
@pytest.mark.parametrize("name", ["leansparse", *[pytest.param(n, marks=pytest.mark.slow) for n in (
    "resident", "hisparse", "echo", "adaptive", "dsa_shared")]])
def test_mixed_step_equals_decode_step_and_forward_chunk(name):
    """Two of three slots decoding (one idle) beside a prompt's second chunk (partial): the
    state, DecodeOutput (logits, tokens, selections, sources), chunk logits and caches equal
    the separate programs' bit for bit."""
    engine = engine_for(name)
    for r in workload(2, seed=4):
        engine.admit(r)
    for _ in range(3):
        engine.step()
    chunks = engine.prefill_chunks(np.random.default_rng(5).integers(0, 256, 50, np.int32))
    next(chunks)
    tokens, start, valid = chunks.pending()
    feed, active = jnp.asarray(engine.next_token), jnp.asarray(engine.active)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731 (the steps donate the state)
    want_state, want = decode_step(engine.params, engine.config, copy(engine.state), feed,
                                   active)
    want_chunk = forward_chunk(engine.params, engine.config.model, chunks.caches, tokens, start,
                               valid, implementation=engine.config.implementation)[:2]
    # inputs committed as Engine.step commits them: the scheduler tests reuse the compilation
    args = jax.device_put((feed, active, chunks.caches, tokens), engine.state.lengths.sharding)
    got_state, got, got_chunk = mixed_step(engine.params, engine.config, copy(engine.state),
                                           *args, start, valid)
    assert_trees_equal(want, got, "decode output")
    assert_trees_equal(want_state, got_state, "state")
    assert_trees_equal(want_chunk, got_chunk, "chunk")
    for slot in np.flatnonzero(engine.active):
        engine.release(slot)


@pytest.mark.parametrize("name,budget", [("resident", 32), ("resident", 64),
                                         ("leansparse", 32)])
def test_mixed_iterations_give_the_tokens_of_unmixed_and_alone(name, budget):
    """Chunked prefill at one and two chunks per iteration: with ``mixed`` one chunk of each
    iteration with decoding requests runs inside the step; every request's greedy tokens
    equal the unmixed schedule's and those it gets served alone."""
    engine = engine_for(name)
    requests = workload(4, seed=7, arrivals=[0.0, 0.0, 0.01, 0.02])
    runs = {}
    for mixed in (False, True):
        reqs = [fresh(r) for r in requests]
        sched = serve(engine, reqs, prefill_token_budget=budget, mixed=mixed,
                      clock=Clock(step_s=0.01, prefill_token_s=1e-4))
        runs[mixed] = {r.id: r.tokens for r in reqs}
        assert sched.summary()["mixed_iterations"] == sum(t["mixed"] for t in sched.trace)
        assert (sched.mixed_iterations > 0) == mixed
    assert runs[True] == runs[False]
    for r in requests[:2]:
        assert runs[True][r.id] == alone(engine, r), r.id


def test_mixed_with_overlap_equals_unmixed():
    """The same with each step launched before the previous one is read."""
    requests = workload(4, seed=8, arrivals=[0.0, 0.0, 0.01, 0.02])
    runs = {}
    for mixed in (False, True):
        reqs = [fresh(r) for r in requests]
        sched = serve(engine_for("resident"), reqs, prefill_token_budget=32, mixed=mixed,
                      overlap=True)
        runs[mixed] = [r.tokens for r in reqs]
        assert (sched.mixed_iterations > 0) == mixed
    assert runs[True] == runs[False]


def test_mixed_refuses_what_it_cannot_serve():
    from lsparse_jax.config import DrafterConfig
    from lsparse_jax.model.drafter import init_drafter
    from lsparse_jax.serving.speculative import SpecEngine

    resident = engine_for("resident")
    with pytest.raises(ValueError, match="set prefill_token_budget"):
        Scheduler(resident, mixed=True)
    cfg = resident.config
    dcfg = DrafterConfig(gamma=2, window=16, target_layers=(1, 3), num_heads=2, head_dim=16,
                         mlp_hidden=64)
    spec = SpecEngine(cfg, resident.params, (init_drafter(cfg.model, dcfg, 1), dcfg))
    with pytest.raises(ValueError, match="SpecEngine runs its own step"):
        Scheduler(spec, prefill_token_budget=32, mixed=True)
    streamed = Engine(dataclasses.replace(cfg, cache=dataclasses.replace(
        cfg.cache, streamed_prefill=True)), resident.params)
    with pytest.raises(ValueError, match="streamed_prefill"):
        Scheduler(streamed, prefill_token_budget=32, mixed=True)
    split = object.__new__(Engine)  # a tp = 2 engine needs two devices: its config suffices
    split.config = dataclasses.replace(cfg, tp=2)
    with pytest.raises(ValueError, match="tp=2"):
        Scheduler(split, prefill_token_budget=32, mixed=True)
