"""index_logits on the GPU (issue 13, deliver 1: the prefill's indexer scores): the Pallas-Triton
kernel against its XLA twin at a V4 prefill tile, T = 1024 queries, H = 64 heads x D = 128,
N in {32768, 131072, 262144} keys (1M tokens compress to 262144 CSA positions).

    PYTHONPATH=$PWD python3 benchmarks/index_logits_gpu.py --out $OUT [--dry]

Each variant: max error relative to max |twin|, then ms per call timed as
kernel_compare does (benchmarks/timing.py::program_time, 2 input sets), TFLOP/s = 2 T H N D /
time, and the twin / kernel ratio. The twin writes and reads back the [T, H, N] f32 products
(8 GiB at N 32768, 64 GiB at N 262144); where it runs out of memory its error is recorded and
the run goes on. Then a few launch variants of the kernel, until --budget-s.
--dry: tiny shapes in interpret mode on CPU (checks the script runs). Writes
index_logits_gpu.json to --out after every row.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import program_time, write_results  # benchmarks/timing.py

from pallas_kernels.index_logits import index_logits
from pallas_kernels.index_logits.triton import index_logits_triton

VARIANTS = [dict(), dict(block_t=2), dict(block_t=8, num_warps=8), dict(block_n=128),
            dict(steps=32), dict(num_warps=8)]  # BT 8 needs 8 warps: 255 registers, no spills


def inputs(key, t, h, d, n):
    kq, kw, kk = jax.random.split(key, 3)
    return (jax.random.normal(kq, (t, h, d), jnp.float32),
            jax.random.normal(kw, (t, h), jnp.float32),
            jax.random.normal(kk, (n, d), jnp.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240.0)
    args = ap.parse_args()
    t, h, d = (16, 4, 32) if args.dry else (1024, 64, 128)
    ns = (64, 256) if args.dry else (32768, 131072, 262144)
    start, rows = time.perf_counter(), []
    print(jax.devices()[0].device_kind, "jax", jax.__version__)
    for n in ns:
        sets = [inputs(jax.random.key(i), t, h, d, n) for i in range(2)]
        flops = 2.0 * t * h * n * d
        twin_ms, want = None, None
        try:
            want = np.asarray(index_logits(*sets[0], implementation="xla"))
            twin_ms = 1e3 * program_time(lambda *a: index_logits(*a, implementation="xla"),
                                         sets)
        except Exception as err:  # noqa: BLE001  (out of memory at large N: recorded)
            rows.append(dict(N=n, variant="xla", error=f"{type(err).__name__}: {err}"[:300]))
        if twin_ms is not None:
            rows.append(dict(N=n, variant="xla", ms=twin_ms, tflops=flops / twin_ms / 1e9))
        for kw in VARIANTS:
            if time.perf_counter() - start > args.budget_s:
                break
            label = "triton " + (" ".join(f"{k}={v}" for k, v in kw.items()) or "default")
            try:
                fn = functools.partial(index_logits_triton, **kw)
                got = np.asarray(fn(*sets[0]))
                err = (float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))
                       if want is not None else None)
                ms = 1e3 * program_time(fn, sets)
                rows.append(dict(N=n, variant=label, ms=ms, tflops=flops / ms / 1e9,
                                 rel_err=err, vs_xla=(twin_ms / ms) if twin_ms else None))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(N=n, variant=label, error=f"{type(exc).__name__}: {exc}"[:300]))
            write_results(args.out, "index_logits_gpu.json", args, rows)
        del sets
    print(f"\nindex_logits: T={t} H={h} D={d}")
    print(f"{'N':>7s} {'variant':28s} {'ms':>9s} {'TFLOP/s':>8s} {'rel err':>9s} {'xla/kern':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['N']:7d} {r['variant']:28s} {r['error'][:70]}")
            continue
        err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
        vs = f"{r['vs_xla']:.2f}" if r.get("vs_xla") else "-"
        print(f"{r['N']:7d} {r['variant']:28s} {r['ms']:9.3f} {r['tflops']:8.1f} {err:>9s} "
              f"{vs:>8s}")
    write_results(args.out, "index_logits_gpu.json", args, rows)


if __name__ == "__main__":
    main()
