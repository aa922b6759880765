"""Issue 16, hot_resolve: where the fused op's time goes, by kernel, at decode shapes.

Run on the GPU machine: python3 benchmarks/hot_resolve_phases_gpu.py [--out DIR] [--quick]
Cases (S requests vmapped, k selected, R hot rows, M = round(miss * k) misses a request):
  target     S 64, k 512,  R 2048, f32 D 512        miss 0.05 and 0 (issue 16's hot_resolve
             target shape: <= 0.10 ms with 5% misses, <= 0.03 ms all hits)
  his_b1     S 1,  k 512,  R 4096, f32 D 512        miss 0.99 (HiSparse at batch 1: ~1.4% reuse
             in the scale runs)
  key_b1/64  S 1 / 64, k 2112, R 4096, (f32 D 32, f32 D 1) miss 0.95 (LeanSparse's key cache:
             C + P positions, 128 FP8 bytes = 32 words and a scale per key)
  *_wide     his_b1 and key_b1 with 32768 positions a request (a CSA layer at 128K) instead
             of R + k: the map's [S, NPOS] scratch as large as in the decode step (session
             29's decode profile at 128K, batch 1: hot_resolve_front 54-57 us a call, against
             map + control ~25-27 us here with the small universe)
  his_b1_bigpool  his_b1 with 1M positions a request (a 2 GiB pinned-host pool of f32 rows,
             as at 1M context): whether apply's host reads slow down over a large pool (the
             decode step's apply took ~45 us a call at batch 1, ~24 us here)
Variants: RADIX_BITS 2 (default) or 4 of ``fused._mth_smallest``; stamps "recent" (a cache
after 1000 steps: distinct stamps below 1000 * k, a ~21-bit spread: 11 radix steps at 2 bits)
or "full" (one unselected row stamped 2^31 - 2: all 16 steps, the cost before session 29's
range trim). Every program is first checked equal to "xla" bit for bit. Timing: the two-launch
op ("triton_fused2", the decode steps' default) as ``hot_resolve_gpu.time_program`` (hot rows
donated, 4 input sets a program, median of 10); profile: the three-launch op ("triton_fused":
map, control, apply as separate kernels) and the two-launch op (front = map + control in one
program, apply) traced once each, us per call by kernel. ``--cases`` picks cases by name.
Writes hot_resolve_phases.json.
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from hot_resolve_gpu import PAGE, SETS, profile, program, time_program  # benchmarks/

from experiments.cases import hot_resolve as case
from pallas_kernels.hot_resolve import fused

CLOCK = 1000  # decode steps the cache has served (stamps below CLOCK * k)
CASES = {  # name: (S, k, R, leaf dims, miss fractions, positions a request: None = R + k)
    "target": (64, 512, 2048, (512,), (0.05, 0.0), None),
    "his_b1": (1, 512, 4096, (512,), (0.99,), None),
    "key_b1": (1, 2112, 4096, (32, 1), (0.95,), None),
    "key_b64": (64, 2112, 4096, (32, 1), (0.95,), None),
    "his_b1_wide": (1, 512, 4096, (512,), (0.99,), 32768),
    "key_b1_wide": (1, 2112, 4096, (32, 1), (0.95,), 32768),
    "his_b1_bigpool": (1, 512, 4096, (512,), (0.99,), 1 << 20),
}
VARIANTS = (("radix2", 2, "recent"), ("radix2", 2, "full"), ("radix4", 4, "recent"))


def pools(s, dims, universe_rows):
    """pinned_host pools (one per leaf) and a page table [S, MP] of distinct pages."""
    pages = s * (-(-universe_rows // PAGE))
    rng = np.random.default_rng(0)
    table = rng.permutation(pages).astype(np.int32).reshape(s, -1)
    leaves = tuple(jax.device_put(jnp.asarray(rng.standard_normal((pages * PAGE, d), np.float32)),
                                  case.HOST) for d in dims)
    return leaves, jnp.asarray(table)


def inputs(key, s, k, r, dims, miss, table, stamps_kind):
    """case.make_inputs' full cache with M misses, stamps rescaled to a decode's (CLOCK steps
    of k ranks) and, for "full", one unselected row at 2^31 - 2."""
    sel, _, held, stamps, _ = case.make_inputs(key, s, k, r, 1, miss, table, PAGE)
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30)))
    stamps = np.stack([np.sort(rng.choice(CLOCK * k, r, replace=False))[np.asarray(st)]
                       for st in stamps]).astype(np.int32)
    if stamps_kind == "full":
        for q in range(s):
            free = np.flatnonzero(~np.isin(np.asarray(held[q]), np.asarray(sel[q])))
            stamps[q, free[0]] = 2**31 - 2
    rows = tuple(jax.random.normal(jax.random.fold_in(key, d), (s, r, d), jnp.float32)
                 for d in dims)
    clock = jnp.full((s,), CLOCK, jnp.int32)
    return sel, rows, held, jnp.asarray(stamps), clock


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="radix2/recent only")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = VARIANTS[:1] if args.quick else VARIANTS
    results, default_bits = [], fused.RADIX_BITS
    try:
        run(out, variants, results, args.cases.split(",") if args.cases else list(CASES))
    finally:
        fused.RADIX_BITS = default_bits


def run(out, variants, results, names):
    """Every case of ``names`` x miss fraction x variant: checked, timed, profiled; the JSON
    rewritten after each row."""
    for name in names:
        s, k, r, dims, misses, universe = CASES[name]
        pool, table = pools(s, dims, universe or r + k)
        for miss in misses:
            for label, bits, stamps_kind in variants:
                fused.RADIX_BITS = bits
                sets = [inputs(jax.random.key(10 + i), s, k, r, dims, miss, table, stamps_kind)
                        for i in range(SETS)]
                rest = [(x[0], x[2], x[3], x[4], table) for x in sets]
                fresh = lambda sets=sets: [tuple(y + 0 for y in x[1]) for x in sets]  # noqa: E731
                outs = {impl: program(impl)(fresh(), rest, pool)
                        for impl in ("xla", "triton_fused", "triton_fused2")}
                for impl in ("triton_fused", "triton_fused2"):
                    for a, b in zip(jax.tree.leaves(outs["xla"]), jax.tree.leaves(outs[impl])):
                        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (name, impl)
                counts = np.asarray(outs["xla"][0][5])
                ms = time_program(program("triton_fused2"), fresh, rest, pool) * 1e3
                got = profile(program("triton_fused"), fresh, rest, pool)
                got2 = profile(program("triton_fused2"), fresh, rest, pool)
                row = dict(case=name, S=s, k=k, R=r, dims=list(dims), miss=miss,
                           misses=int(counts[:, 1].mean()), variant=label,
                           radix_bits=bits, stamps=stamps_kind, fused2_ms=ms,
                           kernels_us=got.get("by_name", {}), span_us=got.get("span_us"),
                           positions=int(table.shape[1] * PAGE),
                           fused2_kernels_us=got2.get("by_name", {}),
                           fused2_span_us=got2.get("span_us"))
                results.append(row)
                kern = " | fused2: ".join(
                    " ".join(f"{n.replace('hot_resolve_', '')}={u:.1f}" for n, u in d.items())
                    for d in (row["kernels_us"], row["fused2_kernels_us"]))
                print(f"{name:8s} miss {miss:4.2f} M {row['misses']:5d} {label:6s} "
                      f"{stamps_kind:6s} fused2 {ms:7.3f} ms | fused: {kern}", flush=True)
                (out / "hot_resolve_phases.json").write_text(json.dumps(
                    {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                     "rows": results}, indent=2))


if __name__ == "__main__":
    main()
