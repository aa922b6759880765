"""sparse_attention kernels (pallas_kernels/sparse_attention) against the model's sink_attention.

Notation: S requests, H heads, D head dim, R table rows, K slots (-1 = none), W window rows.
Ground truth: ``lsparse_jax.model.attention.sink_attention`` per request with T = 1 and groups
[(window, window_mask), (table[max(slots, 0)], slots >= 0)]. Every table row no slot names and
every masked window row holds NaN poison, which must never reach an output; slots mix -1 and
duplicates; one request has no valid row (its output is exactly 0). "triton" runs in Pallas
interpret mode on CPU; the real-kernel checks at the V4-Flash shape need a GPU (``gpu`` marker).
FP8 rows (DeepSeek-V4's format, ``lsparse_jax.quant.kv_rows``) are compared with the model on
the dequantized rows; under jax.vmap the kernels must be one launch over all mapped requests.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import assert_close

from lsparse_jax.model.attention import sink_attention
from lsparse_jax.quant.kv_rows import FP8Rows, dequantize_fp8_rows, quantize_fp8_rows
from pallas_kernels import common
from pallas_kernels.sparse_attention import sparse_attention

IMPLS = ["xla", "triton"]
V4 = dict(h=64, d=512, r=2048, k=512, w=128, dtype="bfloat16")  # V4-Flash CSA decode


def _inputs(s, h, d, r, k, w, dtype="float32", empty=1, seed=0):
    """(q, table, slots, window, window_mask, sink); request ``empty`` has no valid row."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    q = (rng.standard_normal((s, h, d), np.float32) * 2).astype(dt)
    table = rng.standard_normal((s, r, d), np.float32).astype(dt)
    slots = rng.integers(0, r, (s, k)).astype(np.int32)
    slots[rng.random((s, k)) < 0.25] = -1
    if k >= 2:
        slots[:, 1] = slots[:, 0]  # duplicates (or a pair of -1)
    window = rng.standard_normal((s, w, d), np.float32).astype(dt)
    window_mask = rng.random((s, w)) < 0.7
    if empty is not None and empty < s:
        slots[empty] = -1
        window_mask[empty] = False
    sink = rng.uniform(-3, 3, h).astype(np.float32)
    sink[0] = 12.0  # a head whose sink dominates
    named = np.zeros((s, r), bool)
    for i in range(s):
        named[i, slots[i][slots[i] >= 0]] = True
    table[~named] = np.nan  # poison: rows no slot names
    window[~window_mask] = np.nan  # poison: masked window rows
    return q, table, slots, window, window_mask, sink


@jax.jit
def _model(q, table, slots, window, window_mask, sink):
    """sink_attention per request: T = 1, groups [(window, mask), (table[slots], slots >= 0)]."""
    def one(q1, table1, slots1, window1, mask1):
        groups = [(window1[None], mask1[None]),
                  (table1[jnp.maximum(slots1, 0)][None], (slots1 >= 0)[None])]
        return sink_attention(q1[None], groups, sink)[0]

    return jax.vmap(one)(q, table, slots, window, window_mask)


def _truth(*args):
    return np.asarray(_model(*map(jnp.asarray, args)))


def _check(got, args, tol, empty=1):
    got = np.asarray(got)
    q = args[0]
    assert got.shape == q.shape and got.dtype == np.float32
    if empty is not None and empty < q.shape[0]:
        assert np.all(got[empty] == 0.0), "a request with no valid row must return 0"
    assert_close(got, _truth(*args), tol)


def _tol(impl, dtype):
    # "xla" and the interpreted kernel compute in f32; the kernel rounds probabilities to bf16
    return "bfloat16" if impl == "triton" and dtype == "bfloat16" else "float32"


