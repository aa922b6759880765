"""sparse_attention v2 (issue 16) at the V4-Flash CSA decode shape: every implementation and row
format, the decode step's vmapped form, and a launch-parameter sweep of the new Triton kernel.

Run on the GPU machine (from the repository root):
  PYTHONPATH=$PWD python3 benchmarks/sparse_attention_v2_gpu.py --out $OUT
  (--quick: no sweep; --dry: tiny shapes in interpret mode on CPU, checks the script runs)
Shape: H = 64 heads, D = 512 (RoPE 64), K = 512 distinct selected rows of an R = 2048-row table,
W = 128 window rows, B in {8, 64}; rows f32, bf16 or FP8 (V4 layout: 448 e4m3 + 7 e8m0 + 64
bf16 = 583 B; its window rows bf16). q is bf16 (f32 with f32 rows).
Variants: xla (reference), triton_v1 (the issue-6 kernel, head blocks), triton (v2: all heads
a program, split rows, FP8 in place), mosaic (Mosaic GPU, bf16 rows; run in a child process
with a timeout, after the others: a hung kernel costs only its own records); "vmap" rows call
the op as the decode step does: jax.vmap over B slots of S = 1 (v1 through Pallas's batching
rule, v2 and mosaic folded into one launch). Then launch-parameter sweeps (Mosaic splits,
Triton v2) in priority order until --budget-s. Each is checked against the XLA reference
(max abs error and max error relative to max |ref|), then timed as kernel_compare does: one
jitted program calls it on SETS distinct input sets, median over REPEATS programs / SETS
(benchmarks/timing.py).
TFLOP/s equivalent = 4 B H (K + W) D / time; % HBM = bytes moved (rows once, q, out) / time /
3.0 TB/s. A variant that fails to compile or run prints its error and the script goes on.
Writes sparse_attention_v2_gpu.json to --out (default $OUT or results/).
"""

import os

# the Mosaic variants run in a child process (a hung kernel must not take the rest of the run
# with it): neither process may take most of the GPU's memory up front
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax
import jax.numpy as jnp
import numpy as np
from timing import program_time  # benchmarks/timing.py

from lsparse_jax.quant.kv_rows import quantize_fp8_rows
from pallas_kernels.sparse_attention.api import sparse_attention

HBM = 3.0e12
FULL = dict(heads=64, dim=512, rope=64, k=512, window=128, rows=2048, batches=(8, 64),
            sets=8, repeats=10)
DRY = dict(heads=16, dim=128, rope=64, k=40, window=16, rows=64, batches=(2,), sets=2,
           repeats=2)
SWEEP = [  # kwargs of triton.sparse_attention_triton (v2); "dense" ones skip FP8 rows
    dict(col_splits=2), dict(num_warps=16), dict(col_splits=2, num_warps=4), dict(col_splits=4),
    dict(splits=1), dict(splits=4), dict(block_k=16), dict(block_k=64),
    dict(block_h=32), dict(block_h=16, num_warps=4), dict(block_d=64), dict(num_stages=3),
    dict(block_d=128, dense=True), dict(num_warps=4), dict(splits=8),
]
F32_SWEEP = [dict(block_h=32, block_k=16), dict(block_h=16, block_k=32),
             dict(block_h=64, block_k=16, col_splits=2)]

MOSAIC_SWEEP = [dict(row_loop=1), dict(splits=1), dict(splits=2), dict(splits=4),  # bf16 rows
                dict(splits=8), dict(splits=2, row_loop=1), dict(splits=4, row_loop=1)]


def make_inputs(key, batch, shape, rows):
    """(q, table, slots, window, window_mask, sink); K distinct slots a request (no -1)."""
    kq, kt, ks, kw, kk = jax.random.split(key, 5)
    h, d, r = shape["heads"], shape["dim"], shape["rows"]
    dt = jnp.float32 if rows == "float32" else jnp.bfloat16
    q = jax.random.normal(kq, (batch, h, d), jnp.float32).astype(dt)
    table = jax.random.normal(kt, (batch, r, d), jnp.float32)
    table = quantize_fp8_rows(table, shape["rope"]) if rows == "fp8" else table.astype(dt)
    slots = jnp.argsort(jax.random.uniform(ks, (batch, r)), axis=1)[:, :shape["k"]]
    win = jax.random.normal(kw, (batch, shape["window"], d), jnp.float32).astype(dt)
    mask = jnp.ones((batch, shape["window"]), bool)
    sink = jax.random.normal(kk, (h,), jnp.float32)
    return q, tuple(table) if rows == "fp8" else table, slots.astype(jnp.int32), win, mask, sink


