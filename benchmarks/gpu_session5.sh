#!/usr/bin/env bash
# The GPU calls of session 5, one device call each (device tool: carry [".whl"]):
#   STEP=prefill  prefill time by matmul precision at 128K (benchmarks/prefill_precision_gpu.py),
#                 then experiments/scale.py at SCALE_CONTEXTS (default 512K) with bf16 matmuls
#                 into run scale_long (resumes from results/scale_long/results.json)
#   STEP=scale    the scale_long run only (SCALE_CONTEXTS, SCALE_BATCHES)
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
esac
ls -la "$OUT" "$OUT"/* 2>/dev/null | head -30