CASES = [  # (S, H, D, R, K, W, dtype)
    (3, 4, 64, 48, 40, 20, "float32"),    # K, W not multiples of the block; H padded to 16
    (3, 32, 32, 50, 45, 20, "float32"),   # two head blocks
    (2, 4, 64, 64, 16, 32, "bfloat16"),   # the tiny preset's shape
    (2, 16, 64, 30, 50, 0, "bfloat16"),   # no window
    (2, 8, 16, 1, 0, 9, "float32"),       # no slots
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sparse_attention(impl, case):
    *shape, dtype = case
    args = _inputs(*shape, dtype=dtype)
    got = sparse_attention(*args, implementation=impl)
    _check(got, args, _tol(impl, dtype))


@pytest.mark.parametrize("tiling", [
    dict(block_h=16, block_k=16, splits=1),             # two head blocks
    dict(block_k=16, block_d=16, splits=4),             # 5 blocks: 2 + 2 + 1 + 0; D in 2 chunks
    dict(version=1, block_h=16, block_k=16, splits=4),  # the previous kernel (triton_v1)
    dict(block_h=16, block_k=16, col_splits=2),         # output columns over 2 programs
    dict(block_k=16, splits=3, col_splits=2),
    dict(block_k=16, block_d=16, splits=4, fused_combine=True),  # merged in the kernel
    dict(block_k=16, splits=3, col_splits=2, fused_combine=True),
])
def test_tilings_in_interpret_mode(tiling):
    """Head blocks, row blocks, column chunks, splits of the row loop (merged by
    ``combine``): same output, with logits of std ~40 (exp overflows f32 without the running
    maximum)."""
    from pallas_kernels.sparse_attention import triton, triton_v1

    tiling = dict(tiling)
    kernel = (triton_v1 if tiling.pop("version", 2) == 1 else triton).sparse_attention_triton
    args = _inputs(3, 32, 32, 50, 45, 20, seed=1)  # CASES[1]'s shape
    args[0][:] *= 20
    got = kernel(*map(jnp.asarray, args), **tiling)
    _check(got, args, "float32")


@pytest.mark.parametrize("rows", ["float32", "fp8"])
def test_fused_combine_equals_the_xla_combine(rows):
    """fused_combine (the last split to finish merges the partials in the kernel) against the
    same launch merged by ``combine`` in XLA and against the model: dense rows over 3 splits
    and 2 head blocks, FP8 rows in 64-wide scale blocks over 4 splits (interpret mode)."""
    from pallas_kernels.sparse_attention.triton import sparse_attention_triton

    if rows == "fp8":
        args, tiling = _fp8(_inputs(3, 8, 192, 40, 37, 20, seed=6), 64), dict(splits=4)
        truth_args, tol = _dense_twin(args), "bfloat16"  # q and p rounded to bf16
    else:
        args = _inputs(3, 32, 32, 50, 45, 20, seed=3)
        args[0][:] *= 20  # logits of std ~40: the splits' maxima differ
        tiling, truth_args, tol = dict(block_h=16, block_k=16, splits=3), args, "float32"
    args = tuple(a if isinstance(a, tuple) else jnp.asarray(a) for a in args)
    fused = sparse_attention_triton(*args, **tiling, fused_combine=True)
    split = sparse_attention_triton(*args, **tiling)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(split), rtol=1e-6, atol=1e-6)
    _check(fused, truth_args, tol)


def test_fused_combine_lowers_to_one_launch_with_aliased_counters():
    """At the V4 shape with 2 requests (several splits): one Triton call, its counters an
    input aliased to an output (zeros each call), and no combine after it."""
    from pallas_kernels.sparse_attention.triton import sparse_attention_triton

    def after_call(fused):
        fn = functools.partial(sparse_attention_triton, fused_combine=fused)
        text = common.lower_for_cuda(fn, *_specs(2, **V4))
        assert text.count(common.TRITON_CALL_TARGET) == 1
        assert ("output_operand_aliases" in text) == fused
        return text.split(common.TRITON_CALL_TARGET)[1]

    assert "stablehlo.exp2" in after_call(False)  # XLA's combine
    assert "stablehlo.exp2" not in after_call(True)


def _fp8(args, rope):
    """The inputs with the table in the FP8 format (tuple of leaves; NaN poison stays NaN)
    and a bf16 window."""
    q, table, slots, window, window_mask, sink = args
    leaves = tuple(quantize_fp8_rows(jnp.asarray(table), rope))
    return q, leaves, slots, window.astype(jnp.bfloat16), window_mask, sink


def _dense_twin(args):
    """The FP8 inputs with the table dequantized (f32): what the kernel must attend to."""
    q, leaves, slots, window, window_mask, sink = args
    table = np.asarray(dequantize_fp8_rows(FP8Rows(*leaves)))
    return q, table, slots, np.asarray(window.astype(jnp.float32)), window_mask, sink


