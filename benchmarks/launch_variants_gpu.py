"""Launch tunables of the topk, sparse_attention and index_scores kernels in interleaved rounds
(issue 16: the targets these three miss).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/launch_variants_gpu.py --out $OUT/launch
    python benchmarks/launch_variants_gpu.py --dry --out /tmp/lv   # CPU: tiny shapes, interpreter

Their launch parameters were last swept in fixed order (topk: sessions 16-18,
``topk_launch_gpu.py --sweep``; sparse_attention: ``sparse_attention_v2_gpu.py``; index_scores:
``index_scores_sweep.py``), and fixed-order runs drift by up to 30% between back-to-back
runs (session 36). Session 38 found, in interleaved rounds, a 0.91x launch of the pq score
kernel (4 warps) that the fixed-order sweeps had not shown; this script asks the same of the
other three at their issue-16 target shapes:
  topk: 64 x 262144, k 2048, ``topk.fused.topk_fused`` (``fused_config``'s tunables; "floor":
        the row's true k-th score as its floor hint, what a decode step could pass from the
        previous step);
  sparse_attention: B 64, k 512, W 128, H 64, D 512, bf16 rows, the Triton kernel
        (``default_config``'s block_h / block_k / splits / num_warps / num_stages, col_splits);
  index_scores: B 64, C 2048, H 64, D 128, FP8 keys, the jax-triton kernel (block_c, steps,
        num_warps);
  sparse_attention_fp8: sparse_attention's shape with V4's FP8 rows (the serving step's).
--set: s38 one tunable at a time (session 38's set), s39 combinations of session 39's first
run's winners, s39b bf16 rows' new default (3 stages) against 2 and FP8 rows' tunables, s39c
a third run of topk's and index_scores' split winners, s40 topk's select loop with prefetch,
s41 HiSparse's paged decode indexer at 512K, batch 36 (its launch and arithmetic), s42 the
Pallas kernels' fp8 dots on fp8 wgmma (``pallas_kernels.fp8_dot``) against the widened form,
s44 sparse_attention with one warpgroup a program (column splits), s45 topk's select compare
and finish search (with --busy: device time a call from profiles), s47 topk's select chunk
and warps with pair stores, s48 topk's threshold launch against a floor in every select program,
s50 the threshold launch's warps and select blocks of 8192, s51 sparse_attention's in-kernel
combine and topk's threshold launch at 32 warps.
Timing: ``timing.time_program`` (one jitted program, built once a variant, calling the op on
--sets input sets, so dispatch is amortized as in kernel_compare; median of --repeats
programs) once a round for each variant, --rounds rounds, the order rotated a round
(``timing.interleaved_rounds``). Each row: us a call (median over rounds, range), the median
of its per-round ratios to the default launch (range, rounds faster), and its check against
the default's outputs (topk: the same index sets and values; the others: the max relative
difference, equal = bit for bit). A variant that fails to compile or run is recorded with its
error. Writes OUT/results.json after every op and OUT/launch_variants.png; prints the table
last.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import timing  # noqa: E402  (benchmarks/timing.py)

from experiments.cases.sparse_attention import make_inputs as attention_inputs  # noqa: E402
from experiments.profiling import profile_program  # noqa: E402

# The sets s38 / s39 / s39c ran before session 39 changed three defaults; their variants are
# run on the launch that was the default then (``_on``), so that a rerun compares the same
# launches: topk's finish kernels at 8 warps; sparse_attention's bf16 rows 2 stages at BK 32
# (a variant that sets block_k keeps the stage rule, which gives BK 16 / 64 what it gave
# then); index_scores' rescoring at B 64, C 2048 4 warps x 2 blocks (a variant that sets
# block_c keeps the rule, unchanged away from BC 128).
TOPK_S38_DEFAULT = dict(finish_warps=8)
ATTENTION_S38_DEFAULT = dict(num_stages=2)
INDEX_S38_DEFAULT = dict(steps=2, num_warps=4)


def _on(base: dict, variants: dict, unless: str | None = None) -> dict:
    """variants on base's launch (a variant's own settings win; a variant that sets
    ``unless`` gets no base)."""
    return {name: params if unless in params else base | params
            for name, params in variants.items()}


TOPK = {"default": {}, "sw4": dict(select_warps=4), "sw16": dict(select_warps=16),
        "fw4": dict(finish_warps=4), "fw16": dict(finish_warps=16),
        "c2048": dict(chunk=2048), "b8192": dict(block=8192),
        "b8192c2048sw4": dict(block=8192, chunk=2048, select_warps=4),
        "b32768": dict(block=32768), "r128": dict(scan_rows=128), "floor": dict(floor=True)}
ATTENTION = {"default": {}, "w4": dict(num_warps=4), "w16": dict(num_warps=16),
             "splits1": dict(splits=1), "splits3": dict(splits=3), "splits4": dict(splits=4),
             "bk16": dict(block_k=16), "bk64": dict(block_k=64), "stages1": dict(num_stages=1),
             "stages3": dict(num_stages=3), "bh32": dict(block_h=32),
             "cols2": dict(col_splits=2)}
INDEX = {"default": {}, "bc64": dict(block_c=64), "bc256": dict(block_c=256),
         "steps1": dict(steps=1), "steps4": dict(steps=4), "w8": dict(num_warps=8),
         "bc64w2": dict(block_c=64, num_warps=2)}
# --set s39: session 39's second look, around what won most of session 38's 15 rounds
# (results/launch_variants_s39/first/): topk finish_warps 16 (14/15), sparse_attention 3
# stages (14/15) and 64-row blocks (14/15), index_scores 8 warps (15/15) and one step (14/15);
# their combinations, each against the same default
TOPK_S39 = {"default": {}, "fw16": dict(finish_warps=16), "fw32": dict(finish_warps=32),
            "fw16b32768": dict(finish_warps=16, block=32768),
            "fw16c2048": dict(finish_warps=16, chunk=2048)}
ATTENTION_S39 = {"default": {}, "stages3": dict(num_stages=3), "stages4": dict(num_stages=4),
                 "bk64": dict(block_k=64), "bk64stages3": dict(block_k=64, num_stages=3),
                 "stages3splits3": dict(num_stages=3, splits=3),
                 "bk64splits3": dict(block_k=64, splits=3)}
INDEX_S39 = {"default": {}, "w8": dict(num_warps=8), "steps1": dict(steps=1),
             "steps1w8": dict(steps=1, num_warps=8), "bc64w8": dict(block_c=64, num_warps=8),
             "steps4w8": dict(steps=4, num_warps=8)}
# --set s39b: bf16 rows' default launch since then (3 stages) against the 2 stages before,
# and FP8 rows' (V4's 583 B rows: BK 32 blocks of 18.7 KB, 2 stages) tunables
ATTENTION_S39B = {"default": {}, "stages2 (before)": dict(num_stages=2)}
ATTENTION_FP8 = {"default": {}, "stages3": dict(num_stages=3), "stages4": dict(num_stages=4),
                 "bk64": dict(block_k=64), "bk16stages4": dict(block_k=16, num_stages=4),
                 "w4": dict(num_warps=4), "splits3": dict(splits=3)}
# --set s39c: a third run of what won most rounds in one of s38 / s39 but not both
TOPK_S39C = {"default": {}, "fw16": dict(finish_warps=16),
             "fw16b32768": dict(finish_warps=16, block=32768)}
INDEX_S39C = {"default": {}, "w8": dict(num_warps=8), "steps1": dict(steps=1),
              "steps4": dict(steps=4), "steps4w8": dict(steps=4, num_warps=8)}
# --set s40 (prepared in session 39, not yet run): topk's select loop with the next chunk's
# scores loaded before this chunk's scan (fused_config(prefetch=True)); ptxas (sm_90a, CPU):
# at the default chunk 4096 with 8 warps 216 registers (128 without: one program a SM instead
# of two), so prefetch goes with a smaller chunk or 16 warps: chunk 2048 126 (122 without),
# chunk 1024 80, 16 warps 126 (116 without)
# (prefetch was removed in session 47; its variants are gone from this set)
TOPK_S40 = {"default": {}, "c2048": dict(chunk=2048), "c1024": dict(chunk=1024)}
# --set s41 (prepared in session 40, not yet run): HiSparse's decode indexer over device pages
# (``index_scores_paged``, B 36 requests x N 131104 keys at 512K, pages of 64, f32 q: the
# operating point of issue 13), which session 40's profile put at 28% of HBM (0.74 ms a layer
# for 0.62 GB of keys): the long-row launch rule (BC 64, 4 warps, STEPS up to 8; swept at B 8
# in session 33) against other blocks, steps and warps, and two other arithmetics (recorded
# with their difference to the default's scores): q rounded to bf16 (one dot, no hi + lo
# split) and fp8 x fp8 (``IndexerConfig.score_precision = "fp8"``)
INDEX_PAGED_S41 = {"default": {}, "bc32": dict(block_c=32), "bc128": dict(block_c=128),
                   "steps4": dict(steps=4), "steps16": dict(steps=16),
                   "w8": dict(num_warps=8), "bc128w8": dict(block_c=128, num_warps=8),
                   "stages3": dict(num_stages=3), "bf16q": dict(bf16q=True),
                   "fp8": dict(fp8=True), "fp8bc128w8": dict(fp8=True, block_c=128, num_warps=8)}
# --set s42 (prepared in session 42): the Pallas kernels' e4m3 x e4m3 dots through
# ``pallas_kernels.fp8_dot`` (fp8 wgmma, ``benchmarks/pallas_ptx.py --set fp8``) against the same
# kernels traced under ``fp8_dot.widened()`` (session 41's form: e4m3 widened to f16 mma.sync),
# the default being the widened form: HiSparse's paged indexer and the contiguous one at 512K
# B 36 (f32 q for reference), the fused rescoring + top-512 at issue 16's B 64, C 2048, and
# LeanSparse's Pallas coarse PQ pass at 512K B 36
FP8_S42 = {"default": dict(widened=True), "wgmma": {}}
INDEX_PAGED_S42 = FP8_S42 | {"f32q": dict(fp8=False)}
# --set s44 (session 44): sparse_attention with one warpgroup a program. At 8 warps (the
# default) Triton gives the [64, BK] logits dot the warp layout [8, 1] with N = BK / 2 wgmma
# instructions, so both warpgroups compute all the logits, each issuing two n16 wgmma per
# k-step (each rereading the [64, 16] query tile from shared memory: ~10 KB of shared reads
# a row of K); 4 warps issue one m64n32k16 a k-step. With col_splits 2 a program's
# accumulator is [64, 256] (128 registers a thread), and at BK 16 / 2 stages (114688 B of
# shared memory) two programs fit an SM (benchmarks/pallas_ptx.py-style compile, CPU)
ATTENTION_S44 = {"default": {}, "c2w4": dict(col_splits=2, num_warps=4),
                 "c2w4bk16s2": dict(col_splits=2, num_warps=4, block_k=16, num_stages=2),
                 "c2w4bk16s3": dict(col_splits=2, num_warps=4, block_k=16, num_stages=3),
                 "c2w4s2": dict(col_splits=2, num_warps=4, num_stages=2),
                 "bk64s2": dict(block_k=64, num_stages=2)}
# --set s45 (session 45; ran in session 46, results/launch_variants_s46/): topk's select
# testing a score with one f32 compare (``fused_config(compare="float")``) against the key path
# (canonical score, key, compare), the finish's radix search with the early stop at a prefix
# of exactly m candidates (stop_early=True) against its 32 steps, both, both with select's
# chunk 2048 (ptxas sm_90a: 114 registers against 125 at 4096, 127 with keys), the threshold
# / finish kernels at 8 warps, and a floor hint; run with --busy (device time a call from
# profiles; the ratios of interleaved wall times too). Its "default" stays session 45's
# (keys, 32 steps); float_stop is fused_config's default since session 46
TOPK_S45 = _on(dict(compare="keys", stop_early=False),
               {"default": {}, "float": dict(compare="float"), "stop": dict(stop_early=True),
                "float_stop": dict(compare="float", stop_early=True),
                "float_stop_c2048": dict(compare="float", stop_early=True, chunk=2048),
                "fw8": dict(finish_warps=8), "floor": dict(floor=True)})
# --set s47 (session 47): topk's select now stores each candidate as one 8-byte (position,
# score bits) pair: its chunk and warps again (the store instructions, not the loads, set its
# time: benchmarks/select_probe_gpu.py), a longer block, and the finish at 8 warps
# (ran with chunk 4096 as fused_config's default, results/launch_variants_s47/; chunk 2048 is
# the default since)
TOPK_S47 = _on(dict(chunk=4096),
               {"default": {}, "c2048": dict(chunk=2048),
                "c2048w4": dict(chunk=2048, select_warps=4), "b32768": dict(block=32768),
                "fw8": dict(finish_warps=8)})
# --set s48 (session 48): topk's threshold launch against the sample floor computed by every
# select program (threshold_kernel=False; session 12 measured it slower, 16 programs a row
# redoing the search, before the select's rewrites), and the finish's new forms: keys >= T
# kept after an early stop (skip_ties), prefix sums through a [64, CR / 64] view (Triton's
# scan of a 1-D [8192] over 16 warps reads every warp's partials for each of a thread's
# strided elements: ptxas sm_90a, the finish after its search 2680 -> 1842 SASS
# instructions), two programs a row (128 programs on 132 SMs,
# each ranking half of the candidates: 1488; with the view 1069), and the floor's and the
# finish's searches by thirds (two counts a reduction: 0.63x the steps); LeanSparse's
# rescoring + top-512 with its search by thirds, fused and split (kernel_compare's form)
TOPK_S48 = {"default": {}, "no_threshold_kernel": dict(threshold_kernel=False),
            "skip_ties": dict(skip_ties=True), "sr64": dict(finish_scan_rows=64),
            "p2sr64": dict(finish_programs=2, finish_scan_rows=64),
            "p2sr64skip": dict(finish_programs=2, finish_scan_rows=64, skip_ties=True),
            "thirds": dict(search="thirds"),
            "p2sr64skip_thirds": dict(finish_programs=2, finish_scan_rows=64, skip_ties=True,
                                      search="thirds")}
INDEX_TOPK_S48 = {"default": {}, "thirds": dict(search="thirds"), "split": dict(split=True),
                  "split_thirds": dict(split=True, search="thirds")}
# --set s50 (session 50): the threshold launch's own warps (16 until now, finish_warps's),
# select blocks of 8192 (32 programs a row, four chunk trips each), and the floor hint (no
# threshold launch: what the select and finish take alone); tw32 (Hopper's most, 1024 threads;
# it lowers for sm_90) was added after session 50's run: results/launch_variants_s50/ lacks it
TOPK_S50 = {"default": {}, "tw4": dict(threshold_warps=4), "tw8": dict(threshold_warps=8),
            "tw32": dict(threshold_warps=32), "b8192": dict(block=8192),
            "floor": dict(floor=True)}
# --set s51 (session 51): sparse_attention's split partials merged inside the kernel by the
# last split of each request to finish (``fused_combine``: no combine launch in XLA), bf16 and
# V4 FP8 rows, at the default P = 2 splits and at 4 and 5 (more programs to hide the row
# gathers' latency, the merge no longer an XLA launch's cost); topk's threshold launch at 32
# warps
ATTENTION_S51 = {"default": {}, "fused": dict(fused_combine=True), "s4": dict(splits=4),
                 "fused_s4": dict(fused_combine=True, splits=4),
                 "fused_s5": dict(fused_combine=True, splits=5)}
TOPK_S51 = {"default": {}, "tw32": dict(threshold_warps=32)}
SETS = {"s38": {"topk": _on(TOPK_S38_DEFAULT, TOPK),
                "sparse_attention": _on(ATTENTION_S38_DEFAULT, ATTENTION, "block_k"),
                "index_scores": _on(INDEX_S38_DEFAULT, INDEX, "block_c")},
        "s39": {"topk": _on(TOPK_S38_DEFAULT, TOPK_S39),
                "sparse_attention": _on(ATTENTION_S38_DEFAULT, ATTENTION_S39, "block_k"),
                "index_scores": _on(INDEX_S38_DEFAULT, INDEX_S39, "block_c")},
        "s39b": {"sparse_attention": ATTENTION_S39B, "sparse_attention_fp8": ATTENTION_FP8},
        "s39c": {"topk": _on(TOPK_S38_DEFAULT, TOPK_S39C),
                 "index_scores": _on(INDEX_S38_DEFAULT, INDEX_S39C, "block_c")},
        "s40": {"topk": TOPK_S40},
        "s41": {"index_scores_paged": INDEX_PAGED_S41},
        "s42": {"index_scores_paged_fp8": INDEX_PAGED_S42, "index_scores_fp8": FP8_S42,
                "index_topk_fp8": FP8_S42, "pq_coarse_fp8": FP8_S42},
        "s44": {"sparse_attention": ATTENTION_S44},
        "s45": {"topk": TOPK_S45}, "s47": {"topk": TOPK_S47},
        "s48": {"topk": TOPK_S48, "index_topk_fp8": INDEX_TOPK_S48}, "s50": {"topk": TOPK_S50},
        "s51": {"sparse_attention": ATTENTION_S51, "sparse_attention_fp8": ATTENTION_S51,
                "topk": TOPK_S51}}
SHAPES = {"topk": dict(b=64, n=262144, k=2048), "sparse_attention": dict(b=64, k=512, w=128),
          "sparse_attention_fp8": dict(b=64, k=512, w=128), "index_scores": dict(b=64, c=2048),
          "index_scores_paged": dict(b=36, n=131104),
          "index_scores_paged_fp8": dict(b=36, n=131104), "index_scores_fp8": dict(b=36, c=131104),
          "index_topk_fp8": dict(b=64, c=2048), "pq_coarse_fp8": dict(b=36, n=131104)}
DRY = {"topk": dict(b=3, n=4096, k=64), "sparse_attention": dict(b=2, k=32, w=16),
       "sparse_attention_fp8": dict(b=2, k=32, w=16), "index_scores": dict(b=2, c=256),
       "index_scores_paged": dict(b=2, n=320), "index_scores_paged_fp8": dict(b=2, n=320),
       "index_scores_fp8": dict(b=2, c=256), "index_topk_fp8": dict(b=2, c=256),
       "pq_coarse_fp8": dict(b=2, n=512)}


def rows_same_set(got, want) -> int:
    """How many rows of two [B, k] index arrays hold the same set."""
    got, want = np.asarray(got), np.asarray(want)
    return sum(set(g.tolist()) == set(w.tolist()) for g, w in zip(got, want))


def topk_op(shape, interpret):
    """(make(key) -> args, call(params, *args) -> outputs, check(out, want) -> dict)."""
    from pallas_kernels.topk.fused import topk_fused

    b, n, k = shape["b"], shape["n"], shape["k"]

    def make(key):
        scores = jax.random.normal(key, (b, n), jnp.float32)
        floor = -jnp.sort(-scores, axis=1)[:, k - 1]  # the true k-th: the fast path
        return scores, jnp.full((b,), n, jnp.int32), floor

    def call(params, scores, lengths, floor):
        params = dict(params)
        hint = floor if params.pop("floor", False) else None
        return topk_fused(scores, lengths, k, floor=hint, interpret=interpret, **params)

    def check(out, want):
        same = rows_same_set(out[0], want[0]) == b
        values = np.array_equal(np.sort(np.asarray(out[1]), 1), np.sort(np.asarray(want[1]), 1))
        return dict(equal_default=bool(same and values))

    return make, call, check


def attention_op(shape, interpret, fp8=False):
    from lsparse_jax.quant.kv_rows import quantize_fp8_rows
    from pallas_kernels.sparse_attention.triton import sparse_attention_triton

    b, k, w = shape["b"], shape["k"], shape["w"]
    heads, dim = (64, 512) if not interpret else (64, 64)

    def make(key):
        q, table, *rest = attention_inputs(key, b, k, w, heads, dim, rows=max(2048, 2 * k))
        if fp8:  # V4's rows: FP8 non-RoPE part in 64-wide scale blocks, bf16 RoPE part
            table = tuple(quantize_fp8_rows(table, min(64, dim // 2)))
        return (q, table, *rest)

    def call(params, *args):
        return sparse_attention_triton(*args, **params)

    return make, call, timing.compare_outputs


def index_op(shape, interpret):
    from experiments.kernel_compare import index_scores_case

    make = index_scores_case(shape["b"], shape["c"]).make  # H 64, D 128, FP8 keys

    def call(params, *args):
        if interpret:  # no jax-triton on a CPU: the Pallas kernel with the same knobs
            from pallas_kernels.index_scores.triton import index_scores_triton

            return index_scores_triton(*args, **params)
        from pallas_kernels.index_scores.jax_triton import index_scores_jax_triton

        return index_scores_jax_triton(*args, **params)

    return make, call, timing.compare_outputs


def index_paged_op(shape, interpret):
    """HiSparse's decode indexer: every request's N keys read in place from a shared pool of
    pages through its page table (``pooled_reads_gpu.problem``: pages in a random order, the
    last page in the tail), one call over the batch as the decode step's vmap folds it."""
    from pooled_reads_gpu import problem  # benchmarks/pooled_reads_gpu.py

    from pallas_kernels.index_scores.paged import index_scores_paged_triton

    b, n = shape["b"], shape["n"]

    def make(key):
        seed = int(jax.random.randint(key, (), 0, 2**30))
        q, w, (values, scales), tables, (tv, ts), paged, eligible = problem(seed, b, n)
        return q[:, 0], w[:, 0], values, scales, tables, tv, ts, paged, eligible[:, 0]

    def call(params, q, *args):
        params = dict(params)
        if params.pop("bf16q", False):
            q = q.astype(jnp.bfloat16)
        return index_scores_paged_triton(q, *args, page=64, **params)

    return make, call, timing.compare_outputs


