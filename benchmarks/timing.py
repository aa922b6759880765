"""Shared timing for the GPU benchmark scripts (run as ``python3 benchmarks/<script>.py``)."""

import json
import pathlib
import time

import jax
import numpy as np


def median_time(fn, make_args, repeats=20, warmup=3):
    """Median seconds of ``fn(*make_args())`` over ``repeats`` device-synchronized calls after
    ``warmup`` calls; fresh arguments each call (made and synchronized outside the timing)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*make_args()))
    times = []
    for _ in range(repeats):
        args = make_args()
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def program_time(fn, sets, repeats=10, warmup=2):
    """Median seconds of one call of ``fn``, timed as one jitted program calling it on each of
    ``sets`` (distinct argument tuples, so one dispatch covers len(sets) calls and host launch
    overhead is amortized; experiments/kernel_compare.py times the same way)."""
    program = jax.jit(lambda sets: [fn(*s) for s in sets])
    for _ in range(warmup):
        jax.block_until_ready(program(sets))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(program(sets))
        times.append((time.perf_counter() - t0) / len(sets))
    return float(np.median(times))


def write_results(out, filename: str, args, results: list) -> None:
    """``results`` (rows so far) with the run's arguments, device and jax version as JSON at
    ``out``/``filename`` (a script calls it after every row; ``out`` None writes nothing)."""
    if out is None:
        return
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / filename).write_text(json.dumps({
        "args": vars(args), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "results": results}, indent=1))
