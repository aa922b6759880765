"""hot_resolve (pallas_kernels/hot_resolve) against a plain-Python LRU model and the reference.

Notation: S requests (vmapped), k selected positions (-1 = nothing), B hot rows, D values per
row, P rows per host page, MP logical pages per request, NP physical pages in the shared pool.

Each case runs a seeded sequence of steps on S requests under ``jax.vmap`` (pool shared,
in_axes=None), starting from a partly filled hot cache with scattered stamps. After every step:
slots, positions, stamps and (hits, misses) equal the model's exactly; no slot twice; every
selected position is resident with its host row, bit for bit (FP8 and NaN payloads included);
rows never touched keep their bytes, empty rows stay NaN; every kernel implementation equals
"xla" bit for bit. "triton" (the decode steps' switch) runs ``api.TRITON_RUNS``.
Pool rows no request maps and empty hot rows are NaN, so a stray read shows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.memory import HotCache, empty_pool, resolve
from lsparse_jax.memory.host_pool import write_host_page
from pallas_kernels import common
from pallas_kernels.hot_resolve import api as hot_api
from pallas_kernels.hot_resolve import hot_resolve, packed
from tests.helpers import assert_resolved_rows

IMPLS = ["xla", "triton_copy"]
FUSED = "triton_fused"
FUSED2 = "triton_fused2"  # the same kernels in two launches (block barriers between steps)
HOST = jax.memory.Space.Host  # pinned_host


class LRUModel:
    """Plain-Python hot cache of one request: the slot rule of the contract, row by row."""

    def __init__(self, positions, stamps, clock):
        self.pos, self.stamps, self.clock = list(positions), list(stamps), int(clock)

    def step(self, selected):
        k, b = len(selected), len(self.pos)
        slots, hit_rows, misses = [-1] * k, set(), []
        row_of = {p: i for i, p in enumerate(self.pos) if p >= 0}  # positions are distinct
        for j, p in enumerate(selected):
            if p < 0:
                continue
            if p in row_of:
                slots[j] = row_of[p]
                hit_rows.add(row_of[p])
            else:
                misses.append(j)
        lru = sorted((i for i in range(b) if i not in hit_rows),
                     key=lambda i: (self.stamps[i], i))  # empty rows (-1) first
        victims = sorted(lru[:len(misses)])  # the M least recently used, in row order
        for m, j in enumerate(misses):
            slots[j] = victims[m]
            self.pos[victims[m]] = int(selected[j])
        for j, s in enumerate(slots):
            if s >= 0:
                self.stamps[s] = self.clock * k + j
        self.clock += 1
        return slots, (len(hit_rows), len(misses))


def _nan(dtype):
    return np.float32(np.nan).astype(jnp.dtype(dtype))


def _rows(rng, shape, dtype):
    return (rng.standard_normal(shape, np.float32) * 4).astype(jnp.dtype(dtype))


class World:
    """S requests, each with MP logical pages mapped to distinct physical pages of one shared
    pool; unmapped pool pages and empty hot rows are NaN. Leaves: a list of (D, dtype)."""

    def __init__(self, seed, s, b, k, leaves, page=4, mp=6, spare=3, clock=5):
        rng = self.rng = np.random.default_rng(seed)
        self.s, self.b, self.k, self.page, self.mp = s, b, k, page, mp
        n_phys = s * mp + spare
        perm = rng.permutation(n_phys).astype(np.int32)
        self.table = perm[:s * mp].reshape(s, mp)  # [S, MP]
        self.pool = [np.full((n_phys * page, d), _nan(dt)) for d, dt in leaves]
        for leaf, (d, dt) in zip(self.pool, leaves):
            for phys in self.table.reshape(-1):
                leaf[phys * page:(phys + 1) * page] = _rows(rng, (page, d), dt)
        self.rows = [np.full((s, b, d), _nan(dt)) for d, dt in leaves]
        self.positions = np.full((s, b), -1, np.int32)
        self.stamps = np.full((s, b), -1, np.int32)
        self.clock = np.full((s,), clock, np.int32)
        universe = mp * page
        for r in range(s):  # a partly filled cache with scattered stamps
            held = rng.choice(b, size=b // 2, replace=False)
            self.positions[r, held] = rng.choice(universe, size=held.size, replace=False)
            self.stamps[r, held] = rng.choice(clock * k, size=held.size, replace=False)
            for i in held:
                for j, leaf in enumerate(self.rows):
                    leaf[r, i] = self.truth(j, r, self.positions[r, i])

    def truth(self, leaf, request, p):
        phys = self.table[request, p // self.page]
        return self.pool[leaf][phys * self.page + p % self.page]

    def selection(self, step):
        """k distinct positions per request from a drifting window (so rows get reused), 25%
        replaced by -1."""
        universe = self.mp * self.page
        out = np.full((self.s, self.k), -1, np.int32)
        for r in range(self.s):
            lo = (step * 3 + r * 5) % universe
            window = (lo + np.arange(2 * self.k)) % universe
            out[r] = self.rng.choice(window, size=self.k, replace=False)
        out[self.rng.random(out.shape) < 0.25] = -1
        return out

    def device_args(self, pytree):
        """pytree: False (one leaf), True (a tuple of leaves) or "packed" (a tuple of row
        leaves, the pool a ``PackedPool`` of them)."""
        rows = [jnp.asarray(r) for r in self.rows]
        pool = [jax.device_put(p, HOST) for p in self.pool]
        if not pytree:
            rows, pool = rows[0], pool[0]
        else:
            rows, pool = tuple(rows), tuple(pool)
        if pytree == "packed":
            layout, treedef = packed.layout_of(rows)
            pool = packed.PackedPool(jax.device_put(packed.pack(self.pool), HOST), layout,
                                     treedef)
        return (rows, jnp.asarray(self.positions), jnp.asarray(self.stamps),
                jnp.asarray(self.clock), jnp.asarray(self.table), pool)


@functools.lru_cache(maxsize=None)
def _step_fn(impl, page):
    def one(sel, rows, pos, stamps, clock, table, pool):
        return hot_resolve(sel, rows, pos, stamps, clock, table, pool, page_size=page,
                           implementation=impl)

    return jax.jit(jax.vmap(one, in_axes=(0, 0, 0, 0, 0, 0, None)))


def _bytes(x):
    return np.asarray(x).tobytes()


def _check_step(world, models, step, sel, before, out, want):
    """One implementation's outputs of one step against the (already stepped) models."""
    slots, rows, pos, stamps, clock, counts = (np.asarray(x) if not isinstance(x, tuple)
                                               else x for x in out)
    leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(rows)]
    for r, model in enumerate(models):
        want_slots, want_counts = want[r]
        assert slots[r].tolist() == want_slots, f"step {step} request {r}"
        assert tuple(counts[r]) == want_counts
        assert (pos[r].tolist(), stamps[r].tolist()) == (model.pos, model.stamps)
        assert int(clock[r]) == model.clock
        used = slots[r][slots[r] >= 0]
        assert len(set(used.tolist())) == used.size, "a hot row serves two positions"
        for j, p in enumerate(sel[r]):  # every selected row resident, with its host bytes
            for li, leaf in enumerate(leaves):
                if p >= 0:
                    assert _bytes(leaf[r, slots[r][j]]) == _bytes(world.truth(li, r, p))
        for leaf, old in zip(leaves, before):  # rows not used keep their bytes; empty = NaN
            for i in sorted(set(range(world.b)) - set(used.tolist())):
                assert _bytes(leaf[r, i]) == _bytes(old[r, i]), f"row {i} changed"
                if pos[r, i] < 0:
                    assert np.isnan(leaf[r, i].astype(np.float32)).all()


