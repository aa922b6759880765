#!/usr/bin/env bash
# Session 46's GPU calls (device tool, carry [".whl"]); the card is printed first.
# STEP=topk (~10 s on a warm machine, its first compile included): kernel_compare's topk rows (64 x 262144, k 2048; XLA and triton_fused)
#   with fused_config's new defaults (select's f32 compare, the finish's early stop), traced
#   -> $OUT/kc/.
# (Session 46's other runs: gpu_session45.sh STEP=min, STEP=kc with KC_BUDGET_S=120, and
# STEP=p512.)
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-topk}" in
  topk)
    TAIL=12 part kc ${KC_S:-120} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin \"--gin.kernel_compare.ops=('topk',)\" \
      \"--gin.kernel_compare.topk_shapes=((64, 262144, 2048),)\" \
      \"--gin.kernel_compare.implementations=('xla', 'triton_fused')\" \
      --gin.kernel_compare.profile=True 2>&1 | grep -v ' spent$'" ;;
  *) echo "STEP=${STEP}: unknown (topk)"; exit 2 ;;
esac
