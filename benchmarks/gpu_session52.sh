#!/usr/bin/env bash
# Session 52's GPU calls (device tool, carry [".whl"]; the card is printed first).
# STEP: one or more of the steps below, in order (e.g. STEP="gt kcd").
# STEP=gt: the GPU tests of sparse_attention's in-kernel combine (fused_combine; bf16 and FP8
#   rows, 2 and 64 requests, 3 calls each) and of the V4-shape kernel -> the log only.
# STEP=kcd: kernel_compare's default configuration (every op, shape and implementation, issue
#   16 item 5), run name kernel_compare, under a budget of KCD_S - 30 s -> $OUT/kcd/.
# STEP=lv: launch_variants_gpu.py --set s51 (sparse_attention bf16 / FP8 rows: fused_combine at
#   2, 4 and 5 splits against the XLA combine; topk: the threshold launch at 32 warps), 3
#   interleaved rounds, device time from 2 profiles a variant -> $OUT/lv/ (LV_OPS: a comma list
#   of the set's ops, default all).
source "$(dirname "$0")/gpu_lib.sh"
for step in ${STEP:-gt kcd}; do
case "$step" in
  gt)
    TAIL=6 part gputests ${TESTS_S:-150} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_sparse_attention.py -k 'fused or v4_shape_matches'" ;;
  kcd)
    TAIL=60 part kcd ${KCD_S:-360} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin --gin.kernel_compare.budget_s=$(( ${KCD_S:-360} - 30 )) \
      --gin.run.name=\"'kernel_compare'\" 2>&1 | grep -v ' spent$'" ;;
  lv) LV_ARGS="--busy 2 ${LV_OPS:+--ops $LV_OPS}" variants lv s51 ${LV_ROUNDS:-3} ${LV_S:-200} ;;
  *) echo "STEP=${step}: unknown (gt | kcd | lv)"; exit 2 ;;
esac
done