def _run_case(world: World, steps: int, pytree: bool, impls=tuple(IMPLS)):
    """Steps the implementations side by side (impls[0] = "xla"); checks each against the
    model and every one against "xla" bit for bit."""
    models = [LRUModel(world.positions[r], world.stamps[r], world.clock[r])
              for r in range(world.s)]
    state = {impl: world.device_args(pytree) for impl in impls}
    totals = np.zeros(2, int)
    for step in range(steps):
        sel = world.selection(step)
        want = [model.step(sel[r]) for r, model in enumerate(models)]
        totals += np.sum([counts for _, counts in want], axis=0)
        outs = {}
        for impl in impls:
            rows, pos, stamps, clock, table, pool = state[impl]
            before = [np.asarray(leaf) for leaf in jax.tree.leaves(rows)]
            out = _step_fn(impl, world.page)(jnp.asarray(sel), rows, pos, stamps, clock,
                                             table, pool)
            assert jax.tree.leaves(pool)[0].sharding.memory_kind == "pinned_host"
            _check_step(world, models, step, sel, before, out, want)
            outs[impl] = out
            state[impl] = out[1:5] + (table, pool)
        for impl in impls[1:]:
            for a, b in zip(jax.tree.leaves(outs["xla"]), jax.tree.leaves(outs[impl])):
                assert _bytes(a) == _bytes(b), f"{impl} differs from xla"
    assert totals.min() > 0, f"the sequence needs hits and misses, got {totals}"


