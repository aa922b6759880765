"""Host-to-hot-cache row moves at V4-Flash shapes: f32 rows vs the FP8 V4 row layout.

Run on the GPU machine: python3 benchmarks/kv_rows_gpu.py [--out DIR]
One request's hot_resolve (``pallas_kernels.hot_resolve``, implementation "triton"): a hot
cache of B = 4096 rows, k = 512 selected positions that all miss, a pinned_host pool of 4096
pages x 64 rows; rows of D = 512 (rope 64) stored as ``quant.KVRowFormat`` "f32" (one
[N, 512] f32 array: the Triton copy kernel) or "fp8_v4" (448 e4m3 + 7 e8m0 + 64 bf16 = 583 B:
the 64-wide bf16 leaf goes through the kernel; the 448-wide and 7-wide leaves are not powers
of two and take the XLA row loop). Median of 20 synchronized calls after 3 warm-ups; prints a
table and writes kv_rows_gpu.json. Not yet run on a GPU (written with the fp8rows branch;
checked on CPU at small sizes only): no figure from it is in RESULTS.md.
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time  # benchmarks/timing.py

from lsparse_jax.memory.host_pool import empty_pool
from lsparse_jax.memory.hot_cache import HotCache
from lsparse_jax.quant import KVRowFormat
from pallas_kernels.hot_resolve import hot_resolve

PAGES, PAGE, HOT, K = 4096, 64, 4096, 512


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    out = pathlib.Path(ap.parse_args().out)
    rng = np.random.default_rng(0)
    table = jnp.arange(PAGES, dtype=jnp.int32)
    rows = []
    for kind in ("f32", "fp8_v4"):
        fmt = KVRowFormat(kind, 512, 64)
        pool = jax.tree.map(lambda r: empty_pool(PAGES, PAGE, r.shape[-1], r.dtype),
                            fmt.template())
        hot = HotCache.empty_like(fmt.template(), HOT)

        @jax.jit
        def move(selected, hot=hot, pool=pool):
            out = hot_resolve(selected, hot.rows, hot.positions, hot.stamps, hot.clock, table,
                              pool, page_size=PAGE, implementation="triton")
            return out[1]

        t = median_time(move, lambda: (jnp.asarray(
            rng.choice(PAGES * PAGE, K, replace=False), jnp.int32),))
        rows.append({"kv_dtype": kind, "row_bytes": fmt.row_bytes, "rows": K, "seconds": t,
                     "us_per_row": t / K * 1e6})
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    (out / "kv_rows_gpu.json").write_text(json.dumps(result, indent=2))
    print(f"{'kv_dtype':8s} {'B/row':>6s} {'rows':>5s} {'ms':>9s} {'us/row':>8s}")
    for r in rows:
        print(f"{r['kv_dtype']:8s} {r['row_bytes']:6d} {r['rows']:5d} {r['seconds'] * 1e3:9.3f} "
              f"{r['us_per_row']:8.2f}")


if __name__ == "__main__":
    main()
