"""Plain Triton ``pq_topc`` through jax-triton: the codebook held on chip, decoded by
``tl.gather``, bf16 tensor-core scores, then ``pallas_kernels.topk``.

Notation:
  B requests, H indexer heads (HP = H padded to a power of two >= 16), D = M * d head dim,
  M subspaces (MP padded) of d dims (d' = max(4, 2^ceil(log2 d)) padded), K <= 256 centroids
  (KP = K padded to a power of two), N positions, C = num_candidates,
  WPS = d' / 4 64-bit words per centroid row (4 bf16 values a word; fp8: 32-bit words of four
  e4m3), W = MP * WPS words per decoded key, DP = MP * d' = 4 W decoded dims, BN keys per tile,
  STEPS tiles per program.

Why decode + dot, not look-up tables. Eq. 6 is s[n] = sum_h w[h] ReLU(sum_j q[h, j] . C_j[c_nj]).
The per-request table LUT[h, j, c] = q[h, j] . C_j[c] holds H * M * K = 64 * 32 * 256 = 524,288
f32 (2 MiB per request, 128 MiB at B = 64): it does not fit on chip, and since the ReLU acts per
head after the sum over subspaces, a key still needs H * M = 2048 table reads (no dot can
replace them): 1.7e10 scattered reads at B = 64, N = 131072, ~2 ms of shared-memory/L1 gathers
alone. Decoding instead reads M codebook words per key and lets the tensor cores do the
2 * H * D = 16,384 FLOPs per key (1.4e11 FLOPs: 0.17 ms at 790 TFLOP/s, the op's roofline; the
codes are 268 MB: 0.09 ms of HBM). So: decode on chip, one bf16 dot per tile.

Kernel (grid (B, cdiv(N, BN * STEPS))): program (b, i) loads request b's q^T [DP, HP] bf16, its
head weights and the packed codebook ``book`` [KP, W] int64 once (row c, word j * WPS + g holds
C_j[c, 4g:4g+4] as four bf16 bit patterns, low half first: 64 KiB at the V4 shape) and keeps
them in registers; then for each of its STEPS tiles of BN positions (tiles wholly past
lengths[b] only store -inf):
  idx[n, w]   = codes[b, n, w // WPS] (int32; masked to 0 for padded subspaces, clamped < K)
  packed      = tl.gather(book, idx) [BN, W] int64          one 64-bit read per (key, word)
  keys        = the four 16-bit fields of each word as bf16 -> [BN, DP] (column 4 w + f)
  s[n]        = sum_h w[h] * ReLU((keys @ q^T)[n, h])        bf16 operands, f32 accumulation
and stores s (-inf at n >= lengths[b]) to scores [B, N] f32. ``decode`` picks how Triton lowers
the gather: "smem" (a 1-D gather over the flattened book: Triton stages the book in shared
memory and each output is one 64-bit shared load), "smem_linear" (the same without the
swizzle below, kept to measure it), "smem_lanes" (the default: the row-major book with the
codes read one a thread, so that lane l gathers word l of one key: no conflict whatever the
codes, at the price of byte-wide code loads; score kernel at B 64, N 131072 on the H200
0.864 ms bf16 / 0.644 fp8 against 0.985 / 0.671 swizzled, 0.867 / 0.602 with all codes 0:
results/kernel_ablation_session28/) or "shuffle" (the 2-D gather along the K axis,
which Triton makes warp-local: K / 32 register shuffles of each 64-bit word per output; no
shared memory, but 16 shuffles per (key, subspace) at K = 256). None can keep the book in
shared memory across tiles (Triton has no explicit shared allocation): the smem lowerings
re-stage it per tile (64 KiB of shared stores per BN keys, amortised by a large BN).

Bank swizzle ("smem"). Shared memory serves one 128-byte row of its 32 banks per wavefront, so
S = 128 / word bytes words (16 at bf16, 32 at fp8) have distinct bank slots; in the row-major
book word (c, w) sits at c W + w, whose slot is w mod S alone (the V4 shape: W = 32). jax-triton
passes 16-byte-aligned arrays, so Triton loads the codes 16 bytes a thread ([1, 16] codes a
thread, 16 keys x 2 halves of the words a warp) and the gather takes that layout: one gather
instruction reads word w (and w + 16) of 16 keys, all in slot w mod 16, a ~32-way conflict
unless the keys' codes agree. Measured with the row-major book (H200, B 64, N 131072;
results/kernel_ncu_session26_next/): ~29 conflicts per shared load (2.5e8 for 8.7e6) and 1.76
ms with random codes, 0.68 ms with all codes 0; fast when all keys decode alike, slow when keys
differ even if a key's subspaces share one code. "smem" stores word w of row c at column
w ^ (c & X), X = min(W, S) - 1, and gathers from c W + (w ^ (c & X)), so one word's slot is
(w ^ c) mod S, spread by the codes: 3.4e7 conflicts, 0.85 ms under Nsight Compute, 1.92x (bf16)
and 1.74x (fp8) per call (results/kernel_ncu_session27/, results/kernel_ablation_session27/).
(Compiled without the alignment, as sessions 25-26 read the PTX, Triton loads one code a
thread and lane l gathers word l of one key, which would not conflict: ``compile_ptx`` marks
the pointers aligned.)

Latency variants (``Params.prefetch``, ``Params.book_per_tile``; session 36). At the default
launch ptxas gives the fp8 kernel 168 registers, so one program of 8 warps runs a SM, and
each tile's phases (byte loads of the codes from HBM, the book's re-staging, the gather, the
relay to the dot's operand layout, the dot, the head sum) wait on each other behind
barriers: by count, the tile's shared-memory wavefronts and instructions at one a cycle
would take ~1/4 of the measured time (an estimate). ``prefetch`` issues tile t + 1's code
loads before tile t's decode (207 registers); ``book_per_tile`` reloads the 32 KiB book
from L1/L2 in each tile instead of holding it in 32 registers across the loop (146; with
BN 128: 108, two programs a SM).
The scores are the default's bit for bit (GPU test). Timed on an H100 in 9 interleaved rounds
(session 37, results/pq_variants_s37/; three fixed-order runs in session 36 had drifted by up to
30%): at fp8 prefetch and book per tile alone are slower in every round (1.05-1.19x), and BN 128
with the book per tile faster in every round (0.938x contiguous, 0.946x paged): fp8's default since
(FP8_PARAMS), with 4 warps a program since session 38 (0.91-0.92x of 8 warps,
results/pq_variants_s38/w4/); bf16's default since session 39 BN 512 with 16 warps and the book per
tile (BF16_PARAMS, 0.93-0.94x). ``keys_as_b`` (session 37): the keys as the dot's B operand; ptxas
gives 90 registers at that tile (108 without), and the head sum becomes a reduction across warps
through shared memory; timed in session 38 at 1.35x the default (slower in 9 of 9 rounds,
results/pq_variants_s38/), kept as an option, not the default. ``interpreted.py`` runs this kernel
on a CPU under Triton's interpreter (fp8: the interpreter's bf16 dot is wrong).

Top-C: ``pallas_kernels.topk`` on the [B, N] scores, "triton_fused" by default since session 30
(its sample floor and fallback in-kernel: no XLA glue; before, "triton", whose sample floor
runs ``lax.top_k`` over the sampled keys in XLA, an XLA sort on the GPU). The Pallas kernel
(``triton.py``) fuses topk's first counting pass into its score kernel instead; that saves one
read of the scores (33.5 MB, ~11 us at B = 64), small next to the decode, and would tie this
kernel to topk's two-read tail. Not done here.

Precision as ``triton.py``: q and the codebooks rounded to bf16, f32 accumulation
(``TOLERANCE['bfloat16']``); small-integer inputs give the exact scores.

precision="fp8" (``FP8=True``): q and the codebooks quantized by ``reference.quantize_fp8``
(scales folded into the head weights), so a centroid row of d' = 4 dims is one 32-bit word of
four e4m3 bytes (the book [KP, W] int32: 32 KiB at the V4 shape, half the bf16 book; one 32-bit
gather per (key, word)); q is passed as [B, HP, DP] e4m3 (contraction dim contiguous, the
K-major operand Hopper's fp8 MMA wants) and the tile dot is e4m3 x e4m3 with f32 accumulation
(2x the bf16 tensor-core rate; Triton's default on sm_90 accumulates fp8 MMAs without the
periodic f32 promotion, ~2^-13 relative, far below the e4m3 rounding). DP >= 32 (an fp8 dot's
contraction dim).

``triton`` and ``jax_triton`` are imported lazily (the package imports without them); this path
needs a CUDA GPU. ``packed_codebook`` and ``decode_packed`` (plain jnp) are the kernel's packing
and its unpacking, so CPU tests check the layout against ``reference.decode_codes``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.pq_topc import reference
from pallas_kernels.topk import topk

MIN_DOT_DIM = 16  # tl.dot needs every operand dim >= 16
MIN_DOT_K_FP8 = 32  # an fp8 tl.dot needs a contraction dim >= 32
WORD_VALUES = 4  # values per codebook word: 4 bf16 in 64 bits, or 4 e4m3 in 32 bits (fp8)
DECODES = ("smem", "smem_linear", "smem_lanes", "shuffle")
BANK_BYTES = 128  # one shared-memory wavefront: 32 banks of 4 bytes


@dataclasses.dataclass(frozen=True)
class Params:
    """Launch parameters (powers of two): block_n keys per tile, steps tiles per program,
    decode "smem" | "smem_linear" | "smem_lanes" | "shuffle" (see the module docstring);
    prefetch: each tile issues the next tile's code loads before its own decode (the codes
    carried across the loop), so their latency overlaps this tile's work; book_per_tile: the
    book is loaded from global memory (L1/L2) in each tile instead of held in registers
    across the loop (fewer live registers, more programs per SM). Both off: the kernel of
    sessions 28-35. keys_as_b: the decoded keys are the dot's B operand, dots [HP, BN] =
    q . keys^T (wgmma reads B from shared memory; the head sum then reduces across warps, and
    the PTX keeps the A form's stmatrix / ldmatrix count, so whether it saves time is the
    GPU's to say); off: dots [BN, HP] = keys . q^T."""

    block_n: int = 256
    steps: int = 8
    num_warps: int = 8
    num_stages: int = 2
    decode: str = "smem_lanes"  # session 28: 0.864 vs 0.985 ms bf16, 0.644 vs 0.671 fp8
    prefetch: bool = False
    book_per_tile: bool = False
    keys_as_b: bool = False


DEFAULT_PARAMS = Params()  # the sessions-28-36 launch (BN 256, 8 warps): variants' base
# fp8: 128-key tiles, 16 a program, the book reloaded in each tile, 4 warps a program (ptxas:
# 155 registers, three programs a SM). Session 37 (8 warps then: 108 registers, two programs a
# SM; H100, benchmarks/pq_variants_gpu.py, 9 interleaved rounds at 512K): 0.938 of
# DEFAULT_PARAMS' time at batch 64 (contiguous codes) and 0.946 at batch 36 (paged), faster in
# 9 of 9 rounds each, scores bit for bit equal; at bf16 the same launch takes 1.19-1.29x.
# Session 38 (H100, 25 interleaved rounds of 50 calls, results/pq_variants_s38/w4/): 4 warps
# take 0.920 of the 8-warp time at batch 64 (faster in 20 of 25 rounds) and 0.907 at batch 36
# paged (25 of 25), scores bit for bit equal; keys as B took 1.35x, BN 64 1.27-1.31x (9 rounds).
FP8_PARAMS = Params(block_n=128, steps=16, num_warps=4, book_per_tile=True)
# bf16: 512-key tiles, 4 a program, 16 warps, the book reloaded in each tile. H100, 512K,
# benchmarks/pq_variants_gpu.py in interleaved rounds against DEFAULT_PARAMS, scores bit for
# bit equal: session 37 (9 rounds) 0.93-0.94x; session 39 (--set bf16_w4, 25 rounds of 50
# calls, results/pq_variants_s39_bf16/) 0.943x at batch 64 contiguous and 0.934x at batch 36
# paged, faster in 25 of 25 rounds each (4 warps: 1.06-1.09x, BN 128 or 64 slower still).
BF16_PARAMS = Params(block_n=512, steps=4, num_warps=16, book_per_tile=True)


def default_params(precision: str) -> Params:
    """The launch a call at ``precision`` gets when it passes no ``params``."""
    return FP8_PARAMS if precision == "fp8" else BF16_PARAMS


def _pow2(x: int) -> int:
    return 1 << (max(int(x), 1) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Layout:
    """Padded sizes of one call (see Notation)."""

    h: int
    hp: int
    m: int
    mp: int
    ds: int
    dsp: int
    k: int
    kp: int
    fp8: bool = False

    @property
    def wps(self) -> int:
        return self.dsp // WORD_VALUES

    @property
    def words(self) -> int:
        return self.mp * self.wps

    @property
    def dp(self) -> int:
        return self.mp * self.dsp


def layout(h: int, m: int, k: int, ds: int, fp8: bool = False) -> Layout:
    """Zero padding to power-of-two dims that tl.arange / tl.dot accept (exact: a zero query
    column or zero centroid value adds nothing)."""
    dsp = max(WORD_VALUES, _pow2(ds))
    min_k = MIN_DOT_K_FP8 if fp8 else MIN_DOT_DIM
    mp = max(_pow2(m), min_k // min(dsp, min_k))
    return Layout(h=h, hp=max(MIN_DOT_DIM, _pow2(h)), m=m, mp=mp, ds=ds, dsp=dsp, k=k,
                  kp=_pow2(k), fp8=fp8)


def swizzle_mask(lay: Layout, decode: str) -> int:
    """X of the bank swizzle (module docstring) for ``decode``: min(W, S) - 1 for "smem", else
    0 (row-major)."""
    if decode != "smem":
        return 0
    return min(lay.words, BANK_BYTES // (4 if lay.fp8 else 8)) - 1


def packed_codebook(codebooks, lay: Layout, swizzle: int = 0) -> jnp.ndarray:
    """Codebooks [M, K, d] -> the kernel's book [KP, W, 2] uint32 (little-endian halves of the
    int64 word): word j * WPS + g of row c = bf16 bits of C_j[c, 4g + f] at bits 16 f, stored
    at column (j * WPS + g) ^ (c & swizzle).
    fp8 (codebooks already e4m3): [KP, W] uint32, e4m3 bits of C_j[c, 4g + f] at bits 8 f.
    Padded subspaces, dims and rows are zero."""
    book = _row_major_book(codebooks, lay)
    # out[c, v] = in[c, v ^ (c & X)]: XOR is its own inverse, so word w lands at w ^ (c & X)
    cols = jnp.arange(lay.words)[None, :] ^ (jnp.arange(lay.kp)[:, None] & swizzle)
    return jnp.take_along_axis(book, cols if lay.fp8 else cols[..., None], axis=1)


def _row_major_book(codebooks, lay: Layout) -> jnp.ndarray:
    """``packed_codebook`` without the swizzle."""
    pad = ((0, lay.mp - lay.m), (0, lay.kp - lay.k), (0, lay.dsp - lay.ds))
    if lay.fp8:
        if codebooks.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"pq_topc: the fp8 book packs e4m3 codebooks, got {codebooks.dtype}")
        bits = lax.bitcast_convert_type(jnp.pad(codebooks, pad), jnp.uint8).astype(jnp.uint32)
        bits = bits.reshape(lay.mp, lay.kp, lay.wps, WORD_VALUES)
        words = bits[..., 0] | (bits[..., 1] << 8) | (bits[..., 2] << 16) | (bits[..., 3] << 24)
        return words.transpose(1, 0, 2).reshape(lay.kp, lay.words)
    books = jnp.pad(codebooks.astype(jnp.bfloat16), pad)
    bits = lax.bitcast_convert_type(books, jnp.uint16).astype(jnp.uint32)  # [MP, KP, d']
    bits = bits.reshape(lay.mp, lay.kp, lay.wps, 2, 2)  # [.., g, half, f within the half]
    halves = bits[..., 0] | (bits[..., 1] << 16)  # [MP, KP, WPS, 2]
    return halves.transpose(1, 0, 2, 3).reshape(lay.kp, lay.words, 2)


def decode_packed(book, codes, lay: Layout, swizzle: int = 0) -> jnp.ndarray:
    """The kernel's decode in jnp: book [KP, W, 2] uint32 (``packed_codebook`` with this
    ``swizzle``), codes [..., N, M] uint8 -> keys [..., N, DP] bf16 (column 4 w + f = field f
    of word w), codes clamped to K - 1. fp8: book [KP, W] uint32 -> keys [..., N, DP] e4m3."""
    sub = jnp.arange(lay.words) // lay.wps  # [W] subspace of each word
    ids = jnp.minimum(codes.astype(jnp.int32), lay.k - 1)
    ids = jnp.where(sub < lay.m, ids[..., jnp.minimum(sub, lay.m - 1)], 0)  # [..., N, W]
    words = book[ids, jnp.arange(lay.words) ^ (ids & swizzle)]  # [..., N, W, 2] ([.., W] fp8)
    if lay.fp8:
        fields = jnp.stack([(words >> (8 * f)) & 0xFF for f in range(WORD_VALUES)], axis=-1)
        keys = lax.bitcast_convert_type(fields.astype(jnp.uint8), jnp.float8_e4m3fn)
        return keys.reshape(*codes.shape[:-1], lay.dp)
    fields = jnp.stack([words[..., 0] & 0xFFFF, words[..., 0] >> 16,
                        words[..., 1] & 0xFFFF, words[..., 1] >> 16], axis=-1)
    keys = lax.bitcast_convert_type(fields.astype(jnp.uint16), jnp.bfloat16)
    return keys.reshape(*codes.shape[:-1], lay.dp)


def padded_query(q, lay: Layout) -> jnp.ndarray:
    """q [B, H, D] -> q^T [B, DP, HP] bf16, zero padded per subspace; fp8 (q already e4m3):
    [B, HP, DP] e4m3, not transposed."""
    b = q.shape[0]
    qp = q.astype(jnp.float8_e4m3fn if lay.fp8 else jnp.bfloat16)
    qp = qp.reshape(b, lay.h, lay.m, lay.ds)
    qp = jnp.pad(qp, ((0, 0), (0, lay.hp - lay.h), (0, lay.mp - lay.m), (0, lay.dsp - lay.ds)))
    qp = qp.reshape(b, lay.hp, lay.dp)
    return qp if lay.fp8 else qp.transpose(0, 2, 1)


def _check_precision(precision: str) -> None:
    if precision not in reference.PRECISIONS:
        raise ValueError(f"pq_topc: precision={precision!r} is unknown; allowed: "
                         f"{reference.PRECISIONS}")


def _quantized(q, weights, codebooks, precision: str):
    """(q, weights, codebooks) as the kernel takes them (fp8: ``reference.quantize_fp8``)."""
    if precision == "fp8":
        return reference.quantize_fp8(q, weights, codebooks)
    return q, weights, codebooks


@functools.partial(jax.jit, static_argnames=("precision",))
def emulated_scores(q, weights, codes, codebooks, lengths, precision: str = "bf16"):
    """The kernel's math in jnp (packed book, decode, bf16 or e4m3 dot with f32 accumulation,
    ReLU, head weights, mask): masked scores [B, N] f32. For CPU tests of the decomposition."""
    _check_precision(precision)
    q, weights, codebooks = _quantized(q, weights, codebooks, precision)
    h, (m, k, ds) = q.shape[1], codebooks.shape
    lay = layout(h, m, k, ds, fp8=precision == "fp8")
    swz = swizzle_mask(lay, DEFAULT_PARAMS.decode)
    keys = decode_packed(packed_codebook(codebooks, lay, swz), codes, lay, swz)  # [B, N, DP]
    qp = padded_query(q, lay)
    if lay.fp8:  # e4m3 products are exact in f32
        dots = jnp.einsum("bnd,bhd->bnh", keys.astype(jnp.float32), qp.astype(jnp.float32),
                          precision=lax.Precision.HIGHEST)
    else:
        dots = jnp.einsum("bnd,bdh->bnh", keys, qp, preferred_element_type=jnp.float32)
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, lay.hp - h)))
    s = jnp.sum(jnp.maximum(dots, 0.0) * w[:, None, :], axis=2)
    pos = jnp.arange(codes.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(pos < lengths.astype(jnp.int32)[:, None], s, -jnp.inf)


@functools.cache
def _kernel():
    """Builds the @triton.jit kernel on first use (imports triton lazily)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _load_codes(codes_ptr, pt_ptr, b, rows, sub, length, live, N: tl.constexpr,
                    M: tl.constexpr, LANES: tl.constexpr, PAGE: tl.constexpr,
                    MPG: tl.constexpr):
        """codes[b, rows, sub] [BN, W] uint8 (0 where not live or sub >= M)."""
        ok = live[:, None] & (sub[None, :] < M)
        # LANES: an offset of unknown divisibility (0 at run time: lengths are clipped to
        # [0, N]) hides the 16-byte alignment, so Triton reads one code a thread, lane l at
        # word l of one key
        base = codes_ptr + ((length < 0).to(tl.int32) if LANES else 0)
        if PAGE > 0:  # pool row pt[b, n // P] * P + n % P (row 0 where unmapped)
            phys = tl.load(pt_ptr + b * MPG + tl.minimum(rows // PAGE, MPG - 1),
                           mask=rows < N, other=0)
            at = tl.maximum(phys, 0).to(tl.int64) * PAGE + rows % PAGE  # [BN]
            addr = base + at[:, None] * M + sub[None, :]
        else:
            addr = base + b * (N * M) + rows[:, None] * M + sub[None, :]
        return tl.load(addr, mask=ok, other=0, eviction_policy="evict_first")

    # the kernel finds its helper among the module's globals (Triton's interpreter re-runs
    # the kernel's source with them, not with this closure)
    globals()["_load_codes"] = _load_codes

    @triton.jit
    def pq_scores_kernel(
        # inputs
        len_ptr,    # [B]         int32, clipped to [0, N]
        qt_ptr,     # [B, DP, HP] bf16   q^T, zero padded (FP8: [B, HP, DP] e4m3 bits, uint8)
        w_ptr,      # [B, HP]     f32    head weights, zero padded (FP8: times q's scales)
        codes_ptr,  # [B, N, M]   uint8 (PAGE > 0: a pool [R, M] read through pt_ptr)
        book_ptr,   # [KP, W, 2]  uint32 = [KP, W] int64 packed codebook (FP8: [KP, W] uint32)
        pt_ptr,     # [B, MPG]    int32  page tables (PAGE > 0; else unread)
        # outputs
        out_ptr,    # [B, N]      f32    masked scores
        N: tl.constexpr, M: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
        W: tl.constexpr, WPS: tl.constexpr, DP: tl.constexpr, HP: tl.constexpr,
        BN: tl.constexpr, STEPS: tl.constexpr, FLAT: tl.constexpr, FP8: tl.constexpr,
        SWZ: tl.constexpr,  # X of the bank swizzle (0: row-major book)
        LANES: tl.constexpr,  # codes read through a pointer of unknown alignment ("smem_lanes")
        PAGE: tl.constexpr,  # P rows per page of the codes pool (0: codes [B, N, M])
        MPG: tl.constexpr,  # MP page-table entries per request
        PREFETCH: tl.constexpr,  # Params.prefetch
        BOOK_PER_TILE: tl.constexpr,  # Params.book_per_tile
        KEYS_B: tl.constexpr,  # Params.keys_as_b
    ):
        b = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * (BN * STEPS)
        length = tl.load(len_ptr + b)
        words = tl.arange(0, W)
        sub = words // WPS  # [W] subspace of each word
        if FP8:
            book_words = book_ptr.to(tl.pointer_type(tl.int32))
        else:
            book_words = book_ptr.to(tl.pointer_type(tl.int64))
        if FLAT:
            book_at = book_words + tl.arange(0, KP * W)  # [KP * W] (row-major [KP, W])
        else:
            book_at = book_words + tl.arange(0, KP)[:, None] * W + words[None, :]  # [KP, W]
        if not BOOK_PER_TILE:
            book = tl.load(book_at)
        dims, heads = tl.arange(0, DP), tl.arange(0, HP)
        if FP8:  # [HP, DP] e4m3, transposed as a view: the K-major B operand
            q8 = tl.load(qt_ptr + b * (DP * HP) + heads[:, None] * DP + dims[None, :])
            qt = tl.trans(q8.to(tl.float8e4nv, bitcast=True))  # [DP, HP]
        else:
            qt = tl.load(qt_ptr + b * (DP * HP) + dims[:, None] * HP + heads[None, :])  # [DP, HP]
        w = tl.load(w_ptr + b * HP + heads)  # [HP]
        if PREFETCH:  # the first tile's codes (positions past the length read nothing)
            rows0 = first + tl.arange(0, BN)
            codes = _load_codes(codes_ptr, pt_ptr, b, rows0, sub, length, rows0 < length,
                                N, M, LANES, PAGE, MPG)
        for t in range(STEPS):
            start = first + t * BN
            rows = start + tl.arange(0, BN)  # [BN] positions
            if PREFETCH:  # issue tile t + 1's loads before tile t's decode
                after = rows + BN
                ahead = _load_codes(codes_ptr, pt_ptr, b, after, sub, length,
                                    (after < length) & (after < first + BN * STEPS),
                                    N, M, LANES, PAGE, MPG)
            if start < length:
                if not PREFETCH:
                    codes = _load_codes(codes_ptr, pt_ptr, b, rows, sub, length, rows < N,
                                        N, M, LANES, PAGE, MPG)
                idx = tl.minimum(codes.to(tl.int32), K - 1)  # [BN, W]
                if BOOK_PER_TILE:
                    book = tl.load(book_at)
                if FLAT:
                    flat = tl.reshape(idx * W + (words[None, :] ^ (idx & SWZ)), (BN * W,))
                    packed = tl.reshape(tl.gather(book, flat, 0), (BN, W))
                else:
                    packed = tl.gather(book, idx, 0)  # [BN, W] int64 (FP8: int32)
                if FP8:  # int8 fields, bitcast to e4m3 after the reshape
                    f0 = (packed & 0xFF).to(tl.int8)
                    f1 = ((packed >> 8) & 0xFF).to(tl.int8)
                    f2 = ((packed >> 16) & 0xFF).to(tl.int8)
                    f3 = ((packed >> 24) & 0xFF).to(tl.int8)
                else:
                    f0 = (packed & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
                    f1 = ((packed >> 16) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
                    f2 = ((packed >> 32) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
                    f3 = ((packed >> 48) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
                # join appends its axis last: join(join(f0, f2), join(f1, f3))[n, w, p, i] =
                # field 2 p + i of word w, so the reshape puts it at column 4 w + 2 p + i
                keys = tl.reshape(tl.join(tl.join(f0, f2), tl.join(f1, f3)), (BN, DP))
                if FP8:
                    keys = keys.to(tl.float8e4nv, bitcast=True)
                if KEYS_B:  # [HP, BN] f32, the heads reduced across the warps
                    dots = tl.dot(tl.trans(qt), tl.trans(keys), out_dtype=tl.float32)
                    s = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)  # [BN]
                else:
                    dots = tl.dot(keys, qt, out_dtype=tl.float32)  # [BN, HP] f32
                    s = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)  # [BN]
                s = tl.where(rows < length, s, float("-inf"))
            else:
                s = tl.full((BN,), float("-inf"), tl.float32)
            tl.store(out_ptr + b * N + rows, s, mask=rows < N)
            if PREFETCH:
                codes = ahead

    return pq_scores_kernel


def compile_ptx(lay: Layout, n: int, params: Params | None = None, arch: int = 90,
                page: int = 0, max_pages: int = 1) -> str:
    """PTX of the score kernel for CUDA sm_``arch`` (needs only the triton package, no GPU):
    for tests that the fp8 path lowers to e4m3 tensor-core MMAs (page > 0: the paged
    form). Every pointer is marked
    16-byte aligned, as jax-triton marks the arrays it passes: the alignment changes Triton's
    layouts (16 codes a thread instead of 1), hence which lanes share a gather instruction."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    p = params or default_params("fp8" if lay.fp8 else "bf16")
    consts = _constexprs(lay, n, p, page, max_pages)
    sig = dict(len_ptr="*i32", qt_ptr="*u8" if lay.fp8 else "*bf16", w_ptr="*fp32",
               codes_ptr="*u8", book_ptr="*u32", pt_ptr="*i32", out_ptr="*fp32")
    sig.update(dict.fromkeys(consts, "constexpr"))
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values())
               if t.startswith("*")}
    out = triton.compile(ASTSource(fn=_kernel(), signature=sig, constexprs=consts,
                                   attrs=aligned),
                         target=GPUTarget("cuda", arch, 32),
                         options=dict(num_warps=p.num_warps, num_stages=p.num_stages))
    return out.asm["ptx"]