CASES = [  # (S, B, k, leaves)
    (3, 8, 6, [(16, "float32")]),
    (2, 12, 12, [(32, "float8_e4m3fn")]),  # k = B: every row may be taken
    (2, 8, 5, [(16, "bfloat16")]),
    (2, 8, 4, [(24, "float32")]),  # D not a power of two: the XLA row loop in "triton_copy"
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}-B{c[1]}-k{c[2]}-{c[3]}")
def test_matches_lru_model_under_vmap(case):
    s, b, k, leaves = case
    _run_case(World(seed=b * 7 + k, s=s, b=b, k=k, leaves=leaves), steps=8, pytree=False)


@pytest.mark.parametrize("case", [CASES[3]] + [
    pytest.param(c, marks=pytest.mark.slow) for c in CASES[:3]],
    ids=lambda c: f"S{c[0]}-B{c[1]}-k{c[2]}-{c[3]}")
def test_fused_matches_lru_model_under_vmap(case):
    """triton_fused (control in-kernel) against the model and xla, D=24 included (masked
    columns in the kernel, no XLA row loop)."""
    s, b, k, leaves = case
    _run_case(World(seed=b * 7 + k, s=s, b=b, k=k, leaves=leaves), steps=5, pytree=False,
              impls=("xla", FUSED))


def test_fused2_matches_lru_model_under_vmap():
    """triton_fused2 (map and control in one program a request) against the model and
    xla, k = B (every row may be taken)."""
    _run_case(World(seed=13, s=2, b=12, k=12, leaves=[(32, "float8_e4m3fn")]), steps=4,
              pytree=False, impls=("xla", FUSED2))


def test_fused_moves_e8m0_scales_bit_for_bit():
    """FP8 KV rows of ``kv_dtype="fp8_v4"``: e4m3 values [B, 16] and e8m0 scales [B, 2] (NaN
    0xFF included) from a pinned_host pool; the fused kernels move the e8m0 leaf as its uint8
    bytes: equal to the model and to "xla" bit for bit, and "triton" (the decode steps' switch)
    runs the two-launch fused kernels."""
    assert hot_api.TRITON_RUNS == FUSED2
    world = World(seed=4, s=2, b=8, k=5, leaves=[(16, "float8_e4m3fn"), (2, "float8_e8m0fnu")])
    _run_case(world, steps=2, pytree=True, impls=("xla", "triton"))


@pytest.mark.slow
def test_fused_pytree_rows_fp8_keys_and_scales():
    world = World(seed=3, s=2, b=10, k=7, leaves=[(32, "float8_e4m3fn"), (1, "float32")])
    _run_case(world, steps=4, pytree=True, impls=("xla", FUSED))


