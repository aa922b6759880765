"""Pallas-Triton ``pq_topc``: PQ decode + bf16 tensor-core coarse scores fused with the first
counting pass of the top-C selection.

Score kernel (grid (B, N / SPAN)): each program loads request b's query block (bf16,
pre-transposed to [D, H]) and head weights once, then walks its SPAN positions in sub-blocks of
BLOCK_N keys. For each sub-block it loads the uint8 codes [BLOCK_N, M], decodes them on chip by
gathering one centroid row per (key, subspace) from the flattened bf16 codebook ref, takes
keys @ q^T on the tensor cores (bf16 operands, f32 accumulation), applies ReLU and the weighted
head sum, masks positions >= lengths[b] to -inf and stores the [BLOCK_N] scores into a [B, N]
f32 buffer. Sub-blocks wholly past lengths[b] skip the decode and the dot and just store -inf,
so the work follows the real lengths, not the buffer size N. Per key only its codes come in
from HBM (M bytes) and one f32 goes out; the codebook (M * K * D/M bf16, 64 KiB at M=32,
K=256, D=128) stays in L1/L2.

Top-C (``pallas_kernels.topk``'s threshold search; see its module docstring), fused=True, the
default:
  1. XLA pre-pass: Eq. 6 at topk's strided sample of positions (``sample_scores``: about 1024
     per row, bf16 operands as in the kernel), and from it topk's first NT thresholds
     (``topk.triton.sample_thresholds``).
  2. The score kernel also counts, per threshold, the eligible scores of its span whose
     order-preserving keys are >= it (from the f32 values it stores, so the counts are exactly
     those of topk's counting kernel on the stored row) and writes [B, N / SPAN, NT] counts;
     XLA sums them into topk blocks (BLOCK = max(SPAN, topk's block), a whole number of spans).
     This replaces topk's first counting pass, one full read of the [B, N] score row.
  3. ``topk.triton.topk_after_first_pass`` continues from that bracket with topk's own code:
     the refine launch (further counting passes, in-kernel, only for rows whose bracket still
     holds > CAP positions, rare; the other rows' programs exit at once: no host wait),
     the selection kernel (one more read of the score row) and stage 2, on the padded
     [B, N_pad] score row (padded positions are never eligible).
Not fused: the score row is still written to HBM and read back by the selection kernel (the
winners' positions are only known after the counts of all spans). fused=False runs the score
kernel, then the whole ``pallas_kernels.topk`` (``select_top_c``; Triton or XLA), as before.

Precision: q and the codebooks are rounded to bf16 (relative error <= 2^-9 each; the dot
accumulates in f32), so scores differ from the f32 reference by a small fraction of the largest
|score| (tests hold them to ``TOLERANCE['bfloat16']`` = 2e-2) and top-C sets may differ at the
boundary; inputs exact in bf16 (small integers, dyadic weights) give bit-identical scores.
precision="fp8": q and the codebooks quantized by ``reference.quantize_fp8`` (scales folded
into the head weights), e4m3 codebook gathers and an e4m3 x e4m3 dot (contraction dim >= 32)
with f32 accumulation; the fp8 reference twin differs only in accumulation order.

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
from pallas_kernels.fp8_dot import dot_f32
from pallas_kernels.pq_topc import reference
from pallas_kernels.topk import topk
from pallas_kernels.topk import triton as topk_impl
from pallas_kernels.topk.triton import count_at_least, eligible_keys

MIN_DOT_DIM = 16  # tl.dot needs every operand dim >= 16
MIN_DOT_K_FP8 = 32  # and an fp8 dot a contraction dim >= 32 (one e4m3 MMA k-step)


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
# Tuned parameters keyed by (H, D, M, K) after padding. Empty on purpose: the H200 sweep
# (benchmarks/pq_topc_sweep.py, results/gpu_session3/pq_topc_sweep.log) put all 36 launch
# configurations of the score kernel within 15% of each other, and the default was fastest for
# the fused kernel (benchmarks/pq_topc_fused_gpu.py): decode gathers bound it, not the launch.
TUNED: dict[tuple[int, int, int, int], Params] = {}


def _pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    return 1 << (max(int(x), 1) - 1).bit_length()


def _coarse_kernel(*refs, block_n: int, blocks_per_program: int, num_centroids: int,
                   fused: bool, paged: tuple[int, int, int] | None = None, ids=None):
    """Coarse PQ scores of one request's SPAN positions; fused: also their pass-1 counts.

    Refs: inputs  lengths_ref [1] int32 (lengths[b]), qt_ref [D, H] bf16 (q[b]^T), w_ref [H]
                  f32 (weights[b]), codes_ref [SPAN, M] uint8 (codes[b, SPAN block]),
                  books_ref [M * K, d] bf16 (codebooks, row j * K + k = C_j[k]; whole array,
                  any space), fused only: thr_ref [NT] int32 (thresholds of request b)
          outputs scores_ref [SPAN] f32 (-inf at positions >= lengths[b]),
                  fused only: cnt_ref [NT] int32 (#{eligible n in the span : key(s[n]) >= t})
    Notation: b = program_id(0) request, H heads, D = M * d query/key dim, M subspaces of d
    dims, K centroids per subspace, BLOCK_N keys per sub-block, SPAN = BLOCK_N *
    blocks_per_program positions per program, starting at program_id(1) * SPAN; key(.) the
    order-preserving int32 key of ``pallas_kernels.topk``, NT thresholds t.
    Math: s[n] = sum_h w[h] * ReLU( sum_j q[h, j*d:(j+1)*d] . C_j[codes[n, j]] ), with the
    decoded key k[n] = concat_j C_j[codes[n, j]] formed on chip and s = ReLU(k @ q^T) @ w.
    paged = (P, MP, M): codes_ref is instead a pool [R, M] of code rows shared by the batch
    (whole array, any space) and pt_ref [B * MP] int32 (after lengths_ref) the flattened page
    tables: position n reads pool row pt[b * MP + n // P] * P + n % P (row 0 where the page is
    -1: eligible positions must be mapped), subspaces >= M (padding to M') read code 0.
    ids = (b, span index): given instead of read from the grid, for a launch whose grid also
    holds another kernel's programs (``benchmarks/colaunch_gpu.py``).
    """
    if paged is None:
        lengths_ref, qt_ref, w_ref, codes_ref, books_ref, *rest = refs
    else:
        lengths_ref, pt_ref, qt_ref, w_ref, codes_ref, books_ref, *rest = refs
    thr_ref, scores_ref, cnt_ref = rest if fused else (None, rest[0], None)
    thr = thr_ref[...] if fused else None  # [NT] int32
    dim = qt_ref.shape[0]  # D
    num_sub = dim // books_ref.shape[1]  # M (padded)
    length = lengths_ref[0]
    qt = qt_ref[...]  # [D, H] bf16, kept on chip for the whole span
    w = w_ref[...]  # [H] f32
    sub_base = jnp.arange(num_sub, dtype=jnp.int32) * num_centroids  # [M]: row of C_j[0]
    # (read here: interpret mode has no program_id inside loops)
    request, span = ids if ids is not None else (pl.program_id(0), pl.program_id(1))
    span_start = span * (block_n * blocks_per_program)

    def load_codes(start):  # [BN, M] codes of positions span_start + start + [0, BN)
        if paged is None:
            return pltriton.load(codes_ref.at[pl.ds(start, block_n), :],
                                 eviction_policy="evict_first")
        page, max_pages, m = paged
        pos = span_start + start + jnp.arange(block_n, dtype=jnp.int32)
        logical = jnp.minimum(pos // page, max_pages - 1)
        phys = pltriton.load(pt_ref.at[request * max_pages + logical])  # [BN]
        ids = jnp.maximum(phys, 0) * page + pos % page
        cols = jnp.arange(num_sub, dtype=jnp.int32)[None, :]
        return pltriton.load(codes_ref.at[ids[:, None], jnp.minimum(cols, m - 1)],
                             mask=jnp.broadcast_to(cols < m, (block_n, num_sub)), other=0,
                             eviction_policy="evict_first")

    def body(i, acc):
        start = pl.multiple_of(i * block_n, block_n)
        rows = pl.ds(start, block_n)
        # Garbage codes past the length may be >= K: clamp so every gather stays in bounds.
        # Codes are read once: stream them past the cache that holds the codebook.
        codes = load_codes(start)  # [BN, M]
        codes = jnp.minimum(codes.astype(jnp.int32), num_centroids - 1)
        flat = (codes + sub_base[None, :]).reshape(block_n * num_sub)  # [BN * M]
        keys = books_ref[flat, :].reshape(block_n, dim)  # [BN, D] bf16, decoded keys
        dots = dot_f32(keys, qt, (((1,), (0,)), ((), ())))  # [BN, H]
        s = jnp.sum(jnp.maximum(dots, 0.0) * w[None, :], axis=1)  # [BN]
        pos = span_start + start + jnp.arange(block_n, dtype=jnp.int32)  # [BN]
        scores_ref[rows] = jnp.where(pos < length, s, -jnp.inf)
        if not fused:
            return acc
        _, key = eligible_keys(s, span_start + start, length)  # INT32_MIN past the length
        return acc + count_at_least(key, thr)  # [BN, NT]

    def fill(i, carry):  # a sub-block wholly past the length: no decode, no dot, no count
        rows = pl.ds(pl.multiple_of(i * block_n, block_n), block_n)
        scores_ref[rows] = jnp.full((block_n,), -jnp.inf, jnp.float32)
        return carry

    # Sub-blocks holding an eligible position come first; short rows skip the rest's work.
    remaining = jnp.maximum(length - span_start, 0)
    live = jnp.minimum((remaining + block_n - 1) // block_n, blocks_per_program)
    acc = jnp.zeros((block_n, thr.shape[0]), jnp.int32) if fused else jnp.int32(0)
    acc = lax.fori_loop(0, live, body, acc)
    lax.fori_loop(live, blocks_per_program, fill, 0)
    if fused:
        cnt_ref[...] = jnp.sum(acc, axis=0)


def _params_for(h: int, d: int, m: int, k: int, n: int, params: Params | None) -> Params:
    """Tuned (or given) parameters, made powers of two and shrunk for short N."""
    p = params or TUNED.get((h, d, m, k), DEFAULT_PARAMS)
    block_n = max(MIN_DOT_DIM, _pow2(p.block_n))
    block_n = min(block_n, max(MIN_DOT_DIM, _pow2(n)))
    bpp = min(_pow2(p.blocks_per_program), _pow2(-(-n // block_n)))
    return dataclasses.replace(p, block_n=block_n, blocks_per_program=bpp)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Padded sizes of one call (see the module docstring): B, N, N padded to SPAN, H', D' =
    M' * d', M', d', K, and the launch parameters."""

    b: int
    n: int
    n_pad: int
    hp: int
    dp: int
    mp: int
    dsp: int
    k: int
    p: Params
    fp8: bool = False

    @property
    def span(self) -> int:
        return self.p.block_n * self.p.blocks_per_program


def _layout(q, codes, codebooks, params: Params | None, paged=None) -> _Layout:
    """Sizes of one call; fp8 when q (already quantized) is float8_e4m3fn. paged = (page
    table [B, MP], P): codes is a pool [R, M] and N = MP * P."""
    b, h, _ = q.shape
    n, m = codes.shape[1:] if paged is None else (paged[0].shape[1] * paged[1], codes.shape[1])
    k, ds = codebooks.shape[1:]
    fp8 = q.dtype == jnp.float8_e4m3fn
    min_k = MIN_DOT_K_FP8 if fp8 else MIN_DOT_DIM
    # Zero padding to power-of-two dims that tl.dot accepts (exact, see the module docstring).
    hp, dsp = max(MIN_DOT_DIM, _pow2(h)), _pow2(ds)
    mp = max(_pow2(m), min_k // min(dsp, min_k))
    p = _params_for(hp, mp * dsp, mp, k, n, params)
    span = p.block_n * p.blocks_per_program
    n_pad = -(-n // span) * span
    # the padded codes' offsets (per call: under a vmap the batched operand is larger)
    common.check_offsets("pq_topc", codes=codes if paged is not None else
                         jax.ShapeDtypeStruct((b, n_pad, mp), codes.dtype))
    return _Layout(b=b, n=n, n_pad=n_pad, hp=hp, dp=mp * dsp, mp=mp, dsp=dsp,
                   k=k, p=p, fp8=fp8)


def _operands(q, weights, codes, codebooks, lengths, lay: _Layout, paged=None):
    """Kernel operands (lengths [B] clipped to N, q^T [B, D', H'] bf16, weights [B, H'],
    codes [B, N_pad, M'], codebooks [M' * K, d'] bf16; e4m3 instead of bf16 when lay.fp8, the
    inputs then being ``reference.quantize_fp8``'s), zero padded. paged = (page table, P):
    the flattened page table [B * MP] follows the lengths and the pool [R, M] is the codes,
    unpadded (the kernel masks subspaces >= M)."""
    b, h, _ = q.shape
    n, m = lay.n, codebooks.shape[0]
    ds = codebooks.shape[2]
    dtype = jnp.float8_e4m3fn if lay.fp8 else jnp.bfloat16
    qt = q.astype(dtype).reshape(b, h, m, ds)
    qt = jnp.pad(qt, ((0, 0), (0, lay.hp - h), (0, lay.mp - m), (0, lay.dsp - ds)))
    qt = qt.reshape(b, lay.hp, lay.dp).transpose(0, 2, 1)  # [B, D', H']
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, lay.hp - h)))  # [B, H']
    books = jnp.pad(codebooks.astype(dtype),
                    ((0, lay.mp - m), (0, 0), (0, lay.dsp - ds)))
    books = books.reshape(lay.mp * lay.k, lay.dsp)  # [M' * K, d']
    lens = jnp.clip(lengths.astype(jnp.int32), 0, n)  # padded positions are never eligible
    if paged is not None:
        return lens, paged[0].reshape(-1), qt, w, codes, books
    if (lay.n_pad, lay.mp) != (n, m):
        codes = jnp.pad(codes, ((0, 0), (0, lay.n_pad - n), (0, lay.mp - m)))
    return lens, qt, w, codes, books


def _score_call(lay: _Layout, interpret: bool, nt: int | None = None,
                paged: tuple[int, int, int] | None = None):
    """The coarse-score pallas_call, grid (B, N_pad / SPAN): operands -> scores [B, N_pad];
    with nt (fused): operands + thresholds [B, NT] -> (scores, counts [B, N_pad / SPAN, NT]).
    paged = (P, MP, M): the operands of ``_operands(..., paged)`` (``_coarse_kernel``)."""
    fused = nt is not None
    span, grid = lay.span, (lay.b, lay.n_pad // lay.span)
    kernel = functools.partial(_coarse_kernel, block_n=lay.p.block_n,
                               blocks_per_program=lay.p.blocks_per_program, num_centroids=lay.k,
                               fused=fused, paged=paged)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [
        pl.BlockSpec((1,), lambda i, j: (i,)),  # lengths
        *([any_] if paged else []),  # page tables, flattened
        pl.BlockSpec((None, lay.dp, lay.hp), lambda i, j: (i, 0, 0)),  # q^T
        pl.BlockSpec((None, lay.hp), lambda i, j: (i, 0)),  # weights
        any_ if paged else pl.BlockSpec((None, span, lay.mp), lambda i, j: (i, j, 0)),  # codes
        any_,  # codebooks, gathered from
    ]
    out_shape = [jax.ShapeDtypeStruct((lay.b, lay.n_pad), jnp.float32)]
    out_specs = [pl.BlockSpec((None, span), lambda i, j: (i, j))]
    if fused:
        in_specs.append(pl.BlockSpec((None, nt), lambda i, j: (i, 0)))  # thresholds
        out_shape.append(jax.ShapeDtypeStruct((*grid, nt), jnp.int32))
        out_specs.append(pl.BlockSpec((None, None, nt), lambda i, j: (i, j, 0)))
    call = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltriton.CompilerParams(num_warps=lay.p.num_warps,
                                                num_stages=lay.p.num_stages),
        interpret=interpret, name="pq_coarse_scores_count" if fused else "pq_coarse_scores")
    return (lambda *a: tuple(call(*a))) if fused else (lambda *a: call(*a)[0])


def coarse_scores_triton(q, weights, codes, codebooks, lengths, *, params: Params | None = None,
                         interpret: bool | None = None, precision: str = "bf16",
                         page_table=None, page: int | None = None) -> jnp.ndarray:
    """Masked coarse scores [B, N] f32 (-inf at positions >= lengths[b]) by the Pallas kernel.

    q [B, H, D], weights [B, H], codes [B, N, M] uint8, codebooks [M, K, D/M], lengths [B]
    (validated by ``api.pq_topc``). ``params`` overrides the tuned launch parameters;
    ``interpret`` defaults to ``common.interpret()`` (True without a GPU, False while
    ``common.abstract_gpu`` lowers for CUDA). ``precision`` as ``pq_topc_triton``;
    page_table [B, MP] with page P: codes is a pool [R, M] read through it (N = MP * P).
    """
    _check_precision(precision)
    if interpret is None:  # resolved outside jit: it reads the abstract-mesh context
        interpret = common.interpret()
    return _coarse_scores(q, weights, codes, codebooks, lengths, page_table, params=params,
                          interpret=interpret, precision=precision, page=page)


def _check_precision(precision: str) -> None:
    if precision not in reference.PRECISIONS:
        raise ValueError(f"pq_topc: precision={precision!r} is unknown; allowed: "
                         f"{reference.PRECISIONS}")


def _quantized(q, weights, codebooks, precision: str):
    """(q, weights, codebooks) as the kernel takes them: unchanged for "bf16" (rounded in
    ``_operands``), ``reference.quantize_fp8``'s e4m3 values and folded weights for "fp8"."""
    if precision == "fp8":
        return reference.quantize_fp8(q, weights, codebooks)
    return q, weights, codebooks


@functools.partial(jax.jit, static_argnames=("params", "interpret", "precision", "page"))
def _coarse_scores(q, weights, codes, codebooks, lengths, page_table=None, *,
                   params: Params | None, interpret: bool, precision: str,
                   page: int | None = None) -> jnp.ndarray:
    q, weights, codebooks = _quantized(q, weights, codebooks, precision)
    paged = None if page_table is None else (page_table, page)
    lay = _layout(q, codes, codebooks, params, paged)
    kernel_paged = None if paged is None else (page, page_table.shape[1], codes.shape[1])
    scores = _score_call(lay, interpret, paged=kernel_paged)(
        *_operands(q, weights, codes, codebooks, lengths, lay, paged))
    return scores[:, :lay.n] if lay.n_pad != lay.n else scores


# ------------------------------------------------------------------- fused scores + top-C


def sample_scores(q, weights, codes, codebooks, stride: int) -> jnp.ndarray:
    """XLA pre-pass: Eq. 6 at positions 0, st, 2 st, ... (st = stride) with the kernel's bf16
    q and codebooks and f32 accumulation -> [B, ceil(N / st)] f32. Codes are clamped to K - 1
    and nothing is masked (``topk.triton.sample_thresholds`` masks by length).

    Notation: S sampled positions, keys [B, S, D] decoded from codes[:, ::st].
    """
    m, k, ds = codebooks.shape
    idx = jnp.minimum(codes[:, ::stride].astype(jnp.int32), k - 1)  # [B, S, M]
    keys = codebooks.astype(jnp.bfloat16)[jnp.arange(m), idx]  # [B, S, M, d]
    keys = keys.reshape(*idx.shape[:2], m * ds)  # [B, S, D]
    dots = jnp.einsum("bhd,bsd->bhs", q.astype(jnp.bfloat16), keys,
                      preferred_element_type=jnp.float32)  # [B, H, S]
    return jnp.sum(weights.astype(jnp.float32)[:, :, None] * jnp.maximum(dots, 0.0), axis=1)


def _frozen(tunables: dict | None) -> tuple:
    """topk tunables as a hashable jit static: sorted (name, value) pairs."""
    return tuple(sorted((tunables or {}).items()))


def _topk_config(lay: _Layout, num_candidates: int, interpret: bool,
                 tunables: tuple = ()) -> topk_impl.Config:
    """topk's configuration for the padded score rows [B, N_pad]: its tunables (``tunables``,
    (name, value) pairs of ``topk.triton.config`` arguments, override the defaults), the block
    raised to SPAN when SPAN is larger, so that every topk block is a whole number of spans."""
    kw = dict(tunables)
    kw["block"] = max(lay.span, kw.get("block", topk_impl.DEFAULT_BLOCK))
    cfg = topk_impl.config(lay.n_pad, num_candidates, interpret=interpret, **kw)
    if cfg.block % lay.span:
        raise ValueError(f"pq_topc: SPAN={lay.span} exceeds topk's largest block {cfg.block}")
    return cfg


def _to_topk_blocks(counts, span: int, cfg: topk_impl.Config):
    """Per-span counts [B, N_pad / SPAN, NT] -> per-topk-block counts [B, nblk, NT] (a block
    = BLOCK / SPAN consecutive spans; the last block may hold fewer)."""
    b, spans, nt = counts.shape
    g = cfg.block // span
    counts = jnp.pad(counts, ((0, 0), (0, cfg.nblk * g - spans), (0, 0)))
    return jnp.sum(counts.reshape(b, cfg.nblk, g, nt), axis=2)


def _first_pass(q, weights, codes, codebooks, lengths, lay, cfg, interpret, paged=None):
    """Sample thresholds [B, NT], then the fused kernel: (lengths clipped to N, thresholds,
    scores [B, N_pad], per-span counts [B, N_pad / SPAN, NT]). paged = (page table [B, MP],
    P): codes is a pool [R, M] (the sample's codes gathered through the tables)."""
    length, m = topk_impl.row_lengths(jnp.clip(lengths.astype(jnp.int32), 0, lay.n), cfg)
    stride = topk_impl.sample_stride(cfg)
    if paged is None:
        xs = sample_scores(q, weights, codes, codebooks, stride)
        kernel_paged = None
    else:
        ids, _ = common.paged_rows(paged[0], lay.n, paged[1])
        xs = sample_scores(q, weights, codes[ids[:, ::stride]], codebooks, 1)
        kernel_paged = (paged[1], paged[0].shape[1], codes.shape[1])
    thr = topk_impl.sample_thresholds(xs, length, m, cfg)
    ops = _operands(q, weights, codes, codebooks, lengths, lay, paged)
    scores, counts = _score_call(lay, interpret, cfg.nt, kernel_paged)(*ops, thr)
    return length, thr, scores, counts


_first_pass_jit = jax.jit(_first_pass, static_argnums=(5, 6, 7))


def fused_first_pass(q, weights, codes, codebooks, lengths, *, num_candidates: int,
                     params: Params | None = None, interpret: bool | None = None,
                     topk_tunables: dict | None = None, precision: str = "bf16"):
    """The fused kernel's raw outputs, for tests and inspection: (thresholds [B, NT] int32,
    scores [B, N_pad] f32, per-span counts [B, N_pad / SPAN, NT] int32, SPAN)."""
    _check_precision(precision)
    if interpret is None:
        interpret = common.interpret()
    q, weights, codebooks = _quantized(q, weights, codebooks, precision)
    lay = _layout(q, codes, codebooks, params)
    cfg = _topk_config(lay, num_candidates, interpret, _frozen(topk_tunables))
    _, thr, scores, counts = _first_pass_jit(q, weights, codes, codebooks, lengths, lay, cfg,
                                             interpret)
    return thr, scores, counts, lay.span


@functools.partial(jax.jit, static_argnames=("num_candidates", "params", "interpret",
                                             "tunables", "precision", "page"))
def _pq_topc_fused(q, weights, codes, codebooks, lengths, page_table=None, *,
                   num_candidates: int, params: Params | None, interpret: bool, tunables: tuple,
                   precision: str, page: int | None = None):
    q, weights, codebooks = _quantized(q, weights, codebooks, precision)
    paged = None if page_table is None else (page_table, page)
    lay = _layout(q, codes, codebooks, params, paged)
    cfg = _topk_config(lay, num_candidates, interpret, tunables)
    length, thr, scores, counts = _first_pass(q, weights, codes, codebooks, lengths, lay, cfg,
                                              interpret, paged)
    counts = _to_topk_blocks(counts, lay.span, cfg)
    return topk_impl.topk_after_first_pass(scores, length, thr, counts, cfg)


def select_top_c(scores, lengths, num_candidates: int, implementation: str = "triton"):
    """Top-C eligible positions of each score row [B, N] f32 by ``pallas_kernels.topk``
    (``implementation`` "triton": its Pallas-Triton kernel; "xla": ``lax.top_k``):
    (positions [B, C] int32 in any order, -1 padded; values [B, C] f32, -inf at padding)."""
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, scores.shape[1])
    return topk(scores, lengths, num_candidates, implementation=implementation)


