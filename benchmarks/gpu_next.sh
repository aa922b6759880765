#!/usr/bin/env bash
# What the GPU still owes issues 6 and 7, in one device call each (see benchmarks/RESULTS.md):
#   STEP=kernels  GPU tests + kernel_compare of the issue-6 ops + the hierarchy decode-step
#                 timing with the Triton kernels wired in (hisparse vs resident, +15% target)
#   STEP=accuracy the accuracy study's GPU table (1K-8K, 64 examples), methods split in two
#                 runs so each finishes well inside one 10-minute call (results per cell)
# Use through the device tool: carry [".whl"], command "STEP=kernels bash benchmarks/gpu_next.sh".
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
export LSPARSE_RUNS=$OUT
case "${STEP:-kernels}" in
  kernels)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -15
    timeout 200 python3 -m experiments.cli run configs/experiments/kernel_compare.gin \
      "--gin.kernel_compare.ops=('sparse_attention','hot_resolve')" \
      "--gin.kernel_compare.implementations=('xla','triton')" 2>&1 | grep -v "it/s\]" | tail -30
    timeout 120 python3 benchmarks/hierarchy_gpu.py --out "$OUT" 2>&1 | tail -20 ;;
  accuracy)
    ARGS=("--gin.accuracy.lengths=(1024,2048,4096,8192)" "--gin.accuracy.examples=64"
          "--gin.accuracy.num_slots=16" "--gin.accuracy.tasks=('niah',)")
    timeout 280 python3 -m experiments.cli run configs/experiments/accuracy.gin "${ARGS[@]}" \
      "--gin.accuracy.methods=('dense','resident','hisparse','direct_pq')" \
      "--gin.run.name='accuracy_gpu_a'" 2>&1 | tr '\r' '\n' | grep -v "example/s" | tail -20
    timeout 280 python3 -m experiments.cli run configs/experiments/accuracy.gin "${ARGS[@]}" \
      "--gin.accuracy.methods=('resident','leansparse_C64','leansparse_C128','leansparse_C4096')" \
      "--gin.run.name='accuracy_gpu_b'" 2>&1 | tr '\r' '\n' | grep -v "example/s" | tail -20 ;;
  *) echo "STEP must be kernels or accuracy" >&2; exit 2 ;;
esac