def row_bytes(shape, rows) -> float:
    d, rope = shape["dim"], shape["rope"]
    if rows == "fp8":
        n = d - rope
        return n + -(-n // 64) + 2 * rope
    return d * (4 if rows == "float32" else 2)


def moved_bytes(shape, batch, rows) -> float:
    win_item = 4 if rows == "float32" else 2
    return batch * (shape["k"] * row_bytes(shape, rows) + shape["window"] * shape["dim"] * win_item
                    + shape["heads"] * shape["dim"] * (win_item + 4) + shape["k"] * 4)


def variant_fn(name, kw=None):
    """(q, table, slots, window, mask, sink) -> out for variant ``name``."""
    kw = dict(kw or {})
    kw.pop("dense", None)
    if name == "xla":
        return functools.partial(sparse_attention, implementation="xla")
    if name == "triton_v1":
        from pallas_kernels.sparse_attention.triton_v1 import sparse_attention_triton
        return functools.partial(sparse_attention_triton, **kw)
    if name == "triton":
        if not kw:
            return functools.partial(sparse_attention, implementation="triton")
        from pallas_kernels.sparse_attention.triton import sparse_attention_triton
        return functools.partial(sparse_attention_triton, **kw)
    if name == "mosaic":
        if not kw:
            return functools.partial(sparse_attention, implementation="mosaic")
        from pallas_kernels.sparse_attention.mosaic import sparse_attention_mosaic
        return functools.partial(sparse_attention_mosaic, **kw)
    raise ValueError(name)


def vmapped(fn):
    """The decode step's form: vmap over slots of S = 1 (inputs from ``per_slot``: [B, 1, ...],
    made outside the timing), the sink shared; out [B, H, D]."""
    def call(q, table, slots, window, mask, sink):
        out = jax.vmap(fn, in_axes=(0, 0, 0, 0, 0, None))(q, table, slots, window, mask, sink)
        return out[:, 0]
    return call


def per_slot(sets):
    """Input sets as the decode step holds them: [B, 1, ...] per-slot arrays."""
    out = []
    for q, table, slots, window, mask, sink in sets:
        slot_args = jax.tree.map(lambda a: a[:, None], (q, table, slots, window, mask))
        out.append(jax.block_until_ready((*slot_args, sink)))
    return out


def measure(label, fn, sets, want, shape, batch, rows, repeats, xla_ms=None):
    rec = dict(variant=label, rows=rows, B=batch)
    try:
        got = np.asarray(jax.jit(fn)(*sets[0]), np.float64)
        err = float(np.abs(got - want).max())
        rec.update(max_abs_err=err, max_rel_err=err / max(float(np.abs(want).max()), 1e-6),
                   finite=bool(np.isfinite(got).all()))
        sec = program_time(fn, sets, repeats=repeats)
        flops = 4.0 * batch * shape["heads"] * (shape["k"] + shape["window"]) * shape["dim"]
        rec.update(ms=sec * 1e3, tflops=flops / sec / 1e12,
                   pct_hbm=100 * moved_bytes(shape, batch, rows) / sec / HBM)
        if xla_ms:
            rec["x_xla"] = xla_ms / rec["ms"]
    except Exception as err:  # a variant that fails to compile or run: report it, go on
        rec["error"] = f"{type(err).__name__}: {err}"[:400]
        print(f"  {label} ({rows}, B={batch}) FAILED: {rec['error']}", flush=True)
        traceback.print_exc(limit=3, file=sys.stdout)
    return rec


def fmt(r):
    if "error" in r:
        return f"{r['variant']:44s} {r['rows']:8s} {r['B']:3d}   ERROR {r['error'][:60]}"
    return (f"{r['variant']:44s} {r['rows']:8s} {r['B']:3d} {r['ms']:8.4f} {r['tflops']:7.1f} "
            f"{r['pct_hbm']:6.1f} {r.get('x_xla', float('nan')):6.2f} {r['max_abs_err']:9.2e} "
            f"{r['max_rel_err']:9.2e}")


HEAD = (f"{'variant':44s} {'rows':8s} {'B':>3s} {'ms':>8s} {'TFLOP/s':>7s} {'%HBM':>6s} "
        f"{'xXLA':>6s} {'abs_err':>9s} {'rel_err':>9s}")


def run_mosaic_child(args, shape, out, start) -> list:
    """The Mosaic variants (bf16 rows) in a child process with a timeout; its records."""
    left = args.budget_s - (time.perf_counter() - start)
    budget = max(30.0, min(args.mosaic_timeout_s - 50.0, left))
    cmd = [sys.executable, __file__, "--only-mosaic", "--out", str(out), "--budget-s",
           str(budget), "--batches", ",".join(map(str, shape["batches"]))]
    cmd += ["--quick"] if args.quick else []
    print(f"\n-- Mosaic GPU variants in a child process (timeout {args.mosaic_timeout_s:.0f} s)",
          flush=True)
    try:
        subprocess.run(cmd, timeout=args.mosaic_timeout_s, check=False)
    except subprocess.TimeoutExpired:
        print("-- the Mosaic child timed out (a hung kernel?): its records so far are kept",
              flush=True)
    child = out / "sparse_attention_v2_mosaic.json"
    if not child.exists():
        return [dict(variant="mosaic", rows="bfloat16", B=0, error="the child wrote nothing")]
    recs = [r for r in json.loads(child.read_text())["records"] if r["variant"] != "xla"]
    print("-- back from the Mosaic child\n" + HEAD, flush=True)
    return recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--dry", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--quick", action="store_true", help="no launch-parameter sweep")
    ap.add_argument("--rows", default="bfloat16,fp8,float32")
    ap.add_argument("--batches", default=None, help="e.g. 64 (default: 8,64)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="start no new measurement after this many seconds")
    ap.add_argument("--only-mosaic", action="store_true",
                    help="(the child process) the Mosaic variants of bf16 rows only")
    ap.add_argument("--mosaic-timeout-s", type=float, default=200.0)
    ap.add_argument("--no-mosaic", action="store_true", help="skip the Mosaic child process")
    ap.add_argument("--sweep", default=None,
                    help="Triton v2 variants instead of SWEEP, e.g. 'block_k=64;block_k=64,"
                    "num_stages=3' (integers; an empty variant '' is the default config)")
    args = ap.parse_args()
    if args.only_mosaic:
        args.rows = "bfloat16"
    shape = dict(DRY if args.dry else FULL)
    if args.batches:
        shape["batches"] = tuple(int(b) for b in args.batches.split(","))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("sparse_attention_v2_mosaic.json" if args.only_mosaic
                  else "sparse_attention_v2_gpu.json")
    start = time.perf_counter()
    print(jax.devices()[0].device_kind, "jax", jax.__version__, "dry" if args.dry else "")
    on_gpu = jax.default_backend() == "gpu"
    records = []

    def save():
        path.write_text(json.dumps(dict(device=jax.devices()[0].device_kind,
                                        jax=jax.__version__, shape=shape, dry=args.dry,
                                        records=records), indent=1))

    def run(label, fn, sets, want, batch, rows, xla_ms=None):
        if time.perf_counter() - start > args.budget_s:
            print(f"  {label} ({rows}, B={batch}) skipped: over --budget-s", flush=True)
            return {}
        rec = measure(label, fn, sets, want, shape, batch, rows, shape["repeats"], xla_ms)
        records.append(rec)
        print(fmt(rec), flush=True)
        save()
        return rec

    print(HEAD, flush=True)
    kept = {}  # (rows, B) -> (sets, want, xla_ms) for the sweeps
    sweeps = [] if args.quick else [("bfloat16", 64), ("fp8", 64), ("bfloat16", 8), ("float32", 8)]
    for rows in args.rows.split(","):  # every implementation, direct and vmapped
        for batch in shape["batches"]:
            sets = [make_inputs(jax.random.key(i), batch, shape, rows)
                    for i in range(shape["sets"])]
            want = np.asarray(variant_fn("xla")(*sets[0]), np.float64)
            xla_ms = run("xla", variant_fn("xla"), sets, want, batch, rows).get("ms")
            names = ["triton", "triton_v1"] if rows != "fp8" else ["triton"]  # v1: dense rows
            if args.only_mosaic:
                names = ["mosaic"]
            for name in names:
                run(name, variant_fn(name), sets, want, batch, rows, xla_ms)
            slot_sets = per_slot(sets)
            for name in names:  # the decode step's vmapped form
                run(f"{name} vmap(S=1)x{batch}", vmapped(variant_fn(name)), slot_sets, want,
                    batch, rows, xla_ms)
            del slot_sets
            if (rows, batch) in sweeps or (args.dry and not args.quick):
                kept[(rows, batch)] = (sets, want, xla_ms)
    if (on_gpu and not args.only_mosaic and not args.no_mosaic
            and "bfloat16" in args.rows.split(",")):
        records.extend(run_mosaic_child(args, shape, out, start))
        save()
    if args.only_mosaic:
        sweeps = [] if args.quick else [(r, b) for r, b in sweeps if r == "bfloat16"]
        kept = {key: kept[key] for key in sweeps if key in kept}
    sweep = SWEEP if args.sweep is None else [
        {k: int(v) for k, v in (kv.split("=") for kv in part.split(",") if kv)}
        for part in args.sweep.split(";")]
    order = sweeps + [key for key in kept if key not in sweeps]
    for rows, batch in [key for key in order if key in kept]:  # launch parameters
        sets, want, xla_ms = kept[(rows, batch)]
        if args.only_mosaic:
            for kw in MOSAIC_SWEEP:
                label = "mosaic " + " ".join(f"{k}={v}" for k, v in kw.items())
                run(label, variant_fn("mosaic", kw), sets, want, batch, rows, xla_ms)
            continue
        for kw in sweep if rows != "float32" else F32_SWEEP:
            if kw.get("dense") and rows == "fp8":
                continue
            label = "triton " + (" ".join(f"{k}={v}" for k, v in kw.items() if k != "dense")
                                 or "default")
            run(label, variant_fn("triton", kw), sets, want, batch, rows, xla_ms)
    print("\nsparse_attention v2: H=%d D=%d K=%d W=%d R=%d" % (
        shape["heads"], shape["dim"], shape["k"], shape["window"], shape["rows"]))
    print(HEAD)
    for r in records:
        print(fmt(r))
    best = {}
    for r in records:
        kind = r["variant"].split()[0]
        if "ms" in r and kind in ("triton", "mosaic"):
            key = (kind, r["rows"], r["B"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    print("\nbest Triton v2 and Mosaic variant per (rows, B):")
    for r in best.values():
        print(fmt(r))
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
