"""A request's result does not depend on the batch it is computed in (issue 15: speculative
verification runs LeanSparse's per-query selection in other batches than the plain decode step).

For every kernel the verification runs per query with implementation "triton" (``pq_topc``,
``index_scores``, ``topk``) and for LeanSparse's coarse-to-fine selection built from them, one
row computed alone, in a batch of 4 and in a batch of 20 (other rows random) gives the same bits
(Pallas interpret mode on CPU: it runs the block config a batch size would pick, so a config
that changed a row's reduction order with the batch would show here). Batches are formed both
as the op's own leading axis B and, as the decode and verification steps do, by ``jax.vmap``
over slots of a B = 1 call.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.indexing.coarse_to_fine import coarse_to_fine
from lsparse_jax.methods.leansparse import coarse_topc
from pallas_kernels.index_scores import triton as index_triton
from pallas_kernels.index_scores.api import index_scores
from pallas_kernels.pq_topc.api import pq_topc
from pallas_kernels.topk.api import topk

BATCHES = (1, 4, 20)
ROWS = max(BATCHES)
H, D, M, K, N = 4, 32, 8, 16, 256  # the small model's indexer (H, D), PQ with d = 4


def by_position(positions, values):
    """A row's (positions, values) as a set, in position order (the kernels return sets)."""
    positions, values = np.asarray(positions), np.asarray(values)
    order = np.argsort(np.where(positions >= 0, positions, np.iinfo(np.int32).max),
                       kind="stable")
    return positions[order], values[order]


def assert_rows_equal(results, what):
    """results: per batch size, row 0's arrays; all bit-equal to the first's."""
    ref = results[0]
    for b, got in zip(BATCHES[1:], results[1:]):
        for x, y in zip(ref, got):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8),
                                          np.asarray(y).view(np.uint8),
                                          err_msg=f"{what}: row 0 alone vs in a batch of {b}")