def _constexprs(lay: Layout, n: int, p: Params, page: int = 0, max_pages: int = 1) -> dict:
    """The kernel's compile-time arguments for N = n positions (shared by the launch and
    ``compile_ptx``); page > 0: codes paged, max_pages entries a page table."""
    block_n, steps = _tile(n, p)
    return dict(N=n, M=lay.m, K=lay.k, KP=lay.kp, W=lay.words, WPS=lay.wps, DP=lay.dp,
                HP=lay.hp, BN=block_n, STEPS=steps, FLAT=p.decode != "shuffle", FP8=lay.fp8,
                SWZ=swizzle_mask(lay, p.decode), LANES=p.decode == "smem_lanes", PAGE=page,
                MPG=max_pages, PREFETCH=p.prefetch, BOOK_PER_TILE=p.book_per_tile,
                KEYS_B=p.keys_as_b)


def _tile(n: int, params: Params) -> tuple[int, int]:
    """(BN, STEPS) shrunk for short N (BN >= 16 for tl.dot)."""
    block_n = max(MIN_DOT_DIM, min(_pow2(params.block_n), _pow2(n)))
    steps = max(1, min(_pow2(params.steps), _pow2(-(-n // block_n))))
    return block_n, steps


def launch_inputs(q, weights, codes, codebooks, lengths, *, params: Params | None = None,
                  precision: str = "bf16", page_table=None, page: int | None = None):
    """The score kernel's launch: (array arguments in the kernel's order, without the output;
    compile-time arguments; grid; params). Shared by the jax-triton launch and
    ``interpreted.interpreted_scores``."""
    p = params or default_params(precision)
    if p.decode not in DECODES:
        raise ValueError(f"pq_topc: decode={p.decode!r}; allowed: {DECODES}")
    _check_precision(precision)
    q, weights, codebooks = _quantized(q, weights, codebooks, precision)
    (b, h, _), (k, ds) = q.shape, codebooks.shape[1:]
    if page_table is None:
        (n, m), pages = codes.shape[1:], jnp.zeros((1,), jnp.int32)  # unread
        consts = {}
    else:
        (n, m), pages = (page_table.shape[1] * page, codes.shape[1]), page_table
        consts = dict(page=page, max_pages=page_table.shape[1])
    lay = layout(h, m, k, ds, fp8=precision == "fp8")
    consts = _constexprs(lay, n, p, **consts)
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, lay.hp - h)))
    lens = jnp.clip(lengths.astype(jnp.int32), 0, n)
    qt = padded_query(q, lay)
    if lay.fp8:  # passed as raw bytes, bitcast back in the kernel
        qt = lax.bitcast_convert_type(qt, jnp.uint8)
    args = (lens, qt, w, codes, packed_codebook(codebooks, lay, consts["SWZ"]), pages)
    return args, consts, (b, -(-n // (consts["BN"] * consts["STEPS"]))), p


def coarse_scores_jax_triton(q, weights, codes, codebooks, lengths, *,
                             params: Params | None = None, precision: str = "bf16",
                             page_table=None, page: int | None = None) -> jnp.ndarray:
    """Masked coarse scores [B, N] f32 (-inf at n >= lengths[b]) by the Triton kernel.
    Inputs as ``api.pq_topc`` (validated there); precision "bf16" or "fp8" (module docstring);
    page_table [B, MP] with page P: codes is a pool [R, M] read through it (N = MP * P).
    Needs a CUDA GPU."""
    args, consts, grid, p = launch_inputs(q, weights, codes, codebooks, lengths, params=params,
                                          precision=precision, page_table=page_table, page=page)
    import jax_triton
    return jax_triton.triton_call(
        *args, kernel=_kernel(),
        out_shape=jax.ShapeDtypeStruct((grid[0], consts["N"]), jnp.float32),
        grid=grid, num_warps=p.num_warps, num_stages=p.num_stages, **consts)


@functools.partial(jax.jit, static_argnames=("num_candidates", "params",
                                             "topk_implementation", "precision", "page"))
def pq_topc_jax_triton(q, weights, codes, codebooks, lengths, *, num_candidates: int,
                       params: Params | None = None,
                       topk_implementation: str = "triton_fused",
                       precision: str = "bf16", page_table=None, page: int | None = None):
    """Top-C positions of PQ-coded keys: the Triton score kernel, then ``pallas_kernels.topk``
    (``topk_implementation``). Returns (positions [B, C] int32 in any order, -1 padded;
    scores [B, C] f32, -inf at padding). Inputs validated by ``api.pq_topc``; precision
    "bf16" or "fp8" (module docstring); page_table, page: codes paged (``api.pq_topc``)."""
    scores = coarse_scores_jax_triton(q, weights, codes, codebooks, lengths, params=params,
                                      precision=precision, page_table=page_table, page=page)
    lens = jnp.clip(lengths.astype(jnp.int32), 0, scores.shape[1])
    return topk(scores, lens, num_candidates, implementation=topk_implementation)
