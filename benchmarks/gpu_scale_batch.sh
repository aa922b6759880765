#!/usr/bin/env bash
# Issue 13, deliver 4 and 6 on one H200 (device tool, carry [".whl"]), one device call each:
#   STEP=profile  LeanSparse request groups: what overlap XLA gives
#                 (benchmarks/groups_profile_gpu.py: 128K, batch 16, variants g1/g2/g2_main,
#                 and g2/g1 under the latency-hiding scheduler; ~280 s wall) -> $OUT/groups/
#   STEP=scale    the scale study's batch axis (configs/experiments/scale_batch.gin: 512K at
#                 batch 8, 64, 32, 1 and 1M at batch 8, 1; hisparse, leansparse, leansparse_g2,
#                 resident, adaptive), stopped by its own budget (scale.time_budget_s = 480 s
#                 of the call) -> $OUT/scale_batch/{results.json, config.gin, scale.png}.
#                 Resumable: copy $OUT/scale_batch/results.json to results/scale_batch/ before
#                 the next call (this script also keeps a copy on the machine, in
#                 /tmp/lsparse_scale_batch, and starts from whichever holds more cells); the
#                 prefill of each context is cached in /tmp/lsparse_scale_prefill while the
#                 machine stays warm. results.json's `pending` lists the cells left.
#   STEP=both     profile (with a 170 s budget) then scale (budget cut to fit): one call.
# RUN: the scale run (default scale_batch): configs/experiments/$RUN.gin, resumed from
#   results/$RUN/ (e.g. RUN=scale_batch_short: 32K and 128K at batch 64 and 32).
# SCALE_BUDGET: the scale step's budget in s (default 480; a call is <= 600 s).
# SCALE_ARGS: extra gin bindings for the scale run, e.g.
#   SCALE_ARGS="--gin.scale.methods=('hisparse','leansparse','leansparse_g2')"
# Everything written under $OUT comes back; the last lines print the tables.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache  # persistent compile cache while warm
# XLA's pinned host allocator stops at 64 GB by default; 512K at batch 64 asks for one 16 GiB
# buffer beyond it (session 27). The machine has 125 GiB.
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-110}
OUT=${OUT:-/tmp/out}
export OUT LSPARSE_RUNS=$OUT
START=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
quiet() { tr '\r' '\n' | grep -v "it/s\]\|tok/s\]\|req/s\]\|Deprecation" ; }
STEP=${STEP:-scale}
export RUN=${RUN:-scale_batch}

profile() {
  echo "== groups profile ($1 s)"
  timeout "$(( $1 + 20 ))" python3 benchmarks/groups_profile_gpu.py --out "$OUT/groups" \
    --budget-s "$1" 2>&1 | quiet | tail -16
}

scale() {
  local budget=$1
  echo "== $RUN (budget $budget s)"
  mkdir -p "$OUT/$RUN" "/tmp/lsparse_$RUN"
  python3 - <<'EOF'
import json, os, pathlib, shutil
run = os.environ["RUN"]
cands = [pathlib.Path(f"results/{run}/results.json"),
         pathlib.Path(f"/tmp/lsparse_{run}/results.json")]
count = lambda p: len(json.loads(p.read_text())["records"]) if p.exists() else -1
best = max(cands, key=count)
if count(best) >= 0:
    shutil.copy(best, pathlib.Path(os.environ["OUT"]) / run / "results.json")
    print(f"resuming from {best} ({count(best)} cells)")
EOF
  # the whole log (progress bars dropped, first 4 MB) comes back as $OUT/$RUN/run.log: where
  # a cell runs out of host memory, XLA's allocator prints its live-buffer summary there
  timeout "$(( budget + 45 ))" python3 -m experiments.cli run "configs/experiments/$RUN.gin" \
    "--gin.scale.time_budget_s=$budget" ${SCALE_ARGS:-} 2>&1 | quiet \
    | tee "$OUT/$RUN/run.log" | tail -40
  echo "-- scale exit ${PIPESTATUS[0]} (124: cut by its timeout)"
  truncate -s '<4000000' "$OUT/$RUN/run.log"
  cp "$OUT/$RUN/results.json" "/tmp/lsparse_$RUN/" 2>/dev/null
  python3 -m experiments.scale_report --runs "$OUT" --only "$RUN" 2>&1 | tail -30
}

case "$STEP" in
  profile) profile 240 ;;
  scale) scale "${SCALE_BUDGET:-480}" ;;
  both)
    profile 170
    scale $(( 470 - ($(date +%s) - START) )) ;;
esac
echo "== wall $(( $(date +%s) - START )) s"
