"""Pallas (Triton lowering) kernel of ``index_scores``: exact rescoring of FP8 candidate keys.

Notation:
  B requests, H indexer heads, D head dim, C gathered candidates per request,
  NB scale blocks per key, BS = D / NB values per scale block,
  HP = H padded to a power of two >= 16 (the smallest Triton dot dimension),
  BC = candidates per block, STEPS = blocks per program (powers of two).

Design: grid (B, cdiv(C, STEPS * BC)); program (b, i) scores candidates
[i * STEPS * BC, (i + 1) * STEPS * BC) of request b. It loads q[b] [HP, D] once, cast to bf16,
and for each of its STEPS blocks of BC candidates (a loop that Triton software-pipelines with
num_stages when STEPS > 1; straight-line code when STEPS = 1) loads the FP8 key block [BC, D],
casts it to bf16 (exact: every e4m3 value is a bf16 value) and dots it with q (hi and lo
parts, see Precision), accumulating in f32 -> [BC, HP]. Each scale block j contributes
dot(k[:, j], q[:, j]) * scale[:, j] (one dot when NB = 1), so the scales multiply the f32
dot products instead of the keys. Then ReLU, the weighted sum over heads and a
``jnp.where`` that writes -inf to invalid rows (NaN poison in their values and scales only
reaches their own row of the dot, which the select discards).
A partial last program of C is scored from a padded copy of its own rows (see
index_scores_triton). The keys are read once:
at B = 64, C = 2048, D = 128 that is 17 MB, ~6 us at the H200's ~3 TB/s; q (re-read by every
program, 32 KB in f32) and the weights come from L2.

Precision: an f32 q is split into two bf16 parts (hi = bf16(q), lo = bf16(q - hi)), each
dotted with the keys (two tensor-core dots; the kernel is bound by reading the keys, so the
second costs little): scores within ~1e-5 relative of the f32 reference, where rounding q to
bf16 alone gave ~1e-2 and let a query's ~1e-6 float noise (a decode step vs a speculative
verification of the same position) flip near-tied candidates. A bf16 q is used as it is. The
FP8 keys and the f32 scales are used exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.fp8_dot import dot_f32
from pallas_kernels.index_scores.reference import quantize_queries, quantize_rows

MIN_DOT = 16  # smallest dimension of a Triton tl.dot
FP8_MIN_DOT = 32  # smallest contraction of an FP8 tensor-core dot
LO_SCALE = 256.0  # the f32 q's low bf16 part is held as 2^8 * (q - bf16(q))
# fp8: a request's q is quantized in-kernel (``query_parts``) while its candidates span at most
# this many programs (issue 16's B 64, C 2048: 4; the XLA pre-pass cost 6.2 of 16.8 us busy,
# session 44), else once before the kernel (``kernel_queries``, every kernel): each program
# would read the [HP, D] f32 q (4x q8's bytes) and redo the work (H100, HiSparse's paged
# indexer at 512K batch 36 quantizing in-kernel: 0.466 -> 0.498 ms a step, session 44).
IN_KERNEL_QUANT_PROGRAMS = 8


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def padded_heads(h: int) -> int:
    """HP: H rounded up to a power of two, at least ``MIN_DOT``."""
    return max(MIN_DOT, _next_pow2(h))


def check_triton_shapes(op: str, d: int, nb: int, fp8: bool = False) -> None:
    """Shape limits of the Triton kernels (power-of-two blocks, dots of >= 16 along D; fp8
    dots: >= 32, the K of Hopper's FP8 wgmma)."""
    if fp8 and d // nb < FP8_MIN_DOT:
        raise ValueError(f"{op}: the fp8 x fp8 kernels need scale blocks of >= {FP8_MIN_DOT} "
                         f"values, got D / NB = {d // nb}; use implementation='triton' or 'xla'")
    if not _pow2(d) or d < MIN_DOT:
        raise ValueError(f"{op}: key_values key dim D={d} must be a power of two >= {MIN_DOT} "
                         "for the Triton kernels; use implementation='xla'")
    if d // nb < MIN_DOT:
        raise ValueError(f"{op}: key_scales has {nb} scale blocks per key, i.e. blocks of "
                         f"{d // nb} < {MIN_DOT} values, too small for the Triton kernels' "
                         "per-block dots; use implementation='xla'")


MIN_PROGRAMS = 512  # ~4 programs per H200 SM (132 SMs) before blocks are merged into loops
LONG_ROW = 16384  # C from which a call is a decode step's whole history (HiSparse's indexer)
LONG_ROW_PROGRAMS = 128  # programs a long row keeps per request before merging blocks


def default_config(b: int, h: int, c: int) -> tuple[int, int, int]:
    """(BC, STEPS, num_warps): the launch parameters the GPU sweeps chose.

    Rescoring (C < LONG_ROW; LeanSparse's C candidates): BC = 128 keeps the [BC, HP] f32 accumulator
    at 64 registers per thread with 4 warps at HP = 64 (ptxas at sm_90: ~155-170 registers in all,
    no spills). STEPS (<= 4) merges blocks into a pipelined loop while at least MIN_PROGRAMS
    programs remain, which cuts the re-reads of q from L2 (at the V4 shape: 64 x 16 blocks -> STEPS
    = 2, 512 programs); the session-1 sweep put this within 3% of the best. Where that gives 4 warps
    and STEPS 2, the launch is 8 warps and STEPS 4 (as many warps on the GPU in half the programs, q
    read half as often): at the V4 shape, B 64, C 2048, FP8 keys (H100, session 39,
    ``benchmarks/launch_variants_gpu.py``, interleaved rounds, scores bit for bit equal) 0.944x (20
    of 25 rounds faster) and 0.892x (34 of 35) of the 4-warp STEPS-2 launch
    (``results/launch_variants_s39/``). Long rows (C >= LONG_ROW: a decode step scores a request's
    whole history, one [1, N] call a request under a vmap, so b is 1): BC = 64, 4 warps and STEPS up
    to 8 while LONG_ROW_PROGRAMS programs remain a request; session 33's sweep at B 8, N 131104 (f32
    q, ``benchmarks/index_scores_sweep.py --shape decode``, H100): 0.238 ms against 0.305 with the
    rescoring rule (BC 128, STEPS 2), the best of 48 configurations, same scores.
    """
    if c >= LONG_ROW:
        block_c, steps = 64, 1
        while steps < 8 and -(-c // block_c) // (2 * steps) >= LONG_ROW_PROGRAMS:
            steps *= 2
        return block_c, steps, 4
    block_c = min(128, _next_pow2(c))
    num_warps = 4 if block_c * padded_heads(h) <= 128 * 64 else 8
    programs, steps = b * -(-c // block_c), 1
    while steps < 4 and programs // (2 * steps) >= MIN_PROGRAMS:
        steps *= 2
    if num_warps == 4 and steps == 2:  # the same warps in half the programs, each 4 blocks
        num_warps, steps = 8, 4
    return block_c, steps, num_warps


def query_parts(q_ref, w, nb: int, bs: int, fp8: bool):
    """Inside a kernel: ((operand, qs, q_lo), w) of q_ref [HP, D] and the head weights w [HP]
    f32 for the block dots.

    operand: the cast a key block gets before its dot (none for fp8 x fp8, bf16 otherwise);
    qs: NB x [HP, BS] q in that form, loaded once; q_lo: NB x [HP, BS] 2^8 * (q - bf16(q))
    when an f32 q is split into bf16 hi + lo (else None).
    fp8: q (f32 / bf16) is quantized here to e4m3, one power-of-two scale a head moved into
    w (``reference.quantize_rows``, the twin's own ops: exact, so the same bits; an e4m3 q_ref
    was quantized before the kernel and w is its w8), and the dot takes FP8 keys as they are
    (an fp8 x fp8 tensor-core dot); else both are widened to bf16 and w is returned as given.
    An f32 q is split into bf16 parts q = hi + lo (+ ~2^-17 |q|), each dotted with the keys:
    scores within ~1e-5 of f32, so a query's 1e-6 noise cannot flip near-ties the way a bf16
    rounding of q (~4e-3) does. lo is kept as 2^8 * lo (exact; clear of bf16 subnormals).
    """
    cols = [pl.ds(j * bs, bs) for j in range(nb)]
    if fp8 and q_ref.dtype == jnp.float8_e4m3fn:  # quantized before the kernel (w8 given)
        return ((lambda x: x), [q_ref[:, col] for col in cols], None), w
    if fp8:
        qs, w = quantize_rows([q_ref[:, col].astype(jnp.float32) for col in cols], w)
        return ((lambda x: x), qs, None), w

    def operand(x):
        return x.astype(jnp.bfloat16)

    qs = [operand(q_ref[:, col]) for col in cols]                 # NB x [HP, BS]
    split = q_ref.dtype == jnp.float32
    q_lo = [((q_ref[:, col] - q.astype(jnp.float32)) * LO_SCALE).astype(jnp.bfloat16)
            for col, q in zip(cols, qs)] if split else None       # NB x [HP, BS] 2^8 * lo
    return (operand, qs, q_lo), w


def block_scores(keys, scale, parts, w, nb: int, barrier: bool):
    """Inside a kernel: scores [BC] f32 of one block of BC keys (before the validity select).

    keys(j) -> [BC, BS] FP8 values of scale block j; scale(j) -> [BC] f32 their scales;
    parts: ``query_parts``; w [HP] f32 head weights. Each scale block's dot is scaled after
    it (the scales multiply f32 dot products, not keys), then ReLU and the weighted head sum.
    barrier: interpret mode runs through XLA, whose simplifier would rewrite
    dot(k, hi) + dot(k, lo) into dot(k, hi + lo), whose bf16 sum is hi (Triton does no such
    rewrite).
    """
    operand, qs, q_lo = parts
    dims = (((1,), (1,)), ((), ()))
    dots = None                                                    # [BC, HP] f32
    for j in range(nb):
        k = operand(keys(j))                                       # [BC, BS] (exact)
        part = dot_f32(k, qs[j], dims)
        if q_lo is not None:
            lo = jax.lax.dot_general(k, q_lo[j], dims, preferred_element_type=jnp.float32)
            if barrier:
                lo = jax.lax.optimization_barrier(lo)
            part = part + lo * (1.0 / LO_SCALE)
        part = part * scale(j)[:, None]
        dots = part if dots is None else dots + part
    return jnp.sum(jnp.maximum(dots, 0.0) * w[None, :], axis=1)   # [BC]


def _kernel(q_ref, w_ref, kv_ref, ks_ref, valid_ref, out_ref, *, nb: int, bs: int, bc: int,
            steps: int, fp8: bool = False, barrier: bool = False):
    # inputs
    #   q_ref      [HP, D]          f32 or bf16 (request b; fp8: quantized here, or e4m3 for
    #                               long rows, ``IN_KERNEL_QUANT_PROGRAMS``)
    #   w_ref      [HP]             f32
    #   kv_ref     [steps * BC, D]  float8_e4m3fn (candidates of program i)
    #   ks_ref     [steps * BC] f32 when NB = 1, else [steps * BC, NB] f32
    #   valid_ref  [steps * BC]     bool
    # outputs
    #   out_ref    [steps * BC]     f32
    # scratch: none
    parts, w = query_parts(q_ref, w_ref[...].astype(jnp.float32), nb, bs, fp8)  # w [HP]

    def score_block(start):
        rows = pl.ds(start, bc)
        scores = block_scores(lambda j: kv_ref[rows, pl.ds(j * bs, bs)],
                              lambda j: ks_ref[rows] if nb == 1 else ks_ref[rows, j],
                              parts, w, nb, barrier)
        out_ref[rows] = jnp.where(valid_ref[rows], scores, -jnp.inf)  # drops NaN poison

    common.each_block(steps, bc, score_block)


@functools.partial(jax.jit, static_argnames=("block_c", "steps", "num_warps", "num_stages",
                                             "fp8"))
def index_scores_triton(q: jnp.ndarray, weights: jnp.ndarray, key_values: jnp.ndarray,
                        key_scales: jnp.ndarray, valid: jnp.ndarray, *,
                        block_c: int | None = None, steps: int | None = None,
                        num_warps: int | None = None,
                        num_stages: int | None = None, fp8: bool = False) -> jnp.ndarray:
    """Pallas-Triton ``index_scores`` (interpret mode without a GPU); fp8=True: the fp8 x fp8
    form (implementation "triton_fp8", twin ``reference.index_scores_fp8_xla``).

    Inputs: q [B, H, D] f32/bf16, weights [B, H] f32, key_values [B, C, D] float8_e4m3fn,
    key_scales [B, C, NB] f32, valid [B, C] bool (checked by ``api.index_scores``).
    Output: scores [B, C] f32, -inf on invalid rows.
    Tuning (None = ``default_config``): block_c (BC, a power of two), steps (candidate blocks
    per program, a power of two: > 1 loads q once per program and loops over BC-row blocks,
    which Triton can software-pipeline with num_stages), num_warps, num_stages.
    """
    b, h, d = q.shape
    c, nb = key_values.shape[1], key_scales.shape[2]
    check_triton_shapes("index_scores", d, nb, fp8)
    block_c, steps, num_warps = resolve_config(b, h, c, block_c, steps, num_warps)
    rows = block_c * steps                                         # candidates per program
    q, weights = kernel_queries(q, weights, fp8, -(-c // rows))
    call = functools.partial(_call, block_c=block_c, steps=steps, num_warps=num_warps,
                             num_stages=num_stages, fp8=fp8, rows=rows)
    full = c // rows * rows
    if full == c:
        return call(q, weights, key_values, key_scales, valid, full)
    # A partial last block is scored from a padded copy of the last c - full rows only: on the
    # GPU, Pallas-Triton did not confine a partial last block of candidates to its request
    # (H200, jax 0.11.2: scores off by ~100% at B 4, C 2112, exact at B 1; interpret mode is
    # exact), which made speculative and plain greedy decoding differ (issue 15). Padding the
    # whole [B, C, D] instead copied every key (a decode step's N keys: ~0.16 ms a CSA layer
    # at 512K batch 8, session 32). Each row's score does not depend on its block.
    pad = rows - (c - full)
    rest = [jnp.pad(a[:, full:], ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2),
                    constant_values=fill)
            for a, fill in ((key_values, 0), (key_scales, 1.0), (valid, False))]
    tail = call(q, weights, *rest, rows)[:, :c - full]
    if full == 0:
        return tail
    head = call(q, weights, key_values, key_scales, valid, full)
    return jnp.concatenate([head, tail], axis=1)


def kernel_queries(q, weights, fp8: bool = False, programs: int = 1):
    """(q, weights) as the kernels take them: heads zero-padded to HP (zero heads with zero
    weight add nothing). fp8 with more than ``IN_KERNEL_QUANT_PROGRAMS`` programs a request:
    q quantized here, once (``reference.quantize_queries``: e4m3 q, w8); else the kernel
    quantizes it (``query_parts``), to the same bits."""
    if fp8 and programs > IN_KERNEL_QUANT_PROGRAMS:
        q, weights = quantize_queries(q, weights)
    h, hp = q.shape[1], padded_heads(q.shape[1])
    if hp != h:
        q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
        weights = jnp.pad(weights, ((0, 0), (0, hp - h)))
    return q, weights


def _call(q, weights, key_values, key_scales, valid, c: int, *, block_c: int, steps: int,
          num_warps: int, num_stages: int | None, fp8: bool, rows: int):
    """The kernel over candidates [0, c) of key_values [B, >= c, D] (c a multiple of rows):
    the grid covers whole programs only."""
    b, hp, d = q.shape
    nb = key_scales.shape[2]
    interpret = common.interpret()
    kernel = functools.partial(_kernel, nb=nb, bs=d // nb, bc=block_c, steps=steps, fp8=fp8,
                               barrier=interpret)
    scale_block = (None, rows, None if nb == 1 else nb)            # NB = 1: a vector
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, c), jnp.float32),
        grid=(b, c // rows),
        in_specs=[
            pl.BlockSpec((None, hp, d), lambda i, j: (i, 0, 0)),        # q
            pl.BlockSpec((None, hp), lambda i, j: (i, 0)),              # weights
            pl.BlockSpec((None, rows, d), lambda i, j: (i, j, 0)),      # key_values
            pl.BlockSpec(scale_block, lambda i, j: (i, j, 0)),          # key_scales
            pl.BlockSpec((None, rows), lambda i, j: (i, j)),            # valid
        ],
        out_specs=pl.BlockSpec((None, rows), lambda i, j: (i, j)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="index_scores",
    )(q, weights.astype(jnp.float32), key_values, key_scales, valid)


def resolve_config(b: int, h: int, c: int, block_c: int | None, steps: int | None,
                   num_warps: int | None) -> tuple[int, int, int]:
    """Fills unset tuning knobs from ``default_config`` and checks them."""
    default_bc, default_steps, default_warps = default_config(b, h, c)
    block_c = default_bc if block_c is None else block_c
    steps = default_steps if steps is None else steps
    num_warps = default_warps if num_warps is None else num_warps
    if not _pow2(block_c):
        raise ValueError(f"index_scores: block_c={block_c} must be a power of two")
    if not _pow2(steps):
        raise ValueError(f"index_scores: steps={steps} must be a power of two")
    return block_c, steps, num_warps
