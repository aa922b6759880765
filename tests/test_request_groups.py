"""LeanSparse request groups: the grouped decode step equals the ungrouped one bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig
from lsparse_jax.memory.hot_cache import HotCache
from lsparse_jax.memory.key_store import KeyPageView, PagedKeys
from lsparse_jax.methods.leansparse import CoarseToFineIndex
from lsparse_jax.model.store import IndexerQuery
from lsparse_jax.request_groups import grouped, on_stream
from tests.helpers import tiny

# S slots, N history rows, P page rows, H heads, D key dim, M subspaces, C candidates,
# Bk key-cache rows, k top-k, K centroids
S, N, P, H, D, M, C, BK, K, KC = 4, 256, 8, 2, 16, 4, 48, 64, 16, 16


def random_slots(seed: int):
    """Every slot's key state (tail, a partly filled key cache, PQ codes), its query, and the
    shared host pool / codebooks / page tables of S slots at different lengths."""
    rng = np.random.default_rng(seed)
    completed = rng.integers(P * 4, N - P, S).astype(np.int32)
    pool_values = rng.normal(size=(N * S, D)).astype(jnp.float8_e4m3fn)
    pool_scales = rng.uniform(0.5, 2.0, (N * S, 1)).astype(np.float32)
    tables = rng.permutation(N * S // P).reshape(S, N // P).astype(np.int32)
    keys = []
    for s in range(S):
        state = PagedKeys.empty(P, BK, N, D, 1, M)
        held = rng.choice(completed[s] // P * P, BK // 2, replace=False).astype(np.int32)
        rows = np.concatenate([held, np.full(BK - held.size, -1, np.int32)])
        values = np.where(rows[:, None] >= 0, rng.normal(size=(BK, D)), np.nan)
        cache = HotCache(rows=(jnp.asarray(values, jnp.float8_e4m3fn),
                               jnp.asarray(np.where(rows[:, None] >= 0, 1.0, np.nan),
                                           jnp.float32)),
                         positions=jnp.asarray(rows),
                         stamps=jnp.asarray(np.where(rows >= 0, np.arange(BK), -1), jnp.int32),
                         clock=jnp.asarray(3, jnp.int32))
        tail = (jnp.asarray(rng.normal(size=(P, D)), jnp.float8_e4m3fn),
                jnp.asarray(rng.uniform(0.5, 2.0, (P, 1)), jnp.float32))
        codes = jnp.asarray(rng.integers(0, KC, (N, M)), jnp.uint8)
        keys.append(state.replace(tail=tail, cache=cache, codes=codes))
    state = jax.tree.map(lambda *x: jnp.stack(x), *keys)
    query = IndexerQuery(jnp.asarray(rng.normal(size=(S, 1, H, D)), jnp.float32),
                         jnp.asarray(rng.uniform(0.1, 1.0, (S, 1, H)), jnp.float32))
    eligible = jnp.asarray(np.arange(N)[None, None, :] < completed[:, None, None] + 3)
    books = jnp.asarray(rng.normal(size=(M, KC, D // M)), jnp.float32)
    return (state, jnp.asarray(completed), query, eligible, jnp.asarray(tables),
            (jnp.asarray(pool_values), jnp.asarray(pool_scales)), books)


@functools.partial(jax.jit, static_argnames=("index",))
def select_all(index, state, completed, query, eligible, tables, pool, books):
    def one(st, c, q, e, t):
        return index.select(st, c, q, e, KeyPageView(pool, t, books))

    return jax.vmap(one)(state, completed, query, eligible, tables)


@functools.cache
def selections(groups: int, stream: int | None = 1):
    """Two steps of the selection of the slots of ``random_slots(0)`` (the second reads the
    key cache the first one filled): (final key state, [step selections]) as numpy."""
    args = random_slots(0)
    lean = LeanSparseConfig(C, 1.0, BK, pq_subspace_dim=D // M, groups=groups,
                            fetch_stream=stream)
    index = CoarseToFineIndex(lean, K, P, M, "xla")
    state, outs = args[0], []
    for _ in range(2):
        state, sel = select_all(index, state, *args[1:])
        outs.append(sel)
    return jax.tree.map(np.asarray, (state, outs))


def assert_same(want, got):
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("groups,stream", [
    (2, 1),
    pytest.param(4, 1, marks=pytest.mark.slow),
    pytest.param(2, None, marks=pytest.mark.slow),
])
def test_grouped_selection_equals_one_batch_bit_for_bit(groups, stream):
    """The coarse-to-fine selection of S = 4 slots (coarse top-C, miss filter, key fetch into
    the key cache, exact rerank) as request groups, the key fetch on GPU stream 1 (ignored
    on CPU) or on the main stream: positions, eligible counts, key sources and the new key
    cache equal the one-batch selection's bit for bit, over two steps."""
    want = selections(1)
    assert (want[1][0].key_sources[..., 2] > 0).all()  # every slot fetched keys from host
    assert_same(want, selections(groups, stream))


