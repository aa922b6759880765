"""``pq_topc``: LeanSparse's coarse pass, the top-C positions of PQ-coded indexer keys.

For each request b, score every eligible position n < lengths[b] of its PQ-coded history with
Eq. 6 and return the C best:

    s[b, n] = sum_h weights[b, h] * ReLU( sum_j q[b, h, j-th slice] . codebooks[j, codes[b, n, j]] )

Implementations: "xla" (``reference.py``: decode + f32 einsum + ``lax.top_k``), "triton"
(``triton.py``: fused decode + bf16 tensor-core score kernel that also runs the first counting
pass of the top-C threshold search, then the rest of ``pallas_kernels.topk``'s selection;
interpret mode without a GPU) and "jax_triton" (``jax_triton.py``: a plain Triton score kernel
that holds the packed codebook on chip and decodes with ``tl.gather``, then
``pallas_kernels.topk``; GPU only). None picks "triton" on a GPU and "xla" elsewhere.

precision: "bf16" (the default) rounds q and the codebooks to bf16 in the kernels (the "xla"
reference scores the given values exactly in f32); "fp8" quantizes them to float8_e4m3fn with
per-subspace codebook and per-(request, head) query scales (``reference.quantize_fp8``, whose
docstring states the scale rule), the kernels take an e4m3 x e4m3 dot with f32 accumulation
(Hopper fp8 tensor cores: twice the bf16 rate) and "xla" scores the same quantized values
exactly in f32, so kernel and reference differ only in accumulation order.
"""

from __future__ import annotations

import operator
from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.pq_topc import reference
from pallas_kernels.pq_topc import triton as triton_impl

OP = "pq_topc"
AVAILABLE = ("xla", "triton", "jax_triton")
MAX_CENTROIDS = 256  # codes are uint8

_pq_topc_xla = jax.jit(reference.pq_topc_xla, static_argnames=("num_candidates", "precision"))


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape)


def _validate(q, weights, codes, codebooks, lengths, num_candidates) -> int:
    """Raises ValueError naming the bad argument; returns num_candidates as an int."""
    try:
        if isinstance(num_candidates, bool):
            raise TypeError
        c = operator.index(num_candidates)
    except TypeError:
        raise ValueError(f"{OP}: num_candidates={num_candidates!r} must be an int >= 1") from None
    if c < 1:
        raise ValueError(f"{OP}: num_candidates={c} must be >= 1")
    if q.ndim != 3:
        raise ValueError(f"{OP}: q must be 3-D [B, H, D], got shape {_shape(q)}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{OP}: q must be float32 or bfloat16, got dtype {q.dtype}")
    b, h, d = q.shape
    if weights.shape != (b, h):
        raise ValueError(f"{OP}: weights must be [B, H] = {(b, h)} (from q), got shape "
                         f"{_shape(weights)}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"{OP}: weights must be floating point (float32), got dtype "
                         f"{weights.dtype}")
    if codebooks.ndim != 3:
        raise ValueError(f"{OP}: codebooks must be 3-D [M, K, D/M], got shape "
                         f"{_shape(codebooks)}")
    if not jnp.issubdtype(codebooks.dtype, jnp.floating):
        raise ValueError(f"{OP}: codebooks must be floating point (float32), got dtype "
                         f"{codebooks.dtype}")
    m, k, ds = codebooks.shape
    if not 1 <= k <= MAX_CENTROIDS:
        raise ValueError(f"{OP}: codebooks have K={k} centroids; need 1 <= K <= {MAX_CENTROIDS} "
                         "(codes are uint8)")
    if m < 1 or ds < 1 or m * ds != d:
        raise ValueError(f"{OP}: codebooks [M, K, D/M] have M={m} subspaces of dim {ds} "
                         f"(D={m * ds}) but q has D={d}")
    if codes.ndim != 3 or codes.shape[0] != b or codes.shape[2] != m:
        raise ValueError(f"{OP}: codes must be [B, N, M] with B={b} (from q) and M={m} (from "
                         f"codebooks), got shape {_shape(codes)}")
    if codes.dtype != jnp.uint8:
        raise ValueError(f"{OP}: codes must be uint8, got dtype {codes.dtype}")
    if codes.shape[1] < 1:
        raise ValueError(f"{OP}: codes hold N=0 positions; need N >= 1")
    if lengths.shape != (b,):
        raise ValueError(f"{OP}: lengths must be [B] = {(b,)} (from q), got shape "
                         f"{_shape(lengths)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{OP}: lengths must be integers (int32), got dtype {lengths.dtype}")
    return int(c)


