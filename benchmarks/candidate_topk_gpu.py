"""``candidate_topk`` on the GPU: the Pallas kernel's launch variants against the XLA sorts it
replaces in LeanSparse's decode step (session 30), at the step's shapes.

    PYTHONPATH=$PWD python3 benchmarks/candidate_topk_gpu.py --out $OUT

Rows: B requests in {1, 8, 64}; R = 2048 (the miss filter's C coarse scores) and 2112 (the
rerank's C + P); k = 512. Variants: "xla" (the op's twin: one two-key sort a row, what the
rerank ran before), "xla_sort" (a one-key sort of the scores: what the miss filter ran),
"triton nw W bc BC" (the kernel with W warps and BC lanes a register row; session 44 also
timed the radix count's forms, "triton blocks / flat1 / flat2 nw W", before keeping flat1:
git history, ``results/candidate_topk_s44/``); at R = 2048 also
the whole ``miss_filter`` op, "miss_filter xla" and "miss_filter triton" (k-th score,
statistics and threshold in one kernel; 10% of the candidates cached). Each kernel row's
winners are checked against the twin's as sets (ties by id: scores drawn from 64 values so
that the tie search runs). Time per call: one jitted program over 8 distinct argument sets
(``timing.program_time``). Writes OUT/candidate_topk.json after every row; prints a table.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax.numpy as jnp
import numpy as np
from timing import program_time, write_results  # benchmarks/timing.py

from pallas_kernels.miss_filter import miss_filter
from pallas_kernels.topk.api import candidate_topk
from pallas_kernels.topk.candidates import candidate_topk_triton

VARIANTS = [("xla", None), ("xla_sort", None)] + [
    (f"triton nw {w} bc {bc}", dict(num_warps=w, block_c=bc))
    for w in (4, 8, 16) for bc in (128, 256)] + [
    ("miss_filter xla", None), ("miss_filter triton", None)]


def make_sets(b, r, n_sets, seed):
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(n_sets):
        scores = rng.integers(0, 64, (b, r)).astype(np.float32) / 8  # ties at the k-th
        ids = np.stack([rng.choice(1 << 20, r, replace=False) for _ in range(b)])
        ids[rng.random((b, r)) < 0.1] = -1
        sets.append((jnp.asarray(scores), jnp.asarray(ids.astype(np.int32))))
    return sets


def _filter(scores, ids, *, k, implementation):
    """The miss filter on the rows' coarse scores (valid where ids >= 0, 10% cached)."""
    valid = ids >= 0
    return miss_filter(scores, valid, valid & (ids % 10 == 0), k=k, offset=1.0,
                       implementation=implementation)


def same_sets(got, want) -> bool:
    return all(set(g.tolist()) == set(w.tolist())
               for g, w in zip(np.asarray(got[0]), np.asarray(want[0])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--variants", default=None, help="comma-separated names (default: all)")
    args = ap.parse_args()
    rows = []
    for r in (2048, 2112):
        for b in map(int, args.batches.split(",")):
            sets = make_sets(b, r, 8, seed=b * r)
            want = candidate_topk(*sets[0], args.k, implementation="xla")
            for name, kw in VARIANTS:
                if args.variants and name not in args.variants.split(","):
                    continue
                if name.startswith("miss_filter"):
                    if r != 2048:
                        continue
                    fn = functools.partial(_filter, k=args.k,
                                           implementation=name.split()[-1])
                elif name == "xla":
                    fn = functools.partial(candidate_topk, k=args.k, implementation="xla")
                elif name == "xla_sort":
                    fn = lambda s, i: jnp.sort(s, axis=-1)  # noqa: E731
                else:
                    fn = functools.partial(candidate_topk_triton, k=args.k, **kw)
                row = dict(B=b, R=r, k=args.k, variant=name)
                try:
                    if kw is not None:
                        row["same_set_as_xla"] = same_sets(fn(*sets[0]), want)
                    row["us"] = 1e6 * program_time(fn, sets, repeats=args.repeats)
                except Exception as err:  # a launch variant that does not compile
                    row["error"] = f"{type(err).__name__}: {err}"[:300]
                rows.append(row)
                write_results(args.out, "candidate_topk.json", args, rows)
                print(row, flush=True)
    print(f"\n{'R':>5s} {'B':>3s} {'variant':22s} {'us':>8s}  set")
    for row in rows:
        us = f"{row['us']:8.1f}" if "us" in row else f"{'n/a':>8s}"
        print(f"{row['R']:5d} {row['B']:3d} {row['variant']:22s} {us}  "
              f"{row.get('same_set_as_xla', '')}{row.get('error', '')[:60]}")


if __name__ == "__main__":
    main()