FP8_CASES = [  # (S, H, D, R, K, W, rope): D = n + rope
    (3, 8, 192, 40, 37, 20, 64),    # D not a power of two: 64-wide scale blocks + RoPE chunk
    (2, 4, 128, 40, 30, 0, 64),     # whole rows dequantized in registers, no window
    (2, 16, 64, 30, 20, 8, 16),     # whole rows, n = 48: a partial scale block (tiny preset)
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: "-".join(map(str, c)))
def test_fp8_rows_match_the_dequantized_rows(impl, case):
    *shape, rope = case
    args = _fp8(_inputs(*shape, seed=6), rope)
    got = sparse_attention(*args, implementation=impl)
    # kernel: q, probabilities and the window in bf16; the e4m3 values and scales are exact
    _check(got, _dense_twin(args), "bfloat16" if impl == "triton" else "float32")


@pytest.mark.parametrize("block_d", [None, 64])  # whole rows; 64-wide scale blocks
def test_fp8_scales_are_exact_powers_of_two(block_d):
    """Rows whose first block spans scales 2^-20 .. 2^20: the kernel's in-register e8m0
    decode is exact, so only bf16 rounding of q and p remains."""
    from pallas_kernels.sparse_attention.triton import sparse_attention_triton

    args = _inputs(2, 16, 128, 16, 12, 4, seed=7, empty=None)
    table = args[1]
    table[:, :, :64] *= 2.0 ** np.arange(-20, 20, 2.5)[:16, None]
    args = _fp8(args, 64)
    got = sparse_attention_triton(*args, block_d=block_d)
    _check(got, _dense_twin(args), "bfloat16", empty=None)
    if block_d is None:  # whole rows, output columns over 2 programs
        got = sparse_attention_triton(*args, col_splits=2, splits=2)
        _check(got, _dense_twin(args), "bfloat16", empty=None)


def test_fp8_shape_limits():
    args = _fp8(_inputs(2, 4, 80, 8, 4, 3), 32)  # D = 80, n = 48: neither form reads it
    sparse_attention(*args, implementation="xla")
    with pytest.raises(ValueError, match="FP8 rows need D = n \\+ r a power of two.*'xla'"):
        sparse_attention(*args, implementation="triton")


@pytest.mark.slow
def test_decode_step_is_one_launch_over_slots():
    """The serving decode step (vmap of the model over 4 slots, "triton")
    lowered for CUDA: one sparse_attention launch whose grid covers all 4 slots (S = 4 on the
    grid's last axis), not Pallas's batching of an S = 1 kernel."""
    from helpers import model_and_tokens, tiny

    from lsparse_jax.config import CacheConfig, EngineConfig
    from lsparse_jax.serving.engine import Engine
    from lsparse_jax.serving.steps import decode_step

    cfg = tiny(max_len=256)
    params, _ = model_and_tokens(cfg, 1)
    engine = Engine(EngineConfig(model=cfg, method="resident", implementation="triton",
                                 cache=CacheConfig(num_slots=4, prefill_chunk=32)), params)
    tokens, active = jnp.zeros(4, jnp.int32), jnp.ones(4, bool)
    with common.abstract_gpu():
        text = decode_step.trace(engine.params, engine.config, engine.state, tokens,
                                 active).lower(lowering_platforms=("cuda",)).as_text()
    # (head blocks, splits, S) of each sparse_attention kernel (a jitted kernel: one body); the
    # step's other Triton kernels (the exact selections' top-k) have grids of their own
    calls = text.split(common.TRITON_CALL_TARGET)[1:]
    grids = [_grid(c)[:3] for c in calls
             if re.search(r'name = "(\w+)"', c).group(1).startswith("sparse_attention")]
    assert grids and all(g[2] == 4 for g in grids)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_slots_equals_one_call(impl):
    """The decode step's shape: vmap over B slots of S = 1 requests (sink per slot, like a
    per-slot parameter) equals one call per slot; the kernel runs once over all B."""
    q, table, slots, window, window_mask, sink = map(jnp.asarray, _inputs(4, 4, 32, 20, 12, 8))
    sinks = jnp.stack([sink + i for i in range(4)])
    fn = functools.partial(sparse_attention, implementation=impl)
    got = jax.jit(jax.vmap(fn))(q[:, None], table[:, None], slots[:, None], window[:, None],
                                window_mask[:, None], sinks)[:, 0]
    for i in range(4):
        one = fn(q[i:i + 1], table[i:i + 1], slots[i:i + 1], window[i:i + 1],
                 window_mask[i:i + 1], sinks[i])
        np.testing.assert_allclose(np.asarray(got[i:i + 1]), np.asarray(one), rtol=1e-5,
                                   atol=1e-6)