@pytest.mark.parametrize("impls", [("xla", FUSED2), ("xla", "triton_copy")])
def test_packed_pool_of_fp8_keys_and_scales(impls):
    """LeanSparse's host key rows packed (``packed.PackedPool``: 32 e4m3 values and an f32
    scale side by side in 9 words a row): every implementation equals the LRU model and
    "xla" bit for bit (NaN payloads included), the hot rows stay (values, scales)."""
    world = World(seed=8, s=2, b=10, k=7, leaves=[(32, "float8_e4m3fn"), (1, "float32")])
    _run_case(world, steps=4, pytree="packed", impls=impls)


def test_packed_rows_round_trip_bit_for_bit():
    """pack / unpack (and unpack_numpy) are inverse bitcasts for every leaf dtype the pools
    hold, NaN payloads included; a leaf that is not whole words is refused."""
    rng = np.random.default_rng(0)
    rows = (_rows(rng, (5, 16), "float8_e4m3fn"), _rows(rng, (5, 1), "float32"),
            _rows(rng, (5, 4), "bfloat16"), _rows(rng, (5, 4), "float8_e8m0fnu"))
    rows = tuple(np.where(rng.random(r.shape) < 0.2, _nan(r.dtype), r) for r in rows)
    layout, treedef = packed.layout_of(rows)
    words = packed.pack(tuple(jnp.asarray(r) for r in rows))
    assert words.shape == (5, 4 + 1 + 2 + 1) and words.dtype == jnp.uint32
    for back in (packed.unpack(words, layout, treedef),
                 packed.unpack_numpy(np.asarray(words), layout, treedef)):
        assert [_bytes(a) for a in back] == [_bytes(r) for r in rows]
        assert [np.asarray(a).dtype for a in back] == [r.dtype for r in rows]
    with pytest.raises(ValueError, match="not whole 4-byte words"):
        packed.layout_of((jnp.zeros((2, 3), jnp.bfloat16),))


def test_pytree_rows_fp8_keys_and_scales():
    """The indexer-key cache: (FP8 keys [B, 32], f32 scales [B, 1]) move with one control."""
    world = World(seed=3, s=2, b=10, k=7, leaves=[(32, "float8_e4m3fn"), (1, "float32")])
    _run_case(world, steps=6, pytree=True)


@pytest.mark.parametrize("impl", IMPLS + [pytest.param(FUSED, marks=pytest.mark.slow)])
def test_single_request_without_vmap(impl):
    """One request, eager call, k = B with all-miss then all-hit steps; a device pool."""
    world = World(seed=11, s=1, b=6, k=6, leaves=[(16, "float32")], clock=1)
    rows, pos, stamps, _, table, _ = world.device_args(False)
    rows, pos, stamps, table = rows[0], pos[0], stamps[0], table[0]
    pool = jnp.asarray(world.pool[0])
    model = LRUModel(world.positions[0], world.stamps[0], 1)
    clock = jnp.ones((), jnp.int32)
    fresh = np.array([p for p in range(world.mp * world.page) if p not in model.pos][:6],
                     np.int32)
    for sel in (fresh, fresh[::-1].copy(), np.array([-1] * 6, np.int32)):
        slots, rows, pos, stamps, clock, counts = hot_resolve(
            jnp.asarray(sel), rows, pos, stamps, clock, table, pool, page_size=world.page,
            implementation=impl)
        want_slots, want_counts = model.step(sel)
        assert np.asarray(slots).tolist() == want_slots
        assert tuple(np.asarray(counts)) == want_counts
        assert np.asarray(pos).tolist() == model.pos
        assert np.asarray(stamps).tolist() == model.stamps
        for j, p in enumerate(sel):
            if p >= 0:
                assert _bytes(np.asarray(rows)[want_slots[j]]) == _bytes(world.truth(0, 0, p))
    assert want_counts == (0, 0) and int(clock) == 4


