"""pq_topc with paged codes (``page_table``): LeanSparse's coarse pass reading PQ codes in place
from a device page pool.

Notation: B requests, H heads, D dim, M subspaces, K centroids, P rows per page, MP page-table
entries per request (N = MP * P positions), C candidates. The pool's unmapped pages hold
garbage codes (255 >= K); each request's table maps its pages in a random order and leaves
entries past its length -1. A paged call must give exactly what the same implementation gives
on the gathered [B, N, M] codes: "xla" its twin, "triton" (interpret mode) the same kernel
arithmetic on the same codes; "jax_triton" on a GPU (``gpu`` marker), its PTX on the CPU when
the triton package is installed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import assert_same_sets, pq_problem

from pallas_kernels import common
from pallas_kernels.pq_topc import pq_topc


def _paged(seed, b, h, d, m, k, page, max_pages, lengths):
    """(q, weights, pool [R, M], codebooks, lengths, page_table [B, MP]) and the gathered
    codes [B, N, M] (garbage where unmapped)."""
    n = page * max_pages
    q, w, codes, books = pq_problem(seed, b, h, d, m, k, n)
    rng = np.random.default_rng(seed)
    num_pages = b * max_pages + 2
    order = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    lengths = np.asarray(lengths, np.int32)
    needed = -(-lengths // page)
    table = np.where(np.arange(max_pages)[None, :] < needed[:, None], order, -1)
    pool = np.full((num_pages * page, m), 255, np.uint8)           # garbage: >= K
    codes = np.asarray(codes)
    for r in range(b):
        for j in range(needed[r]):
            pool[table[r, j] * page:(table[r, j] + 1) * page] = codes[r, j * page:(j + 1) * page]
    ids = np.maximum(table, 0)[:, np.arange(n) // page] * page + np.arange(n) % page
    return (q, w, jnp.asarray(pool), books, jnp.asarray(lengths),
            jnp.asarray(table)), jnp.asarray(pool[ids])


# (B, H, D, M, K, P, MP, lengths): ragged lengths (0, partial pages, all), M = 3 padded to 4
CASES = [
    (3, 4, 32, 8, 16, 16, 12, (192, 70, 0)),
    (2, 6, 12, 3, 10, 8, 40, (300, 17)),
]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_paged_codes_give_the_gathered_codes_result(impl, precision, case):
    b, h, d, m, k, page, mp, lengths = case
    (q, w, pool, books, lens, table), gathered = _paged(1, b, h, d, m, k, page, mp, lengths)
    c = 24
    got = pq_topc(q, w, pool, books, lens, num_candidates=c, implementation=impl,
                  precision=precision, page_table=table, page=page)
    want = pq_topc(q, w, gathered, books, lens, num_candidates=c, implementation=impl,
                   precision=precision)
    if impl == "xla":  # best-first, ties to the lower position: equal arrays
        for g, x in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(x))
        return
    assert_same_sets(got[0], want[0])
    order = lambda p, v: np.take_along_axis(np.asarray(v), np.argsort(np.asarray(p)), 1)  # noqa
    np.testing.assert_array_equal(order(*got), order(*want))


def test_unfused_paged_scores_are_the_gathered_codes_scores():
    """The score kernel alone (``coarse_scores_triton``) and the unfused top-C read paged
    codes as the gathered copy: equal scores and positions."""
    from pallas_kernels.pq_topc import triton as pq_triton

    (q, w, pool, books, lens, table), gathered = _paged(5, 2, 4, 32, 8, 16, 16, 6, (90, 33))
    got = pq_triton.coarse_scores_triton(q, w, pool, books, lens, page_table=table, page=16)
    want = pq_triton.coarse_scores_triton(q, w, gathered, books, lens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    got = pq_triton.pq_topc_triton(q, w, pool, books, lens, num_candidates=12, fused=False,
                                   page_table=table, page=16)
    want = pq_triton.pq_topc_triton(q, w, gathered, books, lens, num_candidates=12, fused=False)
    assert_same_sets(got[0], want[0])


def test_engine_form_under_a_vmap_equals_the_batched_call():
    """The decode step's form: a vmap over slots of [1, ...] calls with the pool and the
    codebooks shared equals one batched call, bit for bit."""
    (q, w, pool, books, lens, table), _ = _paged(2, 3, 4, 32, 8, 16, 16, 12, (150, 192, 33))
    one = functools.partial(pq_topc, num_candidates=20, implementation="triton", page=16)
    per_slot = jax.vmap(lambda q, w, n, t: jax.tree.map(
        lambda x: x[0], one(q[None], w[None], pool, books, n[None], page_table=t[None])))
    got = per_slot(q, w, lens, table)
    want = one(q, w, pool, books, lens, page_table=table)
    for g, x in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(x))


def test_paged_triton_lowers_for_cuda_at_the_v4_shape():
    """B 8 requests of 131072 positions in pages of 64 from a shared pool: the fused score
    kernel and topk's three, as unpaged."""
    s = jax.ShapeDtypeStruct
    specs = (s((8, 64, 128), jnp.bfloat16), s((8, 64), jnp.float32),
             s((8 * 2048 * 64, 32), jnp.uint8), s((32, 256, 4), jnp.float32),
             s((8,), jnp.int32), s((8, 2048), jnp.int32))
    text = common.lower_for_cuda(
        lambda q, w, pool, books, n, t: pq_topc(q, w, pool, books, n, num_candidates=2048,
                                                implementation="triton", page_table=t, page=64),
        *specs)
    assert "pq_coarse_scores_count" in text
    assert text.count(common.TRITON_CALL_TARGET) == 4


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_paged_jax_triton_compiles_for_sm90(fp8):
    """With the triton package (no GPU needed; skipped without it): the paged score kernel
    compiles to the same tile dot as the unpaged one."""
    pytest.importorskip("triton")
    from pallas_kernels.pq_topc import jax_triton as pq_jt

    lay = pq_jt.layout(64, 32, 256, 4, fp8=fp8)
    ptx = pq_jt.compile_ptx(lay, 131072, page=64, max_pages=2048)
    kind = "e4m3.e4m3" if fp8 else "bf16.bf16"
    assert f".f32.{kind}" in ptx and "wgmma.mma_async" in ptx


