"""Fused vs unfused Pallas-Triton pq_topc at the V4-Flash shape, and launch parameters (GPU).

Run on the GPU machine: python3 benchmarks/pq_topc_fused_gpu.py
Times (median of 10 synchronized calls after warm-up) pq_topc_triton with fused=True/False for
the default and the swept-best score-kernel Params (benchmarks/pq_topc_sweep.py), and checks
that every variant returns the same top-C sets as the unfused default.
"""

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time  # benchmarks/timing.py

from pallas_kernels.pq_topc import triton as pq_triton


def main(b=64, n=131072, h=64, d=128, m=32, k=256, c=2048):
    keys = jax.random.split(jax.random.key(9), 4)
    q = jax.random.normal(keys[0], (b, h, d), jnp.float32)
    w = jax.random.uniform(keys[1], (b, h), jnp.float32, -0.5, 1.0)
    codes = jax.random.randint(keys[2], (b, n, m), 0, k, jnp.int32).astype(jnp.uint8)
    books = jax.random.normal(keys[3], (m, k, d // m), jnp.float32)
    args = (q, w, codes, books, jnp.full((b,), n, jnp.int32))
    base = None
    for params in (None, pq_triton.Params(128, 16, 8, 2), pq_triton.Params(256, 4, 8, 2)):
        for fused in (False, True):
            fn = jax.jit(lambda *a, p=params, f=fused: pq_triton.pq_topc_triton(
                *a, num_candidates=c, params=p, fused=f))
            pos = np.sort(np.asarray(fn(*args)[0]), axis=1)
            base = pos if base is None else base
            same = float(np.mean(np.all(pos == base, axis=1)))
            ms = 1e3 * median_time(fn, lambda: args, repeats=10, warmup=2)
            print(f"{ms:8.3f} ms  fused={fused!s:5}  params={params}  rows with the same set "
                  f"as unfused/default: {same:.3f}")


if __name__ == "__main__":
    main()