@pytest.mark.parametrize("impl", IMPLS + [pytest.param(FUSED, marks=pytest.mark.slow)])
def test_resolve_compacts_selections_longer_than_the_cache(impl):
    """hot_cache.resolve with k > B (leansparse: C candidates + P tail rows): the non-tail
    positions (at most B) go through the op; rows, counts and the LRU order stay right."""
    page, dim, b = 4, 16, 6
    rng = np.random.default_rng(5)
    truth = rng.standard_normal((10 * page, dim)).astype(np.float32)
    perm = rng.permutation(10).astype(np.int32)
    pool = empty_pool(12, page, dim)
    for logical in range(10):
        pool = write_host_page(pool, int(perm[logical]),
                               jnp.asarray(truth[logical * page:(logical + 1) * page]))
    paged = 9 * page  # positions 36..39 are the tail
    tail = jnp.asarray(truth[paged:])
    hot = HotCache.empty(b, dim)
    order = []  # positions, least recently used first
    for step in range(6):
        sel = rng.choice(paged, size=b, replace=False).astype(np.int32)
        sel[rng.random(b) < 0.3] = -1
        sel = np.concatenate([sel, paged + rng.permutation(page).astype(np.int32)])  # k = 10
        rows, hot, counts = resolve(hot, jnp.asarray(sel), tail, paged, jnp.asarray(perm),
                                    pool, impl)
        assert_resolved_rows(rows, sel, truth)
        want = [p for p in sel if 0 <= p < paged]
        hits = sum(p in order for p in want)
        assert tuple(np.asarray(counts)) == (page, hits, len(want) - hits), f"step {step}"
        order = [p for p in order if p not in want] + want
        order = order[-b:]
        pos, stamps = np.asarray(hot.positions), np.asarray(hot.stamps)
        assert pos[pos >= 0][np.argsort(stamps[pos >= 0])].tolist() == order


def test_triton_lowers_for_cuda_under_vmap():
    """64 requests, k = 512, B = 2048, D = 512 f32, 1 GiB device-spec pool: one Triton call,
    its hot-row operand aliased to its output."""
    s = jax.ShapeDtypeStruct
    req, k, b, d, page = 64, 512, 2048, 512, 64

    def fn(sel, rows, pos, stamps, clock, table, pool):
        one = lambda *a: hot_resolve(*a, table, pool, page_size=page,  # noqa: E731
                                     implementation="triton_copy")
        return jax.vmap(one)(sel, rows, pos, stamps, clock)

    text = common.lower_for_cuda(
        fn, s((req, k), jnp.int32), s((req, b, d), jnp.float32), s((req, b), jnp.int32),
        s((req, b), jnp.int32), s((req,), jnp.int32), s((8192,), jnp.int32),
        s((1 << 19, d), jnp.float32))
    assert text.count(common.TRITON_CALL_TARGET) == 1
    call = text[text.index(common.TRITON_CALL_TARGET):]
    assert "output_operand_aliases" in call[:call.index("\n")]
    assert f"grid_x = {req * k}" in call


def test_triton_lowers_for_cuda_pytree():
    """FP8 keys [B, 128] and their f32 scales [B, 1]: both leaves through the kernel."""
    s = jax.ShapeDtypeStruct
    b, k, page = 256, 128, 64
    fn = functools.partial(hot_resolve, page_size=page, implementation="triton_copy")
    text = common.lower_for_cuda(
        fn, s((k,), jnp.int32), (s((b, 128), jnp.float8_e4m3fn), s((b, 1), jnp.float32)),
        s((b,), jnp.int32), s((b,), jnp.int32), s((), jnp.int32), s((64,), jnp.int32),
        (s((4096, 128), jnp.float8_e4m3fn), s((4096, 1), jnp.float32)))
    assert text.count(common.TRITON_CALL_TARGET) == 2


