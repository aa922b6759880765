"""GPU figures for the KV hierarchy's XLA copy path (issue 3) and the decode step.

Run on the GPU machine: python benchmarks/hierarchy_gpu.py [--out DIR]
Prints a table and writes hierarchy_gpu.json. Timing: warm-up, then the median of repeats of
device-synchronized wall time around each jitted call; indices are re-drawn every repeat.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time  # benchmarks/timing.py

from lsparse_jax.config import CacheConfig, EngineConfig
from lsparse_jax.memory import read_host_rows, write_host_page
from lsparse_jax.model import init_params, preset
from lsparse_jax.serving.engine import Engine

PCIE = 48e9  # measured pinned_host -> device, ../shared/gpu_facts


def copy_path(rows_list, dim, pool_gib, rng):
    page = 64
    num_pages = int(pool_gib * 2**30 // (page * dim * 4))
    pool = jax.device_put(np.zeros((num_pages * page, dim), np.float32), jax.memory.Space.Host)
    read = jax.jit(read_host_rows)
    out = []
    for rows in rows_list:
        def args(rows=rows):
            return pool, jnp.asarray(rng.integers(0, num_pages * page, rows), jnp.int32)
        t = median_time(read, args)
        out.append({"op": "read_host_rows", "rows": rows, "row_bytes": dim * 4,
                    "pool_GiB": pool_gib, "seconds": t, "us_per_row": t / rows * 1e6,
                    "GB_per_s": rows * dim * 4 / t / 1e9,
                    "fraction_of_pcie": rows * dim * 4 / t / PCIE})
    write = jax.jit(write_host_page, donate_argnums=0)
    block = jnp.ones((page, dim), jnp.float32)
    holder = {"pool": pool}

    def do_write(page_id):
        holder["pool"] = write(holder["pool"], page_id, block)
        return holder["pool"]

    t = median_time(do_write, lambda: (int(rng.integers(num_pages)),))
    out.append({"op": "write_host_page", "rows": page, "row_bytes": dim * 4, "seconds": t,
                "GB_per_s": page * dim * 4 / t / 1e9,
                "fraction_of_pcie": page * dim * 4 / t / PCIE,
                "memory_kind_after": holder["pool"].sharding.memory_kind})
    return out


def decode_steps(slots, prompt_len, steps, hot_rows):
    cfg = preset("tiny", max_len=4096)
    params = init_params(cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, prompt_len).astype(np.int32) for _ in range(slots)]
    rows = []
    for method, b, impl in (("resident", None, "xla"), ("hisparse", hot_rows, "xla"),
                            ("hisparse", hot_rows, "triton"), ("resident", None, "triton")):
        eng = Engine(EngineConfig(model=cfg, method=method, implementation=impl,
                                  cache=CacheConfig(num_slots=slots, prefill_chunk=512,
                                                    hot_cache_rows=b, page_size=64)), params)
        eng.warmup()
        for p in prompts:
            eng.admit(p, steps + 1)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        m = eng.metrics()
        rows.append({"op": f"decode_step[{method},{impl}]", "slots": slots, "prompt": prompt_len,
                     "seconds": float(np.median(times[2:])),
                     "resolved_fraction": m["selection"]["resolved_fraction"],
                     "generated": [eng.generated[s] for s in range(slots)]})
    for row in rows[1:]:
        row["identical_tokens"] = rows[0]["generated"] == row["generated"]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--decode-only", action="store_true", help="skip the host-copy rows")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    results = {"device": dev.device_kind, "jax": jax.__version__,
               "memory_kinds": [m.kind for m in dev.addressable_memories()]}
    rows = []
    if not args.decode_only:
        rows += copy_path([26, 512, 1664], 512, 4, rng)  # 1664 = 64 slots x 5% of k=512
        rows += copy_path([512], 128, 1, rng)
    rows += decode_steps(8, 3000, 40, 64)
    results["rows"] = rows
    path = pathlib.Path(args.out) / "hierarchy_gpu.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"device={results['device']} jax={results['jax']}")
    print(f"{'op':28s} {'rows':>6s} {'row_B':>6s} {'ms':>9s} {'us/row':>8s} {'GB/s':>7s} "
          f"{'%pcie':>6s}")
    for r in rows:
        print(f"{r['op']:28s} {r.get('rows', r.get('slots', '')):>6} {r.get('row_bytes', ''):>6} "
              f"{r['seconds'] * 1e3:9.3f} {r.get('us_per_row', float('nan')):8.2f} "
              f"{r.get('GB_per_s', float('nan')):7.2f} "
              f"{100 * r.get('fraction_of_pcie', float('nan')):6.1f}")
    print("tokens identical to resident/xla (hisparse xla, hisparse triton, resident triton):",
          *[r["identical_tokens"] for r in rows[-3:]])


if __name__ == "__main__":
    main()