def _shared_inputs(s, h, d, r, k, w, dtype="float32", seed=0):
    """Inputs whose S requests index one shared table [1, R, D] (a device page pool): each
    request's slots name rows of its own, the other rows are NaN poison."""
    q, table, slots, window, window_mask, sink = _inputs(s, h, d, s * r, k, w, dtype,
                                                         seed=seed)
    own = np.arange(s)[:, None] * r
    slots = np.where(slots >= 0, own + slots % r, -1).astype(np.int32)
    shared = np.full((1, s * r, d), np.nan, table.dtype)
    rng = np.random.default_rng(seed + 1)
    named = np.unique(slots[slots >= 0])
    shared[0, named] = rng.standard_normal((named.size, d)).astype(table.dtype)
    return q, shared, slots, window, window_mask, sink


@pytest.mark.parametrize("impl", IMPLS + ["triton_fp8"])
def test_shared_table_equals_its_copy_per_request(impl):
    """A [1, R, ...] table is one table for all S requests: the output equals the same call
    with the table repeated per request, bit for bit (dense f32 and FP8 rows), and under
    vmap over slots (the decode step's form, the pool unmapped) it equals the direct call."""
    q, table, slots, window, mask, sink = map(jnp.asarray, _shared_inputs(3, 4, 64, 24, 20, 8))
    if impl == "triton_fp8":
        stored = quantize_fp8_rows(table, 16)
        table, window = tuple(stored), window.astype(jnp.bfloat16)
    fn = functools.partial(sparse_attention,
                           implementation="triton" if impl == "triton_fp8" else impl)
    copied = jax.tree.map(lambda t: jnp.broadcast_to(t, (3,) + t.shape[1:]), table)
    got = np.asarray(fn(q, table, slots, window, mask, sink))
    np.testing.assert_array_equal(got, np.asarray(fn(q, copied, slots, window, mask, sink)))
    mapped = jax.jit(jax.vmap(fn, in_axes=(0, None, 0, 0, 0, None)))(
        q[:, None], table, slots[:, None], window[:, None], mask[:, None], sink)[:, 0]
    np.testing.assert_array_equal(np.asarray(mapped), got)
    rows = dequantize_fp8_rows(FP8Rows(*table)) if impl == "triton_fp8" else table
    _check(got, (q, np.broadcast_to(np.asarray(rows), (3,) + rows.shape[1:]), slots,
                 window.astype(jnp.float32), mask, sink), "bfloat16" if "fp8" in impl
           else "float32")


@pytest.mark.parametrize("impl", IMPLS)
def test_nested_maps_keep_each_slots_table(impl):
    """A verification block's form: a map over T queries that share their slot's table
    ([1, R, D], unmapped there) inside the map over B slots (each its own table): every
    query attends to its own slot's rows, as one call per query would."""
    b, t = 3, 2
    q, table, slots, window, mask, sink = map(jnp.asarray, _inputs(b * t, 4, 32, 20, 12, 8))
    q, slots, window, mask = (a.reshape((b, t, 1) + a.shape[1:])
                              for a in (q, slots, window, mask))
    tables = table[::t][:, None]                                    # [B, 1, R, D]
    fn = functools.partial(sparse_attention, implementation=impl)
    per_query = jax.vmap(fn, in_axes=(0, None, 0, 0, 0, None))
    got = jax.jit(jax.vmap(per_query, in_axes=(0, 0, 0, 0, 0, None)))(
        q, tables, slots, window, mask, sink)
    for i in range(b):
        for j in range(t):
            one = fn(q[i, j], tables[i], slots[i, j], window[i, j], mask[i, j], sink)
            np.testing.assert_allclose(np.asarray(got[i, j]), np.asarray(one), rtol=1e-6,
                                       atol=1e-6)


def test_shared_table_under_vmap_is_not_copied():
    """Lowered for CUDA, the decode step's form with an unmapped [1, R, D] pool passes the
    pool itself to the one launch: no [S, R, D] broadcast of it appears in the program."""
    fn = functools.partial(sparse_attention, implementation="triton")
    s = 8
    q, _, slots, window, mask, sink = _specs(s, **V4)
    pool = jax.ShapeDtypeStruct((1, 4096, V4["d"]), jnp.bfloat16)
    per_slot = [jax.ShapeDtypeStruct((s, 1) + a.shape[1:], a.dtype)
                for a in (q, slots, window, mask)]
    text = common.lower_for_cuda(
        jax.vmap(fn, in_axes=(0, None, 0, 0, 0, None)), per_slot[0], pool, *per_slot[1:],
        sink)
    assert text.count(common.TRITON_CALL_TARGET) == 1
    assert "tensor<8x4096x512xbf16>" not in text and "tensor<1x4096x512xbf16>" in text


