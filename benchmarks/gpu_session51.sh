#!/usr/bin/env bash
# Session 51's GPU calls (device tool, carry [".whl"]; the card is printed first).
# STEP: one or more of the steps below, in order (e.g. STEP="gt lv kc").
# STEP=gt: the GPU tests of sparse_attention's in-kernel combine (fused_combine; bf16 and FP8
#   rows, 2 and 64 requests, 3 calls each) and of the V4-shape kernel -> the log only.
# STEP=lv: launch_variants_gpu.py --set s51 (sparse_attention bf16 / FP8 rows: fused_combine
#   against the XLA combine; topk: the threshold launch at 32 warps), 3 interleaved rounds,
#   device time from 2 profiles a variant -> $OUT/lv/ (LV_OPS: a comma list of the set's ops,
#   default all; session 52 added 4 and 5 splits to the set).
# STEP=kc: kernel_compare at issue 16's target shapes, profiled and pipelined, as
#   gpu_session50.sh STEP=kc, named kernel_compare_s51 -> $OUT/kc/.
source "$(dirname "$0")/gpu_lib.sh"
for step in ${STEP:-gt lv}; do
case "$step" in
  gt)
    TAIL=6 part gputests ${TESTS_S:-150} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_sparse_attention.py -k 'fused or v4_shape_matches'" ;;
  lv) LV_ARGS="--busy 2 ${LV_OPS:+--ops $LV_OPS}" variants lv s51 ${LV_ROUNDS:-3} ${LV_S:-200} ;;
  kc) (STEP=kc KC_NAME=kernel_compare_s51 bash "$(dirname "$0")/gpu_session50.sh") ;;
  *) echo "STEP=${step}: unknown (gt | lv | kc)"; exit 2 ;;
esac
done
