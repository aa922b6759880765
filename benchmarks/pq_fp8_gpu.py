"""pq_topc precision="fp8" vs "bf16" on one H200 (issue 16: the coarse pass at 0.5 ms).

Run from the repository root (jax-triton wheel as in benchmarks/kernels_session7_gpu.py):
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/pq_fp8_gpu.py --out $OUT/pq_fp8 --budget-s 420
--dry: a CPU smoke run (tiny shapes; xla and the Pallas kernel in interpret mode; the
jax_triton rows are recorded as skipped). Not a benchmark.

Per shape (the kernel_compare target B=64, N=131072, C=2048, then B=16, N=32768; V4 indexer
H=64, D=128, M=32, K=256; row 0 of each batch holds N / 3 positions, the rest N):
  rows     xla (f32 reference), xla_fp8 (the fp8 twin), jax_triton / triton (Pallas) at
           bf16 and fp8: the whole op (scores + top-C); *_scores: the jax_triton score kernel
           alone at a few launch parameters (the default first), bf16 and fp8, first shape only.
  time     median of --repeats synchronized calls after 2 warm-ups (benchmarks/timing.py).
  TFLOP/s  2 H D sum(lengths) / time (the score dot; decode and top-C add no FLOPs), and its
           fraction of the dense tensor-core roofline: 790 TFLOP/s bf16, 1580 fp8 (H200).
  check    overlap with the reference twin's top-C (xla for bf16 kernels, xla_fp8 for fp8
           ones): mean over rows of |mine & twin| / |twin|; near-ties make it < 1 for bf16.
  recall   fp8 selections against the bf16 selection of the same kernel (recall_vs_bf16) and
           against the exact top-C of the unquantized PQ keys (recall_vs_exact: xla's f32).
Budget: a timing starts only while --budget-s has more than SLACK_S left; skipped rows say so.
Writes OUT/pq_fp8.json after every row; prints the table last (also OUT/pq_fp8.txt).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # benchmarks/timing.py
from timing import median_time  # noqa: E402

from pallas_kernels.pq_topc import api, reference  # noqa: E402

ROOFLINE = {"bf16": 790e12, "fp8": 1580e12}  # H200 dense tensor-core FLOP/s
SLACK_S = 30.0
SHAPES = [dict(b=64, n=131072, h=64, d=128, m=32, k=256, c=2048),
          dict(b=16, n=32768, h=64, d=128, m=32, k=256, c=2048)]
DRY_SHAPES = [dict(b=3, n=640, h=16, d=32, m=8, k=16, c=64)]
# (block_n, steps, num_warps) tried for the jax_triton score kernel alone
SWEEP = [(256, 8, 8), (512, 4, 8), (256, 4, 4), (512, 8, 8), (128, 8, 4)]


def make_args(s: dict, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    b, n = s["b"], s["n"]
    q = jax.random.normal(keys[0], (b, s["h"], s["d"]), jnp.bfloat16)
    w = jax.random.uniform(keys[1], (b, s["h"]), jnp.float32, -0.5, 1.0)
    codes = jax.random.randint(keys[2], (b, n, s["m"]), 0, s["k"], jnp.int32).astype(jnp.uint8)
    books = jax.random.normal(keys[3], (s["m"], s["k"], s["d"] // s["m"]), jnp.float32)
    lengths = jnp.full((b,), n, jnp.int32).at[0].set(n // 3)
    return (q, w, codes, books, lengths)


def overlap(got, want) -> float:
    """Mean over rows of |got & want| / |want| (valid positions only)."""
    got, want = np.asarray(got), np.asarray(want)
    fr = []
    for g, t in zip(got, want):
        t = set(t[t >= 0].tolist())
        if t:
            fr.append(len(set(g[g >= 0].tolist()) & t) / len(t))
    return float(np.mean(fr)) if fr else 1.0


def variants(s: dict, dry: bool, sweep: bool):
    """(name, precision, kind, fn) to time; kind "op" returns (positions, scores)."""
    c = s["c"]
    out = []
    for impl in ("xla", "jax_triton", "triton"):
        for prec in ("bf16", "fp8"):
            name = impl if prec == "bf16" else f"{impl}_fp8"
            if dry and impl == "jax_triton":
                out.append((name, prec, "skip", "jax_triton needs a GPU (--dry)"))
                continue
            fn = jax.jit(lambda *a, i=impl, p=prec: api.pq_topc(
                *a, num_candidates=c, implementation=i, precision=p))
            out.append((name, prec, "op", fn))
    if dry or not sweep:
        return out
    from pallas_kernels.pq_topc import jax_triton as pq_jt
    for prec in ("bf16", "fp8"):
        for block_n, steps, warps in SWEEP:
            p = pq_jt.Params(block_n=block_n, steps=steps, num_warps=warps)
            fn = jax.jit(lambda *a, p=p, pr=prec: pq_jt.coarse_scores_jax_triton(
                *a, params=p, precision=pr))
            out.append((f"jax_triton_scores_{prec} bn{block_n} st{steps} w{warps}", prec,
                        "scores", fn))
    return out


def run_shape(s: dict, dry: bool, sweep: bool, repeats: int, deadline: float, rows: list,
              save) -> None:
    args = make_args(s)
    flops = 2.0 * s["h"] * s["d"] * float(np.sum(np.clip(np.asarray(args[4]), 0, s["n"])))
    shape = {k.upper(): v for k, v in s.items()}
    sel = {}  # name -> positions
    ref_scores = {"bf16": reference.masked_coarse_scores, "fp8":
                  reference.masked_coarse_scores_fp8}
    for name, prec, kind, fn in variants(s, dry, sweep):
        row = dict(shape=shape, name=name, precision=prec)
        rows.append(row)
        if kind == "skip":
            row["skipped"] = fn
            save()
            continue
        if time.monotonic() > deadline - SLACK_S:
            row["skipped"] = "budget spent"
            save()
            continue
        try:
            out = fn(*args)
            jax.block_until_ready(out)
            sec = median_time(fn, lambda: args, repeats=repeats, warmup=2)
        except Exception as e:  # record the failure, go on with the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            save()
            continue
        row.update(ms=1e3 * sec, tflops=flops / sec / 1e12,
                   roofline_frac=flops / sec / ROOFLINE[prec])
        if kind == "scores":  # against the reference twin's scores
            want = np.asarray(jax.jit(ref_scores[prec])(*args))
            got, live = np.asarray(out), np.isfinite(want)
            row["mask_ok"] = bool(np.array_equal(np.isneginf(got), ~live))
            row["max_rel_err"] = float(np.abs(got[live] - want[live]).max()
                                       / np.abs(want[live]).max())
        else:
            sel[name] = np.asarray(out[0])
        save()
    # set checks once every op row ran: twins, fp8 vs bf16 of the same kernel, fp8 vs exact
    for row in rows:
        name = row["name"]
        if row.get("shape") != shape or name not in sel:
            continue
        base = name.removesuffix("_fp8")
        twin = "xla_fp8" if row["precision"] == "fp8" else "xla"
        if twin in sel and twin != name:
            row["overlap_twin"] = overlap(sel[name], sel[twin])
        if row["precision"] == "fp8":
            if base in sel:
                row["recall_vs_bf16"] = overlap(sel[name], sel[base])
            if "xla" in sel:
                row["recall_vs_exact"] = overlap(sel[name], sel["xla"])
    save()


def table(rows) -> str:
    head = (f"{'B':>3} {'N':>7} {'variant':44} {'ms':>8} {'TFLOP/s':>8} {'roof':>6} "
            f"{'twin':>6} {'r_bf16':>6} {'r_exact':>7} {'err':>8}")
    lines = [head, "-" * len(head)]

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for r in rows:
        tail = r.get("skipped") or r.get("error")
        sh = r["shape"]
        if tail:
            lines.append(f"{sh['B']:>3} {sh['N']:>7} {r['name']:44} {tail[:60]}")
            continue
        lines.append(f"{sh['B']:>3} {sh['N']:>7} {r['name']:44} {f(r.get('ms'), '8.3f')} "
                     f"{f(r.get('tflops'), '8.1f')} {f(r.get('roofline_frac'), '6.3f')} "
                     f"{f(r.get('overlap_twin'), '6.4f')} {f(r.get('recall_vs_bf16'), '6.4f')} "
                     f"{f(r.get('recall_vs_exact'), '7.4f')} {f(r.get('max_rel_err'), '8.1e')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dry", action="store_true", help="CPU smoke run, tiny shapes")
    a = ap.parse_args(argv)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.budget_s
    rows: list[dict] = []
    meta = dict(devices=[str(d) for d in jax.devices()], jax=jax.__version__, dry=a.dry,
                budget_s=a.budget_s, repeats=a.repeats, roofline=ROOFLINE)

    def save():
        (out / "pq_fp8.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

    for i, s in enumerate(DRY_SHAPES if a.dry else SHAPES):  # launch sweep: first shape only
        run_shape(s, a.dry, i == 0, 2 if a.dry else a.repeats, deadline, rows, save)
    text = table(rows)
    (out / "pq_fp8.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
