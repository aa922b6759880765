"""sparse_attention at the V4-Flash CSA decode shape: Pallas-Triton vs XLA, then launch variants.

Run on the GPU machine: python3 benchmarks/sparse_attention_gpu.py [--out DIR]
Shape: H = 64 heads, D = 512, K = 512 distinct selected rows of a 2048-row table, W = 128 window
rows, bf16, batch B in 1, 8, 32, 64. Each implementation is checked against XLA, then timed as
experiments/kernel_compare.py does: one jitted program calls it on SETS distinct input sets
(> 2x the 50 MB L2 at B = 64), so host dispatch (~20-60 us, more than the kernel) is amortized;
median of REPEATS programs / SETS. (benchmarks/timing.median_time times one dispatched call,
which at these sizes would measure the dispatch.) FLOPs = 4 B H (K + W) D; % is of the
measured 790 TFLOP/s bf16 peak; GB/s counts the rows read once. A last table times launch
variants of the kernel at B = 64 (and splits of the row loop at B = 8). ~30-60 s of GPU time;
writes sparse_attention_gpu.json to --out.
"""

import argparse
import json
import pathlib
import time

import jax
import numpy as np

from experiments.cases.sparse_attention import flops_and_bytes, make_inputs
from pallas_kernels.sparse_attention.api import sparse_attention
from pallas_kernels.sparse_attention.triton_v1 import default_config, sparse_attention_triton

PEAK = 790e12
SHAPE = dict(k=512, window=128, heads=64, dim=512, rows=2048, dtype="bfloat16")
SETS, REPEATS = 8, 10
VARIANTS = [  # (batch, kwargs of sparse_attention_triton); {} = default_config
    (64, {}),
    (64, dict(block_h=32, block_k=16, num_warps=8, num_stages=4)),
    (64, dict(block_h=32, block_k=64, num_warps=8, num_stages=2)),
    (64, dict(block_h=16, block_k=32, num_warps=4, num_stages=3)),
    (64, dict(block_h=64, block_k=32, num_warps=8, num_stages=2)),
    (64, dict(block_h=64, block_k=16, num_warps=8, num_stages=3)),
    (64, dict(block_h=64, block_k=32, num_warps=16, num_stages=2)),
    (64, dict(block_h=64, block_k=32, num_warps=8, num_stages=2, splits=2)),
    (32, {}),
    (32, dict(block_h=16, block_k=32, num_warps=4, num_stages=3, splits=1)),
    (8, {}),
    (8, dict(splits=8)),
    (8, dict(block_h=16, block_k=32, num_warps=4, num_stages=3)),
]


def time_program(fn, sets):
    """Median seconds of one call of ``fn``, timed over a program of len(sets) calls."""
    program = jax.jit(lambda sets: [fn(*s) for s in sets])
    jax.block_until_ready(program(sets))  # compile + warm-up
    jax.block_until_ready(program(sets))
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        jax.block_until_ready(program(sets))
        times.append((time.perf_counter() - t0) / len(sets))
    return float(np.median(times))


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


def row(label, batch, seconds, err):
    flops, nbytes = flops_and_bytes(batch, SHAPE["k"], SHAPE["window"], SHAPE["heads"],
                                    SHAPE["dim"], SHAPE["dtype"])
    return dict(label=label, B=batch, ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                pct_peak=100 * flops / seconds / PEAK, gbytes_per_s=nbytes / seconds / 1e9,
                max_rel_err=err)


def fmt(r):
    return (f"{r['label']:58s} {r['B']:3d} {r['ms']:8.4f} {r['tflops']:7.1f} "
            f"{r['pct_peak']:6.1f} {r['gbytes_per_s']:7.0f} {r['max_rel_err']:9.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    out = pathlib.Path(ap.parse_args().out)
    head = (f"{'implementation / variant':58s} {'B':>3s} {'ms':>8s} {'TFLOP/s':>7s} "
            f"{'%790':>6s} {'GB/s':>7s} {'rel_err':>9s}")
    print(jax.devices()[0].device_kind, "jax", jax.__version__)
    print(head)
    inputs, rows = {}, []
    for batch in (1, 8, 32, 64):
        sets = [make_inputs(jax.random.key(i), batch, **SHAPE) for i in range(SETS)]
        inputs[batch] = sets
        want = sparse_attention(*sets[0], implementation="xla")
        for impl in ("xla", "triton"):
            fn = lambda *a, impl=impl: sparse_attention(*a, implementation=impl)  # noqa: E731
            err = rel_err(fn(*sets[0]), want)
            rows.append(row(impl, batch, time_program(fn, sets), err))
            print(fmt(rows[-1]), flush=True)
        if batch not in {b for b, _ in VARIANTS}:
            del inputs[batch]
    variants = []
    for batch, kw in VARIANTS:
        sets = inputs[batch]
        cfg = default_config(batch, SHAPE["heads"], SHAPE["dim"], SHAPE["k"], SHAPE["window"],
                             2, **kw)
        label = " ".join(f"{k}={v}" for k, v in cfg.items()) + (" (default)" if not kw else "")
        fn = lambda *a, kw=kw: sparse_attention_triton(*a, **kw)  # noqa: E731
        try:
            err = rel_err(fn(*sets[0]), sparse_attention(*sets[0], implementation="xla"))
            variants.append(row(label, batch, time_program(fn, sets), err))
        except Exception as e:  # report a variant that fails to compile, go on
            print(f"{label}: {type(e).__name__}: {str(e)[:200]}")
    print("\nlaunch variants of the Triton kernel (config, B, ms, TFLOP/s, %790, GB/s, err):")
    print(head)
    for r in variants:
        print(fmt(r))
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "shape": SHAPE,
              "rows": rows, "variants": variants}
    (out / "sparse_attention_gpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
