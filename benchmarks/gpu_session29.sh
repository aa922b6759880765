#!/usr/bin/env bash
# What session 28 left for the next GPU calls (device tool, carry [".whl"]); everything under
# $OUT comes back in one tar.
# STEP=check (default; ~330 s, one call):
#   1. the decode step at 128K, batch 1 and 8, HiSparse and LeanSparse's FP8 jax-triton coarse
#      pass, profiled (decode_profile_gpu.py): does the compressor's optimization barrier
#      (session 28) remove the two concatenate fusions that took 3.5 of HiSparse's 6.9 ms at
#      batch 1 (results/decode_profile_b1_b8/); does the one-program launch
#      (steps.launch_step) close the 1.5-1.9 ms the device idled at each step's start at
#      batch 8 waiting for the host's dispatches; and where does LeanSparse's extra time at
#      small batches go (512K: 1.12x HiSparse at batch 1, 1.07x at batch 8);
#   2. pq_topc's GPU tests with "smem_lanes" now the jax-triton default (the fp8 test over
#      both lowerings: the new default and the swizzled book);
#   3. kernel_compare of the whole pq_topc op at B 64, N 131072 with the new default beside
#      the swizzled book (session 28: 1.095 ms with the swizzled book; target 0.5).
# STEP=scale512 / scale1m: batches 1 and 8 at 512K / 1M after the fix
#   (configs/experiments/scale_small_batch{,_1m}.gin; results under $OUT/<run>/).
# Session 29, after hot_resolve lost its M x M victim ranking (row-order victims) and its radix
# select its steps over bits the stamps do not span:
# STEP=resolve (~330 s, one call): benchmarks/hot_resolve_phases_gpu.py (per-kernel times at
#   issue 16's target shape, HiSparse batch 1 and LeanSparse's key cache at batch 1 / 64),
#   hot_resolve's GPU tests, and the batch-1 / batch-8 decode profiles again (profile b1/b8).
# STEP=scale_all (~450 s, one call): scale512, scale1m, then 1M at batch 64 in the same run
#   (resumed from the machine's copy of the batch-1/8 cells).
source "$(dirname "$0")/gpu_lib.sh"
profile() {  # profile NAME BATCH: decode_profile at 128K for HiSparse and leansparse_fp8_jt
  TAIL=40 part "$1" 150 "python3 benchmarks/decode_profile_gpu.py \
    --methods hisparse,leansparse_fp8_jt --context 131072 --batch $2 \
    --gin \"model_preset.matmul_precision='bf16'\" --prefill-cache /tmp/lsparse_scale_prefill \
    --out \$OUT --budget-s 140"
}
case "${STEP:-check}" in
  check)
    profile b1 1
    profile b8 8
    part tests 120 "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kernel_pq_topc.py -k 'jax_triton or fp8'"
    TAIL=12 part kc_pq 80 "python3 -m experiments.cli run configs/experiments/kernel_compare.gin \
      \"--gin.kernel_compare.ops=('pq_topc',)\" \"--gin.kernel_compare.batches=(64,)\" \
      \"--gin.kernel_compare.histories=(131072,)\" \
      \"--gin.kernel_compare.implementations=('jax_triton','jax_triton_smem')\" \
      --gin.kernel_compare.budget_s=60 \"--gin.run.name='kernel_compare_pq_lanes'\""
    pack session29_check ;;
  resolve)
    TAIL=30 part phases 200 "python3 benchmarks/hot_resolve_phases_gpu.py --out \$OUT"
    part tests 90 "python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_hot_resolve.py"
    profile b1 1
    profile b8 8
    pack session29_resolve ;;
  scale_all)
    RUN=scale_small_batch STEP=scale bash "$(dirname "$0")/gpu_scale_batch.sh"
    RUN=scale_small_batch_1m STEP=scale bash "$(dirname "$0")/gpu_scale_batch.sh"
    RUN=scale_small_batch_1m SCALE_BUDGET=240 SCALE_ARGS="--gin.scale.batches=(64,)" \
      STEP=scale bash "$(dirname "$0")/gpu_scale_batch.sh" ;;
  scale512) RUN=scale_small_batch STEP=scale bash "$(dirname "$0")/gpu_scale_batch.sh" ;;
  scale1m) RUN=scale_small_batch_1m STEP=scale bash "$(dirname "$0")/gpu_scale_batch.sh" ;;
  *) echo "STEP=${STEP}: unknown (check | scale512 | scale1m | resolve | scale_all)"; exit 2 ;;
esac
