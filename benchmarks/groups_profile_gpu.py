"""LeanSparse request groups on the GPU: what overlap XLA gives (issue 13, deliver 4).

One bounded call: per XLA flag setting ("default"; "lhs" = the latency-hiding scheduler,
``--xla_gpu_enable_latency_hiding_scheduler=true``, with the stream annotation forced on,
``--xla_gpu_experimental_stream_annotation=true``; "nocb" = "lhs" with XLA's command buffers
(CUDA graphs) off, ``--xla_gpu_enable_command_buffer=``: session 21 saw every kernel of g2
on one stream under "default" and "lhs", and a graph replays its nodes on the stream it is
launched on) a child process runs leansparse at one
context and batch as variants g1 (groups=1, today's step), g2 (2 groups, each group's key
fetch an async call on GPU stream 1), g2_main (2 groups, fetch on the main stream) and, if
asked, g4 (--variants).
Per variant: the decode step's wall time (mean of --steps after --warm), then
  - the schedule XLA compiled (``decode_step`` lowered and compiled again, a cache hit with
    JAX_COMPILATION_CACHE_DIR): how many async calls (``call-start``) the step has and how
    many instructions XLA placed between each start and its done (0 = nothing can overlap);
  - a profile of 3 steps (jax.profiler): the GPU streams that ran kernels, kernel time off
    the main stream (the fetches), how much of it overlapped kernels on the main stream, and
    how much overlapped the coarse pass (kernels named pq_*), per step; and, whatever stream
    the trace names, ``concurrent_us``: summed kernel time minus the union of kernel
    intervals (the time two kernels ran at once; 0 = strictly one after another).
Writes groups_profile.json under --out as it goes (one record per variant and flag setting)
and prints a table last. The prefill is cached in --prefill-cache (shared with the scale
study's cache), so the second child and later calls skip it.

GPU (H200, ~240 s at the defaults: ~40 s a variant, 5 variants, two children):
    python3 benchmarks/groups_profile_gpu.py --out $OUT/groups --budget-s 240
CPU check of the whole flow (tiny model, no GPU streams in the profile: overlap fields null):
    JAX_PLATFORMS=cpu python benchmarks/groups_profile_gpu.py --quick --out /tmp/gp
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

VARIANTS = {"g1": (1, None), "g2": (2, 1), "g2_main": (2, None), "g4": (4, 1)}
LHS = ("--xla_gpu_enable_latency_hiding_scheduler=true "
       "--xla_gpu_experimental_stream_annotation=true")
FLAGS = {"default": "", "lhs": LHS, "nocb": LHS + " --xla_gpu_enable_command_buffer="}


# ------------------------------------------------------------------------- what XLA compiled
def async_calls(hlo: str) -> list[dict]:
    """Async calls in the entry computation of scheduled HLO text: for each ``call-start``,
    the instructions XLA scheduled between it and its ``call-done`` (the window in which
    main-stream work may run beside the call)."""
    entry = hlo[hlo.index("\nENTRY"):] if "\nENTRY" in hlo else hlo
    lines = [ln.strip() for ln in entry.splitlines() if " = " in ln]
    names = [ln.split(" = ")[0].replace("ROOT ", "").lstrip("%") for ln in lines]
    out = []
    for i, ln in enumerate(lines):
        if re.search(r"\bcall-start\(", ln):
            start = names[i]
            done = next((j for j in range(i + 1, len(lines))
                         if re.search(r"\bcall-done\(", lines[j]) and
                         re.search(rf"%?{re.escape(start)}(?![\w.])",
                                   lines[j].split("call-done(")[1])),
                        None)
            between = lines[i + 1:done] if done is not None else []
            out.append({"start": start, "between": len(between),
                        "between_kernels": sum("fusion(" in b or "custom-call(" in b
                                               for b in between)})
    return out


# -------------------------------------------------------------------------- what the GPU ran
def _union(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _overlap(xs, ys) -> float:
    """Length of the intersection of two sorted lists of disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def stream_overlap(trace_file: pathlib.Path, steps: int) -> dict:
    """Per-step GPU figures of a Perfetto trace (us): kernel time per stream, busy time, and
    the time kernels off the main stream (the one with most kernel time) overlapped main-stream
    kernels and main-stream pq_* kernels (the coarse pass), and ``concurrent_us``, summed
    kernel time minus busy time (any two kernels at once, on whatever streams). None fields:
    no GPU in the trace."""
    data = json.load(gzip.open(trace_file))
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {p for p, n in procs.items() if "/device:GPU" in n}
    kernels: dict[str, list] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu:
            continue
        stream = threads.get((e["pid"], e["tid"]), str(e["tid"]))
        if "Memcpy" in stream and "Compute" not in stream:
            continue  # host<->device copies of the step's inputs/outputs
        kernels.setdefault(stream, []).append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    if not kernels:
        return {"streams": {}, "busy_us": None, "side_us": None, "side_overlap_us": None,
                "side_overlap_coarse_us": None, "concurrent_us": None}
    per = {s: sum(b - a for a, b, _ in ks) / steps for s, ks in kernels.items()}
    main = max(per, key=per.get)
    side = _union([(a, b) for s, ks in kernels.items() if s != main for a, b, _ in ks])
    main_all = _union([(a, b) for a, b, _ in kernels[main]])
    coarse = _union([(a, b) for a, b, n in kernels[main] if n.startswith("pq_")])
    names = sorted({n for s, ks in kernels.items() if s != main for _, _, n in ks})
    busy = sum(b - a for a, b in _union([(a, b) for ks in kernels.values()
                                         for a, b, _ in ks])) / steps
    return {"streams": {s: round(v, 1) for s, v in per.items()}, "main_stream": main,
            "busy_us": busy, "concurrent_us": sum(per.values()) - busy,
            "side_us": sum(b - a for a, b in side) / steps,
            "side_overlap_us": _overlap(side, main_all) / steps,
            "side_overlap_coarse_us": _overlap(side, coarse) / steps,
            "side_kernels": names[:12]}