def pq_inputs(seed=0, rows=ROWS):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((rows, H, D)).astype(np.float32)
    w = rng.standard_normal((rows, H)).astype(np.float32)
    codes = rng.integers(0, K, (rows, N, M)).astype(np.uint8)
    books = rng.standard_normal((M, K, D // M)).astype(np.float32)
    lengths = rng.integers(1, N + 1, rows).astype(np.int32)
    lengths[0] = 200
    return q, w, codes, books, lengths


def fp8_inputs(c, seed=1, rows=ROWS):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((rows, H, D)).astype(np.float32)
    w = rng.standard_normal((rows, H)).astype(np.float32)
    keys = jnp.asarray(rng.standard_normal((rows, c, D)), jnp.float8_e4m3fn)
    scales = rng.uniform(0.5, 2.0, (rows, c, 1)).astype(np.float32)
    valid = rng.random((rows, c)) < 0.9
    return q, w, keys, scales, valid


@pytest.mark.slow  # interpret mode: ~20 s
def test_topk_row_does_not_depend_on_the_batch():
    rng = np.random.default_rng(2)
    scores = rng.standard_normal((max(BATCHES), N)).astype(np.float32)
    scores[0, 10:20] = scores[0, 5]  # ties at the boundary: the lower positions win
    lengths = rng.integers(1, N + 1, max(BATCHES)).astype(np.int32)
    lengths[0] = N
    run = functools.partial(topk, k=16, implementation="triton")
    direct = [by_position(*(a[0] for a in run(scores[:b], lengths[:b]))) for b in BATCHES]
    assert_rows_equal(direct, "topk (B axis)")
    mapped = jax.vmap(lambda s, n: run(s[None], n[None]))
    vmapped = [by_position(*(a[0, 0] for a in mapped(scores[:b], lengths[:b])))
               for b in BATCHES]
    assert_rows_equal(vmapped, "topk (vmap)")
    assert_rows_equal([direct[0], vmapped[0]], "topk B axis vs vmap")


@pytest.mark.slow  # interpret mode: ~25 s
def test_pq_topc_row_does_not_depend_on_the_batch():
    q, w, codes, books, lengths = pq_inputs()
    run = functools.partial(pq_topc, num_candidates=64, implementation="triton")
    direct = [by_position(*(a[0] for a in run(q[:b], w[:b], codes[:b], books, lengths[:b])))
              for b in BATCHES]
    assert_rows_equal(direct, "pq_topc (B axis)")
    mapped = jax.vmap(lambda q, w, c, n: run(q[None], w[None], c[None], books, n[None]))
    vmapped = [by_position(*(a[0, 0] for a in mapped(q[:b], w[:b], codes[:b], lengths[:b])))
               for b in BATCHES]
    assert_rows_equal(vmapped, "pq_topc (vmap)")
    assert_rows_equal([direct[0], vmapped[0]], "pq_topc B axis vs vmap")


def test_index_scores_row_does_not_depend_on_the_batch():
    """C = C_lean + tail (64 + 16) as in leansparse; and the one batch-dependent knob of
    ``default_config``, STEPS (blocks merged per program once there are >= 2 * MIN_PROGRAMS
    programs), only loops over candidate blocks: a row's scores are the same bits at every
    STEPS (each candidate's dot is the same [BC, BS] x [BS, HP] tile)."""
    q, w, keys, scales, valid = fp8_inputs(80)
    run = functools.partial(index_scores, implementation="triton")
    direct = [(run(q[:b], w[:b], keys[:b], scales[:b], valid[:b])[0],) for b in BATCHES]
    assert_rows_equal(direct, "index_scores (B axis)")
    mapped = jax.vmap(lambda *a: run(*(x[None] for x in a)))
    vmapped = [(mapped(q[:b], w[:b], keys[:b], scales[:b], valid[:b])[0, 0],)
               for b in BATCHES]
    assert_rows_equal(vmapped, "index_scores (vmap)")
    assert_rows_equal([direct[0], vmapped[0]], "index_scores B axis vs vmap")
    # STEPS 1, 2, 4 over 512 candidates in blocks of 128
    q, w, keys, scales, valid = (a[:2] for a in fp8_inputs(512, seed=3))
    by_steps = [(index_triton.index_scores_triton(q, w, keys, scales, valid, block_c=128,
                                                  steps=s)[0],) for s in (1, 2, 4)]
    assert_rows_equal(by_steps, "index_scores by STEPS")  # labels: 1 vs 2, 1 vs 4


def lean_selection(books, q, w, codes, length, keys, scales, tail, *, implementation):
    """LeanSparse's selection for one query as ``CoarseToFineIndex.select_one`` composes it
    (``coarse_topc`` -> ``coarse_to_fine`` with exact rescoring by ``index_scores``), the
    exact keys held in memory (the key cache only moves them): positions [k]."""
    cand, cand_scores = coarse_topc(q[None], w[None], codes[None], books, length[None], 32,
                                    implementation)

    def exact(retained):
        ok = retained >= 0
        at = jnp.maximum(retained, 0)
        s = index_scores(q[None], w[None], keys[at][None], scales[at][None], ok[None],
                         implementation=implementation)
        return s[0], None

    selected, _, _ = coarse_to_fine(cand[0], cand_scores[0], jnp.ones(cand.shape[1], bool),
                                    tail, exact, top_k=16, filter_offset=None)
    return selected


@pytest.mark.parametrize("implementation", [
    pytest.param("triton", marks=pytest.mark.slow), "xla"])
def test_leansparse_selection_does_not_depend_on_the_batch(implementation):
    """The whole per-query selection, vmapped over slots as both steps run it."""
    q, w, codes, books, lengths = pq_inputs(seed=4)
    rng = np.random.default_rng(5)
    keys = jnp.asarray(rng.standard_normal((max(BATCHES), N + 16, D)), jnp.float8_e4m3fn)
    scales = rng.uniform(0.5, 2.0, (max(BATCHES), N + 16, 1)).astype(np.float32)
    tail = np.broadcast_to(N + np.arange(16, dtype=np.int32), (max(BATCHES), 16))
    run = jax.jit(jax.vmap(functools.partial(lean_selection, books,
                                             implementation=implementation)))
    got = [(run(q[:b], w[:b], codes[:b], lengths[:b], keys[:b], scales[:b], tail[:b])[0],)
           for b in BATCHES]
    assert_rows_equal(got, f"leansparse selection ({implementation})")
    assert (np.asarray(got[0][0]) >= 0).all()
