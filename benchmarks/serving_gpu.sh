#!/usr/bin/env bash
# Serving under load on one H200 (issue 14), one device call per STEP (device tool: carry
# [".whl"]; jax 0.11.2 with the CUDA plugin on the machine, gin-config and jax-triton wheels
# from .whl/ as in gpu_session5.sh). Every part is time-limited and its experiment rewrites
# results.json after every cell (method), so a cut run keeps what finished and a rerun with
# the same $OUT contents resumes. Results land in $OUT/<run name>/; a short table prints last.
#   STEP=capacity  experiments/capacity.py, configs/experiments/capacity.gin: N per method at
#                  200K/512K/950K from one calibrated budget (instant), then decode timed at
#                  min(N, 256) copies and at HiSparse's N, for the contexts in CONTEXTS
#                  (default "(204800,)"; then "(524288,)", "(972800,)" with PRIOR set: one
#                  context per call, prefill ~30 s / 70 s / ~150 s, the rest admissions
#                  and decode compiles)
#   STEP=replay    experiments/replay.py, configs/experiments/replay.gin, METHOD (default
#                  leansparse; then echo, hisparse: one call each, ~4-6 min) or METHODS (a gin
#                  tuple, run in order under one LIMIT; each finished method is kept)
#   STEP=loadstep  experiments/residency.py, configs/experiments/loadstep.gin: C8 load step,
#                  resident / hisparse / adaptive at 32K (~4 min)
#   STEP=session   the three in one call of <= 345 s (timeouts 105 + 110 + 130 s after the wheel
#                  install; session 8 cut loadstep at 65 s and replay at 70 s while compiling),
#                  each at a scale that compiles in time: capacity at 200K (N
#                  predicted for all contexts, decode timed at 8 copies, f32 rows), loadstep
#                  C8 at 8K prompts, replay of 4 sessions x 3 calls (echo, leansparse, then
#                  hisparse if time is left). Results: $OUT/{capacity,loadstep,replay}_session
# PRIOR=DIR: a folder holding earlier <run name>/results.json to resume from (copied into $OUT).
# STEP=capacity / STEP=replay / STEP=loadstep: RUN_NAME (default: the step) names the run (and the
# PRIOR results it resumes); extra arguments are gin overrides (e.g. --gin.replay.sessions=24,
# --gin.replay.input_repeat=0.3, --gin.residency.input_repeat=0.3).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# compiled programs persist across the parts of a call and across calls on a warm machine
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/runs/jaxcache}
OUT=${OUT:-/tmp/out}
export LSPARSE_RUNS=$OUT
LIMIT=${LIMIT:-560}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
run() {  # run NAME GIN [gin overrides...]: time-limited (LIMIT s), progress bars filtered
  local name=$1 gin=$2; shift 2
  if [ -n "${PRIOR:-}" ] && [ -f "$PRIOR/$name/results.json" ]; then
    mkdir -p "$OUT/$name" && cp "$PRIOR/$name/results.json" "$OUT/$name/"
  fi
  timeout "$LIMIT" python3 -m experiments.cli run "$gin" "$@" 2>&1 \
    | tr '\r' '\n' | grep -v "it/s\]\|tok/s\]\|call/s\]\|s/it\]\|s/call\]\|step/s\]\|s/step\]" \
    | tail -30
  echo "exit ${PIPESTATUS[0]} (124: cut by the ${LIMIT} s limit; cells written so far kept)"
}
case "${STEP:-capacity}" in
  capacity) run "${RUN_NAME:-capacity}" configs/experiments/capacity.gin \
              "--gin.capacity.time_contexts=${CONTEXTS:-(204800,)}" \
              "--gin.run.name='${RUN_NAME:-capacity}'" "$@" ;;
  replay)   run "${RUN_NAME:-replay}" configs/experiments/replay.gin \
              "--gin.replay.methods=${METHODS:-('${METHOD:-leansparse}',)}" \
              "--gin.run.name='${RUN_NAME:-replay}'" "$@" ;;
  loadstep) run "${RUN_NAME:-loadstep}" configs/experiments/loadstep.gin \
              "--gin.run.name='${RUN_NAME:-loadstep}'" "$@" ;;
  session)
    echo "== capacity (200K timed at 8 copies)"
    LIMIT=105 run capacity_session configs/experiments/capacity.gin \
      "--gin.run.name='capacity_session'" "--gin.capacity.time_contexts=(204800,)" \
      --gin.capacity.max_timed_batch=8 --gin.capacity.steps=8 --gin.capacity.warm_steps=2 \
      "--gin.model_preset.kv_dtype='f32'" --gin.capacity.calibration_tokens=2048
    echo "== loadstep (C8, 8K prompts)"
    LIMIT=${LOADSTEP_LIMIT:-110} run loadstep_session configs/experiments/loadstep.gin \
      "--gin.run.name='loadstep_session'" --gin.residency.prompt_tokens=8192 \
      --gin.residency.requests=10 --gin.residency.arrival_steps=2 \
      --gin.residency.decode_tokens=16 --gin.residency.hot_cache_rows=1024 \
      --gin.residency.optional_pages=96 --gin.residency.refill_pages=8
    echo "== replay (4 sessions x 3 calls)"
    LIMIT=${REPLAY_LIMIT:-130} run replay_session configs/experiments/replay.gin \
      "--gin.run.name='replay_session'" "--gin.replay.methods=('echo', 'leansparse', 'hisparse')" \
      --gin.replay.sessions=4 --gin.replay.calls=3 "--gin.replay.first_prompt_tokens=(2048, 4096)" \
      "--gin.replay.turn_tokens=(256, 512)" "--gin.replay.output_tokens=(16, 32)" \
      --gin.replay.tool_wait_s=0.5 --gin.replay.num_slots=4 --gin.replay.echo_pool_rows=4096 \
      --gin.replay.prefill_chunk=2048 ;;
  *) echo "STEP must be capacity, replay, loadstep or session"; exit 2 ;;
esac
ls -la "$OUT" "$OUT"/* 2>/dev/null | head -20