def _validate_paged(q, codes, page_table, page, m: int) -> None:
    """Raises ValueError naming the bad argument of a paged call (codes a pool of pages)."""
    if isinstance(page, bool) or not isinstance(page, int) or page < 1:
        raise ValueError(f"{OP}: page must be a static int >= 1 with page_table, got {page!r}")
    if codes.ndim != 2 or codes.shape[1] != m:
        raise ValueError(f"{OP}: codes must be a pool [R, M] with M={m} (from codebooks) when "
                         f"page_table is given, got shape {_shape(codes)}")
    if codes.shape[0] % page or codes.shape[0] == 0:
        raise ValueError(f"{OP}: codes has {codes.shape[0]} rows, not whole pages of {page}")
    if codes.dtype != jnp.uint8:
        raise ValueError(f"{OP}: codes must be uint8, got dtype {codes.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != q.shape[0] or page_table.shape[1] < 1:
        raise ValueError(f"{OP}: page_table must be [B, MP] with B={q.shape[0]} (from q) and "
                         f"MP >= 1, got shape {_shape(page_table)}")
    if page_table.dtype != jnp.int32:
        raise ValueError(f"{OP}: page_table must be int32, got dtype {page_table.dtype}")


def pq_topc(q, weights, codes, codebooks, lengths, *, num_candidates: int,
            implementation: str | None = None, precision: str = "bf16", page_table=None,
            page: int | None = None):
    """Top-C positions of PQ-coded keys by coarse score (LeanSparse's coarse pass).

    Notation: B requests, H indexer heads, D head dim, M subspaces of d = D / M dims, K <= 256
    centroids per subspace, N positions per request, C = num_candidates.
    Args:
      q: [B, H, D] float32 or bfloat16 indexer queries.
      weights: [B, H] float32 head weights.
      codes: [B, N, M] uint8 PQ codes; positions n >= lengths[b] may hold garbage (any byte).
        Codes of eligible positions must be < K.
      codebooks: [M, K, d] float32, shared by the batch.
      lengths: [B] int32; position n of request b is eligible iff n < lengths[b].
      num_candidates: C >= 1 (may exceed N: the rest is padding).
      implementation: "xla", "triton", "jax_triton" (GPU only) or None (triton on a GPU, xla
        elsewhere).
      precision: "bf16" or "fp8" (see the module docstring; all implementations).
      page_table: optional [B, MP] int32 with ``page`` P (static int): codes is then a pool
        [R, M] of code rows (R a whole number of pages) shared by the batch, and position n of
        request b is its row page_table[b, n // P] * P + n % P (N = MP * P): the codes are read
        in place (a device page pool) instead of from a gathered [B, N, M] copy. Eligible
        positions must lie on mapped pages (an entry -1 reads row 0, as garbage codes would).
        Vmappable over requests with the pool shared (in_axes None).
    Returns:
      positions [B, C] int32: the set of the C best eligible positions (higher score first,
        ties to the lower position), -1 where fewer than C are eligible; in any order (the
        "xla" implementation returns them best-first).
      scores [B, C] float32 aligned with positions, -inf where the position is -1. The
        "triton" and "jax_triton" scores use bf16 q and codebooks (~1e-2 relative to the f32
        reference); with precision="fp8" every implementation scores e4m3 values (~3e-2
        relative to the unquantized scores; kernels within f32 accumulation of "xla").
    Raises ValueError on bad shapes, dtypes, num_candidates, implementation or precision.
    """
    if precision not in reference.PRECISIONS:
        raise ValueError(f"{OP}: precision={precision!r} is unknown; allowed: "
                         f"{reference.PRECISIONS}")
    impl = common.choose(OP, implementation, AVAILABLE, fastest_on_gpu="triton")
    q, weights, codes = jnp.asarray(q), jnp.asarray(weights), jnp.asarray(codes)
    codebooks, lengths = jnp.asarray(codebooks), jnp.asarray(lengths)
    if page_table is not None:
        return _pq_topc_paged(q, weights, codes, codebooks, lengths, jnp.asarray(page_table),
                              page, num_candidates, impl, precision)
    c = _validate(q, weights, codes, codebooks, lengths, num_candidates)
    weights = weights.astype(jnp.float32)
    codebooks = codebooks.astype(jnp.float32)
    lengths = lengths.astype(jnp.int32)
    if impl == "xla":
        fn = partial(_pq_topc_xla, num_candidates=c, precision=precision)
    elif impl == "jax_triton":
        from pallas_kernels.pq_topc.jax_triton import pq_topc_jax_triton

        # vmappable (the decode step runs the coarse pass under a vmap over slots); the
        # codebooks are shared by the batch
        fn = common.batch_folding(partial(pq_topc_jax_triton, num_candidates=c,
                                          precision=precision), (True, True, True, False, True))
    else:
        fn = partial(triton_impl.pq_topc_triton, num_candidates=c, precision=precision)
    return fn(q, weights, codes, codebooks, lengths)


def _pq_topc_paged(q, weights, pool, codebooks, lengths, page_table, page, num_candidates,
                   impl: str, precision: str):
    """``pq_topc`` with codes read through page tables (arguments as there, validated here)."""
    if q.ndim != 3 or codebooks.ndim != 3:  # raises, naming q or codebooks
        _validate(q, weights, pool, codebooks, lengths, num_candidates)
    _validate_paged(q, pool, page_table, page, codebooks.shape[0])
    n = page_table.shape[1] * page
    stand_in = jax.ShapeDtypeStruct((q.shape[0], n, pool.shape[-1]), pool.dtype)
    c = _validate(q, weights, stand_in, codebooks, lengths, num_candidates)
    weights = weights.astype(jnp.float32)
    codebooks = codebooks.astype(jnp.float32)
    lengths = lengths.astype(jnp.int32)
    if impl == "xla":
        ids, _ = common.paged_rows(page_table, n, page)
        return _pq_topc_xla(q, weights, pool[ids], codebooks, lengths, num_candidates=c,
                            precision=precision)
    if impl == "jax_triton":
        from pallas_kernels.pq_topc.jax_triton import pq_topc_jax_triton as kernel
    else:
        kernel = triton_impl.pq_topc_triton

    def call(q, weights, pool, codebooks, lengths, page_table):
        return kernel(q, weights, pool, codebooks, lengths, num_candidates=c,
                      precision=precision, page_table=page_table, page=page)

    # the pool and the codebooks are shared by the batch
    return common.batch_folding(call, (True, True, False, False, True, True))(
        q, weights, pool, codebooks, lengths, page_table)