def test_grouped_rejects_a_batch_it_does_not_divide():
    fn = grouped(lambda x, shared: x * shared, 3)
    np.testing.assert_array_equal(jax.vmap(fn, in_axes=(0, None))(jnp.arange(6.0), 2.0),
                                  np.arange(6.0) * 2)
    assert float(fn(jnp.asarray(2.0), 3.0)) == 6.0  # outside a vmap: fn itself
    with pytest.raises(ValueError, match="groups=3 must divide the batch \\(4 requests\\)"):
        jax.vmap(fn, in_axes=(0, None))(jnp.arange(4.0), 2.0)
    with pytest.raises(ValueError, match="groups must be a positive int"):
        grouped(lambda x: x, 0)
    with pytest.raises(ValueError, match="stream must be an int >= 1"):
        on_stream(lambda x: x, 0)


def test_config_rejects_groups_not_dividing_the_slots():
    cfg = tiny(max_len=128)
    with pytest.raises(ValueError, match="leansparse.groups=3 is invalid: must divide "
                                         "cache.num_slots=4"):
        EngineConfig(model=cfg, cache=CacheConfig(4, 32, 16, 8), method="leansparse",
                     leansparse=LeanSparseConfig(32, 1.0, 48, groups=3))
    with pytest.raises(ValueError, match="LeanSparseConfig.groups=0 is invalid"):
        LeanSparseConfig(groups=0)
    with pytest.raises(ValueError, match="LeanSparseConfig.fetch_stream=0 is invalid"):
        LeanSparseConfig(fetch_stream=0)


@functools.cache
def engine_run(groups: int):
    """A leansparse engine of 4 slots as ``groups`` request groups: 3 requests, a 4th joins
    at step 4, slot 1 leaves at step 8; per-step outputs and the final statistics."""
    from tests.test_leansparse import make  # the tiny model and its codebooks

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (77, 141, 50, 99)]
    engine = make("leansparse", LeanSparseConfig(32, 1.0, 48, groups=groups), slots=4)
    for p in prompts[:3]:
        engine.admit(p, max_new_tokens=30)
    steps = []
    for step in range(12):
        if step == 4:
            engine.admit(prompts[3], max_new_tokens=30)
        if step == 8:
            engine.release(1)
        out = engine.step()
        steps.append(jax.tree.map(np.asarray, (out.tokens, out.logits, out.selected,
                                               out.eligible, out.sources, out.key_sources)))
    return steps, jax.tree.map(np.asarray, engine.stats), engine.metrics()["selection"]


@pytest.mark.slow
@pytest.mark.parametrize("groups", [2, 4])
def test_engine_with_request_groups_equals_one_group(groups):
    """The engine's decode step with 2 and 4 request groups: the same tokens, logits,
    selections, sources and statistics as with one group, bit for bit, as requests join and
    leave."""
    want, got = engine_run(1), engine_run(groups)
    assert want[2]["host_key_rows"] > 0  # keys were fetched from the host
    assert_same(want[:2], got[:2])
    assert want[2] == got[2]


