#!/usr/bin/env bash
# Session 50's GPU calls (device tool, carry [".whl"]; they ran on nvidia-h100-x1 after
# nvidia-h200 was refused five times; the card is printed first).
# STEP: one or more of the steps below, in order (e.g. STEP="kc lv").
# STEP=kc (93.6 s with KC_S=230 on the H100): kernel_compare at issue 16's target shapes only
#   (pq_topc B 64 N 131072, topk 64 x 262144 k 2048, index_scores / sparse_attention B 64,
#   hot_resolve B 64 at 5% and 0% misses), every implementation, per call batched in one
#   program, pipelined, and profiled (busy time) -> $OUT/kc/.
# STEP=lv (19.0 s warm): topk's GPU test of the default and of threshold_warps 4, then
#   launch_variants_gpu.py --set s50 (topk: the threshold launch at 4, 8 and 32 warps -- 32
#   added after the run --, select blocks of 8192, the floor hint), 3 interleaved rounds,
#   device time from 2 profiles a variant -> $OUT/lv/.
# KC_NAME: the kc run's name (default kernel_compare_s50; gpu_session51.sh STEP=kc: _s51).
# STEP=p512 (~220 s; not run in session 50): the 512K batch-36 fp8 decode profile (as
#   gpu_session49.sh STEP=p512) -> $OUT/p512/.
source "$(dirname "$0")/gpu_lib.sh"
for step in ${STEP:-kc}; do
case "$step" in
  kc)
    TAIL=40 part kc ${KC_S:-330} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin --gin.kernel_compare.batches='(64,)' \
      --gin.kernel_compare.histories='(131072,)' \
      \"--gin.kernel_compare.topk_shapes=((64, 262144, 2048),)\" \
      --gin.kernel_compare.profile=True --gin.run.name=\"'${KC_NAME:-kernel_compare_s50}'\" \
      2>&1 | grep -v ' spent$'" ;;
  lv)
    TAIL=6 part gputests ${TESTS_S:-90} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_topk.py -k 'thr_warps4 or (test_fused_on_gpu and default)'"
    LV_ARGS="--busy 2" variants lv s50 ${LV_ROUNDS:-3} ${LV_S:-150} ;;
  p512) PROFILE_GIN=$FP8_GIN profile p512 524288 36 ${PROFILE_S:-210} ;;
  *) echo "STEP=${step}: unknown (kc | lv | p512)"; exit 2 ;;
esac
done
