"""Host-to-device row gather: the XLA per-row path vs the zero-copy Pallas-Triton kernel.

Run on the GPU machine: python3 benchmarks/gather_rows_gpu.py [--out DIR] [--dtype D]
A 4 GiB table [N, 512] in pinned_host memory (f32, or e4m3 with --dtype float8_e4m3fn: those
rows cross the kernel as uint32 words, ``pallas_kernels.common.as_words``, and a bitcast that
XLA staged on the device would show as a ~85 ms copy per call); random row ids redrawn every
call; median of 20 synchronized calls after 3 warm-ups. Prints a table and writes
gather_rows_gpu[_<dtype>].json.
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time  # benchmarks/timing.py

from pallas_kernels.gather_rows.api import gather_rows

PCIE = 48e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float8_e4m3fn"))
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    rng = np.random.default_rng(0)
    dim, gib, dtype = 512, 4, jnp.dtype(args.dtype)
    n = gib * 2**30 // (dim * dtype.itemsize)
    table = jax.device_put(np.zeros((n, dim), dtype), jax.memory.Space.Host)
    rows = []
    for impl in ("xla", "triton"):
        fn = jax.jit(lambda t, i, impl=impl: gather_rows(t, i, implementation=impl))
        for count in (26, 512, 1664):
            t = median_time(fn, lambda c=count: (table, jnp.asarray(
                rng.integers(0, n, c), jnp.int32)))
            rows.append({"implementation": impl, "rows": count, "row_bytes": dim * dtype.itemsize,
                         "table_GiB": gib, "seconds": t, "us_per_row": t / count * 1e6,
                         "GB_per_s": count * dim * dtype.itemsize / t / 1e9,
                         "fraction_of_pcie": count * dim * dtype.itemsize / t / PCIE})
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    name = "gather_rows_gpu" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(f"{'impl':8s} {'rows':>6s} {'ms':>9s} {'us/row':>8s} {'GB/s':>7s} {'%pcie':>6s}")
    for r in rows:
        print(f"{r['implementation']:8s} {r['rows']:6d} {r['seconds'] * 1e3:9.3f} "
              f"{r['us_per_row']:8.2f} {r['GB_per_s']:7.2f} {100 * r['fraction_of_pcie']:6.1f}")


if __name__ == "__main__":
    main()
