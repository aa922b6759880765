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
    return time_program(batched_program(fn), sets, repeats, warmup)


def batched_program(fn):
    """The jitted program ``program_time`` times: ``fn`` on each argument tuple of a list."""
    return jax.jit(lambda sets: [fn(*s) for s in sets])


def time_program(program, sets, repeats=10, warmup=2):
    """``program_time`` of a ``batched_program`` built once (a caller timing it again, e.g.
    once a round, compiles it once)."""
    for _ in range(warmup):
        jax.block_until_ready(program(sets))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(program(sets))
        times.append((time.perf_counter() - t0) / len(sets))
    return float(np.median(times))


def interleaved_rounds(group: list[dict], time_row, rounds: int, deadline: float) -> None:
    """Times each row of ``group`` (dicts with a "_times" list; the base of the ratios first)
    once a round, ``time_row(row)`` seconds, the order rotated by one each round, so drift
    between rounds (clocks, temperature: session 36 saw one launch move 30% between
    back-to-back runs) falls on all rows alike. Stops after a round past ``deadline - 10``
    (time.monotonic()); every row then holds the same number of rounds."""
    for r in range(rounds):
        if r and time.monotonic() > deadline - 10:
            break
        order = group[r % len(group):] + group[:r % len(group)]
        for row in order:
            row["_times"].append(time_row(row))


def summarize_rounds(group: list[dict]) -> None:
    """Replaces each row's "_times" (seconds a round) with ms (median over rounds), ms_range,
    vs_default (the median of its per-round ratios to group[0]'s time of the same round),
    vs_default_range and rounds_faster (rounds with a ratio below 1)."""
    base = np.asarray(group[0]["_times"])
    for row in group:
        per_round = np.asarray(row.pop("_times"))
        ratios = per_round / base
        row.update(ms=1e3 * float(np.median(per_round)),
                   ms_range=[1e3 * float(per_round.min()), 1e3 * float(per_round.max())],
                   vs_default=float(np.median(ratios)),
                   vs_default_range=[float(ratios.min()), float(ratios.max())],
                   rounds_faster=int(np.sum(ratios < 1.0)))


def compare_outputs(out, want) -> dict:
    """A launch variant's output against the default's: equal_default (bit for bit, NaN equal
    to NaN), mask_equal (the same finite entries) and max_rel_diff (the largest difference on
    the default's finite entries over their largest magnitude; 0 when there are none)."""
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    live = np.isfinite(want)
    diff = (float(np.abs(out[live] - want[live]).max())
            / max(float(np.abs(want[live]).max()), 1e-30) if live.any() else 0.0)
    return dict(equal_default=bool(np.array_equal(out, want, equal_nan=True)),
                mask_equal=bool(np.array_equal(np.isfinite(out), live)), max_rel_diff=diff)


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
