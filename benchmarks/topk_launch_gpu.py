"""Issue 16, topk: launches, not bandwidth. lax.top_k, the current "triton" default and the
two-launch "triton_fused" (pallas_kernels/topk/fused.py) timed per call, with the GPU's view of
a call (kernels, busy time, span) and under XLA command-buffer (CUDA graph) settings.

Run on the GPU machine (jax 0.11.2 or newer, triton), from the repository root:
    PYTHONPATH=$PWD python3 benchmarks/topk_launch_gpu.py --out DIR --budget-s 300
CPU smoke run of the script (tiny shapes, Pallas interpret mode; not a benchmark):
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python3 benchmarks/topk_launch_gpu.py --smoke --out DIR

Shapes (B, N, k), full-length rows of normal scores: (64, 262144, 2048) the issue-16 target
(<= 0.050 ms), (64, 131072, 2048), (64, 32768, 512) the decode step's.
Per (shape, variant):
  call_ms   median of >= 20 single jitted calls after warm-up, each waited for
            (block_until_ready): what one dispatch costs, host launch included;
  batch_ms  one jitted program of 8 back-to-back calls on 8 distinct inputs, / 8 (median of
            10): the device-side cost of a call inside a larger program;
  sets      whether every row's index set equals lax.top_k's (checked before timing);
  fast      (fused variants) fraction of rows finished from the candidates (the rest took the
            in-kernel whole-row scan);
  kernels / busy_us / span_us  per call, from a jax.profiler trace of the 8-call program:
            GPU kernels (memsets left out), their summed time, and first start to last end
            divided by 8 (span - busy = gaps between launches).
Variants: lax_top_k (lax.top_k, no lengths), triton (api default: one read, 4096 sample,
register finish), triton_fused (api, fused.py defaults), and fused.py tunables to choose its
defaults from: thr_kernel (the sample search in its own grid (B,) launch, 3 launches),
b8192 / b32768 (programs per row), fb32 (full 32-bit floor search), s1024 (smaller sample),
floor (a per-row hint: the row's 1.125 k-th score, as the previous decode step would give).
Command buffers: the target shape's triton and triton_fused timed again in child processes
under XLA_FLAGS settings (CMD_BUFFER below; jax 0.11's XLA records FUSION, CUBLAS, CUBLASLT,
CUSTOM_CALL, CUDNN by default but only regions of >= 5 thunks, xla_gpu_graph_min_graph_size):
a flag the child's XLA does not know makes it exit, and the row shows that child's error.

Order: the three variants at every shape, the command-buffer children, the fused sweep; work
stops at --budget-s (rows left show "skipped: budget"; a child running then is given up to
240 s). Compilation dominates: expect ~5-8 minutes for everything on an H200.
Writes DIR/topk_launch_gpu.json after every row and DIR/topk_launch_gpu.txt (the tables,
printed last).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

# Parent and command-buffer children share the GPU: neither takes 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from timing import median_time  # noqa: E402  (benchmarks/timing.py)
from traces import gpu_events, per_call  # noqa: E402  (benchmarks/traces.py)

from pallas_kernels.common import on_gpu  # noqa: E402

SHAPES = [dict(b=64, n=262144, k=2048), dict(b=64, n=131072, k=2048),
          dict(b=64, n=32768, k=512)]
SMOKE_SHAPES = [dict(b=4, n=4096, k=64), dict(b=3, n=3000, k=24)]
CORE = ("lax_top_k", "triton", "triton_fused")
SWEEP = ("thr_kernel", "b8192", "b32768", "fb32", "s1024", "floor")
FUSED_TUNABLES = {"thr_kernel": dict(threshold_kernel=True), "b8192": dict(block=8192),
                  "b32768": dict(block=32768), "fb32": dict(floor_bits=32),
                  "s1024": dict(sample=1024), "floor": {},
                  # --sweep only (session 16): select / finish warps, select chunk and block
                  "sw4": dict(select_warps=4), "sw16": dict(select_warps=16),
                  "fw4": dict(finish_warps=4), "fw16": dict(finish_warps=16),
                  "c1024": dict(chunk=1024), "c2048": dict(chunk=2048),
                  "b8192c2048": dict(block=8192, chunk=2048),
                  "b4096c1024sw4": dict(block=4096, chunk=1024, select_warps=4),
                  # --sweep only (session 17): the select chunk's prefix count in row scans
                  "r8": dict(scan_rows=8), "r32": dict(scan_rows=32),
                  "r128": dict(scan_rows=128),
                  # session 18: 32 row scans became the default; r1 is the one scan before
                  "r1": dict(scan_rows=1)}
CMD_BUFFER = {  # name -> XLA_FLAGS added in the child process
    "default": "",
    "off": "--xla_gpu_enable_command_buffer=",
    "min1": "--xla_gpu_graph_min_graph_size=1",
    "fusion_cc_min1": ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                       "--xla_gpu_graph_min_graph_size=1"),
}
CALLS = 8  # back-to-back calls in the batched program


def variant_fn(name: str, k: int):
    """fn(scores, lengths, floor) -> positions [B, k] of one variant."""
    from pallas_kernels.topk import fused, topk

    if name == "lax_top_k":
        return lambda s, n, f: jax.lax.top_k(s, k)[1]
    if name in ("triton", "triton_fused", "xla"):
        return lambda s, n, f: topk(s, n, k, implementation=name)[0]
    tun = FUSED_TUNABLES[name]
    interpret = not on_gpu()
    return lambda s, n, f: fused.topk_fused(s, n, k, interpret=interpret,
                                            floor=f if name == "floor" else None, **tun)[0]


def inputs(shape, count, seed=0):
    """count distinct score sets [B, N] f32 (normal), full lengths [B], and floor hints [B]
    for each: the row's ceil(1.125 k)-th score (below its k-th)."""
    b, n, k = shape["b"], shape["n"], shape["k"]
    keys = jax.random.split(jax.random.PRNGKey(seed), count)
    scores = [jax.random.normal(key, (b, n), jnp.float32) for key in keys]
    lengths = jnp.full((b,), n, jnp.int32)
    r = min(n, -(-9 * k // 8))
    floors = [jax.lax.top_k(s, r)[0][:, r - 1] for s in scores]
    return jax.block_until_ready((scores, lengths, floors))


def sets_equal(pos, want) -> bool:
    pos, want = np.sort(np.asarray(pos), 1), np.sort(np.asarray(want), 1)
    return bool(np.array_equal(pos, want))


def profile(program, args, calls):
    """Per call: kernels, busy_us, span_us, device-to-host copies, the largest kernels."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(program(*args))
        ev = gpu_events(pathlib.Path(tmp))
    got = per_call(ev, calls)
    if not got:
        return dict(kernels=None)
    d2h = sum("DtoH" in e[0] or "Device -> Host" in e[0] for e in ev)
    top = dict(sorted(got.pop("by_name").items(), key=lambda kv: -kv[1])[:6])
    return dict(got, device_to_host=d2h, top=top)


def measure(name, shape, data, repeats, check=True, trace=True):
    """One row: sets check, single-call and batched timings, profile."""
    scores, lengths, floors = data
    k = shape["k"]
    fn = variant_fn(name, k)
    one = jax.jit(fn)
    row = dict(variant=name, **shape)
    if check:
        want = jax.lax.top_k(scores[0], k)[1]
        row["sets_equal"] = sets_equal(one(scores[0], lengths, floors[0]), want)
        if name.startswith("triton_fused") or name in FUSED_TUNABLES:
            from pallas_kernels.topk import fused

            tun = {} if name == "triton_fused" else FUSED_TUNABLES[name]
            fast = fused.fast_rows(scores[0], lengths, k, interpret=not on_gpu(),
                                   floor=floors[0] if name == "floor" else None, **tun)
            row["fast"] = float(np.mean(np.asarray(fast)))
    row["call_ms"] = median_time(one, lambda: (scores[0], lengths, floors[0]), repeats) * 1e3
    batch = jax.jit(lambda ss, n, ff: [fn(s, n, f) for s, f in zip(ss, ff)])
    args = (tuple(scores[:CALLS]), lengths, tuple(floors[:CALLS]))
    row["batch_ms"] = median_time(batch, lambda: args, max(3, repeats // 2)) * 1e3 / CALLS
    if trace and on_gpu():
        try:
            row.update(profile(batch, args, CALLS))
        except Exception as err:  # a profiler problem must not cost the timings
            row["profile_error"] = repr(err)[:300]
    return row


# ------------------------------------------------------------------------ child processes


def child_main(a):
    """Times the given variants at one shape under this process's XLA_FLAGS; prints RESULT."""
    shape = (SMOKE_SHAPES if a.smoke else SHAPES)[a.shape_index]
    data = inputs(shape, CALLS)
    rows = []
    for name in a.variants.split(","):
        try:
            rows.append(measure(name, shape, data, a.repeats, check=False))
        except Exception:
            rows.append(dict(variant=name, error=traceback.format_exc(limit=2)[-600:]))
    print("RESULT " + json.dumps(rows), flush=True)


def cmd_buffer_rows(setting, flags, a, timeout):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--shape-index", "0",
           "--variants", "triton,triton_fused", "--repeats", str(a.repeats)]
    cmd += ["--smoke"] if a.smoke else []
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [dict(setting=setting, xla_flags=flags, error=f"timeout after {timeout:.0f} s")]
    for line in done.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return [dict(setting=setting, xla_flags=flags, **r) for r in json.loads(line[7:])]
    tail = (done.stderr or done.stdout)[-800:]
    return [dict(setting=setting, xla_flags=flags, error=f"exit {done.returncode}: {tail}")]


# ------------------------------------------------------------------------------ main


def table(rows, keys):
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4f}" if v < 10 else f"{v:.1f}"
        return "" if v is None else str(v)

    lines = [" | ".join(keys)]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(" | ".join(fmt(r.get(c)) for c in keys[:3]) + " | "
                         + (r.get("skipped") or r["error"].strip().splitlines()[-1][:150]))
        else:
            lines.append(" | ".join(fmt(r.get(c)) for c in keys))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/topk_launch_gpu"))
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape-index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--variants", default="", help=argparse.SUPPRESS)
    ap.add_argument("--sweep", default="", help="comma-separated FUSED_TUNABLES names: time "
                    "only triton_fused and these at the first shape (no core table, no "
                    "command-buffer children)")
    a = ap.parse_args()
    if a.smoke:
        a.repeats = min(a.repeats, 3)
    if a.child:
        return child_main(a)
    start = time.monotonic()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    meta = dict(jax=jax.__version__, backend=jax.default_backend(),
                device=str(jax.devices()[0].device_kind), smoke=a.smoke,
                xla_flags=os.environ.get("XLA_FLAGS", ""), budget_s=a.budget_s)
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:
        meta["triton"] = None
    from pallas_kernels.topk import fused

    meta["fused_config"] = {f"{s['n']}/{s['k']}": repr(fused.fused_config(
        s["n"], s["k"], interpret=not on_gpu())) for s in shapes}
    rows, cmd_rows = [], []

    def left():
        return a.budget_s - (time.monotonic() - start)

    def save():
        (out / "topk_launch_gpu.json").write_text(json.dumps(
            dict(meta=meta, rows=rows, command_buffers=cmd_rows,
                 seconds=time.monotonic() - start), indent=1))

    data = {}

    def run_rows(index, names):
        shape = shapes[index]
        for name in names:
            if left() <= 0:
                rows.append(dict(variant=name, **shape, skipped="skipped: budget"))
                continue
            if index not in data:
                data.clear()  # one shape's inputs on the device at a time
                data[index] = inputs(shape, CALLS)
            t0 = time.monotonic()
            try:
                row = measure(name, shape, data[index], a.repeats)
            except Exception:
                row = dict(variant=name, **shape, error=traceback.format_exc(limit=3)[-800:])
            row["wall_s"] = round(time.monotonic() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()

    if a.sweep:
        names = a.sweep.split(",")
        unknown = [n for n in names if n not in FUSED_TUNABLES]
        if unknown:
            raise SystemExit(f"--sweep: unknown {unknown}; known {sorted(FUSED_TUNABLES)}")
        run_rows(0, ["triton_fused"] + names)
    for index in range(0 if a.sweep else len(shapes)):
        run_rows(index, CORE)
    data.clear()
    for setting, flags in ({} if a.sweep else CMD_BUFFER).items():  # children need the memory
        if left() <= 0:
            cmd_rows.append(dict(setting=setting, xla_flags=flags, skipped="skipped: budget"))
            continue
        got = cmd_buffer_rows(setting, flags, a, timeout=min(240.0, max(30.0, left())))
        cmd_rows.extend(got)
        print(json.dumps(got), flush=True)
        save()
    if not a.sweep:
        run_rows(0, SWEEP)
        run_rows(len(shapes) - 1, ("floor", "thr_kernel", "s1024"))
    save()
    keys = ["n", "k", "variant", "call_ms", "batch_ms", "sets_equal", "fast", "kernels",
            "busy_us", "span_us", "device_to_host"]
    text = (f"topk launches ({meta['device']}, jax {meta['jax']}, triton {meta['triton']}; "
            f"B = {shapes[0]['b']}; ms per call)\n" + table(rows, keys)
            + "\n\ncommand buffers (child processes, first shape)\n"
            + table(cmd_rows, ["setting", "xla_flags", "variant", "call_ms", "batch_ms",
                               "kernels", "busy_us", "span_us"])
            + f"\n\n{time.monotonic() - start:.0f} s; {out}/topk_launch_gpu.json")
    (out / "topk_launch_gpu.txt").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
