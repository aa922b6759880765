"""Issue 16, session 6 on one H200: the new kernel variants against XLA, one cell at a time.

Run from the repository root (jax 0.11.2, triton 3.6.0; gin / jax-triton wheels as usual):
    PYTHONPATH=$PWD python3 benchmarks/kernels_session6_gpu.py --out $OUT --budget-s 220
--small: tiny shapes in Pallas interpret mode (a CPU smoke run of the script, not a benchmark).
--cells: a comma list of cells to run (default: all, in this order):
  hot_resolve   B = 64 requests, k = 512, R = 2048 hot rows of D = 512 f32, 1 GiB pinned_host
                pool, 5% and 0% misses: xla, triton, triton_fused (control in-kernel). Timed
                with the hot rows donated (as in the decode step); every output checked bit for
                bit against xla. Roofline: the missed rows over the 48 GB/s host link (none at
                0% misses: there the target is the absolute 0.03 ms).
  index_scores  V4 indexer, B = 64, C = 2048, H = 64, D = 128, FP8 keys: scores by xla, triton
                (bf16 dot), triton_fp8 (fp8 x fp8); scores + top-512 by xla, triton + topk
                triton (two ops), triton_fp8 + topk triton (two ops), index_topk triton_fp8
                (one fused kernel), triton_fp8 + short-row top-k (two kernels, split form).
                fp8 variants checked against their XLA twin (index_scores_fp8_xla; sets
                against index_topk_xla(fp8=True)).
  topk          64 x 262144, k = 2048: xla, triton (fixed sequence), triton one-read (opt-in),
                each also with finish_in_registers=True (stage 2 on register-held keys), and
                one-read with a floor hint (a previous step's k-th score: no sample / sort).
  nosync        host syncs: per op, a jitted program of 8 back-to-back calls of the Triton
                variant under jax.profiler; GPU kernels counted, the largest idle gap between
                consecutive kernels and any device->host copy reported ("host_ms" = host time
                of one dispatch without waiting: a host wait inside the op makes it ~ the call).
Each variant: max relative error / set agreement vs its reference ("correct"), ms = one jitted
program over R = 4 distinct input sets (together past the 50 MB L2) / R (benchmarks/timing.py),
x XLA, % roofline (HBM 3.0 TB/s, host link 48 GB/s). A failing variant records its error; the
others still run. Past --budget-s the remaining cells are skipped (recorded). Each cell runs in
a child process (a kernel that crashes the process or hangs costs only its cell; the parent
never touches the GPU). JSON after every variant: OUT/kernels_session6_gpu.<cell>.json, merged
into OUT/kernels_session6_gpu.json after every cell; the table last (and
OUT/kernels_session6_gpu.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from timing import program_time  # noqa: E402
from traces import gpu_events  # noqa: E402  (benchmarks/traces.py)

HBM = 3.0e12
LINK = 48e9
SHAPES = dict(hot=dict(batch=64, k=512, rows=2048, dim=512, page=64, pool_gib=1.0),
              index=dict(b=64, c=2048, h=64, d=128, top=512),
              topk=dict(b=64, n=262144, k=2048))
SMALL = dict(hot=dict(batch=4, k=16, rows=32, dim=16, page=4, pool_gib=2**-12),
             index=dict(b=2, c=256, h=8, d=64, top=32),
             topk=dict(b=2, n=4096, k=64))
STATE = dict(rows=[], start=time.monotonic(), budget=220.0, out=None, repeats=10, sets=4)
MARGIN_S = 8.0  # a variant needs at least this much budget left to start (compile + timing)


def left() -> float:
    return STATE["budget"] - (time.monotonic() - STATE["start"])


def record(**row):
    """Appends a row and rewrites the JSON (the parent's never touches the GPU: no jax.devices
    there, so its children get the whole device)."""
    STATE["rows"].append(row)
    payload = dict(jax=jax.__version__, seconds=time.monotonic() - STATE["start"],
                   rows=STATE["rows"])
    if STATE.get("child"):
        payload["device"] = jax.devices()[0].device_kind
    STATE["json"].write_text(json.dumps(payload, indent=1, default=str))


def variant(op, name, fn, **extra):
    """Runs one variant; fn() -> dict(ms=..., correct=..., ...). Errors are recorded."""
    if left() <= MARGIN_S:
        record(op=op, variant=name, skipped="budget", **extra)
        return None
    t0 = time.monotonic()
    try:
        row = fn()
    except Exception as err:  # one variant failing must not stop the others
        record(op=op, variant=name, error=f"{type(err).__name__}: {err}"[:400],
               trace=traceback.format_exc(limit=3)[-800:], wall_s=time.monotonic() - t0,
               **extra)
        return None
    record(op=op, variant=name, wall_s=time.monotonic() - t0, **extra, **row)
    return row


# ---------------------------------------------------------------------------- hot_resolve


def cell_hot_resolve(small):
    import hot_resolve_gpu as hr

    from experiments.cases import hot_resolve as case

    s = SHAPES["hot"]
    hr.BATCH, hr.K, hr.ROWS, hr.DIM, hr.PAGE = s["batch"], s["k"], s["rows"], s["dim"], s["page"]
    hr.SETS, hr.REPEATS = 4, STATE["repeats"]
    pool, table = case.make_pool(jax.random.key(0), s["batch"], s["dim"], s["page"],
                                 s["pool_gib"])
    for miss in (0.05, 0.0):
        _hot_miss(hr, case, s, pool, table, miss)


def _hot_miss(hr, case, s, pool, table, miss):
    """The three implementations at one miss fraction (see cell_hot_resolve)."""
    sets = [case.make_inputs(jax.random.key(10 + i), s["batch"], s["k"], s["rows"],
                             s["dim"], miss, table, s["page"]) for i in range(hr.SETS)]
    rest = [(x[0], x[2], x[3], x[4], table) for x in sets]
    fresh = lambda: [x[1] + 0 for x in sets]  # noqa: E731
    n_miss = int(round(miss * s["k"]))
    link = s["batch"] * n_miss * s["dim"] * 4
    sel, rows, pos, stamps, clock = sets[0]
    want = jax.jit(case.batched_hot_resolve("xla", s["page"]))(sel, rows + 0, pos, stamps,
                                                              clock, table, pool)
    want = [np.asarray(x) for x in jax.tree.leaves(want)]
    base = {}
    for impl in ("xla", "triton", "triton_fused"):
        def run(impl=impl):
            got = jax.jit(case.batched_hot_resolve(impl, s["page"]))(
                sel, rows + 0, pos, stamps, clock, table, pool)
            same = all(np.asarray(a).tobytes() == b.tobytes()
                       for a, b in zip(jax.tree.leaves(got), want))
            t = hr.time_program(hr.program(impl), fresh, rest, pool)
            base.setdefault("xla", t)
            return dict(ms=t * 1e3, correct=bool(same), vs_xla=base["xla"] / t,
                        roofline=(link / LINK) / t if link else None,
                        target_ms=0.10 if miss else 0.03)
        variant("hot_resolve", impl, run, miss_fraction=miss, missed_rows=s["batch"] * n_miss)


# ---------------------------------------------------------------------------- index_scores


def _index_inputs(key, b, c, h, d):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    q = jax.random.normal(k1, (b, h, d), jnp.float32)
    w = jax.random.normal(k2, (b, h), jnp.float32)
    values = (jax.random.normal(k3, (b, c, d), jnp.float32) * 4).astype(jnp.float8_e4m3fn)
    scales = jax.random.uniform(k4, (b, c, 1), jnp.float32, 0.5, 2.0)
    valid = jax.random.uniform(k5, (b, c)) < 0.95
    return q, w, values, scales, valid


def _rel(got, want, valid):
    got, want, valid = (np.asarray(x) for x in (got, want, valid))
    if not np.all(got[~valid] == -np.inf):
        return float("inf")
    scale = max(np.abs(want[valid]).max(initial=0), 1e-6)
    return float(np.abs(got[valid] - want[valid]).max(initial=0) / scale)


def _sets(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return float(np.mean([set(a[a >= 0].tolist()) == set(b[b >= 0].tolist())
                          for a, b in zip(got, want)]))


def cell_index_scores(small):
    from pallas_kernels.index_scores import index_scores, index_topk
    from pallas_kernels.index_scores.reference import index_scores_fp8_xla, index_topk_xla
    from pallas_kernels.topk import topk

    s = SHAPES["index"]
    b, c, top = s["b"], s["c"], s["top"]
    sets = [_index_inputs(jax.random.key(i), b, c, s["h"], s["d"])
            for i in range(STATE["sets"])]
    args = sets[0]
    exact = index_scores(*args, implementation="xla")
    twin = index_scores_fp8_xla(*args)
    bytes_ = b * c * (s["d"] + 4 + 1) + b * s["h"] * s["d"] * 4
    roof = bytes_ / HBM
    base = {}

    def timed(name, fn, check, top_k):
        def run():
            correct = check()
            t = program_time(fn, sets, repeats=STATE["repeats"])
            key = "topk" if top_k else "scores"
            base.setdefault(key, t)
            return dict(ms=t * 1e3, vs_xla=base[key] / t, roofline=roof / t, **correct,
                        target_ms=0.015)
        variant("index_scores", name, run, with_topk=top_k)

    lengths = lambda valid: jnp.full((valid.shape[0],), c, jnp.int32)  # noqa: E731

    def two_ops(impl):
        def fn(*a):
            sc = index_scores(*a, implementation=impl)
            return topk(sc, lengths(a[4]), top, implementation="triton" if impl != "xla"
                        else "xla")
        return fn

    timed("xla", lambda *a: index_scores(*a, implementation="xla"),
          lambda: dict(correct=True, rel_err=0.0), False)
    timed("triton (bf16 dot)", lambda *a: index_scores(*a, implementation="triton"),
          lambda: (lambda e: dict(correct=e < 2e-2, rel_err=e))(
              _rel(index_scores(*args, implementation="triton"), exact, args[4])), False)
    timed("triton_fp8", lambda *a: index_scores(*a, implementation="triton_fp8"),
          lambda: (lambda e: dict(correct=e < 1e-4, rel_err=e, rel_err_vs_exact=_rel(
              twin, exact, args[4])))(
              _rel(index_scores(*args, implementation="triton_fp8"), twin, args[4])), False)
    want_x = index_topk_xla(*args, k=top, fp8=False)[0]
    want_8 = index_topk_xla(*args, k=top, fp8=True)[0]
    timed("xla + top-512", two_ops("xla"), lambda: dict(correct=True, sets=1.0), True)
    timed("triton + topk triton", two_ops("triton"),
          lambda: dict(sets=_sets(two_ops("triton")(*args)[0], want_x), correct=True), True)
    timed("triton_fp8 + topk triton", two_ops("triton_fp8"),
          lambda: (lambda f: dict(sets=f, correct=f >= 0.98))(
              _sets(two_ops("triton_fp8")(*args)[0], want_8)), True)

    def fused_check():
        pos, _, scores = index_topk(*args, k=top, implementation="triton_fp8")
        f, e = _sets(pos, want_8), _rel(scores, twin, args[4])
        return dict(sets=f, rel_err=e, correct=f >= 0.98 and e < 1e-4)

    timed("index_topk fused triton_fp8",
          lambda *a: index_topk(*a, k=top, implementation="triton_fp8")[:2], fused_check, True)
    from pallas_kernels.index_scores.topk_fused import index_topk_split

    def split_check():
        pos, _, scores = index_topk_split(*args, k=top)
        f, e = _sets(pos, want_8), _rel(scores, twin, args[4])
        return dict(sets=f, rel_err=e, correct=f >= 0.98 and e < 1e-4)

    timed("triton_fp8 + short-row top-k", lambda *a: index_topk_split(*a, k=top)[:2],
          split_check, True)


# ---------------------------------------------------------------------------- topk


def cell_topk(small):
    from pallas_kernels.topk import topk
    from pallas_kernels.topk.triton import topk_triton

    s = SHAPES["topk"]
    b, n, k = s["b"], s["n"], s["k"]
    sets = [(jax.random.normal(jax.random.key(i), (b, n), jnp.float32),
             jnp.full((b,), n, jnp.int32)) for i in range(STATE["sets"])]
    want, kth = topk(*sets[0], k, implementation="xla")
    # "previous step's k-th score": set 0's k-th value, 0.03 lower (~4 sd of the k-th order
    # statistic of 262144 normals), used as the floor hint for every set
    hint = jnp.full((b,), float(np.median(np.asarray(kth)[:, -1])) - 0.03, jnp.float32)
    roof = 4.0 * b * n / HBM
    base = {}
    interp = not any(d.platform == "gpu" for d in jax.devices())
    variants = {"xla": lambda sc, ln: topk(sc, ln, k, implementation="xla"),
                "triton": lambda sc, ln: topk(sc, ln, k, implementation="triton"),
                "triton one-read": lambda sc, ln: topk_triton(sc, ln, k, interpret=interp,
                                                              one_read=True, sample=4096),
                "triton regs-finish": lambda sc, ln: topk_triton(
                    sc, ln, k, interpret=interp, finish_in_registers=True),
                "triton one-read regs-finish": lambda sc, ln: topk_triton(
                    sc, ln, k, interpret=interp, one_read=True, sample=4096,
                    finish_in_registers=True),
                "triton one-read floor-hint regs-finish": lambda sc, ln: topk_triton(
                    sc, ln, k, interpret=interp, one_read=True, finish_in_registers=True,
                    floor=hint)}
    for name, fn in variants.items():
        def run(fn=fn):
            f = _sets(fn(*sets[0])[0], want)
            t = program_time(fn, sets, repeats=STATE["repeats"])
            base.setdefault("xla", t)
            return dict(ms=t * 1e3, vs_xla=base["xla"] / t, roofline=roof / t, sets=f,
                        correct=f == 1.0, target_ms=0.050)
        variant("topk", name, run)


# ---------------------------------------------------------------------------- nosync


def sync_profile(name, fn, args, calls=8, chained=False):
    """Host dispatch time and the GPU stream of ``calls`` back-to-back calls in one program
    (chained: fn(x) returns the next call's only argument, e.g. hot rows updated in place)."""
    def many(*a):
        if not chained:
            return [fn(*a) for _ in range(calls)]
        x = a[0]
        for _ in range(calls):
            x = fn(x)
        return x

    program = jax.jit(many)
    for _ in range(2):  # warm: compile, then a first run (lazy first-execution work)
        jax.block_until_ready(program(*args))
    t0 = time.perf_counter()
    out = program(*args)
    host = time.perf_counter() - t0
    jax.block_until_ready(out)
    total = time.perf_counter() - t0
    trace = STATE["out"] / "trace_nosync" / name.replace(" ", "_")
    trace.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(trace), create_perfetto_trace=True):
        jax.block_until_ready(program(*args))
    ev = [e for e in gpu_events(trace) if not e[0].startswith("Memset")]
    gaps = [b[1] - (a[1] + a[2]) for a, b in zip(ev, ev[1:])]
    d2h = [e[0] for e in ev if "DtoH" in e[0] or "Device -> Host" in e[0]]
    return dict(host_ms=host * 1e3, call_ms=total * 1e3 / calls, kernels=len(ev),
                kernels_per_call=len(ev) / calls, max_gap_us=max(gaps, default=0.0),
                sum_gap_us=float(sum(g for g in gaps if g > 0)), device_to_host=len(d2h),
                busy_us=float(sum(e[2] for e in ev)), correct=bool(ev) and not d2h,
                kernel_us_per_call=per_kernel(ev, calls))