@pytest.mark.parametrize("change, match", [
    (dict(page=0), "page must be a static int >= 1"),
    (dict(pool=np.zeros((30, 8), np.uint8)), "codes has 30 rows, not whole pages of 16"),
    (dict(pool=np.zeros((32, 5), np.uint8)), r"codes must be a pool \[R, M\] with M=8"),
    (dict(pool=np.zeros((32, 8), np.int32)), "codes must be uint8"),
    (dict(table=np.zeros((2, 4), np.int32)), r"page_table must be \[B, MP\] with B=3"),
    (dict(table=np.zeros((3, 4), np.float32)), "page_table must be int32"),
])
def test_bad_paged_inputs(change, match):
    (q, w, pool, books, lens, table), _ = _paged(3, 3, 4, 32, 8, 16, 16, 4, (64, 10, 0))
    args = dict(pool=pool, table=table, page=16) | change
    with pytest.raises(ValueError, match=f"pq_topc: {match}"):
        pq_topc(q, w, args["pool"], books, lens, num_candidates=4, implementation="xla",
                page_table=args["table"], page=args["page"])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "jax_triton"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_paged_codes_give_the_gathered_codes_result(impl, precision):
    """V4's coarse pass (H 64, D 128, M 32, K 256) at B 4 x N 131072 in pages of 64, ragged
    lengths: the paged kernel's sets and scores are the unpaged kernel's on gathered codes."""
    lengths = (131072, 5000, 0, 131072 - 100)
    (q, w, pool, books, lens, table), gathered = _paged(4, 4, 64, 128, 32, 256, 64, 2048,
                                                        lengths)
    got = pq_topc(q, w, pool, books, lens, num_candidates=2048, implementation=impl,
                  precision=precision, page_table=table, page=64)
    want = pq_topc(q, w, gathered, books, lens, num_candidates=2048, implementation=impl,
                   precision=precision)
    assert_same_sets(got[0], want[0])
    order = lambda p, v: np.take_along_axis(np.asarray(v), np.argsort(np.asarray(p)), 1)  # noqa
    np.testing.assert_array_equal(order(*got), order(*want))
