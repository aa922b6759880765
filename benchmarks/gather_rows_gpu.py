"""Host-to-device row gather: the XLA per-row path vs the zero-copy Pallas-Triton kernel.

Run on the GPU machine: python3 benchmarks/gather_rows_gpu.py [--out DIR]
A 4 GiB f32 table [N, 512] in pinned_host memory; random row ids redrawn every call; median
of 20 synchronized calls after 3 warm-ups. Prints a table and writes gather_rows_gpu.json.
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
    out = pathlib.Path(ap.parse_args().out)
    rng = np.random.default_rng(0)
    dim, gib = 512, 4
    n = gib * 2**30 // (dim * 4)
    table = jax.device_put(np.zeros((n, dim), np.float32), jax.memory.Space.Host)
    rows = []
    for impl in ("xla", "triton"):
        fn = jax.jit(lambda t, i, impl=impl: gather_rows(t, i, implementation=impl))
        for count in (26, 512, 1664):
            t = median_time(fn, lambda c=count: (table, jnp.asarray(
                rng.integers(0, n, c), jnp.int32)))
            rows.append({"implementation": impl, "rows": count, "row_bytes": dim * 4,
                         "table_GiB": gib, "seconds": t, "us_per_row": t / count * 1e6,
                         "GB_per_s": count * dim * 4 / t / 1e9,
                         "fraction_of_pcie": count * dim * 4 / t / PCIE})
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    (out / "gather_rows_gpu.json").write_text(json.dumps(result, indent=2))
    print(f"{'impl':8s} {'rows':>6s} {'ms':>9s} {'us/row':>8s} {'GB/s':>7s} {'%pcie':>6s}")
    for r in rows:
        print(f"{r['implementation']:8s} {r['rows']:6d} {r['seconds'] * 1e3:9.3f} "
              f"{r['us_per_row']:8.2f} {r['GB_per_s']:7.2f} {100 * r['fraction_of_pcie']:6.1f}")


if __name__ == "__main__":
    main()
