"""hot_resolve at HiSparse decode scale: the XLA row loop vs the Pallas-Triton kernels.

Run on the GPU machine: python3 benchmarks/hot_resolve_gpu.py [--out DIR]
Shape: batch 64 requests (vmapped), k = 512 selected positions, B = 2048 hot rows of D = 512
f32 (2 KiB), a 1 GiB pinned_host pool of 64-row pages shared by all requests; 5% of the
selection misses (26 rows a request, 1664 rows = 3.4 MB a call), and a hit-only run (0%).
Implementations (IMPLS): xla, triton_copy (XLA control + copy kernel), triton_fused (3 launches
since session 29, 4 before: control in-kernel), triton_fused2 (2 launches: map and control (and
before session 29 the victims' order) in one program a request). Every one is first checked equal
to xla (every output, bit for bit) and the copied rows checked against the pool. Timing: one jitted
program runs SETS distinct input sets with the hot rows donated (the op then writes them in place,
as in the decode step), fresh copies made outside the timing; median over REPEATS programs / SETS.
GB/s counts the missed rows; % is of the ~48 GB/s measured pinned_host -> device link. "control"
times the XLA hit scan + victim choice + stamps alone (triton_copy's control). Profile: for each
Triton implementation one jax.profiler trace of its program: GPU kernels per call (busy us by
kernel name) and the span per call (first kernel start to last end / SETS; memsets left out). ~40 s
of GPU time; writes hot_resolve_gpu.json to --out.
"""

import argparse
import json
import pathlib
import tempfile
import time

import jax
import numpy as np
from traces import gpu_events, per_call  # benchmarks/traces.py

from experiments.cases import hot_resolve as case
from pallas_kernels.hot_resolve.reference import resolve_control

BATCH, K, ROWS, DIM, PAGE, POOL_GIB = 64, 512, 2048, 512, 64, 1.0
SETS, REPEATS = 4, 10
IMPLS = ("xla", "triton_copy", "triton_fused", "triton_fused2")


def program(impl):
    one = case.batched_hot_resolve(impl, PAGE)
    return jax.jit(lambda rows, rest, pool: [one(r[0], h, *r[1:], pool)
                                             for h, r in zip(rows, rest)], donate_argnums=0)


def control_program():
    one = jax.vmap(lambda sel, pos, stamps, clock, table: resolve_control(
        sel, pos, stamps, clock, table, page_size=PAGE))
    return jax.jit(lambda rest: [one(r[0], *r[1:]) for r in rest])


def time_program(fn, fresh_rows, rest, pool):
    """Median seconds per input set (hot rows donated: a fresh copy each run)."""
    times = []
    for i in range(REPEATS + 2):
        rows = fresh_rows()
        jax.block_until_ready(rows)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(rows, rest, pool) if pool is not None else fn(rest))
        if i >= 2:
            times.append((time.perf_counter() - t0) / SETS)
    return float(np.median(times))


def profile(fn, fresh_rows, rest, pool):
    """``traces.per_call`` of one traced run of the program (SETS calls)."""
    rows = fresh_rows()
    jax.block_until_ready(rows)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(fn(rows, rest, pool))
        return per_call(gpu_events(pathlib.Path(tmp)), SETS)


def check(sets, table, pool, miss_fraction):
    """every implementation == xla on set 0, and every copied row equals its pool row."""
    sel, rows, pos, stamps, clock = sets[0]
    outs = {}
    for impl in IMPLS:
        outs[impl] = jax.jit(case.batched_hot_resolve(impl, PAGE))(sel, rows + 0, pos, stamps,
                                                                   clock, table, pool)
    for impl in IMPLS[1:]:
        for a, b in zip(jax.tree.leaves(outs["xla"]), jax.tree.leaves(outs[impl])):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"{impl} differs"
    slots, new_rows, _, _, _, counts = (np.asarray(x) for x in outs["triton_fused2"])
    n_miss = int(round(miss_fraction * K))
    assert (counts == [K - n_miss, n_miss]).all(), counts
    sel, old_pos, table_np = np.asarray(sel), np.asarray(pos), np.asarray(table)
    pool_np = np.asarray(jax.device_put(pool, jax.memory.Space.Device))
    for r in range(0, BATCH, 16):  # spot-check the misses of a few requests
        for j in np.flatnonzero(~np.isin(sel[r], old_pos[r])):
            p = sel[r, j]
            src = table_np[r, p // PAGE] * PAGE + p % PAGE
            assert new_rows[r, slots[r, j]].tobytes() == pool_np[src].tobytes()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    out = pathlib.Path(ap.parse_args().out)
    pool, table = case.make_pool(jax.random.key(0), BATCH, DIM, PAGE, POOL_GIB)
    assert pool.sharding.memory_kind == "pinned_host"
    pool_gib = pool.nbytes / 2**30
    programs = {impl: program(impl) for impl in IMPLS}
    results = []
    for miss_fraction in (0.05, 0.0):
        sets = [case.make_inputs(jax.random.key(10 + i), BATCH, K, ROWS, DIM, miss_fraction,
                                 table, PAGE) for i in range(SETS)]
        check(sets, table, pool, miss_fraction)
        rest = [(s[0], s[2], s[3], s[4], table) for s in sets]
        fresh = lambda sets=sets: [s[1] + 0 for s in sets]  # noqa: E731
        n_miss = int(round(miss_fraction * K))
        link = BATCH * n_miss * DIM * 4
        rows = [("control", time_program(control_program(), fresh, rest, None))]
        rows += [(impl, time_program(fn, fresh, rest, pool)) for impl, fn in programs.items()]
        for impl, t in rows:
            results.append({"implementation": impl, "miss_fraction": miss_fraction,
                            "missed_rows": BATCH * n_miss, "link_bytes": link, "seconds": t,
                            "GB_per_s": link / t / 1e9,
                            "fraction_of_link": link / t / case.LINK_BYTES_PER_S})
            if impl.startswith("triton"):
                try:
                    got = profile(programs[impl], fresh, rest, pool)
                    results[-1].update(kernels_us=got.get("by_name", {}),
                                       span_us=got.get("span_us"), busy_us=got.get("busy_us"))
                except Exception as err:  # a profiler problem must not cost the timings
                    results[-1].update(profile_error=f"{type(err).__name__}: {err}"[:300])
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "shape": dict(batch=BATCH, k=K, hot_rows=ROWS, dim=DIM, page=PAGE,
                          pool_GiB=pool_gib), "timing": f"donated, {SETS} sets a program"}
    (out / "hot_resolve_gpu.json").write_text(json.dumps({**meta, "rows": results}, indent=2))
    print(f"{meta['device']}, jax {jax.__version__}, pool {pool_gib:.2f} GiB pinned_host")
    print(f"{'impl':14s} {'miss%':>6s} {'rows':>6s} {'ms':>8s} {'GB/s':>7s} {'%48GB/s':>8s} "
          f"{'busy us':>8s} {'span us':>8s}  kernels (us per call)")
    for r in results:
        kern = " ".join(f"{n[:28]}={u:.1f}" for n, u in r.get("kernels_us", {}).items())
        busy, span = r.get("busy_us"), r.get("span_us")
        print(f"{r['implementation']:14s} {100 * r['miss_fraction']:6.1f} {r['missed_rows']:6d} "
              f"{r['seconds'] * 1e3:8.3f} {r['GB_per_s']:7.2f} {100 * r['fraction_of_link']:8.1f} "
              f"{busy if busy is None else round(busy, 1)!s:>8s} "
              f"{span if span is None else round(span, 1)!s:>8s}  {kern}")


if __name__ == "__main__":
    main()