# -------------------------------------------------------------------------------- one child
def child(args) -> None:
    import jax
    import jax.numpy as jnp

    from experiments.common import fit_max_len, timed_steps
    from experiments.scale import cached_prefill, prefill_cache_dir
    from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig, SamplingConfig
    from lsparse_jax.methods.leansparse import calibrate_codebooks
    from lsparse_jax.model import init_params, preset
    from lsparse_jax.serving.engine import Engine
    from lsparse_jax.serving.request import Request
    from lsparse_jax.serving.steps import decode_step

    started = time.perf_counter()
    out = pathlib.Path(args.out)
    if args.quick:
        base = preset("tiny", layer_pattern=("swa", "csa", "hca", "csa"), hca_ratio=16)
        shapes = dict(chunk=128, hot=32, page=8, lean=(32, 1.0, 48), impl="xla", calib=256)
    else:
        base = preset("v4_flash", layer_pattern=("swa", "csa", "hca", "csa"),
                      matmul_precision="bf16")
        shapes = dict(chunk=4096, hot=4096, page=64, lean=(2048, 1.0, 4096), impl="triton",
                      calib=4096)
    steps, warm = args.steps, args.warm
    cfg = fit_max_len(base, args.context + warm + steps + 8)
    params = init_params(cfg, 0)
    prompt = np.random.default_rng(args.context).integers(0, 256, args.context).astype(np.int32)
    pre, prefill_s = cached_prefill(params, cfg, prompt, shapes["chunk"], prefill_cache_dir(
        args.prefill_cache, cfg, 0, args.context, shapes["chunk"]))
    books = calibrate_codebooks(params, cfg, prompt[:shapes["calib"]], iters=8)
    for name in args.variants.split(","):
        if time.perf_counter() - started > args.budget_s:
            print(f"[{args.flags}] budget spent; {name} and later variants not run", flush=True)
            break
        groups, stream = VARIANTS[name]
        rec = {"variant": name, "flags": args.flags, "groups": groups, "fetch_stream": stream,
               "context": args.context, "batch": args.batch, "prefill_s": prefill_s}
        try:
            engine = EngineConfig(
                model=cfg, cache=CacheConfig(args.batch, shapes["chunk"], shapes["hot"],
                                             shapes["page"]),
                sampling=SamplingConfig(0.0, 0), method="leansparse",
                leansparse=LeanSparseConfig(*shapes["lean"], groups=groups,
                                            fetch_stream=stream),
                implementation=shapes["impl"])
            eng = Engine(engine, params, books)
            t0 = time.perf_counter()
            eng.warmup()
            rec["warmup_s"] = time.perf_counter() - t0
            for _ in range(args.batch):
                eng.admit(Request(prompt, max_new_tokens=warm + steps + 6), prefilled=pre)
            rec["step_ms"] = timed_steps(eng, warm, steps)
            hlo = decode_step.lower(eng.params, eng.config, eng.state,
                                    jnp.asarray(eng.next_token),
                                    jnp.asarray(eng.active)).compile().as_text()
            calls = async_calls(hlo)
            rec["async_calls"] = len(calls)
            rec["between_per_call"] = [c["between"] for c in calls]
            rec["between_kernels_per_call"] = [c["between_kernels"] for c in calls]
            with tempfile.TemporaryDirectory() as tmp:
                with jax.profiler.trace(tmp, create_perfetto_trace=True):
                    for _ in range(3):
                        eng.step()
                    jax.block_until_ready(eng.state)
                found = sorted(pathlib.Path(tmp).rglob("*.trace.json.gz"))
                rec.update(stream_overlap(found[0], 3) if found else {"trace": "none"})
            rec["tokens"] = [list(map(int, t)) for t in eng.generated if t][:2]
            del eng
        except Exception as err:  # noqa: BLE001  (recorded; the next variant runs)
            rec["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        with open(out / "groups_profile.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps({k: rec.get(k) for k in ("flags", "variant", "step_ms", "async_calls",
                                                  "side_us", "side_overlap_us", "error")}),
              flush=True)