@pytest.mark.parametrize("impl", IMPLS)
def test_duplicate_slot_counts_twice(impl):
    """Identity: a row named twice == that row once with the sink lowered by ln 2
    (2 e^x r / (e^s + 2 e^x) = e^x r / (e^(s - ln 2) + e^x))."""
    q, table, slots, window, window_mask, sink = _inputs(2, 4, 32, 20, 8, 4, seed=2, empty=None)
    table[:, 7] = np.random.default_rng(3).standard_normal(table[:, 7].shape)
    slots[:] = -1
    slots[:, [2, 5]] = 7
    window_mask[:] = False
    twice = sparse_attention(q, table, slots, window, window_mask, sink, implementation=impl)
    slots[:, 5] = -1
    once = sparse_attention(q, table, slots, window, window_mask, sink - np.log(2.0),
                            implementation=impl)
    twice, once = np.asarray(twice), np.asarray(once)
    assert np.isfinite(twice).all() and np.abs(twice).max() > 0.1
    np.testing.assert_allclose(twice, once, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_under_jit_with_f32_query_and_bf16_rows(impl):
    q, table, slots, window, mask, sink = _inputs(3, 4, 64, 48, 40, 20, seed=3)  # CASES[0]
    args = (q, table.astype(jnp.bfloat16), slots, window.astype(jnp.bfloat16), mask, sink)
    fn = jax.jit(functools.partial(sparse_attention, implementation=impl))
    _check(fn(*map(jnp.asarray, args)), args, _tol(impl, "bfloat16"))  # triton rounds q


def _specs(s, h, d, r, k, w, dtype, rope=None):
    """ShapeDtypeStructs of the inputs; ``rope`` set: FP8 rows (n = d - rope), bf16 window."""
    sd, dt = jax.ShapeDtypeStruct, jnp.dtype(dtype)
    table = sd((s, r, d), dt)
    if rope is not None:
        n = d - rope
        table = (sd((s, r, n), jnp.float8_e4m3fn), sd((s, r, -(-n // 64)), jnp.float8_e8m0fnu),
                 sd((s, r, rope), jnp.bfloat16))
    return (sd((s, h, d), dt), table, sd((s, k), jnp.int32), sd((s, w, d), dt),
            sd((s, w), jnp.bool_), sd((h,), jnp.float32))


@pytest.mark.parametrize("rows", ["bfloat16", "float32", "fp8"])
@pytest.mark.parametrize("s", [2, 64])  # 2: the row loop split across programs; 64: less so
def test_triton_lowers_for_cuda_at_v4_shape(s, rows):
    fn = functools.partial(sparse_attention, implementation="triton")
    shape = dict(V4, dtype="bfloat16" if rows == "fp8" else rows,
                 rope=64 if rows == "fp8" else None)
    text = common.lower_for_cuda(fn, *_specs(s, **shape))
    assert text.count(common.TRITON_CALL_TARGET) == 1


def test_triton_refuses_fp8_tables_whose_offsets_would_wrap():
    """FP8 rows of 2-4 GiB (here 5 requests x 2^20 rows x 448 e4m3 bytes: resident KV at 512K x
    37 requests is of this size) would be indexed with wrapping int32 offsets: a clear error at
    trace time, under the decode step's vmap too; the XLA twin takes them."""
    fn = functools.partial(sparse_attention, implementation="triton")
    specs = _specs(5, **dict(V4, r=1 << 20, rope=64))
    with pytest.raises(ValueError, match="table is a float8_e4m3fn array.*offsets that wrap"):
        jax.eval_shape(fn, *specs)
    per_slot = [a if a.ndim == 1 else jax.ShapeDtypeStruct((5, 1) + a.shape[1:], a.dtype)
                for a in jax.tree.leaves(specs)]
    per_slot = (per_slot[0], tuple(per_slot[1:4]), *per_slot[4:])
    with pytest.raises(ValueError, match="offsets that wrap"):
        jax.eval_shape(jax.vmap(fn, in_axes=(0, 0, 0, 0, 0, None)), *per_slot)
    jax.eval_shape(functools.partial(sparse_attention, implementation="xla"), *specs)


@pytest.mark.parametrize("s", [8])  # 8 row splits a request; one shape keeps CI fast
def test_mosaic_lowers_for_cuda_at_v4_shape(s):
    """The Mosaic GPU kernel (TMA row copies, wgmma) lowers for the H200 from a CPU machine,
    as one kernel, at the V4-Flash shape (bf16 rows), directly and under vmap over slots."""
    fn = functools.partial(sparse_attention, implementation="mosaic")
    specs = _specs(s, **V4)
    text = common.lower_for_cuda(fn, *specs)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    per_slot = [a if a.ndim == 1 else jax.ShapeDtypeStruct((s, 1) + a.shape[1:], a.dtype)
                for a in specs]
    mapped = common.lower_for_cuda(jax.vmap(fn, in_axes=(0, 0, 0, 0, 0, None)), *per_slot)
    assert mapped.count("stablehlo.custom_call @mosaic_gpu") == 1


def test_mosaic_unrolled_rows_lower_for_cuda():
    """The Mosaic kernel with its row copies unrolled (``row_loop=False``; the default issues
    them from a loop) lowers for CUDA as one kernel at the V4 shape (its outputs are checked on
    the GPU by ``test_gpu_mosaic_v4_shape_matches_reference``)."""
    from pallas_kernels.sparse_attention.mosaic import sparse_attention_mosaic

    fn = functools.partial(sparse_attention_mosaic, row_loop=False)
    text = common.lower_for_cuda(fn, *_specs(8, **V4))
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


def test_mosaic_row_codes():
    """The Mosaic kernel's row list per (request, split): valid window rows as -(w + 2), then
    the selected table rows, -1 for masked rows, -1 slots and padding; P contiguous shares
    of whole BK blocks."""
    from pallas_kernels.sparse_attention.mosaic import row_codes

    slots = np.array([[5, -1, 7], [0, 2, -1]], np.int32)
    mask = np.array([[True, False], [False, False]])
    codes = np.asarray(row_codes(jnp.asarray(slots), jnp.asarray(mask), block_k=2, splits=2))
    # 5 rows -> 3 blocks of 2 -> 2 shares of 2 blocks (4 codes), the last 3 codes padding
    assert codes.shape == (2, 2, 4)
    np.testing.assert_array_equal(codes[0].ravel(), [-2, -1, 5, -1, 7, -1, -1, -1])
    np.testing.assert_array_equal(codes[1].ravel(), [-1, -1, 0, 2, -1, -1, -1, -1])


def test_mosaic_limits():
    """Mosaic reads bf16 rows with D a multiple of 128 (<= 512) and needs a GPU to run: clear
    errors otherwise, naming the implementations that work."""
    args = _inputs(2, 4, 128, 8, 4, 3, dtype="bfloat16")
    with pytest.raises(ValueError, match="'mosaic' needs a CUDA GPU"):
        sparse_attention(*args, implementation="mosaic")
    f32 = _inputs(2, 4, 128, 8, 4, 3)
    with pytest.raises(ValueError, match="'mosaic' reads bf16 rows only.*'triton'"):
        sparse_attention(*f32, implementation="mosaic")
    with pytest.raises(ValueError, match="'mosaic' reads bf16 rows only"):
        sparse_attention(*_fp8(_inputs(2, 4, 128, 8, 4, 3), 64), implementation="mosaic")
    small = _inputs(2, 4, 64, 8, 4, 3, dtype="bfloat16")
    with pytest.raises(ValueError, match="D a multiple of 128"):
        sparse_attention(*small, implementation="mosaic")


def _grid(text):
    return tuple(int(g) for g in re.findall(r"grid_[xyz] = (\d+)", text))


def test_vmapped_call_is_one_launch_over_all_requests():
    """The decode step maps the model over slots (S = 1 each): lowered for CUDA, the vmapped
    call is the same single launch (same grid) as one direct call over all slots."""
    fn = functools.partial(sparse_attention, implementation="triton")
    specs = _specs(8, **V4)
    per_slot = [a if a.ndim == 1 else jax.ShapeDtypeStruct((8, 1) + a.shape[1:], a.dtype)
                for a in specs]
    mapped = common.lower_for_cuda(jax.vmap(fn, in_axes=(0, 0, 0, 0, 0, None)), *per_slot)
    direct = common.lower_for_cuda(fn, *specs)
    assert mapped.count(common.TRITON_CALL_TARGET) == 1
    assert _grid(mapped) == _grid(direct) and len(_grid(direct)) == 3


def test_triton_lowers_for_cuda_at_tiny_shape():
    fn = functools.partial(sparse_attention, implementation="triton")
    text = common.lower_for_cuda(fn, *_specs(4, 4, 64, 256, 16, 32, "float32"))
    assert text.count(common.TRITON_CALL_TARGET) == 1


def _bad(name):
    """Valid small inputs with one argument replaced by a bad shape or dtype."""
    q, table, slots, window, mask, sink = _inputs(2, 4, 16, 8, 4, 3)
    bad = {
        "q_rank": ("q", q[0]),
        "q_dtype": ("q", q.astype(np.float16)),
        "table_rank": ("table", table[0]),
        "table_dim": ("table", table[..., :8]),
        "table_dtype": ("table", table.astype(np.float16)),
        "table_rows": ("table", table[:, :0]),
        "slots_shape": ("slots", slots[:1]),
        "slots_dtype": ("slots", slots.astype(np.int64)),
        "window_dim": ("window", window[..., :8]),
        "window_dtype": ("window", window.astype(jnp.bfloat16)),
        "window_mask_shape": ("window_mask", mask[:, :2]),
        "window_mask_dtype": ("window_mask", mask.astype(np.int32)),
        "sink_shape": ("sink", sink[:3]),
        "sink_dtype": ("sink", sink.astype(jnp.bfloat16)),
    }[name]
    args = dict(q=q, table=table, slots=slots, window=window, window_mask=mask, sink=sink)
    args[bad[0]] = bad[1]
    return bad[0], args


@pytest.mark.parametrize("case", ["q_rank", "q_dtype", "table_rank", "table_dim", "table_dtype",
                                  "table_rows", "slots_shape", "slots_dtype", "window_dim",
                                  "window_dtype", "window_mask_shape", "window_mask_dtype",
                                  "sink_shape", "sink_dtype"])
def test_bad_inputs_name_the_argument(case):
    arg, args = _bad(case)
    with pytest.raises(ValueError, match=rf"sparse_attention: {arg}\b"):
        sparse_attention(**args, implementation="xla")


def test_triton_shape_limits_and_implementations():
    args = _inputs(1, 4, 48, 8, 4, 3, empty=None)  # D = 48 is not a power of two
    sparse_attention(*args, implementation="xla")
    with pytest.raises(ValueError, match="head dim D=48.*implementation='xla'"):
        sparse_attention(*args, implementation="triton")
    for bad in ("jax_triton", "cuda"):
        with pytest.raises(ValueError, match="sparse_attention: implementation="):
            sparse_attention(*args, implementation=bad)


# ---------------------------------------------------------------- GPU ----------------------


@pytest.mark.gpu
@pytest.mark.parametrize("s", [2, 64])
def test_gpu_v4_shape_matches_reference(s):
    """The real Triton kernel at the V4-Flash shape (bf16) vs the XLA reference and the model."""
    args = _inputs(s, **V4, seed=4)
    got = np.asarray(sparse_attention(*args, implementation="triton"))
    want = np.asarray(sparse_attention(*args, implementation="xla"))
    assert np.all(got[1] == 0.0)
    assert_close(got, want, "bfloat16")
    if s == 2:
        _check(got, args, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["bfloat16", "fp8"])
@pytest.mark.parametrize("s", [2, 64])
def test_gpu_fused_combine_matches_the_xla_combine(s, rows):
    """fused_combine on the GPU (the programs race to the counters) at the V4-Flash shape
    (B 2: 20 splits a request; B 64: 2): the same output as the launch merged in XLA, within
    f32 rounding, and the XLA reference, in each of three calls (the order in which the
    splits finish varies between calls)."""
    from pallas_kernels.sparse_attention.triton import sparse_attention_triton

    args = _inputs(s, **V4, seed=9)
    if rows == "fp8":
        args = _fp8(args, 64)
    args = tuple(a if isinstance(a, tuple) else jnp.asarray(a) for a in args)
    want = np.asarray(sparse_attention(*args, implementation="xla"))
    split = np.asarray(sparse_attention_triton(*args))
    for _ in range(3):
        fused = np.asarray(sparse_attention_triton(*args, fused_combine=True))
        np.testing.assert_allclose(fused, split, rtol=1e-5, atol=1e-6)
        assert_close(fused, want, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["float32", "fp8"])
def test_gpu_v4_shape_row_formats(rows):
    """f32 rows (3-pass TF32 dots) and FP8 rows at the V4-Flash shape vs the XLA reference,
    called directly and under vmap over slots (the decode step's form)."""
    args = _inputs(8, **dict(V4, dtype="float32"), seed=8)
    tol = "tf32"
    if rows == "fp8":
        args, tol = _fp8(args, 64), "bfloat16"
    args = tuple(a if isinstance(a, tuple) else jnp.asarray(a) for a in args)
    want = np.asarray(sparse_attention(*args, implementation="xla"))
    got = np.asarray(sparse_attention(*args, implementation="triton"))
    assert_close(got, want, tol)
    per_slot = jax.tree.map(lambda a: a[:, None], args[:5])
    mapped = jax.vmap(functools.partial(sparse_attention, implementation="triton"),
                      in_axes=(0, 0, 0, 0, 0, None))(*per_slot, args[5])
    assert_close(np.asarray(mapped[:, 0]), want, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["float32", "fp8"])
def test_gpu_shared_pool_matches_its_copies(rows):
    """An HCA decode's form at V4 shapes: 8 requests' slots into one shared [1, R, D] pool
    (f32 or FP8 rows), under vmap over slots with the pool unmapped: bit for bit the call
    with the pool copied per request, and within tolerance of the XLA reference."""
    args = _shared_inputs(8, 64, 512, 1024, 1024, 128, seed=9)
    tol = "tf32"
    if rows == "fp8":
        args, tol = _fp8(args, 64), "bfloat16"
    q, table, slots, window, mask, sink = tuple(
        a if isinstance(a, tuple) else jnp.asarray(a) for a in args)
    copied = jax.tree.map(lambda t: jnp.broadcast_to(t, (8,) + t.shape[1:]), table)
    fn = functools.partial(sparse_attention, implementation="triton")
    want = np.asarray(fn(q, copied, slots, window, mask, sink))
    mapped = jax.jit(jax.vmap(fn, in_axes=(0, None, 0, 0, 0, None)))(
        q[:, None], table, slots[:, None], window[:, None], mask[:, None], sink)[:, 0]
    np.testing.assert_array_equal(np.asarray(mapped), want)
    ref = sparse_attention(q, copied, slots, window, mask, sink, implementation="xla")
    assert_close(want, np.asarray(ref), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("s", [2, 64])
def test_gpu_mosaic_v4_shape_matches_reference(s):
    """The Mosaic GPU kernel at the V4-Flash shape (bf16) vs XLA, direct and vmapped; and with
    its row copies unrolled (``row_loop=False``; the default loops)."""
    from pallas_kernels.sparse_attention.mosaic import sparse_attention_mosaic

    args = tuple(map(jnp.asarray, _inputs(s, **V4, seed=9)))
    want = np.asarray(sparse_attention(*args, implementation="xla"))
    got = np.asarray(sparse_attention(*args, implementation="mosaic"))
    assert np.all(got[1] == 0.0)
    assert_close(got, want, "bfloat16")
    unrolled = np.asarray(sparse_attention_mosaic(*args, row_loop=False))
    assert_close(unrolled, want, "bfloat16")
    mapped = jax.vmap(functools.partial(sparse_attention, implementation="mosaic"),
                      in_axes=(0, 0, 0, 0, 0, None))(*(a[:, None] for a in args[:5]), args[5])
    assert_close(np.asarray(mapped[:, 0]), want, "bfloat16")


@pytest.mark.gpu
def test_gpu_tiny_shape_matches_model():
    args = _inputs(4, 4, 64, 256, 16, 32, "float32", seed=5)
    _check(sparse_attention(*args, implementation="triton"), args, "float32")


def test_default_stages_follow_the_block_bytes_by_row_format():
    """default_config gives 3 stages of rows while a block (BK rows) is at most the format's
    ``STAGE3_BLOCK_BYTES``: bf16 rows at D 512, BK 32 (32 KB, session 39's measured launch)
    get 3, FP8 rows (583 B, 18.7 KB blocks) and f32 rows (BK 16 x 2 KB) 2; a given num_stages
    is kept."""
    from pallas_kernels.sparse_attention import triton as sa

    def stages(row, fp8=False, f32=False, **kw):
        return sa.default_config(64, 64, 512, 512, 128, row, fp8, f32, **kw)["num_stages"]

    assert stages(1024) == 3 and stages(1024, block_k=64) == 2
    assert stages(583, fp8=True) == 2 and stages(583, fp8=True, block_k=16) == 3
    assert stages(2048, f32=True) == 2
    assert stages(1024, num_stages=2) == 2
