"""The jax-triton pq score kernel's launch variants on one GPU (issues 13 and 16: the coarse pass
reads its PQ codes at 0.27 TB/s where HiSparse's indexer reads FP8 keys at 0.86).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/pq_variants_gpu.py --out $OUT/pq_variants

Variants (``pallas_kernels.pq_topc.jax_triton.Params``; ptxas registers for sm_90a at fp8 from
``benchmarks/pq_ptx_census.py``-style compiles on a CPU, session 36):
  default            BN 256, 8 warps (168 registers: one program a SM; bf16's default launch,
                     fp8's until session 37)
  prefetch           the next tile's codes loaded before this tile's decode (207)
  book_per_tile      the book reloaded from L1/L2 in each tile, not held in registers (146)
  prefetch+book      both (177)
  bn128+both         BN 128, 16 steps, both (126: two programs a SM)
  bn128+book         BN 128, 16 steps, book per tile (108)
  w16                BN 256, 16 warps (123)
  w16+both           16 warps, both (126)
  bn512+w16+book     BN 512, 4 steps, 16 warps, book per tile (128, 40 bytes spilled)
``--set fp8_s38``: variants of fp8's session-37 launch (BN 128, 16 steps, 8 warps, book per
tile; the ratios' base): steps 8 / 32, 3 stages, 4 or 16 warps, BN 64, BN 256 with
16 warps (half the book's re-staging a key: 40 KB of shared stores a tile), and the keys
as the dot's B operand (``Params.keys_as_b``: 90 instead of 108 registers, ptxas on a CPU);
with ``--precisions fp8``. ``--set fp8_w4``: 4 warps (fp8's default since session 38,
``FP8_PARAMS``) and three variants of it against the same base; ``--set bf16_w4``: 4-warp
launches at bf16 against DEFAULT_PARAMS (``--precisions bf16``).
Shapes: the decode step's at 512K (N 131072 codes a request): batch 64 contiguous (the
kernel_compare target) and batch 36 paged (pages of 64 rows in a shuffled pool: the capacity
study's 512K cell), fp8 then bf16. Random codes; row 0 of each batch holds N / 3 positions.
Timing: --rounds rounds; in each, every variant's median of --repeats synchronized calls
(after 2 warm-ups), the variants' order rotated by one a round, so drift between rounds
(session 36: the same variant's time moved by up to 30% between three back-to-back runs)
falls on all alike. Each row: the median over rounds (ms, and its range), the codes' bytes
over that time (TB/s, HBM ~3.0 TB/s on an H100), the median of the per-round ratios to the
default launch (and their range; rounds_faster counts the rounds it beat the default), and
whether its scores equal the default's bit for bit (else the max relative difference).
Writes OUT/results.json after each shape and OUT/pq_variants.png (each variant's ratio to the
default per precision and shape; the range as a bar); prints the table last.
``--plot-runs A.json B.json ...`` only draws the ratios of earlier runs (one point a run) to
OUT/pq_variants.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # benchmarks/timing.py
from timing import compare_outputs, interleaved_rounds, median_time, summarize_rounds  # noqa: E402

from pallas_kernels.pq_topc import jax_triton as jt  # noqa: E402

VARIANTS = {
    "default": jt.Params(),
    "prefetch": jt.Params(prefetch=True),
    "book_per_tile": jt.Params(book_per_tile=True),
    "prefetch+book": jt.Params(prefetch=True, book_per_tile=True),
    "bn128+both": jt.Params(block_n=128, steps=16, prefetch=True, book_per_tile=True),
    "bn128+book": jt.Params(block_n=128, steps=16, book_per_tile=True),
    "w16": jt.Params(num_warps=16),
    "w16+both": jt.Params(num_warps=16, prefetch=True, book_per_tile=True),
    "bn512+w16+book": jt.Params(block_n=512, steps=4, num_warps=16, book_per_tile=True),
}
# --set fp8_s38 (run in session 38): around fp8's session-37 launch (BN 128, 16 steps, 8 warps,
# book per tile: S37, the base of the ratios), BN 256 beside it as the launch before
S37 = jt.Params(block_n=128, steps=16, book_per_tile=True)
FP8_S38 = {
    "default": S37,
    "bn256 (before)": jt.DEFAULT_PARAMS,
    "steps8": dataclasses.replace(S37, steps=8),
    "steps32": dataclasses.replace(S37, steps=32),
    "stages3": dataclasses.replace(S37, num_stages=3),
    "w4": dataclasses.replace(S37, num_warps=4),
    "bn64": dataclasses.replace(S37, block_n=64, steps=32),
    "bn128+w16": dataclasses.replace(S37, num_warps=16),
    "bn256+w16": dataclasses.replace(S37, block_n=256, steps=8, num_warps=16),
    "keys_as_b": dataclasses.replace(S37, keys_as_b=True),
}
# --set fp8_w4: session 38's second look at 4 warps (faster in 7 of 9 noisy rounds of fp8_s38);
# "w4" became FP8_PARAMS
W4 = dataclasses.replace(S37, num_warps=4)
FP8_W4 = {
    "default": S37,
    "w4": W4,
    "w4+steps8": dataclasses.replace(W4, steps=8),
    "w4+stages3": dataclasses.replace(W4, num_stages=3),
    "w4+bn64": dataclasses.replace(W4, block_n=64, steps=32),
}
# --set bf16_w4 (prepared in session 38, not yet run; with --precisions bf16): 4 warps at bf16,
# whose default (BN 256, 8 warps, 234 registers) runs one program a SM; ptxas (sm_90a, CPU):
# BN 256 / 128 / 64 with 4 warps and the book per tile 243 / 218 / 197 registers (two programs
# of 4 warps a SM), no spills; BN 512 with 16 warps and the book won 0.93-0.94x in session 37
BF16_W4 = {
    "default": jt.DEFAULT_PARAMS,
    "w4+book": jt.Params(num_warps=4, book_per_tile=True),
    "bn128+w4+book": jt.Params(block_n=128, steps=16, num_warps=4, book_per_tile=True),
    "bn64+w4+book": jt.Params(block_n=64, steps=32, num_warps=4, book_per_tile=True),
    "bn512+w16+book": jt.Params(block_n=512, steps=4, num_warps=16, book_per_tile=True),
}
SETS = {"s36": VARIANTS, "fp8_s38": FP8_S38, "fp8_w4": FP8_W4, "bf16_w4": BF16_W4}
SHAPES = [dict(name="B64 contiguous", b=64, page=0), dict(name="B36 paged", b=36, page=64)]
N, H, D, M, K = 131072, 64, 128, 32, 256


def make_args(b: int, page: int, seed: int = 0):
    """(q, w, codes or pool, books, lengths, extra kwargs): pool pages shuffled, one spare."""
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, H, D), jnp.bfloat16)
    w = jax.random.uniform(keys[1], (b, H), jnp.float32, -0.5, 1.0)
    codes = jax.random.randint(keys[2], (b, N, M), 0, K, jnp.int32).astype(jnp.uint8)
    books = jax.random.normal(keys[3], (M, K, D // M), jnp.float32)
    lengths = jnp.full((b,), N, jnp.int32).at[0].set(N // 3)
    if not page:
        return (q, w, codes, books, lengths), {}
    pages = b * N // page
    order = jax.random.permutation(keys[4], pages + 1)
    pool = jnp.zeros((pages + 1, page, M), jnp.uint8).at[order[:pages]].set(
        codes.reshape(pages, page, M))
    table = order[:pages].reshape(b, N // page).astype(jnp.int32)
    return (q, w, pool.reshape(-1, M), books, lengths), dict(page_table=table, page=page)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/pq_variants")
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--repeats", type=int, default=10, help="calls timed per variant a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plot-runs", nargs="+", default=None, metavar="RESULTS_JSON")
    ap.add_argument("--set", default="s36", choices=list(SETS),
                    help="the variants (the first is the ratios' base)")
    ap.add_argument("--precisions", default="fp8,bf16", help="comma-separated: fp8, bf16")
    args = ap.parse_args(argv)
    variants = SETS[args.set]
    precisions = args.precisions.split(",")
    if not precisions or any(p not in ("fp8", "bf16") for p in precisions):
        ap.error(f"--precisions {args.precisions!r}: a comma-separated list of fp8, bf16")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_runs:
        plot([json.loads(pathlib.Path(f).read_text())["rows"] for f in args.plot_runs],
             out / "pq_variants.png", list(variants))
        return 0
    deadline = time.monotonic() + args.budget_s
    rows = []

    def save():
        (out / "results.json").write_text(json.dumps(dict(
            device=str(jax.devices()[0].device_kind), jax=jax.__version__,
            shape=dict(N=N, H=H, D=D, M=M, K=K), rounds=args.rounds, repeats=args.repeats,
            set=args.set, rows=rows), indent=1) + "\n")

    for precision in precisions:
        for shape in SHAPES:
            if time.monotonic() > deadline - 30:
                rows.append(dict(precision=precision, shape=shape["name"],
                                 skipped="budget spent"))
                save()
                continue
            inputs, extra = make_args(shape["b"], shape["page"])
            code_bytes = float(np.sum(np.clip(np.asarray(inputs[4]), 0, N))) * M
            group = compiled_variants(variants, precision, shape, inputs, extra, rows, save)
            if not group:  # the default launch failed (recorded): nothing to compare
                continue
            interleaved_rounds(group, lambda row, x=inputs: median_time(
                row["_fn"], lambda: x, repeats=args.repeats, warmup=2), args.rounds, deadline)
            summarize_rounds(group)
            for row in group:
                row["codes_tb_s"] = code_bytes / (row["ms"] / 1e3) / 1e12
            for row in group:
                del row["_fn"], row["_scores"]
            save()
    plot([rows], out / "pq_variants.png", list(variants))
    print(f"\n{'precision':9} {'shape':15} {'variant':14} {'ms':>7} {'TB/s':>6} "
          f"{'/default':>8} {'range':>13} faster  equal")
    for r in rows:
        if "ms" in r:
            lo, hi = r["vs_default_range"]
            print(f"{r['precision']:9} {r['shape']:15} {r['variant']:14} {r['ms']:7.3f} "
                  f"{r['codes_tb_s']:6.3f} {r['vs_default']:8.3f} {lo:6.3f}-{hi:6.3f} "
                  f"{r['rounds_faster']:>3}/{args.rounds}  {r['equal_default']}")
        else:
            print(f"{r['precision']:9} {r.get('shape', ''):15} {r.get('variant', ''):14} "
                  f"{r.get('skipped') or r.get('error')}")
    return 0


def plot(runs: list[list[dict]], path: pathlib.Path, names: list[str]) -> None:
    """One panel per (precision, shape): each variant's ratio to the default, a point per run
    (with its range over rounds where the run has one)."""
    from experiments.common import pyplot
    plt = pyplot()
    panels = sorted({(r["precision"], r["shape"]) for rows in runs for r in rows if "ms" in r})
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4 * max(len(panels), 1), 3.6),
                             sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for i, rows in enumerate(runs):
            got = {r["variant"]: r for r in rows if (r.get("precision"), r.get("shape")) == panel
                   and "ms" in r}
            xs = [names.index(v) + 0.1 * (i - (len(runs) - 1) / 2) for v in got]
            ys = [r["vs_default"] for r in got.values()]
            lo = [r["vs_default"] - r.get("vs_default_range", [r["vs_default"]] * 2)[0]
                  for r in got.values()]
            hi = [r.get("vs_default_range", [r["vs_default"]] * 2)[1] - r["vs_default"]
                  for r in got.values()]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", ms=4, label=f"run {i + 1}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
        ax.set_title(" ".join(panel), fontsize=9)
    axes[0][0].set_ylabel("time / default launch")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compiled_variants(variants, precision, shape, inputs, extra, rows, save) -> list[dict]:
    """One row per variant that compiled and ran once (the default first), its scores checked
    against the default's; failures recorded and left out."""
    group = []
    for name, params in variants.items():
        row = dict(precision=precision, shape=shape["name"], variant=name,
                   params=dataclasses.asdict(params))
        rows.append(row)
        fn = jax.jit(lambda *a, p=params, pr=precision, x=extra:
                     jt.coarse_scores_jax_triton(*a, params=p, precision=pr, **x))
        try:
            scores = np.asarray(fn(*inputs))
        except Exception as e:  # record, go on with the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            save()
            if name == "default":
                return []
            continue
        row.update(_fn=fn, _scores=scores, _times=[],
                   **compare_outputs(scores, group[0]["_scores"] if group else scores))
        group.append(row)
    return group


if __name__ == "__main__":
    raise SystemExit(main())
