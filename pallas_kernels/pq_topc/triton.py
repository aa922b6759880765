"""Pallas-Triton ``pq_topc``: fused PQ decode + bf16 tensor-core coarse scores, then top-C.

Stage 1 (this file's kernel, grid (B, N / SPAN)): each program loads request b's query block
(bf16, pre-transposed to [D, H]) and head weights once, then walks its SPAN positions in
sub-blocks of BLOCK_N keys. For each sub-block it loads the uint8 codes [BLOCK_N, M], decodes
them on chip by gathering one centroid row per (key, subspace) from the flattened bf16 codebook
ref, takes keys @ q^T on the tensor cores (bf16 operands, f32 accumulation), applies ReLU and
the weighted head sum, masks positions >= lengths[b] to -inf and stores the [BLOCK_N] scores
into a [B, N] f32 buffer. Sub-blocks wholly past lengths[b] skip the decode and the dot and
just store -inf, so the work follows the real lengths, not the buffer size N. Per key only its
codes come in from HBM (M bytes) and one f32 goes out; the codebook (M * K * D/M bf16, 64 KiB
at M=32, K=256, D=128) stays in L1/L2.

Stage 2 selects the top-C eligible positions of every score row with the sibling op
``pallas_kernels.topk`` (its Pallas-Triton kernel by default; see ``select_top_c``).

Precision: q and the codebooks are rounded to bf16 (relative error <= 2^-9 each; the dot
accumulates in f32), so scores differ from the f32 reference by a small fraction of the largest
|score| (tests hold them to ``TOLERANCE['bfloat16']`` = 2e-2) and top-C sets may differ at the
boundary; inputs exact in bf16 (small integers, dyadic weights) give bit-identical scores.

Pallas-Triton needs power-of-two block shapes and tl.dot needs every dim >= 16, so the wrapper
pads with zeros where needed (exact: a zero query row / zero codebook column adds nothing):
H to max(16, 2^h), D/M to 2^d, M to a power of two with M * D/M >= 16, N to a multiple of SPAN
(padded positions are >= N >= lengths, hence -inf). At the V4-Flash shape (H=64, D=128, M=32,
K=256, N=131072) nothing is padded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import common
from pallas_kernels.topk import topk

MIN_DOT_DIM = 16  # tl.dot needs every operand dim >= 16


@dataclasses.dataclass(frozen=True)
class Params:
    """Launch parameters of the coarse-score kernel (all powers of two).

    block_n: keys per sub-block (rows of the dot); blocks_per_program: sub-blocks one program
    walks with its query block kept on chip (SPAN = block_n * blocks_per_program).
    """

    block_n: int = 128
    blocks_per_program: int = 4
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_PARAMS = Params()
# Tuned parameters keyed by (H, D, M, K) after padding. Empty: no GPU was available to tune on;
# candidates to sweep on the H200: block_n in {64, 128, 256}, blocks_per_program in {1, 4, 16},
# num_warps in {4, 8}, num_stages in {2, 3}.
TUNED: dict[tuple[int, int, int, int], Params] = {}


def _pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    return 1 << (max(int(x), 1) - 1).bit_length()


def _coarse_kernel(
    # inputs
    lengths_ref,  # [1] int32: lengths[b]
    qt_ref,  # [D, H] bf16: q[b]^T
    w_ref,  # [H] f32: weights[b]
    codes_ref,  # [SPAN, M] uint8: codes[b, SPAN block]
    books_ref,  # [M * K, d] bf16: codebooks, row j * K + k = C_j[k] (whole array, any space)
    # outputs
    scores_ref,  # [SPAN] f32: coarse scores, -inf at positions >= lengths[b]
    # scratch: none
    *,
    block_n: int,
    blocks_per_program: int,
    num_centroids: int,
):
    """Coarse PQ scores of one request's SPAN positions.

    Notation: b = program_id(0) request, H heads, D = M * d query/key dim, M subspaces of d
    dims, K centroids per subspace, BLOCK_N keys per sub-block, SPAN = BLOCK_N *
    blocks_per_program positions per program, starting at program_id(1) * SPAN.
    Math: s[n] = sum_h w[h] * ReLU( sum_j q[h, j*d:(j+1)*d] . C_j[codes[n, j]] ), with the
    decoded key k[n] = concat_j C_j[codes[n, j]] formed on chip and s = ReLU(k @ q^T) @ w.
    """
    num_sub = codes_ref.shape[-1]  # M
    dim = qt_ref.shape[0]  # D
    length = lengths_ref[0]
    qt = qt_ref[...]  # [D, H] bf16, kept on chip for the whole span
    w = w_ref[...]  # [H] f32
    sub_base = jnp.arange(num_sub, dtype=jnp.int32) * num_centroids  # [M]: row of C_j[0]
    span_start = pl.program_id(1) * (block_n * blocks_per_program)

    def body(i, carry):
        start = pl.multiple_of(i * block_n, block_n)
        rows = pl.ds(start, block_n)
        # Garbage codes past the length may be >= K: clamp so every gather stays in bounds.
        # Codes are read once: stream them past the cache that holds the codebook.
        codes = pltriton.load(codes_ref.at[rows, :], eviction_policy="evict_first")  # [BN, M]
        codes = jnp.minimum(codes.astype(jnp.int32), num_centroids - 1)
        flat = (codes + sub_base[None, :]).reshape(block_n * num_sub)  # [BN * M]
        keys = books_ref[flat, :].reshape(block_n, dim)  # [BN, D] bf16, decoded keys
        dots = jnp.dot(keys, qt, preferred_element_type=jnp.float32)  # [BN, H]
        s = jnp.sum(jnp.maximum(dots, 0.0) * w[None, :], axis=1)  # [BN]
        pos = span_start + start + jnp.arange(block_n, dtype=jnp.int32)  # [BN]
        scores_ref[rows] = jnp.where(pos < length, s, -jnp.inf)
        return carry

    def fill(i, carry):  # a sub-block wholly past the length: no decode, no dot
        rows = pl.ds(pl.multiple_of(i * block_n, block_n), block_n)
        scores_ref[rows] = jnp.full((block_n,), -jnp.inf, jnp.float32)
        return carry

    # Sub-blocks holding an eligible position come first; short rows skip the rest's work.
    remaining = jnp.maximum(length - span_start, 0)
    live = jnp.minimum((remaining + block_n - 1) // block_n, blocks_per_program)
    lax.fori_loop(0, live, body, 0)
    lax.fori_loop(live, blocks_per_program, fill, 0)


def _params_for(h: int, d: int, m: int, k: int, n: int, params: Params | None) -> Params:
    """Tuned (or given) parameters, made powers of two and shrunk for short N."""
    p = params or TUNED.get((h, d, m, k), DEFAULT_PARAMS)
    block_n = max(MIN_DOT_DIM, _pow2(p.block_n))
    block_n = min(block_n, max(MIN_DOT_DIM, _pow2(n)))
    bpp = min(_pow2(p.blocks_per_program), _pow2(-(-n // block_n)))
    return dataclasses.replace(p, block_n=block_n, blocks_per_program=bpp)


def coarse_scores_triton(q, weights, codes, codebooks, lengths, *, params: Params | None = None,
                         interpret: bool | None = None) -> jnp.ndarray:
    """Masked coarse scores [B, N] f32 (-inf at positions >= lengths[b]) by the Pallas kernel.

    q [B, H, D], weights [B, H], codes [B, N, M] uint8, codebooks [M, K, D/M], lengths [B]
    (validated by ``api.pq_topc``). ``params`` overrides the tuned launch parameters;
    ``interpret`` defaults to ``common.interpret()`` (True without a GPU, False while
    ``common.abstract_gpu`` lowers for CUDA).
    """
    if interpret is None:  # resolved outside jit: it reads the abstract-mesh context
        interpret = common.interpret()
    return _coarse_scores(q, weights, codes, codebooks, lengths, params=params,
                          interpret=interpret)


@functools.partial(jax.jit, static_argnames=("params", "interpret"))
def _coarse_scores(q, weights, codes, codebooks, lengths, *, params: Params | None,
                   interpret: bool) -> jnp.ndarray:
    b, h, d = q.shape
    n, m = codes.shape[1:]
    k, ds = codebooks.shape[1:]
    # Zero padding to power-of-two dims that tl.dot accepts (exact, see the module docstring).
    hp, dsp = max(MIN_DOT_DIM, _pow2(h)), _pow2(ds)
    mp = max(_pow2(m), MIN_DOT_DIM // min(dsp, MIN_DOT_DIM))
    dp = mp * dsp
    p = _params_for(hp, dp, mp, k, n, params)
    span = p.block_n * p.blocks_per_program
    n_pad = -(-n // span) * span

    qt = q.astype(jnp.bfloat16).reshape(b, h, m, ds)
    qt = jnp.pad(qt, ((0, 0), (0, hp - h), (0, mp - m), (0, dsp - ds)))
    qt = qt.reshape(b, hp, dp).transpose(0, 2, 1)  # [B, D', H']
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, hp - h)))  # [B, H']
    books = jnp.pad(codebooks.astype(jnp.bfloat16), ((0, mp - m), (0, 0), (0, dsp - ds)))
    books = books.reshape(mp * k, dsp)  # [M' * K, d']
    if (n_pad, mp) != (n, m):
        codes = jnp.pad(codes, ((0, 0), (0, n_pad - n), (0, mp - m)))
    lens = jnp.clip(lengths.astype(jnp.int32), 0, n)  # padded positions are never eligible

    kernel = functools.partial(_coarse_kernel, block_n=p.block_n,
                               blocks_per_program=p.blocks_per_program, num_centroids=k)
    scores = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, n_pad), jnp.float32),
        grid=(b, n_pad // span),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),  # lengths
            pl.BlockSpec((None, dp, hp), lambda i, j: (i, 0, 0)),  # q^T
            pl.BlockSpec((None, hp), lambda i, j: (i, 0)),  # weights
            pl.BlockSpec((None, span, mp), lambda i, j: (i, j, 0)),  # codes
            pl.BlockSpec(memory_space=pl.ANY),  # codebooks, gathered from
        ],
        out_specs=pl.BlockSpec((None, span), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=p.num_warps,
                                                num_stages=p.num_stages),
        interpret=interpret,
        name="pq_coarse_scores",
    )(lens, qt, w, codes, books)
    return scores[:, :n] if n_pad != n else scores


def select_top_c(scores, lengths, num_candidates: int, implementation: str = "triton"):
    """Top-C eligible positions of each score row [B, N] f32 by ``pallas_kernels.topk``
    (``implementation`` "triton": its Pallas-Triton kernel; "xla": ``lax.top_k``):
    (positions [B, C] int32 in any order, -1 padded; values [B, C] f32, -inf at padding)."""
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, scores.shape[1])
    return topk(scores, lengths, num_candidates, implementation=implementation)


def pq_topc_triton(q, weights, codes, codebooks, lengths, *, num_candidates: int,
                   params: Params | None = None, interpret: bool | None = None,
                   topk_implementation: str = "triton"):
    """Coarse scores by the Pallas-Triton kernel, then the top-C positions by
    ``select_top_c`` (see the module docstring). Inputs as in ``api.pq_topc``."""
    scores = coarse_scores_triton(q, weights, codes, codebooks, lengths, params=params,
                                  interpret=interpret)
    return select_top_c(scores, lengths, num_candidates, topk_implementation)
