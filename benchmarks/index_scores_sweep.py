"""Launch-parameter sweep of the index_scores Pallas-Triton kernel at the V4-Flash shape (GPU).

Run on the GPU machine: python3 benchmarks/index_scores_sweep.py
Each configuration is timed inside one jitted program over 8 input sets (median of 10), so
dispatch is amortized as in experiments/kernel_compare.py; it must match the default's scores.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.index_scores.triton import index_scores_triton


def main(b=64, c=2048, h=64, d=128, sets=8):
    def make(i):
        k = jax.random.split(jax.random.key(i), 4)
        return (jax.random.normal(k[0], (b, h, d), jnp.float32),
                jax.random.normal(k[1], (b, h), jnp.float32),
                jax.random.normal(k[2], (b, c, d), jnp.float32).astype(jnp.float8_e4m3fn),
                jax.random.uniform(k[3], (b, c, 1), jnp.float32, 0.5, 2.0),
                jnp.ones((b, c), bool))

    inputs = [make(i) for i in range(sets)]
    base = np.asarray(index_scores_triton(*inputs[0]))
    rows = []
    for block_c in (32, 64, 128):
        for steps in (1, 2, 4, 8):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    kw = dict(block_c=block_c, steps=steps, num_warps=warps, num_stages=stages)
                    prog = jax.jit(lambda xs, kw=kw: [index_scores_triton(*x, **kw) for x in xs])
                    try:
                        jax.block_until_ready(prog(inputs))
                        ts = []
                        for _ in range(10):
                            t = time.perf_counter()
                            jax.block_until_ready(prog(inputs))
                            ts.append((time.perf_counter() - t) / sets)
                    except Exception as e:  # report a configuration that fails, go on
                        rows.append((np.inf, kw, f"{type(e).__name__}: {str(e)[:80]}"))
                        continue
                    ms = 1e3 * float(np.median(ts))
                    err = np.abs(np.asarray(prog(inputs)[0]) - base).max()
                    gbs = b * c * (d + 4) / ms / 1e6
                    rows.append((ms, kw, f"{gbs:.0f} GB/s, max diff to default {err:.1e}"))
    for ms, kw, note in sorted(rows, key=lambda r: r[0])[:15]:
        print(f"{ms:8.4f} ms  {kw}  {note}")


if __name__ == "__main__":
    main()