def pq_topc_triton(q, weights, codes, codebooks, lengths, *, num_candidates: int,
                   params: Params | None = None, interpret: bool | None = None,
                   fused: bool = True, topk_implementation: str = "triton",
                   topk_tunables: dict | None = None, precision: str = "bf16",
                   page_table=None, page: int | None = None):
    """Top-C positions of PQ-coded keys (see the module docstring); inputs as in
    ``api.pq_topc``. fused=True: the score kernel also runs topk's first counting pass, then
    topk continues from there. fused=False: the score kernel, then ``select_top_c`` with
    ``topk_implementation`` ("triton" or "xla"; the fused path is triton only).
    ``topk_tunables``: keyword arguments of ``topk.triton.topk_triton`` (block, cap, sample,
    digit_bits, chunk, num_warps, select_warps) for the triton top-C stage; None: defaults.
    ``precision`` "bf16": q and codebooks rounded to bf16; "fp8": quantized to e4m3 by
    ``reference.quantize_fp8`` (scales folded into the head weights), an e4m3 x e4m3 dot with
    f32 accumulation. page_table [B, MP] int32 with page P: codes is a pool [R, M] of code
    rows shared by the batch, position n of request b its row page_table[b, n // P] * P +
    n % P (``api.pq_topc``)."""
    _check_precision(precision)
    if interpret is None:  # resolved outside jit: it reads the abstract-mesh context
        interpret = common.interpret()
    if fused:
        if topk_implementation != "triton":
            raise ValueError(f"pq_topc_triton: fused=True needs topk_implementation='triton', "
                             f"got {topk_implementation!r}")
        return _pq_topc_fused(q, weights, codes, codebooks, lengths, page_table,
                              num_candidates=num_candidates, params=params,
                              interpret=bool(interpret), tunables=_frozen(topk_tunables),
                              precision=precision, page=page)
    scores = coarse_scores_triton(q, weights, codes, codebooks, lengths, params=params,
                                  interpret=interpret, precision=precision,
                                  page_table=page_table, page=page)
    if topk_tunables and topk_implementation == "triton":
        lengths = jnp.clip(lengths.astype(jnp.int32), 0, scores.shape[1])
        return topk_impl.topk_triton(scores, lengths, num_candidates, interpret=interpret,
                                     **topk_tunables)
    return select_top_c(scores, lengths, num_candidates, topk_implementation)