def test_grouped_selection_lowers_for_cuda_with_async_key_fetches():
    """On a GPU the grouped selection (Triton kernels) has one async call per group on stream
    1 (``_xla_stream_annotation``, not inlineable), each running the Triton ``hot_resolve``
    of that group's key fetch; one group has none. Lowered for CUDA on this CPU machine."""
    import re

    from pallas_kernels import common

    s = jax.ShapeDtypeStruct

    def lowered(groups):
        lean = LeanSparseConfig(C, 1.0, BK, pq_subspace_dim=D // M, groups=groups)
        index = CoarseToFineIndex(lean, K, P, M, "triton")
        state = jax.tree.map(lambda x: s((S,) + x.shape, x.dtype),
                             PagedKeys.empty(P, BK, N, D, 1, M))

        def fn(st, completed, q, w, elig, table, books, pool):
            def one(st, c, q, w, e, t):
                return index.select(st, c, IndexerQuery(q, w), e, KeyPageView(pool, t, books))

            return jax.vmap(one)(st, completed, q, w, elig, table)

        return common.lower_for_cuda(
            fn, state, s((S,), jnp.int32), s((S, 1, H, D), jnp.float32),
            s((S, 1, H), jnp.float32), s((S, 1, N), jnp.bool_), s((S, N // P), jnp.int32),
            s((M, KC, D // M), jnp.float32),
            (s((N * S, D), jnp.float8_e4m3fn), s((N * S, 1), jnp.float32)))

    calls = lambda text: re.findall(  # noqa: E731
        r"call @(compute_on\w*)\(.*_xla_stream_annotation = \"1\", inlineable = \"false\"",
        text)
    assert calls(lowered(1)) == []
    text = lowered(2)
    assert len(calls(text)) == 2
    for name in calls(text):
        body = text[text.index(f"func.func private @{name}("):]
        body = body[:body.index("\n  }")]
        # the key fetch: hot_resolve's Triton kernels (api.TRITON_RUNS) inside the async call
        assert common.TRITON_CALL_TARGET in body and "hot_resolve" in body
        # and no call nested in it (request_groups.inlined): XLA's GPU stream assignment
        # does not reach an annotated call inside another (session 19's NOT_FOUND error)
        assert re.findall(r"(?<![\w.])call @\w+", body) == []  # (custom calls are kernels)


def test_inlined_leaves_no_nested_call_and_the_same_values():
    """request_groups.inlined: a function whose nested jitted calls (jnp.where, jnp.clip, a
    user jit) sit at the top, inside a fori_loop and inside a cond evaluates to the same bits
    with no call equation left at any depth."""
    from lsparse_jax.request_groups import CALL_PRIMITIVES, inlined

    @jax.jit
    def inner(x):
        return jnp.clip(jnp.where(x > 0, x, -x), 0.1, 2.0)

    def fn(x, n):
        y = jax.lax.fori_loop(0, 3, lambda i, y: inner(y) * 1.5 + i, x)
        y = jax.lax.cond(n > 2, lambda y: inner(y), lambda y: y - 1.0, y)
        return {"y": y, "s": jnp.sum(inner(x))}

    def calls(jaxpr):
        found = 0
        for eqn in jaxpr.eqns:
            found += eqn.primitive.name in CALL_PRIMITIVES
            for v in eqn.params.values():
                for j in (v if isinstance(v, tuple) else (v,)):
                    if isinstance(j, jax.extend.core.ClosedJaxpr):
                        found += calls(j.jaxpr)
        return found

    x = jnp.asarray(np.random.default_rng(0).normal(size=(5,)), jnp.float32)
    for n in (1, 3):
        want, got = fn(x, n), jax.jit(inlined(fn))(x, n)
        for key in want:
            np.testing.assert_array_equal(np.asarray(want[key]), np.asarray(got[key]))
    assert calls(jax.make_jaxpr(fn)(x, 3).jaxpr) > 0
    assert calls(jax.make_jaxpr(inlined(fn))(x, 3).jaxpr) == 0