@pytest.mark.parametrize("impl, launches", [(FUSED, 3), (FUSED2, 2)])
def test_fused_lowers_for_cuda_under_vmap(impl, launches):
    """triton_fused at the benchmark shape (64 requests, k = 512, B = 2048, D = 512 f32) and a
    pytree of FP8 keys + f32 scales: three Triton calls (map, control, apply; two for
    triton_fused2: front, apply) for all requests and leaves, no XLA sort or while loop, rows /
    positions / stamps aliased."""
    s = jax.ShapeDtypeStruct
    req, k, b, d, page = 64, 512, 2048, 512, 64

    def fn(sel, rows, pos, stamps, clock, table, pool):
        one = lambda *a: hot_resolve(*a, pool, page_size=page,  # noqa: E731
                                     implementation=impl)
        return jax.vmap(one)(sel, rows, pos, stamps, clock, table)

    text = common.lower_for_cuda(
        fn, s((req, k), jnp.int32), (s((req, b, d), jnp.float32), s((req, b, 1), jnp.float32)),
        s((req, b), jnp.int32), s((req, b), jnp.int32), s((req,), jnp.int32),
        s((req, 2048), jnp.int32), (s((1 << 19, d), jnp.float32), s((1 << 19, 1), jnp.float32)))
    assert text.count(common.TRITON_CALL_TARGET) == launches
    assert "stablehlo.sort" not in text and "stablehlo.while" not in text
    call = text[text.rindex(common.TRITON_CALL_TARGET):]
    assert "output_operand_aliases" in call[:call.index("\n")]


def test_fused_lowers_for_cuda_with_a_packed_pool():
    """LeanSparse's key cache at batch 36 (k = C + P = 2112 of B = 4096 rows of (128 e4m3, 1
    f32)) from a packed host pool of 33-word rows: two Triton calls (front, apply) for all
    requests, the apply taking the one [N, 33] uint32 pool (10 operands: 7 + 2 row leaves +
    1 pool), the hot rows aliased."""
    s = jax.ShapeDtypeStruct
    req, k, b, page, n = 36, 2112, 4096, 64, 1 << 20
    rows = (s((req, b, 128), jnp.float8_e4m3fn), s((req, b, 1), jnp.float32))
    layout, treedef = packed.layout_of((s((b, 128), jnp.float8_e4m3fn), s((b, 1), jnp.float32)))
    pool = packed.PackedPool(s((n, 33), jnp.uint32), layout, treedef)

    def fn(sel, rows, pos, stamps, clock, table, pool):
        one = lambda *a: hot_resolve(*a, pool, page_size=page,  # noqa: E731
                                     implementation="triton")
        return jax.vmap(one)(sel, rows, pos, stamps, clock, table)

    text = common.lower_for_cuda(fn, s((req, k), jnp.int32), rows, s((req, b), jnp.int32),
                                 s((req, b), jnp.int32), s((req,), jnp.int32),
                                 s((req, 2048), jnp.int32), pool)
    assert text.count(common.TRITON_CALL_TARGET) == 2
    call = text[text.rindex(common.TRITON_CALL_TARGET):]
    call = call[:call.index("\n")]
    assert "output_operand_aliases" in call and "tensor<1048576x33xui32>" in call
    assert call.count("tensor<1048576x") == 1  # the pool is one operand


def test_fused_lowers_for_cuda_with_e8m0_leaf():
    """An e8m0 scale leaf beside e4m3 values: still two Triton calls for all leaves (the
    e8m0 leaf crosses them as uint8: no f8E8M0FNU operand, which Triton 3.6 rejects), no
    while loop."""
    s = jax.ShapeDtypeStruct
    b, k, page = 64, 16, 8
    fn = functools.partial(hot_resolve, page_size=page, implementation="triton")
    text = common.lower_for_cuda(
        fn, s((k,), jnp.int32), (s((b, 32), jnp.float8_e4m3fn), s((b, 2), jnp.float8_e8m0fnu)),
        s((b,), jnp.int32), s((b,), jnp.int32), s((), jnp.int32), s((16,), jnp.int32),
        (s((256, 32), jnp.float8_e4m3fn), s((256, 2), jnp.float8_e8m0fnu)))
    assert text.count(common.TRITON_CALL_TARGET) == 2  # "triton" runs triton_fused2
    assert "stablehlo.while" not in text
    calls = [ln for ln in text.splitlines() if common.TRITON_CALL_TARGET in ln]
    assert not any("f8E8M0FNU" in ln for ln in calls)


