#!/usr/bin/env bash
# The GPU calls of session 4 (issues 12, 13, 16), one device call each:
#   STEP=check   GPU tests of the refactored engine and the changed kernels (hisparse ==
#                resident with the Triton kernels, hot_resolve's narrow-leaf copy, topk and
#                pq_topc without host syncs) + the topk/pq_topc no-sync benchmark + where a
#                128K prefill chunk's GPU time goes (benchmarks/prefill_profile_gpu.py)
#   STEP=scale   experiments/scale.py at V4 shapes (4-layer slice), SCALE_CONTEXTS (default
#                32K), batches 1 and 8, Triton kernels; traces of SCALE_PROFILE cells
# Use through the device tool: carry [".whl"], command "STEP=check bash benchmarks/gpu_session4.sh".
# The no-sync benchmark's "old" variants read the 78be51b kernels: where the GPU checkout has no
# git history, first export them here (ignored folder, name it in carry too):
#   mkdir -p .baseline && for f in topk pq_topc; do git show 78be51b:pallas_kernels/$f/triton.py \
#     > .baseline/pallas_kernels_${f}_triton.py; done
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
export LSPARSE_RUNS=$OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
case "${STEP:-check}" in
  check)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hierarchy.py \
      tests/test_kernel_hot_resolve.py tests/test_kernel_topk.py tests/test_kernel_pq_topc.py \
      tests/test_kernel_topk_nosync.py \
      2>&1 | tail -15
    timeout 200 python3 benchmarks/topk_nosync_gpu.py --out "$OUT" \
      $( [ -d .baseline ] && echo --baseline-dir .baseline ) 2>&1 | tail -25
    timeout 150 python3 benchmarks/prefill_profile_gpu.py --context 131072 --out "$OUT" \
      2>&1 | tail -24 ;;
  scale)  # resumes from the committed results/scale/results.json
    mkdir -p "$OUT/scale" && cp results/scale/results.json "$OUT/scale/" 2>/dev/null
    timeout 560 python3 -m experiments.cli run configs/experiments/scale.gin \
      "--gin.scale.implementation='triton'" "--gin.scale.contexts=${SCALE_CONTEXTS:-(32768,)}" \
      "--gin.scale.profile=${SCALE_PROFILE:-()}" 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|tok/s\]" \
      | tail -30 ;;
  scale2)  # a fresh scale run (SCALE_NAME) after the writeback change + the prefill profile
    timeout 400 python3 -m experiments.cli run configs/experiments/scale.gin \
      "--gin.scale.implementation='triton'" "--gin.scale.contexts=${SCALE_CONTEXTS:-(32768,)}" \
      "--gin.scale.batches=${SCALE_BATCHES:-(8,)}" "--gin.run.name='${SCALE_NAME:-scale_v2}'" \
      2>&1 | tr '\r' '\n' | grep -v "it/s\]\|tok/s\]" | tail -12
    timeout 120 python3 benchmarks/prefill_profile_gpu.py --context 131072 --out "$OUT" \
      2>&1 | tail -16 ;;
esac
ls -la "$OUT" "$OUT"/* 2>/dev/null | head -30
