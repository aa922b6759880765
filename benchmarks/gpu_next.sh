#!/usr/bin/env bash
# The GPU calls of session 3 (issues 4-7), one device call each (see benchmarks/RESULTS.md):
#   STEP=kernels  GPU tests + kernel_compare of the issue-6 ops + the hierarchy decode-step
#                 timing with the Triton kernels wired in (hisparse vs resident, +15% target)
#                 + streamed-vs-monolithic prefill on the trained model (issue 4 tolerance)
#   STEP=pq_sweep launch-parameter sweep of the pq_topc score kernel (data for TUNED)
#   STEP=pq_fused GPU tests + fused vs unfused pq_topc (kernel_compare, launch parameters)
#   STEP=nosync   issue 16 deliver 1: benchmarks/topk_nosync_gpu.py (topk / pq_topc: XLA vs
#                 the old while-loop kernels vs the fixed launch sequence vs one-read topk,
#                 profiler trace in $OUT/trace), then the GPU tests of topk and pq_topc
#   STEP=accuracy the accuracy study's GPU table (1K-8K, 64 examples, both tasks, every
#                 method; results written after every cell; ACC_LENGTHS/ACC_TASKS/ACC_NAME
#                 restrict a rerun, ACC_EXTRA adds gin flags, e.g. an ablation)
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
    timeout 100 python3 benchmarks/hierarchy_gpu.py --out "$OUT" 2>&1 | tail -20
    timeout 110 python3 benchmarks/prefill_stream_tolerance.py --out "$OUT" 2>&1 | tail -6 ;;
  pq_sweep)
    timeout 240 python3 benchmarks/pq_topc_sweep.py 2>&1 | tail -40 ;;
  pq_fused)  # GPU tests, then fused vs unfused pq_topc (kernel_compare + launch parameters)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -4
    timeout 150 python3 -m experiments.cli run configs/experiments/kernel_compare.gin \
      "--gin.kernel_compare.ops=('pq_topc',)" "--gin.kernel_compare.batches=(8,64)" \
      "--gin.kernel_compare.histories=(131072,)" "--gin.run.name='kernel_compare_pq_fused'" \
      "--gin.kernel_compare.implementations=('xla','triton','triton_unfused')" 2>&1 \
      | tr '\r' '\n' | grep -v "case/s" | tail -12
    timeout 150 python3 benchmarks/pq_topc_fused_gpu.py 2>&1 | tail -8 ;;
  nosync)  # issue 16 deliver 1 (benchmark first: it is the result; ~2 min, then ~2-4 min)
    timeout 200 python3 benchmarks/topk_nosync_gpu.py --out "$OUT" 2>&1 | grep -v Deprecat | tail -30
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_topk.py \
      tests/test_kernel_topk_nosync.py tests/test_kernel_pq_topc.py 2>&1 | tail -8 ;;
  accuracy)
    # One process, every method, both tasks; engines compile concurrently, and the XLA
    # compilation cache goes back in $OUT/jaxcache.tar (carry it as runs/jaxcache next time).
    export JAX_COMPILATION_CACHE_DIR=$PWD/runs/jaxcache
    mkdir -p runs/jaxcache
    timeout ${ACC_TIMEOUT:-560} python3 -m experiments.cli run configs/experiments/accuracy.gin \
      "--gin.accuracy.lengths=${ACC_LENGTHS:-(1024,2048,4096,8192)}" "--gin.accuracy.examples=64" \
      "--gin.accuracy.num_slots=32" "--gin.accuracy.tasks=${ACC_TASKS:-('niah','mrcr')}" \
      "--gin.run.name='${ACC_NAME:-accuracy_gpu}'" ${ACC_EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v "example/s\]" | tail -40
    tar -C runs -cf "$OUT/jaxcache.tar" jaxcache; ls -la "$OUT" ;;
  *) echo "STEP must be kernels, pq_sweep, pq_fused, nosync or accuracy" >&2; exit 2 ;;
esac
