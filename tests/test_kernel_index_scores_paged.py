"""index_scores_paged (pallas_kernels/index_scores): FP8 keys scored in place in a page pool.

Notation: B requests, H heads, D head dim, NB scale blocks, P rows per page, NP pool pages,
MP page-table entries per request, N positions per request.
The pool is NaN-poisoned everywhere no request maps; pages are assigned in a random order;
some requests have unmapped (-1) entries inside their N positions and tables shorter than N / P.
Such positions, and invalid ones, must come back exactly -inf. "triton" runs in Pallas
interpret mode on CPU; the V4 decode shape runs on a GPU (``gpu`` marker).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import assert_close, index_scores_oracle

from lsparse_jax.quant import quantize_index_keys
from pallas_kernels import common
from pallas_kernels.index_scores import index_scores, index_scores_paged


def _problem(b, h, d, nb, page, n, seed=0, q_dtype="float32", holes=True):
    """((q, weights, pool_values, pool_scales, page_table, valid), tail, keys): tail =
    (values [B, P, D], scales [B, P, NB], start [B]) with request 0's tail inside its mapped
    pages (whose pool rows there hold other keys: must not be read), request 1's past its
    table, the others' unreached; keys = (values [B, N, D], scales [B, N, NB], mapped [B, N])
    of what each position reads."""
    rng = np.random.default_rng(seed)
    max_pages = -(-n // page)
    num_pages = b * max_pages + 3                        # spare pages stay poisoned
    q = rng.standard_normal((b, h, d), np.float32).astype(jnp.dtype(q_dtype))
    weights = rng.standard_normal((b, h), np.float32)

    def keys(count):
        x = rng.standard_normal((count, d), np.float32) * rng.uniform(0.1, 10, (count, 1))
        return (np.asarray(y) for y in quantize_index_keys(jnp.asarray(x), d // nb))

    values, scales = keys(num_pages * page)
    table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    if holes:
        table[0, max_pages // 2] = -1                    # a hole inside request 0's history
        table[-1, max_pages - 1:] = -1                   # the last request's last page unmapped
        table = table[:, :max(max_pages - 1, 1)]         # a table shorter than N / P
    poison = np.ones(num_pages, bool)
    poison[table[table >= 0]] = False
    poison = np.repeat(poison, page)
    values = np.where(poison[:, None], np.float32(np.nan).astype(values.dtype), values)
    scales = np.where(poison[:, None], np.nan, scales).astype(np.float32)
    tv, ts = keys(b * page)
    tail = (tv.reshape(b, page, d), ts.reshape(b, page, nb),
            np.full((b,), -2 ** 30, np.int32))
    tail[2][0] = (n // page // 3) * page                 # request 0: over a mapped page
    if b > 1:
        tail[2][1] = n - page // 2                       # request 1: runs past N
    valid = rng.random((b, n)) < 0.8
    pos = np.arange(n)
    logical = pos // page
    phys = table[:, np.minimum(logical, table.shape[1] - 1)]
    mapped = (logical < table.shape[1]) & (phys >= 0)
    at = pos[None, :] - tail[2][:, None]
    in_tail = (at >= 0) & (at < page)
    rows = np.where(mapped, phys * page + pos % page, 0)
    at = np.clip(at, 0, page - 1)
    pick = lambda pool, t: np.where(  # noqa: E731
        in_tail[..., None], np.take_along_axis(t, at[..., None], axis=1), pool[rows])
    gathered = (pick(values, tail[0]), pick(scales, tail[1]), mapped | in_tail)
    return (q, weights, values, scales, table, valid), tail, gathered


def _gathered(args, keys):
    """The contiguous index_scores problem of the same positions (unmapped ones invalid)."""
    q, w, *_, valid = args
    values, scales, mapped = keys
    return q, w, values, scales, valid & mapped


# (B, H, D, NB, P, N, q dtype): N not whole pages, H padded to 16, two scale blocks,
# pages smaller than, equal to and larger than the kernel's 16-64 position blocks
CASES = [
    (2, 4, 64, 1, 16, 100, "float32"),
    (3, 64, 128, 2, 64, 300, "float32"),
    (2, 6, 64, 1, 8, 72, "bfloat16"),
    (1, 4, 128, 1, 256, 600, "float32"),
]


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_paged_scores_equal_the_oracle_of_the_mapped_rows(impl, case):
    b, h, d, nb, page, n, q_dtype = case
    args, tail, keys = _problem(b, h, d, nb, page, n, q_dtype=q_dtype)
    got = np.asarray(index_scores_paged(*args, page=page, tail=tail, implementation=impl))
    want = index_scores_oracle(*_gathered(args, keys))
    live = np.isfinite(want)
    assert got.shape == (b, n) and got.dtype == np.float32
    assert np.all(got[~live] == -np.inf), "invalid or unmapped positions must be exactly -inf"
    assert live.any() and (args[-1] & ~keys[2]).any()     # valid positions on unmapped pages
    assert_close(got, want, "float32", mask=live)


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_kernel_scores_as_the_contiguous_kernel(fp8):
    """Each mapped position gets bit for bit the score the contiguous kernel gives the same
    key at the same launch (the kernels share ``block_scores``); fp8 both quantize q alike."""
    args, tail, keys = _problem(2, 4, 64, 2, 16, 200, seed=1)
    impl = "triton_fp8" if fp8 else "triton"
    got = np.asarray(index_scores_paged(*args, page=16, tail=tail, implementation=impl))
    want = np.asarray(index_scores(*_gathered(args, keys), implementation=impl))
    np.testing.assert_array_equal(got, want)


def test_fp8_form_matches_its_twin():
    from pallas_kernels.index_scores.reference import index_scores_paged_xla

    args, tail, _ = _problem(2, 4, 64, 1, 16, 130, seed=2)
    got = np.asarray(index_scores_paged(*args, page=16, tail=tail, implementation="triton_fp8"))
    q, w, values, scales, table, valid = map(jnp.asarray, args)
    want = np.asarray(index_scores_paged_xla(q, w, values, scales, table,
                                             *map(jnp.asarray, tail), valid, page=16, fp8=True))
    live = np.isfinite(want)
    assert np.all(got[~live] == -np.inf)
    assert_close(got, want, "float32", mask=live)


def test_long_row_under_the_engines_vmap_is_one_launch_of_the_batched_scores():
    """The decode step's form: a vmap over slots of [1, N] calls with the pool shared, N a
    long row (``default_config``'s long-row rule, a partial last program): the scores of one
    batched call, bit for bit, and the whole vmap lowers for CUDA to one kernel launch."""
    from pallas_kernels.index_scores import triton as tri

    n, page = tri.LONG_ROW + 40, 64
    args, tail, _ = _problem(2, 4, 64, 1, page, n, seed=3, q_dtype="bfloat16")
    q, w, values, scales, table, valid = map(jnp.asarray, args)
    tail = tuple(map(jnp.asarray, tail))
    one = functools.partial(index_scores_paged, page=page, implementation="triton")
    per_slot = jax.vmap(lambda q, w, t, ok, tv, ts, t0: one(
        q[None], w[None], values, scales, t[None], ok[None],
        tail=(tv[None], ts[None], t0[None]))[0])
    got = per_slot(q, w, table, valid, *tail)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(one(q, w, values, scales, table,
                                                                  valid, tail=tail)))
    s = jax.ShapeDtypeStruct
    vmapped = jax.vmap(lambda q, w, v, sc, t, ok: one(q[None], w[None], v, sc, t[None],
                                                      ok[None])[0],
                       in_axes=(0, 0, None, None, 0, 0))
    text = common.lower_for_cuda(vmapped, s((8, 64, 128), jnp.float32), s((8, 64), jnp.float32),
                                 s((1 << 21, 128), jnp.float8_e4m3fn),
                                 s((1 << 21, 1), jnp.float32), s((8, 2049), jnp.int32),
                                 s((8, 131104), jnp.bool_))
    assert text.count(common.TRITON_CALL_TARGET) == 1


def test_fp8_kernel_lowers_for_cuda():
    s = jax.ShapeDtypeStruct
    fn = functools.partial(index_scores_paged, page=64, implementation="triton_fp8")
    text = common.lower_for_cuda(fn, s((8, 64, 128), jnp.float32), s((8, 64), jnp.float32),
                                 s((1 << 20, 128), jnp.float8_e4m3fn),
                                 s((1 << 20, 1), jnp.float32), s((8, 2049), jnp.int32),
                                 s((8, 131104), jnp.bool_))
    assert text.count(common.TRITON_CALL_TARGET) == 1


def test_empty_and_fully_unmapped_requests():
    args, _, _ = _problem(2, 4, 64, 1, 16, 48, holes=False)
    q, w, values, scales, table, valid = args
    empty = index_scores_paged(q, w, values, scales, table, valid[:, :0], page=16,
                               implementation="triton")
    assert empty.shape == (2, 0)
    got = index_scores_paged(q, w, values, scales, np.full_like(table, -1), valid, page=16,
                             implementation="triton")
    assert np.all(np.asarray(got) == -np.inf)


def _bad(name):
    args, tail, _ = _problem(2, 4, 64, 1, 16, 40, holes=False)
    q, w, values, scales, table, valid = args
    page = 16
    bad = {
        "page": ("page", 0),
        "pool_values_rank": ("pool_values", values[None]),
        "pool_values_pages": ("pool_values", values[:-1]),
        "pool_values_dtype": ("pool_values", values.astype(np.float32)),
        "pool_scales_rows": ("pool_scales", scales[:-16]),
        "page_table_dtype": ("page_table", table.astype(np.float32)),
        "page_table_batch": ("page_table", table[:1]),
        "valid_dtype": ("valid", valid.astype(np.int32)),
        "q_rank": ("q", q[0]),
        "tail_rows": ("tail", (tail[0][:, :-1], tail[1], tail[2])),
        "tail_start": ("tail", (tail[0], tail[1], tail[2][:1])),
    }[name]
    kwargs = dict(q=q, weights=w, pool_values=values, pool_scales=scales, page_table=table,
                  valid=valid, page=page, tail=tail)
    kwargs[bad[0]] = bad[1]
    return bad[0], kwargs


@pytest.mark.parametrize("case", ["page", "pool_values_rank", "pool_values_pages",
                                  "pool_values_dtype", "pool_scales_rows", "page_table_dtype",
                                  "page_table_batch", "valid_dtype", "q_rank", "tail_rows",
                                  "tail_start"])
def test_bad_inputs_name_the_argument(case):
    arg, kwargs = _bad(case)
    with pytest.raises(ValueError, match=rf"index_scores(_paged)?: {arg}\b"):
        index_scores_paged(**kwargs, implementation="xla")


def test_implementations():
    args, _, _ = _problem(1, 4, 64, 1, 16, 20, holes=False)
    with pytest.raises(ValueError, match="implementation='jax_triton' is not available"):
        index_scores_paged(*args, page=16, implementation="jax_triton")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "triton_fp8"])
def test_gpu_decode_shape_matches_the_contiguous_kernel(impl):
    """B 8 requests x 131104 positions (512K / 4 + 32) in pages of 64, vmapped as the engine
    calls it: each score equals the contiguous kernel's on the gathered keys."""
    args, tail, keys = _problem(8, 64, 128, 1, 64, 131104, seed=4)
    q, w, values, scales, table, valid = map(jnp.asarray, args)
    one = functools.partial(index_scores_paged, page=64, implementation=impl)
    got = jax.jit(jax.vmap(lambda q, w, t, ok, tv, ts, t0: one(
        q[None], w[None], values, scales, t[None], ok[None],
        tail=(tv[None], ts[None], t0[None]))[0]))(q, w, table, valid, *map(jnp.asarray, tail))
    want = index_scores(*_gathered(args, keys), implementation=impl)
    got, want = np.asarray(got), np.asarray(want)
    live = np.isfinite(want)
    assert np.all(got[~live] == -np.inf)
    assert_close(got, want, "float32", mask=live)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_per_request_pools_and_row_tables(impl):
    """A pool per request ([B, R, D]) with page 1 (the table names rows: a candidate list read
    in place from each request's key cache, LeanSparse's rescoring) and a tail of P rows at
    the end of the list: the contiguous scores of the gathered rows, bit for bit for the
    kernel; under the engine's vmap too."""
    rng = np.random.default_rng(6)
    b, h, d, r, c, p = 3, 4, 64, 40, 50, 8
    q = rng.standard_normal((b, h, d), np.float32)
    w = rng.standard_normal((b, h), np.float32)
    keys = rng.standard_normal((b, r + p, d), np.float32)
    values, scales = (np.asarray(x) for x in quantize_index_keys(jnp.asarray(keys), d))
    rows = rng.integers(-1, r, (b, c + p)).astype(np.int32)      # -1: dropped candidates
    rows[:, c:] = -1                                               # the tail's entries
    valid = (rows >= 0) | (np.arange(c + p) >= c)[None, :]
    valid[1, c + 3:] = False                                       # a tail not yet full
    tail = (values[:, r:], scales[:, r:], np.full((b,), c, np.int32))
    got = index_scores_paged(q, w, values[:, :r], scales[:, :r], rows, valid, page=1,
                             tail=tail, implementation=impl)
    pick = np.concatenate([np.maximum(rows[:, :c], 0), r + np.arange(p)[None].repeat(b, 0)], 1)
    gathered = (q, w, np.take_along_axis(values, pick[..., None], 1),
                np.take_along_axis(scales, pick[..., None], 1), valid)
    want = index_scores(*gathered, implementation="triton" if impl == "triton" else "xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    one = functools.partial(index_scores_paged, page=1, implementation=impl)
    per_slot = jax.vmap(lambda q, w, v, s, t, ok, tv, ts, t0: one(
        q[None], w[None], v[None], s[None], t[None], ok[None],
        tail=(tv[None], ts[None], t0[None]))[0])
    np.testing.assert_array_equal(
        np.asarray(per_slot(q, w, values[:, :r], scales[:, :r], rows, valid, *tail)),
        np.asarray(got))
