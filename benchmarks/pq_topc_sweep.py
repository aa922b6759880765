"""Launch-parameter sweep of the pq_topc score kernel at the V4-Flash shape (GPU only).

Run on the GPU machine: python3 benchmarks/pq_topc_sweep.py
Prints configurations fastest first (median of 10 synchronized calls after warm-up), as data
for ``pallas_kernels.pq_topc.triton.TUNED``; every configuration must reproduce the default
configuration's scores.
"""


import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time  # benchmarks/timing.py

from pallas_kernels.pq_topc import triton as pq_triton


def main(b=64, n=131072, h=64, d=128, m=32, k=256):
    keys = jax.random.split(jax.random.key(9), 4)
    q = jax.random.normal(keys[0], (b, h, d), jnp.bfloat16)
    w = jax.random.uniform(keys[1], (b, h), jnp.float32, -0.5, 1.0)
    codes = jax.random.randint(keys[2], (b, n, m), 0, k, jnp.int32).astype(jnp.uint8)
    books = jax.random.normal(keys[3], (m, k, d // m), jnp.float32)
    args = (q, w, codes, books, jnp.full((b,), n, jnp.int32))
    base = np.asarray(pq_triton.coarse_scores_triton(*args))
    rows = []
    for block_n in (64, 128, 256):
        for bpp in (1, 4, 16):
            for warps in (4, 8):
                for stages in (2, 3):
                    p = pq_triton.Params(block_n, bpp, warps, stages)
                    fn = jax.jit(lambda *a, p=p: pq_triton.coarse_scores_triton(*a, params=p))
                    try:
                        ms = 1e3 * median_time(fn, lambda: args, repeats=10, warmup=1)
                    except Exception as e:  # report a configuration that fails, go on
                        rows.append((np.inf, p, f"{type(e).__name__}: {str(e)[:80]}"))
                        continue
                    err = np.nanmax(np.abs(np.asarray(fn(*args)) - base))
                    rows.append((ms, p, f"{2 * b * n * h * d / ms / 1e9:.0f} TFLOP/s, "
                                        f"max diff to default {err:.2e}"))
    for ms, p, note in sorted(rows, key=lambda r: r[0]):
        print(f"{ms:8.3f} ms  {p}  {note}")


if __name__ == "__main__":
    main()
