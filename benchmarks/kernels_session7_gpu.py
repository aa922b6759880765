"""Issue 16, session 7 on one H200: kernel_compare's default config, the profiled decode step,
the kernel GPU tests and a pq_topc jax_triton launch sweep, in one bounded call.

Run from the repository root (jax 0.11.2, triton 3.6.0; gin / jax-triton wheels as usual):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/kernels_session7_gpu.py --out $OUT/session7 \\
        --budget-s 400
--small: a CPU smoke run of the script (tiny shapes, XLA / interpret mode; not a benchmark).
Parts (each a child process with its own timeout, in this order; --parts picks a subset):
  kernel_compare  ``lsparse run configs/experiments/kernel_compare.gin`` (the default config:
                  all five ops and their variants; each op's issue-16 target shape first, then
                  the other shapes until its budget_s is spent) -> OUT/results/kernel_compare/
                  results.json (copy to the repository's results/kernel_compare/).
  tests           ``pytest -m gpu`` on tests/test_kernel_*.py, the new kernels' files first
                  (log OUT/tests.log; correctness of the new defaults before the profile).
  decode_profile  benchmarks/decode_profile_gpu.py: the decode step at V4 shapes (4-layer
                  slice, B = 64, 128K context, bf16 matmuls, Triton kernels) profiled per op;
                  step time vs the sum of its kernels -> OUT/decode_profile/.
  pq_sweep        pq_topc jax_triton score kernel alone at B = 64, N = 131072: a few launch
                  configurations and both gather lowerings, each checked against the Pallas
                  kernel's scores (max relative error) -> OUT/pq_sweep.json.
Budget: --budget-s is split by SHARES; a part gets its share plus what earlier parts left, and
is killed at that time (what it wrote stays). OUT/session7.json is rewritten after each part;
the table is printed last (and written to OUT/session7.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
SHARES = dict(kernel_compare=0.42, tests=0.18, decode_profile=0.32, pq_sweep=0.08)
TEST_FILES = ("pq_topc", "hot_resolve", "index_scores", "topk", "topk_nosync",
              "sparse_attention", "gather_rows")  # the new kernels' tests first
SLACK_S = 25.0  # kernel_compare stops starting timings this long before its part's deadline
STATE = dict(parts=[], start=time.monotonic())


def left(budget: float) -> float:
    return budget - (time.monotonic() - STATE["start"])


def run_part(name: str, cmd: list[str], seconds: float, out: pathlib.Path, env=None) -> dict:
    """Runs one part's command with a timeout; its output goes to OUT/<name>.log."""
    log = out / f"{name}.log"
    t0 = time.monotonic()
    print(f"== {name} ({seconds:.0f} s): {' '.join(cmd)}", flush=True)
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=seconds,
                                  cwd=ROOT, env={**os.environ, **(env or {})})
            status = proc.returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    row = dict(part=name, status=status, wall_s=round(time.monotonic() - t0, 1),
               limit_s=round(seconds), log=str(log))
    STATE["parts"].append(row)
    (out / "session7.json").write_text(json.dumps(STATE["parts"], indent=1))
    return row


def kernel_compare_cmd(seconds: float, small: bool, repeats: int) -> list[str]:
    cmd = [sys.executable, "-m", "experiments.cli", "run", "configs/experiments/kernel_compare.gin",
           f"--gin.kernel_compare.budget_s={max(seconds - SLACK_S, 1.0):.0f}",
           f"--gin.kernel_compare.repeats={repeats}"]
    if small:
        cmd += ["--gin.kernel_compare.batches=(1,)", "--gin.kernel_compare.histories=(512,)",
                "--gin.kernel_compare.topk_shapes=((2, 2048, 64),)",
                "--gin.kernel_compare.ops=('pq_topc', 'topk')"]
    return cmd