# ------------------------------------------------------------------------------- the parent
def table(records) -> str:
    rows = ["| flags | variant | step ms | async calls | instrs between start/done | "
            "side-stream kernels us/step | overlapped us | of it with pq_* | GPU busy us | "
            "concurrent us | tokens = g1 |", "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    fmt = lambda v: "" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in records:
        if "error" in r:
            rows.append(f"| {r['flags']} | {r['variant']} | error: {r['error'][:80]} |")
            continue
        between = r.get("between_per_call") or []
        rows.append("| " + " | ".join(fmt(v) for v in (
            r["flags"], r["variant"], r.get("step_ms"), r.get("async_calls"),
            f"{min(between)}-{max(between)}" if between else "-", r.get("side_us"),
            r.get("side_overlap_us"), r.get("side_overlap_coarse_us"), r.get("busy_us"),
            r.get("concurrent_us"), r.get("same_tokens_as_g1"))) + " |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--variants", default="g1,g2,g2_main", help=f"of {list(VARIANTS)}")
    ap.add_argument("--lhs-variants", default="g2,g1", help="variants also run with the "
                    "latency-hiding scheduler ('' = none)")
    ap.add_argument("--nocb-variants", default="", help="variants also run with the "
                    "latency-hiding scheduler and command buffers off (e.g. 'g2,g1')")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=230.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "results/groups_profile"))
    ap.add_argument("--prefill-cache", default="/tmp/lsparse_scale_prefill")
    ap.add_argument("--quick", action="store_true", help="tiny model (a CPU check)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--flags", default="default", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.context = args.context or (256 if args.quick else 131072)
    args.batch = args.batch or (4 if args.quick else 16)
    if args.child:
        child(args)
        return 0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "groups_profile.jsonl"
    log.unlink(missing_ok=True)
    started = time.perf_counter()
    for flags, variants in (("default", args.variants), ("lhs", args.lhs_variants),
                            ("nocb", args.nocb_variants)):
        left = args.budget_s - (time.perf_counter() - started)
        if not variants or left < 30:
            print(f"[{flags}] not run ({left:.0f} s left)", flush=True)
            continue
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                           + FLAGS[flags]).strip())
        cmd = [sys.executable, __file__, "--child", "--flags", flags, "--variants", variants,
               "--context", str(args.context), "--batch", str(args.batch), "--steps",
               str(args.steps), "--warm", str(args.warm), "--budget-s", str(left - 25),
               "--out", str(out), "--prefill-cache", args.prefill_cache] + \
            (["--quick"] if args.quick else [])
        try:
            subprocess.run(cmd, env=env, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            print(f"[{flags}] cut by the budget", flush=True)
    records = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    for r in records:  # the groups must not change what is decoded
        ref = next((g.get("tokens") for g in records
                    if g["variant"] == "g1" and g["flags"] == r["flags"]), None)
        r["same_tokens_as_g1"] = None if ref is None or "tokens" not in r \
            else r["tokens"] == ref
    (out / "groups_profile.json").write_text(json.dumps(records, indent=1) + "\n")
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
