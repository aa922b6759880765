"""The decode step's sparse_attention at its kernel's fast formats (issues 16, 13): the op alone
in the decode step's vmapped form, per row format and f32 launch parameters, then the decode
step itself at ModelConfig.attention_precision = "bf16".

Run on the GPU machine from the repository root (bounded by --budget-s, default 150 s):
    PYTHONPATH=$PWD python3 benchmarks/attention_precision_gpu.py --out $OUT
(--dry: tiny shapes in interpret mode on CPU, no decode step: checks the script runs.)
Part 1 (--op-budget-s, default 40 s): S = 64 slots of one request each (jax.vmap over S = 1,
as the decode step calls it), H = 64, D = 512 (RoPE 64), K = 512 distinct rows of R = 2048,
W = 128; timed and checked against the XLA reference as sparse_attention_v2_gpu.py does:
  f32 rows, block_d = 512   the f32 path before (one column chunk: the 7.1 ms of the session-7
                            profile; triton.F32_BLOCK_D says why)
  f32 rows, default         block_d = 64 (F32_BLOCK_D), then a small sweep around it
  f32 rows as bf16          what attention_precision = "bf16" does with f32 rows: the k
                            selected rows gathered and rounded to bf16 (XLA) + the bf16 kernel
  bf16 rows, fp8 rows       read in place (attention_precision = "bf16" with kv_dtype bf16 /
                            fp8_v4); q f32 as in the model (the kernel rounds it)
Part 2 (the rest of the budget): benchmarks/decode_profile_gpu.py at the profile's shape
(V4-Flash 4-layer slice, B = 64, 128K, bf16 matmuls, Triton), one run per --decode entry
"method:kv_dtype:attention_precision" (default hisparse:fp8_v4:bf16), each in its own
OUT/decode_<entry>/; the session-7 numbers (f32 attention) are the "before": hisparse 24.7 ms
(f32 rows) / 23.6 ms (fp8_v4), sparse_attention_v2 14.3-14.5 ms of each step.
Writes OUT/attention_precision_gpu.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # part 2 runs in a child

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import sparse_attention_v2_gpu as v2  # noqa: E402  (benchmarks/ is the script's directory)

from pallas_kernels.sparse_attention.api import sparse_attention  # noqa: E402
from pallas_kernels.sparse_attention.triton import sparse_attention_triton  # noqa: E402

FULL = dict(heads=64, dim=512, rope=64, k=512, window=128, rows=2048, batch=64, sets=4,
            repeats=5)
DRY = dict(heads=16, dim=128, rope=64, k=40, window=16, rows=64, batch=2, sets=2, repeats=2)
F32_CONFIGS = [  # (label, sparse_attention_triton kwargs); H200 session 8: block_d=512 7.29 ms,
    # block_d=64 8 warps 1.03 ms, 4 warps 0.66 ms (now the default)
    ("f32 default (block_d=64, 4 warps)", {}),
    ("f32 block_d=64 num_warps=8", dict(block_d=64, num_warps=8)),
    ("f32 block_d=128 num_warps=4", dict(block_d=128, num_warps=4)),
    ("f32 block_d=512 (session 7)", dict(block_d=512, num_warps=8)),
    ("f32 block_d=32", dict(block_d=32)),
    ("f32 block_h=32 block_d=64", dict(block_h=32, block_d=64)),
    ("f32 block_k=32 block_d=64", dict(block_k=32, block_d=64)),
]


def as_bf16_selected(table, slots, window):
    """attention_precision = "bf16" with f32 rows (model.blocks.kernel_rows): the selected
    rows gathered to [S, K, D] bf16, slots 0..K-1; the window rounded to bf16."""
    rows = jnp.take_along_axis(table, jnp.maximum(slots, 0)[..., None], axis=1)
    slots = jnp.where(slots >= 0, jnp.arange(slots.shape[-1]), -1).astype(jnp.int32)
    return rows.astype(jnp.bfloat16), slots, window.astype(jnp.bfloat16)


def op_part(shape, budget_s, records, save):
    start = time.perf_counter()
    b = shape["batch"]

    def run(label, fn, sets, want, rows):
        if time.perf_counter() - start > budget_s:
            print(f"  {label} skipped: over --op-budget-s", flush=True)
            return
        rec = v2.measure(label, v2.vmapped(fn), sets, want, shape, b, rows, shape["repeats"])
        records.append(rec)
        print(v2.fmt(rec), flush=True)
        save()

    print(v2.HEAD, flush=True)
    for rows in ("bfloat16", "fp8", "float32"):  # in-place forms first (the budget's cut)
        sets = [v2.make_inputs(jax.random.key(i), b, shape, rows) for i in range(shape["sets"])]
        if rows != "float32":  # q f32, as the model passes it (the kernel rounds it to bf16)
            sets = [(q.astype(jnp.float32), *rest) for q, *rest in sets]
        want = np.asarray(v2.variant_fn("xla")(*sets[0]), np.float64)
        slot_sets = v2.per_slot(sets)
        if rows == "float32":
            for label, kw in F32_CONFIGS:
                if kw.get("block_d", 0) > shape["dim"] or kw.get("block_h", 0) > shape["heads"]:
                    continue
                run(label, functools.partial(sparse_attention_triton, **kw), slot_sets, want,
                    rows)

            def bf16_of_f32(q, table, slots, window, mask, sink):
                t, s, w = as_bf16_selected(table, slots, window)
                return sparse_attention(q, t, s, w, mask, sink, implementation="triton")

            run("f32 rows as bf16 (gather+cast, bf16 kernel)", bf16_of_f32, slot_sets, want,
                rows)
        else:
            run(f"{rows} rows in place", functools.partial(sparse_attention,
                                                           implementation="triton"),
                slot_sets, want, rows)
        del sets, slot_sets


def decode_part(entries, budget_s, out, records, save):
    start = time.perf_counter()
    for entry in entries:
        method, kv, prec = entry.split(":")  # method: one, or several joined by "+"
        left = budget_s - (time.perf_counter() - start)
        if left < 30:
            print(f"decode {entry}: skipped ({left:.0f} s of the budget left)", flush=True)
            records.append(dict(decode=entry, skipped="budget"))
            continue
        sub = out / f"decode_{method.replace('+', '_')}_{kv}_{prec}"
        cmd = [sys.executable, "benchmarks/decode_profile_gpu.py", "--out", str(sub),
               "--methods", method.replace("+", ","), "--kv-dtype", kv,
               "--attention-precision", prec,
               "--budget-s", str(int(left - 10))]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=False)
        path = sub / "decode_profile.json"
        rows = json.loads(path.read_text()) if path.exists() else []
        for r in rows:
            r = {k: r.get(k) for k in ("method", "step_ms", "kernels_ms", "ratio", "error",
                                       "by_kind")}
            records.append(dict(decode=entry, **r))
        save()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/attention_precision_gpu")
    ap.add_argument("--dry", action="store_true", help="tiny shapes, interpret mode, no decode")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--op-budget-s", type=float, default=40.0)
    ap.add_argument("--decode", default="hisparse:fp8_v4:bf16",
                    help="comma-separated method[+method]:kv_dtype:attention_precision ('' : none)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = dict(DRY if a.dry else FULL)
    records = []

    def save():
        (out / "attention_precision_gpu.json").write_text(json.dumps(dict(
            device=jax.devices()[0].device_kind, jax=jax.__version__, shape=shape,
            records=records), indent=1))

    print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    op_part(shape, 1e9 if a.dry else a.op_budget_s, records, save)
    entries = [e for e in a.decode.split(",") if e] if not a.dry else []
    decode_part(entries, a.budget_s - (time.perf_counter() - t0), out, records, save)
    save()
    print(f"wrote {out / 'attention_precision_gpu.json'} "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