def _fp8_switch(call):
    """call with a ``widened`` parameter: True traces the kernel under ``fp8_dot.widened()``."""
    from pallas_kernels import fp8_dot

    def switched(params, *args):
        params = dict(params)
        if params.pop("widened", False):
            with fp8_dot.widened():
                return call(params, *args)
        return call(params, *args)

    return switched


def index_paged_fp8_op(shape, interpret):
    """``index_paged_op`` at fp8 x fp8 (a variant's fp8=False: its f32-q form)."""
    make, call, check = index_paged_op(shape, interpret)
    return make, _fp8_switch(lambda p, *a: call({"fp8": True} | p, *a)), check


def index_fp8_op(shape, interpret):
    """The Pallas index_scores kernel at fp8 x fp8 (FP8 keys, H 64, D 128; q quantized per
    head as ``score_precision="fp8"`` does)."""
    from experiments.kernel_compare import index_scores_case
    from pallas_kernels.index_scores.triton import index_scores_triton

    make = index_scores_case(shape["b"], shape["c"]).make

    def call(params, *args):
        return index_scores_triton(*args, **{"fp8": True} | params)

    return make, _fp8_switch(call), timing.compare_outputs


def index_topk_fp8_op(shape, interpret):
    """LeanSparse's rescoring: fp8 x fp8 scores of C candidates and their top-512 in one
    kernel (``index_scores.topk_fused``); checked as sets of positions."""
    from experiments.kernel_compare import index_scores_case
    from pallas_kernels.index_scores.topk_fused import index_topk_split, index_topk_triton

    make = index_scores_case(shape["b"], shape["c"]).make
    k = min(512, shape["c"] // 2)

    def call(params, *args):
        params = dict(params)
        if params.pop("split", False):  # kernel_compare's form: score kernel, short-row top-k
            return index_topk_split(*args, k=k, **params)
        return index_topk_triton(*args, k=k, **params)

    def check(out, want):
        same = rows_same_set(out[0], want[0])
        scores = timing.compare_outputs(out[2], want[2])
        return scores | dict(equal_default=scores["equal_default"] and same == out[0].shape[0],
                             rows_same_set=int(same))

    return make, _fp8_switch(call), check


def pq_coarse_fp8_op(shape, interpret):
    """LeanSparse's coarse pass: PQ scores of N positions (32 subspaces x 256 centroids, H 64,
    D 128), the Pallas kernel at precision fp8."""
    from pallas_kernels.pq_topc.triton import coarse_scores_triton

    b, n, h, d, m = shape["b"], shape["n"], 64, 128, 32

    def make(key):
        k = jax.random.split(key, 4)
        return (jax.random.normal(k[0], (b, h, d)), jax.random.uniform(k[1], (b, h)),
                jax.random.randint(k[2], (b, n, m), 0, 256).astype(jnp.uint8),
                jax.random.normal(k[3], (m, 256, d // m)), jnp.full((b,), n, jnp.int32))

    def call(params, *args):
        return coarse_scores_triton(*args, precision="fp8", interpret=interpret, **params)

    return make, _fp8_switch(call), timing.compare_outputs


OPS = {"topk": topk_op, "sparse_attention": attention_op,
       "sparse_attention_fp8": functools.partial(attention_op, fp8=True),
       "index_scores": index_op, "index_scores_paged": index_paged_op,
       "index_scores_paged_fp8": index_paged_fp8_op, "index_scores_fp8": index_fp8_op,
       "index_topk_fp8": index_topk_fp8_op, "pq_coarse_fp8": pq_coarse_fp8_op}


def run_op(name, args, deadline, rows, save) -> None:
    build, variants = OPS[name], SETS[args.set][name]
    shape = (DRY if args.dry else SHAPES)[name]
    make, call, check = build(shape, args.dry)
    sets = [make(jax.random.key(i)) for i in range(args.sets)]
    group = []
    for variant, params in variants.items():
        row = dict(op=name, shape=shape, variant=variant, params=params)
        rows.append(row)
        program = timing.batched_program(lambda *a, p=params: call(p, *a))
        try:  # compiled ahead (a trace-cache clear, as fp8_dot.widened() does, cannot
            # retrace it); its first run gives the outputs to check
            program = program.lower(sets).compile()
            out = jax.block_until_ready(program(sets))[0]
        except Exception as e:  # record, go on with the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            save()
            if not group:  # the default failed: nothing to compare with
                return
            continue
        if group:
            row.update(check(out, group[0]["_out"]))
        row.update(_program=program, _out=out, _times=[])
        group.append(row)

    def time_row(row):
        return timing.time_program(row["_program"], sets, repeats=args.repeats, warmup=1)

    timing.interleaved_rounds(group, time_row, args.rounds, deadline)
    timing.summarize_rounds(group)
    for row in group if args.busy else ():
        runs = [profile_program(row["_program"], (sets,), len(sets)) for _ in range(args.busy)]
        busy = sorted(r for r in (x.get("busy_us") for x in runs) if r is not None)
        if busy:  # device time a call (median run), with that run's largest kernels
            mid = next(x for x in runs if x.get("busy_us") == busy[len(busy) // 2])
            row.update(busy_us=mid["busy_us"], busy_us_range=[busy[0], busy[-1]],
                       kernels=mid["kernels"], top_kernels_us=mid["top_kernels_us"])
    for row in group:
        del row["_program"], row["_out"]
    save()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/launch_variants")
    ap.add_argument("--ops", default=None,
                    help=f"comma-separated: {', '.join(OPS)} (default: the set's ops)")
    ap.add_argument("--set", default="s38", choices=sorted(SETS),
                    help="the variants (the module docstring says what each set holds)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=5, help="programs timed a variant a round")
    ap.add_argument("--sets", type=int, default=4, help="input sets (calls) a program")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--dry", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--busy", type=int, default=0,
                    help="after the rounds, profile each variant's program this many times: "
                         "busy_us (device time a call, the median run) and its top kernels")
    args = ap.parse_args(argv)
    ops = list(SETS[args.set]) if args.ops is None else args.ops.split(",")
    if not ops or any(o not in SETS[args.set] for o in ops):
        ap.error(f"--ops {args.ops!r}: a comma-separated list of {', '.join(SETS[args.set])} "
                 f"(--set {args.set}'s ops)")
    if args.rounds < 1 or args.repeats < 1 or args.sets < 1 or args.busy < 0:
        ap.error("--rounds, --repeats and --sets must be >= 1, --busy >= 0")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    rows: list[dict] = []

    def save():
        (out / "results.json").write_text(json.dumps(dict(
            device=str(jax.devices()[0].device_kind), jax=jax.__version__, dry=args.dry,
            set=args.set,
            rounds=args.rounds, repeats=args.repeats, sets=args.sets,
            rows=[{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]),
            indent=1) + "\n")

    for name in ops:
        if time.monotonic() > deadline - 30:
            rows.append(dict(op=name, skipped="budget spent"))
            save()
            continue
        run_op(name, args, deadline, rows, save)
    plot(rows, out / "launch_variants.png")
    print(f"\n{'op':20} {'variant':14} {'us':>8} {'/default':>8} {'range':>13} faster  check")
    for r in rows:
        if "ms" in r:
            lo, hi = r["vs_default_range"]
            check = ("equal" if r.get("equal_default", True) else
                     f"rel {r.get('max_rel_diff', float('nan')):.1e}")
            busy = f"  busy {r['busy_us']:.1f} us" if "busy_us" in r else ""
            print(f"{r['op']:20} {r['variant']:14} {1e3 * r['ms']:8.1f} {r['vs_default']:8.3f} "
                  f"{lo:6.3f}-{hi:6.3f} {r['rounds_faster']:>3}/{args.rounds}  {check}{busy}")
        else:
            print(f"{r['op']:20} {r.get('variant', ''):14} {r.get('skipped') or r.get('error')}")
    return 0


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """One panel per op: each variant's median ratio to the default, its range as a bar."""
    from experiments.common import pyplot
    plt = pyplot()
    ops = [o for o in OPS if any(r.get("op") == o and "ms" in r for r in rows)]
    fig, axes = plt.subplots(1, max(len(ops), 1), figsize=(4.5 * max(len(ops), 1), 3.6),
                             squeeze=False)
    for ax, op in zip(axes[0], ops):
        got = [r for r in rows if r.get("op") == op and "ms" in r]
        ys = [r["vs_default"] for r in got]
        err = [[r["vs_default"] - r["vs_default_range"][0] for r in got],
               [r["vs_default_range"][1] - r["vs_default"] for r in got]]
        ax.errorbar(range(len(got)), ys, yerr=err, fmt="o", ms=4)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(got)))
        ax.set_xticklabels([r["variant"] for r in got], rotation=60, ha="right", fontsize=7)
        ax.set_title(op, fontsize=9)
    axes[0][0].set_ylabel("time / default launch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
