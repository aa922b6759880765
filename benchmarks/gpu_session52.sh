#!/usr/bin/env bash
# Session 52's GPU calls (device tool, carry [".whl"]; the card is printed first).
# STEP: one or more of the steps below, in order (e.g. STEP="gt kcd").
# STEP=gt, STEP=lv: gpu_session51.sh's (the in-kernel combine's GPU tests; launch_variants_gpu.py
#   --set s51, LV_OPS a comma list of its ops, default all) -> the log, $OUT/lv/.
# STEP=kcd: kernel_compare's default configuration (every op, shape and implementation, issue
#   16 item 5), run name kernel_compare, under a budget of KCD_S - 30 s -> $OUT/kcd/.
source "$(dirname "$0")/gpu_lib.sh"
for step in ${STEP:-gt kcd}; do
case "$step" in
  gt|lv) (STEP=$step bash "$(dirname "$0")/gpu_session51.sh") ;;
  kcd)
    TAIL=60 part kcd ${KCD_S:-360} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin --gin.kernel_compare.budget_s=$(( ${KCD_S:-360} - 30 )) \
      --gin.run.name=\"'kernel_compare'\" 2>&1 | grep -v ' spent$'" ;;
  *) echo "STEP=${step}: unknown (gt | lv | kcd)"; exit 2 ;;
esac
done