def decode_profile_cmd(seconds: float, small: bool, out: pathlib.Path) -> list[str]:
    cmd = [sys.executable, "benchmarks/decode_profile_gpu.py", "--out", str(out),
           "--budget-s", f"{max(seconds - 10, 1):.0f}"]
    if small:
        cmd += ["--context", "1024", "--batch", "1", "--steps", "1", "--implementation", "xla",
                "--methods", "hisparse"]
    return cmd


def tests_cmd(small: bool) -> list[str]:
    files = [f"tests/test_kernel_{name}.py" for name in TEST_FILES]
    missing = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_kernel_*.py")}
    files += sorted(missing - set(files))
    return [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu",
            "-rfE", *files] if not small else [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
        "tests/test_kernel_pq_topc.py"]


# ---------------------------------------------------------------------------- pq_sweep (child)


def pq_sweep(out: pathlib.Path, small: bool, budget: float) -> None:
    """Times the jax_triton score kernel alone at several launch configurations (child)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(HERE))
    from timing import program_time

    from pallas_kernels.pq_topc import jax_triton as jt
    from pallas_kernels.pq_topc import triton as pq_triton

    start = time.monotonic()
    b, n, h, d, m, k = (2, 4096, 16, 32, 8, 16) if small else (64, 131072, 64, 128, 32, 256)

    def inputs(seed):
        k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
        return (jax.random.normal(k1, (b, h, d), jnp.float32),
                jax.random.uniform(k2, (b, h), jnp.float32, -0.5, 1.0),
                jax.random.randint(k3, (b, n, m), 0, k, jnp.int32).astype(jnp.uint8),
                jax.random.normal(k4, (m, k, d // m), jnp.float32),
                jnp.full((b,), n, jnp.int32))

    sets = [inputs(i) for i in range(4)]
    ref = np.asarray(pq_triton.coarse_scores_triton(*sets[0]))
    scale = float(np.abs(ref).max())
    configs = [jt.Params(), jt.Params(decode="shuffle"), jt.Params(block_n=128),
               jt.Params(block_n=512, steps=4), jt.Params(num_warps=4),
               jt.Params(block_n=128, num_warps=8, decode="shuffle"),
               jt.Params(block_n=256, steps=16), jt.Params(block_n=128, steps=16, num_warps=4)]
    rows = []
    flops = 2.0 * b * n * h * d
    for p in configs:
        if time.monotonic() - start > budget - 10:
            rows.append(dict(params=str(p), skipped="budget"))
            continue
        try:
            fn = jax.jit(lambda *a, p=p: jt.coarse_scores_jax_triton(*a, params=p))
            err = float(np.abs(np.asarray(fn(*sets[0])) - ref).max() / scale)
            t = program_time(lambda *a, fn=fn: fn(*a), sets, repeats=5)
            rows.append(dict(params=str(p), ms=t * 1e3, rel_err_vs_pallas=err,
                             tflops=flops / t / 1e12))
        except Exception as e:  # noqa: BLE001  (one config failing must not stop the sweep)
            rows.append(dict(params=str(p), error=f"{type(e).__name__}: {e}"[:300]))
        (out / "pq_sweep.json").write_text(json.dumps(dict(b=b, n=n, rows=rows), indent=1))
    pallas = program_time(lambda *a: pq_triton.coarse_scores_triton(*a), sets, repeats=5)
    rows.append(dict(params="pallas triton.coarse_scores_triton", ms=pallas * 1e3,
                     tflops=flops / pallas / 1e12))
    (out / "pq_sweep.json").write_text(json.dumps(dict(b=b, n=n, rows=rows), indent=1))


# ---------------------------------------------------------------------------- table


def table(out: pathlib.Path) -> str:
    lines = ["part            status    wall_s  limit_s"]
    lines += [f"{p['part']:15s} {str(p['status']):9s} {p['wall_s']:7.1f} {p['limit_s']:8d}"
              for p in STATE["parts"]]
    kc = out / "results" / "kernel_compare" / "results.json"
    if kc.exists():
        from experiments.kernel_compare import format_table

        rows = json.loads(kc.read_text())["rows"]
        lines += ["", "kernel_compare (target shapes first):",
                  format_table([r for r in rows if "skipped" not in r])]
        skipped = sum("skipped" in r for r in rows)
        lines.append(f"  ({skipped} timings skipped by the budget)")
    dp = out / "decode_profile" / "decode_profile.json"
    if dp.exists():
        lines += ["", "decode_profile (step vs its kernels; target ratio <= 1.25):"]
        for r in json.loads(dp.read_text()):
            lines.append(f"  {r.get('method')} ctx {r.get('context')} B {r.get('batch')}: step "
                         f"{r.get('step_ms') or float('nan'):.3f} ms, kernels "
                         f"{r.get('kernels_ms', float('nan')):.3f} ms, ratio "
                         f"{r.get('ratio', float('nan')):.2f} "
                         f"{r.get('error') or r.get('skipped') or ''}")
            for kind, ms in list(r.get("by_kind", {}).items())[:8]:
                lines.append(f"      {kind:26s} {ms:8.3f} ms")
    log = out / "tests.log"
    if log.exists():
        text = log.read_text()
        summary = [ln for ln in text.splitlines()
                   if re.search(r"\d+ (passed|failed|skipped|deselected)", ln)]
        failed = [ln for ln in text.splitlines() if ln.startswith("FAILED")]
        lines += ["", "tests: " + (summary[-1] if summary else "no summary line (cut?)")]
        lines += [f"  {ln[:150]}" for ln in failed[:15]]
    sw = out / "pq_sweep.json"
    if sw.exists():
        lines += ["", "pq_sweep (score kernel alone):"]
        for r in json.loads(sw.read_text())["rows"]:
            if "ms" in r:
                lines.append(f"  {r['ms']:8.4f} ms {r['tflops']:6.1f} TFLOP/s  "
                             f"err {r.get('rel_err_vs_pallas', float('nan')):.1e}  "
                             f"{r['params']}")
            else:
                lines.append(f"  {r.get('error') or r.get('skipped')}  {r['params']}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/kernels_session7")
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--parts", default=",".join(SHARES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--child", default=None, help="internal: run one in-process part")
    a = ap.parse_args()
    out = pathlib.Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if a.child == "pq_sweep":
        pq_sweep(out, a.small, a.budget_s)
        return
    parts = a.parts.split(",")
    unknown = set(parts) - set(SHARES)
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; allowed: {list(SHARES)}")
    env = {"PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": "/tmp/jax_cache_session7"}
    if a.small:
        env["JAX_PLATFORMS"] = "cpu"
    total = sum(SHARES[p] for p in parts)
    carry = 0.0  # what earlier parts left of their shares
    for name in parts:
        share = a.budget_s * SHARES[name] / total + carry
        seconds = min(share, left(a.budget_s))
        if seconds < 15:
            STATE["parts"].append(dict(part=name, status="skipped (budget)", wall_s=0.0,
                                       limit_s=0))
            continue
        if name == "kernel_compare":
            row = run_part(name, kernel_compare_cmd(seconds, a.small, a.repeats), seconds, out,
                           {**env, "LSPARSE_RUNS": str(out / "results")})
        elif name == "decode_profile":
            row = run_part(name, decode_profile_cmd(seconds, a.small, out / "decode_profile"),
                           seconds, out, env)
        elif name == "tests":
            row = run_part(name, tests_cmd(a.small), seconds, out, env)
        else:
            row = run_part(name, [sys.executable, __file__, "--child", name, "--out", str(out),
                                  "--budget-s", f"{seconds - 5:.0f}"]
                           + (["--small"] if a.small else []), seconds, out, env)
        carry = max(share - row["wall_s"], 0.0)
    text = table(out)
    (out / "session7.txt").write_text(text + "\n")
    print(f"total {time.monotonic() - STATE['start']:.0f} s")
    print(text)


if __name__ == "__main__":
    main()