WIDE_STAMPS = np.array([-2**31, -5, -1, 0, 7, 2**30, 2**31 - 2], np.int32)


@pytest.mark.parametrize("stamps", ["tied", "wide"])
def test_fused_many_misses_and_tied_stamps_equal_xla(stamps):
    """Two requests, B = 96, k = 80: most positions miss (more victims than one warp's lanes)
    and stamps tie in groups (the LRU order falls back to the row index), or spread over the
    whole int32 range (the radix select's offsets from the smallest key wrap): every output of
    triton_fused equals the reference bit for bit."""
    rng = np.random.default_rng(2)
    s, b, k, d, page, mp = 2, 96, 80, 8, 4, 64
    table = np.stack([rng.permutation(s * mp)[:mp] for _ in range(s)]).astype(np.int32)
    pool = jnp.asarray(rng.standard_normal((s * mp * page, d)).astype(np.float32))
    pos = np.stack([rng.choice(mp * page, b, replace=False) for _ in range(s)]).astype(np.int32)
    pos[:, ::7] = -1
    stamps = (rng.integers(-1, 6, (s, b)) if stamps == "tied"
              else rng.choice(WIDE_STAMPS, (s, b))).astype(np.int32)
    sel = np.stack([rng.choice(mp * page, k, replace=False) for _ in range(s)]).astype(np.int32)
    sel[:, ::9] = -1
    args = (jnp.asarray(sel), jnp.asarray(rng.standard_normal((s, b, d)).astype(np.float32)),
            jnp.asarray(pos), jnp.asarray(stamps), jnp.full((s,), 3, jnp.int32),
            jnp.asarray(table))
    outs = {impl: _step_fn(impl, page)(*args, pool) for impl in ("xla", FUSED, FUSED2)}
    counts = np.asarray(outs["xla"][5])
    assert (counts[:, 1] > 40).all() and (counts[:, 0] > 0).all(), counts
    for impl in (FUSED, FUSED2):
        for a, c in zip(jax.tree.leaves(outs["xla"]), jax.tree.leaves(outs[impl])):
            assert _bytes(a) == _bytes(c), impl
    one = hot_resolve(*(x[1] for x in args), pool, page_size=page,  # no vmap: S = 1
                      implementation="triton_fused")
    for a, c in zip(jax.tree.leaves(outs["xla"]), jax.tree.leaves(one)):
        assert _bytes(np.asarray(a)[1]) == _bytes(c)


def _good():
    b, d, page = 4, 16, 2
    return dict(selected=np.array([0, 3], np.int32), hot_rows=np.zeros((b, d), np.float32),
                hot_positions=np.full(b, -1, np.int32), hot_stamps=np.full(b, -1, np.int32),
                clock=np.zeros((), np.int32), page_table=np.arange(3, dtype=np.int32),
                pool=np.zeros((6, d), np.float32)), page


@pytest.mark.parametrize("arg, value", [
    ("selected", np.zeros((2, 1), np.int32)),
    ("selected", np.zeros(2, np.int64)),
    ("selected", np.zeros(5, np.int32)),  # k > B
    ("hot_stamps", np.zeros(3, np.int32)),
    ("clock", np.zeros(1, np.int32)),
    ("page_table", np.zeros(3, np.float32)),
    ("hot_rows", np.zeros((4, 16), np.float16)),
    ("hot_rows", np.zeros((3, 16), np.float32)),
    ("pool", np.zeros((6, 8), np.float32)),
    ("pool", np.zeros((5, 16), np.float32)),  # not whole pages
    ("pool", np.zeros((6, 16), jnp.float8_e4m3fn)),
    ("pool", (np.zeros((6, 16), np.float32),)),
])
def test_bad_inputs_name_the_argument(arg, value):
    kwargs, page = _good()
    hot_resolve(**kwargs, page_size=page, implementation="xla")
    kwargs[arg] = value
    with pytest.raises(ValueError, match=rf"hot_resolve: {arg}\b"):
        hot_resolve(**kwargs, page_size=page, implementation="xla")


