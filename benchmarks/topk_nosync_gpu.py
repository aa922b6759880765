"""Issue 16, deliver 1 on the GPU: topk and pq_topc without a host wait inside the op.

Run on the GPU machine (jax 0.11.2, H200), from the repository root:
    PYTHONPATH=$PWD python3 benchmarks/topk_nosync_gpu.py [--out DIR]
(DIR defaults to $OUT, else runs/topk_nosync_gpu), or STEP=nosync bash benchmarks/gpu_next.sh.
About 1-2 minutes, mostly compilation; past a time budget (--budget, 140 s) the variants left
are skipped (their rows say so) rather than run over; results are written after each op.

Shapes as in experiments/kernel_compare.py: topk 64 x 262144 f32, k = 2048; pq_topc B = 64,
N = 131072, H = 64, D = 128, M = 32, K = 256, C = 2048. Implementations:
  xla         the XLA reference (``implementation="xla"``),
  triton_old  the Pallas-Triton kernels as of 78be51b: counting passes in an XLA while loop on
              a device predicate (their source read from git at run time),
  triton      the fixed launch sequence (count, refine with early exit, select, finish),
  triton_oneread (topk only) one_read=True, sample 4096: a sampled floor, one segment-selection
              pass, a per-row finish, the two-read sequence as an early-exit fallback;
              "1read" = fraction of rows the one-read pass finished (the rest fell back),
  triton_oneread_s1024 (with --extra) the same with the default 1024-position sample,
  triton_unfused (pq_topc only) the score kernel, then the whole topk.
Timing reuses experiments.kernel_compare.time_case: "ms" = one jitted program over R >= 8
distinct input sets, divided by R (launch overhead amortized). "call_ms" = 8 separately
dispatched calls of one jitted function on one input set, one sync at the end (what a caller
pays). "host_ms" = host time to dispatch one call without waiting (a host wait inside the op
shows up here as about the whole call). Roofline: 3.0 TB/s HBM reading the op's input once
(topk: the f32 scores; pq_topc: the uint8 codes and q).
Checks against XLA: "sets" = fraction of rows whose index set equals the reference's on the
timing inputs ("ovl" = mean overlap; pq_topc's bf16 scores may move the C-th place there);
"sets*" = the same on check inputs where sets must match exactly (topk: integer scores with
heavy ties, NaN poison, lengths 0, 1, k - 1, k, k + 1, ...; pq_topc: integer inputs, exact in
bf16). A jax.profiler trace of 3 calls of each Triton variant goes to DIR/trace (TensorBoard /
xprof / Perfetto: the old path shows the stream idle while the host reads each pass's
predicate, the new one a gap-free stream).

Writes DIR/topk_nosync_gpu.json and DIR/topk_nosync_gpu.txt (the printed table). A variant that
fails prints its error in its row; the others still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
HBM_BYTES_PER_S = 3.0e12
TOPK = dict(b=64, n=262144, k=2048)
PQ = dict(b=64, n=131072, h=64, d=128, m=32, centroids=256, c=2048)
# --small: a CPU smoke run of this script (Pallas interpret mode), not a benchmark.
SMALL_TOPK = dict(b=8, n=4096, k=64)
SMALL_PQ = dict(b=8, n=1024, h=16, d=32, m=8, centroids=16, c=64)
INTERPRET = False  # set by run(): True without a GPU
BASELINE_DIR: pathlib.Path | None = None  # --baseline-dir: exported 78be51b kernel sources
ONE_READ_SAMPLE = {"triton_oneread": 4096, "triton_oneread_s1024": 1024}
TOPK_EXTRA: tuple[str, ...] = ()  # --extra: ("triton_oneread_s1024",)


BASELINE = "78be51b"  # the commit whose kernels counted in an XLA while loop


def _load(name: str, path: str, replace: dict[str, str] | None = None):
    """Imports ``path`` as it was at ``BASELINE`` (from git) as module ``name``, imports in it
    rewritten by ``replace``. Needs the repository's git history, or --baseline-dir holding
    the file as ``git show BASELINE:path > DIR/<path with / as _>`` wrote it."""
    local = BASELINE_DIR / path.replace("/", "_") if BASELINE_DIR else None
    if local is not None and local.exists():
        src = local.read_text()
    else:
        src = subprocess.run(["git", "show", f"{BASELINE}:{path}"], cwd=HERE.parent, check=True,
                             capture_output=True, text=True).stdout
    for old, new in (replace or {}).items():
        if old not in src:
            raise RuntimeError(f"{path.name}: expected {old!r} to rewrite")
        src = src.replace(old, new)
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(src, str(path), "exec"), module.__dict__)
    return module


def old_modules():
    """(topk, pq_topc) Triton modules as of 78be51b, or the error that stopped their import."""
    try:
        topk_old = _load("topk_triton_78be51b", "pallas_kernels/topk/triton.py")
        pq_old = _load("pq_topc_triton_78be51b", "pallas_kernels/pq_topc/triton.py",
                       {"from pallas_kernels.topk import triton as topk_impl":
                        "import topk_triton_78be51b as topk_impl",
                        "from pallas_kernels.topk.triton import count_at_least, eligible_keys":
                        "from topk_triton_78be51b import count_at_least, eligible_keys"})
        return topk_old, pq_old
    except Exception as err:  # the package moved on: report, time the rest
        return err, err


# ------------------------------------------------------------------------------ cases


def topk_call(old):
    from pallas_kernels.topk import topk
    from pallas_kernels.topk.triton import topk_triton

    k = TOPK["k"]

    def call(impl, scores, lengths):
        if impl == "triton_old":
            if isinstance(old, Exception):
                raise old
            return old.topk_triton(scores, lengths, k, interpret=INTERPRET)
        if impl.startswith("triton_oneread"):
            return topk_triton(scores, lengths, k, interpret=INTERPRET, one_read=True,
                               sample=ONE_READ_SAMPLE[impl])
        return topk(scores, lengths, k, implementation=impl)

    return call


def pq_call(old):
    from pallas_kernels.pq_topc import pq_topc
    from pallas_kernels.pq_topc import triton as pq_triton

    c = PQ["c"]

    def call(impl, *args):
        if impl == "triton_old":
            if isinstance(old, Exception):
                raise old
            return old.pq_topc_triton(*args, num_candidates=c, interpret=INTERPRET)
        if impl == "triton_unfused":
            return pq_triton.pq_topc_triton(*args, num_candidates=c, fused=False,
                                            interpret=INTERPRET)
        return pq_topc(*args, num_candidates=c, implementation=impl)

    return call


def topk_tie_inputs():
    """Integer scores (heavy ties), NaN past the lengths, lengths 0, 1, k - 1, k, k + 1, ..."""
    b, n, k = TOPK["b"], TOPK["n"], TOPK["k"]
    rng = np.random.default_rng(16)
    lengths = np.full((b,), n, np.int32)
    lengths[:8] = [0, 1, k - 1, k, k + 1, min(5000, n - 2), n // 2, n - 1]
    scores = rng.integers(0, 50, size=(b, n)).astype(np.float32)
    scores[np.arange(n)[None, :] >= lengths[:, None]] = np.nan
    return jnp.asarray(scores), jnp.asarray(lengths)


def pq_exact_inputs():
    """Small-integer q and codebooks, dyadic weights: bf16 scores equal f32 ones exactly."""
    p = PQ
    rng = np.random.default_rng(17)
    q = rng.integers(-1, 2, (p["b"], p["h"], p["d"])).astype(np.float32)
    w = (rng.integers(-2, 5, (p["b"], p["h"])) / 4).astype(np.float32)
    books = rng.integers(-1, 2, (p["m"], p["centroids"], p["d"] // p["m"])).astype(np.float32)
    codes = rng.integers(0, p["centroids"], (p["b"], p["n"], p["m"])).astype(np.uint8)
    lengths = np.full((p["b"],), p["n"], np.int32)
    lengths[:6] = [0, 1, p["c"] - 1, p["c"], p["c"] + 1, p["n"] // 2]
    return tuple(map(jnp.asarray, (q, w, codes, books, lengths)))


def _sets(pos):
    pos = np.asarray(pos)
    return [frozenset(row[row >= 0].tolist()) for row in pos]


def one_read_fraction(impl, scores, lengths) -> float:
    """Fraction of rows the one-read pass finished (the others take the fallback)."""
    from pallas_kernels.topk import triton as topk_impl

    cfg = topk_impl.config(scores.shape[1], TOPK["k"], interpret=INTERPRET, one_read=True,
                           sample=ONE_READ_SAMPLE[impl])
    length, m = topk_impl.row_lengths(lengths, cfg)
    fn = jax.jit(topk_impl.one_read_select, static_argnames="cfg")
    return float(np.mean(np.asarray(fn(scores, length, m, cfg=cfg)[0])))


def set_agreement(got, want) -> tuple[float, float]:
    """(fraction of rows with equal sets, mean overlap |got & want| / |want|)."""
    g, w = _sets(got[0]), _sets(want[0])
    equal = np.mean([a == b for a, b in zip(g, w)])
    overlap = np.mean([len(a & b) / max(len(b), 1) for a, b in zip(g, w)])
    return float(equal), float(overlap)


# ----------------------------------------------------------------------------- timing


def _timer():
    """experiments.kernel_compare.time_case when importable, else a per-call fallback on
    benchmarks/timing.median_time (same arguments)."""
    try:
        from experiments.kernel_compare import time_case

        return time_case
    except Exception as err:  # gin / tqdm missing on this machine
        print(f"kernel_compare timing unavailable ({type(err).__name__}: {err}); "
              "using benchmarks/timing.median_time per call")
        from timing import median_time

        def time_case(case, impl, repeats, warmup=2):
            args = case.make(jax.random.key(0))
            fn = jax.jit(lambda *a: case.call(impl, *a))
            return median_time(fn, lambda: args, repeats=repeats, warmup=warmup)

        return time_case


def launch_sequence(fn, args) -> list[str]:
    """The Pallas-Triton kernels of one call in program order, as "name[grid]" (empty in
    interpret mode, where kernels become plain HLO)."""
    from pallas_kernels import common

    try:
        text = fn.lower(*args).as_text()
    except Exception as err:
        return [f"unavailable: {type(err).__name__}"]
    out = []
    for line in text.splitlines():
        if common.TRITON_CALL_TARGET in line:
            name = re.findall(r'name = "([^"]+)"', line)
            grid = [re.findall(rf"grid_{a} = (\d+)", line) for a in "xyz"]
            out.append(f"{name[0] if name else '?'}[{','.join(g[0] for g in grid if g)}]")
    return out


def dispatch_seconds(fn, args, calls=8, repeats=3) -> tuple[float, float]:
    """(host seconds to dispatch one call without waiting, seconds per call of ``calls``
    back-to-back dispatched calls with one sync at the end), medians over repeats; fn warm."""
    host, total = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        t1 = time.perf_counter()
        jax.block_until_ready(outs)
        host.append((t1 - t0) / calls)
        total.append((time.perf_counter() - t0) / calls)
    return float(np.median(host)), float(np.median(total))


@dataclasses.dataclass
class Case:
    """Just what ``time_case`` reads: make (key -> args) and call (impl, *args)."""

    make: callable
    call: callable


def run(out: pathlib.Path, repeats: int, budget: float):
    global INTERPRET
    from pallas_kernels import common

    INTERPRET = common.interpret()
    start = time.perf_counter()
    time_case = _timer()
    topk_old, pq_old = old_modules()
    if isinstance(topk_old, Exception):
        print(f"triton_old unavailable: {type(topk_old).__name__}: {topk_old}")

    b, n = TOPK["b"], TOPK["n"]
    p = PQ

    def topk_make(key):
        return jax.random.normal(key, (b, n), jnp.float32), jnp.full((b,), n, jnp.int32)

    def pq_make(key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        return (jax.random.normal(k1, (p["b"], p["h"], p["d"]), jnp.float32),
                jax.random.normal(k2, (p["b"], p["h"]), jnp.float32),
                jax.random.randint(k3, (p["b"], p["n"], p["m"]), 0, p["centroids"],
                                   jnp.int32).astype(jnp.uint8),
                jax.random.normal(k4, (p["m"], p["centroids"], p["d"] // p["m"]), jnp.float32),
                jnp.full((p["b"],), p["n"], jnp.int32))

    ops = [
        dict(op="topk", shape=f"B={b},N={n},k={TOPK['k']}",
             case=Case(topk_make, topk_call(topk_old)),
             impls=("xla", "triton", "triton_oneread", "triton_old") + TOPK_EXTRA,
             roof_bytes=4.0 * b * n, check=topk_tie_inputs),
        dict(op="pq_topc", shape=f"B={p['b']},N={p['n']},C={p['c']}",
             case=Case(pq_make, pq_call(pq_old)),
             impls=("xla", "triton", "triton_old", "triton_unfused"),
             roof_bytes=float(p["b"] * p["n"] * p["m"] + p["b"] * p["h"] * p["d"] * 4),
             check=pq_exact_inputs),
    ]
    # Priority order, so that a budget overrun skips the least important variants: XLA and
    # the new path of each op first, then the rest. Each op's XLA row comes before its others
    # (the set checks compare with it).
    first = [(spec, impl) for spec in ops for impl in spec["impls"][:2]]
    order = first + [(spec, impl) for spec in ops for impl in spec["impls"][2:]]
    state = {spec["op"]: dict(args=spec["case"].make(jax.random.key(0))) for spec in ops}
    nominal = [(spec["op"], impl) for spec in ops for impl in spec["impls"]]  # table order
    rows, compiled = [], []
    for spec, impl in order:
        case, op, st = spec["case"], spec["op"], state[spec["op"]]
        args = st["args"]
        row = dict(op=op, impl=impl, shape=spec["shape"],
                   roofline_ms=1e3 * spec["roof_bytes"] / HBM_BYTES_PER_S)
        rows.append(row)
        rows.sort(key=lambda r: nominal.index((r["op"], r["impl"])))
        if time.perf_counter() - start > budget:
            row["error"] = f"skipped: over the {budget:.0f} s budget"
            continue
        try:
            fn = jax.jit(lambda *a, c=case, i=impl: c.call(i, *a))
            got = jax.block_until_ready(fn(*args))
            if "check_args" not in st:
                st["check_args"] = spec["check"]()
            check_args = st["check_args"]
            got_check = jax.block_until_ready(fn(*check_args))
            if impl == "xla":
                st["ref"], st["ref_check"] = got, got_check
            elif "ref" in st:
                row["sets_equal_timing_inputs"], row["overlap_timing_inputs"] = \
                    set_agreement(got, st["ref"])
                row["sets_equal_check_inputs"], _ = set_agreement(got_check, st["ref_check"])
            if impl.startswith("triton_oneread"):
                row["one_read_rows"] = one_read_fraction(impl, *args)
                row["one_read_rows_check"] = one_read_fraction(impl, *check_args)
            if impl != "xla":
                row["kernels"] = launch_sequence(fn, args)
            host, per_call = dispatch_seconds(fn, args)
            row["host_ms"], row["call_ms"] = 1e3 * host, 1e3 * per_call
            compiled.append((f"{op}/{impl}", fn, args))
            row["ms"] = 1e3 * time_case(case, impl, repeats)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:400]
            row["trace"] = traceback.format_exc(limit=3)[-1200:]
            print(f"{op}/{impl} failed:\n{row['trace']}")
        print(f"{op}/{impl}: done at {time.perf_counter() - start:.0f} s")
        for r in rows:  # ratios to the XLA row of the same op
            xla = next((x for x in rows if x["op"] == r["op"] and x["impl"] == "xla"
                        and "ms" in x), None)
            if "ms" in r:
                r["speedup_vs_xla"] = xla["ms"] / r["ms"] if xla else None
                r["fraction_of_roofline"] = r["roofline_ms"] / r["ms"]
        write(out, rows, repeats, start, partial=True)  # kept if a later step is killed

    trace_dir = out / "trace"
    try:
        profile(trace_dir, [c for c in compiled if not c[0].endswith("/xla")])
    except Exception as err:
        print(f"profile failed: {type(err).__name__}: {err}")

    print(write(out, rows, repeats, start, partial=False))
    print(f"wrote {out}/topk_nosync_gpu.json, topk_nosync_gpu.txt and {trace_dir}/")


def write(out: pathlib.Path, rows, repeats: int, start: float, partial: bool) -> str:
    """Writes the table and the JSON (rows so far when partial); returns the table."""
    table = format_table(rows)
    (out / "topk_nosync_gpu.txt").write_text(table + "\n")
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  hbm_bytes_per_s=HBM_BYTES_PER_S, repeats=repeats, partial=partial,
                  seconds_total=time.perf_counter() - start, trace_dir=str(out / "trace"),
                  rows=rows, table=table)
    (out / "topk_nosync_gpu.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return table


def profile(trace_dir: pathlib.Path, compiled):
    """A jax.profiler trace of 3 back-to-back calls of each (warm) Triton variant."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(trace_dir)):
        for name, fn, args in compiled:
            with jax.profiler.TraceAnnotation(name):
                jax.block_until_ready([fn(*args) for _ in range(3)])


