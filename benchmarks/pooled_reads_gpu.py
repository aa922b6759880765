"""Decode-step reads of device page pools (GPU): a gathered copy + the contiguous kernel against
the paged kernels that read in place. Keys: HiSparse's exact decode indexer
(``index_scores_paged``); codes: LeanSparse's coarse pass (``pq_topc`` with a page table).

Run on the GPU machine:
  python3 benchmarks/pooled_reads_gpu.py --out results/pooled_reads_gpu
Shape (``CacheConfig.device_pages``, capacity.gin's pages of 64): B requests (default 8 and
36, HiSparse's N at 512K in the capacity study) x N = 131104 positions (512K / 4 + 32) of FP8
keys (D 128, one scale) in a pool of pages assigned in a random order, each request's last
page in its tail; one [1, N] call a request under a vmap over the batch, as the decode step
calls it (f32 q: the kernel's hi + lo split). Variants, each timed as one jitted program over
``--sets`` input sets (``timing.program_time``):
  gather      ``device_pool.gather_slot_rows`` of every position, then ``index_scores``
              "triton" on the copy (what ``PooledIndex.select`` ran before session 34)
  paged       ``index_scores_paged`` "triton" (``device_pool.pooled_decode_scores``)
  contiguous  ``index_scores`` "triton" on keys already contiguous (no pool: the floor)
  paged_fp8   ``index_scores_paged`` "triton_fp8" (q quantized to e4m3 per head: V4's
              fp8 x fp8 indexer arithmetic; other numerics, not compared)
  paged_bf16q "triton" with q rounded to bf16 (one dot instead of the f32 hi + lo split)
Each of gather's scores must equal the paged kernel's bit for bit (printed).
Codes (B x 131072 positions of 32 PQ codes, pages of 64, C 2048, the coarse pass at
``--coarse``, default jax_triton fp8 as capacity_s34.gin): codes_gather (``common.paged_rows``
gather, then ``pq_topc``) against codes_paged (``pq_topc(..., page_table=...)``); the top-C
sets and their scores must agree. Prints a table, and with --out writes JSON after every row.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from timing import program_time, write_results  # benchmarks/timing.py

from lsparse_jax.memory.device_pool import PoolView, gather_slot_rows, pooled_decode_scores
from pallas_kernels import common
from pallas_kernels.index_scores import index_scores
from pallas_kernels.pq_topc import pq_topc

H, D, PAGE = 64, 128, 64
HBM = 3.0e12  # bytes/s, the roofline of reading the keys once


def problem(seed, b, n):
    """(q [B, 1, H, D], w [B, 1, H], pool (values, scales), tables [B, MP], tails, paged [B],
    eligible [B, 1, N])."""
    k = jax.random.split(jax.random.key(seed), 6)
    mp = -(-n // PAGE)
    pages = b * mp
    values = jax.random.normal(k[0], (pages * PAGE, D)).astype(jnp.float8_e4m3fn)
    scales = jax.random.uniform(k[1], (pages * PAGE, 1), jnp.float32, 0.5, 2.0)
    tables = jax.random.permutation(k[2], pages).reshape(b, mp).astype(jnp.int32)
    paged = jnp.full((b,), (n // PAGE) * PAGE, jnp.int32)          # the last page: the tail
    tails = (jax.random.normal(k[3], (b, PAGE, D)).astype(jnp.float8_e4m3fn),
             jnp.ones((b, PAGE, 1), jnp.float32))
    q = jax.random.normal(k[4], (b, 1, H, D), jnp.float32)
    w = jax.random.normal(k[5], (b, 1, H), jnp.float32)
    return q, w, (values, scales), tables, tails, paged, jnp.ones((b, 1, n), bool)


def variant(name):
    """fn(q, w, pool, tables, tails, paged, eligible) -> [B, 1, N] scores, vmapped over B."""
    def one(q, w, pool, table, tail, paged, eligible):
        view = PoolView(pool, table)
        if name == "paged":
            return pooled_decode_scores("triton", view, tail, paged, PAGE)(q, w, eligible)
        if name == "paged_fp8":  # the fp8 x fp8 form (q quantized to e4m3 per head)
            return pooled_decode_scores("triton_fp8", view, tail, paged, PAGE)(q, w, eligible)
        if name == "paged_bf16q":  # q rounded to bf16: one dot, no hi + lo split
            return pooled_decode_scores("triton", view, tail, paged, PAGE)(
                q.astype(jnp.bfloat16), w, eligible)
        if name == "gather":
            values, scales = gather_slot_rows(view, jnp.arange(eligible.shape[-1]), tail,
                                              paged, PAGE)
        else:  # contiguous: the same keys, stored in order (the pool's first N rows)
            values, scales = (x[:eligible.shape[-1]] for x in pool)
        return index_scores(q, w, values[None], scales[None], eligible,
                            implementation="triton")
    return jax.vmap(one, in_axes=(0, 0, None, 0, 0, 0, 0))


M, K, C = 32, 256, 2048


def codes_problem(seed, b, n):
    """(q [B, H, D], w [B, H], pool [R, M] uint8, codebooks [M, K, D / M], lengths [B],
    tables [B, MP])."""
    k = jax.random.split(jax.random.key(seed), 5)
    mp = n // PAGE
    pool = jax.random.randint(k[0], (b * mp * PAGE, M), 0, K).astype(jnp.uint8)
    tables = jax.random.permutation(k[1], b * mp).reshape(b, mp).astype(jnp.int32)
    return (jax.random.normal(k[2], (b, H, D)), jax.random.normal(k[3], (b, H)), pool,
            jax.random.normal(k[4], (M, K, D // M)), jnp.full((b,), n, jnp.int32), tables)


def coarse_variant(name, impl, precision):
    """fn(q, w, pool, books, lengths, tables) -> (positions, scores) [B, C], vmapped over B."""
    def one(q, w, pool, books, n, table):
        kw = dict(num_candidates=C, implementation=impl, precision=precision)
        if name == "codes_paged":
            return pq_topc(q[None], w[None], pool, books, n[None], page_table=table[None],
                           page=PAGE, **kw)
        ids, _ = common.paged_rows(table[None], table.shape[0] * PAGE, PAGE)
        return pq_topc(q[None], w[None], pool[ids], books, n[None], **kw)
    return jax.vmap(lambda *a: jax.tree.map(lambda x: x[0], one(*a)),
                    in_axes=(0, 0, None, None, 0, 0))


def sorted_by_position(out):
    pos, val = (np.asarray(x) for x in out)
    order = np.argsort(pos, axis=1)
    return np.take_along_axis(pos, order, 1), np.take_along_axis(val, order, 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="8,36")
    p.add_argument("--coarse", default="jax_triton:fp8",
                   help="implementation:precision of the coarse pass, comma-separated "
                   "(none: no codes rows)")
    p.add_argument("--keys", default="paged,gather,contiguous",
                   help="key variants, comma-separated: paged, gather, contiguous, paged_fp8 "
                   "(fp8 x fp8), paged_bf16q (bf16 q); gather is checked against paged")
    p.add_argument("--n", type=int, default=131104)
    p.add_argument("--sets", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for b in map(int, args.batches.split(",")):
        sets = [problem(i, b, args.n) for i in range(args.sets)]
        want = np.asarray(jax.jit(variant("paged"))(*sets[0]))  # what gather must equal
        for name in args.keys.split(","):
            fn = variant(name)
            ms = 1e3 * program_time(fn, sets, repeats=args.repeats)
            # the others run other arithmetic or launches (contiguous; fp8 / bf16 q)
            same = {"paged": True, "gather": None}.get(name)
            if name == "gather":
                same = bool(np.array_equal(np.asarray(jax.jit(fn)(*sets[0])), want))
            key_bytes = b * args.n * (D + 4)
            rows.append(dict(batch=b, n=args.n, variant=name, ms=ms,
                             hbm_fraction=key_bytes / HBM / (ms * 1e-3),
                             equal_to_paged=same))
            write_results(args.out, "results.json", args, rows)
        n = args.n // PAGE * PAGE
        sets = [codes_problem(i, b, n) for i in range(args.sets)]
        for spec in [] if args.coarse == "none" else args.coarse.split(","):
            impl, precision = spec.split(":")
            ref = None
            for name in ("codes_paged", "codes_gather"):
                fn = coarse_variant(name, impl, precision)
                ms = 1e3 * program_time(fn, sets, repeats=args.repeats)
                got = sorted_by_position(jax.jit(fn)(*sets[0]))
                same = True if ref is None else all(np.array_equal(a, r)
                                                    for a, r in zip(got, ref))
                ref = got if ref is None else ref
                rows.append(dict(batch=b, n=n, variant=f"{name} {impl} {precision}", ms=ms,
                                 hbm_fraction=b * n * M / HBM / (ms * 1e-3),
                                 equal_to_paged=same))
                write_results(args.out, "results.json", args, rows)
    print(f"{'batch':>5} {'variant':>26} {'ms':>8} {'of HBM':>7} {'= paged':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['variant']:>26} {r['ms']:8.3f} {r['hbm_fraction']:7.1%} "
              f"{str(r['equal_to_paged']):>8}")


if __name__ == "__main__":
    main()