def test_bad_page_size_implementation_and_batched_pool():
    kwargs, page = _good()
    with pytest.raises(ValueError, match="hot_resolve: page_size"):
        hot_resolve(**kwargs, page_size=0, implementation="xla")
    for bad in ("mosaic", "jax_triton", "cuda"):
        with pytest.raises(ValueError, match="hot_resolve: implementation="):
            hot_resolve(**kwargs, page_size=page, implementation=bad)
    stacked = {n: np.stack([v, v]) for n, v in kwargs.items()}
    with pytest.raises(ValueError, match="pool is shared"):
        jax.vmap(lambda *a: hot_resolve(*a, page_size=page, implementation="xla"))(
            *stacked.values())


# ---------------------------------------------------------------- GPU ----------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_gpu_pinned_host_pool_triton_equals_xla_and_model(dtype):
    """8 requests, B = 1024, k = 256, D = 512, a >= 1 GiB pinned_host pool (f32; 256 MiB FP8):
    both implementations agree bit for bit with each other and with the LRU model."""
    s, b, k, d, page = 8, 1024, 256, 512, 64
    world = World(seed=7, s=s, b=b, k=k, leaves=[(d, dtype)], page=page, mp=64,
                  spare=(1 << 30) // (page * d * 4) - s * 64)
    _run_case(world, steps=4, pytree=False, impls=("xla", "triton_copy", FUSED, FUSED2))


@pytest.mark.gpu
def test_gpu_pinned_host_fp8_v4_rows_fused_equals_xla():
    """FP8 KV rows as ``kv_dtype="fp8_v4"`` stores them (e4m3 values [B, 448], e8m0 scales
    [B, 7], bf16 rope [B, 64]) in a pinned_host pool: "triton" (the fused kernels, the e8m0
    leaf as uint8 bytes) equals "xla" and the model bit for bit on the GPU."""
    leaves = [(448, "float8_e4m3fn"), (7, "float8_e8m0fnu"), (64, "bfloat16")]
    world = World(seed=8, s=4, b=256, k=64, leaves=leaves, page=64, mp=16, spare=64)
    _run_case(world, steps=3, pytree=True, impls=("xla", "triton_copy", "triton", FUSED2))


@pytest.mark.gpu
def test_gpu_fp8_host_pool_of_3gib_fused_equals_xla():
    """fp8_v4 rows in a 3 GiB pinned_host pool (e4m3 [N, 448]: leansparse's host KV pool at
    200K tokens x 164 requests is 3.8 GB), the requests' pages spread over all of it: the fused
    kernels equal xla and the model. Before 1-byte leaves crossed the kernels as words
    (``common.as_words``) Pallas-Triton's int32 offsets wrapped past 2 GiB: an illegal address."""
    page, mp, s = 64, 16, 4
    leaves = [(448, "float8_e4m3fn"), (7, "float8_e8m0fnu"), (64, "bfloat16")]
    world = World(seed=9, s=s, b=256, k=64, leaves=leaves, page=page, mp=mp,
                  spare=(3 << 30) // (page * 448) - s * mp)
    _run_case(world, steps=2, pytree=True, impls=("xla", "triton"))


@pytest.mark.gpu
def test_gpu_packed_key_pool_fused_equals_xla():
    """LeanSparse's key rows (128 e4m3 values + an f32 scale) in a packed pinned_host pool of
    33-word rows (``packed.PackedPool``): the fused kernels read each missed row in place and
    equal "xla" and the model bit for bit on the GPU."""
    leaves = [(128, "float8_e4m3fn"), (1, "float32")]
    world = World(seed=10, s=4, b=512, k=256, leaves=leaves, page=64, mp=32, spare=256)
    _run_case(world, steps=3, pytree="packed", impls=("xla", "triton", FUSED2))