def per_kernel(ev, calls):
    """{kernel name: us per call}, longest first (where a call's time goes)."""
    total = {}
    for name, _, dur in ev:
        total[name[:70]] = total.get(name[:70], 0.0) + dur / calls
    return dict(sorted(total.items(), key=lambda kv: -kv[1])[:15])


def cell_nosync(small):
    """Most informative first: the default topk, the new hot_resolve and index_topk, pq_topc,
    then the topk one-read forms and the old hot_resolve."""
    from experiments.cases import hot_resolve as case
    from pallas_kernels.index_scores import index_topk
    from pallas_kernels.pq_topc import pq_topc
    from pallas_kernels.topk import topk
    from pallas_kernels.topk.triton import topk_triton

    t, s, h = SHAPES["topk"], SHAPES["index"], SHAPES["hot"]
    scores = jax.random.normal(jax.random.key(0), (t["b"], t["n"]), jnp.float32)
    lengths = jnp.full((t["b"],), t["n"], jnp.int32)
    variant("nosync", "topk triton", lambda: sync_profile(
        "topk", lambda sc, ln: topk(sc, ln, t["k"], implementation="triton"),
        (scores, lengths)))
    pool, table = case.make_pool(jax.random.key(0), h["batch"], h["dim"], h["page"],
                                 h["pool_gib"])
    sel, rows, pos, stamps, clock = case.make_inputs(jax.random.key(3), h["batch"], h["k"],
                                                     h["rows"], h["dim"], 0.05, table,
                                                     h["page"])

    def hot(impl):
        one = case.batched_hot_resolve(impl, h["page"])
        variant("nosync", f"hot_resolve {impl}", lambda: sync_profile(
            f"hot_resolve_{impl}", lambda r: one(sel, r, pos, stamps, clock, table, pool)[1],
            (rows,), chained=True))

    hot("triton_fused")
    variant("nosync", "index_topk triton_fp8", lambda: sync_profile(
        "index_topk", lambda *a: index_topk(*a, k=s["top"], implementation="triton_fp8"),
        _index_inputs(jax.random.key(2), s["b"], s["c"], s["h"], s["d"])))
    n = 4096 if small else 131072
    b = t["b"]
    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    hd, m = (32, 8) if small else (128, 32)
    pq_args = (jax.random.normal(k1, (b, s["h"], hd), jnp.float32),
               jax.random.normal(k2, (b, s["h"]), jnp.float32),
               jax.random.randint(k3, (b, n, m), 0, 256, jnp.int32).astype(jnp.uint8),
               jax.random.normal(k4, (m, 256, hd // m), jnp.float32),
               jnp.full((b,), n, jnp.int32))
    variant("nosync", "pq_topc triton", lambda: sync_profile(
        "pq_topc", lambda *a: pq_topc(*a, num_candidates=min(2048, n // 2),
                                      implementation="triton"), pq_args))
    variant("nosync", "topk one-read regs-finish", lambda: sync_profile(
        "topk_oneread_regs", lambda sc, ln: topk_triton(sc, ln, t["k"], interpret=small,
                                                        one_read=True, sample=4096,
                                                        finish_in_registers=True),
        (scores, lengths)))
    hot("triton")
    variant("nosync", "topk triton one-read", lambda: sync_profile(
        "topk_oneread", lambda sc, ln: topk_triton(sc, ln, t["k"], interpret=small,
                                                   one_read=True, sample=4096),
        (scores, lengths)))


# ---------------------------------------------------------------------------- table


def table() -> str:
    head = (f"{'op':13s} {'variant':30s} {'ms':>8s} {'xXLA':>6s} {'%roof':>6s} {'correct':>7s}"
            f"  notes")
    lines = [head, "-" * len(head)]
    for r in STATE["rows"]:
        label = r["variant"] + (f" {100 * r['miss_fraction']:.0f}%miss"
                                if "miss_fraction" in r else "")
        if "ms" not in r and "host_ms" not in r:
            why = r.get("skipped") or r.get("error", "")
            lines.append(f"{r['op']:13s} {label:30s} {'n/a':>8s}  {why[:80]}")
            continue
        if r["op"] == "nosync":
            lines.append(f"{r['op']:13s} {label:30s} {r['call_ms']:8.3f} {'':>6s} {'':>6s} "
                         f"{str(r['correct']):>7s}  host {r['host_ms']:.3f} ms, "
                         f"{r['kernels_per_call']:.1f} kernels/call, max gap "
                         f"{r['max_gap_us']:.1f} us, D2H {r['device_to_host']}")
            continue
        roof = r.get("roofline")
        notes = ", ".join(f"{k} {r[k]:.3g}" for k in ("sets", "rel_err", "target_ms")
                          if isinstance(r.get(k), (int, float)))
        lines.append(f"{r['op']:13s} {label:30s} {r['ms']:8.4f} {r['vs_xla']:6.2f} "
                     f"{'-' if roof is None else format(100 * roof, '6.1f'):>6s} "
                     f"{str(r['correct']):>7s}  {notes}")
    return "\n".join(lines)


CELLS = dict(hot_resolve=cell_hot_resolve, index_scores=cell_index_scores, topk=cell_topk,
             nosync=cell_nosync)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/kernels_session6")
    ap.add_argument("--budget-s", type=float, default=220.0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--child", action="store_true", help="internal: run the cells in-process")
    a = ap.parse_args()
    if a.small:
        SHAPES.update(SMALL)
        STATE["sets"] = 2
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    STATE.update(budget=a.budget_s, repeats=2 if a.small else a.repeats, out=out,
                 child=a.child)
    if a.child:  # one cell, in this process
        STATE["json"] = out / f"kernels_session6_gpu.{a.cells}.json"
        try:
            CELLS[a.cells](a.small)
        except Exception as err:  # the cell's setup failed: record
            record(op=a.cells, variant="(cell setup)", error=f"{type(err).__name__}: {err}"[:400],
                   trace=traceback.format_exc(limit=3)[-800:])
        return
    # Parent: each cell in a child process, so that a crashing kernel (a signal, not an
    # exception) or a hang costs only its own cell; rows merged as the children write them.
    STATE["json"] = out / "kernels_session6_gpu.json"
    device = None
    for name in a.cells.split(","):
        budget = left()
        if budget <= 2 * MARGIN_S:
            record(op=name, variant="(cell)", skipped="budget")
            continue
        part = out / f"kernels_session6_gpu.{name}.json"
        part.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--child", "--cells", name, "--out", str(out),
               "--budget-s", f"{budget - 3:.0f}", "--repeats", str(a.repeats)]
        cmd += ["--small"] if a.small else []
        try:
            proc = subprocess.run(cmd, timeout=budget + 15, capture_output=True, text=True)
            status = None if proc.returncode == 0 else f"exit code {proc.returncode}"
            tail = (proc.stdout + proc.stderr)[-1500:]
        except subprocess.TimeoutExpired as err:
            status, tail = f"killed after {budget + 15:.0f} s", str(err.stderr or "")[-1500:]
        rows = json.loads(part.read_text()) if part.exists() else {}
        device = rows.get("device", device)
        for row in rows.get("rows", []):
            record(**row)
        if status:
            record(op=name, variant="(cell process)", error=status, trace=tail)
    text = table()
    for r in STATE["rows"]:  # where each profiled call's GPU time goes
        if r.get("kernel_us_per_call"):
            text += f"\n{r['variant']}: " + ", ".join(
                f"{k} {v:.1f}us" for k, v in list(r["kernel_us_per_call"].items())[:8])
    (STATE["out"] / "kernels_session6_gpu.txt").write_text(text + "\n")
    print(f"{device}, jax {jax.__version__}, {time.monotonic() - STATE['start']:.0f} s")
    print(text)


if __name__ == "__main__":
    main()
