"""Issue 16 deliver 4: the decode step at V4 shapes against the sum of its kernels' times.

Run on the GPU machine from the repository root (gin wheel on PYTHONPATH as usual):
    PYTHONPATH=$PWD python3 benchmarks/decode_profile_gpu.py --out $OUT [--methods hisparse]
It runs experiments/scale.py (configs/experiments/scale.gin: V4-Flash 4-layer slice swa, csa,
hca, csa; random weights) at one context and batch (default 128K, B = 64), bf16 model matmuls,
Triton kernels, with the timed steps' cell profiled (jax.profiler, 3 extra steps), then reads
each cell's Perfetto trace:
  step_ms        wall time per decode step (scale.py, host work included; Engine.decode's
                 pipelined steps unless --stepwise; the profiled steps run the same way),
  kernels_ms     sum of the durations of the GPU events of one step (kernels + copies),
  span_ms        first GPU event start to last event end, per step,
  ratio          step_ms / kernels_ms (issue target <= 1.25: the rest is glue / host time),
  by_kind        the kernels' time by kind: the Pallas ops (by kernel name), XLA fusions,
                 GEMMs, copies (memcpy), other;
  top            the 25 longest kernel names (ms per step).
``--hlo-census`` also dumps XLA's optimized HLO of the decode step (``jit_launch_step``) and
lists its sort and scatter instructions (shape, source file and line) in OUT/hlo_census.json:
which line of ours each XLA sort kernel of the profile comes from (session 30: LeanSparse had
10 sort kernels a step at 128K, ~0.2 ms at batch 1 and 8).
Costs: one 128K prefill (~5 s at bf16), the decode compile (~30-90 s) and a few steps per
method. ``--budget-s`` bounds the scale run (killed past it; the cells it finished are still
analysed: scale.py writes its results after every cell). Writes OUT/decode_profile.json and
prints a summary; scale's own files go to OUT/runs/decode_profile/.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

PALLAS = ("sparse_attention", "topk", "pq_topc", "pq_coarse", "pq_scores", "hot_resolve",
          "index_scores", "index_topk", "gather_rows", "count", "refine", "select", "finish")
STEPS = 3  # scale.PROFILED_STEPS


def kind(name: str) -> str:
    low = name.lower()
    for op in PALLAS:
        if op in low:
            return f"pallas:{op}"
    if "memcpy" in low or "memset" in low:
        return "copy"
    if "gemm" in low or "cutlass" in low or "xmma" in low or "cublas" in low:
        return "gemm"
    if "fusion" in low or "loop_" in low or "input_" in low or "reduce" in low:
        return "xla_fusion"
    return "other"


def analyze(trace: pathlib.Path) -> dict:
    ev = json.load(gzip.open(trace))["traceEvents"]
    gpu = {e["pid"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    ks = [e for e in ev if e.get("ph") == "X" and e.get("pid") in gpu]
    by_name, by_kind = collections.Counter(), collections.Counter()
    for e in ks:
        by_name[e["name"][:90]] += e.get("dur", 0) / STEPS / 1e3
        by_kind[kind(e["name"])] += e.get("dur", 0) / STEPS / 1e3
    span = (max(e["ts"] + e.get("dur", 0) for e in ks) - min(e["ts"] for e in ks)) if ks else 0
    return dict(kernels_ms=sum(by_kind.values()), span_ms=span / STEPS / 1e3,
                events_per_step=len(ks) / STEPS, by_kind=dict(by_kind.most_common()),
                top=[(n, round(v, 4)) for n, v in by_name.most_common(25)])


HLO_OP = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) (sort|scatter)\(")


def hlo_census(dump: pathlib.Path, module: str = "launch_step") -> list[dict]:
    """Sort and scatter instructions of the optimized HLO modules named ``module`` that XLA
    dumped to ``dump`` (``--xla_dump_to``): one record per instruction with its module file,
    name, op, result shape, the source file / line of the Python that made it where the dump
    names it (newer XLA prints a stack-frame id instead) and the op_name's last 160 characters
    (the jit / vmap scopes and primitive)."""
    out = []
    for path in sorted(dump.glob(f"*{module}*after_optimizations.txt")):
        for line in path.read_text().splitlines():
            m = HLO_OP.match(line)
            if not m:
                continue
            src = re.search(r'source_file="([^"]*)" source_line=(\d+)', line)
            name = re.search(r'op_name="([^"]*)"', line)
            out.append(dict(module=path.name, name=m.group(1), op=m.group(3),
                            shape=m.group(2)[:120],
                            source=f"{src.group(1).split('lsparse-jax/')[-1]}:{src.group(2)}"
                            if src else None,
                            op_name=name.group(1)[-160:] if name else None))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/decode_profile_gpu")
    ap.add_argument("--methods", default="hisparse,leansparse")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--implementation", default="triton")
    ap.add_argument("--kv-dtype", default=None, help="ModelConfig.kv_dtype (None: the "
                    "preset's, f32 rows; fp8_v4: V4's 584-byte rows)")
    ap.add_argument("--attention-precision", default=None, help="ModelConfig."
                    "attention_precision (None: the preset's, 'f32'; 'bf16': the "
                    "sparse_attention kernel's fast formats, FP8/bf16 rows in place)")
    ap.add_argument("--stepwise", action="store_true", help="time one Engine.step at a time "
                    "(each read back before the next; default: Engine.decode, pipelined)")
    ap.add_argument("--time-both", action="store_true", help="also time the other mode "
                    "(scale.time_both_modes: step_ms_pipelined and step_ms_stepwise)")
    ap.add_argument("--input-repeat", type=float, default=None, help="scale.input_repeat: "
                    "teacher-forced inputs with this repeat probability (selection reuse)")
    ap.add_argument("--prefill-cache", default=None, help="scale.prefill_cache (a directory)")
    ap.add_argument("--gin", action="append", default=[], help="extra gin binding for the "
                    "scale run, e.g. LeanSparseConfig.coarse_implementation=\"'jax_triton'\"")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="kill the scale run after this many seconds (None: no limit)")
    ap.add_argument("--hlo-census", action="store_true", help="dump the decode step's "
                    "optimized HLO and list its sorts and scatters (OUT/hlo_census.json)")
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    runs = out / "runs"
    methods = tuple(a.methods.split(","))
    cells = tuple((m, a.context, a.batch) for m in methods)
    cmd = [sys.executable, "-m", "experiments.cli", "run", "configs/experiments/scale.gin",
           "--gin.run.name='decode_profile'", f"--gin.scale.methods={methods!r}",
           f"--gin.scale.contexts=({a.context},)", f"--gin.scale.batches=({a.batch},)",
           f"--gin.scale.steps={a.steps}", "--gin.scale.warm_steps=2",
           f"--gin.scale.implementation='{a.implementation}'",
           f"--gin.scale.profile={cells!r}", "--gin.model_preset.matmul_precision='bf16'"]
    if a.stepwise:
        cmd.append("--gin.scale.pipelined=False")
    if a.time_both:
        cmd.append("--gin.scale.time_both_modes=True")
    if a.input_repeat is not None:
        cmd.append(f"--gin.scale.input_repeat={a.input_repeat}")
    if a.prefill_cache is not None:
        cmd.append(f"--gin.scale.prefill_cache='{a.prefill_cache}'")
    cmd += [f"--gin.{binding}" for binding in a.gin]
    if a.kv_dtype is not None:
        cmd.append(f"--gin.model_preset.kv_dtype='{a.kv_dtype}'")
    if a.attention_precision is not None:
        cmd.append(f"--gin.model_preset.attention_precision='{a.attention_precision}'")
    print(" ".join(cmd), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    status = None
    env = {**os.environ, "LSPARSE_RUNS": str(runs)}
    dump = pathlib.Path(tempfile.mkdtemp(prefix="hlo_")) if a.hlo_census else None
    if dump is not None:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                            " --xla_dump_hlo_module_re=.*launch_step.*").strip()
    try:
        proc = subprocess.run(cmd, env=env, timeout=a.budget_s)
        status = None if proc.returncode == 0 else f"scale exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"scale killed after --budget-s {a.budget_s} s"
    run = runs / "decode_profile"
    results = run / "results.json"
    records = json.loads(results.read_text())["records"] if results.exists() else []
    done = {r.get("method") for r in records}
    records += [dict(method=m, context=a.context, batch=a.batch, error=status or "no record")
                for m in methods if m not in done]
    rows = []
    for rec in records:
        row = {k: rec.get(k) for k in ("method", "context", "batch", "step_ms",
                                       "step_ms_pipelined", "step_ms_stepwise", "reuse",
                                       "pipelined", "input_repeat", "error", "skipped")}
        trace = run / f"trace_{rec['method']}_{rec['context']}_{rec['batch']}.json.gz"
        if trace.exists():
            row.update(analyze(trace))
            if row.get("step_ms") and row["kernels_ms"]:
                row["ratio"] = row["step_ms"] / row["kernels_ms"]
        rows.append(row)
    (out / "decode_profile.json").write_text(json.dumps(rows, indent=1))
    if dump is not None:
        census = hlo_census(dump)
        (out / "hlo_census.json").write_text(json.dumps(census, indent=1))
        print(f"HLO census ({len(census)} sorts / scatters):")
        for c in census:
            where = c["source"] or (c["op_name"] or "")[-70:]
            print(f"    {c['op']:8s} {c['shape'][:50]:50s} {where}")
    for r in rows:
        print(f"{r['method']:10s} ctx {r['context']} B {r['batch']}: step "
              f"{r.get('step_ms') or float('nan'):.3f} ms, kernels {r.get('kernels_ms', 0):.3f}"
              f" ms, span {r.get('span_ms', 0):.3f} ms, ratio {r.get('ratio', float('nan')):.2f}"
              f" (pipelined {r.get('step_ms_pipelined')}, stepwise {r.get('step_ms_stepwise')},"
              f" reuse {r.get('reuse')})"
              f" {r.get('error') or r.get('skipped') or ''}")
        for k, v in r.get("by_kind", {}).items():
            print(f"    {k:24s} {v:8.3f} ms")
        for n, v in r.get("top", [])[:12]:
            print(f"      {v:8.4f}  {n}")


if __name__ == "__main__":
    main()
