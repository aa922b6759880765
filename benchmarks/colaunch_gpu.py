"""Does a host-row copy overlap a coarse PQ pass when both share one launch? (issue 13: the
paper's request groups, Section 5, hide one group's indexer-key reads under another group's
coarse scoring.)

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/colaunch_gpu.py --out $OUT/colaunch
    python benchmarks/colaunch_gpu.py --dry --out /tmp/cl   # CPU: small shapes, interpreter

Sessions 21-22 measured that XLA runs the step's kernels one after another on one stream
(with the fetch annotated onto a second stream, nothing overlapped), so a group's key fetch
and the next group's coarse pass could only overlap inside one kernel whose grid holds both.
This probe builds that kernel from the two bodies as they are and times it:
  copy     M random rows of a pinned-host pool gathered into device memory
           (``host_rows_gpu._kernel``; a key-cache row is 128 FP8 values as 32 words plus a
           4-byte scale: --leaves 32,1), KB rows a program
  coarse   the Pallas coarse PQ scores of B requests x N positions
           (``pallas_kernels.pq_topc.triton._coarse_kernel``, fp8 by default: H 64, D 128,
           M 32 subspaces, K 256), one program per (request, span)
  both     one jitted program running copy then coarse (two launches; ~ their sum)
  co_<order> one launch, grid = copy programs + coarse programs, each program running one
           body by its id; order = which programs get the low ids (the block scheduler
           dispatches low ids first): copy_first, coarse_first, interleave (spread evenly)
overlap = (copy + coarse - co) / min(copy, coarse): 1 = the shorter one fully hidden, 0 = none.
Every co-launch's outputs are checked against the separate launches (bit for bit). The
step's coarse pass is the jax-triton kernel (``pq_topc/jax_triton.py``): this Pallas one took
849-1100 us alone at B 18 on an H100 (session 41), the jax-triton fp8 kernel ~0.24 ms a layer
at B 36 in the step, so the probe answers whether the two kinds of program overlap, not what
a co-launch would save in the step; a Pallas body is what can share a Pallas grid with the
copy. Timing:
``timing.program_time`` (--sets input sets in one jitted program, median of --repeats).
Writes OUT/results.json after every row, OUT/colaunch.png, and prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from host_rows_gpu import _kernel as copy_kernel  # noqa: E402
from host_rows_gpu import bar_groups, check, gather, make_pool  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402
from timing import program_time, write_results  # noqa: E402

from pallas_kernels import common  # noqa: E402
from pallas_kernels.pq_topc import triton as pq  # noqa: E402

ORDERS = ("copy_first", "coarse_first", "interleave")


def roles(order: str, n_copy: int, n_coarse: int):
    """pid -> (is_copy, copy index, coarse index) of a grid of n_copy + n_coarse programs
    (works on traced int32 scalars and Python ints; every index is taken exactly once)."""
    total = n_copy + n_coarse
    if order not in ORDERS:
        raise ValueError(f"colaunch: order={order!r} is unknown; allowed: {ORDERS}")

    def role(pid):
        if order == "copy_first":
            return pid < n_copy, pid, pid - n_copy
        if order == "coarse_first":
            return pid >= n_coarse, pid - n_coarse, pid
        before = (pid * n_copy) // total  # copy programs among ids < pid
        return ((pid + 1) * n_copy) // total > before, before, pid - before

    return role


def coarse_operands(q, weights, codes, codebooks, lengths, precision):
    """(the kernel's operands, its layout) as ``pq.coarse_scores_triton`` builds them."""
    q, weights, codebooks = pq._quantized(q, weights, codebooks, precision)
    lay = pq._layout(q, codes, codebooks, None)
    return pq._operands(q, weights, codes, codebooks, lengths, lay), lay


@functools.partial(jax.jit, static_argnames=("kb", "order", "num_warps", "precision"))
def colaunch(ids, pools, q, weights, codes, codebooks, lengths, *, kb, order, num_warps,
             precision):
    """(rows gathered as ``host_rows_gpu.gather``, coarse scores [B, N_pad] as the Pallas
    coarse kernel) from one launch whose grid holds both kernels' programs."""
    ops, lay = coarse_operands(q, weights, codes, codebooks, lengths, precision)
    m, n = ids.shape[0], len(pools)
    dims = tuple(p.shape[1] for p in pools)
    n_copy, n_span = -(-m // kb), lay.n_pad // lay.span
    role = roles(order, n_copy, lay.b * n_span)

    def blk(pid):  # (request, span) of a coarse program; a copy program maps to a valid block
        r = jnp.clip(role(pid)[2], 0, lay.b * n_span - 1)
        return r // n_span, r % n_span

    def kernel(*refs):
        pid = pl.program_id(0)
        is_copy, c, r = role(pid)
        copy_in, coarse_in = refs[:1 + n], refs[1 + n:6 + n]
        copy_out, scores = refs[6 + n:6 + 2 * n], refs[6 + 2 * n]

        @pl.when(is_copy)
        def _():
            copy_kernel(*copy_in, *copy_out, kb=kb, m=m, dims=dims, first=False, pid=c)

        @pl.when(jnp.logical_not(is_copy))
        def _():
            pq._coarse_kernel(*coarse_in, scores, block_n=lay.p.block_n,
                              blocks_per_program=lay.p.blocks_per_program,
                              num_centroids=lay.k, fused=False, ids=(r // n_span, r % n_span))

    any_ = pl.BlockSpec(memory_space=pl.ANY)
    first = lambda p: blk(p)[0]  # noqa: E731
    in_specs = [any_] * (1 + n) + [
        pl.BlockSpec((1,), lambda p: (first(p),)),  # lengths
        pl.BlockSpec((None, lay.dp, lay.hp), lambda p: (first(p), 0, 0)),  # q^T
        pl.BlockSpec((None, lay.hp), lambda p: (first(p), 0)),  # weights
        pl.BlockSpec((None, lay.span, lay.mp), lambda p: (*blk(p), 0)),  # codes
        any_]  # codebooks
    out_specs = [any_] * n + [pl.BlockSpec((None, lay.span), lambda p: blk(p))]
    out_shape = ([jax.ShapeDtypeStruct((m, d), p.dtype) for p, d in zip(pools, dims)]
                 + [jax.ShapeDtypeStruct((lay.b, lay.n_pad), jnp.float32)])
    outs = pl.pallas_call(
        kernel, grid=(n_copy + lay.b * n_span,), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=max(num_warps, lay.p.num_warps),
                                             num_stages=lay.p.num_stages),
        interpret=common.interpret(), name="colaunch")(ids, *pools, *ops)
    return tuple(outs[:n]), outs[n]


@functools.partial(jax.jit, static_argnames=("kb", "num_warps"))
def copy_alone(ids, pools, *, kb, num_warps):
    return tuple(gather(ids, pools, kb=kb, first=False, num_warps=num_warps))


@functools.partial(jax.jit, static_argnames=("precision",))
def coarse_alone(q, weights, codes, codebooks, lengths, *, precision):
    ops, lay = coarse_operands(q, weights, codes, codebooks, lengths, precision)
    return pq._score_call(lay, common.interpret())(*ops)


def coarse_inputs(rng, b, n, h=64, d=128, m=32, k=256):
    """Random q [B, H, D], weights [B, H], codes [B, N, M] uint8, codebooks [M, K, D/M], full
    lengths (every position eligible)."""
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    codes = jnp.asarray(rng.integers(0, k, (b, n, m)), jnp.uint8)
    return f(b, h, d), jnp.abs(f(b, h)), codes, f(m, k, d // m), jnp.full((b,), n, jnp.int32)


def plot(results: list[dict], path) -> None:
    """us by variant, one group of bars per (M, B) cell."""
    cell = lambda r: f"M {r['rows']}, B {r['batch']}"  # noqa: E731
    series = {v: {cell(r): r["us"] for r in results if r["variant"] == v}
              for v in dict.fromkeys(r["variant"] for r in results)}
    bar_groups(list(dict.fromkeys(cell(r) for r in results)), series, path, "us per call",
               width_per_group=1.4)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="12288,36864", help="copied rows M per cell")
    ap.add_argument("--batch", default="18", help="coarse requests B per cell")
    ap.add_argument("--history", type=int, default=131104, help="coarse positions N")
    ap.add_argument("--leaves", default="32,1", help="words of each row leaf (uint32)")
    ap.add_argument("--kb", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--precision", default="fp8", choices=("bf16", "fp8"))
    ap.add_argument("--orders", default=",".join(ORDERS))
    ap.add_argument("--pool-rows", type=int, default=1 << 24, help="rows of the host pool")
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dry", action="store_true", help="CPU: small shapes, 1 set, 1 repeat")
    args = ap.parse_args()
    if args.dry:
        args.pool_rows, args.rows, args.batch, args.history = 4096, "200", "2", 1024
        args.sets, args.repeats = 1, 1
    host = jax.memory.Space.Host if common.on_gpu() else jax.memory.Space.Device
    rng = np.random.default_rng(0)
    dims = [int(x) for x in args.leaves.split(",")]
    pools = [make_pool(np.uint32, d, args.pool_rows, host) for d in dims]
    row_bytes = 4 * sum(dims)
    # Every timed function takes the pools as an argument (a set is (ids, pools, coarse
    # inputs)): a closed-over pool would become a constant of the program in device memory.
    cp = functools.partial(copy_alone, kb=args.kb, num_warps=args.warps)
    co = functools.partial(coarse_alone, precision=args.precision)

    def run_copy(ids, pools, *_):
        return cp(ids, pools)

    def run_coarse(_, __, *c):
        return co(*c)

    def run_both(ids, pools, *c):
        return cp(ids, pools), co(*c)

    results = []
    for m in (int(x) for x in args.rows.split(",")):
        for b in (int(x) for x in args.batch.split(",")):
            sets = [(jnp.asarray(rng.integers(0, args.pool_rows, m), jnp.int32), tuple(pools),
                     *coarse_inputs(rng, b, args.history)) for _ in range(args.sets)]
            rows0, scores0 = run_both(*sets[0])
            variants = [("copy", run_copy, True), ("coarse", run_coarse, True),
                        ("both", run_both, True)]
            for order in args.orders.split(","):
                fn = functools.partial(colaunch, kb=args.kb, order=order,
                                       num_warps=args.warps, precision=args.precision)

                def run_co(ids, pools, *c, fn=fn):
                    return fn(ids, pools, *c)

                rows1, scores1 = run_co(*sets[0])
                same = (check(rows1, sets[0][0], pools)
                        and all(np.array_equal(np.asarray(a), np.asarray(z))
                                for a, z in zip(rows1, rows0))
                        and np.array_equal(np.asarray(scores1), np.asarray(scores0)))
                variants.append((f"co_{order}", run_co, same))
            cell = {}
            for name, fn, ok in variants:
                cell[name] = program_time(fn, sets, repeats=args.repeats) * 1e6
                row = dict(variant=name, rows=m, batch=b, history=args.history,
                           row_bytes=row_bytes, kb=args.kb, num_warps=args.warps,
                           precision=args.precision, us=cell[name], correct=bool(ok),
                           copy_gb_per_s=m * row_bytes / cell["copy"] / 1e3)
                if name.startswith("co_"):
                    saved = cell["copy"] + cell["coarse"] - cell[name]
                    row["overlap"] = saved / min(cell["copy"], cell["coarse"])
                results.append(row)
                write_results(args.out, "results.json", args, results)
    plot(results, pathlib.Path(args.out) / "colaunch.png")
    print(f"{'variant':18s} {'M':>6s} {'B':>3s} {'us':>9s} {'overlap':>8s} ok")
    for r in results:
        ov = f"{r['overlap']:8.2f}" if "overlap" in r else " " * 8
        print(f"{r['variant']:18s} {r['rows']:6d} {r['batch']:3d} {r['us']:9.1f} {ov} "
              f"{r['correct']}")


if __name__ == "__main__":
    main()
