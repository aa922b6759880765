#!/usr/bin/env bash
# The GPU calls of session 5, one device call each (device tool: carry [".whl"]):
#   STEP=prefill  prefill time by matmul precision at 128K (benchmarks/prefill_precision_gpu.py),
#                 then experiments/scale.py at SCALE_CONTEXTS (default 512K) with bf16 matmuls
#                 into run scale_long (resumes from results/scale_long/results.json)
#   STEP=scale    the scale_long run only (SCALE_CONTEXTS, SCALE_BATCHES)
#   STEP=train    the drafter (configs/experiments/train_drafter.gin, DRAFT_SECONDS) then the
#                 long-context model (benchmarks/train_long_gpu.sh, TRAIN_SECONDS); each exported
#                 checkpoint comes back as one tar in $OUT (checkpoints are folders too deep for
#                 $OUT), runs/ results beside them
#   STEP=final    one short slice each (time-limited): device pools vs preallocated at 128K and
#                 capacity (benchmarks/pools_gpu.py); the speculative experiment on the trained
#                 model + drafter; sparse_attention v2 / Mosaic core table; the 200-example NIAH
#                 study on checkpoints/long (shorter lengths first). Everything comes back in
#                 $OUT/final.tar (more files than $OUT returns)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
export LSPARSE_RUNS=$OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
scale() {
  mkdir -p "$OUT/scale_long" && cp results/scale_long/results.json "$OUT/scale_long/" 2>/dev/null
  timeout "$1" python3 -m experiments.cli run configs/experiments/scale.gin \
    "--gin.scale.implementation='triton'" "--gin.scale.contexts=${SCALE_CONTEXTS:-(524288,)}" \
    "--gin.scale.batches=${SCALE_BATCHES:-(1, 8)}" "--gin.run.name='scale_long'" \
    "--gin.model_preset.matmul_precision='bf16'" \
    2>&1 | tr '\r' '\n' | grep -v "it/s\]\|tok/s\]" | tail -24
}
case "${STEP:-prefill}" in
  prefill)
    timeout 200 python3 benchmarks/prefill_precision_gpu.py --contexts 131072 \
      --precisions highest,tf32,bf16 --out "$OUT" 2>&1 | tail -8
    scale 330 ;;
  scale) scale 560 ;;
  train)  # SPEC_DIR / LONG_DIR: trees holding those branches (default: this one)
    ROOT=$PWD
    (cd "${SPEC_DIR:-.}" && export PYTHONPATH=/tmp/site:$PWD && timeout "${DRAFT_SECONDS:-240}" \
      python3 -m experiments.cli run configs/experiments/train_drafter.gin 2>&1 \
      | tr '\r' '\n' | grep -v "it/s\]" | tail -12
     [ -d checkpoints/drafter_small ] && tar -cf "$OUT/drafter_small.tar" checkpoints/drafter_small)
    cp "$OUT/train_drafter/results.json" "$OUT/train_drafter_results.json" 2>/dev/null
    rm -rf "$OUT/train_drafter"
    (cd "${LONG_DIR:-.}" && unset LSPARSE_RUNS && OUT=$OUT/long STEP=train \
      TRAIN_SECONDS=${TRAIN_SECONDS:-300} bash benchmarks/train_long_gpu.sh
     [ -d checkpoints/long ] && tar -cf "$OUT/long.tar" checkpoints/long)
    rm -rf "$OUT/long/checkpoints" "$OUT/long/train_long/config.gin"; cd "$ROOT" ;;
  final)
    echo "== pools"; timeout 110 python3 benchmarks/pools_gpu.py --contexts 131072 \
      --methods resident,leansparse,hisparse,adaptive --codebooks random --warm 2 --steps 8 \
      --budget-gb 80 --budget-s 75 --out "$OUT/pools" --tag 128k 2>&1 | tail -30
    echo "== speculative"; timeout 100 python3 -m experiments.cli run \
      configs/experiments/speculative.gin \
      "--gin.speculative.methods=('resident', 'hisparse', 'adaptive', 'leansparse')" \
      "--gin.speculative.concurrencies=(1, 8, 4, 2)" --gin.speculative.decode_tokens=64 \
      --gin.speculative.time_limit_s=50 --gin.speculative.results_dir=None 2>&1 \
      | tr '\r' '\n' | grep -v "it/s\]" | tail -25
    echo "== sparse_attention"; timeout 120 python3 benchmarks/sparse_attention_v2_gpu.py \
      --quick --rows bfloat16,fp8 --budget-s 55 --mosaic-timeout-s 50 --out "$OUT/kernels" 2>&1 \
      | grep -v Deprecation | grep -v "^  File\|^    \|^Traceback" | tail -34
    echo "== accuracy"; ACC_TIMEOUT=190 ACC_EXTRA="--gin.accuracy.tasks=('niah',)" \
      STEP=accuracy bash benchmarks/train_long_gpu.sh 2>&1 | tail -30
    (cd "$OUT" && tar -cf /tmp/final.tar . && find . -mindepth 1 -delete && mv /tmp/final.tar .) ;;
esac
ls -la "$OUT" "$OUT"/* 2>/dev/null | head -30