def format_table(rows) -> str:
    head = (f"{'op':8s} {'impl':20s} {'ms':>8s} {'call_ms':>8s} {'host_ms':>8s} "
            f"{'xXLA':>6s} {'%roof':>6s} {'sets':>5s} {'ovl':>5s} {'sets*':>5s} {'1read':>5s}")
    lines = [head, "-" * len(head)]
    fmt = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"  # noqa: E731
    for r in rows:
        if "ms" not in r:
            lines.append(f"{r['op']:8s} {r['impl']:20s} {'n/a':>8s}  {r.get('error', '')[:70]}")
            continue
        lines.append(
            f"{r['op']:8s} {r['impl']:20s} {r['ms']:8.3f} {r['call_ms']:8.3f} "
            f"{r['host_ms']:8.3f} {fmt(r.get('speedup_vs_xla'), '6.2f'):>6s} "
            f"{100 * r['fraction_of_roofline']:6.1f} "
            f"{fmt(r.get('sets_equal_timing_inputs'), '5.2f'):>5s} "
            f"{fmt(r.get('overlap_timing_inputs'), '5.3f'):>5s} "
            f"{fmt(r.get('sets_equal_check_inputs'), '5.2f'):>5s} "
            f"{fmt(r.get('one_read_rows'), '5.2f'):>5s}")
    for r in rows:
        if r.get("kernels"):
            lines.append(f"{r['op']}/{r['impl']} launches: {' '.join(r['kernels'])}")
    lines.append("ms: batched over R input sets; call_ms: 8 dispatched calls / 8; host_ms: "
                 "host dispatch time of one call; xXLA: XLA ms / ms; %roof: 3.0 TB/s reading the "
                 "input once / ms; sets / ovl: rows with the XLA set / mean overlap on the timing "
                 "inputs; sets*: rows with the XLA set on the tie / exact inputs; 1read: rows the "
                 "one-read pass finished")
    return "\n".join(lines)


def main():
    global TOPK_EXTRA, BASELINE_DIR
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/topk_nosync_gpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget", type=float, default=140.0,
                        help="seconds after which remaining variants are skipped")
    parser.add_argument("--extra", action="store_true",
                        help="also time topk one_read with the default 1024-position sample")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes: a CPU smoke run of the script, not a benchmark")
    parser.add_argument("--baseline-dir", default=None,
                        help=f"folder with topk/pq_topc triton.py as of {BASELINE} (default: "
                        "read from git)")
    args = parser.parse_args()
    BASELINE_DIR = pathlib.Path(args.baseline_dir) if args.baseline_dir else None
    if args.extra:
        TOPK_EXTRA = ("triton_oneread_s1024",)
    if args.small:
        TOPK.update(SMALL_TOPK)
        PQ.update(SMALL_PQ)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run(out, args.repeats, args.budget)


if __name__ == "__main__":
    main()
