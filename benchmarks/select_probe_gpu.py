"""Where topk's select kernel spends its time (issue 16): stripped-down kernels at the same grid,
each a stage more of the real one, and the real one, device time a call from profiles.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/select_probe_gpu.py --out $OUT/probe
    python benchmarks/select_probe_gpu.py --dry --out /tmp/probe   # CPU: tiny, interpreter

Stages (scores [B, N] f32, grid (B, N / BLOCK), a loop over the block's chunks of CH):
  read      each chunk loaded and summed: the loads alone
  count     + the compare with a floor tf and the count of candidates
  prefix    + the candidates' exclusive prefix sums, no stores
  select    fused.select_call itself (floor hint: no threshold launch), the candidates
            scattered to their slots as (position, score bits) pairs
At issue 16's 64 x 262144 with floor 2.2 (~1.4% of N-normal scores pass, as the sample floor
passes ~1.4% at k 2048). Writes OUT/results*.json; prints a table. Session 47 ran it on
earlier forms of the select kernel too (two 4-byte scatters; a [CH / 16, 4, 4] layout;
positions alone): benchmarks/RESULTS.md "Session 47".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from experiments.profiling import profile_program  # noqa: E402
from pallas_kernels.topk import fused  # noqa: E402
from pallas_kernels.topk import triton as tk  # noqa: E402

FLOOR = 2.2


def probe_call(scores, stage: str, cfg: fused.FusedConfig):
    """[B, nblk] f32: per program, the stage's sum (read: of the scores; count: of the
    candidates; prefix: of the candidates' prefix sums)."""
    b, ch = scores.shape[0], cfg.chunk

    def kernel(x_ref, o_ref):
        def body(i, acc):
            s = pl.multiple_of(i * ch, ch)
            x = x_ref[pl.ds(s, ch)]
            if stage == "read":
                return acc + jnp.sum(x)
            ci = (x >= FLOOR).astype(jnp.int32)
            if stage == "count":
                return acc + jnp.sum(ci).astype(jnp.float32)
            before, n = tk.exclusive_count(ci, cfg.scan_rows)
            return acc + jnp.sum(before).astype(jnp.float32) + n.astype(jnp.float32)

        acc = lax.fori_loop(0, cfg.block // ch, body, jnp.float32(0))
        o_ref[...] = jnp.full((2,), acc, jnp.float32)

    return pl.pallas_call(
        kernel, grid=(b, cfg.nblk),
        in_specs=[pl.BlockSpec((None, cfg.block), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((None, None, 2), lambda i, j: (i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, cfg.nblk, 2), jnp.float32),
        interpret=cfg.interpret, name=f"probe_{stage}",
        compiler_params=plgpu.CompilerParams(num_warps=cfg.select_warps, num_stages=1),
    )(scores)[:, :, 0]


def select_stage(scores, cfg, floor=FLOOR):
    lens = jnp.full((scores.shape[0], 1), scores.shape[1], jnp.int32)
    floor = jnp.full((scores.shape[0],), floor, jnp.float32)
    pairs, cnt = fused.select_call(scores, lens, floor, cfg)
    return pairs[:, :8], cnt


class _without_stores:
    """Traces fused.py's kernels with some of their ``plgpu.store``s dropped (an ablation,
    not a kernel): "fill" the -1 fill of the candidate row (1-D values), "scatter" the
    candidates' pair stores ([CH, 2] values), "both"."""

    def __init__(self, drop: str):
        self.drop, self.orig = drop, fused.plgpu.store

    def __enter__(self):
        def store(ref, val, *a, **kw):
            fill = jnp.ndim(val) == 1
            if self.drop == "both" or (self.drop == "fill") == fill:
                return None
            return self.orig(ref, val, *a, **kw)
        fused.plgpu.store = store

    def __exit__(self, *exc):
        fused.plgpu.store = self.orig


LAUNCHES = {  # name: fused_config tunables (session 47's runs: chunk 4096 the default then)
    "c2048 w8 (default)": dict(),
    "c4096 w8": dict(chunk=4096),
    "c2048 w4": dict(chunk=2048, select_warps=4),
    "c2048 w4 b32768": dict(chunk=2048, select_warps=4, block=32768),
}


NCU_COLUMNS = {"gpu__time_duration.sum": "us", "launch__registers_per_thread": "regs",
               "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
               "launch__occupancy_limit_registers": "lim_regs",
               "launch__occupancy_limit_shared_mem": "lim_smem",
               "launch__occupancy_limit_warps": "lim_warps",
               "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem%",
               "launch__block_size": "block"}


def ncu_table(path: str) -> None:
    """Prints Nsight Compute's raw CSV (``--csv --page raw``) as one line a kernel launch."""
    import csv

    lines = pathlib.Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.DictReader(lines[start:]))
    cols = [c for c in NCU_COLUMNS if c in rows[0]]
    print(f"{'kernel':28s} " + " ".join(f"{NCU_COLUMNS[c]:>9s}" for c in cols))
    to_us = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3}.get(
        rows[0].get("gpu__time_duration.sum", ""), 1.0)  # rows[0]: the units
    for r in rows[1:]:
        vals = []
        for c in cols:
            v = r[c].replace(",", "")
            vals.append(f"{float(v) * (to_us if c == 'gpu__time_duration.sum' else 1):9.1f}"
                        if v.replace(".", "").isdigit() else f"{v:>9s}")
        print(f"{r['Kernel Name'][:28]:28s} " + " ".join(vals))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/select_probe")
    ap.add_argument("--dry", action="store_true", help="tiny shapes, Pallas interpreter (CPU)")
    ap.add_argument("--profiles", type=int, default=3, help="profiles a stage (0: one run, "
                    "none profiled: under Nsight Compute)")
    ap.add_argument("--floors", default="", help="comma-separated floors: the select stage "
                    "alone at each (how its time grows with the candidates), the first two "
                    "launches only")
    ap.add_argument("--stages", default="read,count,prefix,select",
                    help="comma-separated stages (read, count, prefix, select)")
    ap.add_argument("--ablate", action="store_true", help="the select kernel without its -1 "
                    "fill (select-fill), its scatter (select-scatter) or both, two launches")
    ap.add_argument("--ncu-table", help="print this Nsight Compute raw CSV as a table, exit")
    args = ap.parse_args(argv)
    if args.ncu_table:
        ncu_table(args.ncu_table)
        return 0
    b, n, k = (4, 4096, 64) if args.dry else (64, 262144, 2048)
    scores = jax.random.normal(jax.random.key(0), (b, n), jnp.float32)
    rows = []
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    floors = [float(f) for f in args.floors.split(",") if f]
    launches = list(LAUNCHES.items())[:2] if floors else LAUNCHES.items()
    stages = [f"select@{f}" for f in floors] or args.stages.split(",")
    if args.ablate:
        launches = list(LAUNCHES.items())[:2]
        stages = ["select", "select-fill", "select-scatter", "select-both"]
    for name, tun in launches:
        small = dict(block=1024, chunk=min(tun.get("chunk", 4096), 256)) if args.dry else {}
        cfg = fused.fused_config(n, k, interpret=args.dry, **(tun | small))
        for stage in stages:
            if stage.startswith("select"):
                fn = functools.partial(select_stage, cfg=cfg,
                                       floor=float(stage[7:]) if "@" in stage else FLOOR)
            else:
                fn = functools.partial(probe_call, stage=stage, cfg=cfg)
            drop = stage.split("-")[1] if "-" in stage else None
            with _without_stores(drop) if drop else contextlib.nullcontext():
                program = jax.jit(fn).lower(scores).compile()
            jax.block_until_ready(program(scores))  # (--profiles 0: this run alone, for ncu)
            runs = [profile_program(program, (scores,), 1) for _ in range(args.profiles)]
            busy = sorted(r["busy_us"] for r in runs if r.get("busy_us") is not None)
            if "@" in stage:  # candidates a row at this floor
                row_c = float(jnp.mean(jnp.sum(scores >= float(stage[7:]), axis=1)))
            row = dict(launch=name, params=tun, stage=stage,
                       busy_us=busy[len(busy) // 2] if busy else None,
                       busy_us_range=[busy[0], busy[-1]] if busy else None)
            if "@" in stage:
                row["candidates_per_row"] = row_c
            if row["busy_us"]:
                row["tb_per_s"] = b * n * 4 / row["busy_us"] / 1e6
            rows.append(row)
            print(f"{name:26s} {stage:12s} {row['busy_us'] or float('nan'):8.1f} us  "
                  f"{row.get('tb_per_s', float('nan')):5.2f} TB/s "
                  f"{row.get('candidates_per_row', '')}", flush=True)
            tag = ("_floors" if floors else "_ablate" if args.ablate
                   else "" if args.stages == ap.get_default("stages") else "_stages")
            (out / f"results{tag}.json").write_text(json.dumps(
                dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                     shape=dict(b=b, n=n, k=k), floor=FLOOR, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
