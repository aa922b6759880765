"""Launch-parameter sweep of the index_scores Pallas-Triton kernel (GPU).

Run on the GPU machine:
  python3 benchmarks/index_scores_sweep.py                   # V4 rescoring: B 64, C 2048
  python3 benchmarks/index_scores_sweep.py --shape decode    # HiSparse's decode indexer
--shape decode is the engine's form of a decode step's exact indexer (``store.decode_scores``):
one [1, N] call a request under a vmap over the batch (B 8, N 131104 = 512K / 4 + 32: a
partial last program), f32 q (split into bf16 hi + lo in the kernel) unless --q-dtype bf16;
--fp8 times the fp8 x fp8 form. Each configuration is timed inside one jitted program over
`sets` input sets (median of `repeats`), so dispatch is amortized as in
experiments/kernel_compare.py; its scores must match the default's (max diff printed). Prints
the 15 fastest and the default; --out writes every row as JSON. Stops at --budget-s.
"""

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import program_time  # benchmarks/timing.py

from pallas_kernels.index_scores.triton import default_config, index_scores_triton

SHAPES = {"v4": dict(b=64, c=2048, vmap=False), "decode": dict(b=8, c=131104, vmap=True)}


def inputs(i, b, c, h, d, q_dtype):
    k = jax.random.split(jax.random.key(i), 4)
    return (jax.random.normal(k[0], (b, h, d), jnp.float32).astype(q_dtype),
            jax.random.normal(k[1], (b, h), jnp.float32),
            jax.random.normal(k[2], (b, c, d), jnp.float32).astype(jnp.float8_e4m3fn),
            jax.random.uniform(k[3], (b, c, 1), jnp.float32, 0.5, 2.0),
            jnp.ones((b, c), bool))


def scorer(vmap, **kw):
    def one(q, w, kv, ks, ok):
        return index_scores_triton(q, w, kv, ks, ok, **kw)
    if not vmap:
        return one
    return jax.vmap(lambda *a: one(*(x[None] for x in a))[0])


def time_config(fn, sets, repeats):
    """(median ms of one call, timed as one program over the sets; the first set's scores)."""
    ms = 1e3 * program_time(fn, sets, repeats=repeats, warmup=1)
    return ms, np.asarray(jax.jit(fn)(*sets[0]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="v4")
    p.add_argument("--q-dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--sets", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=1e9)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    shape = SHAPES[a.shape]
    b, c, h, d = shape["b"], shape["c"], 64, 128
    q_dtype = jnp.float32 if a.q_dtype == "f32" else jnp.bfloat16
    sets = [inputs(i, b, c, h, d, q_dtype) for i in range(a.sets)]
    kernel_b = 1 if shape["vmap"] else b  # the batch one kernel call sees
    default = dict(zip(("block_c", "steps", "num_warps"), default_config(kernel_b, h, c)))
    base_ms, base = time_config(scorer(shape["vmap"], fp8=a.fp8), sets, a.repeats)
    key_gb = b * c * (d + 4) / 1e9
    print(f"shape {a.shape} B {b} C {c} q {a.q_dtype} fp8 {a.fp8}: default {default} "
          f"{base_ms:.4f} ms ({key_gb / base_ms:.2f} TB/s of FP8 keys)", flush=True)
    rows, start = [], time.time()
    grid = itertools.product((128, 64, 256), (2, 4, 8, 16), (4, 8), (2, 3))
    for block_c, steps, warps, stages in grid:
        if time.time() - start > a.budget_s:
            print(f"budget {a.budget_s} s spent after {len(rows)} configurations")
            break
        kw = dict(block_c=block_c, steps=steps, num_warps=warps, num_stages=stages)
        try:
            ms, out = time_config(scorer(shape["vmap"], fp8=a.fp8, **kw), sets, a.repeats)
        except Exception as e:  # report a configuration that fails, go on
            rows.append(dict(kw, ms=None, error=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        err = float(np.nanmax(np.abs(out - base)))
        rows.append(dict(kw, ms=ms, tb_s=key_gb / ms, max_diff=err))
    ok = sorted((r for r in rows if r["ms"] is not None), key=lambda r: r["ms"])
    for r in ok[:15]:
        print(f"{r['ms']:8.4f} ms {r['tb_s']:.2f} TB/s  bc {r['block_c']} steps {r['steps']} "
              f"warps {r['num_warps']} stages {r['num_stages']}  max diff {r['max_diff']:.1e}")
    print(f"default {base_ms:.4f} ms; failed: {sum(r['ms'] is None for r in rows)}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(shape=a.shape, b=b, c=c, q_dtype=a.q_dtype, fp8=a.fp8,
                           default=dict(default, ms=base_ms), rows=rows,
                           jax=jax.__version__, device=str(jax.devices()[0])), f, indent=1)


if __name__ == "__main__":
    main()
