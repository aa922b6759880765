"""How fast can a kernel read random rows of pinned host memory, by row layout? (issue 13: the
hot-cache resolve of V4's 583-byte FP8 rows dominates the 512K decode step.)

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/host_rows_gpu.py --out $OUT/host_rows
    python benchmarks/host_rows_gpu.py --dry --out /tmp/hr   # CPU: small pools, interpreter

Session 40's profile at 512K, batch 36 (results/profile_b36_512k_p03/) gave the KV resolve's
apply kernel 1.18-1.27 ms for ~30K missed rows (36 requests x 2 CSA layers x 512 x 81%
misses) of ``kv_dtype="fp8_v4"``: 17 MB, ~14 GB/s, where f32 rows of 2 KiB moved at the
link's 48 GB/s in session 17. An fp8_v4 row is three host arrays (``quant.kv_rows.FP8Rows``:
448 B of e4m3 values as 112 words, 7 B of e8m0 scales, 128 B of bf16 RoPE part), so a missed
row is three short reads. This probe gathers M random rows of a multi-GB pinned_host pool
into device memory with a kernel shaped like ``hot_resolve``'s apply (KB rows x D a program,
masked pow2 tiles), by layout:
  split3        the three arrays, each leaf loaded then stored (today's apply kernel)
  split3_first  the three arrays, every leaf loaded before any is stored
  packed146     one array of 584-byte rows (146 words: the three fields side by side)
  packed160     one array of 640-byte rows (160 words: padded to a multiple of 128 B)
  nope112       the e4m3 values alone (448 B)
  rows512       512-byte rows (128 words)
  f32_2k        2048-byte rows (512 f32: the session-17 reference)
  packed146_dev packed146 from a device pool (the kernel's own ceiling, HBM)
  packed146_small packed146 from a 38 MB host pool (the same reads, few host pages: TLB)
  keys_*        LeanSparse's indexer-key rows (``--layouts keys``: the KEY_LAYOUTS set): split
                (today's host key pages: 32 words of e4m3 values + a 1-word f32 scale, two
                arrays; _first: both loaded before any store), keys33 (the two packed in
                one 132-byte row), keys36 / keys64 (padded to 144 / 256 bytes), keys32 (the
                values alone: a floor)
  *_seq         that layout's rows read in order (M consecutive rows from a random start:
                the link's streaming rate through the same kernel; not in the default set)
each at M = --rows (default 4096 and 29952) and KB = --kb rows a program. Ids are random
(redrawn per input set); pool values are their own offsets (word r * D + c), and every
output is checked against them. Timing: ``timing.program_time`` (--sets input sets in one
jitted program, median of --repeats). GB/s counts the row bytes moved (584 / 640 / ... B).
Writes OUT/results.json after every row, OUT/host_rows.png (GB/s by layout, one series per
M) and prints a table last; ``--plot A.json,B.json --out DIR`` redraws the plot of saved runs.
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
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402
from timing import program_time, write_results  # noqa: E402

from pallas_kernels import common  # noqa: E402

PCIE = 48e9
# layout -> leaves (dtype, D) of one row
LAYOUTS = {
    "split3": ((np.uint32, 112), (np.uint8, 7), (np.uint16, 64)),
    "split3_first": ((np.uint32, 112), (np.uint8, 7), (np.uint16, 64)),
    "packed146": ((np.uint32, 146),),
    "packed160": ((np.uint32, 160),),
    "nope112": ((np.uint32, 112),),
    "rows512": ((np.uint32, 128),),
    "f32_2k": ((np.uint32, 512),),
    "packed146_dev": ((np.uint32, 146),),
    "packed146_small": ((np.uint32, 146),),
    "rows512_seq": ((np.uint32, 128),),
    "packed160_seq": ((np.uint32, 160),),
    "f32_2k_seq": ((np.uint32, 512),),
    # LeanSparse's indexer-key rows (128 e4m3 values = 32 words, one f32 scale): as the host
    # key pages store them (two arrays), packed into one 132-byte row, padded to 144 / 256
    # bytes, and the values alone (the floor)
    "keys_split": ((np.uint32, 32), (np.uint32, 1)),
    "keys_split_first": ((np.uint32, 32), (np.uint32, 1)),
    "keys33": ((np.uint32, 33),),
    "keys36": ((np.uint32, 36),),
    "keys64": ((np.uint32, 64),),
    "keys32": ((np.uint32, 32),),
}
KEY_LAYOUTS = ("keys_split", "keys_split_first", "keys33", "keys36", "keys64", "keys32")
DEFAULT_LAYOUTS = ("split3", "split3_first", "packed146", "packed160", "nope112", "rows512",
                   "f32_2k", "packed146_dev", "packed146_small")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _kernel(ids_ref, *refs, kb, m, dims, first, pid=None):
    """Rows KB * pid .. KB * (pid + 1) - 1 (pid: the program id unless given, as by
    benchmarks/colaunch_gpu.py's shared grid)."""
    n = len(dims)
    pools, outs = refs[:n], refs[n:]
    j = (pl.program_id(0) if pid is None else pid) * kb + lax.broadcasted_iota(jnp.int32, (kb,), 0)
    ok = j < m
    jc = jnp.minimum(j, m - 1)
    src = plgpu.load(ids_ref.at[jc], mask=ok, other=0)

    def cols(d):  # a row's pow2 tile of columns and the tile's mask
        col = lax.broadcasted_iota(jnp.int32, (_pow2(d),), 0)
        return col, ok[:, None] & (col[None, :] < d)

    def load(pool, d):
        col, m2 = cols(d)
        return plgpu.load(pool.at[src[:, None], jnp.minimum(col, d - 1)[None, :]], mask=m2)

    def store(out, d, vals):
        col, m2 = cols(d)
        # j and col unclamped: masked lanes get distinct slots past the array (dropped by the
        # interpreter, whose masked scatter would let a clamped duplicate overwrite a value)
        plgpu.store(out.at[j[:, None], col[None, :]], vals, mask=m2)

    if first:
        vals = [load(p, d) for p, d in zip(pools, dims)]
        for o, d, v in zip(outs, dims, vals):
            store(o, d, v)
    else:
        for p, o, d in zip(pools, outs, dims):
            store(o, d, load(p, d))


@functools.partial(jax.jit, static_argnames=("kb", "first", "num_warps"))
def gather(ids, pools, *, kb, first, num_warps):
    """rows[l][i] = pools[l][ids[i]] for each leaf l (one launch, KB rows a program)."""
    m = ids.shape[0]
    dims = tuple(p.shape[1] for p in pools)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, kb=kb, m=m, dims=dims, first=first),
        grid=(-(-m // kb),), in_specs=[any_] * (1 + len(pools)), out_specs=[any_] * len(pools),
        out_shape=[jax.ShapeDtypeStruct((m, d), p.dtype) for p, d in zip(pools, dims)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=common.interpret(), name="host_rows")(ids, *pools)


def _gather_args(ids, *pools, kb, first, num_warps):
    return gather(ids, pools, kb=kb, first=first, num_warps=num_warps)


def make_pool(dtype, d, n, where):
    """[n, d] of dtype, value at (r, c) = (r * d + c) mod 2^bits, placed in ``where``."""
    bits = np.dtype(dtype).itemsize * 8
    vals = (np.arange(n, dtype=np.uint64)[:, None] * d + np.arange(d, dtype=np.uint64))
    vals = (vals & np.uint64((1 << bits) - 1)).astype(dtype)
    return jax.device_put(vals, where)


def check(rows, ids, pools):
    ids = np.asarray(ids, np.uint64)
    for r, p in zip(rows, pools):
        d, bits = p.shape[1], p.dtype.itemsize * 8
        want = (ids[:, None] * d + np.arange(d, dtype=np.uint64)) & np.uint64((1 << bits) - 1)
        if not np.array_equal(np.asarray(r).astype(np.uint64), want):
            return False
    return True


def bar_groups(groups: list[str], series: dict[str, dict[str, float]], path, ylabel: str,
               width_per_group: float = 0.55, log: bool = False, rotate: bool = False,
               line=None) -> None:
    """One group of bars per name in ``groups``, one bar series per key of ``series``
    (label -> {group: value}; a missing value draws 0); a log y axis, slanted group names
    and ``line`` = (y, label), a dashed reference line, where asked. Saved to ``path``."""
    from experiments.common import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, width_per_group * len(groups) + 2), 3.8))
    width = 0.8 / len(series)
    for i, (label, got) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(groups))], [got.get(g, 0.0) for g in groups],
               width, label=label)
    if line is not None:
        ax.axhline(line[0], color="grey", lw=0.8, ls="--", label=line[1])
    if log:
        ax.set_yscale("log")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
    ax.set_xticklabels(groups, rotation=60 if rotate else 0,
                       ha="right" if rotate else "center", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(results: list[dict], path) -> None:
    """GB/s of row bytes by layout (one bar series per M), the 48 GB/s link as a line."""
    name = lambda r: f"{r['layout']} kb{r['kb']} w{r['num_warps']}"  # noqa: E731
    series = {f"M = {m} rows": {name(r): r["gb_per_s"] for r in results if r["rows"] == m}
              for m in sorted({r["rows"] for r in results})}
    bar_groups(list(dict.fromkeys(name(r) for r in results)), series, path,
               "GB/s of row bytes", log=True, rotate=True,
               line=(PCIE / 1e9, "48 GB/s (H200 probe)"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="4096,29952")
    ap.add_argument("--kb", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--pool-rows", type=int, default=1 << 22, help="rows of the host pools")
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                    help=f"comma-separated, of {', '.join(LAYOUTS)}; or 'keys'")
    ap.add_argument("--dry", action="store_true", help="CPU: small pools, 2 sets, 1 repeat")
    ap.add_argument("--plot", help="comma-separated results.json files: redraw, run nothing")
    args = ap.parse_args()
    if args.plot:
        saved = [r for f in args.plot.split(",") for r in json.loads(
            pathlib.Path(f).read_text())["results"]]
        plot(saved, pathlib.Path(args.out) / "host_rows.png")
        return
    if args.dry:
        args.pool_rows, args.rows, args.sets, args.repeats = 4096, "96", 2, 1
    host = jax.memory.Space.Host if common.on_gpu() else jax.memory.Space.Device
    rng = np.random.default_rng(0)
    results = []
    layouts = ",".join(KEY_LAYOUTS) if args.layouts == "keys" else args.layouts
    for name in layouts.split(","):
        leaves = LAYOUTS[name]
        n = (args.pool_rows // 4 if name.startswith("f32_2k") else args.pool_rows)
        n = 1 << 16 if name.endswith("_small") and not args.dry else n
        where = jax.memory.Space.Device if name.endswith("_dev") else host
        t0 = time.perf_counter()
        pools = [make_pool(dt, d, n, where) for dt, d in leaves]
        made_s = time.perf_counter() - t0
        row_bytes = sum(np.dtype(dt).itemsize * d for dt, d in leaves)
        for m in (int(x) for x in args.rows.split(",")):
            # the pools are arguments of the timed program (a closed-over pool would become
            # a constant in device memory)
            seq = name.endswith("_seq")
            sets = [(jnp.asarray(rng.integers(0, n - m) + np.arange(m) if seq
                                 else rng.integers(0, n, m), jnp.int32), *pools)
                    for _ in range(args.sets)]
            fn = functools.partial(_gather_args, kb=args.kb, first=name.endswith("first"),
                                   num_warps=args.warps)
            ok = check(fn(*sets[0]), sets[0][0], pools)
            sec = program_time(fn, sets, repeats=args.repeats)
            row = dict(layout=name, rows=m, row_bytes=row_bytes, pool_rows=n,
                       pool_gb=n * row_bytes / 1e9, kb=args.kb, num_warps=args.warps,
                       us=sec * 1e6, gb_per_s=m * row_bytes / sec / 1e9,
                       of_pcie=m * row_bytes / sec / PCIE, correct=ok, pool_made_s=made_s)
            results.append(row)
            write_results(args.out, "results.json", args, results)
        del pools
    plot(results, pathlib.Path(args.out) / "host_rows.png")
    print(f"{'layout':16s} {'rows':>6s} {'B/row':>6s} {'us':>9s} {'GB/s':>7s} {'%pcie':>6s} ok")
    for r in results:
        print(f"{r['layout']:16s} {r['rows']:6d} {r['row_bytes']:6d} {r['us']:9.1f} "
              f"{r['gb_per_s']:7.2f} {100 * r['of_pcie']:6.1f} {r['correct']}")


if __name__ == "__main__":
    main()
